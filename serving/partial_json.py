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
    found, end = _elements(text, at, "{}", _member)
    return dict(found), end


def items(text: str, at: int) -> tuple[list[int], int | None]:
    """The array that begins at text[at]: where each item begun starts, and where the array ends (None while it is
    open, or where it is no array)."""
    return _elements(text, at, "[]", lambda text, at: (at, value_end(text, at)))


def _member(text: str, at: int) -> tuple[tuple | None, int | None]:
    """((key, (the value's start, end or None)), where the member ends) of the member at text[at]; (None, None)
    while its key and colon are being written, or where it is none."""
    key_end = value_end(text, at) if text[at] == '"' else None
    if key_end is None:
        return None, None
    key, at = json.loads(text[at:key_end]), skip_space(text, key_end)
    if text[at:at + 1] != ":":
        return None, None
    at = skip_space(text, at + 1)
    if at == len(text):
        return None, None
    end = value_end(text, at)
    return (key, (at, end)), end


def _elements(text: str, at: int, brackets: str, element) -> tuple[list, int | None]:
    """The elements begun of the container that begins at text[at] with brackets[0] (`element(text, at)`: (an
    element or None, where it ends or None)), and where the container ends (None while open, or where it is none)."""
    found = []
    if text[at:at + 1] != brackets[0]:
        return found, None
    at = skip_space(text, at + 1)
    if text[at:at + 1] == brackets[1]:
        return found, at + 1
    while at < len(text):
        read, end = element(text, at)
        if read is not None:
            found.append(read)
        if end is None:
            return found, None
        at = skip_space(text, end)
        if text[at:at + 1] == brackets[1]:
            return found, at + 1
        if text[at:at + 1] != ",":
            return found, None
        at = skip_space(text, at + 1)
    return found, None
