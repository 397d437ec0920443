"""Data preparation and loading speed: tokens/s per worker, scaling to 2 workers, peak memory against corpus
size, and the time to assemble a micro-batch from a blend.

    python benchmarks/data.py                      # ~100 MB and ~1 GB JSONL corpora under /tmp, deleted after
    python benchmarks/data.py --small_mb 20 --large_mb 200 --work_dir /tmp/bench

The corpora are real text (tinyshakespeare speeches and Python standard library docstrings, repeated with a
counter in each record so no two documents are equal). The tokenizer is the GPT-2 one where tiktoken has its
files (`--tokenizer gpt2`); offline (the default), an equivalent tiktoken encoding is built here: GPT-2's
split pattern and byte-level BPE with merges trained by `tokenizers` on the same text (`--bpe_size`
ids), run by tiktoken's GPT-2 code path. Each preparation runs in a fresh process (`python -m data.prepare`);
its peak resident memory is the largest of that process and its workers. Prints a table, writes JSON.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.report import at_least, print_table, results_file, run_main, work_folder, write_json
from common.checks import ToolParser, existing_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# $SHAKESPEARE_TXT, else the shared copy beside the repo, else the quickstart's download (as the tests).
TEXTS = (os.path.join(REPO, "..", "shared", "data", "tinyshakespeare.txt"),
         os.path.join(REPO, "data", "shakespeare_char", "input.txt"))
SHAKESPEARE = os.environ.get("SHAKESPEARE_TXT") or next((p for p in TEXTS if os.path.isfile(p)), TEXTS[-1])


def corpus_documents() -> list[str]:
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from corpora import docstrings, speeches

    return speeches(SHAKESPEARE) + docstrings()


def write_jsonl(path: str, documents: list[str], megabytes: float) -> int:
    """Records {"text": ...} cycling through `documents` until the file holds `megabytes`; returns records."""
    target, written, n = megabytes * 2**20, 0, 0
    with open(path, "w") as f:
        while written < target:
            line = json.dumps({"text": f"{documents[n % len(documents)]}\n[{n}]"}) + "\n"
            f.write(line)
            written, n = written + len(line), n + 1
    return n


def local_gpt2_like(documents: list[str], size: int, directory: str) -> str:
    """A tiktoken encoding with GPT-2's split pattern and `size` byte-level BPE ranks trained here, saved as
    a tokenizer directory (tokenizer.tiktoken + its meta); returns the directory."""
    import tiktoken
    from tokenizers.pre_tokenizers import ByteLevel

    from data.tokenizers import TiktokenTokenizer, train_bpe

    hf = train_bpe(iter(documents), size).tokenizer
    byte_of = {c: b for b, c in zip(range(256), _gpt2_bytes_to_unicode())}
    ranks = {bytes(byte_of[c] for c in token): i for token, i in hf.get_vocab().items() if token != "<|endoftext|>"}
    ranks = {token: rank for rank, (token, _) in enumerate(sorted(ranks.items(), key=lambda kv: kv[1]))}
    assert len(ByteLevel.alphabet()) == 256
    gpt2_pattern = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    tokenizer = TiktokenTokenizer(tiktoken.Encoding("gpt2_local", pat_str=gpt2_pattern, mergeable_ranks=ranks,
                                                    special_tokens={}))
    sample = documents[::97]  # tiktoken runs the same BPE as tokenizers: the same ids (theirs less the EOT at 0)
    assert [tokenizer.encode(d) for d in sample] == [[i - 1 for i in e.ids] for e in hf.encode_batch(sample)]
    print(f"local GPT-2-like encoding: {tokenizer.vocab_size:,} ids (tiktoken, GPT-2 pattern, BPE trained here)")
    tokenizer.save(directory)
    with open(os.path.join(directory, "meta.json"), "w") as f:
        json.dump({"tokenizer": tokenizer.name, **tokenizer.meta()}, f)
    return directory


def _gpt2_bytes_to_unicode() -> list[str]:
    """GPT-2's printable stand-ins for bytes 0..255 (what byte-level BPE vocabularies are written in)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b], extra = chr(256 + extra), extra + 1
    return [chars[b] for b in range(256)]


PREPARE = """
import json, resource, sys, time
from data.prepare import prepare
from data.tokenizers import load_tokenizer
corpus, out_dir, tokenizer, workers, val = (sys.argv[1:] + ["0.005"])[:5]
tok = load_tokenizer(tokenizer) if not tokenizer.startswith(("gpt2", "tiktoken:")) else tokenizer
start = time.perf_counter()
meta = prepare([corpus], out_dir, tok, workers=int(workers), val_fraction=float(val))
seconds = time.perf_counter() - start
rss = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
print(json.dumps({"seconds": seconds, "tokens": meta["train_tokens"] + meta["val_tokens"], "peak_rss_mb": rss / 1024}))
"""


def measure_prepare(corpus: str, out_dir: str, tokenizer: str, workers: int) -> dict:
    shutil.rmtree(out_dir, ignore_errors=True)
    proc = subprocess.run([sys.executable, "-c", PREPARE, corpus, out_dir, tokenizer, str(workers)], cwd=REPO,
                          capture_output=True, text=True, check=True)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {**result, "tokens_per_s": result["tokens"] / result["seconds"],
            "corpus_mb": os.path.getsize(corpus) / 2**20, "workers": workers}


def measure_batches(plays: str, docs: str, iters: int = 2000) -> dict:
    """Mean time of TokenData.train_batch: micro 12 x 1024 from a 0.3/0.7 blend of two prepared datasets."""
    import numpy as np
    import torch

    from data.token_data import TokenData
    from training.topology import Layout

    data = TokenData(None, None, 1024, [{"dir": plays, "weight": 0.3}, {"dir": docs, "weight": 0.7}])
    layout, cpu = Layout(8, 1, 12, 4), torch.device("cpu")
    data.train_batch(0, 1, 0, 0, layout, cpu)  # the first epoch's permutations are drawn once
    times = []
    for step in range(2, iters + 2):
        start = time.perf_counter()
        data.train_batch(0, step, step % 4, step % 8, layout, cpu)
        times.append(time.perf_counter() - start)
    return {"mean_ms": 1e3 * float(np.mean(times)), "p99_ms": 1e3 * float(np.percentile(times, 99))}


def check(args) -> None:
    """The arguments and the text, before any corpus is written."""
    at_least(args, 1, "small_mb")  # its validation split (0.5%) must hold a window of 1,025 tokens, blended below
    at_least(args, args.small_mb, "large_mb")  # the memory ratio is large over small
    at_least(args, 257, "bpe_size")  # the 256 byte tokens and <|endoftext|>
    results_file(args.json)
    existing_file(SHAKESPEARE, "the text", "set SHAKESPEARE_TXT to the path of tinyshakespeare.txt")
    work_folder(args.work_dir)


def main(argv=None) -> None:
    parser = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small_mb", type=float, default=100)
    parser.add_argument("--large_mb", type=float, default=1000)
    parser.add_argument("--tokenizer", default="local", help="local (built here, offline) or gpt2 / tiktoken:NAME")
    parser.add_argument("--bpe_size", type=int, default=50_257)
    parser.add_argument("--work_dir", default="/tmp")
    parser.add_argument("--json", default=os.path.join(REPO, "out", "benchmarks", "data.json"))
    args = parser.parse_args(argv)
    check(args)
    work = tempfile.mkdtemp(prefix="megalite_data_bench_", dir=args.work_dir)
    try:
        documents = corpus_documents()
        tokenizer = args.tokenizer
        if tokenizer == "local":
            os.makedirs(os.path.join(work, "tokenizer"))
            tokenizer = local_gpt2_like(documents, args.bpe_size, os.path.join(work, "tokenizer"))
        corpora = {}
        for name, mb in (("small", args.small_mb), ("large", args.large_mb)):
            corpora[name] = os.path.join(work, f"{name}.jsonl")
            write_jsonl(corpora[name], documents, mb)
        runs = [measure_prepare(corpora["small"], os.path.join(work, "out1"), tokenizer, 1),
                measure_prepare(corpora["small"], os.path.join(work, "out2"), tokenizer, 2),
                measure_prepare(corpora["large"], os.path.join(work, "out_large"), tokenizer, 2)]
        shutil.rmtree(os.path.join(work, "out_large"))
        os.remove(corpora["large"])
        with open(os.path.join(work, "docs.jsonl"), "w") as f:
            f.writelines(json.dumps({"text": d}) + "\n" for d in documents[-3000:])
        subprocess.run([sys.executable, "-c", PREPARE, os.path.join(work, "docs.jsonl"), os.path.join(work, "docs"),
                        tokenizer, "1", "0.1"], cwd=REPO, check=True, capture_output=True)
        batches = measure_batches(os.path.join(work, "out2"), os.path.join(work, "docs"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    speedup = runs[1]["tokens_per_s"] / runs[0]["tokens_per_s"]
    memory_ratio = runs[2]["peak_rss_mb"] / runs[1]["peak_rss_mb"]
    print_table(["corpus", "workers", "tokens", "seconds", "tokens/s", "tokens/s per worker", "peak RSS"],
                [[f"{r['corpus_mb']:,.0f} MB JSONL", r["workers"], f"{r['tokens']:,}", f"{r['seconds']:.1f}",
                  f"{r['tokens_per_s']:,.0f}", f"{r['tokens_per_s'] / r['workers']:,.0f}",
                  f"{r['peak_rss_mb']:,.0f} MB"]
                 for r in runs])
    print(f"\n2 workers / 1 worker: {speedup:.2f}x; peak RSS {args.large_mb:,.0f} MB / {args.small_mb:,.0f} MB corpus: "
          f"{memory_ratio:.3f}; micro-batch 12 x 1024 from a 0.3/0.7 blend: {batches['mean_ms']:.3f} ms mean, "
          f"{batches['p99_ms']:.3f} ms p99")
    write_json(args.json, {"tokenizer": args.tokenizer if args.tokenizer != "local" else
                           f"local GPT-2-like tiktoken BPE ({args.bpe_size} ids requested)", "prepare": runs,
                           "speedup_2_workers": speedup, "peak_rss_ratio": memory_ratio, "batch": batches})


if __name__ == "__main__":
    run_main(main)
