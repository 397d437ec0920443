"""Conversations into a fine-tuning dataset: `python -m data.prepare --format chat`.

    python -m data.prepare --format chat --input chats.jsonl --tokenizer PATH/tokenizer.json --context 1024
    python -m data.prepare --format chat --input alpaca.jsonl --tokenizer char --chat_template plain

Each conversation of the JSONL inputs (data/chat.py: messages, ShareGPT or Alpaca records, one format a file)
is rendered by the chat template (--chat_template FILE or a built-in name; else the `chat_template` of the
tokenizer.json's tokenizer_config.json; else, for char and tiktoken, the built-in `plain`), tokenized, and
written as one document, with its loss mask beside its tokens (train.mask, val.mask: one byte a token, 1 on
the assistant's tokens of every turn; with --train_on last, of the last; with everything, on every token). A
conversation of more than --context + 1 tokens, which no training window of that context holds whole, is cut to
it (--overlong truncate) or left out (drop); one left without a supervised token is left out; both are counted
in meta.json and printed. A bad record, a template that is not Jinja or fails on a conversation, and a
tokenizer_config.json that holds no template string end the preparation in one line (the file, the line, the fix).
Conversations are rendered and tokenized in this one process: fine-tuning sets are small next to corpora.
"""
import json
import os

from data.chat import (
    ANSWERS,
    BUILTIN_TEMPLATES,
    CHATML,
    CHATML_TOKENS,
    ChatError,
    json_kind,
    masked_ids,
    read_conversations,
    supervised_mask,
)
from data.chat_template import ChatTemplate, ChatTemplateError, template_tokens
from data.jsonl_job import built_tokenizer, jsonl_files, jsonl_job
from data.out_dir import check_val_fraction, done_job, finish_dataset, in_val, job_workspace
from data.readers import InputError
from data.tokenizers import EOT, CharTokenizer, HFTokenizer, parse_spec
from data.writer import SPLITS, ShardWriter, token_dtype

TOKENIZER_CONFIG, TEMPLATE_FILE = "tokenizer_config.json", "chat_template.jinja"


def chat_template(spec: str | None, tokenizer_spec, tokenizer=None) -> tuple[str, str]:
    """(name, Jinja source) of the template: --chat_template (a built-in name or a file), else the tokenizer's own
    (the tokenizer_config.json beside a tokenizer.json, or in a --tokenizer folder), else, for tokenizers that come
    without one, `plain`, or `lines` for a tokenizer without an end-of-text token (`tokenizer`, a ready one)."""
    if spec in BUILTIN_TEMPLATES:
        return spec, BUILTIN_TEMPLATES[spec]
    if spec is not None:
        if not os.path.isfile(spec):
            raise InputError(f"--chat_template {spec} is neither a file nor a built-in template "
                             f"({', '.join(BUILTIN_TEMPLATES)}); pass a Jinja template file or a built-in name")
        return os.path.abspath(spec), _read_text(spec, "pass a Jinja chat template file")
    folder = isinstance(tokenizer_spec, str) and os.path.isdir(tokenizer_spec)
    if folder and not isinstance(tokenizer, HFTokenizer):  # a model's own characters or tiktoken encoding
        if not os.path.isfile(os.path.join(tokenizer_spec, TOKENIZER_CONFIG)):  # none fine-tuned on conversations
            return ("plain", BUILTIN_TEMPLATES["plain"]) if tokenizer.eot_id is not None else \
                ("lines", BUILTIN_TEMPLATES["lines"])
    if isinstance(tokenizer_spec, str) and (tokenizer_spec.endswith(".json") or folder):
        fix = "pass --chat_template FILE (a Jinja chat template), or --chat_template plain"
        found = tokenizer_template(tokenizer_spec, fix)
        if found is None:
            raise InputError(f"{_beside(tokenizer_spec, TOKENIZER_CONFIG)} holds no chat_template for "
                             f"{tokenizer_spec}: {fix}")
        return found
    return "plain", BUILTIN_TEMPLATES["plain"]


def tokenizer_template(tokenizer_spec: str, fix: str) -> tuple[str, str] | None:
    """(where, Jinja source) of the chat template that comes with a tokenizer.json (or a tokenizer's folder), as
    transformers reads it: a chat_template.jinja beside it (what save_pretrained writes now), else its
    tokenizer_config.json's chat_template; None where neither holds one."""
    jinja = _beside(tokenizer_spec, TEMPLATE_FILE)
    if os.path.isfile(jinja):
        return jinja, _read_text(jinja, f"correct it, or {fix}")
    config, record = tokenizer_config(tokenizer_spec, fix) or (None, {})
    template = record.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise InputError(f"the chat_template of {config} is {json_kind(template)}, not a string (a Jinja "
                         f"template); fix: {fix}")
    return None if template is None else (config, template)


def _beside(tokenizer_spec: str, name: str) -> str:
    """The file `name` beside a tokenizer.json, or in a tokenizer's folder."""
    folder = tokenizer_spec if os.path.isdir(tokenizer_spec) else os.path.dirname(tokenizer_spec)
    return os.path.join(os.path.abspath(folder), name)


def _config_path(tokenizer_spec) -> str | None:
    """The tokenizer_config.json beside a tokenizer.json, or in a tokenizer's folder (None for other tokenizers)."""
    if not isinstance(tokenizer_spec, str) or not (os.path.isdir(tokenizer_spec) or tokenizer_spec.endswith(".json")):
        return None
    return _beside(tokenizer_spec, TOKENIZER_CONFIG)


def tokenizer_config(tokenizer_spec, fix: str) -> tuple[str, dict] | None:
    """(path, record) of the tokenizer's tokenizer_config.json; None where it has none."""
    config = _config_path(tokenizer_spec)
    if config is None or not os.path.isfile(config):
        return None
    try:
        record = json.loads(_read_text(config, f"correct it, or {fix}"))
    except json.JSONDecodeError as e:
        raise InputError(f"{config} is not JSON ({e.msg} at line {e.lineno}, column {e.colno}); fix: correct it, "
                         f"or {fix}") from None
    if not isinstance(record, dict):
        raise InputError(f"{config} is {json_kind(record)}, not a JSON object; fix: correct it, or {fix}")
    return config, record


def _read_text(path: str, fix: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise InputError(f"{path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start:,}); fix: {fix}"
                         ) from None


def template_settings(template: ChatTemplate | None) -> list:
    """What of a template changes a dataset beside its source, for its job: the special tokens it renders with
    (none: nothing, so datasets of tokenizers without them keep their jobs)."""
    return [template.special_tokens] if template is not None and template.special_tokens else []


def template_label(name: str) -> str:
    """How a message names the template chat_template() returned as `name`."""
    if name in BUILTIN_TEMPLATES:
        return f"the built-in template {name}"
    if os.path.basename(name) == TOKENIZER_CONFIG:
        return f"the chat_template of {name}"
    return f"the chat template {name}"


def load_template(template_spec: str | None, tokenizer_spec, ready) -> tuple[str, str, ChatTemplate]:
    """(name, source, compiled template) of chat_template()'s choice; `ready`: the tokenizer when it is a ready one.
    A template that is not Jinja, or plain for characters without an end-of-text token, is refused."""
    name, source = chat_template(template_spec, tokenizer_spec, ready)
    if name in ("plain", "hermes") and isinstance(ready, CharTokenizer) and ready.eot_id is None:
        raise InputError(f"the built-in template {name} ends each answer with {EOT}, which the tokenizer of "
                         f"--tokenizer {tokenizer_spec} ({ready.vocab_size} characters, no end-of-text token) does not "
                         f"hold; fix: pass --chat_template lines (each answer ends with a newline), or leave "
                         f"--chat_template out")
    config = tokenizer_config(tokenizer_spec, "remove it")  # its special tokens, whichever template renders
    try:
        return name, source, ChatTemplate(source, template_tokens(config[1]) if config else None)
    except ChatTemplateError as e:
        raise InputError(f"{e.describe(template_label(name), '')}; fix: correct the template at that line, or pass "
                         f"another --chat_template FILE") from None


def _one_token(tok, text: str) -> bool:
    try:
        return len(tok.encode(text)) == 1
    except ValueError:  # characters a character vocabulary lacks
        return False


def template_failure(e: ChatTemplateError, name: str, what: str) -> InputError:
    """The refusal of a template (chat_template()'s `name`) that failed as it rendered `what` (a record)."""
    at = " at that line" if e.line else ""
    fix = (f"leave the record out, or correct the template{at}" if e.refused else
           "pass --train_on last (the last answer is found whatever comes before it), or a --chat_template FILE "
           "that marks each answer with {% generation %}" if e.unmarked else
           f"correct the template{at}, or pass another --chat_template FILE")
    return InputError(f"{e.describe(template_label(name), what)}; fix: {fix}")


def prepare_chat(inputs: list[str], out_dir: str, tokenizer_spec="char", template_spec: str | None = None,
                 train_on: str = "all", context: int = 1024, overlong: str = "truncate", val_fraction: float = 0.01,
                 force: bool = False) -> dict:
    """Write the conversation dataset of `inputs` to out_dir unless it is already there; returns its meta."""
    if context < 1:
        raise InputError(f"--context {context}: must be >= 1; fix: pass the model's block_size")
    check_val_fraction(val_fraction)
    files = jsonl_files(inputs, "conversations")
    tokenizer_kind = parse_spec(tokenizer_spec)  # a tokenizer.json that is not one ends here, before any rendering
    ready = tokenizer_kind[1] if tokenizer_kind[0] == "ready" else None
    name, source, template = load_template(template_spec, tokenizer_spec, ready)
    job = jsonl_job("chat", files, tokenizer_spec, ready, source, train_on, context, overlong, val_fraction,
                    *template_settings(template))
    meta = done_job(out_dir, job, force, "these conversations")
    if meta is not None:
        return meta

    conversations, formats, rendered, lines = _read(files, template, name, train_on)
    texts = [text for text, _ in rendered]
    tok = built_tokenizer(tokenizer_kind, texts)
    if name == CHATML and not all(_one_token(tok, token) for token in CHATML_TOKENS):
        raise InputError(f"the built-in template chatml needs {' and '.join(CHATML_TOKENS)} as tokens of their own, "
                         f"which --tokenizer {tokenizer_spec} does not hold; fix: pass a tokenizer that has them "
                         f"(Qwen's), or --chat_template plain")
    try:
        end_of_turn = marked_end_of_turn(template, tok, conversations[0][0])
    except ChatTemplateError:
        raise
    except ValueError as e:  # a character outside a given character vocabulary
        raise _untokenizable(e, lines[0], tokenizer_spec) from None
    if end_of_turn is None:
        raise InputError(f"{template_label(name)} renders no token of the last answer of the first conversation of "
                         f"{files[0]} (its {{% generation %}} blocks, or the text the answer adds to its prompt); fix: "
                         f"correct the template, or pass another --chat_template FILE")
    workspace = job_workspace(out_dir, job)
    prefix = os.path.join(workspace, "shards", "chat")
    encoded = (_tokenized(text, spans, tok, train_on, where, tokenizer_spec)
               for (text, spans), where in zip(rendered, lines))
    counts, supervised = _write(prefix, token_dtype(tok.vocab_size), encoded, texts, context, overlong, val_fraction)
    if not any(supervised.values()):
        raise InputError(f"none of the {len(conversations):,} conversations keeps an assistant token within "
                         f"--context {context}; fix: pass the model's block_size as --context")
    print(f"{len(conversations):,} conversations: {counts['truncated']:,} cut to {context + 1:,} tokens, "
          f"{counts['dropped_overlong']:,} left out as longer (--overlong {overlong}), "
          f"{counts['dropped_unsupervised']:,} left out with no assistant token within the context")
    record = {"chat": {"formats": formats, "template": name, "chat_template": source,
                       "special_tokens": template.special_tokens, "train_on": train_on,
                       "end_of_turn_id": end_of_turn, "end_of_turn": tok.decode([end_of_turn]),
                       "context": context, "overlong": overlong, "conversations": len(conversations), **counts,
                       **{f"{s}_supervised_tokens": supervised[s] for s in SPLITS}}}
    return finish_dataset(out_dir, workspace, [prefix], tok, job, files,
                          f"conversations by hash, val_fraction {val_fraction}", None, record)


def _read(files: list[str], template: ChatTemplate, name: str, train_on: str) -> tuple[list, dict, list, list[str]]:
    """Every file's conversations ((turns, tools) each), each file's format (one a file), each conversation's
    rendering (its text, and the spans of the assistant parts `train_on` trains) and where it was read
    ("file:line")."""
    conversations, formats, rendered, lines = [], {}, [], []
    for path in files:
        try:
            for line, kind, turns, tools in read_conversations(path):
                if formats.setdefault(path, kind) != kind:
                    raise InputError(f"{path}:{line}: a {kind} record in a file of {formats[path]} records: keep one "
                                     f"format a file")
                if (tools or any("tool_calls" in t for t in turns)) and not template.renders_tools:
                    raise InputError(f"{path}:{line}: a conversation that uses tools, which {template_label(name)} "
                                     f"does not render (it reads no `tools`); fix: pass --chat_template hermes, or "
                                     f"the model's own template that renders them")
                conversations.append((turns, tools))
                lines.append(f"{path}:{line}")
                rendered.append(template.render(turns, tools=tools, answers=ANSWERS[train_on]))
        except ChatError as e:
            raise InputError(f"{e}; fix the record or leave it out") from None
        except ChatTemplateError as e:
            raise template_failure(e, name, f"the conversation {path}:{line}") from None
    if not conversations:
        raise InputError(f"no conversation in {', '.join(files)}: the inputs are empty")
    return conversations, formats, rendered, lines


def _tokenized(text: str, spans: list, tok, train_on: str, where: str, tokenizer_spec):
    try:
        return masked_ids(text, spans, tok, train_on)
    except ValueError as e:
        raise _untokenizable(e, where, tokenizer_spec) from None


def _write(prefix: str, dtype, encoded, texts: list[str], context: int, overlong: str,
           val_fraction: float) -> tuple[dict, dict]:
    """Each conversation (`encoded`: its ids and loss mask), fitted to the context, into the shards at `prefix`;
    the counts of meta.json's chat record and each split's supervised tokens."""
    writer = ShardWriter(prefix, dtype, masks=True)
    counts = {"truncated": 0, "dropped_overlong": 0, "dropped_unsupervised": 0}
    supervised = dict.fromkeys(SPLITS, 0)
    for (ids, mask), text in zip(encoded, texts):
        if len(ids) > context + 1:
            if overlong == "drop":
                counts["dropped_overlong"] += 1
                continue
            ids, mask = ids[:context + 1], mask[:context + 1]
            counts["truncated"] += 1
        if not any(mask[1:]):  # the first token is never a target
            counts["dropped_unsupervised"] += 1
            continue
        split = "val" if in_val(text, val_fraction) else "train"
        writer.write(split, [ids], [mask])
        supervised[split] += sum(mask[1:])
    writer.close()
    return counts, supervised


def _untokenizable(e: ValueError, where: str, tokenizer_spec) -> InputError:
    return InputError(f"{where}: the conversation does not encode with --tokenizer {tokenizer_spec} ({e}); fix: leave "
                      f"the record out, or write it in the tokenizer's characters")


def marked_end_of_turn(template: ChatTemplate, tok, turns: list[dict]) -> int | None:
    """The token that ends the last assistant turn of `turns` (the last of its part, marked or found: render's
    spans): where generation stops. None where its part holds no token."""
    text, spans = template.render(turns, answers="last")
    ids, offsets = tok.encode_with_offsets(text)
    marked = [i for i, m in enumerate(supervised_mask(offsets, spans[-1:])) if m]
    return ids[marked[-1]] if marked else None


if __name__ == "__main__":
    from common.checks import not_a_command

    not_a_command("data.prepare_chat", "python -m data.prepare --format chat")
