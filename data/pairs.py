"""Batches of a preference dataset (data/prepare_preference.py): each pair's two rows, the chosen answer's then
the rejected one's, side by side in one micro-batch of one data-parallel rank, whatever the layout.

A row is one sequence, the prompt and an answer, padded to the window (input 0, target IGNORE): the loss is
the row's, summed over its answer's targets. Its labels are (targets, pair_info): pair_info's two columns are
the reference's log-probability of the answer (training/objectives/reference.py fills it in before training; 0
until then, and for a loss without a reference) and the answer's count of target tokens. Each epoch visits the
train pairs in its own order, drawn from (seed, epoch): a sample is a pure function of (seed, sample index), so
resuming is exact and layouts of one global batch see the same pairs each step. Validation is the first
train.eval_windows rows (an even number) of each split.
"""
import math

import numpy as np
import torch

from common.checks import ConfigError
from data.conversations import Split
from data.token_data import IGNORE, TokenData, move_to_device


class PairData(TokenData):
    """A preference dataset as the training loop reads data (TokenData's interface)."""
    KIND = "preference"
    OBJECTIVE = "dpo"

    def __init__(self, data_dir: str, tokenizer: str | None, block_size: int):
        super().__init__(data_dir, tokenizer, block_size)
        record = self.meta["preference"]
        if record["context"] > block_size:
            raise ConfigError(f"{data_dir} was prepared for a context of {record['context']:,} tokens but "
                              f"model.block_size={block_size}: its pairs would not fit a window; prepare it again "
                              f"with --context {block_size}, or raise model.block_size")
        dtype = self.datasets[0].dtype
        self.splits = {s: Split(data_dir, s, dtype, block_size, pack=False) for s in ("train", "val")}
        self.pairs = {s: len(split.windows) // 2 for s, split in self.splits.items()}
        self.reference = {s: np.zeros(2 * n) for s, n in self.pairs.items()}
        self._orders = {}

    def check_micro_batch(self, micro_batch: int) -> None:
        if micro_batch % 2:
            raise ConfigError(f"the micro-batch of {micro_batch} rows splits a preference pair (two rows, the chosen "
                              f"and the rejected answer, which one micro-batch holds together): set an even "
                              f"train_micro_batch_size_per_gpu")

    def set_reference(self, split: str, logps: np.ndarray) -> None:
        """The reference's summed log-probability of each row of `split` (training/objectives/reference.py)."""
        self.reference[split] = np.asarray(logps, dtype=np.float64)

    def _pair_info(self, split: str, rows: np.ndarray, windows: np.ndarray) -> np.ndarray:
        T = self.block_size
        counts = (rows[:, T:2 * T] != IGNORE).sum(axis=1)
        return np.stack([self.reference[split][windows], counts.astype(np.float64)], axis=1)

    def _train_rows(self, seed: int, first: int, count: int):
        pair, side = np.divmod(np.arange(first, first + count, dtype=np.int64), 2)
        epoch, position = np.divmod(pair, self.pairs["train"])
        windows = np.empty(count, dtype=np.int64)
        for e in np.unique(epoch):
            windows[epoch == e] = 2 * self._order(seed, int(e))[position[epoch == e]] + side[epoch == e]
        rows = self.splits["train"].rows(windows)
        return rows, self._pair_info("train", rows, windows)

    def _order(self, seed: int, epoch: int) -> np.ndarray:
        if (seed, epoch) not in self._orders:
            self._orders = {k: v for k, v in self._orders.items() if k[0] == seed and k[1] >= epoch - 1}
            self._orders[seed, epoch] = np.random.default_rng([seed, epoch]).permutation(self.pairs["train"])
        return self._orders[seed, epoch]

    def _to_device(self, rows_and_info, device):
        rows, info = rows_and_info
        T = self.block_size
        batch = move_to_device(torch.from_numpy(rows[:, :2 * T].copy()), device)
        return batch[:, :T], (batch[:, T:], move_to_device(torch.from_numpy(info), device))

    @property
    def positions(self) -> bool:
        return False

    def eval_rows(self, split: str, count: int) -> int:
        """Rows of the validation set of `split`: `count` at most, whole pairs."""
        return min(count - count % 2, 2 * self.pairs[split])

    def eval_windows(self, split: str, count: int) -> np.ndarray:
        return self.splits[split].rows(np.arange(self.eval_rows(split, count)))

    def eval_pair_info(self, split: str, count: int) -> np.ndarray:
        """pair_info of the validation set's rows, in order."""
        n = self.eval_rows(split, count)
        return self._pair_info(split, self.eval_windows(split, count), np.arange(n))

    def scoring_batches(self, split: str, rows: int, dp_rank: int, layout, device):
        """This rank's share of the first `rows` rows of `split`, in micro-batches of the training shape (padded
        with IGNORE rows), as (inputs, targets): what the reference and evaluation score."""
        T = self.block_size
        per_rank = math.ceil(rows / layout.dp)
        mine = np.arange(dp_rank * per_rank, min((dp_rank + 1) * per_rank, rows))
        micro_batches = max(1, math.ceil(per_rank / layout.micro_batch))
        padded = np.zeros((micro_batches * layout.micro_batch, 2 * T), dtype=np.int64)
        padded[:, T:] = IGNORE
        padded[:len(mine)] = self.splits[split].rows(mine)[:, :2 * T]
        for m in range(micro_batches):
            batch = move_to_device(torch.from_numpy(padded[m * layout.micro_batch:(m + 1) * layout.micro_batch]),
                                   device)
            yield batch[:, :T], batch[:, T:]

    def epochs_used(self, samples: int) -> dict:
        return {f"epochs_{self.names[0]}": round(samples / (2 * self.pairs["train"]), 6)}

    def steps_for_epochs(self, epochs: float, global_batch: int) -> int:
        return max(1, math.ceil(epochs * 2 * self.pairs["train"] / global_batch))
