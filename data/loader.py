"""Batches from a prepared dataset (memory-mapped uint16 tokens).

Training windows are a pure function of (seed, step): the step's global batch is one draw of
`global_batch` window starts, and each (dp rank, micro-step) takes its own contiguous slice of it.
So every data-parallel rank sees different samples, a resumed run sees exactly the windows an
uninterrupted one would, and layouts with the same global batch (dp=1 x accum 4, dp=2 x accum 2,
micro 4 x accum 1, ...) train on the same samples each step.
"""
import json
import os

import numpy as np
import torch

from training.config import ConfigError

EVAL_SEED = 0  # validation windows are fixed across runs and seeds, so val losses compare


class TokenData:
    def __init__(self, data_dir: str, tokenizer: str, block_size: int):
        meta_path = os.path.join(data_dir, "meta.json")
        prepare = f"python -m data.prepare --tokenizer {tokenizer} --input PATH/TO/text.txt --out_dir {data_dir}"
        if not os.path.exists(meta_path):
            raise ConfigError(f"no prepared dataset in {data_dir} (meta.json missing); prepare it with: {prepare}")
        with open(meta_path) as f:
            self.meta = json.load(f)
        if self.meta.get("tokenizer") != tokenizer:
            raise ConfigError(f"{meta_path} was prepared with the {self.meta.get('tokenizer')!r} tokenizer but the "
                              f"run config asks for data.tokenizer={tokenizer!r}: point data.dir at a "
                              f"{tokenizer} dataset or set data.tokenizer={self.meta.get('tokenizer')}")
        self.block_size = block_size
        self.splits = {split: self._open(data_dir, split, prepare) for split in ("train", "val")}

    def _open(self, data_dir: str, split: str, prepare: str) -> np.memmap:
        path = os.path.join(data_dir, f"{split}.bin")
        if not os.path.exists(path) or os.path.getsize(path) == 0:
            raise ConfigError(f"{path} is missing or empty; prepare the dataset with: {prepare}")
        tokens = np.memmap(path, dtype=np.dtype(self.meta["dtype"]), mode="r")
        if len(tokens) != self.meta[f"{split}_tokens"]:
            raise ConfigError(f"{path} holds {len(tokens):,} tokens but meta.json says {self.meta[f'{split}_tokens']:,}: "
                              f"the dataset is corrupt or half-written; prepare it again with: {prepare}")
        if len(tokens) <= self.block_size + 1:
            raise ConfigError(f"model.block_size={self.block_size} needs windows of {self.block_size + 1} tokens but "
                              f"{path} holds only {len(tokens):,}: use a smaller block_size or more text")
        return tokens

    def check_vocab(self, vocab_size: int) -> None:
        if self.meta["max_token_id"] >= vocab_size:
            raise ConfigError(f"the dataset has token ids up to {self.meta['max_token_id']} but model.vocab_size="
                              f"{vocab_size}: set model.vocab_size to at least {self.meta['max_token_id'] + 1} "
                              f"(or null to take {self.meta['vocab_size']} from meta.json)")

    def _windows(self, split: str, starts: np.ndarray, device: torch.device):
        tokens = self.splits[split]
        rows = np.stack([tokens[s: s + self.block_size + 1] for s in starts]).astype(np.int64)
        batch = torch.from_numpy(rows)
        if device.type == "cuda":
            batch = batch.pin_memory().to(device, non_blocking=True)
        return batch[:, :-1], batch[:, 1:]

    def _starts(self, split: str, seed, count: int) -> np.ndarray:
        high = len(self.splits[split]) - self.block_size  # last start leaves block_size + 1 tokens
        return np.random.default_rng(seed).integers(0, high, size=count)

    def train_batch(self, seed: int, step: int, micro_step: int, dp_rank: int, layout, device):
        """(inputs, targets) for one micro-batch of one rank; a pure function of its arguments."""
        starts = self._starts("train", [seed, step], layout.global_batch)
        first = (dp_rank * layout.grad_accum + micro_step) * layout.micro_batch
        return self._windows("train", starts[first: first + layout.micro_batch], device)

    def eval_batches(self, split: str, iters: int, dp_rank: int, layout, device):
        """This rank's share of a fixed set of `iters x micro x dp` windows of `split`."""
        per_iter = layout.micro_batch * layout.dp
        starts = self._starts(split, [EVAL_SEED], iters * per_iter)
        for i in range(iters):
            first = i * per_iter + dp_rank * layout.micro_batch
            yield self._windows(split, starts[first: first + layout.micro_batch], device)
