"""Range checks for run settings, written next to each setting's dataclass as one line per setting.

Each config dataclass (model/config.py, training/config.py) has a `check(self, c: Checks)` method;
load_run_config calls it for every section after the YAML and the overrides are merged, so every bad
value stops the run before any data is read or any process starts. A new setting's check is one line:

    c.at_least("eval_interval", 0, "0 evaluates only at step 0 and at the end")

Messages read "<section.key>=<value>: must be ...; fix: ...". A value of None (an Optional setting left
unset) passes every range check; the dataclass documents what None means.
"""
import os
import sys


class ConfigError(ValueError):
    """A bad setting; the message names it and how to fix it."""


def exit_bad_input(message) -> None:
    """How a command-line tool ends on bad input, as train.py does: one line on stderr, exit 2, no traceback."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


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
