"""What serving LoRA adapters costs the model's work (model/lora_batch.py): --clients sequences prefilled and then
decoded together through the server's engine (fp32 linear maps packed for oneDNN on a CPU, as scripts.serve runs
them) at a preset's shape with random weights, rank --rank adapters on every linear map of its blocks, three ways:
no adapter, every sequence through one adapter, each sequence through its own. Prefill and decode tokens/s, the
median of --rounds rounds taken in turn (a slow spell of a shared machine falls on each way), each way against none.

    python benchmarks/lora_serving.py                        # llama_124m's shape, 8 sequences, rank 16
    python benchmarks/lora_serving.py --presets quickstart --clients 4 --new 8 --json lora.json
"""
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.generation import add_batch_arguments, checked_presets, model_config
from benchmarks.report import at_least, device_description, print_table, run_main, write_json
from common.checks import ToolParser

WAYS = ("none", "one adapter", "own adapters")


def adapters_for(batch, rank: int, count: int) -> list:
    """`count` adapters of `rank` on every map the engine's model has, their B away from zero."""
    from model.lora_batch import Adapter

    generator = torch.Generator().manual_seed(0)
    return [batch.prepare(Adapter(f"adapter{i}", {name: (torch.randn(rank, inner, generator=generator) * 0.02,
                                                          torch.randn(out, rank, generator=generator) * 0.02)
                                                  for name, (out, inner) in batch.shapes().items()}))
            for i in range(count)]


def timed(decoder, prompts: list[list[int]], adapters: list, new: int) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s) of the prompts, each through its adapter, then `new` greedy tokens each."""
    start = time.perf_counter()
    started = [decoder.start(prompt, adapter=adapter) for prompt, adapter in zip(prompts, adapters)]
    prefilled = time.perf_counter()
    tokens = {slot: int(logits.argmax()) for slot, logits in started}
    for _ in range(new):
        tokens = {slot: int(logits.argmax()) for slot, logits in
                  decoder.step({slot: [token] for slot, token in tokens.items()}).items()}
    done = time.perf_counter()
    for slot in tokens:
        decoder.release(slot)
    return sum(map(len, prompts)) / (prefilled - start), len(prompts) * new / (done - prefilled)


@torch.no_grad()
def measure(preset: str, clients: int, prompt_len: int | None, new: int, rank: int, rounds: int) -> dict:
    from model import build_model
    from serving.engine import start_engine

    cfg = model_config(preset, prompt_len, new)
    prompt_len = prompt_len or cfg.block_size // 2
    engine = start_engine(cfg, build_model(cfg), {"tokenizer": "char", "vocab_size": cfg.vocab_size}, "cpu", "fp32",
                          clients, 0, prefix_cache_mb=0, thread=False)
    decoder = engine.scheduler.decoder
    own = adapters_for(engine.adapters, rank, clients)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, cfg.vocab_size, (prompt_len,), generator=generator).tolist() for _ in range(clients)]
    ways = {"none": [None] * clients, "one adapter": [own[0]] * clients, "own adapters": own}
    timed(decoder, prompts, ways["none"], 2)  # a first pass's one-off costs
    runs = {way: [] for way in WAYS}
    for _ in range(rounds):
        for way in WAYS:
            runs[way].append(timed(decoder, prompts, ways[way], new))
    figures = {way: {"prefill_tokens_per_s": statistics.median(r[0] for r in rs),
                     "decode_tokens_per_s": statistics.median(r[1] for r in rs)} for way, rs in runs.items()}
    adapter_params = sum(a.numel() + b.numel() for a, b in own[0].maps.values())
    return {"parameters": engine.parameters, "adapter_parameters": adapter_params, "prompt": prompt_len, **figures}


def main() -> int:
    parser = ToolParser(description=__doc__)
    add_batch_arguments(parser)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    at_least(args, 1, "clients", "new", "rank", "rounds", *(["prompt"] if args.prompt is not None else []))
    presets = checked_presets(args)
    report = {"device": device_description(torch.device("cpu")), "results": {}}
    rows = []
    for preset in presets:
        r = report["results"][preset] = measure(preset, args.clients, args.prompt, args.new, args.rank, args.rounds)
        for way in WAYS:
            rows.append([preset, f"{r['parameters'] / 1e6:.1f}M", way, f"{r[way]['prefill_tokens_per_s']:,.0f}",
                         f"{r[way]['decode_tokens_per_s']:,.1f}",
                         f"{r[way]['decode_tokens_per_s'] / r['none']['decode_tokens_per_s']:.2f}"])
    print(f"{report['device']}: fp32, {args.clients} sequences of {r['prompt']} prompt tokens + {args.new}, adapters "
          f"of rank {args.rank} on every map ({r['adapter_parameters'] / 1e6:.2f}M parameters each), median of "
          f"{args.rounds} rounds")
    print_table(["preset", "parameters", "adapters", "prefill tokens/s", "decode tokens/s", "decode vs none"], rows)
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    run_main(main)
