"""The step's levers on one device, each row a whole `python train.py` run of its own: the micro-batch swept at a
fixed global batch (accumulation making up the rest), up to one past the largest the memory plan says fits; then,
at the fastest micro-batch that ran, each lever of --levers flipped (train.compile=true, ZeRO-0 for ZeRO-1, inductor's
autotuned matmuls through env:TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1, ...).

    python benchmarks/sweep.py --config configs/gpt2_124m.yaml --global_batch 48 --levers train.compile=true \
        ds_config=ds_configs/zero0.json
    python benchmarks/sweep.py --config configs/quickstart.yaml --global_batch 16 --micro 4 8 --steps 6

A row's tokens/s and MFU are the mean of its logged intervals after the first (train.py's own figures, from its
metrics.jsonl); its memory is the largest peak the intervals logged, allocated and reserved. The plan's figure
(training/memory_plan.py) stands beside it, with whether it fits --gpu_gb (the device's own memory on a GPU).
A run that ends out of memory is a row marked "out of memory", which is what the sweep checks the plan against:
the largest micro-batch the plan fits, beside the largest that ran; one whose plan is over the device's whole
memory train.py refuses at start ("over the plan"). Prints a table and writes JSON (--json).
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report import (
    at_least,
    environment,
    first_device,
    load_inputs,
    print_table,
    results_file,
    run_main,
    work_folder,
    write_json,
)
from common.checks import ConfigError, ToolParser
from training.memory_plan import GB, fits, plan

OUT_OF_MEMORY = ("out of memory", "OutOfMemoryError")
OVER_THE_PLAN = "error: the memory plan needs"  # train.py's refusal of a run whose plan is over the device's memory
ENV_LEVER = "env:"  # a lever that sets an environment variable of its row's process, not a setting


def default_micros(plan_fits: dict[int, bool]) -> list[int]:
    """Of the micro-batches `plan_fits` holds in ascending order, those up to one past the largest the plan fits."""
    powers = list(plan_fits)
    fitting = [m for m in powers if plan_fits[m]]
    last = fitting[-1] if fitting else powers[0]
    return [m for m in powers if m <= last] + [m for m in powers if m > last][:1]


def row_settings(args, lever: str | None) -> tuple[str, list[str], dict[str, str]]:
    """A row's ds_config, run-config overrides and environment: the sweep's, with its lever applied."""
    ds_config, overrides, env = args.ds_config, list(args.overrides), {}
    if lever and lever.startswith("ds_config="):
        ds_config = lever.split("=", 1)[1]
    elif lever and lever.startswith(ENV_LEVER):
        name, _, value = lever.removeprefix(ENV_LEVER).partition("=")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) or not value:
            raise ConfigError(f"--levers {lever}: an environment lever is {ENV_LEVER}NAME=VALUE; fix: e.g. "
                              f"{ENV_LEVER}TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1")
        env[name] = value
    elif lever:
        overrides.append(lever)
    return ds_config, overrides, env


def planned_bytes(args, micro: int, lever: str | None) -> float:
    """The memory plan's total for a row, its lever applied (train.compile's loss holds no fp32 chunk)."""
    ds_config, overrides, _ = row_settings(args, lever)
    cfg, ds, _ = load_inputs(args.config, ds_config, overrides)
    ds = dict(ds, train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=args.global_batch // micro)
    return plan(cfg.model, ds, 1, cfg.train.mlp_tiles, compiled=cfg.train.compile)["total"]


def command(args, micro: int, lever: str | None, out_dir: str) -> list[str]:
    ds_config, overrides, _ = row_settings(args, lever)
    return [sys.executable, "train.py", "--config", args.config, "--ds_config", ds_config, *overrides,
            f"ds.train_micro_batch_size_per_gpu={micro}",
            f"ds.gradient_accumulation_steps={args.global_batch // micro}", f"train.out_dir={out_dir}",
            f"train.max_steps={args.steps}", f"train.log_interval={args.log_interval}",
            "train.eval_interval=0", f"train.eval_windows={args.global_batch}", "train.save_interval=0",
            "sample.max_new_tokens=1"]


def measured(proc: subprocess.CompletedProcess, out_dir: str) -> dict:
    """A finished run's figures, or why it has none."""
    if proc.returncode != 0:
        tail = (proc.stderr or "") + (proc.stdout or "")
        status = ("over the plan" if OVER_THE_PLAN in tail else
                  "out of memory" if any(s in tail for s in OUT_OF_MEMORY) else "failed")
        return {"status": status, "error": tail.strip().splitlines()[-1:] or [""]}
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        intervals = [r for r in map(json.loads, f) if "tokens_per_s" in r][1:]
    if not intervals:
        return {"status": "failed", "error": ["fewer than two logged intervals: raise --steps"]}
    return {"status": "ok", "tokens_per_s": sum(r["tokens_per_s"] for r in intervals) / len(intervals),
            "mfu": sum(r["mfu"] for r in intervals) / len(intervals),
            "peak_gb": max(r["peak_mem_gb"] for r in intervals),
            "reserved_gb": max(r["reserved_gb"] for r in intervals)}


def run_row(args, row: dict, work: str) -> dict:
    name = f"micro{row['micro']}" + (f"_{row['lever'].replace('/', '_').replace('=', '_')}" if row["lever"] else "")
    out_dir = os.path.join(work, name)
    shutil.rmtree(out_dir, ignore_errors=True)
    env = {**os.environ, "WANDB_MODE": "disabled", **row_settings(args, row["lever"])[2]}
    proc = subprocess.run(command(args, row["micro"], row["lever"], out_dir), capture_output=True, text=True,
                          timeout=args.timeout, env=env)
    return {**row, **measured(proc, out_dir)}


def main() -> int:
    parser = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--ds_config", default="ds_configs/zero1.json")
    parser.add_argument("--global_batch", type=int, required=True, help="windows a step, the same in every row")
    parser.add_argument("--micro", type=int, nargs="+", help="default: powers of two to one past the plan's largest")
    parser.add_argument("--levers", nargs="*", default=[],
                        help="overrides flipped one at a time at the fastest micro-batch (ds_config=PATH for another "
                             "ds_config, env:NAME=VALUE for an environment variable of the row's process)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--log_interval", type=int, default=5)
    parser.add_argument("--gpu_gb", type=float, help="the plan's budget (default: the GPU's memory, else 80)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds a row may take")
    parser.add_argument("--work_dir", default="out/benchmarks/sweep")
    parser.add_argument("--json", default="out/benchmarks/sweep.json")
    parser.add_argument("overrides", nargs="*", help="run-config key=value for every row (ds.* for the ds_config)")
    args = parser.parse_args()
    at_least(args, 1, "global_batch", "steps", "log_interval", "timeout")
    for micro in args.micro or []:
        if micro < 1 or args.global_batch % micro:
            raise ConfigError(f"--micro {micro} does not divide --global_batch {args.global_batch}: pick divisors")
    if args.steps < 2 * args.log_interval:
        raise ConfigError(f"--steps {args.steps}: needs two logged intervals of --log_interval {args.log_interval}; "
                          f"fix: raise --steps")
    results_file(args.json)
    gpu_gb = plan_budget(args)
    powers = [m for m in (2**i for i in range(12)) if args.global_batch % m == 0]
    planned = {m: planned_bytes(args, m, None) for m in sorted(set(powers + (args.micro or [])))}
    for lever in args.levers:  # each lever's settings checked before the first row's minutes
        planned_bytes(args, powers[0], lever)
    micros = args.micro or default_micros({m: fits(planned[m], gpu_gb) for m in powers})
    work = work_folder(args.work_dir)
    rows = [run_row(args, {"micro": m, "lever": None}, work) for m in micros]
    ran = [r for r in rows if r["status"] == "ok"]
    if ran and args.levers:
        best = max(ran, key=lambda r: r["tokens_per_s"])["micro"]
        rows += [run_row(args, {"micro": best, "lever": lever}, work) for lever in args.levers]
    for r in rows:
        total = planned_bytes(args, r["micro"], r["lever"]) if r["lever"] else planned[r["micro"]]
        r["plan_gb"], r["plan_fits"] = total / GB, fits(total, gpu_gb)
    report = {**environment(first_device()), "config": args.config, "ds_config": args.ds_config,
              "overrides": args.overrides, "global_batch": args.global_batch, "steps": args.steps, "gpu_gb": gpu_gb,
              "rows": rows,
              "plan_largest_fitting_micro": max((m for m in micros if fits(planned[m], gpu_gb)), default=None),
              "largest_micro_that_ran": max((r["micro"] for r in rows if r["status"] == "ok" and not r["lever"]),
                                            default=None)}
    print_report(report)
    write_json(args.json, report)
    return 0 if ran else 1


def plan_budget(args) -> float:
    """The plan's budget in GiB: --gpu_gb, else the GPU's memory, else an 80 GB card's."""
    import torch

    from training.device import memory_capacity

    return args.gpu_gb or (memory_capacity(torch.device("cuda", 0), 1)[0] / GB if torch.cuda.is_available()
                           else 79.1)


def print_report(report: dict) -> None:
    print(f"\n{report['config']} with {report['ds_config']}, {report['global_batch']} windows a step, "
          f"{report['steps']} steps a row; plan against {report['gpu_gb']:.1f} GB")
    print_table(["micro x accumulation", "lever", "tokens/s", "MFU", "peak GB (reserved)", "plan GB", "status"],
                [[f"{r['micro']} x {report['global_batch'] // r['micro']}", r["lever"] or "",
                  f"{r['tokens_per_s']:,.0f}" if r["status"] == "ok" else "",
                  f"{100 * r['mfu']:.1f}%" if r["status"] == "ok" else "",
                  f"{r['peak_gb']:.2f} ({r['reserved_gb']:.2f})" if r["status"] == "ok" else "",
                  f"{r['plan_gb']:.2f}{'' if r['plan_fits'] else ' (over)'}", r["status"]]
                 for r in report["rows"]])
    print(f"largest micro-batch the plan fits: {report['plan_largest_fitting_micro']}; largest that ran: "
          f"{report['largest_micro_that_ran']}")


if __name__ == "__main__":
    run_main(main)
