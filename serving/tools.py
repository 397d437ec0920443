"""Tool calling, as OpenAI's chat completions ask for it and vLLM serves it: `tools` (function definitions) rendered
by the model's chat template, and `tool_choice`:

- a named function, or "required": the answer is the call's arguments, or a JSON array of {"name", "parameters"}
  calls, through structured outputs (serving/structured.py): it cannot be anything else;
- "auto" (the default with tools): the model answers in text or calls tools, read from its answer in the format its
  template writes calls in (CALL_FORMATS: Hermes' and Qwen's blocks, Llama 3's JSON, Mistral's [TOOL_CALLS]);
- "none": the tools are shown, no call is read.
"""
import json
import random
import re
import string
import uuid
from dataclasses import dataclass
from typing import Callable

from data.chat import ChatError, record_tools
from serving.errors import APIError
from serving.structured import JSON_STYLE

HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
LLAMA_SEPARATOR = re.compile(r"\s*;?\s*")
PYTHON_TAG, TOOL_CALLS = "<|python_tag|>", "[TOOL_CALLS]"


def _hermes(text: str) -> list[tuple]:
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks; text between them is dropped."""
    return [(call["name"], call.get("arguments", {})) for call in map(json.loads, HERMES_CALL.findall(text))]


def _llama3(text: str) -> list[tuple]:
    """{"name": ..., "parameters": {...}} objects (or "arguments"), `;` between them, after an optional
    <|python_tag|>: the whole answer."""
    text, calls, at = text.strip().removeprefix(PYTHON_TAG), [], 0
    while at < len(text):
        call, at = json.JSONDecoder().raw_decode(text, at)
        calls.append((call["name"], call["parameters"] if "parameters" in call else call["arguments"]))
        at = LLAMA_SEPARATOR.match(text, at).end()
    return calls


def _mistral(text: str) -> list[tuple]:
    """[TOOL_CALLS] and a JSON array of {"name", "arguments"} (Mistral's v3 tokenizers), or each call as
    [TOOL_CALLS]name[ARGS]{...} (v11 and later)."""
    text = text.split(TOOL_CALLS, 1)[1].strip()
    if text.startswith("["):
        return [(call["name"], call["arguments"]) for call in json.loads(text)]
    named = [part.split("[ARGS]", 1) for part in text.split(TOOL_CALLS)]
    return [(name.strip(), json.loads(arguments)) for name, arguments in named]


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
    read: Callable[[str], list[tuple]]  # (name, arguments) of each call in the text from its first mark
    new_id: Callable[[], str] = _call_id


CALL_FORMATS = (
    CallFormat("hermes", "Hermes' and Qwen's <tool_call> blocks", ("<tool_call>",), ("<tool_call>",), False, _hermes),
    CallFormat("mistral", "Mistral's [TOOL_CALLS]", (TOOL_CALLS,), (TOOL_CALLS,), False, _mistral, _mistral_id),
    # Llama 3.1-3.3's templates: tool results are turns of the ipython role, calls {"name", "parameters"}
    CallFormat("llama3_json", "Llama 3's JSON", ('"parameters": ', "ipython"), (PYTHON_TAG, "{"), True, _llama3),
)


def call_format(template: str) -> CallFormat | None:
    """The format a chat template (its source) writes calls in; None where it writes none this server reads."""
    return next((f for f in CALL_FORMATS if all(sign in template for sign in f.signs)), None)


@dataclass(frozen=True)
class Tools:
    definitions: list  # OpenAI's {"type": "function", "function": {...}}, as the template renders them
    choice: str  # "none", "auto", "required", or the name of the function to call
    format: CallFormat | None  # how the model's template writes calls (call_format)
    parallel: bool = True  # OpenAI's parallel_tool_calls: false, at most one call

    def grammar(self) -> str | None:
        """The grammar the answer follows: a named function's arguments, or required's array of calls."""
        from llguidance import LLMatcher

        functions = {d["function"]["name"]: d["function"].get("parameters") or {"type": "object"}
                     for d in self.definitions}
        if self.choice in ("none", "auto"):
            return None
        if self.choice != "required":
            return LLMatcher.grammar_from_json_schema(functions[self.choice], JSON_STYLE)
        calls = [{"type": "object", "properties": {"name": {"enum": [name]}, "parameters": parameters},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, parameters in functions.items()]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            array["maxItems"] = 1
        return LLMatcher.grammar_from_json_schema(array, JSON_STYLE)

    def reading(self) -> CallFormat | None:
        """The format the answer's calls are read in where the model chooses to call (auto)."""
        return self.format if self.choice == "auto" else None

    def calls(self, text: str) -> list[dict]:
        """The tool calls, in OpenAI's shape, of an answer's text; none where they do not read (an answer cut at
        max_tokens: it is all content then). Their ids are the model's template's kind."""
        try:
            if self.choice == "auto":
                named = self.format.read(text)
            elif self.choice == "required":
                named = [(c["name"], c["parameters"]) for c in json.loads(text)]
            elif self.choice != "none":
                named = [(self.choice, json.loads(text))]
            else:
                return []
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            return []
        if not all(isinstance(name, str) for name, _ in named):
            return []
        named = named if self.parallel else named[:1]  # vLLM's rule: the first call
        new_id = self.format.new_id if self.format else _call_id
        return [{"id": new_id(), "type": "function", "function": {
            "name": name, "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}}
            for name, args in named]

    def check_format(self) -> None:
        """auto reads the calls a model writes: its template must write them in a format this server reads."""
        if self.choice == "auto" and self.format is None:
            formats = ", ".join(f.title for f in CALL_FORMATS)
            raise APIError(400, "tool_choice auto reads the calls a model writes, and this model's chat template "
                                f"writes them in none of the formats read here ({formats}); fix: ask for "
                                "tool_choice required or a named function", "tool_choice", code="unsupported")

    def finish_reason(self, reason: str, calls: list) -> str:
        """OpenAI's: "tool_calls" where the model chose to call (auto, required), "stop" for a named function."""
        return "tool_calls" if calls and reason == "stop" and self.choice in ("auto", "required") else reason


def read_tools(body: dict, template: str) -> Tools | None:
    """The request's tools and tool_choice, checked, with the format the model's chat template (its source) writes
    calls in; None where the request gives no tools."""
    definitions, choice = body.get("tools"), body.get("tool_choice")
    if not definitions:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        return None
    try:
        record_tools(body)
    except ChatError as e:
        raise APIError(400, str(e), "tools") from None
    names = [d["function"]["name"] for d in definitions]
    if isinstance(choice, dict):
        choice = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if choice not in names:
            raise APIError(400, f"tool_choice must name one of the tools: {', '.join(names)}", "tool_choice")
    elif choice is None:
        choice = "auto"
    elif choice not in ("none", "auto", "required"):
        raise APIError(400, "tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": "
                            "{\"name\": ...}}", "tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise APIError(400, "parallel_tool_calls must be true or false", "parallel_tool_calls")
    return Tools(definitions, choice, call_format(template), parallel)
