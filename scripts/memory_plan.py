"""Per-GPU memory plan for a preset under each ds_config layout: model states plus activations; with --plan, every
layout for a number of GPUs with its memory, an estimated step time and MFU, and the one to choose.

    python -m scripts.memory_plan --config configs/encoder_1b.yaml  # every shipped ds_config, 1 and 8 GPUs
    python -m scripts.memory_plan --config configs/gpt2_1.5b.yaml --ds_config ds_configs/zero3.json --gpus 8
    python -m scripts.memory_plan --config configs/llama3.1_70b.yaml --plan --gpus 64 --gpu_gb 80

What it counts, after whom, and what comes on top of it: training/memory_plan.py; the step-time model and its
assumptions: training/layout_planner.py.
"""
import argparse
import dataclasses
import glob
import os

import torch

from common.checks import ConfigError, ToolParser, exit_bad_input
from training.config import REPO_ROOT, load_run_config, split_overrides
from training.device import memory_capacity
from training.ds_config import load_ds_config
from training.layout_planner import Assumptions, plan_layouts
from training.memory_plan import ALLOWANCE, GB, PARTS, fits, plan

GPUS_PER_NODE, TOP = 8, 10
ASSUMED = ("peak_tflops", "mfu", "intra_gbps", "inter_gbps", "pcie_gbps", "cpu_adam_gparams", "host_gb")
PLAN_ONLY = ("nodes", "gpus_per_node", "global_batch", "top", *ASSUMED)  # read by --plan alone


def main(argv=None) -> None:
    parser = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="a preset, e.g. configs/encoder_1b.yaml")
    parser.add_argument("--ds_config", action="append", help="default: every shipped ds_config")
    parser.add_argument("--gpus", type=int, action="append", help="default: 1 and 8")
    parser.add_argument("--gpu_gb", type=float, help="memory of one GPU (default: this machine's GPU 0, else 80)")
    planner = parser.add_argument_group("--plan: every layout for --gpus GPUs (or --nodes x --gpus_per_node)")
    planner.add_argument("--plan", action="store_true", help="enumerate the layouts and recommend one")
    planner.add_argument("--nodes", type=int, help="nodes of --gpus_per_node GPUs, instead of --gpus")
    planner.add_argument("--gpus_per_node", type=int, help=f"default {GPUS_PER_NODE}")
    planner.add_argument("--global_batch", type=int, help="windows a step (default: 4M tokens' worth)")
    planner.add_argument("--top", type=int, help=f"layouts printed (default {TOP})")
    defaults = Assumptions()
    for name in ASSUMED:
        planner.add_argument(f"--{name}", type=float, help=f"default {getattr(defaults, name):g}")
    parser.add_argument("overrides", nargs="*", help="overrides, e.g. model.block_size=2048 "
                                                    "ds.train_micro_batch_size_per_gpu=4 (each ds_config alike)")
    args = parser.parse_args(argv)
    try:
        report(args)
    except ConfigError as e:
        exit_bad_input(e)


def report(args) -> None:
    given = [name for name in PLAN_ONLY if getattr(args, name) is not None]
    if given and not args.plan:
        raise ConfigError(f"--{given[0]} is an option of --plan, which enumerates every layout for a number of GPUs; "
                          f"fix: add --plan")
    if args.gpu_gb is None:  # the device's real capacity, else an "80 GB" H100's (79.1 GiB)
        args.gpu_gb = memory_capacity(torch.device("cuda", 0), 1)[0] / GB if torch.cuda.is_available() else 79.1
    if not args.gpu_gb > 0:  # NaN included
        raise ConfigError(f"--gpu_gb {args.gpu_gb}: must be > 0; fix: leave it out for this machine's GPU (else 80 GB)")
    for gpus in args.gpus or []:
        if gpus < 1:
            raise ConfigError(f"--gpus {gpus}: must be 1 or more; fix: e.g. --gpus 8")
    run_overrides, ds_overrides = split_overrides(args.overrides)
    run = load_run_config(args.config, run_overrides)
    cfg = run.model
    print(f"{args.config}: {cfg.arch}, {cfg.n_layer} layers x {cfg.n_embd} wide, context {cfg.block_size}\n")
    if args.plan:
        print_plan(cfg, args)
        return
    ds_paths = args.ds_config or sorted(glob.glob(os.path.join(REPO_ROOT, "ds_configs", "*.json")))
    print(f"| ds_config | GPUs | layout | ZeRO | micro | params/GPU | model states | activations | total/GPU | "
          f"fits {args.gpu_gb:.0f} GB |\n|---|---|---|---|---|---|---|---|---|---|")
    for path in ds_paths:
        ds = load_ds_config(path, ds_overrides)
        for gpus in args.gpus or [1, 8]:
            try:
                p = plan(cfg, ds, gpus, run.train.mlp_tiles, compiled=run.train.compile)
            except ValueError as e:  # a layout that cannot exist on this many GPUs
                print(f"| {os.path.basename(path)} | {gpus} | impossible: {e} |")
                continue
            cpu = f" (+{p['cpu'] / GB:.0f} GB CPU)" if p["cpu"] else ""
            print(f"| {os.path.basename(path)} | {gpus} | {p['layout']} | {p['zero']} | {p['micro']} | "
                  f"{p['params_per_gpu'] / 1e9:.2f}B | {p['states'] / GB:.1f} GB{cpu} | "
                  f"{p['activations'] / GB:.1f} GB | "
                  f"{p['total'] / GB:.1f} GB | {'yes' if fits(p['total'], args.gpu_gb) else 'no'} |")


def print_plan(cfg, args) -> None:
    """The --plan table: the fastest layouts that fit first, and the recommendation."""
    for name in ("peak_tflops", "intra_gbps", "inter_gbps", "pcie_gbps", "cpu_adam_gparams", "host_gb",
                 "gpus_per_node", "nodes", "global_batch"):
        value = getattr(args, name)
        if value is not None and not value > 0:  # NaN included
            raise ConfigError(f"--{name} {value}: must be > 0; fix: leave it out for its default")
    if args.mfu is not None and not 0 < args.mfu <= 1:
        raise ConfigError(f"--mfu {args.mfu}: must be in (0, 1], the share of the peak the matmuls reach; fix: e.g. "
                          f"--mfu 0.45")
    per_node = args.gpus_per_node or GPUS_PER_NODE
    gpus = args.nodes * per_node if args.nodes else (args.gpus or [0])[0]
    if gpus < 1 or (args.gpus and len(args.gpus) > 1):
        raise ConfigError("--plan needs one GPU count: --gpus N, or --nodes N (x --gpus_per_node)")
    global_batch = args.global_batch or max(1, 4 * 2**20 // cfg.block_size)
    assumptions = dataclasses.replace(Assumptions(args.gpu_gb), **{name: getattr(args, name) for name in ASSUMED
                                                                   if getattr(args, name) is not None})
    rows = plan_layouts(cfg, gpus, per_node, global_batch, assumptions)
    fitting = [r for r in rows if r["fits"]]
    print(f"{gpus} GPUs ({per_node} a node), {global_batch} windows a step; {assumptions.describe()}; "
          f"{len(fitting)} of {len(rows)} layouts fit, each GPU's plan within {1 - ALLOWANCE:.0%} of it "
          f"({ALLOWANCE * args.gpu_gb:.1f} GB left to the allocator's fragmentation, communication buffers and the "
          f"CUDA context)\n")
    print(f"| layout | {' | '.join(PARTS)} | memory / GPU | host memory / node | fits | step s | MFU |\n"
          f"|---|{'---|' * len(PARTS)}---|---|---|---|---|")
    for r in rows[:TOP if args.top is None else args.top]:
        host = f"{r['host'] / GB:.0f} GB" if r["host"] else ""
        parts = " | ".join(f"{r['parts'][part] / GB:.1f} GB" for part in PARTS)
        print(f"| {r['layout'].describe()} | {parts} | {r['memory'] / GB:.1f} GB | {host} | "
              f"{'yes' if r['fits'] else 'no'} | {r['seconds']:.2f} | {r['mfu']:.1%} |")
    if not fitting:
        raise ConfigError(f"no layout fits {args.gpu_gb:g} GB GPUs: add GPUs or lower --global_batch")
    best = fitting[0]["layout"]
    print(f"\nrecommended: {best.describe()}: ds_config " + ", ".join(
        f"{k}={v}" for k, v in flat(best.ds_config()).items()))


def flat(ds: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in ds.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


if __name__ == "__main__":
    main()
