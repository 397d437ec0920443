"""The README's quickstart against nanoGPT's CPU recipe in a plain-PyTorch loop, one after the other.

    python benchmarks/quickstart_race.py                 # each once, the quickstart first
    python benchmarks/quickstart_race.py --repeats 2     # taking turns: Q P Q P

Both run as whole processes, timed from their start to their exit, on data/shakespeare_char
(`python -m data.prepare` makes it), after an untimed one-step train.py (a machine's first run builds one of
DeepSpeed's ops):
- the quickstart: `python train.py` as the README runs it, in a fresh --work_dir out_dir: start-up, its
  steps (1,400 at three times the recipe's rate), its evaluations (600 windows of each split at steps 0, 500,
  1000 and the last), its checkpoints, the sample. Tokens/s: its progress lines' mean after the warm-up
  interval; the validation loss: its last.
- the recipe (`--plain`, this file): nanoGPT's published CPU settings for shakespeare_char (4 layers x 4 heads x
  128 wide, exact GELU, context 64, batch 12, 2,000 steps, fp32, AdamW at 1e-3 with 100 warm-up steps and a
  cosine to 1e-4, betas 0.9/0.99, weight decay 0.1 on matrices, clipping at 1.0, dropout 0, random windows, 20
  batches of each split evaluated every 250 steps and at the end), in a loop of plain PyTorch over this repo's
  model code. Its tokens/s: the training steps' alone.
Prints a table with the ratios (quickstart / recipe: wall time as speed, so > 1 is faster) and writes JSON.
"""
import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report import at_least, print_table, results_file, run_main, work_folder, write_json
from common.checks import ConfigError, ToolParser

DATA = "data/shakespeare_char"
RECIPE = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64, "batch": 12, "steps": 2000, "lr": 1e-3,
          "min_lr": 1e-4, "warmup": 100, "betas": (0.9, 0.99), "weight_decay": 0.1, "clip": 1.0,
          "eval_interval": 250, "eval_batches": 20, "seed": 1337, "activation": "gelu"}


def plain() -> dict:
    """nanoGPT's CPU recipe in plain PyTorch; returns its figures."""
    import numpy as np
    import torch

    from model import build_model
    from model.config import ModelConfig
    from training.optim import param_groups
    from training.steps import lm_loss

    r = RECIPE
    torch.manual_seed(r["seed"])
    splits = {s: np.memmap(os.path.join(DATA, f"{s}.bin"), dtype=np.uint16, mode="r") for s in ("train", "val")}
    with open(os.path.join(DATA, "meta.json")) as f:
        vocab = json.load(f)["vocab_size"]
    model = build_model(ModelConfig(n_layer=r["n_layer"], n_head=r["n_head"], n_embd=r["n_embd"],
                                    block_size=r["block_size"], vocab_size=vocab, dropout=0.0,
                                    activation=r["activation"]), r["seed"])
    optimizer = torch.optim.AdamW(param_groups(model.named_parameters(), r["weight_decay"]), lr=r["lr"],
                                  betas=r["betas"])

    def batch(split: str):
        data = splits[split]
        starts = torch.randint(len(data) - r["block_size"] - 1, (r["batch"],)).tolist()
        windows = torch.stack([torch.from_numpy(data[i:i + r["block_size"] + 1].astype(np.int64)) for i in starts])
        return windows[:, :-1], windows[:, 1:]

    def lr(step: int) -> float:
        if step < r["warmup"]:
            return r["lr"] * (step + 1) / (r["warmup"] + 1)
        progress = (step - r["warmup"]) / (r["steps"] - r["warmup"])
        return r["min_lr"] + 0.5 * (1 + math.cos(math.pi * progress)) * (r["lr"] - r["min_lr"])

    @torch.no_grad()
    def evaluate() -> dict:
        model.eval()
        losses = {s: sum(lm_loss(model(x), y).item() for x, y in (batch(s) for _ in range(r["eval_batches"])))
                  / r["eval_batches"] for s in splits}
        model.train()
        return losses

    trained, losses = 0.0, {}
    for step in range(r["steps"] + 1):
        if step % r["eval_interval"] == 0 or step == r["steps"]:
            losses = evaluate()
        if step == r["steps"]:
            break
        start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr(step)
        x, y = batch("train")
        loss = lm_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), r["clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        trained += time.perf_counter() - start
    return {"steps": r["steps"], "val_loss": losses["val"],
            "tokens_per_s": r["steps"] * r["batch"] * r["block_size"] / trained}


def timed(cmd: list[str]) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "WANDB_MODE": "disabled"})
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return seconds, proc.stdout


def quickstart(out_dir: str) -> dict:
    shutil.rmtree(out_dir, ignore_errors=True)
    seconds, stdout = timed([sys.executable, "train.py", f"train.out_dir={out_dir}"])
    speeds = [float(s.replace(",", "")) for s in re.findall(r"\| ([\d,]+) tok/s \|", stdout)]
    step, val = re.findall(r"step (\d+): train loss \d+\.\d+, val loss (\d+\.\d+)", stdout)[-1]
    precision = "bf16" if "; torch.bfloat16; MFU" in stdout else \
        "fp32, bf16 matmuls" if "fp32 with bf16 matmuls" in stdout else "fp32"
    return {"wall_s": seconds, "steps": int(step), "tokens_per_s": sum(speeds) / len(speeds), "val_loss": float(val),
            "precision": precision}


def recipe() -> dict:
    seconds, stdout = timed([sys.executable, __file__, "--plain"])
    return {"wall_s": seconds, **json.loads(stdout.strip().splitlines()[-1]), "precision": "fp32"}


def main() -> None:
    parser = ToolParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=1, help="rounds of the two, taking turns")
    parser.add_argument("--work_dir", default="out/benchmarks/quickstart_race")
    parser.add_argument("--json", default="out/benchmarks/quickstart_race.json")
    parser.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)  # the recipe's own process
    args = parser.parse_args()
    if args.plain:
        print(json.dumps(plain()))
        return
    at_least(args, 1, "repeats")
    if not os.path.exists(os.path.join(DATA, "train.bin")):
        raise ConfigError(f"{DATA} is not prepared; fix: python -m data.prepare")
    results_file(args.json)
    work_folder(args.work_dir)
    # DeepSpeed builds its CPU communication op on a machine's first run (tens of seconds, once): not the race's.
    timed([sys.executable, "train.py", f"train.out_dir={os.path.join(args.work_dir, 'warm_up')}",
           "train.max_steps=1", "sample.max_new_tokens=1"])
    shutil.rmtree(os.path.join(args.work_dir, "warm_up"), ignore_errors=True)
    runs = {"quickstart": [], "recipe": []}
    for _ in range(args.repeats):
        runs["quickstart"].append(quickstart(os.path.join(args.work_dir, "quickstart")))
        runs["recipe"].append(recipe())
    best = {name: min(results, key=lambda r: r["wall_s"]) for name, results in runs.items()}
    q, p = best["quickstart"], best["recipe"]
    print(f"\nthe quickstart against nanoGPT's CPU recipe in plain PyTorch (the faster of {args.repeats} each)")
    print_table(["run", "precision", "steps", "wall time", "tokens/s", "val loss"],
                [[name, r["precision"], f"{r['steps']:,}", f"{r['wall_s']:.1f} s", f"{r['tokens_per_s']:,.0f}",
                  f"{r['val_loss']:.4f}"]
                 for name, r in best.items()])
    print(f"quickstart / recipe: speed by wall time {p['wall_s'] / q['wall_s']:.3f}x, tokens/s "
          f"{q['tokens_per_s'] / p['tokens_per_s']:.3f}x")
    write_json(args.json, {"runs": runs, "recipe": RECIPE})


if __name__ == "__main__":
    run_main(main)
