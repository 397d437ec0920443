"""Per-GPU memory plan for a preset under each ds_config layout: model states plus activations.

    python -m scripts.memory_plan --config configs/encoder_1b.yaml  # every shipped ds_config, 1 and 8 GPUs
    python -m scripts.memory_plan --config configs/gpt2_1.5b.yaml --ds_config ds_configs/zero3.json --gpus 8

What it counts, after whom, and what comes on top of it: training/memory_plan.py.
"""
import argparse
import glob
import os

import torch

from common.checks import ToolParser
from training.config import REPO_ROOT, load_run_config
from training.ds_config import load_ds_config
from training.memory_plan import GB, plan


def main() -> None:
    parser = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="a preset, e.g. configs/encoder_1b.yaml")
    parser.add_argument("--ds_config", action="append", help="default: every shipped ds_config")
    parser.add_argument("--gpus", type=int, action="append", help="default: 1 and 8")
    parser.add_argument("--gpu_gb", type=float, help="memory of one GPU (default: this machine's GPU 0, else 80)")
    parser.add_argument("overrides", nargs="*", help="run-config overrides, e.g. model.block_size=2048")
    args = parser.parse_args()

    if args.gpu_gb is None:  # the device's real capacity, else an "80 GB" H100's (79.1 GiB)
        args.gpu_gb = torch.cuda.get_device_properties(0).total_memory / GB if torch.cuda.is_available() else 79.1
    run = load_run_config(args.config, args.overrides)
    cfg = run.model
    ds_paths = args.ds_config or sorted(glob.glob(os.path.join(REPO_ROOT, "ds_configs", "*.json")))
    print(f"{args.config}: {cfg.arch}, {cfg.n_layer} layers x {cfg.n_embd} wide, context {cfg.block_size}\n")
    print(f"| ds_config | GPUs | layout | ZeRO | micro | params/GPU | model states | activations | total/GPU | "
          f"fits {args.gpu_gb:.0f} GB |\n|---|---|---|---|---|---|---|---|---|---|")
    for path in ds_paths:
        ds = load_ds_config(path, [])
        for gpus in args.gpus or [1, 8]:
            try:
                p = plan(cfg, ds, gpus, run.train.mlp_tiles)
            except ValueError as e:  # a layout that cannot exist on this many GPUs
                print(f"| {os.path.basename(path)} | {gpus} | impossible: {e} |")
                continue
            cpu = f" (+{p['cpu'] / GB:.0f} GB CPU)" if p["cpu"] else ""
            print(f"| {os.path.basename(path)} | {gpus} | {p['layout']} | {p['zero']} | {p['micro']} | "
                  f"{p['params_per_gpu'] / 1e9:.2f}B | {p['states'] / GB:.1f} GB{cpu} | "
                  f"{p['activations'] / GB:.1f} GB | "
                  f"{p['total'] / GB:.1f} GB | {'yes' if p['total'] < 0.9 * args.gpu_gb * GB else 'no'} |")


if __name__ == "__main__":
    main()
