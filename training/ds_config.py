"""The ds_config: DeepSpeed's own JSON (`--ds_config`), which owns the engine (batch triple, ZeRO stage and
offload, precision, gradient clipping, monitors), with its `ds.<key>=<value>` overrides applied and checked
before anything starts: the numbers DeepSpeed's typed models leave unchecked, then DeepSpeed's own parser, and
no top-level key it would silently ignore."""
import collections.abc
import difflib
import json
import os

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from common.checks import ConfigError, existing_file
from training.config import DS_PREFIX, REPO_ROOT
from training.overrides import read_overrides


def load_ds_config(path: str, overrides: list[str]) -> dict:
    """The ds_config JSON with `ds.` overrides applied, checked by DeepSpeed's own parser."""
    shipped = sorted(os.listdir(os.path.join(REPO_ROOT, "ds_configs")))
    existing_file(path, "ds_config", f"pass a DeepSpeed config JSON; shipped ones: {', '.join(shipped)}")
    with open(path) as f:
        text = f.read()
    try:
        ds = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}, line {e.lineno}, column {e.colno}: malformed JSON: {e.msg}") from None
    if not isinstance(ds, dict):
        raise ConfigError(f"{path} holds a JSON {type(ds).__name__}, not an object: a ds_config is one JSON object "
                          f"of DeepSpeed settings, e.g. {{\"train_micro_batch_size_per_gpu\": 12}}")
    if overrides:
        try:
            merged = OmegaConf.merge(OmegaConf.create(ds), read_overrides(overrides, DS_PREFIX))
        except OmegaConfBaseException as e:
            raise ConfigError(f"bad ds override {overrides}: {str(e).splitlines()[0]}") from None
        ds = OmegaConf.to_container(merged)
    for section, home in (("optimizer", "optim.*"), ("scheduler", "optim.* (warmup_steps, min_lr)")):
        if section in ds:
            raise ConfigError(f"{path}: the '{section}' section is a run setting here: set {home} in the "
                              f"run YAML or on the command line, and remove it from the ds_config")
    if isinstance(ds.get("checkpoint"), dict) and ds["checkpoint"].get("writer") is not None:
        raise ConfigError(f"{path}: checkpoint.writer is DeepSpeed's decoupled writer, which this repo does not use "
                          f"(it fails without a Megatron mpu, and a pipeline's update would race its write); fix: "
                          f"remove it: train.background_save=true (the default) writes checkpoints while training "
                          f"goes on")
    check_numbers(ds, path)
    check_with_deepspeed(ds, path)
    return ds


# The ds_config's numbers that no typed model of DeepSpeed's checks (and our own keys): a string there fails
# deep inside its parser ("'>' not supported between instances of 'str' and 'int'"), true passes as 1, and a
# negative clip would flip the gradients. key -> (integer only, lowest value, what the lowest value means).
DS_NUMBERS = {
    "train_batch_size": (True, 1, ""),
    "train_micro_batch_size_per_gpu": (True, 1, ""),
    "gradient_accumulation_steps": (True, 1, ""),
    "tensor_model_parallel_size": (True, 1, ""),
    "sequence_parallel_size": (True, 1, ""),
    "expert_parallel_size": (True, 1, ""),
    "steps_per_print": (True, 1, ""),
    "pipeline.stages": (True, 1, ""),
    "pipeline.activation_checkpoint_interval": (True, 0, "0 disables it"),
    "gradient_clipping": (False, 0, "0 disables clipping"),
}


def check_numbers(ds: dict, path: str) -> None:
    for key, (integer, low, meaning) in DS_NUMBERS.items():
        section, _, name = key.rpartition(".")
        value = (ds.get(section) if section else ds)
        value = value.get(name) if isinstance(value, dict) else None
        kinds = (int,) if integer else (int, float)
        if value is not None and (isinstance(value, bool) or not isinstance(value, kinds) or value < low):
            must = f"{'an integer' if integer else 'a number'} >= {low}" + (f" ({meaning})" if meaning else "")
            raise ConfigError(f"{key}={value!r} in {path}: must be {must}; fix: set ds.{key} to one, in the "
                              f"ds_config or on the command line")


REJECTED_FIX = "fix: correct it in the ds_config, or in its ds.* override"


def check_with_deepspeed(ds: dict, path: str) -> None:
    """Parse `ds` with DeepSpeedConfig and reject top-level keys it never reads (it ignores them)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    probe = _KeyRecorder(ds)
    # DeepSpeedConfig checks the batch triple against world size 1; ours is checked in topology.py.
    probe.pop("train_batch_size", None)
    probe.pop("sequence_parallel_size", None)  # ours to read (training/topology.py SP_KEY); it divides that world
    if isinstance(ds.get("bf16"), dict) and ds["bf16"].get("enabled") == "auto":  # ours: resolved for the device
        probe["bf16"] = {**ds["bf16"], "enabled": True}                              # (training/startup.py)
    try:
        DeepSpeedConfig(probe)
    except Exception as e:
        if hasattr(e, "errors") and hasattr(e, "title"):  # a section's pydantic model: one line per problem
            problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
            raise ConfigError(f"{path} is rejected by DeepSpeed's config parser ({e.title}): {problems}; "
                              f"{REJECTED_FIX}") from None
        raise ConfigError(f"{path} is rejected by DeepSpeed's config parser: {e}; {REJECTED_FIX}") from None
    # Our keys beside DeepSpeed's (training/topology.py TP_KEY, TP_SEQUENCE_KEY): the tensor-parallel degree of our
    # own layers, and whether they split the sequence between them; and
    # DeepSpeed's sequence-parallel degree, which this repo reads itself (SP_KEY); the expert-parallel degree of
    # the model's MoE layers (training/moe.py EP_KEY).
    ours = {"train_batch_size", "tensor_model_parallel_size", "tensor_sequence_parallel", "sequence_parallel_size",
            "expert_parallel_size"}
    unknown = sorted(set(ds) - probe.read - ours)
    if unknown:
        hints = [f"'{k}'" + (f" (did you mean '{m[0]}'?)" if (m := difflib.get_close_matches(k, probe.read, 1))
                             else "") for k in unknown]
        raise ConfigError(f"{path}: DeepSpeed does not know the key(s) {', '.join(hints)}; fix: correct or remove "
                          f"them")


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
