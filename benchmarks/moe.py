"""The mixture-of-experts quickstart against the dense Llama quickstart, one after the other on this machine.

    python benchmarks/moe.py [--steps 2000] [--eval_interval 250] [--out_dir out/benchmarks/moe] [key=value ...]

Trains configs/llama_quickstart.yaml and configs/llama_quickstart_moe.yaml (4 experts of half the dense MLP's
width, 2 per token: the same matmul FLOPs per token) for the same steps and evaluations, then prints for each:
the validation loss at equal steps, tokens/s, the training time (the logged intervals' tokens over their
tokens/s, evaluations left out), the MoE run's validation loss at the evaluation nearest the dense run's whole
training time (equal time), and its expert load (busiest expert / mean) at the end. Writes moe.json there.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.report import at_least, load_inputs, print_table, run_main, run_tool, write_json
from common.checks import ToolParser, new_output

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = {"dense": "configs/llama_quickstart.yaml", "moe": "configs/llama_quickstart_moe.yaml"}


def train(name: str, args) -> list[dict]:
    out_dir = os.path.join(args.out_dir, name)
    cmd = [sys.executable, "train.py", "--config", RUNS[name], f"train.out_dir={out_dir}", "train.resume=none",
           f"train.max_steps={args.steps}", f"train.eval_interval={args.eval_interval}", "train.log_interval=50",
           *args.overrides]
    print(" ".join(cmd), flush=True)
    run_tool(cmd, cwd=REPO)
    with open(os.path.join(REPO, out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def summary(records: list[dict], tokens_per_step: int) -> dict:
    """Validation losses by step and by training time so far; tokens/s; the last routing figures."""
    seconds, last_step, elapsed = {0: 0.0}, 0, 0.0
    for r in records:
        if r.get("tokens_per_s"):
            elapsed += (r["step"] - last_step) * tokens_per_step / r["tokens_per_s"]
        if "loss" in r:
            last_step = r["step"]
            seconds[r["step"]] = elapsed
    evals = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    speeds = [r["tokens_per_s"] for r in records if r.get("tokens_per_s")]
    routing = [r for r in records if "expert_load_max" in r]
    return {"val_loss": evals[-1][1], "evals": [(step, seconds.get(step, elapsed), loss) for step, loss in evals],
            "train_s": elapsed, "tokens_per_s": sum(speeds) / len(speeds),
            "expert_load_max": routing[-1]["expert_load_max"] if routing else None}


def main() -> None:
    parser = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--eval_interval", type=int, default=250)
    parser.add_argument("--out_dir", default=os.path.join("out", "benchmarks", "moe"),
                        help="a new or empty folder: both runs train from scratch")
    parser.add_argument("overrides", nargs="*", help="run-config key=value for both runs")
    args = parser.parse_args()
    at_least(args, 1, "steps", "eval_interval")
    new_output(os.path.join(REPO, args.out_dir), "--out_dir", "give a new or empty folder")
    tokens = {}
    for name, config in RUNS.items():  # both presets load with these overrides before anything trains
        cfg, ds, _ = load_inputs(config, "ds_configs/zero0.json", args.overrides, REPO)
        tokens[name] = ds["train_micro_batch_size_per_gpu"] * cfg.model.block_size
    results = {name: summary(train(name, args), tokens[name]) for name in RUNS}
    dense, moe = results["dense"], results["moe"]
    at_dense_time = min(moe["evals"], key=lambda e: abs(e[1] - dense["train_s"]))
    results["moe_at_dense_time"] = {"step": at_dense_time[0], "train_s": at_dense_time[1],
                                    "val_loss": at_dense_time[2]}
    write_json(os.path.join(REPO, args.out_dir, "moe.json"), {"steps": args.steps, "overrides": args.overrides,
                                                                "results": results})
    print_table(["run", f"val loss at step {args.steps}", "tokens/s", "training time", "expert load max / mean"],
                [[name, f"{r['val_loss']:.4f}", f"{r['tokens_per_s']:,.0f}", f"{r['train_s']:.0f} s",
                  f"{r['expert_load_max']:.3f}" if r["expert_load_max"] else ""] for name, r in (("dense", dense),
                                                                                                 ("moe", moe))])
    print(f"equal time: the MoE run at step {at_dense_time[0]} ({at_dense_time[1]:.0f} s of training, the dense run's "
          f"{dense['train_s']:.0f} s): val loss {at_dense_time[2]:.4f} against the dense run's {dense['val_loss']:.4f}")


if __name__ == "__main__":
    run_main(main)
