"""Online RL on a task with a checkable answer, the reverse-the-words task (data/reverse_task.py): exact match on
held-out prompts after a short fine-tuning, after that plus GRPO (or RLOO), and after fine-tuning more instead for
as long (train.py's wall time).

    python benchmarks/rl.py --init_from out/llama_quickstart_export       # the quickstart Llama, pretrained
    python benchmarks/rl.py --init_from EXPORT --sft_steps 300 --steps 300 --objective rloo optim.lr=1e-4

From the pretrained export: --sft_steps of configs/llama_quickstart_sft.yaml on the task's conversations, exported;
then from that export --steps of configs/llama_quickstart_grpo.yaml (--objective; 8 prompts a step) on the same
training prompts with their answers, rewarded by exact match; and configs/llama_quickstart_sft.yaml again from the
export for as many seconds as the RL run took (its steps chosen from the first fine-tuning's speed). Exact match:
the share of --test held-out prompts whose greedy answer through the chat template is the reversal
(benchmarks/finetune.py's). The RL run's curve and the share of each step's time spent sampling are printed from
its metrics: its pass@1 is on the prompts the preparation held back from RL (its val split, 5% of the training
prompts, which the first fine-tuning saw).
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.finetune import accuracy, train, trained
from benchmarks.preference import SFT, SFT_STEPS, prepare, short_fine_tuning
from benchmarks.report import at_least, print_table, run_main
from common.checks import ToolParser
from data.reverse_task import prompt_record

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RL = "configs/llama_quickstart_grpo.yaml"
RL_ENGINE = ["ds.gradient_accumulation_steps=8"]  # 8 prompts a step, one to each micro-batch of 12 answers


def write_prompts(path: str, drawn: list[list[str]]) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(prompt_record(w)) + "\n" for w in drawn)
    return path


def read_metrics(run: str) -> list[dict]:
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def main() -> None:
    parser = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--init_from", required=True, help="an export of the pretrained quickstart Llama "
                        "(python -m scripts.export --out_dir out/llama_quickstart)")
    parser.add_argument("--train", type=int, default=3000, help="training prompts (conversations and prompts)")
    parser.add_argument("--test", type=int, default=200, help="held-out prompts")
    parser.add_argument("--sft_steps", type=int, default=300, help="the short fine-tuning's steps")
    parser.add_argument("--steps", type=int, default=2000, help="steps of online RL")
    parser.add_argument("--objective", default="grpo", choices=["grpo", "rloo"])
    parser.add_argument("--work_dir", default=os.path.join("out", "rl"))
    parser.add_argument("overrides", nargs="*", help="run-config key=value (and ds.key=value) for the RL run")
    args = parser.parse_intermixed_args()
    at_least(args, 1, "train", "test", "sft_steps", "steps")
    start = short_fine_tuning(args)
    work, train_words, held_out, sft, sft_export = start.work, start.train_words, start.held_out, start.run, \
        start.export
    prompts = prepare("prompts", write_prompts(os.path.join(work, "prompts.jsonl"), train_words), sft_export,
                      os.path.join(work, "data_prompts"))
    rl_run = os.path.join(work, "run_rl")
    rl_seconds = train(prompts, rl_run, [f"train.init_from={sft_export}", f"train.max_steps={args.steps}",
                                         f"train.objective={args.objective}", f"train.eval_windows={args.test}",
                                         *RL_ENGINE, *args.overrides], RL)
    more_steps = max(1, round(args.sft_steps * rl_seconds / start.seconds))
    more = os.path.join(work, "run_more_sft")
    more_seconds = train(start.chats, more, [f"train.init_from={sft_export}", f"train.max_steps={more_steps}",
                                             *SFT_STEPS], SFT)
    results = {name: accuracy(*trained(run), held_out) for name, run in (("sft", sft), ("rl", rl_run),
                                                                         ("more", more))}
    records = read_metrics(rl_run)
    curve = [(r["step"], r["val_pass1"]) for r in records if "val_pass1" in r]
    shares = [r["rollout_s"] / (r["rollout_s"] + r["train_s"]) for r in records if r.get("train_s")]
    print_table(["model", "steps", "train.py seconds", "exact match on held-out prompts"], [
        [f"fine-tuned from {args.init_from}", args.sft_steps, f"{start.seconds:.0f}", f"{results['sft']:.3f}"],
        [f"then {args.objective}", f"{args.sft_steps} + {args.steps}", f"{rl_seconds:.0f}", f"{results['rl']:.3f}"],
        ["then fine-tuned as long instead", f"{args.sft_steps} + {more_steps}", f"{more_seconds:.0f}",
         f"{results['more']:.3f}"]])
    print(f"{args.objective} curve, pass@1 of the prompts held back from RL by step: "
          + ", ".join(f"{s}: {p:.3f}" for s, p in curve))
    if shares:
        print(f"sampling's share of a step's time: {min(shares):.0%} to {max(shares):.0%} "
              f"(mean {sum(shares) / len(shares):.0%})")
    with open(os.path.join(work, "rl.json"), "w") as f:
        json.dump({"init_from": args.init_from, "train": args.train, "test": args.test, "sft_steps": args.sft_steps,
                   "steps": args.steps, "objective": args.objective, "overrides": args.overrides,
                   "exact_match": results, "train_py_seconds": {"sft": start.seconds, "rl": rl_seconds,
                                                                "more": more_seconds},
                   "more_steps": more_steps, "curve": curve}, f, indent=1)


if __name__ == "__main__":
    run_main(main)
