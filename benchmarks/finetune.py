"""Fine-tuning on a task with a checkable answer, the reverse-the-words task (data/reverse_task.py): exact-match
accuracy on held-out prompts, before and after.

    python benchmarks/finetune.py --init_from out/llama_quickstart_export   # the README's example
    python benchmarks/finetune.py                # from scratch: the prompt left out of the loss, or trained on
    python benchmarks/finetune.py --steps 300    # a quicker, rougher figure
    python benchmarks/finetune.py --init_from out/llama_quickstart_export --lora_rank 8   # and with LoRA

--init_from EXPORT, the README's fine-tuning example as it runs: the task's defaults (`python -m data.reverse_task`:
--train 3,000 conversations of 2 or 3 of its 23 words, --test 200 held-out prompts) are prepared with the export's
own tokenizer (`data.prepare --format chat --tokenizer EXPORT --context 64`: the quickstart's characters, the
built-in template lines), and configs/llama_quickstart_sft.yaml trains on them as it is (its epochs; --steps
replaces them) from the export, then from scratch (train.init_from=null) on the same data, and with --lora_rank
R from the export with adapters of rank R (its other weights frozen) at --lora_lr; the seconds each
train.py took are printed beside. "Before" is the export, or the initialization.

Without it, the prompt masked or not: 2 to 6 words (--train 4,000), prepared twice with a character tokenizer of
their own (`--context 128`: `--train_on all`, the assistant's tokens; `--train_on everything`, every token), each
trained from the same initialization (the preset at context 128 and a pretraining learning rate, since it starts
from scratch) for --steps steps (1,500). "Before" is the initialization.

Accuracy: the share of held-out prompts whose greedy answer (`sample.py --chat`'s, up to the end of turn) is
exactly the reversal.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.report import at_least, print_table, run_main, run_tool, work_folder
from common.checks import ConfigError, ToolParser
from data.reverse_task import answer, conversation, prompt, tasks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "configs/llama_quickstart_sft.yaml"
CONTEXT = 128  # the longest task of the masking comparison, in characters through the plain template, fits whole
FROM_SCRATCH = ["optim.lr=1e-3", "optim.min_lr=1e-4", "optim.warmup_steps=50", "train.eval_interval=0",
                f"model.block_size={CONTEXT}", "ds.bf16.enabled=false", "sample.max_new_tokens=0"]
EXAMPLE_CONTEXT = 64  # the quickstart Llama's block_size


def trained(run_dir: str):
    """(model config, model, tokenizer, dataset meta) of a run's last checkpoint."""
    from training.checkpoints.export import load_trained

    return load_trained(run_dir)


def initial(run_dir: str):
    """trained(run_dir) with the model at the run's initialization from scratch (its seed), not its weights."""
    from model import build_model
    from training.checkpoints import checkpoint

    cfg, _, tokenizer, meta = trained(run_dir)
    seed = checkpoint.read_run_state(checkpoint.find_checkpoint(run_dir, None))["config"]["train"]["seed"]
    return cfg, build_model(cfg, seed), tokenizer, meta


def accuracy(cfg, model, tokenizer, meta, held_out: list[list[str]]) -> float:
    """The share of held-out prompts the model answers exactly (greedy, up to the end of turn), through the chat
    template and tokenizer of `meta`."""
    said = greedy_answers(cfg, model, tokenizer, meta, held_out)
    return sum(ids == tokenizer.encode(answer(words)) for ids, words in zip(said, held_out)) / len(held_out)


def greedy_answers(cfg, model, tokenizer, meta, prompts: list[list[str]]) -> list[list[int] | None]:
    """The model's greedy answer to each task's prompt, through the chat template and tokenizer of `meta`: its ids
    up to the end of turn, or None where it never ends its turn."""
    from data.chat import chat_prompt
    from model.generate import Sampling, decoder_for, generate

    decoder = decoder_for(model.eval(), cfg.block_size, cfg.vocab_size)
    said = []
    for words in prompts:
        ids, stop = chat_prompt([{"role": "user", "content": prompt(words)}], meta, tokenizer, "a held-out prompt",
                                "fine-tune it first")
        out = generate(decoder, ids, Sampling(48, 0.0, stop_ids=(stop,)))
        said.append(out[:-1] if out and out[-1] == stop else None)
    return said


def write_tasks(path: str, drawn: list[list[str]]) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(conversation(w)) + "\n" for w in drawn)
    return path


def train(data: str, run: str, settings: list[str], config: str = CONFIG) -> float:
    """train.py on `data` into a fresh `run`; its wall seconds."""
    shutil.rmtree(run, ignore_errors=True)  # this benchmark's own earlier run
    start = time.perf_counter()
    run_tool([sys.executable, "train.py", "--config", config, f"data.dir={data}", f"train.out_dir={run}",
              "train.resume=none", *settings], cwd=REPO, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def from_export(args, work: str) -> dict:
    """The README's example: the preset from the export and from scratch, on the export's tokenizer."""
    from training.checkpoints.export import load_trained

    train_tasks, held_out = tasks(args.train or 3000, args.test)
    data, export = os.path.join(work, "data_example"), os.path.abspath(args.init_from)
    run_tool([sys.executable, "-m", "data.prepare", "--format", "chat", "--input",
              write_tasks(os.path.join(work, "tasks.jsonl"), train_tasks), "--tokenizer", export,
              "--context", str(EXAMPLE_CONTEXT), "--out_dir", data, "--force"], cwd=REPO)
    steps = [f"train.max_steps={args.steps}", "train.epochs=null"] if args.steps else []
    starts = {"export": [f"train.init_from={export}"], "scratch": ["train.init_from=null"]}
    if args.lora_rank:
        starts["lora"] = [f"train.init_from={export}", f"model.lora_rank={args.lora_rank}", f"optim.lr={args.lora_lr}",
                          f"optim.min_lr={args.lora_lr / 10}"]
    results = {}
    for start, settings in starts.items():
        run = os.path.join(work, f"run_{start}")
        seconds = train(data, run, [*settings, "train.eval_interval=0", *steps, *args.overrides])
        cfg, model, tokenizer, meta = trained(run)
        before = (initial(run)[:2] if start == "scratch" else load_trained(None, None, args.init_from)[:2])
        results[start] = {"before": accuracy(*before, tokenizer, meta, held_out),
                          "after": accuracy(cfg, model, tokenizer, meta, held_out), "train_py_seconds": seconds,
                          "steps": _last_step(run)}
    names = {"export": f"the export {args.init_from}", "scratch": "from scratch (train.init_from=null)",
             "lora": f"the export, LoRA rank {args.lora_rank} at optim.lr={args.lora_lr:g}"}
    print_table(["start", "steps", "train.py seconds", "exact match before", "exact match after"],
                [[names[k], r["steps"], f"{r['train_py_seconds']:.0f}", f"{r['before']:.3f}", f"{r['after']:.3f}"]
                 for k, r in results.items()])
    return results


def masking(args, work: str) -> dict:
    """From scratch, the loss on the answers against on every token."""
    train_tasks, held_out = tasks(args.train or 4000, args.test, lengths=(2, 6))
    tasks_file = write_tasks(os.path.join(work, "tasks.jsonl"), train_tasks)
    results = {}
    for train_on in ("all", "everything"):
        data, run = os.path.join(work, f"data_{train_on}"), os.path.join(work, f"run_{train_on}")
        run_tool([sys.executable, "-m", "data.prepare", "--format", "chat", "--input", tasks_file, "--tokenizer",
                  "char", "--context", str(CONTEXT), "--train_on", train_on, "--val_fraction", "0.02", "--out_dir",
                  data, "--force"], cwd=REPO)
        steps = args.steps or 1500
        train(data, run, [f"train.max_steps={steps}", "train.epochs=null", f"train.save_interval={steps}",
                          *FROM_SCRATCH, *args.overrides])
        cfg, model, tokenizer, meta = trained(run)
        results[train_on] = {"before": accuracy(*initial(run)[:2], tokenizer, meta, held_out),
                             "after": accuracy(cfg, model, tokenizer, meta, held_out)}
    print_table(["loss on", "exact match before", "exact match after"],
                [["the answers (--train_on all)" if k == "all" else "every token (--train_on everything)",
                  f"{r['before']:.3f}", f"{r['after']:.3f}"] for k, r in results.items()])
    return results


def _last_step(run: str) -> int:
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return max(json.loads(line).get("step", 0) for line in f if line.strip())


def main() -> None:
    parser = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--init_from", help="an export of the quickstart Llama (python -m scripts.export): the "
                        "README's example from it and from scratch")
    parser.add_argument("--train", type=int, help="training conversations (default: 3,000 with --init_from, else "
                        "4,000)")
    parser.add_argument("--test", type=int, default=200, help="held-out prompts")
    parser.add_argument("--steps", type=int, help="default: the preset's epochs with --init_from, else 1,500")
    parser.add_argument("--lora_rank", type=int, default=0, help="with --init_from: also the export fine-tuned "
                        "with adapters of this rank (model.lora_rank), at --lora_lr")
    parser.add_argument("--lora_lr", type=float, default=3e-3, help="the LoRA run's optim.lr (min_lr a tenth)")
    parser.add_argument("--work_dir", default=os.path.join("out", "finetune"))
    parser.add_argument("overrides", nargs="*", help="run-config key=value for every run")
    args = parser.parse_intermixed_args()
    at_least(args, 1, "test", *(name for name in ("train", "steps") if getattr(args, name) is not None))
    at_least(args, 0, "lora_rank")
    if args.init_from is not None and not os.path.isfile(os.path.join(args.init_from, "config.json")):
        raise ConfigError(f"--init_from {args.init_from} holds no export (config.json); fix: export the quickstart "
                          f"Llama with python -m scripts.export --out_dir out/llama_quickstart")
    work = work_folder(os.path.join(REPO, args.work_dir))
    results = from_export(args, work) if args.init_from else masking(args, work)
    with open(os.path.join(work, "finetune.json"), "w") as f:
        json.dump({"init_from": args.init_from, "steps": args.steps or (None if args.init_from else 1500),
                   "train": args.train or (3000 if args.init_from else 4000), "test": args.test, **results}, f,
                  indent=1)


if __name__ == "__main__":
    run_main(main)
