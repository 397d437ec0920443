"""Batches of a prompt dataset (data/prepare_prompts.py) for online RL: each micro-batch holds the prompts whose
answers the objective samples (training/objectives/rl.py), `rows // group_size` of them, as (their ids, their
records); the objective turns them into rows of prompt and answer.

Each epoch visits the train prompts in its own order, drawn from (seed, epoch): the prompts of a step are a pure
function of (seed, step), so resuming is exact and layouts of one global batch sample the same prompts each step.
With rl.epochs = k a batch of prompts serves k steps (its rollouts are trained on k times). Evaluation answers the
first train.eval_windows prompts of each split.
"""
import json
import math
import os

import numpy as np

from common.checks import ConfigError
from data.prepare_prompts import RECORDS
from data.token_data import TokenData
from data.writer import read_index


class PromptSplit:
    """One split's prompts: their ids (read once: prompt sets are small next to corpora) and their records."""

    def __init__(self, data_dir: str, split: str, dtype: np.dtype):
        index = read_index(data_dir, split)
        tokens = np.fromfile(os.path.join(data_dir, f"{split}.bin"), dtype=dtype).astype(np.int64)
        self.ids = [tokens[a:b].tolist() for a, b in zip(index[:-1], index[1:])]
        path = os.path.join(data_dir, RECORDS.format(split=split))
        try:
            with open(path, encoding="utf-8") as f:
                self.records = [json.loads(line) for line in f]
        except (OSError, ValueError) as e:
            raise ConfigError(f"{path} does not read ({type(e).__name__}: {e}); prepare the prompts again with "
                              f"python -m data.prepare --format prompts") from None
        if len(self.records) != len(self.ids):
            raise ConfigError(f"{path} holds {len(self.records):,} records for {len(self.ids):,} prompts: the dataset "
                              f"is half-written; prepare the prompts again with python -m data.prepare --format "
                              f"prompts")

    def batch(self, indices) -> tuple[list[list[int]], list[dict]]:
        return [self.ids[i] for i in indices], [self.records[i] for i in indices]


class PromptData(TokenData):
    """A prompt dataset as the training loop reads data (TokenData's interface)."""
    KIND = "prompts"
    OBJECTIVE = "grpo"

    def __init__(self, data_dir: str, tokenizer: str | None, block_size: int):
        super().__init__(data_dir, tokenizer, block_size)
        self.longest = self.meta["prompts"]["longest"]
        dtype = self.datasets[0].dtype
        self.splits = {s: PromptSplit(data_dir, s, dtype) for s in ("train", "val")}
        self.prompts = {s: len(split.ids) for s, split in self.splits.items()}
        self.group_size, self.steps_per_batch = 1, 1
        self._orders = {}

    def sample_groups(self, group_size: int, steps_per_batch: int) -> None:
        """How the objective samples: `group_size` rows (answers) a prompt, a batch of prompts every
        `steps_per_batch` steps."""
        self.group_size, self.steps_per_batch = group_size, steps_per_batch

    @property
    def positions(self) -> bool:
        return False

    def step_batches(self, seed: int, step: int, dp_rank: int, layout, device) -> list:
        """The rank's micro-batches of prompts of a step: (ids, records) of micro_batch / group_size prompts each, a
        record {"where", "record", "sample": the prompt's index in the run's sequence of prompts}."""
        per_micro = layout.micro_batch // self.group_size
        batch = (step - 1) // self.steps_per_batch
        first = batch * layout.global_batch // self.group_size + dp_rank * layout.grad_accum * per_micro
        order = np.arange(first, first + layout.grad_accum * per_micro, dtype=np.int64)
        epoch, position = np.divmod(order, self.prompts["train"])
        picked = np.array([self._order(seed, int(e))[p] for e, p in zip(epoch, position)], dtype=np.int64)
        batches = []
        for m in range(layout.grad_accum):
            part = slice(m * per_micro, (m + 1) * per_micro)
            ids, records = self.splits["train"].batch(picked[part])
            # the prompt's place in the run: its answers' draws are seeded by it, the same in any layout
            batches.append((ids, [{**r, "sample": int(k)} for r, k in zip(records, order[part])]))
        return batches

    def _order(self, seed: int, epoch: int) -> np.ndarray:
        if (seed, epoch) not in self._orders:
            self._orders = {k: v for k, v in self._orders.items() if k[0] == seed and k[1] >= epoch - 1}
            self._orders[seed, epoch] = np.random.default_rng([seed, epoch]).permutation(self.prompts["train"])
        return self._orders[seed, epoch]

    def eval_prompts(self, split: str, count: int) -> tuple[list[list[int]], list[dict]]:
        """The first `count` prompts of `split` (all of them if it holds fewer): (ids, records)."""
        return self.splits[split].batch(range(min(count, self.prompts[split])))

    def epochs_used(self, samples: int) -> dict:
        prompts = samples / (self.group_size * self.steps_per_batch)
        return {f"epochs_{self.names[0]}": round(prompts / self.prompts["train"], 6)}

    def steps_for_epochs(self, epochs: float, global_batch: int) -> int:
        prompts_per_step = global_batch / (self.group_size * self.steps_per_batch)
        return max(1, math.ceil(epochs * self.prompts["train"] / prompts_per_step))
