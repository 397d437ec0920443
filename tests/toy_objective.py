"""train.py with an objective the repo does not ship, added as a new one is: this file and one registry line. The
toy: the next-token loss plus PaLM's z-loss (1e-4 x log(Z)^2 a token, Z each position's softmax normalizer), its
mean log(Z) in the progress line and metrics, and a record in each checkpoint. Run as train.py is."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train
from data.token_data import IGNORE
from training.objectives import OBJECTIVES
from training.objectives.next_token import NextToken
from training.steps import lm_loss

Z_WEIGHT = 1e-4


class ZLoss(NextToken):
    name = "toy_z"

    def __init__(self):
        super().__init__()
        self.log_z, self.tokens = 0.0, 0

    def describe(self) -> str:
        return f"objective: toy_z (next-token, z-loss weight {Z_WEIGHT:g})"

    def step_loss(self, micro_batches: list, driver):
        def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            log_z = torch.logsumexp(logits.float(), dim=-1)[targets != IGNORE]
            self.log_z, self.tokens = self.log_z + log_z.detach().sum(), self.tokens + log_z.numel()
            return lm_loss(logits, targets) + Z_WEIGHT * (log_z ** 2).mean()
        return loss

    def progress(self, driver) -> tuple[dict, str]:
        mean = float(self.log_z) / max(self.tokens, 1)
        self.log_z, self.tokens = 0.0, 0
        return {"toy_log_z": mean}, f" | log Z {mean:.3f}"

    def record(self) -> dict:
        return {"toy": "z-loss"}


def build(name, cfg, data, layout, init_from, saved) -> ZLoss:
    return ZLoss()


OBJECTIVES["toy_z"] = build  # the registry line (training/objectives/__init__.py, for one the repo ships)

if __name__ == "__main__":
    train.run_rank(train.main)
