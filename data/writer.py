"""Token files: one shard per piece and split while preparing, then the dataset's files.

    train.bin, val.bin     the tokens of every document, each delimited by end-of-text (or begun by BOS),
                           uint16 when every id of the vocabulary fits, else uint32
    train.idx, val.idx     the document index: int64 offsets, document d is tokens [idx[d], idx[d + 1])
    train.mask, val.mask   conversations only (data/prepare_chat.py): one byte a token, 1 where the loss trains

A shard is finished once its `.done` record is written (last, atomically); a later run keeps finished shards
and redoes the rest. Every count and offset is 64-bit.
"""
import itertools
import json
import os

import numpy as np

SPLITS = ("train", "val")


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


class ShardWriter:
    """Appends documents' tokens to `<prefix>.<split>.bin` and their lengths to `<prefix>.<split>.len` (and, with
    masks, their loss masks to `<prefix>.<split>.mask`)."""

    def __init__(self, prefix: str, dtype: np.dtype, masks: bool = False):
        self.prefix, self.dtype, self.limit = prefix, np.dtype(dtype), np.iinfo(dtype).max
        kinds = ("bin", "len", "mask") if masks else ("bin", "len")
        self.files = {s: tuple(open(f"{prefix}.{s}.{kind}", "wb") for kind in kinds) for s in SPLITS}
        self.counts = {s: {"documents": 0, "tokens": 0} for s in SPLITS}
        self.max_id = -1

    def write(self, split: str, documents: list[list[int]], masks: list[list[int]] | None = None) -> None:
        if not documents:
            return
        if masks is not None:
            self.files[split][2].write(np.fromiter(itertools.chain.from_iterable(masks), dtype=np.uint8).tobytes())
        lengths = np.fromiter((len(d) for d in documents), dtype=np.int64, count=len(documents))
        tokens = np.fromiter(itertools.chain.from_iterable(documents), dtype=np.int64, count=int(lengths.sum()))
        if len(tokens) and (tokens.max() > self.limit or tokens.min() < 0):
            bad = int(tokens.max() if tokens.max() > self.limit else tokens.min())
            raise OverflowError(f"token id {bad} does not fit {self.dtype.name} (0..{self.limit}): the vocabulary "
                                f"is larger than the tokenizer declared")
        self.max_id = max(self.max_id, int(tokens.max()) if len(tokens) else -1)
        tokens_file, lengths_file = self.files[split][:2]
        tokens_file.write(tokens.astype(self.dtype).tobytes())
        lengths_file.write(lengths.tobytes())
        self.counts[split]["documents"] += len(documents)
        self.counts[split]["tokens"] += int(lengths.sum())

    def close(self) -> dict:
        """Flush to disk and write the `.done` record; returns it."""
        for handles in self.files.values():
            for f in handles:
                f.flush()
                os.fsync(f.fileno())
                f.close()
        record = {"counts": self.counts, "max_id": self.max_id}
        write_atomic(f"{self.prefix}.done", json.dumps(record).encode())
        return record


def read_done(prefix: str) -> dict | None:
    try:
        with open(f"{prefix}.done") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def merge(prefixes: list[str], split: str, out_dir: str, dtype: np.dtype, suffix: str) -> None:
    """Concatenate the shards' tokens into out_dir/<split>.bin<suffix> and their lengths into the int64
    document index out_dir/<split>.idx<suffix> (and their masks, if they have some, into <split>.mask<suffix>),
    streaming (memory does not grow with the corpus)."""
    offset = 0
    with open(os.path.join(out_dir, f"{split}.bin{suffix}"), "wb") as tokens, \
            open(os.path.join(out_dir, f"{split}.idx{suffix}"), "wb") as index:
        index.write(np.zeros(1, dtype=np.int64).tobytes())
        for prefix in prefixes:
            _append(f"{prefix}.{split}.bin", tokens)
            lengths = np.fromfile(f"{prefix}.{split}.len", dtype=np.int64)
            index.write((offset + np.cumsum(lengths, dtype=np.int64)).tobytes())
            offset += int(lengths.sum())
        for f in (tokens, index):
            f.flush()
            os.fsync(f.fileno())
    assert os.path.getsize(os.path.join(out_dir, f"{split}.bin{suffix}")) == offset * np.dtype(dtype).itemsize
    if os.path.exists(f"{prefixes[0]}.{split}.mask"):
        with open(os.path.join(out_dir, f"{split}.mask{suffix}"), "wb") as masks:
            for prefix in prefixes:
                _append(f"{prefix}.{split}.mask", masks)
            masks.flush()
            os.fsync(masks.fileno())
        assert os.path.getsize(os.path.join(out_dir, f"{split}.mask{suffix}")) == offset


def _append(path: str, out) -> None:
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            out.write(block)


def read_index(data_dir: str, split: str) -> np.ndarray:
    return np.fromfile(os.path.join(data_dir, f"{split}.idx"), dtype=np.int64)


def write_atomic(path: str, body: bytes) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
