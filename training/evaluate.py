"""Score a checkpoint of any layout (or an export) on lm-evaluation-harness tasks, with the run's own tokenizer.

    pip install '.[eval]'
    python -m training.evaluate --out_dir out/quickstart --tasks data/eval/shakespeare.jsonl
    python -m training.evaluate --out_dir out/gpt2_124m --tag step_005000 --tasks hellaswag,arc_easy,piqa --limit 500
    python -m training.evaluate --export out/quickstart/export/step_002000 --tasks my_tasks/shakespeare.yaml

A task is a name the harness knows (its dataset comes from the Hugging Face hub, or the datasets cache), a task
YAML file (--include_path: a folder of them), or a JSONL file in HellaSwag's format (data/tasks.py), scored
as the training loop scores eval.tasks. A list of JSONL files runs offline; for local task YAMLs set
HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1. The results are printed as a table and written to
<out_dir>/eval/<tag>.json (an export's: <export>/eval.json), merged with the tasks scored there before.
"""
import argparse
import difflib
import json
import os

import torch

from common.checks import ConfigError, ToolParser, existing_dir, existing_file, exit_bad_input, json_file
from data.tasks import harness_task, read_task
from data.tokenizers import TokenizerError
from data.writer import write_atomic
from training import checkpoint
from training.export import load_trained

LOCAL = (".jsonl", ".yaml", ".yml")


def main(argv=None) -> None:
    args = parse_args(argv)
    names = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if all(name.endswith(".jsonl") for name in names):  # read before datasets is imported, which reads them once
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
        from lm_eval.utils import make_table

        from training.lm_eval_model import CheckpointLM, RequestError
    except ImportError as e:
        exit_bad_input(f"python -m training.evaluate needs lm-evaluation-harness ({e}); fix: pip install '.[eval]'")
    try:
        source, step, output = where(args)
        cfg, model, tokenizer, _ = load_trained(args.out_dir, args.tag, args.export)
        manager = TaskManager(include_path=args.include_path,
                              include_defaults=any(not name.endswith(LOCAL) for name in names))
        specs = [task_spec(name, tokenizer, manager, args.limit) for name in names]
        earlier = earlier_results(output)
    except (ConfigError, TokenizerError) as e:
        exit_bad_input(e)
    lm = CheckpointLM(model, cfg.block_size, cfg.vocab_size, tokenizer, args.device, args.batch_size)
    try:
        results = lm_eval.simple_evaluate(model=lm, tasks=specs, task_manager=manager, limit=args.limit,
                                          num_fewshot=args.num_fewshot, log_samples=False, bootstrap_iters=1000)
    except RequestError as e:
        exit_bad_input(e)
    except ConnectionError as e:  # a task's dataset is on the hub, which cannot be reached
        exit_bad_input(f"a task's dataset could not be fetched ({type(e).__name__}: {e}); fix: run once where the "
                       f"Hugging Face hub is reachable (the datasets cache keeps it), or score local task files")
    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
    write_results(output, earlier, results, source, step, args)
    print(f"wrote {output}")


def parse_args(argv):
    parser = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--out_dir", help="a run's train.out_dir: score its checkpoint")
    source.add_argument("--export", help="a folder written by python -m training.export")
    parser.add_argument("--tag", help="with --out_dir: the checkpoint tag (default: the newest)")
    parser.add_argument("--tasks", required=True, help="comma-separated: harness task names, task YAML files, "
                        "JSONL files in HellaSwag's format")
    parser.add_argument("--limit", type=int, help="the first N examples of each task")
    parser.add_argument("--num_fewshot", type=int, help="examples shown before each question (the task's default)")
    parser.add_argument("--batch_size", type=int, default=16, help="rows a forward pass")
    parser.add_argument("--include_path", help="a folder of task YAML files, named in --tasks by their task names")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--output", help="the results file (default: <out_dir>/eval/<tag>.json)")
    args = parser.parse_args(argv)
    for name, low in (("limit", 1), ("num_fewshot", 0), ("batch_size", 1)):
        value = getattr(args, name)
        if value is not None and value < low:
            parser.error(f"--{name} {value} must be >= {low}")
    return args


def where(args) -> tuple[str, int, str]:
    """(what is scored, its training step, the results file)."""
    if args.export:
        existing_dir(args.export, "--export", "pass a folder written by python -m training.export")
        config = json_file(os.path.join(args.export, "config.json"), "export config",
                           "export the checkpoint again", keys=("megalite.step",))
        return args.export, config["megalite"]["step"], args.output or os.path.join(args.export, "eval.json")
    tag_dir = checkpoint.find_checkpoint(args.out_dir, args.tag)
    tag = os.path.basename(tag_dir)
    output = args.output or os.path.join(args.out_dir, "eval", f"{tag}.json")
    return tag_dir, checkpoint.read_run_state(tag_dir)["step"], output


def task_spec(name: str, tokenizer, manager, limit: int | None):
    """What simple_evaluate is given for one --tasks entry, checked: a JSONL file's examples are read here."""
    if name.endswith(".jsonl"):
        read_task(existing_file(name, "--tasks file", "pass a JSONL file in HellaSwag's format"), tokenizer, limit)
        return harness_task(name)
    if name.endswith((".yaml", ".yml")):
        return existing_file(name, "--tasks file", "pass a task YAML of lm-evaluation-harness")
    if name not in manager.all_tasks:
        close = difflib.get_close_matches(name, manager.all_tasks, n=3)
        raise ConfigError(f"unknown task {name!r}: not a task, group or tag of lm-evaluation-harness, nor a .jsonl "
                          f"or .yaml file" + (f" (did you mean {', '.join(close)}?)" if close else "") +
                          "; fix: python -m lm_eval ls tasks lists them")
    return name


def earlier_results(output: str) -> dict:
    """The results file's earlier tasks; a file there that is not one is refused, not overwritten, and the
    folder must take a new file: both found before any scoring."""
    if not os.path.exists(output):
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        if not os.access(os.path.dirname(os.path.abspath(output)), os.W_OK):
            raise ConfigError(f"--output {output} cannot be written; fix: pass another --output")
        return {}
    fix = "pass another --output"
    record = json_file(output, "--output", fix, keys=("tasks",))
    if not isinstance(record["tasks"], dict):
        raise ConfigError(f"--output {output} is not a results file of python -m training.evaluate; fix: {fix}")
    return record


def write_results(output: str, earlier: dict, results: dict, source: str, step: int, args) -> None:
    """The tasks scored now over the earlier ones of the same file, each with how it was scored."""
    tasks = dict(earlier.get("tasks", {}))
    for name, metrics in {**results["results"], **results.get("groups", {})}.items():
        tasks[name] = {"metrics": metrics, "n_shot": results.get("n-shot", {}).get(name),
                       "version": results.get("versions", {}).get(name), "limit": args.limit}
    record = {"source": source, "step": step, "tasks": tasks}
    write_atomic(output, (json.dumps(record, indent=1, default=str) + "\n").encode())


if __name__ == "__main__":
    main()
