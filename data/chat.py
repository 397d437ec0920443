"""Conversations for fine-tuning: records in the three formats people bring, rendered by a chat template into
text, tokens, and the mask of the tokens the loss trains on (the assistant's).

Formats, detected per record:
    messages        {"messages": [{"role": "system" | "user" | "assistant", "content": ...}, ...]}  (OpenAI, HF)
    sharegpt        {"conversations": [{"from": "system" | "human" | "gpt", "value": ...}, ...]}
    alpaca          {"instruction": ..., "input": ..., "output": ...}  (one user turn, one assistant turn)

Templates are Jinja, rendered as transformers renders them (a sandbox; trim_blocks, lstrip_blocks; tojson,
raise_exception). The assistant's part of a turn sits between `{% generation %}` and `{% endgeneration %}`:
the tokens that overlap those spans are the supervised ones, which is transformers' rule for
`apply_chat_template(..., return_assistant_tokens_mask=True)`, so the masks are equal. Tokenizers without a
template of their own (char, tiktoken) take a built-in one by name.
"""
import json
from contextvars import ContextVar

from data.tokenizers import EOT

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
# A plain-text template for tokenizers that have no chat template: each assistant turn ends with the
# end-of-text token, which is also what generation stops at.
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


class ChatError(ValueError):
    """A record that is not a conversation this module can train on; the message says why."""


def conversation(record) -> tuple[str, list[dict]]:
    """(format, [{"role", "content"}, ...]) of one record, checked: known roles, non-empty assistant turns, at
    least one of them."""
    if not isinstance(record, dict):
        raise ChatError(f"a record must be a JSON object, not {type(record).__name__}")
    if "messages" in record:
        kind, turns = "messages", _turns(record["messages"], "messages", "role", "content", {r: r for r in ROLES})
    elif "conversations" in record:
        kind, turns = "sharegpt", _turns(record["conversations"], "conversations", "from", "value", SHAREGPT_ROLES)
    elif "instruction" in record and "output" in record:
        prompt = "\n\n".join(str(part) for part in (record["instruction"], record.get("input")) if part)
        kind, turns = "alpaca", [{"role": "user", "content": prompt},
                                 {"role": "assistant", "content": str(record["output"])}]
    else:
        raise ChatError(f"no conversation in it: expected \"messages\", \"conversations\" or \"instruction\" + "
                        f"\"output\", found keys {sorted(record)}")
    assistant = [t for t in turns if t["role"] == "assistant"]
    if not assistant:
        raise ChatError("the conversation has no assistant turn: nothing to train on")
    if any(not t["content"].strip() for t in assistant):
        raise ChatError("an assistant turn is empty")
    return kind, turns


def _turns(items, key: str, role_key: str, content_key: str, roles: dict) -> list[dict]:
    if not isinstance(items, list) or not items:
        raise ChatError(f"\"{key}\" must be a non-empty list of turns")
    turns = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or role_key not in item or content_key not in item:
            raise ChatError(f"{key}[{i}] must be an object with \"{role_key}\" and \"{content_key}\"")
        if item[role_key] not in roles:
            raise ChatError(f"{key}[{i}] has the unknown role {item[role_key]!r}; known: {', '.join(roles)}")
        turns.append({"role": roles[item[role_key]], "content": str(item[content_key])})
    return turns


def read_conversations(path: str):
    """(line number, format, turns) of each record of a JSONL file; ChatError names the file and line."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield (number, *conversation(json.loads(line)))
            except json.JSONDecodeError as e:
                raise ChatError(f"{path}:{number}: not JSON ({e.msg})") from None
            except ChatError as e:
                raise ChatError(f"{path}:{number}: {e}") from None


class ChatTemplate:
    """A Jinja chat template, rendered with the spans of its `{% generation %}` blocks."""

    def __init__(self, source: str):
        self.source = source
        self._spans = ContextVar("generation_spans", default=None)
        self.template = _environment(self._spans).from_string(source)
        self.marks_generation = "generation" in source and "endgeneration" in source

    def render(self, turns: list[dict], add_generation_prompt: bool = False) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text, and the (start, end) character spans of its assistant parts."""
        blocks, spans = [], []
        token = self._spans.set((blocks, spans))
        try:
            for block in self.template.generate(messages=turns, add_generation_prompt=add_generation_prompt):
                blocks.append(block)
        finally:
            self._spans.reset(token)
        return "".join(blocks), spans


def _environment(spans: ContextVar):
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """{% generation %} ... {% endgeneration %}: records where its output lands in the rendered text."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            text = caller()
            tracked = spans.get()
            if tracked is not None:
                blocks, found = tracked
                start = sum(len(b) for b in blocks)
                found.append((start, start + len(text)))
            return text

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = raise_exception
    return env


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


def tokenize(turns: list[dict], template: ChatTemplate, tokenizer, train_on: str = "all") -> tuple[list, list]:
    """A conversation's token ids and its loss mask: 1 on the assistant's tokens (of every assistant turn, or of the
    last one with train_on="last"), each turn's end-of-turn token included where the template marks it so; 1 on
    every token with train_on="everything" (the prompt trained on too, as plain text would be)."""
    text, spans = template.render(turns)
    ids, offsets = tokenizer.encode_with_offsets(text)
    if train_on == "everything":
        return ids, [1] * len(ids)
    return ids, supervised_mask(offsets, spans[-1:] if train_on == "last" else spans)

