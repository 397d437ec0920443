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

Templates are Jinja, rendered as transformers renders them (a sandbox; trim_blocks, lstrip_blocks; tojson,
raise_exception). The assistant's part of a turn sits between `{% generation %}` and `{% endgeneration %}`:
the tokens that overlap those spans are the supervised ones, which is transformers' rule for
`apply_chat_template(..., return_assistant_tokens_mask=True)`, so the masks are equal. Tokenizers without a
template of their own (char, tiktoken) take a built-in one by name. A template that is not Jinja, or that raises
as it renders (an undefined name called, a filter, its own raise_exception), raises ChatTemplateError with the
template's line; callers add which template and which conversation.
"""
import json
from contextvars import ContextVar

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
    if any(not t["content"].strip() for t in assistant):
        raise ChatError("an assistant turn is empty")
    return kind, turns


def prompt_turns(messages, key: str = "messages") -> list[dict]:
    """The turns of an OpenAI `messages` list (a record's field `key`), checked as a conversation's are: known
    roles, text content; a prompt needs no assistant turn."""
    return _turns(messages, key, "role", "content", {r: r for r in ROLES})


def _turns(items, key: str, role_key: str, content_key: str, roles: dict) -> list[dict]:
    if not isinstance(items, list) or not items:
        raise ChatError(f"\"{key}\" must be a non-empty list of turns")
    turns = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or role_key not in item or content_key not in item:
            raise ChatError(f"{key}[{i}] must be an object with \"{role_key}\" and \"{content_key}\"")
        if not isinstance(item[role_key], str) or item[role_key] not in roles:
            raise ChatError(f"{key}[{i}] has the unknown role {item[role_key]!r}; known: {', '.join(roles)}")
        turns.append({"role": roles[item[role_key]],
                      "content": _text(item[content_key], f"{key}[{i}].{content_key}", "tool_calls" in item)})
    return turns


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
    """(line number, format, turns) of each record of a JSONL file; ChatError names the file and line."""
    for number, (kind, turns) in read_records(path, conversation):
        yield number, kind, turns


class ChatTemplateError(ValueError):
    """A chat template that is not Jinja (syntax), or that raised while it rendered a conversation (render): Jinja's
    message and the template's line (None where none is known), and whether the template's raise_exception refused
    the conversation. Callers name the template and the conversation."""

    def __init__(self, problem: str, line: int | None, syntax: bool, refused: bool = False):
        self.problem, self.line, self.syntax = problem, line, syntax
        self.refused = refused  # by the template's own raise_exception(...): the conversation may be what is wrong
        super().__init__(self.describe("the chat template", "a conversation"))

    def describe(self, template: str, conversation: str) -> str:
        """'TEMPLATE is not valid Jinja at line N (PROBLEM)', or 'TEMPLATE fails at line N on CONVERSATION
        (PROBLEM)'."""
        at = f" at line {self.line}" if self.line is not None else ""
        if self.syntax:
            return f"{template} is not valid Jinja{at} ({self.problem})"
        return f"{template} fails{at} on {conversation} ({self.problem})"


class ChatTemplate:
    """A Jinja chat template, rendered with the spans of its `{% generation %}` blocks. A template that is not
    Jinja, or that raises as it renders, raises ChatTemplateError with the template's line."""

    def __init__(self, source: str):
        import jinja2

        self.source = source
        self._spans = ContextVar("generation_spans", default=None)
        try:
            self.template = _environment(self._spans).from_string(source)
        except jinja2.TemplateSyntaxError as e:  # and TemplateAssertionError: an unknown filter or test
            raise ChatTemplateError(_one_line(e.message or type(e).__name__), e.lineno, syntax=True) from None
        self.marks_generation = "generation" in source and "endgeneration" in source

    def render(self, turns: list[dict], add_generation_prompt: bool = False) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text, and the (start, end) character spans of its assistant parts."""
        blocks, spans = [], []
        token = self._spans.set((blocks, spans))
        try:
            for block in self.template.generate(messages=turns, add_generation_prompt=add_generation_prompt):
                blocks.append(block)
        except Exception as e:  # anything the template's code raised: an undefined name called, a filter, ...
            raised = getattr(e, "raised_by_template", False)
            problem = f"raise_exception: {e}" if raised else f"{type(e).__name__}: {e}"
            raise ChatTemplateError(_one_line(problem), self._line(e.__traceback__), False, raised) from None
        finally:
            self._spans.reset(token)
        return "".join(blocks), spans

    def _line(self, tb) -> int | None:
        """The template line of the innermost frame of template code in a traceback: Jinja rewrites the frames of
        a compiled template into frames of its file name (the template's, "<template>" for one from a string) and
        its line."""
        line = None
        while tb is not None:
            if tb.tb_frame.f_code.co_filename == (self.template.filename or "<template>"):
                line = tb.tb_lineno
            tb = tb.tb_next
        return line


def _one_line(message: str) -> str:
    return " ".join(message.split())


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

    def raise_exception(message):  # as transformers defines it, marked as the template's own refusal
        error = jinja2.exceptions.TemplateError(message)
        error.raised_by_template = True
        raise error

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = raise_exception
    return env


def chat_prompt(turns: list[dict], meta: dict, tokenizer, what: str, instead: str) -> tuple[list[int], int]:
    """The ids of a conversation (`turns` of {"role", "content"}) rendered by the model's chat template up to the
    assistant's turn, and the end-of-turn id its answer stops at. A ValueError says why not, beginning with `what`
    (the input as its command names it); `instead`: what to do with a model trained on plain text."""
    if "chat" not in meta:
        raise ValueError(f"{what} needs a model fine-tuned on conversations (data.prepare --format chat), whose chat "
                         f"template it applies; this one was trained on text: {instead}")
    try:
        chat = check_chat_record(meta, "the model's dataset meta")
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
    try:
        text, _ = ChatTemplate(chat["chat_template"]).render(turns, add_generation_prompt=True)
    except ChatTemplateError as e:  # a template that fails on a prompt alone, which preparation never rendered
        source = f", from {chat['template']}" if chat.get("template") else ""
        recorded = f"the model's chat template (meta.json chat.chat_template{source})"
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


def tokenize(turns: list[dict], template: ChatTemplate, tokenizer, train_on: str = "all") -> tuple[list, list]:
    """A conversation's token ids and its loss mask: 1 on the assistant's tokens (of every assistant turn, or of the
    last one with train_on="last"), each turn's end-of-turn token included where the template marks it so; 1 on
    every token with train_on="everything" (the prompt trained on too, as plain text would be)."""
    text, spans = template.render(turns)
    ids, offsets = tokenizer.encode_with_offsets(text)
    if train_on == "everything":
        return ids, [1] * len(ids)
    return ids, supervised_mask(offsets, spans[-1:] if train_on == "last" else spans)

