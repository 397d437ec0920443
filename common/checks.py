"""Range checks for run settings, written next to each setting's dataclass as one line per setting.

Each config dataclass (model/config.py, training/config.py) has a `check(self, c: Checks)` method;
load_run_config calls it for every section after the YAML and the overrides are merged, so every bad
value stops the run before any data is read or any process starts. A new setting's check is one line:

    c.at_least("eval_interval", 0, "0 evaluates only at step 0 and at the end")

Messages read "<section.key>=<value>: must be ...; fix: ...". A value of None (an Optional setting left
unset) passes every range check; the dataclass documents what None means.
"""
import argparse
import json
import os
import sys


class ConfigError(ValueError):
    """A bad setting; the message names it and how to fix it."""


def exit_bad_input(message) -> None:
    """How a command-line tool ends on bad input, as train.py does: one line on stderr, exit 2, no traceback."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def not_a_command(module: str, command: str) -> None:
    """What a library module says when run with `python -m` (a command's old home): where the command is now."""
    exit_bad_input(f"python -m {module} is a library module, not a command; fix: run {command}")


class ToolParser(argparse.ArgumentParser):
    """argparse for every tool: a bad command line ends as any bad input does, in one `error:` line and exit 2
    (argparse's own error prints the usage first, over several lines). A tool run as `python -m data.prepare`
    is named so, not "prepare.py"."""

    def __init__(self, *args, **kwargs):
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        if spec is not None and spec.name.split(".")[0] in ("data", "scripts", "benchmarks"):
            kwargs.setdefault("prog", f"python -m {spec.name}")
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        exit_bad_input(f"{self.prog}: {message}; fix: see {self.prog} --help")


# The repo is run from its root: its shipped paths (data/shakespeare_char, out/quickstart, data/eval) are
# relative to it, and relative paths are read from the current folder, as every tool reads them. A message
# about a relative path read from another folder names its absolute place and that folder, and its fix a
# command that works from there.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_elsewhere(path: str) -> bool:
    """Is `path` relative, and the current folder not the repo's root?"""
    return not os.path.isabs(path) and not _at_repo_root()


def place(path: str) -> str:
    """`path` as a message names it: as given, or its absolute place where it is read_elsewhere."""
    return os.path.abspath(path) if read_elsewhere(path) else path


def read_from(path: str) -> str:
    """Where read_elsewhere(path), which folder it was read from, to follow a message's place(path); else ''."""
    return f"{path} is read from the current folder, {os.getcwd()}" if read_elsewhere(path) else ""


def tool_command(module: str) -> str:
    """How to start the repo's tool `module` (e.g. "data.prepare") from the current folder: `python -m
    data.prepare` at the repo's root, its script by its absolute path from any other (data/prepare.py and
    scripts/plot.py put the repo's root on their import path)."""
    if _at_repo_root():
        return f"python -m {module}"
    return f"python {os.path.join(REPO_ROOT, *module.split('.'))}.py"


def _at_repo_root() -> bool:
    try:
        return os.path.samefile(os.getcwd(), REPO_ROOT)
    except OSError:  # the current folder was removed
        return False


# Every tool's path arguments go through these three, so one wrong path reads the same wherever it is given:
# "<what> <path> <problem>; fix: <fix>".
def existing_dir(path: str, what: str, fix: str) -> str:
    """`path` must be a folder this process can list."""
    problem = _path_problem(path, folder=True)
    if problem:
        raise ConfigError(f"{what} {path} {problem}; fix: {fix}")
    return path


def existing_file(path: str, what: str, fix: str) -> str:
    """`path` must be a file this process can read, and not an empty one."""
    problem = _path_problem(path, folder=False) or ("is empty" if os.path.getsize(path) == 0 else None)
    if problem:
        raise ConfigError(f"{what} {path} {problem}; fix: {fix}")
    return path


def new_output(path: str, what: str, fix: str, folder: bool = True) -> str:
    """An output that must not overwrite earlier results: a path that is free (or, for a folder, an empty
    folder) and whose parent folder exists or can be made."""
    if os.path.isdir(path) != folder and os.path.exists(path):
        raise ConfigError(f"{what} {path} is a {'file' if folder else 'folder'}, not a {'folder' if folder else 'file'}"
                          f"; fix: {fix}")
    if os.path.exists(path) and (not folder or os.listdir(path)):
        raise ConfigError(f"{what} {path} already exists and would be overwritten; fix: {fix}")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError(f"{what} {path} cannot be created: {parent} is a file; fix: {fix}")
    if not os.access(parent, os.W_OK):
        raise ConfigError(f"{what} {path} cannot be created: {parent} is not writable; fix: {fix}")
    return path


def writable_dir(path: str, what: str, fix: str) -> str:
    """A folder a tool writes into beside what it holds (a dataset it replaces only at the end): an existing
    folder this process can write to, or a path new_output would accept."""
    if not os.path.isdir(path):
        return new_output(path, what, fix, folder=True)
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {path} is not writable (permissions); fix: {fix}")
    return path


def json_file(path: str, what: str, fix: str, keys=()) -> dict:
    """A JSON object read from `path`, checked as existing_file checks it, holding every one of `keys` ("a.b":
    key b of the object under a): a file from another tool or another version of this repo stops here."""
    existing_file(path, what, fix)
    try:
        with open(path, "rb") as f:
            value = json.loads(f.read())
    except ValueError as e:  # malformed JSON, or bytes that are not text at all
        raise ConfigError(f"{what} {path} is not JSON ({e}); fix: {fix}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{what} {path} holds a JSON {type(value).__name__}, not an object; fix: {fix}")
    missing = [key for key in keys if not _has(value, key.split("."))]
    if missing:
        raise ConfigError(f"{what} {path} lacks {', '.join(missing)} (written by another version of this repo, or "
                          f"another tool); fix: {fix}")
    return value


def _has(value, path: list[str]) -> bool:
    return not path or (isinstance(value, dict) and path[0] in value and _has(value[path[0]], path[1:]))


def _path_problem(path: str, folder: bool) -> str | None:
    if not os.path.exists(path):
        return "does not exist"
    if os.path.isdir(path) != folder:
        return f"is a {'file' if folder else 'folder'}, not a {'folder' if folder else 'file'}"
    if not os.access(path, os.R_OK | (os.X_OK if folder else 0)):
        return "is not readable (permissions)"
    return None


class Checks:
    """The checks of one config section; `section` prefixes every key in the messages."""

    def __init__(self, section: str, values):
        self.section, self.values = section, values

    def fail(self, key: str, must: str, fix: str) -> None:
        value = getattr(self.values, key)
        raise ConfigError(f"{self.section}.{key}={value!r}: must {must}; fix: {fix}")

    def that(self, ok: bool, key: str, must: str, fix: str) -> None:
        """A check no helper below covers (a relation between settings)."""
        if not ok:
            self.fail(key, must, fix)

    def at_least(self, key: str, low, meaning: str = "") -> None:
        value = getattr(self.values, key)
        if value is not None and value < low:
            self.fail(key, f"be >= {low}" + (f" ({meaning})" if meaning else ""), f"set {self.section}.{key} to "
                      f"{low} or more")

    def above(self, key: str, low) -> None:
        value = getattr(self.values, key)
        if value is not None and not value > low:
            self.fail(key, f"be > {low}", f"set {self.section}.{key} above {low}")

    def in_range(self, key: str, low, high, high_open: bool = False) -> None:
        """low <= value <= high, or < high when `high_open`: probabilities and Adam's betas."""
        value = getattr(self.values, key)
        if value is not None and not (low <= value and (value < high if high_open else value <= high)):
            self.fail(key, f"be in [{low}, {high}{')' if high_open else ']'}",
                      f"set {self.section}.{key} between {low} and {high}")

    def one_of(self, key: str, choices) -> None:
        if getattr(self.values, key) not in choices:
            self.fail(key, f"be one of {', '.join(map(str, choices))}", f"set {self.section}.{key} to one of them")

    def not_empty(self, key: str) -> None:
        if not getattr(self.values, key):
            self.fail(key, "not be empty", f"set {self.section}.{key}")

    def directory(self, key: str) -> None:
        """A path that must be a directory if it exists (it may be created later)."""
        path = getattr(self.values, key)
        self.not_empty(key)
        if os.path.exists(path) and not os.path.isdir(path):
            self.fail(key, "be a directory, but it is a file", f"point {self.section}.{key} at a directory")

    def writable_directory(self, key: str) -> None:
        """A folder the run writes into: directory() and, whether it exists or not yet, writable."""
        self.directory(key)
        writable_dir(getattr(self.values, key), f"{self.section}.{key}",
                     f"point {self.section}.{key} at a folder you can write to")
