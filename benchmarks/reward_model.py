"""A reward model on the reverse-the-words task (data/reverse_task.py): the share of held-out pairs it ranks right,
the reversal scored above the words as given.

    python benchmarks/reward_model.py --init_from out/llama_quickstart_export      # the quickstart Llama, pretrained
    python benchmarks/reward_model.py --init_from out/llama_quickstart_sft_export --steps 200 optim.lr=1e-4

The pairs of --train prompts (preference_pair: the reversal chosen, the words as given rejected) are prepared with
the export's tokenizer and template (data.prepare --format preference --context 64, as for DPO); then
configs/llama_quickstart_reward.yaml trains a score head from the export for --steps (its epoch by default), and
its export is loaded with training.reward_model.load_reward_model, as online RL loads one (rl.reward_model), which
encodes and scores both answers of each of --test held-out prompts, none of them trained on. The run's own val
reward accuracy (on the pairs the preparation held back) is printed beside. Target: 0.95 or more held out.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.finetune import train
from benchmarks.preference import export, last_metric, prepare
from benchmarks.report import at_least, print_table, run_main, work_folder
from common.checks import ConfigError, ToolParser
from data.reverse_task import preference_pair, tasks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REWARD = "configs/llama_quickstart_reward.yaml"
TARGET = 0.95


def ranked_right(reward_model, pairs: list[dict]) -> float:
    """The share of pairs whose chosen answer the reward model scores above the rejected one."""
    chosen = reward_model.score([reward_model.encode(p["prompt"], p["chosen"]) for p in pairs])
    rejected = reward_model.score([reward_model.encode(p["prompt"], p["rejected"]) for p in pairs])
    return (chosen > rejected).float().mean().item()


def main() -> int:
    parser = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--init_from", required=True, help="an export of the quickstart Llama (python -m "
                        "scripts.export --out_dir out/llama_quickstart), pretrained or fine-tuned")
    parser.add_argument("--train", type=int, default=3000, help="training prompts, a pair each")
    parser.add_argument("--test", type=int, default=200, help="held-out prompts, a pair each")
    parser.add_argument("--steps", type=int, help="reward-model steps (default: the preset's epoch)")
    parser.add_argument("--work_dir", default=os.path.join("out", "reward_model"))
    parser.add_argument("overrides", nargs="*", help="run-config key=value for the reward-model run")
    args = parser.parse_intermixed_args()
    at_least(args, 1, "train", "test", *(["steps"] if args.steps is not None else []))
    if not os.path.isfile(os.path.join(args.init_from, "config.json")):
        raise ConfigError(f"--init_from {args.init_from} holds no export (config.json); fix: export the quickstart "
                          f"Llama with python -m scripts.export --out_dir out/llama_quickstart")
    from training.reward_model import load_reward_model

    work = work_folder(os.path.join(REPO, args.work_dir))
    train_words, held_out = tasks(args.train, args.test)
    records = [pair for pair in map(preference_pair, train_words) if pair]
    test_pairs = [pair for pair in map(preference_pair, held_out) if pair]
    pairs_file = os.path.join(work, "pairs.jsonl")
    with open(pairs_file, "w") as f:
        f.writelines(json.dumps(record) + "\n" for record in records)
    data = prepare("preference", pairs_file, os.path.abspath(args.init_from), os.path.join(work, "data_pairs"))
    run = os.path.join(work, "run_reward")
    steps = [f"train.max_steps={args.steps}", "train.epochs=null"] if args.steps else []
    seconds = train(data, run, [f"train.init_from={os.path.abspath(args.init_from)}", *steps, *args.overrides],
                    REWARD)
    reward_model = load_reward_model(export(run, os.path.join(work, "reward_export")))
    accuracy = ranked_right(reward_model, test_pairs)
    val_accuracy = last_metric(run, "val_rewards_accuracy")
    print_table(["reward model", "pairs", "train.py seconds", "val reward accuracy", "held-out pairs ranked right"],
                [[f"from {args.init_from}, {REWARD}", f"{len(records):,}", f"{seconds:.0f}", f"{val_accuracy:.3f}",
                  f"{accuracy:.3f} ({len(test_pairs)} pairs; target {TARGET})"]])
    with open(os.path.join(work, "reward_model.json"), "w") as f:
        json.dump({"init_from": args.init_from, "train": args.train, "test": args.test, "steps": args.steps,
                   "overrides": args.overrides, "pairs": len(records), "held_out_pairs": len(test_pairs),
                   "held_out_accuracy": accuracy, "val_rewards_accuracy": val_accuracy, "train_py_seconds": seconds},
                  f, indent=1)
    return 0 if accuracy >= TARGET else 1


if __name__ == "__main__":
    run_main(main)
