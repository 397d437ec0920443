"""How models write tool calls, read as far as an answer's text goes (serving/partial_json.py): each call's name once
it is written whole, its arguments as the text written so far, and whether the text is calls and nothing else. The
formats chat templates write calls in (CALL_FORMATS, recognized from the template's text as vLLM's parsers of the
same names read them), and the shapes structured outputs make a forced call take (serving/tools.py)."""
import json
import random
import re
import string
import uuid
from dataclasses import dataclass
from typing import Callable

from serving.partial_json import items, members, skip_space, value_end

PYTHON_TAG, TOOL_CALLS, ARGS = "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]"


@dataclass(frozen=True)
class Call:
    name: str | None  # None until it is written whole (or where it is no string)
    arguments: str  # the arguments' JSON as written so far
    done: bool  # written whole


def _object_call(text: str, at: int, keys: tuple[str, ...]) -> tuple[Call, int | None]:
    """The call written as the object at text[at], {"name": ..., KEY: {...}} with KEY one of `keys` (absent: no
    arguments), and where the object ends."""
    found, end = members(text, at)
    name = None
    if "name" in found and found["name"][1] is not None:
        value = json.loads(text[slice(*found["name"])])
        name = value if isinstance(value, str) else None
    key = next((k for k in keys if k in found), None)
    if key is None:
        arguments = "{}" if end is not None else ""
    else:
        start, stop = found[key]
        arguments = text[start:stop]  # to the text's end while it is written
    return Call(name, arguments, end is not None and name is not None), end


def _array_calls(text: str, at: int, keys: tuple[str, ...]) -> tuple[list[Call], bool]:
    """The calls of a JSON array of call objects at text[at], and whether the array is closed."""
    starts, end = items(text, at)
    return [_object_call(text, start, keys)[0] for start in starts], end is not None


def named(function: str, text: str) -> tuple[list[Call], bool]:
    """A named function's forced answer (tool_choice {"function": ...}): its arguments, the whole text."""
    done = value_end(text, 0) == len(text) if text else False
    return [Call(function, text, done)], done


def required(text: str) -> tuple[list[Call], bool]:
    """tool_choice "required"'s forced answer: a JSON array of {"name", "parameters"}."""
    return _array_calls(text, 0, ("parameters",))


def _hermes(text: str) -> tuple[list[Call], bool]:
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks; text between and after them is dropped."""
    calls = [_object_call(text, skip_space(text, m.end()), ("arguments",))[0] for m in re.finditer("<tool_call>", text)]
    return calls, all(call.done for call in calls)


def _llama3(text: str) -> tuple[list[Call], bool]:
    """The whole answer: {"name": ..., "parameters": {...}} objects (or "arguments"), `;` between them, after an
    optional <|python_tag|>."""
    at, calls = skip_space(text, 0), []
    if text.startswith(PYTHON_TAG, at):
        at = skip_space(text, at + len(PYTHON_TAG))
    while at < len(text):
        call, end = _object_call(text, at, ("parameters", "arguments"))
        calls.append(call)
        if end is None:
            return calls, False
        at = skip_space(text, end)
        if text[at:at + 1] == ";":
            at = skip_space(text, at + 1)
        elif at < len(text):
            return calls, False  # text after the calls: they are no calls
    return calls, bool(calls) and all(call.done for call in calls)


def _mistral(text: str) -> tuple[list[Call], bool]:
    """[TOOL_CALLS] and a JSON array of {"name", "arguments"} (Mistral's v3 tokenizers), or each call as
    [TOOL_CALLS]name[ARGS]{...} (v11 and later)."""
    at = text.find(TOOL_CALLS)
    if at < 0:
        return [], False
    at = skip_space(text, at + len(TOOL_CALLS))
    if text[at:at + 1] == "[":
        return _array_calls(text, at, ("arguments",))
    calls = []
    for part in text[at:].split(TOOL_CALLS):
        name, marked, arguments = part.partition(ARGS)
        arguments = arguments.lstrip()
        end = value_end(arguments, 0) if arguments else None  # past it: the next call's mark, maybe half written
        calls.append(Call(name.strip() if marked else None, arguments[:end], bool(marked) and end is not None))
    return calls, all(call.done for call in calls)


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _mistral_id() -> str:
    """Mistral's templates refuse a call id that is not 9 letters or digits (vLLM makes them so too)."""
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


@dataclass(frozen=True)
class CallFormat:
    """How a chat template writes an assistant's tool calls, which is how `auto` reads them from an answer."""
    name: str
    title: str  # in words, for messages
    signs: tuple[str, ...]  # what a template that writes calls so holds, every one
    marks: tuple[str, ...]  # where an answer's calls begin: its content ends there
    leading: bool  # the marks count only where the answer begins with one (after whitespace)
    read: Callable[[str], tuple[list[Call], bool]]  # the calls of an answer's text, and whether they are whole
    new_id: Callable[[], str] = _call_id


CALL_FORMATS = (
    CallFormat("hermes", "Hermes' and Qwen's <tool_call> blocks", ("<tool_call>",), ("<tool_call>",), False, _hermes),
    CallFormat("mistral", "Mistral's [TOOL_CALLS]", (TOOL_CALLS,), (TOOL_CALLS,), False, _mistral, _mistral_id),
    # Llama 3.1-3.3's templates: tool results are turns of the ipython role, calls {"name", "parameters"}
    CallFormat("llama3_json", "Llama 3's JSON", ('"parameters": ', "ipython"), (PYTHON_TAG, "{"), True, _llama3),
)
DEFAULT_ID = _call_id  # the ids of calls where the model's template writes none this server reads


def call_format(template: str) -> CallFormat | None:
    """The format a chat template (its source) writes calls in; None where it writes none this server reads."""
    return next((f for f in CALL_FORMATS if all(sign in template for sign in f.signs)), None)
