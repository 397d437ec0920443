"""An observer of online RL's steps, for tests/test_rl.py: given to the ranks tests/ranks.py forks when
MEGALITE_RL_CHECK is in their environment. Before each step it reads the rows the objective made of the step's
prompts and checks them against what it computes itself: each row is its prompt (the data's, a pure function of
the step) followed by its answer, the loss's targets the answer's tokens only; each row's advantage is its group's
(rl_rewards.length of the decoded answers, training/objectives/policy_loss.py advantages); at a step that samples
(rl.epochs > 1), the rollouts' policy's log-probabilities are the model's before the step. A mismatch raises, and
the run fails."""
import functools

import torch

import train
from data.token_data import IGNORE
from rl_rewards import length
from training.objectives.policy_loss import advantages, token_logps
from training.observers import Observer


class RolloutCheck(Observer):
    def before_training(self, run, rank) -> None:
        self.run = run

    def before_step(self, step: int, driver, micro_batches: list) -> None:
        run = self.run
        cfg, objective = run.cfg, run.objective
        group, stops = cfg.rl.group_size, objective.sampling.stop_ids
        prompts = run.data.step_batches(cfg.train.seed, step, 0, run.layout, run.device)
        samples = (step - 1) % cfg.rl.epochs == 0
        for (prompt_ids, records), (inputs, (targets, advantage, old, _, _)) in zip(prompts, micro_batches):
            rewards = []
            for row, (ids, target) in enumerate(zip(inputs.tolist(), targets.tolist())):
                prompt = prompt_ids[row // group]
                start = len(prompt) - 1
                answer = [t for t in target if t != IGNORE]
                assert ids[:len(prompt)] == prompt, f"step {step} row {row}: not its prompt"
                assert target[:start] == [IGNORE] * start, f"step {step} row {row}: the prompt's tokens in the loss"
                assert target[start:start + len(answer)] == answer, f"step {step} row {row}: the answer is not whole"
                assert ids[len(prompt):start + len(answer)] == answer[:-1], f"step {step} row {row}: not its answer"
                text = answer[:-1] if answer[-1] in stops else answer
                rewards.append(length(records[row // group]["record"], run.tokenizer.decode(text)))
            expected = advantages(torch.tensor(rewards, dtype=torch.float64), group, objective.name,
                                  cfg.rl.scale_rewards).float()
            assert torch.allclose(advantage, expected, atol=1e-6), f"step {step}: advantages {advantage} != {expected}"
            if samples and cfg.rl.epochs > 1:
                with torch.no_grad():
                    driver.engine.eval()
                    now = token_logps(driver.engine(inputs), targets, cfg.model.vocab_size, cfg.rl.temperature)
                    driver.engine.train()
                assert torch.allclose(old, now, atol=1e-5), f"step {step}: the rollouts' log-probabilities are stale"


def checked(main=train.main):
    return functools.partial(main, observers=[RolloutCheck()])
