"""What `python -m scripts.evaluate` scores with lm-evaluation-harness, and where: the checkpoint or export and
its results file, each --tasks entry checked before any scoring, the results merged with the file's earlier tasks.
"""
import difflib
import json
import os
import urllib.error
import urllib.request

from common.checks import ConfigError, existing_dir, existing_file, json_file
from data.tasks import harness_task, read_task
from data.writer import write_atomic
from training.checkpoints import checkpoint
from training.checkpoints.hf_folder import is_hf_folder

LOCAL = (".jsonl", ".yaml", ".yml")
OFFLINE = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")  # read once, when datasets and huggingface_hub are imported


def hub_unreachable(timeout_s: float = 5) -> str | None:
    """Why the Hugging Face hub cannot be reached (one attempt), or None. Online, the datasets library tries a
    missing hub five times over about 30 s before it says so, and before it falls back to its cache."""
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return None  # it answered
    except (urllib.error.URLError, OSError) as e:
        return f"{endpoint}: {getattr(e, 'reason', e)}"
    return None


def go_offline() -> None:
    """The datasets library and the hub's client read only their caches (before either is imported)."""
    for name in OFFLINE:
        os.environ[name] = "1"


def where(out_dir: str | None, tag: str | None, export: str | None, output: str | None) -> tuple[str, int | None, str]:
    """(what is scored, its training step (None for a Hugging Face model's folder), the results file): the export,
    else the run's checkpoint `tag` (or its newest); the results file `output`, else the export's eval.json or
    <out_dir>/eval/<tag>.json."""
    if is_hf_folder(export):  # a Hugging Face model's: no step of this repo's training
        return export, None, output or os.path.join(export, "eval.json")
    if export:
        existing_dir(export, "--export", "pass a folder written by python -m scripts.export")
        config = json_file(os.path.join(export, "config.json"), "export config",
                           "export the checkpoint again", keys=("megalite.step",))
        return export, config["megalite"]["step"], output or os.path.join(export, "eval.json")
    tag_dir = checkpoint.find_checkpoint(out_dir, tag)
    output = output or os.path.join(out_dir, "eval", f"{os.path.basename(tag_dir)}.json")
    return tag_dir, checkpoint.read_run_state(tag_dir)["step"], output


def local_task_file(name: str) -> str | None:
    """A --tasks entry that names a file (JSONL in HellaSwag's format, or a task YAML of the harness), checked to
    exist; None for a task the harness names."""
    if name.endswith(".jsonl"):
        return existing_file(name, "--tasks file", "pass a JSONL file in HellaSwag's format")
    if name.endswith((".yaml", ".yml")):
        return existing_file(name, "--tasks file", "pass a task YAML of lm-evaluation-harness")
    return None


def task_spec(name: str, tokenizer, manager, limit: int | None):
    """What simple_evaluate is given for one --tasks entry, checked: a JSONL file's examples are read here."""
    path = local_task_file(name)
    if path and path.endswith(".jsonl"):
        read_task(path, tokenizer, limit)
        return harness_task(name)
    if path:
        return path
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
        raise ConfigError(f"--output {output} is not a results file of python -m scripts.evaluate; fix: {fix}")
    return record


def write_results(output: str, earlier: dict, results: dict, source: str, step: int, limit: int | None) -> None:
    """The tasks scored now over the earlier ones of the same file, each with how it was scored."""
    tasks = dict(earlier.get("tasks", {}))
    for name, metrics in {**results["results"], **results.get("groups", {})}.items():
        tasks[name] = {"metrics": metrics, "n_shot": results.get("n-shot", {}).get(name),
                       "version": results.get("versions", {}).get(name), "limit": limit}
    record = {"source": source, "step": step, "tasks": tasks}
    write_atomic(output, (json.dumps(record, indent=1, default=str) + "\n").encode())


if __name__ == "__main__":
    from common.checks import not_a_command

    not_a_command("training.evaluation.evaluate", "python -m scripts.evaluate")
