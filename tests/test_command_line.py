"""Every tool as a user types it: a bad input or a bad command line ends in one `error:` line and exit code 2,
with no traceback and no usage text, naming the tool as typed."""
import os
import sys

import pytest

from harness import run
from refusals import assert_one_error_line, only_tag_truncated, snapshot, truncated

# One row of each tool as a user types it: (command, damage, message).
AS_TYPED = [
    ([sys.executable, "-m", "data.prepare", "--input", "{inputs}/not_gzip.jsonl.gz", "--out_dir", "{tmp}/out"], None,
     "input {inputs}/not_gzip.jsonl.gz is not gzip data"),
    ([sys.executable, "-m", "scripts.export", "--out_dir", "{run}", "--output", "{run}/metrics.jsonl"], None,
     "--output {run}/metrics.jsonl is a file, not a folder"),
    ([sys.executable, "sample.py", "--out_dir", "{run}"], only_tag_truncated, "is corrupt: 1,000 bytes, ... fix: "
     "there is no other complete checkpoint in {root}"),
    ([sys.executable, "-m", "scripts.convert_checkpoint", "universal", "--out_dir", "{run}"], truncated,
     "is corrupt: 1,000 bytes, ... fix: resume from another tag: step_000001$"),
    ([sys.executable, "-m", "scripts.plot", "{run}", "--output", "{run}/metrics.jsonl", "--force"], None,
     "--output {run}/metrics.jsonl is not an image file matplotlib writes"),
    ([sys.executable, "preflight.py", "--min_busbw", "-1"], None, "--min_busbw -1.0: must be >= 0"),
    ([sys.executable, "-m", "scripts.evaluate", "--out_dir", "{run}", "--tasks", "{tmp}/none.jsonl"], None,
     "--tasks file {tmp}/none.jsonl does not exist"),
    ([sys.executable, "-m", "scripts.evaluate", "--out_dir", "{run}", "--tasks", "{inputs}/empty.jsonl"], None,
     "--tasks file {inputs}/empty.jsonl is empty; fix: pass a JSONL file in HellaSwag's format$"),
    ([sys.executable, "-m", "data.continuation_task", "--input", "{tmp}/none.txt"], None,
     "--input {tmp}/none.txt does not exist; fix: pass tinyshakespeare.txt"),
]


@pytest.mark.parametrize("cmd,damage,message", AS_TYPED, ids=[next(p for p in row[0][1:] if p != "-m")
                                                               for row in AS_TYPED])
def test_each_tool_as_typed(paths, inputs, cmd, damage, message):
    paths = {**paths, "inputs": inputs}
    if damage:
        damage(paths["run"])
    before = snapshot(paths["run"], inputs)
    proc = run([part.format(**paths) for part in cmd], check=False, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert_one_error_line(proc.stderr, message, paths)
    assert before.items() <= snapshot(paths["run"], inputs).items()


# (the tool as typed, a command line argparse refuses, the error line's words): argparse's own errors end in one
# `error:` line and exit 2 too, naming the tool as the user typed it (common.checks.ToolParser).
BAD_COMMAND_LINES = [
    ("train.py", ["--bogus"], "error: train.py: unrecognized arguments: --bogus; fix: see train.py --help"),
    ("train.py", ["train.init_from=..."], "error: override 'train.init_from=...': YAML cannot read the value '...' "
                                          "(did not find expected node content); fix: give a value there"),
    ("train.py", ["ds.zero_optimization.stage=[1"], "error: override 'ds.zero_optimization.stage=[1': YAML cannot "
                                                    "read the value '[1'"),
    ("preflight.py", ["--min_busbw", "x"], "error: preflight.py: argument --min_busbw: invalid float value: 'x'"),
    ("preflight.py", ["--world", "16"], "error: --world is an option of --dry_run, which checks a layout at that scale "
                                        "without starting a rank; fix: add --dry_run, or leave it out (a launched "
                                        "preflight's world is the launcher's)"),
    ("sample.py", [], "error: sample.py: one of the arguments --out_dir --export is required"),
    ("sample.py", ["--export", "x", "--repetition_penalty", "0"], "error: --repetition_penalty=0.0: must be above 0 "
                                                                 "(1: none)"),
    ("-m data.prepare", ["--workers", "x"], "error: python -m data.prepare: argument --workers: invalid int value: "
                                            "'x'; fix: see python -m data.prepare --help"),
    ("-m scripts.export", [], "error: python -m scripts.export: the following arguments are required: --out_dir"),
    ("-m scripts.chat", ["--export", "x", "--top_p", "0"], "error: --top_p=0.0: must be in (0, 1]"),
    ("-m scripts.chat", ["--export", "x", "--max_model_len", "1"], "error: --max_model_len 1: must be at least 2"),
    ("-m scripts.convert_checkpoint", ["convert"], "error: python -m scripts.convert_checkpoint: argument command: "
                                                   "invalid choice"),
    ("-m scripts.plot", [], "error: python -m scripts.plot: the following arguments are required: RUN_DIR"),
    ("-m scripts.memory_plan", [], "error: python -m scripts.memory_plan: the following arguments are required"),
    ("-m scripts.evaluate", ["--out_dir", "x"], "error: python -m scripts.evaluate: the following arguments are "
                                                 "required: --tasks"),
    ("-m data.continuation_task", [], "error: python -m data.continuation_task: the following arguments are required: "
                                      "--input"),
    ("benchmarks/throughput.py", ["--steps", "x"], "error: throughput.py: argument --steps: invalid int value"),
    ("-m training.checkpoints.export", [], "error: python -m training.checkpoints.export is a library module, not "
                                           "a command; fix: run python -m scripts.export"),
    ("-m training.evaluation.evaluate", [], "error: python -m training.evaluation.evaluate is a library module, "
                                            "not a command; fix: run python -m scripts.evaluate"),
    ("-m data.prepare_chat", [], "error: python -m data.prepare_chat is a library module, not a command; fix: run "
                                 "python -m data.prepare --format chat"),
]


@pytest.mark.parametrize("tool, args, message", BAD_COMMAND_LINES, ids=[" ".join([row[0], *row[1]])
                                                                      for row in BAD_COMMAND_LINES])
@pytest.mark.filterwarnings("ignore:.*found in sys.modules after import of package")  # runpy on imported modules
def test_a_bad_command_line_is_one_error_line(tool, args, message, monkeypatch, capsys):
    """In this process through each tool's `__main__` block, but for the two that set up a rank (signal handlers,
    a fault handler), which run as typed."""
    import runpy
    if tool in ("train.py", "preflight.py"):
        proc = run([sys.executable, tool, *args], check=False, timeout=120)
        code, stderr = proc.returncode, proc.stderr
    else:
        monkeypatch.setattr(sys, "path", list(sys.path))  # scripts put the repo on it again
        monkeypatch.setattr(sys, "argv", [tool.split()[-1], *args])
        with pytest.raises(SystemExit) as ended:
            if tool.startswith("-m "):
                runpy.run_module(tool[3:], run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(os.path.join(os.path.dirname(os.path.dirname(__file__)), tool), run_name="__main__")
        code, stderr = ended.value.code, capsys.readouterr().err
    assert code == 2, stderr
    assert [line for line in stderr.splitlines() if line.startswith("error:")] == [line for line in stderr.splitlines()
                                                                                  if message in line]
    assert message in stderr and "usage:" not in stderr


def test_the_preflights_help_is_its_own():
    """Its own description and options, and where the rest of its command line goes (train.py's)."""
    proc = run([sys.executable, "preflight.py", "--help"], timeout=120)
    assert proc.stdout.startswith("usage: preflight.py") and "Check a multi-node layout" in proc.stdout
    assert all(flag in proc.stdout for flag in ("--dry_run", "--world", "--gpus_per_node", "--gpu_gb", "--min_busbw"))
    assert "Every other argument is train.py's (python train.py --help)" in proc.stdout
