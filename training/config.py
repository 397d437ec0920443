"""The two configuration files of a run, their command-line overrides, and their validation.

- The ds_config JSON (`--ds_config`) owns the engine: batch triple, ZeRO stage and offload, precision,
  gradient clipping, monitors. Override with `ds.<key>=<value>`.
- The run YAML (`--config`) owns model, data, optimizer/schedule, loop and sampling settings, typed by
  the dataclasses below. Override with `<section>.<key>=<value>`.
Every problem found here raises ConfigError before any process group or training work starts.
"""
import argparse
import collections.abc
import difflib
import json
import os
from dataclasses import dataclass, field
from typing import Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from model.config import ModelConfig

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = os.path.join(REPO_ROOT, "configs", "quickstart.yaml")
DEFAULT_DS_CONFIG = os.path.join(REPO_ROOT, "ds_configs", "zero0.json")
DS_PREFIX = "ds."


class ConfigError(ValueError):
    """A bad setting; the message names it and how to fix it."""


@dataclass
class DataConfig:
    dir: str = "data/shakespeare_char"  # holds train.bin, val.bin and meta.json
    tokenizer: str = "char"  # "char" or "gpt2"; must match the dataset's meta.json


@dataclass
class OptimConfig:
    """AdamW (decay on 2-D weights only) with linear warmup then cosine decay to min_lr."""
    lr: float = 6e-4
    min_lr: float = 6e-5
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8


@dataclass
class TrainConfig:
    max_steps: int = 2000
    eval_interval: int = 250
    eval_iters: int = 20
    log_interval: int = 10
    out_dir: str = "out/run"
    seed: int = 1337
    # MFU denominator in TFLOP/s per device; null measures a large matmul at start.
    peak_tflops: Optional[float] = None
    save_interval: int = 1000  # checkpoint every N steps (0: only at the end); always at the end
    keep_checkpoints: int = 3  # the newest K complete checkpoints are kept
    # "auto": continue from the newest complete checkpoint in out_dir, or start fresh if there is none;
    # "none": start fresh (refused if out_dir holds checkpoints); or a tag / path to resume from.
    resume: str = "auto"
    # A local Hugging Face checkpoint folder (config.json + model.safetensors, GPT-2 or Llama) whose weights
    # start a fresh run (fine-tuning, continued pretraining); a run that resumes ignores it.
    init_from: Optional[str] = None
    # Stop after this step, with a checkpoint, though the schedule spans max_steps (fit a job's time slot).
    stop_at_step: Optional[int] = None
    # How long a rank waits in a collective for the others before the job ends with an error. Long enough
    # for a slow checkpoint save on a real cluster; tests make it seconds.
    dist_timeout_s: int = 1800
    # torch.compile the model through DeepSpeed's engine.compile() (inductor; needs a C++ compiler on CPU).
    compile: bool = False


@dataclass
class SampleConfig:
    """Text printed at the end of training."""
    prompt: str = "\n"
    max_new_tokens: int = 300
    temperature: float = 0.8
    top_k: Optional[int] = 200
    seed: int = 0


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train a GPT with DeepSpeed.",
        epilog="Overrides: section.key=value for the run config (e.g. train.max_steps=100), "
               "ds.key=value for the ds_config (e.g. ds.zero_optimization.stage=3).")
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="run config YAML (model, data, optim, train)")
    parser.add_argument("--ds_config", default=DEFAULT_DS_CONFIG, help="DeepSpeed config JSON (engine)")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    return parser.parse_args(argv)


def load_run_config(path: str, overrides: list[str]) -> RunConfig:
    """Dataclass defaults <- YAML preset <- command line; returns the typed RunConfig object."""
    if not os.path.isfile(path):
        raise ConfigError(f"run config {path} not found; presets are in {os.path.join(REPO_ROOT, 'configs')}")
    cfg = OmegaConf.structured(RunConfig)
    for source, layer in ((path, lambda: OmegaConf.load(path)),
                          ("the command line", lambda: OmegaConf.from_dotlist(overrides))):
        try:
            cfg = OmegaConf.merge(cfg, layer())
        except OmegaConfBaseException as e:
            raise ConfigError(_explain_omegaconf_error(e, source)) from None
    return OmegaConf.to_object(cfg)


def _explain_omegaconf_error(e: OmegaConfBaseException, source: str) -> str:
    key = getattr(e, "full_key", None) or "?"
    section, _, name = key.rpartition(".")
    known = _known_keys(section)
    if name and known and name not in known:
        hint = difflib.get_close_matches(name, known, n=1)
        suggestion = f"; did you mean '{section + '.' if section else ''}{hint[0]}'?" if hint else ""
        return (f"unknown setting '{key}' in {source}{suggestion} "
                f"Known keys{' in ' + section if section else ''}: {', '.join(sorted(known))}")
    return f"bad setting '{key}' in {source}: {getattr(e, 'msg', e)}"


def _known_keys(section: str) -> list[str]:
    node = OmegaConf.structured(RunConfig)
    for part in filter(None, section.split(".")):
        node = node.get(part) if isinstance(node, DictConfig) else None
    return list(node.keys()) if isinstance(node, DictConfig) else []


def load_ds_config(path: str, overrides: list[str]) -> dict:
    """The ds_config JSON with `ds.` overrides applied, checked by DeepSpeed's own parser."""
    if not os.path.isfile(path):
        shipped = sorted(os.listdir(os.path.join(REPO_ROOT, "ds_configs")))
        raise ConfigError(f"ds_config {path} not found; shipped ones: {', '.join(shipped)}")
    with open(path) as f:
        text = f.read()
    try:
        ds = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}, line {e.lineno}, column {e.colno}: malformed JSON: {e.msg}") from None
    if overrides:
        try:
            merged = OmegaConf.merge(OmegaConf.create(ds), OmegaConf.from_dotlist(overrides))
        except OmegaConfBaseException as e:
            raise ConfigError(f"bad ds override {overrides}: {e}") from None
        ds = OmegaConf.to_container(merged)
    for section, home in (("optimizer", "optim.*"), ("scheduler", "optim.* (warmup_steps, min_lr)")):
        if section in ds:
            raise ConfigError(f"{path}: the '{section}' section is a run setting here: set {home} in the "
                              f"run YAML or on the command line, and remove it from the ds_config")
    check_with_deepspeed(ds, path)
    return ds


def check_with_deepspeed(ds: dict, path: str) -> None:
    """Parse `ds` with DeepSpeedConfig and reject top-level keys it never reads (it ignores them)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    probe = _KeyRecorder(ds)
    # DeepSpeedConfig checks the batch triple against world size 1; ours is checked in topology.py.
    probe.pop("train_batch_size", None)
    try:
        DeepSpeedConfig(probe)
    except Exception as e:
        if hasattr(e, "errors") and hasattr(e, "title"):  # a section's pydantic model: one line per problem
            problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
            raise ConfigError(f"{path} is rejected by DeepSpeed's config parser ({e.title}): {problems}") from None
        raise ConfigError(f"{path} is rejected by DeepSpeed's config parser: {e}") from None
    unknown = sorted(set(ds) - probe.read - {"train_batch_size"})
    if unknown:
        hints = [f"'{k}'" + (f" (did you mean '{m[0]}'?)" if (m := difflib.get_close_matches(k, probe.read, 1))
                             else "") for k in unknown]
        raise ConfigError(f"{path}: DeepSpeed does not know the key(s) {', '.join(hints)}")


class _KeyRecorder(dict):
    """A dict that remembers which keys were looked up, however the lookup was spelled."""

    def __init__(self, *args):
        super().__init__(*args)
        self.read = set()

    def get(self, key, *default):
        self.read.add(key)
        return super().get(key, *default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)

    def keys(self):
        recorder = self

        class _Keys(collections.abc.KeysView):
            def __contains__(self, key):
                recorder.read.add(key)
                return super().__contains__(key)

        return _Keys(self)


def split_overrides(overrides: list[str]) -> tuple[list[str], list[str]]:
    """Command-line key=value pairs -> (run config overrides, ds_config overrides without 'ds.')."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not key=value (e.g. train.max_steps=100)")
    run = [o for o in overrides if not o.startswith(DS_PREFIX)]
    ds = [o[len(DS_PREFIX):] for o in overrides if o.startswith(DS_PREFIX)]
    return run, ds
