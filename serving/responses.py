"""OpenAI's Responses API (POST /v1/responses, as vLLM serves it) over the chat path: `input` (a string, or a list of
messages whose content is a string or text parts) after `instructions` (a system turn) rendered by the chat template;
`max_output_tokens`, `temperature`, `top_p`, `text.format` (text, json_object, json_schema) and the sampling options
chat completions take (vLLM's extras too); one output message of output_text, whole or as the Responses stream's
events. Nothing is stored (`store` is false): a request that builds on a stored response or conversation, runs in
the background, or brings reasoning settings is refused; an earlier response's reasoning items sent back reach the
template as the turn's reasoning_content."""
import json
import time
import uuid

from serving.errors import APIError
from serving.replies import Reply

# Responses' options this server does not implement, refused where a request sets them.
REFUSED = {"previous_response_id": "this server stores no responses: send the conversation as input",
           "conversation": "this server stores no conversations: send the conversation as input",
           "background": "responses run in the foreground here", "prompt": "this server keeps no prompt templates",
           "include": "this server adds nothing to a response's output",
           "reasoning": "the served model has no reasoning settings", "top_logprobs": "use /v1/chat/completions"}
# Chat completions' options a Responses request may give too (vLLM's sampling extras among them).
PASSED = ("model", "temperature", "top_p", "stream", "seed", "stop", "top_k", "min_p", "repetition_penalty",
          "frequency_penalty", "presence_penalty", "logit_bias", "min_tokens", "ignore_eos", "structured_outputs",
          "truncate_prompt_tokens", "parallel_tool_calls")
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text")


def chat_body(body: dict) -> dict:
    """The chat completions body a Responses body asks for; a 400 names what it cannot be."""
    for key, why in REFUSED.items():
        if body.get(key):
            raise APIError(400, f"{key} is not supported by this server: {why}", key, code="unsupported")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise APIError(400, "instructions must be a string", "instructions")
    if body.get("text") is not None and not isinstance(body["text"], dict):
        raise APIError(400, "text must be an object, e.g. {\"format\": {\"type\": \"json_object\"}}", "text")
    chat = {key: body[key] for key in PASSED if key in body}
    chat["messages"] = ([{"role": "system", "content": instructions}] if instructions else []) + _messages(
        body.get("input"))
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("tools"):
        chat["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(body["tools"])]
    if body.get("tool_choice") is not None:
        choice = body["tool_choice"]
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}} if isinstance(
            choice, dict) and choice.get("type") == "function" else choice
    text_format = (body.get("text") or {}).get("format")
    if text_format is not None:
        if not isinstance(text_format, dict):
            raise APIError(400, "text.format must be an object", "text")
        if text_format.get("type") == "json_schema":  # Responses names the schema beside the type, not under it
            chat["response_format"] = {"type": "json_schema", "json_schema": {
                k: text_format.get(k) for k in ("name", "schema", "strict")}}
        else:
            chat["response_format"] = text_format
    return chat


def _chat_tool(tool, i: int) -> dict:
    """A Responses function tool ({"type": "function", "name", "description", "parameters"}) in chat's shape."""
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise APIError(400, f"tools[{i}] must be a function ({{\"type\": \"function\", \"name\", \"parameters\"}}): "
                            f"this server runs no built-in tools", "tools")
    return {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters") if k in tool}}


def _messages(given) -> list[dict]:
    """Responses' input as chat messages: a string is one user turn; a list's messages each a turn, its
    function_call items the calls of an assistant turn, its function_call_output items tool turns, and its reasoning
    items (an earlier response's output, sent back as clients do) the reasoning_content of the assistant turn that
    follows them (a chat template renders it where it renders a turn's thought)."""
    if isinstance(given, str) and given:
        return [{"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise APIError(400, "input must be a non-empty string or list of messages", "input")
    messages, thought = [], None
    for i, item in enumerate(given):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "reasoning":
            thought = _reasoning(item, i)
            continue
        if kind == "function_call" and all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if not messages or messages[-1]["role"] != "assistant" or thought is not None:
                messages.append({"role": "assistant", "content": None, "tool_calls": []})
            messages[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output" and isinstance(item.get("call_id"), str) and \
                isinstance(item.get("output"), str):
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        elif kind == "message" and item.get("role") in ROLES:
            messages.append({"role": ROLES[item["role"]], "content": _content(item.get("content"), i)})
        else:
            raise APIError(400, f"input[{i}] must be a message of role user, assistant, system or developer, a "
                                f"function_call, a function_call_output or a reasoning item", "input")
        if thought is not None and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"] = thought
        thought = None  # a thought belongs to the assistant turn right after it, or to none
    return messages


def _reasoning(item: dict, i: int) -> str:
    """The text of a reasoning item's reasoning_text parts (its summary is not the thought, and is left out)."""
    parts = item.get("content") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) and p.get("type") == "reasoning_text" and
                                              isinstance(p.get("text"), str) for p in parts):
        raise APIError(400, f"input[{i}]: a reasoning item's content must be reasoning_text parts", "input")
    return "".join(p["text"] for p in parts)


def _content(content, i: int):
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") in TEXT_PARTS for p in content):
            raise APIError(400, f"input[{i}]: only text content is supported (no images, audio or files)", "input")
        return [{"type": "text", "text": p.get("text")} for p in content]
    return content


class ResponseReply(Reply):
    """A chat reply of one choice in the Responses API's shapes: its output items in order, a thinking model's
    reasoning first, then the message, then each function call."""

    def __init__(self, served, chat: bool, asked, sequences: list, stream_options: dict, model: str, body: dict):
        super().__init__(served, chat, asked, sequences, stream_options, model)
        self.body, self.sequence_number, self.call_items = body, 0, []
        self.id = f"resp_{uuid.uuid4().hex}"
        self.item_ids = {"reasoning": f"rs_{uuid.uuid4().hex}", "message": f"msg_{uuid.uuid4().hex}"}
        self.opened, self.done = [], set()  # the stream's items in their order ("reasoning", "message", call k)

    async def whole(self, request) -> dict:
        reasoning, text, reason, calls = "", "", None, []
        async for delta in self.deltas(0):
            reasoning, text, reason = reasoning + delta.reasoning, text + delta.text, delta.reason
            calls += delta.calls
            if await request.is_disconnected():
                return {}
        return self.response(self.items(reasoning, text, reason, calls), reason)

    async def stream(self):
        """The Responses stream's events: the reasoning's and the message's items opened at their first text and
        done as the next item opens (or at the end); each function call an item of its own, added as its name is
        written, its arguments' deltas as the model writes them, done at the end; then the response completed or
        incomplete."""
        try:
            yield self.event("response.created", response=self.response([], None))
            yield self.event("response.in_progress", response=self.response([], None))
            reasoning, text, reason, calls = "", "", None, []
            async for delta in self.deltas(0):
                reasoning, text, reason = reasoning + delta.reasoning, text + delta.text, delta.reason
                calls += delta.calls
                if delta.reasoning:
                    for event in self.opening("reasoning", reasoning, text):
                        yield event
                    yield self.event("response.reasoning_text.delta", **self.where("reasoning"), delta=delta.reasoning)
                if delta.text:
                    for event in self.opening("message", reasoning, text):
                        yield event
                    yield self.event("response.output_text.delta", **self.where("message"), delta=delta.text,
                                     logprobs=[])
                for piece in delta.pieces:
                    call = {"type": "function_call", "id": self.call_item_id(piece["index"]),
                            "call_id": piece.get("id"), "name": piece["function"].get("name")}
                    for event in self.opening(piece["index"], reasoning, text, call) if "id" in piece else ():
                        yield event
                    if piece["function"]["arguments"]:
                        yield self.event("response.function_call_arguments.delta", **self.where(piece["index"]),
                                         delta=piece["function"]["arguments"])
            items = self.items(reasoning, text, reason, calls)
            for kind, item in zip(self.kinds(reasoning, text, calls), items):
                for event in self.opening(kind, reasoning, text, item):  # an empty answer's message, say
                    yield event
                for event in self.closing(kind, item):
                    yield event
            response = self.response(items, reason)
            yield self.event(f"response.{response['status']}", response=response)
        except APIError as e:  # the worker died mid-stream: the Responses stream's error event
            yield self.event("error", code=e.code or e.kind, message=e.message, param=e.param)
        finally:  # the client went away, or all is sent
            for sequence in self.sequences:
                self.served.scheduler.cancel(sequence)

    def opening(self, kind, reasoning: str, text: str, item: dict | None = None):
        """An item's added events where it is not open yet, the item before it done first (its text is whole once
        the next begins). `kind`: "reasoning", "message", or a call's index."""
        if kind in self.opened:
            return
        last = self.opened[-1] if self.opened else None
        if last in ("reasoning", "message"):
            yield from self.closing(last, self.message(text, "stop") if last == "message" else
                                    self.reasoning_item(reasoning))
        self.opened.append(kind)
        if kind == "message":
            yield self.event("response.output_item.added", output_index=self.index(kind), item=self.message("", None))
            yield self.event("response.content_part.added", **self.where(kind), part=self.part(""))
        elif kind == "reasoning":
            yield self.event("response.output_item.added", output_index=self.index(kind),
                             item={**self.reasoning_item(""), "content": []})
        else:
            yield self.event("response.output_item.added", output_index=self.index(kind),
                             item={**item, "arguments": "", "status": "in_progress"})

    def closing(self, kind, item: dict):
        """An item's done events, once."""
        if kind in self.done:
            return
        self.done.add(kind)
        where, index = self.where(kind), self.index(kind)
        if kind == "message":
            text = item["content"][0]["text"] if item["content"] else ""
            yield self.event("response.output_text.done", **where, text=text, logprobs=[])
            yield self.event("response.content_part.done", **where, part=self.part(text))
        elif kind == "reasoning":
            yield self.event("response.reasoning_text.done", **where, text=item["content"][0]["text"])
        else:
            yield self.event("response.function_call_arguments.done", **where, arguments=item["arguments"])
        yield self.event("response.output_item.done", output_index=index, item=item)

    def index(self, kind) -> int:
        return self.opened.index(kind)

    def where(self, kind) -> dict:
        at = {"item_id": self.item_ids.get(kind) or self.call_item_id(kind), "output_index": self.index(kind)}
        return {**at, "content_index": 0} if kind in ("message", "reasoning") else at

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def part(self, text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def message(self, text: str, reason: str | None) -> dict:
        return {"type": "message", "id": self.item_ids["message"], "status": _status(reason), "role": "assistant",
                "content": [self.part(text)] if reason is not None else []}

    def reasoning_item(self, reasoning: str) -> dict:
        return {"type": "reasoning", "id": self.item_ids["reasoning"], "summary": [],
                "content": [{"type": "reasoning_text", "text": reasoning}]}

    @staticmethod
    def kinds(reasoning: str, text: str, calls: list) -> list:
        """The output items' kinds in order: the reasoning (where the model thought), the message (where it has
        text, or calls nothing), each call."""
        return ["reasoning"] * bool(reasoning) + ["message"] * bool(text or not calls) + list(range(len(calls)))

    def items(self, reasoning: str, text: str, reason: str | None, calls: list) -> list[dict]:
        """The output items (kinds())."""
        made = {"reasoning": self.reasoning_item(reasoning), "message": self.message(text, reason)}
        return [made[kind] if isinstance(kind, str) else {
            "type": "function_call", "id": self.call_item_id(kind), "call_id": calls[kind]["id"],
            "name": calls[kind]["function"]["name"], "arguments": calls[kind]["function"]["arguments"],
            "status": "completed"} for kind in self.kinds(reasoning, text, calls)]

    def call_item_id(self, k: int) -> str:
        """The item id of the answer's k-th call, made once: the stream's items are the response's."""
        while len(self.call_items) <= k:
            self.call_items.append(f"fc_{uuid.uuid4().hex}")
        return self.call_items[k]

    def response(self, items: list, reason: str | None) -> dict:
        """The response object of its output `items`: in progress (reason None), completed (the answer ended, or
        called) or incomplete (its max_output_tokens reached)."""
        body, usage, status = self.body, self.usage(), _status(reason)
        tools = self.asked.tools
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "completed_at": int(time.time()) if status == "completed" else None, "model": self.model,
                "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else
                None, "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
                "output": items,
                "parallel_tool_calls": tools.parallel if tools else body.get("parallel_tool_calls", True),
                "temperature": self.asked.sampling.temperature,
                "top_p": self.asked.sampling.top_p, "tool_choice": body.get("tool_choice") or (
                    "auto" if tools else "none"), "tools": body.get("tools") or [], "store": False,
                "metadata": body.get("metadata") or {},
                "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
                "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                          "total_tokens": usage["total_tokens"], "input_tokens_details": {"cached_tokens": 0},
                          "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens}}}


def _status(reason: str | None) -> str:
    """in_progress (no reason yet), completed (stopped, or called), incomplete (max_output_tokens reached)."""
    return "in_progress" if reason is None else "incomplete" if reason == "length" else "completed"
