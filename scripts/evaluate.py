"""Score a checkpoint of any layout (or an export) on lm-evaluation-harness tasks, with the run's own tokenizer.

    pip install '.[eval]'
    python -m scripts.evaluate --out_dir out/quickstart --tasks data/eval/shakespeare.jsonl
    python -m scripts.evaluate --out_dir out/gpt2_124m --tag step_005000 --tasks hellaswag,arc_easy,piqa --limit 500
    python -m scripts.evaluate --export out/quickstart/export/step_002000 --tasks my_tasks/shakespeare.yaml

A task is a name the harness knows (its dataset comes from the Hugging Face hub, or the datasets cache), a task
YAML file (--include_path: a folder of them), or a JSONL file in HellaSwag's format (data/tasks.py), scored
as the training loop scores eval.tasks. A list of JSONL files runs offline; where the hub cannot be reached (one
attempt), the datasets are read from the cache only, so a local task YAML runs and a missing dataset fails at
once. The results are printed as a table and written to
<out_dir>/eval/<tag>.json (an export's: <export>/eval.json), merged with the tasks scored there before.
"""
import argparse
import os
from unittest import mock

import torch

from common import freeze_imports
from common.checks import ConfigError, ToolParser, exit_bad_input
from data.documents import documents_seen
from data.tokenizers import TokenizerError
from training.checkpoints.export import add_trained_arguments, load_trained
from training.evaluation.evaluate import (
    LOCAL,
    earlier_results,
    go_offline,
    hub_unreachable,
    local_task_file,
    task_spec,
    where,
    write_results,
)


def main(argv=None) -> None:
    args = parse_args(argv)
    names = [t.strip() for t in args.tasks.split(",") if t.strip()]
    try:  # a mistyped path is refused in a second, before the harness and the model load
        for name in names:
            local_task_file(name)
    except ConfigError as e:
        exit_bad_input(e)
    if all(name.endswith(".jsonl") for name in names):
        go_offline()
    elif os.environ.get("HF_HUB_OFFLINE") != "1" and (unreachable := hub_unreachable()):
        print(f"the Hugging Face hub cannot be reached ({unreachable}): the datasets are read from the cache only")
        go_offline()
    try:
        from lm_eval import evaluator
        from lm_eval.tasks import TaskManager
        from lm_eval.utils import make_table

        from training.evaluation.lm_eval_model import CheckpointLM, RequestError
    except ImportError as e:
        exit_bad_input(f"python -m scripts.evaluate needs lm-evaluation-harness ({e}); fix: pip install '.[eval]'")
    try:
        source, step, output = where(args.out_dir, args.tag, args.export, args.output)
        cfg, model, tokenizer, meta = load_trained(args.out_dir, args.tag, args.export)
        manager = TaskManager(include_path=args.include_path,
                              include_defaults=any(not name.endswith(LOCAL) for name in names))
        specs = [task_spec(name, tokenizer, manager, args.limit) for name in names]
        earlier = earlier_results(output)
    except (ConfigError, TokenizerError) as e:
        exit_bad_input(e)
    lm = CheckpointLM(model, cfg.block_size, cfg.vocab_size, tokenizer, args.device, args.batch_size,
                      documents_seen(cfg.document_masking, meta))
    try:
        # Work around simple_evaluate's environment report (torch's collect_env, which runs pip and nvidia-smi: a
        # second or more a run): it always makes one, lm_eval has no switch for it, and write_results keeps none.
        with mock.patch.object(evaluator, "add_env_info", lambda results: None):
            results = evaluator.simple_evaluate(model=lm, tasks=specs, task_manager=manager, limit=args.limit,
                                                  num_fewshot=args.num_fewshot, log_samples=False, bootstrap_iters=1000)
    except RequestError as e:
        exit_bad_input(e)
    except ConnectionError as e:  # a task's dataset is on the hub, which cannot be reached
        exit_bad_input(f"a task's dataset could not be fetched ({type(e).__name__}: {e}); fix: run once where the "
                       f"Hugging Face hub is reachable (the datasets cache keeps it), or score local task files")
    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
    write_results(output, earlier, results, source, step, args.limit)
    print(f"wrote {output}")


def parse_args(argv):
    parser = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_trained_arguments(parser, "score")
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


if __name__ == "__main__":
    freeze_imports()
    main()
