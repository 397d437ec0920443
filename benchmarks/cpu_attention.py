"""One layer's causal attention on a CPU, forward and backward, in bf16: torch's flash kernel against this repo's
(model/cpu_attention.py: the same forward, the backward as batched bf16 matmuls), taking turns.

    python benchmarks/cpu_attention.py                                   # the baby GPT's and smaller shapes
    python benchmarks/cpu_attention.py --shapes 12x6x256x64 4x12x512x64  # batch x heads x context x head_dim

Queries, keys and values are laid out as the model's split_heads leaves them. For each shape: the median
milliseconds of each kernel over --rounds turns of --steps steps, and how far each one's gradients are from the
exact ones (fp64), as the relative error of the gradients' norm (the largest of q's, k's and v's)."""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report import at_least, environment, print_table, results_file, run_main, write_json
from common.checks import ConfigError, ToolParser

SHAPES = ["12x6x256x64", "6x12x128x64", "12x6x64x64", "12x4x64x32"]


def shape(text: str) -> tuple[int, ...]:
    parts = text.split("x")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ConfigError(f"--shapes {text}: must be batch x heads x context x head_dim, e.g. 12x6x256x64; fix: write "
                          f"four positive whole numbers joined by x")
    return tuple(int(p) for p in parts)


def measure(dims: tuple[int, ...], rounds: int, steps: int) -> dict:
    import torch
    import torch.nn.functional as F

    from model.cpu_attention import cpu_causal_attention

    B, H, T, D = dims
    generator = torch.Generator().manual_seed(0)
    q, k, v, upstream = (torch.randn(B, T, H, D, generator=generator).bfloat16().transpose(1, 2) for _ in range(4))
    kernels = {"flash": lambda *qkv: F.scaled_dot_product_attention(*qkv, is_causal=True),
               "matmul backward": cpu_causal_attention}
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    exact_grads = torch.autograd.grad(F.scaled_dot_product_attention(*exact, is_causal=True), exact, upstream.double())
    leaves = [t.requires_grad_() for t in (q, k, v)]

    def step(kernel):
        return torch.autograd.grad(kernel(*leaves), leaves, upstream)

    result = {}
    for name, kernel in kernels.items():
        grads = step(kernel)
        result[name] = {"ms": [], "gradient_error": max(((g.double() - e).norm() / e.norm()).item()
                                                        for g, e in zip(grads, exact_grads))}
    for _ in range(rounds):
        for name, kernel in kernels.items():
            start = time.perf_counter()
            for _ in range(steps):
                step(kernel)
            result[name]["ms"].append((time.perf_counter() - start) / steps * 1e3)
    for figures in result.values():
        figures["median_ms"] = statistics.median(figures.pop("ms"))
    return result


def main() -> int:
    parser = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=SHAPES, help="batch x heads x context x head_dim")
    parser.add_argument("--rounds", type=int, default=8, help="turns of each kernel")
    parser.add_argument("--steps", type=int, default=5, help="forward and backward passes a turn")
    parser.add_argument("--json", default="out/benchmarks/cpu_attention.json")
    args = parser.parse_args()
    at_least(args, 1, "rounds", "steps")
    shapes = [shape(s) for s in args.shapes]
    json_path = results_file(args.json)

    import torch

    results = {"x".join(map(str, dims)): measure(dims, args.rounds, args.steps) for dims in shapes}
    rows = [[name, f"{r['flash']['median_ms']:.2f}", f"{r['matmul backward']['median_ms']:.2f}",
             f"{r['flash']['median_ms'] / r['matmul backward']['median_ms']:.2f}x",
             f"{r['flash']['gradient_error']:.4f}", f"{r['matmul backward']['gradient_error']:.4f}"]
            for name, r in results.items()]
    report = {**environment(torch.device("cpu")), "results": results}
    print(f"\nbf16 causal attention, forward and backward, on {report['device']}")
    print_table(["batch x heads x context x head_dim", "flash ms", "matmul backward ms", "speed-up",
                 "flash gradient error", "matmul backward gradient error"], rows)
    write_json(json_path, report)
    return 0


if __name__ == "__main__":
    run_main(main)
