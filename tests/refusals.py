"""How a test checks a refusal: exit code 2, one `error:` line that says what is wrong, no traceback, and every
file the command would have overwritten as it was. Also the names in the run that the tools' tables damage
(conftest's `checkpointed_run`), and the damage that more than one table does to it."""
import hashlib
import shutil
from pathlib import Path

import pytest

from harness import train_py

TAG = "checkpoints/step_000002"  # the newest of the run's two checkpoints
SHARD = "mp_rank_00_model_states.pt"
EXPORT = "export/step_000001"  # the run's first checkpoint, exported


def snapshot(*folders) -> dict:
    """Every file under `folders`, with the digest of its bytes."""
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest()
            for folder in folders for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def command(base: dict, flags: dict, paths: dict) -> list[str]:
    """The argv of `base` with the row's `flags` (None leaves one out, True is a switch; a key that is not a
    flag is a positional argument), its {names} filled in."""
    argv = []
    for key, value in {**base, **flags}.items():
        if value is not None:
            argv += ([key] if key.startswith("--") else []) + ([] if value is True else [value.format(**paths)])
    return argv


def assert_one_error_line(stderr: str, message: str, paths: dict) -> None:
    """`message`'s parts (split at " ... ") in order in the one error line; a trailing "$" ends the line."""
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    line, position = lines[0], 0
    for part in message.format(**paths).removesuffix("$").split(" ... "):
        found = line.find(part, position)
        assert found >= 0, f"{part!r} not in {line!r}"
        position = found + len(part)
    assert not message.endswith("$") or position == len(line), line


def assert_refused(main, argv: list[str], message: str, paths: dict, capsys, keep) -> None:
    """main(argv) exits 2 with one `error:` line holding `message`; every file under `keep` is as it was."""
    before = snapshot(*keep)
    with pytest.raises(SystemExit) as stop:
        main(argv)
    stderr = capsys.readouterr().err
    assert stop.value.code == 2, stderr
    assert_one_error_line(stderr, message, paths)
    assert before.items() <= snapshot(*keep).items()  # nothing removed, nothing rewritten


def train_py_as_typed(*args):
    """`python train.py ARGS`, which is to stop at start: its exit code is the test's to check."""
    return train_py([*args], check=False, timeout=120)


def assert_refused_at_start(proc, message: str = "") -> None:
    """train.py exited 2 with `message` in its stderr, before its first step and without a traceback."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr
    assert "step 0" not in proc.stdout and "Traceback" not in proc.stderr


# Damage done to the run's copy before a row runs.

def truncated(run_dir):
    with open(run_dir / TAG / SHARD, "r+b") as f:
        f.truncate(1000)


def only_tag_truncated(run_dir):
    shutil.rmtree(run_dir / "checkpoints" / "step_000001")
    truncated(run_dir)
