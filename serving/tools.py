"""Tool calling, as OpenAI's chat completions ask for it and vLLM serves it: `tools` (function definitions) rendered
by the model's chat template, and `tool_choice`:

- a named function, or "required": the answer is the call's arguments, or a JSON array of {"name", "parameters"}
  calls, through structured outputs (serving/structured.py): it cannot be anything else;
- "auto" (the default with tools): the model answers in text or calls tools, read from its answer where the template
  writes calls as Hermes' `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Qwen's and Hermes'
  templates do); text before the first block is the answer's content;
- "none": the tools are shown, no call is read.
"""
import json
import re
import uuid
from dataclasses import dataclass

from data.chat import ChatError, record_tools
from serving.errors import APIError
from serving.structured import JSON_STYLE

HERMES = "<tool_call>"
HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


@dataclass(frozen=True)
class Tools:
    definitions: list  # OpenAI's {"type": "function", "function": {...}}, as the template renders them
    choice: str  # "none", "auto", "required", or the name of the function to call

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
        return LLMatcher.grammar_from_json_schema({"type": "array", "minItems": 1, "items": {"anyOf": calls}},
                                                  JSON_STYLE)

    def calls(self, text: str) -> list[dict]:
        """The tool calls, in OpenAI's shape, of an answer's text; none where they do not read as JSON (an answer cut
        at max_tokens: it is all content then)."""
        try:
            if self.choice == "auto":
                named = [(c["name"], c.get("arguments", {})) for c in map(json.loads, HERMES_CALL.findall(text))]
            elif self.choice == "required":
                named = [(c["name"], c["parameters"]) for c in json.loads(text)]
            elif self.choice != "none":
                named = [(self.choice, json.loads(text))]
            else:
                return []
        except (json.JSONDecodeError, KeyError, TypeError):
            return []
        return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {
            "name": name, "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}}
            for name, args in named]

    def check_template(self, template: str) -> None:
        """auto reads the calls a model writes: its chat template (source) must write them as Hermes' blocks."""
        if self.choice == "auto" and HERMES not in template:
            raise APIError(400, "tool_choice auto reads the calls a model writes, and this model's chat template "
                                "writes none as <tool_call> blocks (Hermes', Qwen's); fix: ask for tool_choice "
                                "required or a named function", "tool_choice", code="unsupported")

    def finish_reason(self, reason: str, calls: list) -> str:
        """OpenAI's: "tool_calls" where the model chose to call (auto, required), "stop" for a named function."""
        return "tool_calls" if calls and reason == "stop" and self.choice in ("auto", "required") else reason


def read_tools(body: dict) -> Tools | None:
    """The request's tools and tool_choice, checked; None where it gives no tools."""
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
    return Tools(definitions, choice)
