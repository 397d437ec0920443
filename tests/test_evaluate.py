"""python -m scripts.evaluate refuses what it cannot score, in one `error:` line and exit code 2, before any
scoring and leaving the run as it was (one table, in process on conftest's `checkpointed_run`, a char model of
context 32); the docs' task YAML runs offline and scores as the JSONL form does; without the eval extra it says
how to install it."""
import json
import shutil
import sys

import pytest

import scripts.evaluate
from harness import free_port, run
from refusals import assert_refused, command

GOOD = {"ctx": "ROMEO:\nGood morrow,", "endings": ["sir", "lord"], "label": 0}


def write_tasks(folder) -> None:
    """The task files the rows name: a good one, one with a bad line, one whose ending outruns the context."""
    lines = {"task.jsonl": [GOOD], "bad.jsonl": [GOOD, {"ctx": "a", "endings": ["b", "c"]}],
             "long.jsonl": [{"ctx": "ROMEO:", "endings": ["x" * 40, "y"], "label": 0}]}
    for name, records in lines.items():
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "other.json").write_text('{"a": 1}')


BASE = {"--out_dir": "{run}", "--tasks": "{tmp}/task.jsonl", "--output": "{tmp}/results.json"}
ROWS = [
    ({"--tasks": "hellaswagg"}, "unknown task 'hellaswagg': not a task, group or tag of lm-evaluation-harness, nor a "
                                ".jsonl or .yaml file (did you mean hellaswag"),
    ({"--tag": "step_000009"}, "--tag=step_000009: no such checkpoint"),
    ({"--tasks": "{tmp}/bad.jsonl"}, "{tmp}/bad.jsonl, line 2: the example lacks label; fix: write one example a line "
                                     "in HellaSwag's format"),
    ({"--tasks": "{tmp}/none.jsonl"}, "--tasks file {tmp}/none.jsonl does not exist"),
    ({"--tasks": "{tmp}/none.yaml"}, "--tasks file {tmp}/none.yaml does not exist"),
    # a mistyped task file is named before the checkpoint is looked for and the harness imported
    ({"--out_dir": "{tmp}/no_run", "--tasks": "{tmp}/none.jsonl"}, "--tasks file {tmp}/none.jsonl does not exist"),
    ({"--output": "{tmp}/other.json"}, "--output {tmp}/other.json lacks tasks (written by another version of this "
                                       "repo, or another tool); fix: pass another --output"),
    ({"--tasks": "{tmp}/long.jsonl"}, "the continuation ' xxxxxxxx ... ': a choice of 41 tokens is longer than the "
                                      "model's context of 32; fix: score tasks whose choices fit the model's context"),
    ({"--limit": "0"}, "--limit 0 must be >= 1"),
]


@pytest.mark.parametrize("flags,message", ROWS, ids=["unknown-task", "tag", "format", "jsonl-missing", "yaml-missing",
                                                     "task-before-run", "output", "too-long", "limit"])
def test_evaluate_refuses(paths, capsys, flags, message):
    write_tasks(paths["tmp"])
    assert_refused(scripts.evaluate.main, command(BASE, flags, paths), message, paths, capsys,
                   [paths["run"], paths["tmp"] / "other.json"])


def test_without_the_eval_extra_it_says_how_to_install_it(tmp_path, paths):
    """lm_eval shadowed by a package that cannot be imported: as on a machine without the extra."""
    shim = tmp_path / "shim" / "lm_eval"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError(\"No module named 'lm_eval'\")\n")
    write_tasks(tmp_path)
    proc = run([sys.executable, "-m", "scripts.evaluate", "--out_dir", str(paths["run"]), "--tasks",
                str(tmp_path / "task.jsonl")], check=False, env={"PYTHONPATH": str(tmp_path / "shim")})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == ("error: python -m scripts.evaluate needs lm-evaluation-harness "
                                                    "(No module named 'lm_eval'); fix: pip install '.[eval]'")


def test_a_hub_that_cannot_be_reached_is_tried_once_and_the_cache_read(tmp_path, paths):
    """Where the hub does not answer (a closed loopback port here), the datasets library would try it five times
    over about 30 s: one attempt, then the cache alone, empty here, and one line."""
    proc = run([sys.executable, "-m", "scripts.evaluate", "--out_dir", str(paths["run"]), "--tasks", "hellaswag",
                "--limit", "2"], check=False, env={"HF_ENDPOINT": f"http://127.0.0.1:{free_port()}",
                                                   "HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_OFFLINE": "0",
                                                   "HF_HUB_OFFLINE": "0"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "the Hugging Face hub cannot be reached (http://127.0.0.1:" in proc.stdout
    assert proc.stderr.strip().splitlines()[-1].startswith("error: a task's dataset could not be fetched")
    assert "Retrying" not in proc.stdout + proc.stderr


def test_results_of_other_tasks_are_kept(paths, capsys):
    """A second evaluation of the same checkpoint adds its tasks to the results file, keeping the first's."""
    write_tasks(paths["tmp"])
    shutil.copy(paths["tmp"] / "task.jsonl", paths["tmp"] / "second.jsonl")
    for name in ("task", "second"):
        scripts.evaluate.main(command(BASE, {"--tasks": f"{{tmp}}/{name}.jsonl"}, paths))
    record = json.loads((paths["tmp"] / "results.json").read_text())
    assert record["step"] == 2 and record["source"] == str(paths["tag"])
    assert sorted(record["tasks"]) == ["second", "task"]
    assert record["tasks"]["task"]["metrics"]["acc,none"] == record["tasks"]["second"]["metrics"]["acc,none"]
    assert record["tasks"]["task"]["limit"] is None and record["tasks"]["task"]["n_shot"] == 0
    assert "|task |" in capsys.readouterr().out  # the harness's table


def test_an_export_scores_as_its_checkpoint(paths):
    """--export reads the safetensors export of step 1; its score is that of the checkpoint it came from."""
    write_tasks(paths["tmp"])
    scored = {}
    for name, source in (("export", {"--out_dir": None, "--export": "{export}"}),
                         ("checkpoint", {"--tag": "step_000001"})):
        scripts.evaluate.main(command(BASE, {**source, "--output": f"{{tmp}}/{name}.json"}, paths))
        scored[name] = json.loads((paths["tmp"] / f"{name}.json").read_text())
    assert scored["export"]["step"] == scored["checkpoint"]["step"] == 1
    assert scored["export"]["tasks"]["task"]["metrics"] == scored["checkpoint"]["tasks"]["task"]["metrics"]
