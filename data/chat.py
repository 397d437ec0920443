"""Conversations for fine-tuning: records in the three formats people bring, rendered by a chat template into
text, tokens, and the mask of the tokens the loss trains on (the assistant's).

Formats, detected per record:
    messages        {"messages": [{"role": "system" | "user" | "assistant", "content": ...}, ...]}  (OpenAI, HF)
    sharegpt        {"conversations": [{"from": "system" | "human" | "gpt", "value": ...}, ...]}
    alpaca          {"instruction": ..., "input": ..., "output": ...}  (one user turn, one assistant turn)

A turn's content is a string, or a list of OpenAI text parts [{"type": "text", "text": "..."}, ...], whose texts
are concatenated as they are, with no separator (as the chat templates of transformers models that take parts
write them one after the other; a part's own spaces and newlines are kept). Any other part (image_url,
input_audio, file, ...), a number, an object or null is refused: the model trains on text. Alpaca's fields are
strings; its `input` may be left out, empty or null.

Templates (data/chat_template.py) are Jinja, rendered as transformers renders them. The assistant's part of a turn
sits between `{% generation %}` and `{% endgeneration %}`: the tokens that overlap those spans are the supervised
ones, which is transformers' rule for `apply_chat_template(..., return_assistant_tokens_mask=True)`, so the masks
are equal. Tokenizers without a template of their own (char, tiktoken) take a built-in one by name. A messages record
(and a served chat request) may hold tool use too, in OpenAI's form (request_turns, record_tools), which the template
renders with the tools.
"""
import json

from data.chat_template import ChatTemplate, ChatTemplateError
from data.tokenizers import EOT

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
# Plain-text templates for tokenizers that have no chat template of their own: each assistant turn ends with the
# end-of-text token, which is also what generation stops at.
CHATML, CHATML_TOKENS = "chatml", ("<|im_start|>", "<|im_end|>")
BUILTIN_TEMPLATES = {
    "plain": (
        "{% for message in messages %}"
        "{% if message['role'] == 'assistant' %}"
        "Assistant: {% generation %}{{ message['content'] }}" + EOT + "{% endgeneration %}\n"
        "{% else %}"
        "{{ message['role'] | capitalize }}: {{ message['content'] }}\n"
        "{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}Assistant: {% endif %}"
    ),
    # plain's layout for a tokenizer without an end-of-text token (a character vocabulary of one document, the
    # quickstart's): each assistant turn ends with a newline, which generation stops at, so an answer is one line.
    "lines": (
        "{% for message in messages %}"
        "{% if message['role'] == 'assistant' %}"
        "{% if '\\n' in message['content'] %}"
        "{{ raise_exception('an assistant turn holds a newline, where the template lines ends the turn') }}"
        "{% endif %}"
        "Assistant: {% generation %}{{ message['content'] }}\n{% endgeneration %}"
        "{% else %}"
        "{{ message['role'] | capitalize }}: {{ message['content'] }}\n"
        "{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}Assistant: {% endif %}"
    ),
    # plain's layout with tools, for a tokenizer with an end-of-text token: the tools listed in a system line first,
    # an assistant turn's calls written after its text as Hermes' blocks, <tool_call>{"name": ..., "arguments":
    # {...}}</tool_call> (supervised with the text: the server reads them, tool_choice auto), a tool's result a turn
    # of its own.
    "hermes": (
        "{% if tools %}System: you may call these tools, each as <tool_call>{\"name\": ..., \"arguments\": {...}}"
        "</tool_call>:\n{% for tool in tools %}{{ tool['function'] | tojson }}\n{% endfor %}{% endif %}"
        "{% for message in messages %}"
        "{% if message['role'] == 'assistant' %}"
        "Assistant: {% generation %}{{ message['content'] }}{% for call in message.get('tool_calls') or [] %}"
        "<tool_call>{\"name\": {{ call['function']['name'] | tojson }}, \"arguments\": "
        "{{ call['function']['arguments'] | tojson }}}</tool_call>{% endfor %}" + EOT + "{% endgeneration %}\n"
        "{% elif message['role'] == 'tool' %}"
        "Tool: {{ message['content'] }}\n"
        "{% else %}"
        "{{ message['role'] | capitalize }}: {{ message['content'] }}\n"
        "{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}Assistant: {% endif %}"
    ),
    # ChatML (<|im_start|>role, the turn, <|im_end|>), for a tokenizer that holds its two tokens (Qwen's): each
    # assistant turn's content and its <|im_end|> supervised. A model's own template may render more (a default
    # system turn, say); pass that template, with the marks, to train on its exact layout.
    CHATML: (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
        "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}<|im_end|>"
        "{% endgeneration %}{% else %}{{ message['content'] }}<|im_end|>{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
}


# What a conversation dataset's meta.json records under "chat" (data/prepare_chat.py) that training, sampling and
# export read.
CHAT_KEYS = ("chat_template", "context", "end_of_turn_id", "end_of_turn")


def check_chat_record(meta: dict, where: str) -> dict:
    """The "chat" record of a dataset's meta (or of an export's copy of it), holding CHAT_KEYS."""
    missing = [key for key in CHAT_KEYS if key not in meta["chat"]]
    if missing:
        raise ValueError(f"{where} lacks chat.{', chat.'.join(missing)} (written by another version of "
                         f"data.prepare); prepare the conversations again with python -m data.prepare --format chat")
    return meta["chat"]


def recorded_template(chat: dict) -> ChatTemplate:
    """The chat template a "chat" record (of a dataset's meta or an export's) holds, with the special tokens it was
    rendered with (none in records written before they were kept: none were given then)."""
    return ChatTemplate(chat["chat_template"], chat.get("special_tokens"))


class ChatError(ValueError):
    """A record that is not a conversation this module can train on; the message says why."""


def conversation(record) -> tuple[str, list[dict]]:
    """(format, [{"role", "content"}, ...]) of one record, checked: known roles, non-empty assistant turns, at
    least one of them. A messages record's turns may use tools (request_turns): an assistant turn of tool calls
    needs no text."""
    if not isinstance(record, dict):
        raise ChatError(f"a record must be a JSON object, not {type(record).__name__}")
    if "messages" in record:
        kind, turns = "messages", request_turns(record["messages"])
    elif "conversations" in record:
        kind, turns = "sharegpt", _turns(record["conversations"], "conversations", "from", "value", SHAREGPT_ROLES)
    elif "instruction" in record and "output" in record:
        for key in ("instruction", "input", "output"):
            if not isinstance(record.get(key, ""), str) and not (key == "input" and record[key] is None):
                raise ChatError(f"\"{key}\" must be a string, not {json_kind(record[key])}")
        prompt = "\n\n".join(part for part in (record["instruction"], record.get("input")) if part)
        kind, turns = "alpaca", [{"role": "user", "content": prompt},
                                 {"role": "assistant", "content": record["output"]}]
    else:
        raise ChatError(f"no conversation in it: expected \"messages\", \"conversations\" or \"instruction\" + "
                        f"\"output\", found keys {sorted(record)}")
    assistant = [t for t in turns if t["role"] == "assistant"]
    if not assistant:
        raise ChatError("the conversation has no assistant turn: nothing to train on")
    if any(not t["content"].strip() and not t.get("tool_calls") for t in assistant):
        raise ChatError("an assistant turn is empty")
    return kind, turns


def prompt_turns(messages, key: str = "messages") -> list[dict]:
    """The turns of an OpenAI `messages` list (a record's field `key`), checked as a conversation's are: known
    roles, text content; a prompt needs no assistant turn."""
    return _turns(messages, key, "role", "content", {r: r for r in ROLES})


def record_tools(record: dict, where: str = "tools") -> list | None:
    """A record's (or a request's) `tools`, OpenAI's function definitions, checked; None where it has none."""
    tools = record.get("tools")
    if not tools:
        return None
    if not isinstance(tools, list) or not all(_is_function(t) for t in tools):
        raise ChatError(f"\"{where}\" must be a list of {{\"type\": \"function\", \"function\": {{\"name\", "
                        f"\"description\", \"parameters\"}}}}")
    return tools


def _is_function(definition) -> bool:
    if not isinstance(definition, dict) or not isinstance(definition.get("function"), dict):
        return False
    function = definition["function"]
    return definition.get("type") == "function" and isinstance(function.get("name"), str) and \
        isinstance(function.get("parameters", {}), dict)


def request_turns(messages) -> list[dict]:
    """The turns of an OpenAI `messages` list (a messages record's, a served chat request's): prompt_turns' rules,
    and the turns of tool use that a template renders as transformers passes them: an assistant turn's `tool_calls`
    (its content then may be null) and `tool` turns with their `tool_call_id`."""
    if not isinstance(messages, list) or not messages:
        raise ChatError("\"messages\" must be a non-empty list of turns")
    turns = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if isinstance(message, dict) and message.get("role") == "tool":
            if not isinstance(message.get("tool_call_id"), str):
                raise ChatError(f"{where} is a tool turn without its tool_call_id (a string)")
            turns.append({"role": "tool", "content": _text(message.get("content"), f"{where}.content"),
                          "tool_call_id": message["tool_call_id"]})
        elif isinstance(message, dict) and message.get("role") == "assistant" and message.get("tool_calls"):
            content = message.get("content")
            turns.append({"role": "assistant", "content": "" if content is None else _text(content, where),
                          "tool_calls": _tool_calls(message["tool_calls"], f"{where}.tool_calls"),
                          **_reasoning(message, "assistant", where)})
        else:
            turns.append(_turn(message, where, "role", "content", {r: r for r in ROLES}))
    return turns


def _tool_calls(calls, where: str) -> list[dict]:
    """OpenAI's tool calls of an assistant turn: each {"id", "type": "function", "function": {"name",
    "arguments"}}, the arguments a JSON string, which templates are given as its value: transformers' convention
    (Llama 3's, Qwen's and Mistral's templates write `arguments | tojson`), as vLLM passes them."""
    if not isinstance(calls, list):
        raise ChatError(f"{where} must be a list of tool calls")
    read = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or \
                not isinstance(function.get("arguments"), str):
            raise ChatError(f"{where}[{j}] must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                            f"\"arguments\"}}}} with the arguments a JSON string")
        try:
            arguments = json.loads(function["arguments"])
        except json.JSONDecodeError as e:
            raise ChatError(f"{where}[{j}].function.arguments is not JSON ({e.msg} at character {e.pos}): a call's "
                            f"arguments are a JSON object written as a string") from None
        read.append({**call, "function": {**function, "arguments": arguments}})
    return read


def _turns(items, key: str, role_key: str, content_key: str, roles: dict) -> list[dict]:
    if not isinstance(items, list) or not items:
        raise ChatError(f"\"{key}\" must be a non-empty list of turns")
    return [_turn(item, f"{key}[{i}]", role_key, content_key, roles) for i, item in enumerate(items)]


def _turn(item, where: str, role_key: str, content_key: str, roles: dict) -> dict:
    if not isinstance(item, dict) or role_key not in item or content_key not in item:
        raise ChatError(f"{where} must be an object with \"{role_key}\" and \"{content_key}\"")
    if not isinstance(item[role_key], str) or item[role_key] not in roles:
        raise ChatError(f"{where} has the unknown role {item[role_key]!r}; known: {', '.join(roles)}")
    turn = {"role": roles[item[role_key]],
            "content": _text(item[content_key], f"{where}.{content_key}", "tool_calls" in item)}
    return {**turn, **_reasoning(item, turn["role"], where)}


# The names of an assistant turn's reasoning (a thinking model's): vLLM's older and newer, gpt-oss templates'.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _reasoning(item: dict, role: str, where: str) -> dict:
    """An assistant turn's reasoning under each of its names, as transformers aliases them (reasoning_content, which
    Qwen 3's template renders as its <think> block, and thinking, which gpt-oss templates read)."""
    given = [key for key in REASONING_FIELDS if item.get(key) is not None] if role == "assistant" else []
    if not given:
        return {}
    if not all(isinstance(item[key], str) for key in given):
        key = next(key for key in given if not isinstance(item[key], str))
        raise ChatError(f"{where}.{key} must be a string, not {json_kind(item[key])}")
    reasoning = item[given[0]]
    return {"thinking": reasoning, **{key: item[key] for key in given}, "reasoning_content": reasoning}


TEXT_PART = '{"type": "text", "text": "..."}'


def _text(content, where: str, tool_calls: bool = False) -> str:
    """A turn's content as text: a string, or the concatenated texts of a list of OpenAI text parts."""
    if isinstance(content, str):
        return content
    if content is None:
        if tool_calls:
            raise ChatError(f"{where} is null, a turn of tool_calls: tool calls are not trained on")
        raise ChatError(f"{where} is null: a turn's content must be a string or a list of text parts {TEXT_PART}")
    if not isinstance(content, list):
        raise ChatError(f"{where} must be a string or a list of text parts {TEXT_PART}, not {json_kind(content)}")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise ChatError(f"{where}[{j}] must be a text part {TEXT_PART}, not {json_kind(part)}")
        if part.get("type") != "text":
            raise ChatError(f"{where}[{j}] is a part of type {part.get('type')!r}: only text parts {TEXT_PART} are "
                            f"trained on")
        if not isinstance(part.get("text"), str):
            raise ChatError(f"{where}[{j}].text must be a string, not {json_kind(part.get('text'))}")
        texts.append(part["text"])
    return "".join(texts)


JSON_KINDS = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list", dict: "an object"}


def json_kind(value) -> str:
    """A JSON value as a message names it: its kind and, but for null, how it begins."""
    if value is None:
        return "null"
    return f"{JSON_KINDS.get(type(value), type(value).__name__)} ({json.dumps(value, ensure_ascii=False)[:40]})"


def read_records(path: str, parse):
    """(line number, parse(record)) of each record of a JSONL file, blank lines skipped; a line that is not UTF-8
    or JSON, or that parse refuses (ChatError), ends the reading in a ChatError naming the file and line."""
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            try:
                text = line.decode("utf-8")
                if text.strip():
                    yield number, parse(json.loads(text))
            except UnicodeDecodeError as e:
                raise ChatError(f"{path}:{number}: not UTF-8 text (byte {line[e.start]:#04x} at column {e.start + 1})"
                                ) from None
            except json.JSONDecodeError as e:
                raise ChatError(f"{path}:{number}: not JSON ({e.msg})") from None
            except RecursionError:
                raise ChatError(f"{path}:{number}: JSON nested too deeply to read") from None
            except ChatError as e:
                raise ChatError(f"{path}:{number}: {e}") from None


def read_conversations(path: str):
    """(line number, format, turns, tools) of each record of a JSONL file; ChatError names the file and line."""
    for number, (kind, turns, tools) in read_records(path, lambda r: (*conversation(r), record_tools(r))):
        yield number, kind, turns, tools


# Where a chat prompt ends: at the assistant's turn the answer is (add_generation_prompt), inside the last turn,
# whose content the answer continues (continue_final_message), or after the last turn.
ANSWER, CONTINUE, AFTER = "answer", "continue", "after"


def chat_prompt(turns: list[dict], meta: dict, tokenizer, what: str, instead: str, tools: list | None = None,
                variables: dict | None = None, ending: str = ANSWER) -> tuple[list[int], int]:
    """The ids of a conversation (`turns` of {"role", "content"}) rendered by the model's chat template to its
    `ending`, with `tools` (OpenAI's definitions) and the template's own `variables` where given, and the end-of-turn
    id its answer stops at. A ValueError says why not, beginning with `what` (the input as its command names it);
    `instead`: what to do with a model trained on plain text."""
    if "chat" not in meta:
        raise ValueError(f"{what} needs a model fine-tuned on conversations (data.prepare --format chat), whose chat "
                         f"template it applies; this one was trained on text: {instead}")
    try:
        chat = check_chat_record(meta, "the model's dataset meta")
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
    try:
        template = recorded_template(chat)
        if tools and not template.renders_tools:
            raise ValueError(f"{what}: the model's chat template does not render tools (it reads no `tools`): the "
                             f"model would never see them; fix: serve a model whose template renders them (Qwen's, "
                             f"Hermes'), or leave tools out")
        variables = {k: v for k, v in (variables or {}).items() if k in template.variables}  # vLLM drops others
        text, _ = template.render(turns, ending == ANSWER, tools, variables, ending == CONTINUE)
    except ChatTemplateError as e:  # a template that fails on a prompt alone, which preparation never rendered
        source = f", from {chat['template']}" if chat.get("template") else ""
        recorded = f"the model's chat template (meta.json chat.chat_template{source})"
        if e.refused:  # its own raise_exception: the messages are what it does not take
            raise ValueError(f"{what}: {e.describe(recorded, 'the messages')}; fix: send messages it takes") from None
        raise ValueError(f"{what}: {e.describe(recorded, 'the messages')}; fix: correct the template so it renders "
                         f"user messages with add_generation_prompt, and prepare the conversations again with it "
                         f"(python -m data.prepare --format chat --chat_template FILE)") from None
    try:
        return tokenizer.encode_with_offsets(text)[0], chat["end_of_turn_id"]
    except ValueError as e:  # a character outside a char tokenizer's vocabulary
        raise ValueError(f"{what}: {e}; fix: write the messages in the characters the model was trained on") from None


def supervised_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token whose characters overlap a span, else 0 (transformers' assistant-mask rule: a token
    that straddles a span's edge counts as the assistant's)."""
    mask, span = [0] * len(offsets), 0
    for i, (start, end) in enumerate(offsets):
        while span < len(spans) and start >= spans[span][1]:
            span += 1
        if span == len(spans):
            break
        if end > spans[span][0]:
            mask[i] = 1
    return mask


TRAIN_ON = ("all", "last", "everything")
ANSWERS = {"all": "all", "last": "last", "everything": "none"}  # the assistant parts whose spans each needs


def tokenize(turns: list[dict], template: ChatTemplate, tokenizer, train_on: str = "all",
             tools: list | None = None) -> tuple[list, list]:
    """A conversation's token ids and its loss mask: 1 on the assistant's tokens (of every assistant turn, or of the
    last one with train_on="last"), each turn's end-of-turn token included where the template marks it so; 1 on
    every token with train_on="everything" (the prompt trained on too, as plain text would be)."""
    return masked_ids(*template.render(turns, tools=tools, answers=ANSWERS[train_on]), tokenizer, train_on)


def masked_ids(text: str, spans: list[tuple[int, int]], tokenizer, train_on: str) -> tuple[list, list]:
    """A rendered conversation's (`text`, its assistant `spans`) token ids and loss mask (tokenize's)."""
    ids, offsets = tokenizer.encode_with_offsets(text)
    if train_on == "everything":
        return ids, [1] * len(ids)
    return ids, supervised_mask(offsets, spans[-1:] if train_on == "last" else spans)

