"""Tokenize documents once, in parallel, into a dataset: train/val tokens, document index, tokenizer, meta.json.

    python -m data.prepare                                          # tinyshakespeare by character (downloads it)
    python -m data.prepare --input corpus/ --tokenizer gpt2 --out_dir data/corpus_gpt2
    python -m data.prepare --input 'owt/*.jsonl.zst' --tokenizer bpe:32000 --workers 16 --out_dir data/owt
    python -m data.prepare --input hf:HuggingFaceFW/fineweb-edu:sample-10BT --tokenizer gpt2 --out_dir data/fwe

Inputs and tokenizers: see data/readers.py and data/tokenizers.py. Each document goes to val when a hash of
its text falls below --val_fraction (so the split does not depend on the order of the inputs), and ends
with the end-of-text token. A single text file without --split_blank_lines is one document: it is split
90/10 by characters, with no delimiter (the quickstart's data: nanoGPT's shakespeare_char split).

The inputs are cut into pieces (files, 16 MB ranges of JSONL, Parquet row groups) that --workers processes
tokenize, each streaming its piece in batches into its own shard: memory is bounded by the chunk, not the
corpus, and the dataset is byte-identical whatever the number of workers. An interrupted preparation
resumes (finished shards kept). The dataset's files are replaced only at the end, meta.json last: its
presence marks a complete dataset, so a killed or failed preparation never leaves one that training trusts.
An out_dir that holds a dataset of other inputs or options is refused, unless --force says to replace it.
"""
import argparse
import hashlib
import json
import multiprocessing
import os
import sys
import urllib.request

if __package__ in (None, ""):  # `python data/prepare.py`: import from the repo root, as `python -m` does
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from common.checks import ConfigError, ToolParser, exit_bad_input, writable_dir
from data.out_dir import FORMAT, check_val_fraction, done_job, finish_dataset, in_val, job_workspace
from data.readers import InputError, Piece, documents, expand_inputs, kind_of, plan_pieces
from data.tokenizers import (
    CharTokenizer,
    TokenizerError,
    folder_tokenizer,
    parse_spec,
    tokenizer_from_meta,
    train_bpe,
)
from data.writer import ShardWriter, read_done, token_dtype, write_atomic

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
TRAIN_FRACTION = 0.9  # the single-document split
BATCH_CHARS = 1 << 22  # characters tokenized at once by a worker: its memory bound


def default_out_dir(tokenizer: str) -> str:
    name = "".join(c if c.isalnum() else "_" for c in os.path.basename(tokenizer.removesuffix(".json")))
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), f"shakespeare_{name}")


def download_shakespeare(out_dir: str) -> str:
    path = os.path.join(out_dir, "input.txt")
    if not os.path.exists(path):
        print(f"downloading {SHAKESPEARE_URL}")
        try:
            with urllib.request.urlopen(SHAKESPEARE_URL, timeout=30) as response:
                body = response.read()
        except OSError as e:
            raise InputError(f"could not download {SHAKESPEARE_URL} ({e}); pass --input PATH to a local copy of "
                             f"the text") from None
        os.makedirs(out_dir, exist_ok=True)
        write_atomic(path, body)
    return path


def prepare(inputs: list[str], out_dir: str, tokenizer: str = "char", text_key: str = "text",
            split_blank_lines: bool = False, val_fraction: float = 0.01, workers: int = 1,
            chunk_mb: float = 16, force: bool = False) -> dict:
    """Write the dataset of `inputs` to out_dir unless it is already there; returns its meta. A dataset of other
    inputs or options in out_dir is replaced only with `force`."""
    check_val_fraction(val_fraction)
    if workers < 1:
        raise InputError(f"--workers {workers}: must be >= 1; fix: pass the number of processes that tokenize "
                         f"(default: all cores)")
    if not chunk_mb > 0:
        raise InputError(f"--chunk_mb {chunk_mb}: must be > 0; fix: pass the size of the pieces JSONL is cut into "
                         f"(default: 16)")
    files = expand_inputs(inputs)
    job = _job(files, tokenizer, text_key, split_blank_lines, val_fraction, chunk_mb)
    meta = done_job(out_dir, job, force, "these inputs")
    if meta is not None:
        return meta
    single = len(files) == 1 and kind_of(files[0]) == "txt" and not split_blank_lines
    kind, ready = parse_spec(tokenizer)  # an unreadable tokenizer fails here, before anything is written
    if kind == "ready" and not single and ready.delimiter is None:
        raise InputError(f"--tokenizer {tokenizer}: its {ready.vocab_size} characters hold no end-of-text token to end "
                         f"each document with (a vocabulary of one document); fix: pass one .txt file (one document), "
                         f"or --tokenizer char")
    workspace = job_workspace(out_dir, job)
    pieces = plan_pieces(files, max(int(chunk_mb * 2**20), 1))
    options = {"text_key": text_key, "split_blank_lines": split_blank_lines, "val_fraction": val_fraction}
    if single:
        tok, prefixes = _prepare_single(files[0], kind, ready, workspace)
    else:
        tok = ready if kind == "ready" else _corpus_tokenizer(kind, tokenizer, pieces, options, workers)
        prefixes = _tokenize_pieces(pieces, tok, workspace, options, workers)
    split = f"{TRAIN_FRACTION:.0%} of the characters" if single else f"documents by hash, val_fraction {val_fraction}"
    return finish_dataset(out_dir, workspace, prefixes, tok, job, files, split, None if single else tok.delimiter)


def _job(files, tokenizer, text_key, split_blank_lines, val_fraction, chunk_mb) -> str:
    """What the dataset is made of: its inputs (path, size, mtime) and every option that changes it."""
    stats = [(p, os.path.getsize(p), os.stat(p).st_mtime_ns) if os.path.exists(p) else (p,) for p in files]
    if not isinstance(tokenizer, str):  # a tokenizer object (see data.tokenizers.parse_spec)
        tokenizer, tokenizer_file = tokenizer.name, tokenizer.fingerprint()
    elif os.path.isdir(tokenizer):  # a dataset's or an export's tokenizer, which may change in place
        tokenizer_file = folder_tokenizer(tokenizer).fingerprint()
    else:
        tokenizer_file = hashlib.sha256(open(tokenizer, "rb").read()).hexdigest() if os.path.isfile(tokenizer) else None
    return hashlib.sha256(json.dumps([FORMAT, stats, tokenizer, tokenizer_file, text_key, split_blank_lines,
                                      val_fraction, chunk_mb]).encode()).hexdigest()


def _prepare_single(path: str, kind: str, ready, workspace: str):
    """One document: 90/10 by characters, no delimiter (the quickstart's dataset, as nanoGPT's shakespeare_char)."""
    text = next(documents(Piece(path, "txt")), "")
    if not text:
        raise InputError(f"input {path} is empty: pass a file with text")
    if kind == "bpe":
        raise InputError("--tokenizer bpe:SIZE trains on many documents: pass a folder, JSONL or Parquet, or "
                         "--split_blank_lines")
    tok = ready if kind == "ready" else CharTokenizer.from_text(text)
    split = int(len(text) * TRAIN_FRACTION)
    writer = ShardWriter(os.path.join(workspace, "shards", "single"), token_dtype(tok.vocab_size))
    writer.write("train", [tok.encode(text[:split])])
    writer.write("val", [tok.encode(text[split:])])
    writer.close()
    return tok, [os.path.join(workspace, "shards", "single")]


def _corpus_tokenizer(kind: str, spec: str, pieces, options, workers):
    """char: the characters of the whole corpus (one parallel pass); bpe:SIZE: a BPE trained on it."""
    if kind == "char":
        chars = set()
        for found in _map(_chars_of_piece, pieces, workers, options):
            chars |= found
        return CharTokenizer(sorted(chars), eot=True)
    size = int(spec.split(":")[1])
    print(f"training a byte-level BPE of {size:,} ids on the inputs")
    docs = (d for p in pieces for d in documents(p, options["text_key"], options["split_blank_lines"]))
    return train_bpe(docs, size)


def _chars_of_piece(piece: Piece, options) -> set:
    chars = set()
    for doc in documents(piece, options["text_key"], options["split_blank_lines"]):
        chars.update(doc)
    return chars


def _tokenize_pieces(pieces, tok, workspace, options, workers) -> list[str]:
    tok_meta = {"tokenizer": tok.name, **tok.meta()}
    tok.save(workspace)
    write_atomic(os.path.join(workspace, "tokenizer_meta.json"), json.dumps(tok_meta).encode())
    prefixes = [os.path.join(workspace, "shards", f"{i:06d}") for i in range(len(pieces))]
    todo = [(prefix, piece) for prefix, piece in zip(prefixes, pieces) if read_done(prefix) is None]
    if len(todo) < len(pieces):
        print(f"resuming: {len(pieces) - len(todo)} of {len(pieces)} pieces already done")
    for _ in _map(_tokenize_piece, todo, workers, {**options, "workspace": workspace}):
        pass
    return prefixes


_TOKENIZER = {}  # per worker process: the tokenizer, read once from the workspace


def _worker_tokenizer(workspace: str):
    if workspace not in _TOKENIZER:
        with open(os.path.join(workspace, "tokenizer_meta.json")) as f:
            _TOKENIZER[workspace] = tokenizer_from_meta(json.load(f), workspace)
    return _TOKENIZER[workspace]


def _tokenize_piece(job, options) -> None:
    prefix, piece = job
    tok = _worker_tokenizer(options["workspace"])
    writer = ShardWriter(prefix, token_dtype(tok.vocab_size))
    batch, size = [], 0
    for doc in documents(piece, options["text_key"], options["split_blank_lines"]):
        batch.append(doc)
        size += len(doc)
        if size >= BATCH_CHARS:
            _write_batch(writer, tok, batch, options["val_fraction"])
            batch, size = [], 0
    _write_batch(writer, tok, batch, options["val_fraction"])
    writer.close()


def _write_batch(writer: ShardWriter, tok, docs: list[str], val_fraction: float) -> None:
    if not docs:
        return
    ids = tok.encode_batch(docs)
    if tok.delimiter == "eot":
        ids = [d + [tok.eot_id] for d in ids]
    else:
        ids = [[tok.bos_id] + d for d in ids]
    split = [in_val(doc, val_fraction) for doc in docs]
    writer.write("train", [d for d, v in zip(ids, split) if not v])
    writer.write("val", [d for d, v in zip(ids, split) if v])


def _map(fn, items, workers: int, options):
    """fn(item, options) over items, in `workers` processes (in this one for 1); results in order."""
    if workers <= 1 or len(items) <= 1:
        yield from (fn(item, options) for item in items)
        return
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: --workers sets the parallelism
    with multiprocessing.get_context("fork").Pool(min(workers, len(items))) as pool:
        yield from pool.imap(_Call(fn, options), items)


class _Call:
    def __init__(self, fn, options):
        self.fn, self.options = fn, options

    def __call__(self, item):
        return self.fn(item, self.options)


def main(argv=None) -> None:
    args = parse_args(argv)
    out_dir = args.out_dir or default_out_dir(args.tokenizer)
    try:
        writable_dir(out_dir, "--out_dir", "pass a folder for the dataset (it is made if missing)")
        if args.format == "chat":
            from data.prepare_chat import prepare_chat
            if not args.input:
                raise InputError("--format chat needs --input: JSONL files of conversations")
            prepare_chat(args.input, out_dir, args.tokenizer, args.chat_template, args.train_on or "all",
                         args.context, args.overlong, args.val_fraction, args.force)
            return
        if args.format in ("preference", "prompts"):
            if not args.input:
                raise InputError(f"--format {args.format} needs --input: JSONL files of "
                                 f"{'preference pairs' if args.format == 'preference' else 'prompts'}")
            if args.train_on is not None:
                raise InputError(f"--train_on {args.train_on} applies to --format chat: "
                                 + ("a preference pair trains on every token of each answer after the prompt (TRL's "
                                    "completion mask)" if args.format == "preference" else
                                    "online RL trains on the answers it samples") + "; fix: leave --train_on out")
        if args.format == "prompts":
            from data.prepare_prompts import prepare_prompts
            prepare_prompts(args.input, out_dir, args.tokenizer, args.chat_template, args.context, args.val_fraction,
                            args.force)
            return
        if args.format == "preference":
            from data.prepare_preference import prepare_preference
            prepare_preference(args.input, out_dir, args.tokenizer, args.chat_template, args.context, args.overlong,
                               args.val_fraction, args.force)
            return
        inputs = args.input or [download_shakespeare(out_dir)]
        prepare(inputs, out_dir, args.tokenizer, args.text_key, args.split_blank_lines, args.val_fraction,
                args.workers, args.chunk_mb, args.force)
    except (InputError, TokenizerError, OverflowError, ConfigError) as e:
        exit_bad_input(e)


def parse_args(argv) -> argparse.Namespace:
    parser = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", action="append", help="a file, folder, glob or hf:NAME[:CONFIG[:SPLIT]]; "
                        "repeat for several (default: download tinyshakespeare)")
    parser.add_argument("--tokenizer", default="char", help="char, gpt2, tiktoken:NAME, PATH/tokenizer.json, "
                        "bpe:SIZE, or a folder: a dataset's or an export's tokenizer (default: char)")
    parser.add_argument("--out_dir", help="default: data/shakespeare_<tokenizer>")
    parser.add_argument("--text_key", default="text", help="the text field of JSONL, Parquet and HF records")
    parser.add_argument("--split_blank_lines", action="store_true", help="a .txt holds documents separated by "
                                                                         "blank lines (default: a file is one)")
    parser.add_argument("--val_fraction", type=float, default=0.01, help="share of documents held out (by hash)")
    parser.add_argument("--workers", type=int, default=os.cpu_count(), help="processes (default: all cores)")
    parser.add_argument("--chunk_mb", type=float, default=16, help="JSONL is cut into pieces of this size (MB)")
    parser.add_argument("--force", action="store_true", help="replace a dataset of other inputs or options in "
                                                             "--out_dir")
    chat = parser.add_argument_group("conversations, preference pairs and prompts (--format chat: "
                                     "data/prepare_chat.py; preference: data/prepare_preference.py; prompts: "
                                     "data/prepare_prompts.py)")
    chat.add_argument("--format", choices=["text", "chat", "preference", "prompts"], default="text", help="documents "
                      "of text, conversations (messages, ShareGPT or Alpaca JSONL) for fine-tuning, preference pairs "
                      "(prompt, chosen, rejected JSONL) for DPO, or prompts (and what the reward reads) for online RL")
    chat.add_argument("--chat_template", help="a Jinja chat template file or a built-in name (plain, lines, chatml, "
                      "hermes: plain with tools); "
                      "default: the tokenizer's tokenizer_config.json, else plain (lines for a tokenizer without an "
                      "end-of-text token)")
    chat.add_argument("--train_on", choices=["all", "last", "everything"], help="chat only: the loss trains on "
                      "every assistant turn (default: all), on the last, or on every token (prompts too)")
    chat.add_argument("--context", type=int, default=1024, help="the model's block_size: longer conversations are "
                      "cut or left out")
    chat.add_argument("--overlong", choices=["truncate", "drop"], default="truncate")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
