"""Real test corpora, offline: tinyshakespeare split into speeches, and the docstrings of Python's standard
library (a second domain for blends); and a real BPE tokenizer that needs no download."""
import gzip
import importlib
import inspect
import json
import os

import tiktoken
import zstandard

STDLIB = ("argparse", "asyncio", "collections", "configparser", "contextlib", "csv", "dataclasses", "datetime",
          "decimal", "email", "fractions", "functools", "http.client", "inspect", "ipaddress", "itertools", "json",
          "logging", "os", "pathlib", "pickle", "random", "re", "shutil", "socket", "statistics", "string",
          "subprocess", "tarfile", "textwrap", "threading", "typing", "unittest", "urllib.parse", "zipfile")


def speeches(shakespeare_path: str) -> list[str]:
    with open(shakespeare_path, encoding="utf-8") as f:
        return [block for block in f.read().split("\n\n") if block.strip()]


def docstrings() -> list[str]:
    """Docstrings of modules, classes and functions of STDLIB, in a fixed order, without duplicates."""
    seen, docs = set(), []
    for name in STDLIB:
        module = importlib.import_module(name)
        members = (v for _, v in sorted(vars(module).items()) if inspect.isclass(v) or inspect.isfunction(v))
        for obj in [module, *members]:
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 40 and doc not in seen:
                seen.add(doc)
                docs.append(doc)
    return docs


def write_corpus(directory, docs: list[str]) -> list[str]:
    """The documents spread over every input format: .jsonl, .jsonl.gz, .jsonl.zst, .parquet, .txt files.
    Returns them in the order the preparation reads them (files sorted by name)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(directory, exist_ok=True)
    parts = [docs[i::5] for i in range(5)]

    def lines(part):
        return "".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(part)).encode()

    with open(os.path.join(directory, "a.jsonl"), "wb") as f:
        f.write(lines(parts[0]))
    with gzip.open(os.path.join(directory, "b.jsonl.gz"), "wb") as f:
        f.write(lines(parts[1]))
    with open(os.path.join(directory, "c.jsonl.zst"), "wb") as f:
        f.write(zstandard.ZstdCompressor().compress(lines(parts[2])))
    pq.write_table(pa.table({"text": parts[3]}), os.path.join(directory, "d.parquet"), row_group_size=200)
    os.makedirs(os.path.join(directory, "e"), exist_ok=True)
    for i, doc in enumerate(parts[4][:50]):
        with open(os.path.join(directory, "e", f"{i:03d}.txt"), "w", encoding="utf-8") as f:
            f.write(doc)
    return parts[0] + parts[1] + parts[2] + parts[3] + parts[4][:50]


def byte_level_encoding(first_id: int = 0) -> tiktoken.Encoding:
    """A real tiktoken BPE (GPT-2's split pattern, byte tokens only): the GPT-2 merge files need the
    network, which tests do not have; the preparation code path is the same. `first_id` shifts the ids
    (above 65,535 for a vocabulary that needs 32 bits)."""
    gpt2_pattern = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    return tiktoken.Encoding(f"bytes{first_id or ''}", pat_str=gpt2_pattern,
                             mergeable_ranks={bytes([i]): first_id + i for i in range(256)}, special_tokens={})


def word_level_tokenizer(documents: list[str], size: int = 2000):
    """A word-level tokenizer.json trained on `documents` (whitespace pre-tokenizer, end-of-text and unknown-word
    tokens): a prompt of whitespace, such as the default newline, encodes to no tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from data.tokenizers import EOT, HFTokenizer
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(documents, trainers.WordLevelTrainer(vocab_size=size, special_tokens=[EOT, "[UNK]"],
                                                                       show_progress=False))
    return HFTokenizer(tokenizer, "tokenizer.json")


def prepare_blend_sources(root, shakespeare_path: str, word_level: bool = False) -> tuple[str, str]:
    """Two real domains prepared with one tokenizer: speeches (large) and a small set of stdlib docstrings; in
    bytes (a tiktoken BPE of byte tokens), or with a word-level tokenizer.json trained on both."""
    from data.prepare import prepare
    from data.tokenizers import TiktokenTokenizer

    corpora = (("docs", docstrings()[:60]), ("plays", speeches(shakespeare_path)[:2000]))
    tokenizer = (word_level_tokenizer([d for _, docs in corpora for d in docs]) if word_level
                 else TiktokenTokenizer(byte_level_encoding()))
    for name, docs in corpora:
        os.makedirs(os.path.join(root, name), exist_ok=True)
        with open(os.path.join(root, name, f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
        prepare([os.path.join(root, name)], os.path.join(root, f"{name}_data"), tokenizer, val_fraction=0.2)
    return os.path.join(root, "plays_data"), os.path.join(root, "docs_data")
