"""Fine-tuning on a task with a checkable answer: exact-match accuracy on held-out prompts, before and after, with
the prompt's tokens left out of the loss (the default) against trained on.

    python benchmarks/finetune.py                # reverse-the-words tasks, the Llama quickstart's shape, on the CPU
    python benchmarks/finetune.py --steps 300    # a quicker, rougher figure

Tasks: "Reverse: w1 ... wn" -> "wn ... w1", n from 2 to 6 of 24 words; --train tasks to train on and --test
held-out prompts, none of them among the training ones. They are prepared twice with the character tokenizer
(`data.prepare --format chat --context 128`: `--train_on all`, the assistant's tokens; `--train_on everything`,
every token), and each dataset trains from the same initialization (configs/llama_quickstart_sft.yaml at context
128; a pretraining learning rate, since it starts from scratch) for --steps steps. Accuracy: the share of held-out
prompts whose greedy answer (`sample.py --chat`'s, up to the end of turn) is exactly the reversal; "before" is the
same model at its initialization.
"""
import argparse
import json
import os
import random
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.report import at_least, print_table, run_main, run_tool, work_folder  # noqa: E402
from common.checks import ToolParser  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ("lord king sword night crown queen heart blood ghost storm grave rose moon star fool sea wind fire "
         "tears honour bread gold stone horse").split()
CONFIG = "configs/llama_quickstart_sft.yaml"
CONTEXT = 128  # the longest task, in characters through the plain template, fits whole
FROM_SCRATCH = ["optim.lr=1e-3", "optim.min_lr=1e-4", "optim.warmup_steps=50", "train.eval_interval=0",
                f"model.block_size={CONTEXT}", "ds.bf16.enabled=false"]


def tasks(train: int, test: int, seed: int = 0) -> tuple[list[dict], list[list[str]]]:
    """Training conversations and held-out word lists, disjoint."""
    rng, seen, drawn = random.Random(seed), set(), []
    while len(drawn) < train + test:
        words = tuple(rng.choice(WORDS) for _ in range(rng.randint(2, 6)))
        if words not in seen:
            seen.add(words)
            drawn.append(list(words))
    conversations = [{"messages": [{"role": "user", "content": "Reverse: " + " ".join(w)},
                                   {"role": "assistant", "content": " ".join(reversed(w))}]} for w in drawn[:train]]
    return conversations, drawn[train:]


def accuracy(run_dir: str, held_out: list[list[str]], initial: bool = False) -> float:
    """The share of held-out prompts answered exactly, by the run's last checkpoint (or its initialization)."""
    import torch

    from data.tokenizers import tokenizer_from_meta
    from model import build_model
    from model.generate import generate
    from sample import chat_prompt
    from training import checkpoint
    from training.export import consolidated_state_dict, run_dataset, run_model

    tag_dir = checkpoint.find_checkpoint(run_dir, None)
    run_state = checkpoint.read_run_state(tag_dir)
    meta, data_dir = run_dataset(tag_dir, run_state)
    cfg = run_model(tag_dir, run_state)
    model = build_model(cfg, run_state["config"]["train"]["seed"]).eval()
    if not initial:
        model.load_state_dict(consolidated_state_dict(tag_dir))
    tokenizer = tokenizer_from_meta(meta, data_dir)
    right = 0
    for words in held_out:
        ids, stop = chat_prompt("Reverse: " + " ".join(words), meta, tokenizer)
        out = generate(model, torch.tensor([ids]), 48, cfg.block_size, cfg.vocab_size, 0.0, stop_id=stop)
        answer = out[0, len(ids):].tolist()
        right += answer == tokenizer.encode(" ".join(reversed(words))) + [stop]
    return right / len(held_out)


def main() -> None:
    parser = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train", type=int, default=4000, help="training conversations")
    parser.add_argument("--test", type=int, default=200, help="held-out prompts")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--work_dir", default=os.path.join("out", "finetune"))
    parser.add_argument("overrides", nargs="*", help="run-config key=value for both runs")
    args = parser.parse_intermixed_args()
    at_least(args, 1, "train", "test", "steps")
    work = work_folder(os.path.join(REPO, args.work_dir))
    conversations, held_out = tasks(args.train, args.test)
    with open(os.path.join(work, "tasks.jsonl"), "w") as f:
        f.writelines(json.dumps(c) + "\n" for c in conversations)
    results = {}
    for train_on in ("all", "everything"):
        data, run = os.path.join(work, f"data_{train_on}"), os.path.join(work, f"run_{train_on}")
        shutil.rmtree(run, ignore_errors=True)  # this benchmark's own earlier run
        run_tool([sys.executable, "-m", "data.prepare", "--format", "chat", "--input",
                  os.path.join(work, "tasks.jsonl"), "--tokenizer", "char", "--context", str(CONTEXT), "--train_on",
                  train_on, "--val_fraction", "0.02", "--out_dir", data, "--force"], cwd=REPO)
        run_tool([sys.executable, "train.py", "--config", CONFIG, f"data.dir={data}", f"train.out_dir={run}",
                  "train.resume=none", f"train.max_steps={args.steps}", "train.epochs=null",
                  f"train.save_interval={args.steps}", *FROM_SCRATCH, *args.overrides], cwd=REPO,
                 stdout=subprocess.DEVNULL)
        results[train_on] = {"before": accuracy(run, held_out, initial=True), "after": accuracy(run, held_out)}
    print_table(["loss on", "exact match before", "exact match after"],
                [["the answers (--train_on all)" if k == "all" else "every token (--train_on everything)",
                  f"{r['before']:.3f}", f"{r['after']:.3f}"] for k, r in results.items()])
    with open(os.path.join(work, "finetune.json"), "w") as f:
        json.dump({"steps": args.steps, "train": args.train, "test": args.test, **results}, f, indent=1)


if __name__ == "__main__":
    run_main(main)
