"""Quality benchmark: train the CPU quickstart preset and check its validation loss.

    python benchmarks/quality.py [--ds_config ds_configs/zero0.json] [--target 1.90] [key=value ...]

Runs `train.py --config configs/quickstart.yaml` (4 layers, 4 heads, 128 wide, context 64, batch 12,
lr 3e-3 cosine to 1e-4 over 1,400 steps, warmup 100, dropout 0, beta2 0.99) on the prepared
character-level tinyshakespeare, then prints the final val loss, wall time and mean tokens/s and
writes them to <out_dir>/quality.json. Exits 1 if the val loss misses the target.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.report import load_inputs, run_main, run_tool
from common.checks import ToolParser, new_output

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "configs/quickstart.yaml"


def main() -> int:
    parser = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ds_config", default="ds_configs/zero0.json")
    parser.add_argument("--target", type=float, default=1.90)
    parser.add_argument("--out_dir", default=os.path.join("out", "quality", time.strftime("%Y%m%d-%H%M%S")),
                        help="a new folder: the benchmark always trains from scratch")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    new_output(os.path.join(REPO, args.out_dir), "--out_dir", "give a new or empty folder: the benchmark trains from "
               "scratch")
    load_inputs(CONFIG, args.ds_config, args.overrides, REPO)

    cmd = [sys.executable, "train.py", "--config", CONFIG, "--ds_config", args.ds_config,
           f"train.out_dir={args.out_dir}", "train.resume=none", *args.overrides]
    print(" ".join(cmd), flush=True)
    start = time.perf_counter()
    run_tool(cmd, cwd=REPO)
    wall = time.perf_counter() - start

    with open(os.path.join(REPO, args.out_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    val = [r for r in records if "val_loss" in r][-1]
    speeds = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    result = {"step": val["step"], "val_loss": val["val_loss"], "target": args.target, "wall_s": round(wall, 1),
              "tokens_per_s": round(sum(speeds) / len(speeds)), "ds_config": args.ds_config,
              "overrides": args.overrides}
    with open(os.path.join(REPO, args.out_dir, "quality.json"), "w") as f:
        json.dump(result, f, indent=1)
    passed = val["val_loss"] <= args.target
    print(f"\n| step | val loss | target | wall time | mean tokens/s |\n|---|---|---|---|---|\n"
          f"| {val['step']} | {val['val_loss']:.4f} | <= {args.target} | {wall:.0f} s | {result['tokens_per_s']:,} |")
    print("PASS" if passed else "FAIL")
    return 0 if passed else 1


if __name__ == "__main__":
    run_main(main)
