"""Tensor parallelism, measured: tp = 2 against tp = 1 and dp = 2 for one model, with per-rank model states
and the tensor-parallel communication per step next to the theory.

    python benchmarks/tensor_parallel.py                          # baby GPT, fp32, ZeRO-0, 10 steps
    python benchmarks/tensor_parallel.py --config configs/llama_quickstart.yaml --steps 20

Each layout is a real `deepspeed --num_gpus N train.py` run (one thread per rank on CPU, so each rank is one
"device"): tp 1 on one rank, dp 2 and tp 2 on two. Every rank runs train.py under this file, which counts the
bytes each rank sends through the tensor-parallel all-reduces of model/tensor_parallel.py and the live tensor
storage after each optimizer step, without changing what train.py does. Theory:
- model states kept between steps per rank: bytes per parameter (12 in fp32 with AdamW and no ZeRO: the
  weights and two moments; DeepSpeed frees the gradients at the step) x the parameters a rank holds, every
  replicated one whole and each split one divided by tp;
- communication (Megatron-LM, no sequence parallelism): per layer and micro-batch, four all-reduces of the
  b x s x h activations (two forward, two backward), plus the vocabulary-parallel embedding's forward and
  the LM head input's backward (b x s x h each) and the cross-entropy's three b x s fp32 reductions; a ring
  all-reduce moves 2 (t - 1) / t of that payload in and out of each rank.
Tokens/s is train.py's own meter over the timed steps (the first step, evaluation and saving excluded).
Prints a table, writes JSON.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.report import (
    REPO,
    at_least,
    launch_recorded,
    load_inputs,
    print_table,
    results_file,
    run_main,
    run_recorded_rank,
    work_folder,
    write_json,
)
from common.checks import ConfigError, ToolParser

# name: (ranks, ds_config)
LAYOUTS = {"tp1": (1, "zero1.json"), "dp2": (2, "zero1.json"), "tp2": (2, "tp2.json")}
FP32_ADAMW_KEPT_BYTES = 12  # fp32 weights and Adam's two moments


def counted_rank(record: str) -> None:
    """One rank of train.py, with its tensor-parallel all-reduces and its live tensors after each step counted."""
    import model.tensor_parallel as parallel
    from benchmarks.memory import live_tensor_bytes
    from training.observers import Observer

    sent = {"bytes": 0}
    all_reduce = parallel._all_reduce

    def counting(x, tp, *op):
        if tp.group is not None:
            sent["bytes"] += x.numel() * x.element_size()
        return all_reduce(x, tp, *op)

    parallel._all_reduce = counting
    steps = []

    class Measured(Observer):
        def before_step(self, step, driver, micro_batches):
            self.before = sent["bytes"]

        def after_step(self, step, driver, loss):
            steps.append({"tp_bytes": sent["bytes"] - self.before, "states": live_tensor_bytes(driver.engine.device),
                          "params": sum(p.numel() for p in driver.engine.module.parameters())})

    run_recorded_rank(record, steps, Measured())


def settings(name: str, args) -> list[str]:
    """train.py's key=value for one layout: the same global batch in every layout, hardly any evaluation, saving
    or sampling."""
    micro = args.micro_batch // 2 if name == "dp2" else args.micro_batch
    return ["train.resume=none", f"train.max_steps={args.steps}", f"train.log_interval={args.steps}",
            "train.eval_interval=1000000", "train.eval_windows=1", "train.save_interval=0", "sample.max_new_tokens=1",
            "ds.gradient_accumulation_steps=1", f"ds.train_micro_batch_size_per_gpu={micro}", *args.overrides]


def check(args):
    """Every layout's settings, as train.py will read them, before the first run; returns the model settings the
    theory is computed for."""
    at_least(args, 2, "steps")  # the first step is not timed
    at_least(args, 2, "micro_batch")
    if args.micro_batch % 2:
        raise ConfigError(f"--micro_batch={args.micro_batch}: must be even (dp2 splits it over its 2 replicas); "
                          f"fix: set --micro_batch to {args.micro_batch + 1}")
    if not args.link_gb_s > 0:
        raise ConfigError(f"--link_gb_s={args.link_gb_s}: must be > 0; fix: give the link's bandwidth in GB/s")
    results_file(args.json)
    for name, (_, ds_config) in LAYOUTS.items():
        cfg, _, _ = load_inputs(args.config, f"ds_configs/{ds_config}", settings(name, args), REPO)
    if args.work_dir:
        args.work_dir = work_folder(os.path.join(REPO, args.work_dir))
    return cfg.model  # the same in every layout: only the ds_config and the micro-batch differ


def measure(name: str, args) -> dict:
    ranks, ds_config = LAYOUTS[name]
    return launch_recorded(__file__, name, ranks, args.config, ds_config, settings(name, args), args.work_dir)


def theory(cfg, tp_size: int, micro_batch: int, activation_bytes: int) -> dict:
    import torch

    from model import build_model
    from model.tensor_parallel import TensorParallel, split_rule

    with torch.device("meta"):
        params = [(p.numel(), split_rule(p)) for p in build_model(cfg, tp=TensorParallel(tp_size)).parameters()]
    per_rank = sum(n for n, _ in params)
    tokens = micro_batch * cfg.block_size
    payload = (4 * cfg.n_layer + 2) * tokens * cfg.n_embd * activation_bytes + 3 * tokens * 4 if tp_size > 1 else 0
    return {"params": per_rank, "states": FP32_ADAMW_KEPT_BYTES * per_rank, "tp_bytes": payload,
            "ring_bytes": 2 * (tp_size - 1) / tp_size * payload}


def main() -> None:
    parser = ToolParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/baby_gpt.yaml")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--micro_batch", type=int, default=8, help="sequences per step (split over dp2's replicas)")
    parser.add_argument("--link_gb_s", type=float, default=450.0,
                        help="per-direction link bandwidth for the GPU estimate (H100 NVLink: 450 GB/s)")
    parser.add_argument("--work_dir", default=None)
    parser.add_argument("--json", default="out/benchmarks/tensor_parallel.json")
    parser.add_argument("--record", help=argparse.SUPPRESS)  # a rank of one measurement, under the launcher
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", default=["ds.bf16.enabled=false", "ds.zero_optimization.stage=0",
                                                         "model.dropout=0"],
                        help="key=value for train.py (default: fp32, ZeRO-0, dropout 0)")
    if "--record" in sys.argv:
        args, _ = parser.parse_known_args(sys.argv[1:sys.argv.index("--")])
        return counted_rank(args.record)
    args = parser.parse_args()
    cfg = check(args)

    results = {name: measure(name, args) for name in LAYOUTS}
    activation_bytes = 2 if any(o == "ds.bf16.enabled=true" for o in args.overrides) else 4
    rows = []
    for name, result in results.items():
        tp_size = 2 if name == "tp2" else 1
        expected = theory(cfg, tp_size, args.micro_batch, activation_bytes)
        worst = max(result["ranks"], key=lambda r: r["states"])
        result["theory"] = expected
        rows.append([name, f"{result['tokens_per_s']:,.0f}", f"{worst['params']:,}", f"{expected['params']:,}",
                     f"{worst['states'] / 2**20:.1f}", f"{expected['states'] / 2**20:.1f}",
                     f"{worst['tp_bytes'] / 2**20:.2f}", f"{expected['tp_bytes'] / 2**20:.2f}",
                     f"{expected['ring_bytes'] / 2**20:.2f}"])
    print(f"\n{args.config}, {args.steps} steps, global batch {args.micro_batch}, one thread per rank")
    print_table(["layout", "tokens/s", "params/rank", "theory", "states kept MiB (live tensors)", "theory MiB",
                 "TP all-reduce payload MiB/step", "Megatron formula", "ring traffic per rank MiB"], rows)
    tp1, tp2, dp2 = (results[n] for n in ("tp1", "tp2", "dp2"))
    ratio = max(r["states"] for r in tp2["ranks"]) / max(r["states"] for r in tp1["ranks"])
    print(f"model states per rank tp2 / tp1: {ratio:.1%} measured, "
          f"{tp2['theory']['states'] / tp1['theory']['states']:.1%} theory")
    print(f"tokens/s tp2 / tp1: {tp2['tokens_per_s'] / tp1['tokens_per_s']:.2f}x on 2 ranks "
          f"(dp2 / tp1: {dp2['tokens_per_s'] / tp1['tokens_per_s']:.2f}x)")
    seconds = tp2["theory"]["ring_bytes"] / (args.link_gb_s * 1e9)
    print(f"GPU estimate: {tp2['theory']['ring_bytes'] / 2**20:.2f} MiB of ring traffic per rank and step takes "
          f"{1e6 * seconds:.0f} us at {args.link_gb_s:g} GB/s")
    write_json(args.json, {"config": args.config, "steps": args.steps, "micro_batch": args.micro_batch,
                           "overrides": args.overrides, "results": results})


if __name__ == "__main__":
    run_main(main)
