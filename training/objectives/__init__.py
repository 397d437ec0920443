"""The objectives a run trains with, by `train.objective`: what each does differently is one object
(training/objectives/base.py Objective), built here from the run's settings and data, and the loop calls only
that interface.

Adding one: a module with a subclass of Objective and a `build(name, cfg, data, layout, init_from, saved)` that
returns it (raising common.checks.ConfigError for data or settings it cannot train on), and its name here. A
dataset names the objective it trains with by default (`OBJECTIVE`: text and conversations next-token, pairs DPO,
prompts GRPO).
"""
from common.checks import ConfigError
from training.objectives import next_token, preference, reward, rl
from training.objectives.base import Objective

# train.objective -> its builder
OBJECTIVES = {
    "next_token": next_token.build,
    **{kind: preference.build for kind in preference.KINDS},
    "reward": reward.build,
    **{kind: rl.build for kind in rl.KINDS},
}
# What each model.head is, for the refusal of an objective that trains the other.
HEAD_WORDS = {"lm": "a language model's LM head", "score": "a reward model's score head"}


def choose_objective(cfg, data, layout, init_from: str | None, saved: dict | None) -> Objective:
    """The objective of train.objective, else the data's own, built and checked before any process group.
    `saved`: the run state of the checkpoint a resumed run continues (None for a fresh run)."""
    name = cfg.train.objective or data.OBJECTIVE
    if name not in OBJECTIVES:
        raise ConfigError(f"train.objective={name!r}: must be null (the data's) or one of {', '.join(OBJECTIVES)}; "
                          f"fix: set train.objective to one of them")
    objective = OBJECTIVES[name](name, cfg, data, layout, init_from, saved)
    if objective.head != cfg.model.head:
        raise ConfigError(f"train.objective={name} trains {HEAD_WORDS[objective.head]}, but model.head="
                          f"{cfg.model.head}; fix: set model.head={objective.head}" +
                          (", or train.objective=reward" if cfg.model.head == "score" else ""))
    return objective
