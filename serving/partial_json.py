"""JSON read as far as a growing text goes: where each value begins and ends, the members of an object, the items of
an array, a value still being written open-ended. Tool calls are read so while the model writes them
(serving/tools.py): their arguments go out piece by piece, as the text the model wrote."""
import json

DECODER = json.JSONDecoder()
SPACE = " \t\n\r"


def skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in SPACE:
        at += 1
    return at


def value_end(text: str, at: int) -> int | None:
    """Where the JSON value that begins at text[at] ends; None while it goes on, or where it is no JSON."""
    try:
        _, end = DECODER.raw_decode(text, at)
    except json.JSONDecodeError:
        return None
    return None if end == len(text) and text[at] in "-0123456789" else end  # a number may go on


def members(text: str, at: int) -> tuple[dict, int | None]:
    """The object that begins at text[at]: {key: (its value's start, end or None)} for each member begun, and where
    the object ends (None while it is open, or where it is no object)."""
    found = {}
    if text[at:at + 1] != "{":
        return found, None
    at = skip_space(text, at + 1)
    if text[at:at + 1] == "}":
        return found, at + 1
    while at < len(text):
        key_end = value_end(text, at) if text[at] == '"' else None
        if key_end is None:
            return found, None
        key, at = json.loads(text[at:key_end]), skip_space(text, key_end)
        if text[at:at + 1] != ":":
            return found, None
        at = skip_space(text, at + 1)
        if at == len(text):
            return found, None
        end = value_end(text, at)
        found[key] = (at, end)
        if end is None:
            return found, None
        at = skip_space(text, end)
        if text[at:at + 1] == "}":
            return found, at + 1
        if text[at:at + 1] != ",":
            return found, None
        at = skip_space(text, at + 1)
    return found, None


def items(text: str, at: int) -> tuple[list[int], int | None]:
    """The array that begins at text[at]: where each item begun starts, and where the array ends (None while it is
    open, or where it is no array)."""
    starts = []
    if text[at:at + 1] != "[":
        return starts, None
    at = skip_space(text, at + 1)
    if text[at:at + 1] == "]":
        return starts, at + 1
    while at < len(text):
        starts.append(at)
        end = value_end(text, at)
        if end is None:
            return starts, None
        at = skip_space(text, end)
        if text[at:at + 1] == "]":
            return starts, at + 1
        if text[at:at + 1] != ",":
            return starts, None
        at = skip_space(text, at + 1)
    return starts, None
