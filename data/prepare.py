"""Tokenize a text once into uint16 memmaps: train.bin, val.bin (90/10 split) and meta.json.

    python -m data.prepare --tokenizer char --input ../shared/data/tinyshakespeare.txt
    python -m data.prepare --tokenizer gpt2            # downloads tinyshakespeare if it can

Idempotent: a dataset already prepared from the same text with the same tokenizer is left as it is.
Files are written to temporary names and renamed, so an interrupted run never leaves a torn dataset.
"""
import argparse
import hashlib
import json
import os
import sys
import urllib.request

import numpy as np

if __package__ in (None, ""):  # `python data/prepare.py`: import from the repo root, as `python -m` does
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from data.tokenizers import TOKENIZERS, CharTokenizer, Gpt2Tokenizer

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
TRAIN_FRACTION = 0.9
DTYPE = np.uint16


def default_out_dir(tokenizer: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), f"shakespeare_{tokenizer}")


def read_text(input_path: str | None, out_dir: str) -> str:
    if input_path is None:
        input_path = os.path.join(out_dir, "input.txt")
        if not os.path.exists(input_path):
            print(f"downloading {SHAKESPEARE_URL}")
            try:
                with urllib.request.urlopen(SHAKESPEARE_URL, timeout=30) as response:
                    body = response.read()
            except OSError as e:
                raise SystemExit(f"could not download {SHAKESPEARE_URL} ({e}); pass --input PATH to a local "
                                 f"copy of the text") from None
            _write_atomic(input_path, body)
    if not os.path.isfile(input_path):
        raise SystemExit(f"input text {input_path} not found; pass --input PATH to a text file")
    with open(input_path, encoding="utf-8") as f:
        text = f.read()
    if not text:
        raise SystemExit(f"input text {input_path} is empty")
    return text


def prepare(text: str, out_dir: str, tokenizer, source: str = "") -> dict:
    """Write the dataset for `text` to out_dir unless it is already there; returns its meta."""
    checksum = hashlib.sha256(text.encode("utf-8")).hexdigest()
    meta_path = os.path.join(out_dir, "meta.json")
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
        if (meta.get("source_sha256") == checksum and meta.get("tokenizer") == tokenizer.name
                and all(os.path.exists(os.path.join(out_dir, f"{s}.bin")) for s in ("train", "val"))):
            print(f"{out_dir} already holds this text with the {tokenizer.name} tokenizer; nothing to do")
            return meta

    split = int(len(text) * TRAIN_FRACTION)
    ids = {"train": tokenizer.encode(text[:split]), "val": tokenizer.encode(text[split:])}
    if tokenizer.vocab_size > np.iinfo(DTYPE).max + 1:
        raise SystemExit(f"vocab size {tokenizer.vocab_size} does not fit {DTYPE.__name__} token files")
    os.makedirs(out_dir, exist_ok=True)
    for name, tokens in ids.items():
        _write_atomic(os.path.join(out_dir, f"{name}.bin"), np.array(tokens, dtype=DTYPE).tobytes())
    meta = {
        "tokenizer": tokenizer.name,
        "vocab_size": tokenizer.vocab_size,
        "max_token_id": int(max(max(ids["train"]), max(ids["val"]))),
        "dtype": np.dtype(DTYPE).name,
        "train_tokens": len(ids["train"]),
        "val_tokens": len(ids["val"]),
        "source": source,
        "source_sha256": checksum,
        **tokenizer.meta(),
    }
    # meta.json last: its presence marks a complete dataset.
    _write_atomic(meta_path, json.dumps(meta, indent=1).encode())
    print(f"wrote {out_dir}: {meta['train_tokens']:,} train and {meta['val_tokens']:,} val tokens, "
          f"vocab {meta['vocab_size']:,} ({tokenizer.name})")
    return meta


def _write_atomic(path: str, body: bytes) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(body)
    os.replace(tmp, path)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", choices=TOKENIZERS, default="char")
    parser.add_argument("--input", help="text file to tokenize (default: download tinyshakespeare)")
    parser.add_argument("--out_dir", help="default: data/shakespeare_<tokenizer>")
    args = parser.parse_args(argv)
    out_dir = args.out_dir or default_out_dir(args.tokenizer)
    text = read_text(args.input, out_dir)
    try:
        tokenizer = CharTokenizer.from_text(text) if args.tokenizer == "char" else Gpt2Tokenizer()
    except RuntimeError as e:
        raise SystemExit(str(e)) from None
    prepare(text, out_dir, tokenizer, source=os.path.abspath(args.input) if args.input else SHAKESPEARE_URL)


if __name__ == "__main__":
    sys.exit(main())
