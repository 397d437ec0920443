"""Continuous batching through the server (`python -m scripts.serve`): the total tokens/s that N clients get
asking at once, against the same N requests sent one at a time, for each N of --clients. Per preset shape, with
random weights and the preset's tokenizer trained on tinyshakespeare (a `bpe:N` tokenizer reaches the vocabulary
that text has: 21,527 ids of llama_124m's 50,000), fp32 on the CPU. Each request is a greedy /v1/completions of
--new tokens after a prompt of --prompt tokens (its own part of the text), the end of text ignored.

    python benchmarks/serving.py                        # llama_124m and quickstart; 1, 4 and 16 clients
    python benchmarks/serving.py --presets quickstart --clients 1,8 --prompt 16 --new 40 --json serving.json
"""
import os
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.data import SHAKESPEARE
from benchmarks.report import at_least, device_description, print_table, results_file, run_main, write_json
from common.checks import ConfigError, ToolParser, existing_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def prompt_length(preset: str, prompt: int | None, new: int) -> int:
    """The prompt's tokens (default: a quarter of the preset's context), checked to leave room for `new`."""
    from training.config import load_run_config

    path = os.path.join(REPO, "configs", f"{preset}.yaml")
    if not os.path.isfile(path):
        raise ConfigError(f"--presets {preset}: configs/{preset}.yaml does not exist; fix: name a file of configs/")
    block_size = load_run_config(path, []).model.block_size
    length = prompt or block_size // 4
    if length + new > block_size:
        raise ConfigError(f"--prompt {length} + --new {new} > {preset}'s context of {block_size}; fix: ask for "
                          f"fewer tokens")
    return length


def preset_export(preset: str, text: str, folder: str) -> tuple[str, dict, object]:
    """An export of `preset`'s model shape, random weights, over its tokenizer prepared from `text`; the shape's
    figures; the tokenizer."""
    from data.prepare import prepare
    from data.tokenizers import tokenizer_from_meta
    from model import build_model
    from training.checkpoints.export import write_export
    from training.config import load_run_config

    path = os.path.join(REPO, "configs", f"{preset}.yaml")
    tokenizer = load_run_config(path, []).data.tokenizer or "char"
    data = os.path.join(folder, f"{preset}_data")
    meta = prepare([text], data, tokenizer, split_blank_lines=tokenizer != "char")
    cfg = load_run_config(path, [f"model.vocab_size={meta['vocab_size']}", "model.dropout=0"]).model
    export = os.path.join(folder, preset)
    model = build_model(cfg)
    write_export(export, cfg, model.state_dict(), meta, step=0, data_dir=data)
    return export, {"parameters": sum(p.numel() for p in model.parameters()),
                    "block_size": cfg.block_size, "vocab_size": meta["vocab_size"]}, tokenizer_from_meta(meta, data)


class Server:
    """`python -m scripts.serve` on a free loopback port, until stopped."""

    def __init__(self, export: str, slots: int):
        import httpx

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.proc = subprocess.Popen([sys.executable, "-m", "scripts.serve", "--export", export, "--port", str(port),
                                      "--slots", str(slots), "--max_queue", str(slots), "--name", "bench"], cwd=REPO,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.url = f"http://127.0.0.1:{port}"
        self.client = httpx.Client(timeout=600)  # keeps its connections, as the openai client does
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server ended at its start:\n{self.proc.stdout.read()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("the server did not answer /health within 300 s")

    def complete(self, prompt: str, new: int) -> int:
        """The tokens generated for one greedy request of `new` tokens (all of them, or an error)."""
        reply = self.client.post(f"{self.url}/v1/completions", json={
            "model": "bench", "prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True})
        reply.raise_for_status()
        usage = reply.json()["usage"]
        assert usage["completion_tokens"] == new, usage
        return usage["completion_tokens"]

    def stop(self) -> None:
        self.client.close()
        self.proc.terminate()
        self.proc.wait(timeout=60)


def prompts(text: str, tokenizer, count: int, length: int) -> list[str]:
    """`count` prompts of `length` tokens each (give or take one where BPE merges differently across the cut),
    each from its own part of the text."""
    with open(text, encoding="utf-8") as f:
        ids = tokenizer.encode(f.read()[:200_000])
    stride = (len(ids) - length) // count
    return [tokenizer.decode(ids[i * stride:i * stride + length]) for i in range(count)]


def tokens_per_s(server: Server, asked: list[str], new: int, together: bool) -> float:
    start = time.perf_counter()
    if together:
        with ThreadPoolExecutor(len(asked)) as pool:
            total = sum(pool.map(lambda p: server.complete(p, new), asked))
    else:
        total = sum(server.complete(p, new) for p in asked)
    return total / (time.perf_counter() - start)


def measure(preset: str, text: str, clients: list[int], length: int, new: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        export, shape, tokenizer = preset_export(preset, text, folder)
        server = Server(export, max(clients))
        try:
            server.complete(prompts(text, tokenizer, 1, length)[0], 2)  # a first forward pass's one-off costs
            results = {}
            for n in clients:
                asked = prompts(text, tokenizer, n, length)
                results[n] = {"one_at_a_time": tokens_per_s(server, asked, new, False),
                              "together": tokens_per_s(server, asked, new, True)}
        finally:
            server.stop()
    return {**shape, "prompt": length, "new": new, "clients": results}


def main() -> int:
    parser = ToolParser(description=__doc__)
    parser.add_argument("--presets", default="llama_124m,quickstart", help="comma-separated names of configs/")
    parser.add_argument("--clients", default="1,4,16", help="comma-separated numbers of concurrent clients")
    parser.add_argument("--prompt", type=int, help="tokens of each prompt (default: a quarter of the context)")
    parser.add_argument("--new", type=int, default=32, help="tokens generated for each request")
    parser.add_argument("--text", default=SHAKESPEARE, help="tinyshakespeare's text (default: $SHAKESPEARE_TXT, "
                                                            "else ../shared/data/tinyshakespeare.txt)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    at_least(args, 1, "new", *(["prompt"] if args.prompt is not None else []))
    try:
        clients = [int(n) for n in args.clients.split(",")]
    except ValueError:
        raise ConfigError(f"--clients {args.clients}: not a comma-separated list of numbers; fix: e.g. 1,4,16") \
            from None
    if min(clients) < 1:
        raise ConfigError(f"--clients {args.clients}: each number must be at least 1")
    existing_file(args.text, "the text (--text)", "pass the path of tinyshakespeare.txt or set SHAKESPEARE_TXT")
    presets = {preset: prompt_length(preset, args.prompt, args.new) for preset in args.presets.split(",")}
    if args.json:
        results_file(args.json)
    report = {"device": device_description(torch.device("cpu")), "results": {}}
    rows = []
    for preset, length in presets.items():
        r = report["results"][preset] = measure(preset, args.text, clients, length, args.new)
        for n, figures in r["clients"].items():
            rows.append([preset, f"{r['parameters'] / 1e6:.1f}M", r["prompt"], n, f"{figures['one_at_a_time']:.1f}",
                         f"{figures['together']:.1f}", f"{figures['together'] / figures['one_at_a_time']:.2f}x"])
    print(f"{report['device']}: the server, fp32, greedy, {args.new} new tokens a request")
    print_table(["preset", "parameters", "prompt", "clients", "one at a time tokens/s", "together tokens/s",
                 "speed-up"], rows)
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    run_main(main)
