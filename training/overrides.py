"""Command-line overrides (`section.key=value`, `ds.key=value`) as a config layer, and what goes wrong merging a
layer into the settings told in one line: a value YAML cannot read, an unknown key (with the nearest), a value of
the wrong type (with an example of the right one). OmegaConf's own errors are a parser traceback, or name the
key on lines of their own."""
import dataclasses
import difflib
import types
import typing

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from common.checks import ConfigError


def read_overrides(overrides: list[str], prefix: str = "") -> DictConfig:
    """Command-line key=value pairs (each key after `prefix`) as a config layer. A value YAML cannot read (a pasted
    placeholder such as `...`, an unclosed bracket) is refused naming its override, where OmegaConf's own error
    is a parser traceback that names neither."""
    for item in overrides:
        try:
            OmegaConf.from_dotlist([item])
        except yaml.YAMLError as e:
            problem = " ".join(str(getattr(e, "problem", None) or e).split())
            raise ConfigError(f"override '{prefix}{item}': YAML cannot read the value {item.partition('=')[2]!r} "
                              f"({problem}); fix: give a value there (a number, true or false, a path, a list such "
                              f"as [a,b]), quoting the whole override for the shell, e.g. "
                              f"'eval.tasks=[a.jsonl,b.jsonl]'") from None
    return OmegaConf.from_dotlist(overrides)


def explain_omegaconf_error(e: OmegaConfBaseException, source: str, schema: type) -> str:
    """OmegaConf's error merging `source` into the settings of `schema` (a dataclass), as one line: the setting,
    what it holds, the fix."""
    key = getattr(e, "full_key", None) or "?"
    section, _, name = key.rpartition(".")
    known = _known_keys(schema, section)
    if name and known and name not in known:
        hint = difflib.get_close_matches(name, known, n=1)
        suggestion = f" (did you mean '{section + '.' if section else ''}{hint[0]}'?)" if hint else ""
        return (f"unknown setting '{key}' in {source}{suggestion}; fix: use one of the known keys"
                f"{' in ' + section if section else ''}: {', '.join(sorted(known))}")
    expected = _expected_type(schema, key)
    if expected:
        kind, example = expected
        value = getattr(e, "value", None)
        if kind == TYPE_WORDS[str][0] and isinstance(value, (dict, list, DictConfig, ListConfig)):  # KING: is a map
            return (f"bad setting '{key}' in {source}: {value!r} is not a string: YAML read the value as a "
                    f"{'list' if isinstance(value, (list, ListConfig)) else 'mapping'}; fix: quote it inside the "
                    f"override, e.g. '{key}=\"text: more\"'")
        return f"bad setting '{key}' in {source}: {value!r} is not {kind}; fix: set it to {kind}, e.g. {key}={example}"
    # OmegaConf appends its full_key, reference_type and object_type on lines of their own: the first line says it.
    return f"bad setting '{key}' in {source}: {str(getattr(e, 'msg', None) or e).splitlines()[0]}"


# How a setting's type is named to the user, with a value of that type to show the fix.
TYPE_WORDS = {int: ("an integer", "4"), float: ("a number", "0.5"), bool: ("true or false", "true"),
              str: ("a string", "text"), list: ("a list", "[a,b]")}


def _expected_type(schema: type, key: str) -> tuple[str, str] | None:
    """(what the setting `key` holds, an example value) from its dataclass field's type; None if not found."""
    node, annotation = schema, None
    for part in key.split("."):
        hints = typing.get_type_hints(node) if dataclasses.is_dataclass(node) else {}
        if part not in hints:
            return None
        node = annotation = hints[part]
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)  # Optional[int], int | None
    kinds = [typing.get_origin(t) or t for t in (typing.get_args(annotation) if union else (annotation,))
             if t is not type(None)]
    return TYPE_WORDS.get(kinds[0]) if len(kinds) == 1 else None


def _known_keys(schema: type, section: str) -> list[str]:
    node = OmegaConf.structured(schema)
    for part in filter(None, section.split(".")):
        node = node.get(part) if isinstance(node, DictConfig) else None
    return list(node.keys()) if isinstance(node, DictConfig) else []
