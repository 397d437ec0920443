"""Generation speed on one process: a greedy continuation through the key/value cache, through the full-window
sampler (a forward pass over the whole window for every token), and through transformers' generate on the same
weights exported (fp32 all three, the same torch threads, one after the other, --repeats rounds of the three,
the best of each kept). Per preset shape, with random weights: the time to the first token (the prompt's
prefill) and decode tokens/s (the new tokens after the first, over the time they took; transformers' read off
its streamer's calls).

    python benchmarks/generation.py                       # llama_124m and quickstart: prompts of half the context
    python benchmarks/generation.py --presets llama_124m --prompt 128 --new 64 --json gen.json

A preset's vocabulary is its own, or N for a `bpe:N` tokenizer (benchmarks/gpu_figures.py's rule); the model's
weights are random (a benchmark of speed: every continuation has exactly --new tokens, no stop).
"""
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.gpu_figures import preset_vocab
from benchmarks.report import at_least, device_description, print_table, results_file, run_main, write_json
from common.checks import ConfigError, ToolParser

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def model_config(preset: str, prompt: int | None, new: int):
    from training.config import load_run_config

    path = os.path.join(REPO, "configs", f"{preset}.yaml")
    if not os.path.isfile(path):
        raise ConfigError(f"--presets {preset}: configs/{preset}.yaml does not exist; fix: name a file of configs/")
    vocab = preset_vocab(path)
    cfg = load_run_config(path, [f"model.vocab_size={65 if vocab == 'null' else vocab}", "model.dropout=0"]).model
    if (prompt or cfg.block_size // 2) + new > cfg.block_size:
        raise ConfigError(f"--prompt {prompt} + --new {new} > {preset}'s context of {cfg.block_size}; fix: ask for "
                          f"fewer tokens")
    return cfg


def add_batch_arguments(parser) -> None:
    """The arguments of a benchmark that decodes --clients sequences together at presets' shapes, in --rounds."""
    parser.add_argument("--presets", default="llama_124m", help="comma-separated names of configs/")
    parser.add_argument("--clients", type=int, default=8, help="sequences decoded together")
    parser.add_argument("--prompt", type=int, help="prompt tokens (default: half the preset's context)")
    parser.add_argument("--new", type=int, default=32, help="tokens decoded after each prompt")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write the figures here")


def checked_presets(args) -> list[str]:
    """--presets' names, each preset's shape against --prompt and --new and --json's file checked before the first
    is measured."""
    presets = args.presets.split(",")
    for preset in presets:
        model_config(preset, args.prompt, args.new)
    if args.json:
        results_file(args.json)
    return presets


def timed(decoder, prompt: list[int], new: int) -> tuple[float, float]:
    """(seconds to the first token's logits, decode tokens/s of the rest) of one greedy continuation."""
    start = time.perf_counter()
    slot, logits = decoder.start(prompt)
    first = time.perf_counter() - start
    for _ in range(new - 1):
        logits = decoder.step({slot: [int(logits.argmax())]})[slot]
    decoder.release(slot)
    return first, (new - 1) / (time.perf_counter() - start - first)


class _Clock:
    """transformers' streamer interface, keeping the time of each put(): the prompt's, then each new token's."""

    def __init__(self):
        self.times = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def timed_transformers(model, prompt: list[int], new: int) -> tuple[float, float]:
    """As timed(), read off one generate call: its first token ends the prefill, the rest are its decode."""
    clock, start = _Clock(), time.perf_counter()
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                         pad_token_id=0, streamer=clock)
    assert out.size(1) == len(prompt) + new and len(clock.times) == 1 + new
    return clock.times[1] - start, (new - 1) / (clock.times[-1] - clock.times[1])


@torch.no_grad()
def measure(preset: str, prompt_len: int | None, new: int, repeats: int) -> dict:
    import transformers

    from model import build_model
    from model.generate import CachedDecoder, WindowDecoder
    from training.checkpoints.export import write_export

    cfg = model_config(preset, prompt_len, new)
    prompt_len = prompt_len or cfg.block_size // 2
    model = build_model(cfg).eval()
    prompt = torch.randint(0, cfg.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    ways = {"cache": lambda: timed(CachedDecoder(model, cfg.block_size, cfg.vocab_size), prompt, new),
            "full window": lambda: timed(WindowDecoder(model, cfg.block_size, cfg.vocab_size, torch.device("cpu")),
                                         prompt, new)}
    with tempfile.TemporaryDirectory() as folder:
        write_export(folder, cfg, model.state_dict(), {"tokenizer": "char", "vocab_size": cfg.vocab_size}, step=0)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ways["transformers"] = lambda: timed_transformers(theirs, prompt, new)
    runs = {way: [] for way in ways}
    for _ in range(repeats):  # in turn, so that a noisy moment of the machine falls on each way alike
        for way, run in ways.items():
            runs[way].append(run())
    results = {way: {"first_token_s": min(r[0] for r in rs), "decode_tokens_per_s": max(r[1] for r in rs)}
               for way, rs in runs.items()}
    return {"parameters": sum(p.numel() for p in model.parameters()), "block_size": cfg.block_size,
            "prompt": prompt_len, "new": new, **results}


def main() -> int:
    parser = ToolParser(description=__doc__)
    parser.add_argument("--presets", default="llama_124m,quickstart", help="comma-separated names of configs/")
    parser.add_argument("--prompt", type=int, help="prompt tokens (default: half the preset's context)")
    parser.add_argument("--new", type=int, default=32, help="tokens generated after the prompt")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    at_least(args, 1, "repeats", *(["prompt"] if args.prompt is not None else []))
    at_least(args, 2, "new")
    presets = checked_presets(args)
    report = {"device": device_description(torch.device("cpu")), "results": {}}
    rows = []
    for preset in presets:
        r = report["results"][preset] = measure(preset, args.prompt, args.new, args.repeats)
        for way in ("cache", "full window", "transformers"):
            speed = r[way]["decode_tokens_per_s"]
            rows.append([preset, f"{r['parameters'] / 1e6:.1f}M", r["prompt"], way,
                         f"{r[way]['first_token_s'] * 1e3:.0f} ms", f"{speed:.1f}",
                         f"{speed / r['full window']['decode_tokens_per_s']:.1f}x"])
    print(f"{report['device']}: greedy, fp32, {args.new} new tokens, best of {args.repeats}")
    print_table(["preset", "parameters", "prompt", "generation", "first token", "decode tokens/s",
                 "vs full window"], rows)
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    run_main(main)
