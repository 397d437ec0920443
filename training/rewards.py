"""The rewards of online RL (rl.reward): a Python function called with a prompt's record (data/prompts.py) and an
answer's text, returning a number; `exact_match`, built in, gives 1 where the answer, stripped, is the record's
"answer" (the reverse-the-words task's: data/reverse_task.py), else 0.

    rl.reward=exact_match
    rl.reward=my_rewards:length_penalty        # def length_penalty(record: dict, completion: str) -> float

A function that raises, or returns something that is not a finite number, stops the run naming the prompt's file
and line. The function is imported and tried on the first training prompt at start, so a typo stops the run there.

With rl.reward_model=EXPORT (a reward model: train.objective=reward, then python -m scripts.export) the reward is
instead its score of the prompt and the answer, rendered as its preference pairs were (training/reward_model.py),
each rank scoring its own answers in batches.
"""
import importlib
import math
from typing import Callable

from common.checks import ConfigError


def exact_match(record: dict, completion: str) -> float:
    if "answer" not in record:
        raise KeyError("the record has no \"answer\" for exact_match to compare with")
    return float(completion.strip() == str(record["answer"]).strip())


BUILT_IN = {"exact_match": exact_match}


class Reward:
    """rl.reward's function, called on (a prompt's {"where", "record"}, an answer's text)."""

    def __init__(self, spec: str):
        self.spec, self.function = spec, _function(spec)

    def many(self, prompts: list[dict], completions: list[str]) -> list[float]:
        return [self(prompt, completion) for prompt, completion in zip(prompts, completions)]

    def to(self, device) -> "Reward":
        return self

    def __call__(self, prompt: dict, completion: str) -> float:
        try:
            value = self.function(prompt["record"], completion)
        except Exception as e:  # the user's code: whatever it raises is named with the prompt it failed on
            raise ConfigError(f"rl.reward={self.spec} raised {type(e).__name__}: {e} on the prompt {prompt['where']}; "
                              f"fix: the function, or the record") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"rl.reward={self.spec} returned {value!r} on the prompt {prompt['where']}: a reward is "
                              f"a finite number; fix: the function")
        return float(value)


def _function(spec: str) -> Callable:
    if spec in BUILT_IN:
        return BUILT_IN[spec]
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ConfigError(f"rl.reward={spec}: not {', '.join(BUILT_IN)} nor module:function; fix: name a built-in, or "
                          f"a function importable from the repo's root, e.g. rl.reward=my_rewards:score")
    try:
        function = getattr(importlib.import_module(module), name)
    except ImportError as e:
        raise ConfigError(f"rl.reward={spec}: module {module} does not import ({e}); fix: put it on the path (the "
                          f"repo's root, or PYTHONPATH)") from None
    except AttributeError:
        raise ConfigError(f"rl.reward={spec}: module {module} has no {name}; fix: name a function it defines"
                          ) from None
    if not callable(function):
        raise ConfigError(f"rl.reward={spec}: {name} is not a function; fix: name one, called with (record, "
                          f"completion)")
    return function


class ModelReward(Reward):
    """rl.reward_model's score of each (prompt, answer), read from its export at start (on the CPU; `to` moves it)."""

    def __init__(self, folder: str):
        from training.reward_model import load_reward_model  # the checkpoint code imports the objectives' registry
        self.spec, self.model = f"the reward model {folder}", load_reward_model(folder)

    def to(self, device) -> "ModelReward":
        self.model.model.to(device)
        self.model.device = device
        return self

    def many(self, prompts: list[dict], completions: list[str]) -> list[float]:
        sequences = []
        for prompt, completion in zip(prompts, completions):
            asked = prompt["record"]["prompt"]
            answer = [{"role": "assistant", "content": completion}] if isinstance(asked, list) else completion
            try:
                sequences.append(self.model.encode(asked, answer)[-self.model.block_size:])
            except ValueError as e:
                raise ConfigError(f"rl.reward_model: {e} (the prompt {prompt['where']}); fix: a reward model of the "
                                  f"prompts' kind") from None
        return self.model.score(sequences).tolist()

    def __call__(self, prompt: dict, completion: str) -> float:
        return self.many([prompt], [completion])[0]
