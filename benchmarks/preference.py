"""Preference tuning on a task with a checkable answer, the reverse-the-words task (data/reverse_task.py): exact-match
accuracy on held-out prompts after a short fine-tuning, after that plus DPO, and after fine-tuning for as many
more steps instead.

    python benchmarks/preference.py --init_from out/llama_quickstart_export     # the quickstart Llama, pretrained
    python benchmarks/preference.py --init_from EXPORT --sft_steps 100 --steps 200 --objective ipo

From the pretrained export: --sft_steps of configs/llama_quickstart_sft.yaml on the task's conversations (prepared
with the export's tokenizer, as the README's fine-tuning example), short enough to leave mistakes; that run
exported; then from the export, --steps of configs/llama_quickstart_dpo.yaml (--objective, its reference the
export) on pairs of the same training prompts, the reversal chosen over the fine-tuned model's own greedy answer
where that is wrong (--rejected own; else, and with --rejected given, over the words as given); and --steps more
of the fine-tuning preset on its conversations instead. Accuracy: the share of --test held-out prompts whose greedy
answer through the chat template (benchmarks/finetune.py's) is exactly the reversal. The DPO run's val reward
accuracy (on held-out pairs of the training prompts) is printed beside.
"""
import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.finetune import EXAMPLE_CONTEXT, accuracy, greedy_answers, train, trained, write_tasks
from benchmarks.report import at_least, print_table, run_main, run_tool, work_folder
from common.checks import ConfigError, ToolParser
from data.reverse_task import answer, preference_pair, tasks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SFT, DPO = "configs/llama_quickstart_sft.yaml", "configs/llama_quickstart_dpo.yaml"


def prepare(kind: str, records_file: str, tokenizer: str, out_dir: str) -> str:
    run_tool([sys.executable, "-m", "data.prepare", "--format", kind, "--input", records_file, "--tokenizer",
              tokenizer, "--context", str(EXAMPLE_CONTEXT), "--val_fraction", "0.05", "--out_dir", out_dir,
              "--force"], cwd=REPO, stdout=subprocess.DEVNULL)
    return out_dir


def export(run: str, folder: str) -> str:
    run_tool([sys.executable, "-m", "scripts.export", "--out_dir", run, "--output", folder, "--force"], cwd=REPO,
             stdout=subprocess.DEVNULL)
    return folder


def pair_records(train_words: list[list[str]], model=None) -> tuple[list[dict], int]:
    """The preference pairs of the training prompts, and how many reject the model's own answer: with `model`
    (trained()'s), its greedy answer where it is wrong; else, and where it is right, the words as given."""
    records, own = [pair for pair in map(preference_pair, train_words) if pair], 0
    if model is None:
        return records, own
    tokenizer = model[2]
    for record, ids, words in zip(records, greedy_answers(*model, [w for w in train_words if preference_pair(w)]),
                                  (w for w in train_words if preference_pair(w))):
        said = tokenizer.decode(ids) if ids is not None else None
        if said and said.strip() and said != answer(words):
            record["rejected"] = [{"role": "assistant", "content": said}]
            own += 1
    return records, own


SFT_STEPS = ["train.epochs=null", "train.eval_interval=0"]  # a fine-tuning of --sft_steps (or more), no evaluation


@dataclass(frozen=True)
class ShortFineTuning:
    """What the preference and RL benchmarks start from: the task's words, its conversations prepared, and a short
    fine-tuning of the pretrained export (its run, its export, its train.py seconds)."""
    work: str
    train_words: list
    held_out: list
    chats: str
    run: str
    export: str
    seconds: float


def short_fine_tuning(args) -> ShortFineTuning:
    """--sft_steps of the fine-tuning preset from --init_from (an export, checked) on --train conversations, in
    --work_dir."""
    if not os.path.isfile(os.path.join(args.init_from, "config.json")):
        raise ConfigError(f"--init_from {args.init_from} holds no export (config.json); fix: export the quickstart "
                          f"Llama with python -m scripts.export --out_dir out/llama_quickstart")
    work = work_folder(os.path.join(REPO, args.work_dir))
    train_words, held_out = tasks(args.train, args.test)
    pretrained = os.path.abspath(args.init_from)
    chats = prepare("chat", write_tasks(os.path.join(work, "chats.jsonl"), train_words), pretrained,
                    os.path.join(work, "data_chats"))
    run = os.path.join(work, "run_sft")
    seconds = train(chats, run, [f"train.init_from={pretrained}", f"train.max_steps={args.sft_steps}", *SFT_STEPS],
                    SFT)
    return ShortFineTuning(work, train_words, held_out, chats, run, export(run, os.path.join(work, "sft_export")),
                           seconds)


def last_metric(run: str, key: str) -> float:
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [record[key] for record in map(json.loads, f) if key in record][-1]


def main() -> None:
    parser = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--init_from", required=True, help="an export of the pretrained quickstart Llama "
                        "(python -m scripts.export --out_dir out/llama_quickstart)")
    parser.add_argument("--train", type=int, default=3000, help="training prompts (conversations and pairs)")
    parser.add_argument("--test", type=int, default=200, help="held-out prompts")
    parser.add_argument("--sft_steps", type=int, default=100, help="the short fine-tuning's steps")
    parser.add_argument("--steps", type=int, default=200, help="steps of DPO, and of more fine-tuning instead")
    parser.add_argument("--objective", default="dpo", choices=["dpo", "ipo", "simpo"])
    parser.add_argument("--rejected", default="own", choices=["own", "given"], help="the rejected answer: the "
                        "fine-tuned model's own greedy answer where it is wrong (else the words as given), or always "
                        "the words as given")
    parser.add_argument("--work_dir", default=os.path.join("out", "preference"))
    parser.add_argument("overrides", nargs="*", help="run-config key=value for the preference run")
    args = parser.parse_intermixed_args()
    at_least(args, 1, "train", "test", "sft_steps", "steps")
    start = short_fine_tuning(args)
    work, train_words, held_out, chats, sft, sft_export = (start.work, start.train_words, start.held_out,
                                                           start.chats, start.run, start.export)
    pairs_file = os.path.join(work, "pairs.jsonl")
    records, own = pair_records(train_words, trained(sft) if args.rejected == "own" else None)
    with open(pairs_file, "w") as f:
        f.writelines(json.dumps(record) + "\n" for record in records)
    pairs = prepare("preference", pairs_file, sft_export, os.path.join(work, "data_pairs"))
    runs = {"dpo": os.path.join(work, "run_preference"), "more": os.path.join(work, "run_more_sft")}
    seconds = {
        "dpo": train(pairs, runs["dpo"], [f"train.init_from={sft_export}", f"train.max_steps={args.steps}",
                                          f"train.objective={args.objective}", *SFT_STEPS[:1], *args.overrides],
                     DPO),
        "more": train(chats, runs["more"], [f"train.init_from={sft_export}", f"train.max_steps={args.steps}",
                                            *SFT_STEPS], SFT)}
    results = {"sft": accuracy(*trained(sft), held_out)}
    for name, run in runs.items():
        cfg, model, tokenizer, meta = trained(run)
        results[name] = accuracy(cfg, model, tokenizer, meta, held_out)
    reward_accuracy = last_metric(runs["dpo"], "val_rewards_accuracy")
    print_table(["model", "steps", "train.py seconds", "exact match on held-out prompts"], [
        [f"fine-tuned from {args.init_from}", args.sft_steps, "", f"{results['sft']:.3f}"],
        [f"then {args.objective} on {len(records):,} pairs, {own:,} rejecting its own answer (val reward accuracy "
         f"{reward_accuracy:.3f})",
         f"{args.sft_steps} + {args.steps}", f"{seconds['dpo']:.0f}", f"{results['dpo']:.3f}"],
        ["then fine-tuned as many steps more", f"{args.sft_steps} + {args.steps}", f"{seconds['more']:.0f}",
         f"{results['more']:.3f}"]])
    with open(os.path.join(work, "preference.json"), "w") as f:
        json.dump({"init_from": args.init_from, "train": args.train, "test": args.test, "sft_steps": args.sft_steps,
                   "steps": args.steps, "objective": args.objective, "rejected": args.rejected,
                   "own_rejected": own, "exact_match": results,
                   "val_rewards_accuracy": reward_accuracy, "train_py_seconds": seconds}, f, indent=1)


if __name__ == "__main__":
    run_main(main)
