"""The pipeline bubble, measured: pp=2 against pp=1 at the same global batch, next to (p - 1) / (m + p - 1).

    python benchmarks/pipeline.py                      # baby GPT, micro 2, m = 2, 4, 8 micro-batches
    python benchmarks/pipeline.py --stages 4 --micro_batches 4 8 16 --config configs/gpt2_124m.yaml

Each layout is a real `deepspeed --num_gpus P train.py --ds_config ds_configs/pipe2.json` run (one rank per
stage, no data parallelism, one thread per rank on CPU). The pp=1 run does all the work on one device; a
perfect pipeline would split it across p devices with no idle time, so the measured bubble is
1 - tokens/s(pp) / (p x tokens/s(pp=1)): the fraction of device time the pipeline did not spend on work the
single device had to do. It includes what the theory leaves out: stage imbalance and the transfers between
stages. Tokens/s is train.py's own meter over the last log interval (warm-up, evaluation and saving
excluded). Prints a table, writes JSON.
"""
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.report import (
    DEEPSPEED,
    REPO,
    at_least,
    load_inputs,
    print_table,
    results_file,
    run_main,
    run_tool,
    work_folder,
    write_json,
)
from common.checks import ToolParser

DS_CONFIG = "ds_configs/pipe2.json"


def settings(stages: int, micro_batches: int, args) -> list[str]:
    """train.py's key=value for one layout: timed steps, hardly any evaluation, saving or sampling."""
    return ["train.resume=none", f"train.max_steps={args.steps}", f"train.log_interval={args.steps // 2}",
            "train.eval_interval=1000000", "train.eval_windows=1", "train.save_interval=0", "sample.max_new_tokens=1",
            f"ds.pipeline.stages={stages}", f"ds.gradient_accumulation_steps={micro_batches}",
            f"ds.train_micro_batch_size_per_gpu={args.micro_batch}", *args.overrides]


def check(args) -> None:
    """Every layout's settings, as train.py will read them, before the first run; work_dir made absolute."""
    at_least(args, 2, "stages")  # pp=1 is the reference
    at_least(args, 1, "micro_batches", "micro_batch")
    at_least(args, 2, "steps")  # tokens/s is logged every steps / 2
    results_file(args.json)
    for stages in (1, args.stages):
        for m in args.micro_batches:
            load_inputs(args.config, DS_CONFIG, settings(stages, m, args), REPO)
    args.work_dir = work_folder(os.path.join(REPO, args.work_dir))


def tokens_per_s(stages: int, micro_batches: int, args) -> float:
    out_dir = tempfile.mkdtemp(prefix=f"pipeline_pp{stages}_m{micro_batches}_", dir=args.work_dir)
    cmd = [*DEEPSPEED, "--num_gpus", str(stages), "train.py", "--config", args.config, "--ds_config", DS_CONFIG,
           f"train.out_dir={out_dir}", *settings(stages, micro_batches, args)]
    print("deepspeed", " ".join(cmd[len(DEEPSPEED):]), flush=True)
    threads = os.environ.get("OMP_NUM_THREADS", "1")  # the same compute per stage in every layout
    run_tool(cmd, cwd=REPO, stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": threads})
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "tokens_per_s" in r][-1]["tokens_per_s"]


def main() -> None:
    parser = ToolParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/baby_gpt.yaml")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--micro_batches", type=int, nargs="+", default=[2, 4, 8], help="m: micro-batches per step")
    parser.add_argument("--micro_batch", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--work_dir", default=os.path.join("out", "benchmarks"))
    parser.add_argument("--json", default=os.path.join("out", "benchmarks", "pipeline.json"))
    parser.add_argument("overrides", nargs="*", help="key=value for train.py, e.g. model.dropout=0")
    args = parser.parse_args()
    check(args)

    p, rows, results = args.stages, [], []
    for m in args.micro_batches:
        single, piped = tokens_per_s(1, m, args), tokens_per_s(p, m, args)
        measured, theory = 1 - piped / (p * single), (p - 1) / (m + p - 1)
        results.append({"micro_batches": m, "pp1_tokens_per_s": single, f"pp{p}_tokens_per_s": piped,
                        "bubble_measured": measured, "bubble_theory": theory})
        rows.append([m, f"{single:,.0f}", f"{piped:,.0f}", f"{piped / single:.2f}x", f"{100 * measured:.1f}%",
                     f"{100 * theory:.1f}%"])
    print(f"\n{args.config} {' '.join(args.overrides)}: pp={p} vs pp=1, micro-batch {args.micro_batch}, "
          f"global batch m x {args.micro_batch}")
    print_table(["m", "pp=1 tokens/s", f"pp={p} tokens/s", "speed-up", "bubble measured", "bubble (p-1)/(m+p-1)"], rows)
    write_json(args.json, {"config": args.config, "stages": p, "micro_batch": args.micro_batch,
                           "overrides": args.overrides, "results": results})


if __name__ == "__main__":
    run_main(main)
