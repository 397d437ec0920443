"""Batches of text: one prepared dataset (data.dir) or a weighted blend of several (data.sources).

Training samples are a pure function of (seed, global sample index) (data/sampler.py), and a step's
global batch is the samples step x global_batch ... + global_batch - 1: each (dp rank, micro-step) takes
its own contiguous slice. So every data-parallel rank sees different samples, a resumed run sees exactly
the windows an uninterrupted one would, and layouts with the same global batch (dp=1 x accum 4, dp=2 x
accum 2, micro 4 x accum 1, ...) train on the same samples each step.

Validation is a fixed set of `train.eval_windows` windows per split, whatever the layout: each rank takes
its contiguous share, in micro-batches of the training shape (pipelines need one shape); the last ones are
padded with rows whose targets are IGNORE, which the loss leaves out (training/steps.py `eval_loss`). So
every layout evaluates the same windows and reports the same mean, up to fp32 rounding.

Under document masking (model.document_masking, on data with a document delimiter) a batch's inputs are
(token ids, each token's position within its document): data/documents.py.

Tokens are read with pread, not a long-lived memmap, so the process's resident memory does not grow
with the steps (nanoGPT #287).
"""
import hashlib
import math
import os

import numpy as np
import torch

from common.checks import REPO_ROOT, ConfigError, place, read_elsewhere, read_from, tool_command
from data.documents import Documents
from data.meta import read_meta
from data.sampler import Blend, Epochs
from data.tokenizers import TokenizerError, tokenizer_from_meta

# What the loader reads from meta.json, beside what every reader needs (check_meta).
LOADER_KEYS = ("dtype", "train_tokens", "val_tokens", "max_token_id", "tokenizer_fingerprint")
EVAL_SEED = 0  # validation windows are fixed across runs and seeds, so val losses compare
IGNORE = -100  # target of a padding row: F.cross_entropy's ignore_index
# A prepared dataset's kind, from the record its meta.json holds, and the data.prepare --format that writes it.
FORMATS = {"text": "text", "conversations": "chat", "preference": "preference", "prompts": "prompts"}
KIND_WORDS = {"text": "text", "conversations": "conversations", "preference": "preference pairs",
              "prompts": "prompts"}
OWN_ROWS = ("preference", "prompts")  # kinds whose rows are their own (a pair's side, a prompt), not windows


def dataset_kind(meta: dict) -> str:
    """text, conversations, preference or prompts (pairs and prompts also carry a chat record when they are
    conversations)."""
    for kind in OWN_ROWS:
        if kind in meta:
            return kind
    return "conversations" if "chat" in meta else "text"


def missing_dataset(data_dir: str, prepare: str) -> str:
    """The refusal of a data_dir without meta.json, with its fix: the `prepare` command, or where data_dir is
    relative and read from another folder than the repo's root that holds one, running from there."""
    problem = f"no prepared dataset in {place(data_dir)} (meta.json missing"
    if not read_elsewhere(data_dir):
        return f"{problem}); prepare it with: {prepare}"
    problem = f"{problem}: {read_from(data_dir)}, not the repo's root)"
    if os.path.exists(os.path.join(REPO_ROOT, data_dir, "meta.json")):
        return (f"{problem}; fix: run from the repo's root, cd {REPO_ROOT}, where {data_dir} is prepared, or give "
                f"its absolute path, {os.path.join(REPO_ROOT, data_dir)}")
    return f"{problem}; prepare it with: {prepare}"


class Dataset:
    """One prepared dataset: meta.json, <split>.bin and <split>.idx, the tokenizer's files."""

    def __init__(self, data_dir: str, tokenizer: str | None, block_size: int):
        self.dir, self.block_size = data_dir, block_size
        meta_path = os.path.join(data_dir, "meta.json")
        self.prepare = (f"{tool_command('data.prepare')}{f' --tokenizer {tokenizer}' if tokenizer else ''} --input "
                        f"PATH/TO/text.txt --out_dir {data_dir}")
        if not os.path.exists(meta_path):
            raise ConfigError(missing_dataset(data_dir, self.prepare))
        fix = f"prepare the dataset again with: {self.prepare}"
        self.meta = read_meta(data_dir, "data.dir", fix)
        missing = [key for key in LOADER_KEYS if key not in self.meta]
        if missing:
            raise ConfigError(f"dataset meta {meta_path} lacks {', '.join(missing)} (written by another version of "
                              f"data.prepare, or another tool); fix: {fix}")
        with open(meta_path, "rb") as f:
            self.id = hashlib.sha256(f.read()).hexdigest()[:16]
        if tokenizer is not None and self.meta.get("tokenizer") != tokenizer:
            raise ConfigError(f"{meta_path} was prepared with the {self.meta.get('tokenizer')!r} tokenizer but the "
                              f"run config asks for data.tokenizer={tokenizer!r}: point data.dir at a "
                              f"{tokenizer} dataset or set data.tokenizer={self.meta.get('tokenizer')}")
        self.dtype = np.dtype(self.meta["dtype"])
        self.splits = {split: self._open(split) for split in ("train", "val")}

    def _open(self, split: str) -> int:
        path = os.path.join(self.dir, f"{split}.bin")
        kind = dataset_kind(self.meta)
        may_be_empty = kind in OWN_ROWS and split == "val"  # a small set of pairs or prompts may hold none back
        if not os.path.exists(path) or (os.path.getsize(path) == 0 and not may_be_empty):
            raise ConfigError(f"{path} is missing or empty; prepare the dataset with: {self.prepare}")
        n_tokens = os.path.getsize(path) // self.dtype.itemsize
        if n_tokens != self.meta[f"{split}_tokens"]:
            raise ConfigError(f"{path} holds {n_tokens:,} tokens but meta.json says {self.meta[f'{split}_tokens']:,}: "
                              f"the dataset is corrupt or half-written; prepare it again with: {self.prepare}")
        if n_tokens <= self.block_size + 1 and kind not in OWN_ROWS:  # a pair's or prompt's rows are its own
            raise ConfigError(f"model.block_size={self.block_size} needs windows of {self.block_size + 1} tokens but "
                              f"{path} holds only {n_tokens:,}: use a smaller block_size or more text")
        return n_tokens

    def read(self, split: str, starts: np.ndarray) -> np.ndarray:
        """Windows of block_size + 1 tokens at `starts`, as int64 rows."""
        width = (self.block_size + 1) * self.dtype.itemsize
        fd = os.open(os.path.join(self.dir, f"{split}.bin"), os.O_RDONLY)
        try:
            body = b"".join(os.pread(fd, width, int(s) * self.dtype.itemsize) for s in starts)
        finally:
            os.close(fd)
        return np.frombuffer(body, dtype=self.dtype).reshape(len(starts), -1).astype(np.int64)


class TokenData:
    """data.dir, or the blend data.sources ([{dir, weight}, ...]) of datasets with one tokenizer."""
    KIND = "text"  # the subclasses of data/conversations.py and data/pairs.py read the other kinds
    OBJECTIVE = "next_token"  # train.objective's default for this kind (training/objectives/)

    def __init__(self, data_dir: str, tokenizer: str | None, block_size: int, sources=(),
                 document_masking: bool = False):
        sources = [(s["dir"], s["weight"]) if isinstance(s, dict) else (s.dir, s.weight) for s in sources]
        for i, (path, weight) in enumerate(sources):
            if not path:
                raise ConfigError(f"data.sources[{i}] has no dir: give each source {{dir: PREPARED_DATASET, "
                                  f"weight: W}}")
            if not weight > 0:
                raise ConfigError(f"data.sources[{i}] ({path}) has weight {weight}: weights must be positive; "
                                  f"remove the source to leave it out of the blend")
        self.datasets = [Dataset(path, tokenizer, block_size) for path, _ in sources or [(data_dir, 1.0)]]
        others = [d for d in self.datasets if dataset_kind(d.meta) != self.KIND]
        if others:
            kind = dataset_kind(others[0].meta)
            raise ConfigError(f"{others[0].dir} holds {KIND_WORDS[kind]} (data.prepare --format {FORMATS[kind]}), "
                              f"which train alone: set data.dir to it and leave data.sources empty")
        self.weights = [w for _, w in sources] or [1.0]
        fingerprints = {d.meta["tokenizer_fingerprint"] for d in self.datasets}
        if len(fingerprints) > 1:
            names = ", ".join(f"{d.dir}: {d.meta['tokenizer']}, {d.meta['vocab_size']:,} ids" for d in self.datasets)
            raise ConfigError(f"the sources of data.sources were prepared with different tokenizers ({names}): "
                              f"prepare them all with the same --tokenizer (a tokenizer.json or bpe file: the same "
                              f"file)")
        try:
            self.blend = Blend(self.weights)
        except ValueError as e:
            raise ConfigError(f"data.sources: {e}") from None
        self.block_size = block_size
        self.meta = self.datasets[0].meta
        self.epochs = [Epochs(d.splits["train"], block_size, i) for i, d in enumerate(self.datasets)]
        names = [os.path.basename(os.path.normpath(d.dir)) for d in self.datasets]
        self.names = [n if names.count(n) == 1 else f"{n}_{i}" for i, n in enumerate(names)]
        documents = [Documents(d.meta) for d in self.datasets]
        # Without a delimiter anywhere every window is one document: masking would change nothing.
        self.documents = documents if document_masking and any(d.delimiter for d in documents) else None

    @property
    def positions(self) -> bool:
        """Do the inputs carry each token's position within its document (document masking)?"""
        return self.documents is not None

    def steps_for_epochs(self, epochs: float, global_batch: int) -> int:
        """Steps that train on `epochs` passes over the training windows (train.epochs)."""
        if len(self.datasets) > 1:
            raise ConfigError("train.epochs counts passes over one dataset; a blend has one per source: set "
                              "train.max_steps instead")
        return max(1, math.ceil(epochs * self.epochs[0].windows / global_batch))

    def eval_targets(self, split: str, count: int) -> int:
        """The target tokens of the `count` validation windows: the divisor of the validation loss."""
        return count * self.block_size

    def tokenizer(self):
        """The tokenizer every source was prepared with (their fingerprints agree), read from the first."""
        try:
            return tokenizer_from_meta(self.meta, self.datasets[0].dir)
        except TokenizerError as e:
            raise ConfigError(str(e)) from None

    def check_vocab(self, vocab_size: int) -> None:
        top = max(d.meta["max_token_id"] for d in self.datasets)
        if top >= vocab_size:
            raise ConfigError(f"the dataset has token ids up to {top} but model.vocab_size={vocab_size}: set "
                              f"model.vocab_size to at least {top + 1} (or null to take {self.meta['vocab_size']} "
                              f"from meta.json)")

    def _windows(self, split: str, source: np.ndarray, starts: np.ndarray) -> np.ndarray:
        rows = np.empty((len(starts), self.block_size + 1), dtype=np.int64)
        for i in np.unique(source):
            mask = source == i
            rows[mask] = self.datasets[i].read(split, starts[mask])
        return rows

    def _with_positions(self, source: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """The rows, followed under document masking by each input token's position within its document."""
        if self.documents is None:
            return rows
        positions = np.empty((len(rows), self.block_size), dtype=np.int64)
        for i in np.unique(source):
            mask = source == i
            positions[mask] = self.documents[i].positions(rows[mask, :-1])
        return np.concatenate([rows, positions], axis=1)

    def train_batch(self, seed: int, step: int, micro_step: int, dp_rank: int, layout, device):
        """(inputs, targets) for one micro-batch of one rank; a pure function of its arguments."""
        first = self._first_sample(step, dp_rank, layout) + micro_step * layout.micro_batch
        return self._to_device(self._train_rows(seed, first, layout.micro_batch), device)

    def step_batches(self, seed: int, step: int, dp_rank: int, layout, device) -> list:
        """The rank's micro-batches of a step, train_batch for each micro-step: its samples are contiguous,
        so they are read, pinned and copied to the device at once, then split into views."""
        rows = self._train_rows(seed, self._first_sample(step, dp_rank, layout), layout.grad_accum * layout.micro_batch)
        inputs, targets = self._to_device(rows, device)
        return list(zip(_split(inputs, layout.micro_batch), _split(targets, layout.micro_batch)))

    @staticmethod
    def _first_sample(step: int, dp_rank: int, layout) -> int:
        if step < 1:
            raise ValueError(f"training steps count from 1, not {step}")
        return (step - 1) * layout.global_batch + dp_rank * layout.grad_accum * layout.micro_batch

    def _train_rows(self, seed: int, first: int, count: int) -> np.ndarray:
        source, index = self.blend.locate(np.arange(first, first + count))
        starts = np.empty(len(index), dtype=np.int64)
        for i in np.unique(source):
            mask = source == i
            starts[mask] = self.epochs[i].starts(seed, index[mask])
        return self._with_positions(source, self._windows("train", source, starts))

    def eval_windows(self, split: str, count: int) -> np.ndarray:
        """The fixed validation set of `split`: `count` rows of block_size + 1 tokens, blended like training
        (followed by their positions under document masking)."""
        source, index = self.blend.locate(np.arange(count))
        starts = np.empty(count, dtype=np.int64)
        for i in np.unique(source):
            mask = source == i
            high = self.datasets[i].splits[split] - self.block_size  # last start leaves block_size + 1 tokens
            starts[mask] = np.random.default_rng([EVAL_SEED + int(i)]).integers(0, high, int(mask.sum()))[index[mask]]
        return self._with_positions(source, self._windows(split, source, starts))

    def eval_batches(self, split: str, count: int, dp_rank: int, layout, device):
        """This rank's share of the `count` validation windows, in equal micro-batches (padded rows: IGNORE)."""
        per_rank = math.ceil(count / layout.dp)
        micro_batches = math.ceil(per_rank / layout.micro_batch)
        rows = self.eval_windows(split, count)[dp_rank * per_rank: (dp_rank + 1) * per_rank]
        padded = np.zeros((micro_batches * layout.micro_batch, rows.shape[1]), dtype=np.int64)
        padded[:len(rows)] = rows
        targets = torch.from_numpy(padded[:, 1:self.block_size + 1].copy())
        targets[len(rows):] = IGNORE
        for m in range(micro_batches):
            part = slice(m * layout.micro_batch, (m + 1) * layout.micro_batch)
            batch = move_to_device(torch.from_numpy(padded[part]), device)
            yield self._inputs(batch), move_to_device(targets[part], device)

    def _inputs(self, batch: torch.Tensor):
        """The model's inputs in rows of tokens (and positions): the token ids, or (token ids, positions)."""
        T = self.block_size
        return batch[:, :T] if self.documents is None else (batch[:, :T], batch[:, T + 1:])

    def _to_device(self, rows: np.ndarray, device):
        """(inputs, targets) of rows of tokens (and positions), copied to the device at once."""
        batch = move_to_device(torch.from_numpy(rows), device)
        return self._inputs(batch), batch[:, 1:self.block_size + 1]

    def epochs_used(self, samples: int) -> dict:
        """Epochs of each source's training windows used by the first `samples` samples (for metrics)."""
        drawn = self.blend.drawn(samples)
        return {f"epochs_{name}": round(e.epochs(int(n)), 6) for name, e, n in zip(self.names, self.epochs, drawn)}

    def record(self) -> dict:
        """What a checkpoint remembers of the data, to refuse resuming on other data."""
        return {"sources": [{"dir": d.dir, "dataset": d.id, "tokenizer": d.meta["tokenizer"], "weight": w}
                            for d, w in zip(self.datasets, self.weights)]}

    def check_resume(self, saved: dict, allow_changed: bool) -> None:
        """Refuse to resume a checkpoint whose record() differs from this data's, unless allowed."""
        now = self.record()["sources"]
        changes = []
        if len(saved["sources"]) != len(now):
            changes.append(f"{len(saved['sources'])} sources then, {len(now)} now")
        for i, (was, new) in enumerate(zip(saved["sources"], now)):
            for key, what in (("dataset", "the prepared dataset (another corpus or preparation)"),
                              ("tokenizer", "the tokenizer"), ("weight", "the weight")):
                if was[key] != new[key]:
                    changes.append(f"source {i} ({new['dir']}): {what} differs: {was[key]} then, {new[key]} now")
        if changes and not allow_changed:
            raise ConfigError(f"the checkpoint was trained on other data: {'; '.join(changes)}. Resume with the "
                              f"checkpoint's data, or set data.allow_changed=true to continue on this data anyway "
                              f"(the samples then differ from an uninterrupted run)")


def move_to_device(batch: torch.Tensor, device) -> torch.Tensor:
    """The batch on the device: pinned first on CUDA, so the copy does not hold the host up."""
    if device.type == "cuda":
        return batch.pin_memory().to(device, non_blocking=True)
    return batch


def _split(inputs, size: int) -> list:
    """Micro-batches of `size` rows of inputs or labels: a tensor, or a tuple of them ((token ids, positions),
    (targets, pair_info))."""
    if isinstance(inputs, tuple):
        return list(zip(*(part.split(size) for part in inputs)))
    return list(inputs.split(size))
