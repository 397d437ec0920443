"""Tool calling, as OpenAI's chat completions ask for it and vLLM serves it: `tools` (function definitions) rendered
by the model's chat template, and `tool_choice`:

- a named function, or "required": the answer is the call's arguments, or a JSON array of {"name", "parameters"}
  calls, through structured outputs (serving/structured.py): it cannot be anything else;
- "auto" (the default with tools): the model answers in text or calls tools, read from its answer in the format its
  template writes calls in (CALL_FORMATS: Hermes' and Qwen's blocks, Llama 3's JSON, Mistral's [TOOL_CALLS]);
- "none": the tools are shown, no call is read.
"""
from dataclasses import dataclass

from data.chat import ChatError, record_tools
from serving.call_formats import CALL_FORMATS, DEFAULT_ID, Call, CallFormat, call_format, named, required
from serving.errors import APIError
from serving.structured import JSON_STYLE


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

    def partial(self, text: str) -> tuple[list[Call], bool]:
        """The calls of an answer's text as far as it goes (serving/call_formats.py), and whether they are whole;
        the first alone where parallel calls are off."""
        if self.choice == "auto":
            calls, whole = self.format.read(text)
        elif self.choice == "required":
            calls, whole = required(text)
        else:
            calls, whole = named(self.choice, text)
        return (calls if self.parallel else calls[:1]), whole

    def calls(self, text: str) -> list[Call]:
        """The calls of a whole answer; none where it is not calls whole, each named, with JSON arguments (an answer
        cut at max_tokens: it is all content then)."""
        calls, whole = self.partial(text) if self.choice != "none" else ([], False)
        if not whole or not all(call.done for call in calls):  # a call written whole holds JSON arguments
            return []
        return calls

    def new_id(self) -> str:
        """A call's id, of the kind the model's template takes back."""
        return (self.format.new_id if self.format else DEFAULT_ID)()

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


class CallStream:
    """One answer's calls as its text grows: what to send of them since the last look, as OpenAI's stream's
    `tool_calls` pieces (a call's index, id, type and name with the first, then its arguments' new text), each id
    given as its call's name is written; then the answer's calls, whole (those ids)."""

    def __init__(self, tools: Tools):
        self.tools, self.ids, self.sent = tools, [], []  # per call begun: its id, its arguments' characters sent

    def pieces(self, text: str) -> list[dict]:
        """What to send now of the calls `text` (the answer so far) holds; a call goes out once its name is written,
        in order."""
        out = []
        for k, call in enumerate(self.tools.partial(text.rstrip("\ufffd"))[0]):  # a character still incomplete
            if call.name is None:
                break
            head, name = {}, {}
            if k == len(self.ids):
                self.ids.append(self.tools.new_id())
                self.sent.append(0)
                head, name = {"id": self.ids[k], "type": "function"}, {"name": call.name}
            new = call.arguments[self.sent[k]:]
            self.sent[k] += len(new)
            if head or new:
                out.append({"index": k, **head, "function": {**name, "arguments": new}})
        return out

    def whole(self, text: str) -> tuple[list[dict], list[dict]]:
        """(the calls of the whole answer in OpenAI's shape, what is still to send of them); no calls where it is
        not calls whole: its text is content then (even where pieces of calls went out)."""
        calls = self.tools.calls(text)
        if not calls:
            return [], []
        rest = self.pieces(text)
        return [{"id": self.ids[k], "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
                for k, call in enumerate(calls)], rest


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
