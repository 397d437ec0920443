"""What structured outputs cost the server's decoding (serving/structured.py): --clients sequences decoded together at a
preset's shape (random weights, fp32 linear maps packed for oneDNN on a CPU, as scripts.serve runs them) over a BPE
trained on tinyshakespeare (`bpe:N` reaches the 21,527 ids that text has), each token sampled as the scheduler samples
it, free or under a JSON schema (an object of free strings: a sequence the grammar completes starts a fresh one, so
every sequence draws --new tokens). Decode tokens/s both ways, the median of --rounds rounds taken in turn, and the
grammar's own time per token (its mask and its step).

    python benchmarks/structured_outputs.py                   # llama_124m's shape, 8 sequences
    python benchmarks/structured_outputs.py --presets quickstart --clients 4 --new 8 --json structured.json
"""
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.data import SHAKESPEARE
from benchmarks.generation import add_batch_arguments, checked_presets, model_config
from benchmarks.report import at_least, device_description, print_table, run_main, write_json
from common.checks import ToolParser, existing_file

SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}, "lines": {"type": "array",
                                                                                  "items": {"type": "string"}}},
          "required": ["title", "lines"]}


def timed(decoder, prompts: list[list[int]], new: int, fresh) -> tuple[float, float]:
    """(decode tokens/s, the grammar's seconds per token) of `new` tokens after each prompt, sampled; `fresh()` a new
    Constraint for a sequence (None: free text)."""
    from model.generate import Sampling, choose

    sampling, generator = Sampling(new), torch.Generator().manual_seed(0)
    started = [decoder.start(prompt) for prompt in prompts]
    constraints = {slot: fresh() for slot, _ in started}
    logits, grammar = dict(started), 0.0
    start = time.perf_counter()
    for _ in range(new):
        tokens = {}
        for slot, row in logits.items():
            constraint = constraints[slot]
            if constraint is None:
                tokens[slot] = choose(row, sampling, generator)
                continue
            before = time.perf_counter()
            row = constraint.masked(row)
            grammar += time.perf_counter() - before
            tokens[slot] = choose(row, sampling, generator)
            before = time.perf_counter()
            if constraint.advance(tokens[slot]):
                constraints[slot] = fresh()
            grammar += time.perf_counter() - before
        logits = decoder.step({slot: [token] for slot, token in tokens.items()})
    seconds = time.perf_counter() - start
    for slot in logits:
        decoder.release(slot)
    return len(prompts) * new / seconds, grammar / (len(prompts) * new)


@torch.no_grad()
def measure(preset: str, text: str, clients: int, prompt_len: int | None, new: int, rounds: int) -> dict:
    from data.tokenizers import train_bpe
    from model import build_model
    from serving.engine import start_engine
    from serving.structured import Grammars, grammar_of

    cfg = model_config(preset, prompt_len, new)
    tokenizer = train_bpe(text.split("\n\n"), cfg.vocab_size)
    cfg.vocab_size, prompt_len = tokenizer.vocab_size, prompt_len or cfg.block_size // 2
    engine = start_engine(cfg, build_model(cfg), {"tokenizer": "bpe", "vocab_size": cfg.vocab_size}, "cpu", "fp32",
                          clients, 0, prefix_cache_mb=0, thread=False)
    ids = tokenizer.encode(text)
    prompts = [ids[i * prompt_len:(i + 1) * prompt_len] for i in range(clients)]
    grammars = Grammars(tokenizer)
    grammar = grammar_of({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}})
    ways = {"free": lambda: None, "JSON schema": lambda: grammars.constraint(grammar, ())}
    for fresh in ways.values():  # a first pass's one-off costs (llguidance's view of the vocabulary among them)
        timed(engine.scheduler.decoder, prompts, 2, fresh)
    runs = {way: [] for way in ways}
    for _ in range(rounds):
        for way, fresh in ways.items():
            runs[way].append(timed(engine.scheduler.decoder, prompts, new, fresh))
    return {"parameters": engine.parameters, "vocab_size": cfg.vocab_size, "prompt": prompt_len,
            **{way: {"decode_tokens_per_s": statistics.median(r[0] for r in rs),
                     "grammar_ms_per_token": statistics.median(r[1] for r in rs) * 1e3} for way, rs in runs.items()}}


def main() -> int:
    parser = ToolParser(description=__doc__)
    add_batch_arguments(parser)
    parser.add_argument("--text", default=SHAKESPEARE, help="tinyshakespeare's text (default: $SHAKESPEARE_TXT, "
                                                            "else ../shared/data/tinyshakespeare.txt)")
    args = parser.parse_args()
    at_least(args, 1, "clients", "new", "rounds", *(["prompt"] if args.prompt is not None else []))
    existing_file(args.text, "the text (--text)", "pass the path of tinyshakespeare.txt or set SHAKESPEARE_TXT")
    presets = checked_presets(args)
    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    report = {"device": device_description(torch.device("cpu")), "results": {}}
    rows = []
    for preset in presets:
        r = report["results"][preset] = measure(preset, text, args.clients, args.prompt, args.new, args.rounds)
        for way in ("free", "JSON schema"):
            rows.append([preset, f"{r['parameters'] / 1e6:.1f}M", f"{r['vocab_size']:,}", way,
                         f"{r[way]['decode_tokens_per_s']:,.1f}",
                         f"{r[way]['decode_tokens_per_s'] / r['free']['decode_tokens_per_s']:.2f}",
                         f"{r[way]['grammar_ms_per_token']:.3f}"])
    print(f"{report['device']}: fp32, {args.clients} sequences of {r['prompt']} prompt tokens + {args.new} sampled, "
          f"median of {args.rounds} rounds")
    print_table(["preset", "parameters", "vocabulary", "answers", "decode tokens/s", "vs free", "grammar ms/token"],
                rows)
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    run_main(main)
