"""The run YAML as a config layer: a file over the preset it names as its `base`, and that one over its own, so
that a new YAML states what differs from a preset, not every setting. Each file is checked to be a mapping of the
run config's sections before OmegaConf merges it (its own errors name no file)."""
import os

import yaml
from omegaconf import DictConfig, OmegaConf

from common.checks import REPO_ROOT, ConfigError, existing_file

BASE = "base"  # the key of a run YAML that names the preset it starts from
# Settings that a later layer's setting of another replaces: a sample.prompt given over a preset's sample.chat is
# the one sampled (sample.chat is sampled in its place wherever both are set).
REPLACED_BY = {"sample.chat": "sample.prompt"}


def layered(under: DictConfig, over: DictConfig) -> DictConfig:
    """`over` merged over `under`, a setting of REPLACED_BY that `over` replaces (without setting it) cleared."""
    merged = OmegaConf.merge(under, over)
    for replaced, by in REPLACED_BY.items():
        if OmegaConf.select(over, by) is not None and OmegaConf.select(over, replaced) is None:
            OmegaConf.update(merged, replaced, None)
    return merged


def read_presets(path: str, sections: set[str], derived: tuple[str, ...] = ()) -> DictConfig:
    """A run config file over the preset it names as its `base` (a name in configs/, or a path from the file's
    folder), and that one over its own: a new YAML states what differs from a preset, not every setting."""
    layer = _read_yaml(path, sections)
    base = layer.pop(BASE, None)
    if base is None:
        return layer
    if not isinstance(base, str) or not base.strip():
        raise ConfigError(f"{path}: {BASE}: {base!r} is not a preset; fix: name one of configs/ (e.g. {BASE}: "
                          f"quickstart) or a YAML file")
    named = os.path.join(REPO_ROOT, "configs", f"{base}.yaml")
    base_path = named if os.path.isfile(named) else os.path.join(os.path.dirname(os.path.abspath(path)), base)
    if not os.path.isfile(base_path):
        presets = sorted(f.removesuffix(".yaml") for f in os.listdir(os.path.join(REPO_ROOT, "configs"))
                         if f.endswith(".yaml"))
        raise ConfigError(f"{path}: {BASE}: {base} is neither a preset of configs/ nor a file ({base_path}); fix: "
                          f"name one of {', '.join(presets)}, or a YAML file beside {path}")
    chain = (*derived, os.path.realpath(path))
    if os.path.realpath(base_path) in chain:
        raise ConfigError(f"{path}: {BASE}: {base} leads back to {path}: the presets' bases go round in a circle; "
                          f"fix: remove one {BASE}")
    return layered(read_presets(base_path, sections, chain), layer)


def _read_yaml(path: str, sections: set[str]) -> DictConfig:
    """A run config file: a YAML mapping of sections (model, data, ...) to mappings of settings."""
    existing_file(path, "run config", f"pass a YAML preset, e.g. one of {os.path.join(REPO_ROOT, 'configs')}")
    try:
        layer = OmegaConf.load(path)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = " ".join(str(getattr(e, "problem", None) or e).split())  # one line, as every error here
        raise ConfigError(f"{path}{where}: malformed YAML: {problem}; fix: correct the "
                          f"file (a mapping of sections, as in configs/quickstart.yaml)") from None
    if not isinstance(layer, DictConfig):
        raise ConfigError(f"{path} holds a YAML {type(layer).__name__.removesuffix('Config').lower()}, not a "
                          f"mapping: a run config maps {', '.join(sorted(sections))} to their settings, as in "
                          f"configs/quickstart.yaml")
    for section, value in layer.items_ex(resolve=False):
        if section != BASE and section in sections and not isinstance(value, DictConfig):
            raise ConfigError(f"{path}: '{section}' holds {value!r}, not a mapping of settings; fix: write its "
                              f"settings under it, e.g. {section}: {{key: value}}")
    return layer
