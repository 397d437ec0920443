"""Batches of a conversation dataset (data/prepare_chat.py): whole conversations in every window, the loss on the
assistant's tokens only.

A conversation of n tokens gives n - 1 (input, target) pairs; a target whose mask is 0 (the prompt, the template)
is IGNORE, which the loss leaves out. With data.pack (the default) conversations are packed back to back, in
the dataset's order, into windows of block_size pairs (a conversation starts a new window when it does not fit
the current one's rest), and each token carries its position within its conversation: document masking keeps
them apart (model.document_masking must be on). Without packing a window holds one conversation. The rest of
a window is padding: input 0, target IGNORE, position 0.

The packing is fixed; each epoch visits the train windows in its own order, drawn from (seed, epoch), so a
sample is a pure function of (seed, sample index) as for text (data/token_data.py) and resuming is exact. Validation
is the first train.eval_windows windows of the val split (all of them if there are fewer).
"""
import math
import os

import numpy as np
import torch

from common.checks import ConfigError
from data.chat import check_chat_record
from data.token_data import IGNORE, TokenData, move_to_device
from data.writer import read_index


class Split:
    """One split's conversations and their packing into windows."""

    def __init__(self, data_dir: str, split: str, dtype: np.dtype, block_size: int, pack: bool):
        self.tokens_path, self.masks_path = (os.path.join(data_dir, f"{split}.{ext}") for ext in ("bin", "mask"))
        self.dtype, self.width = dtype, block_size
        self.index = read_index(data_dir, split)
        pairs = np.diff(self.index) - 1
        self.windows = _pack(pairs, block_size) if pack else [(c, c + 1) for c in range(len(pairs))]

    def rows(self, windows: np.ndarray) -> np.ndarray:
        """(len(windows), 3 x block_size) int64: inputs, targets, positions of each window."""
        T = self.width
        rows = np.zeros((len(windows), 3 * T), dtype=np.int64)
        rows[:, T:2 * T] = IGNORE
        with open(self.tokens_path, "rb") as tokens, open(self.masks_path, "rb") as masks:
            for row, w in zip(rows, windows):
                first, end = self.windows[int(w)]
                start, stop = self.index[first], self.index[end]
                ids = np.frombuffer(os.pread(tokens.fileno(), int(stop - start) * self.dtype.itemsize,
                                             int(start) * self.dtype.itemsize), dtype=self.dtype).astype(np.int64)
                mask = np.frombuffer(os.pread(masks.fileno(), int(stop - start), int(start)), dtype=np.uint8)
                at = 0
                for a, b in zip(self.index[first:end] - start, self.index[first + 1:end + 1] - start):
                    n = min(b - a - 1, T)  # prepare_chat cut conversations to its --context + 1 tokens
                    row[at:at + n] = ids[a:a + n]
                    row[T + at:T + at + n] = np.where(mask[a + 1:a + 1 + n] == 1, ids[a + 1:a + 1 + n], IGNORE)
                    row[2 * T + at:2 * T + at + n] = np.arange(n)
                    at += n
        return rows


def _pack(pairs: np.ndarray, width: int) -> list[tuple[int, int]]:
    """Next-fit: runs [first, end) of consecutive conversations whose pairs fill at most `width` positions."""
    windows, first, used = [], 0, 0
    for c, n in enumerate(np.minimum(pairs, width).tolist()):
        if used + n > width:
            windows.append((first, c))
            first, used = c, 0
        used += n
    if len(pairs):
        windows.append((first, len(pairs)))
    return windows


class ChatData(TokenData):
    """A conversation dataset as the training loop reads data (TokenData's interface)."""
    KIND = "conversations"

    def __init__(self, data_dir: str, tokenizer: str | None, block_size: int, document_masking: bool, pack: bool):
        super().__init__(data_dir, tokenizer, block_size)
        dataset = self.datasets[0]
        try:
            chat = check_chat_record(self.meta, f"{data_dir}/meta.json")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if chat["context"] > block_size:
            raise ConfigError(f"{data_dir} was prepared for a context of {chat['context']:,} tokens but "
                              f"model.block_size={block_size}: its conversations would not fit a window; prepare it "
                              f"again with --context {block_size}, or raise model.block_size")
        if pack and not document_masking:
            raise ConfigError("data.pack=true packs several conversations into a window, which then see each other "
                              "without document masking: set model.document_masking=true, or data.pack=false")
        self.pack = pack
        self.splits = {s: Split(data_dir, s, dataset.dtype, block_size, pack) for s in ("train", "val")}
        self.train_windows = len(self.splits["train"].windows)
        self._orders = {}  # (seed, epoch) -> its order of the train windows: the epochs in use only
        self._eval_rows = {}  # (split, count) -> the fixed validation windows, read once

    @property
    def positions(self) -> bool:
        return self.pack

    def _train_rows(self, seed: int, first: int, count: int) -> np.ndarray:
        epoch, position = np.divmod(np.arange(first, first + count, dtype=np.int64), self.train_windows)
        windows = np.empty(count, dtype=np.int64)
        for e in np.unique(epoch):
            windows[epoch == e] = self._order(seed, int(e))[position[epoch == e]]
        return self.splits["train"].rows(windows)

    def _order(self, seed: int, epoch: int) -> np.ndarray:
        if (seed, epoch) not in self._orders:
            self._orders = {k: v for k, v in self._orders.items() if k[0] == seed and k[1] >= epoch - 1}
            self._orders[seed, epoch] = np.random.default_rng([seed, epoch]).permutation(self.train_windows)
        return self._orders[seed, epoch]

    def eval_windows(self, split: str, count: int) -> np.ndarray:
        if (split, count) not in self._eval_rows:
            rows = self.splits[split].rows(np.arange(min(count, len(self.splits[split].windows))))
            rows.setflags(write=False)
            self._eval_rows[split, count] = rows
        return self._eval_rows[split, count]

    def eval_targets(self, split: str, count: int) -> int:
        T = self.block_size
        return int((self.eval_windows(split, count)[:, T:2 * T] != IGNORE).sum())

    def eval_batches(self, split: str, count: int, dp_rank: int, layout, device):
        rows = self.eval_windows(split, count)
        per_rank = math.ceil(len(rows) / layout.dp)
        micro_batches = math.ceil(per_rank / layout.micro_batch)
        mine = rows[dp_rank * per_rank: (dp_rank + 1) * per_rank]
        padded = np.zeros((micro_batches * layout.micro_batch, rows.shape[1]), dtype=np.int64)
        padded[:, self.block_size:2 * self.block_size] = IGNORE
        padded[:len(mine)] = mine
        for m in range(micro_batches):
            yield self._to_device(padded[m * layout.micro_batch:(m + 1) * layout.micro_batch], device)

    def _inputs(self, batch: torch.Tensor):
        T = self.block_size
        return (batch[:, :T], batch[:, 2 * T:]) if self.pack else batch[:, :T]

    def _to_device(self, rows: np.ndarray, device):
        batch = move_to_device(torch.from_numpy(rows), device)
        return self._inputs(batch), batch[:, self.block_size:2 * self.block_size]

    def epochs_used(self, samples: int) -> dict:
        return {f"epochs_{self.names[0]}": round(samples / self.train_windows, 6)}

    def steps_for_epochs(self, epochs: float, global_batch: int) -> int:
        return max(1, math.ceil(epochs * self.train_windows / global_batch))

