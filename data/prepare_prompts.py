"""Prompts into a dataset for online RL: `python -m data.prepare --format prompts`.

    python -m data.prepare --format prompts --input prompts.jsonl --tokenizer EXPORT --context 64 --out_dir DIR

Each record of the JSONL inputs (data/prompts.py: a "prompt", text or messages, and what the reward reads) is
tokenized as the model will see it when it answers: messages rendered by the chat template up to the assistant's
turn (add_generation_prompt; the template --format chat would use), text as transformers' tokenizer(text) encodes
it. The ids are written as one document each (train.bin, val.bin), the records beside them in the same order
(train.prompts.jsonl, val.prompts.jsonl: {"where": "file:line", "record": ...}), and meta.json's "prompts" record
holds the longest prompt, which with rl.max_new_tokens must fit the model's block_size. A prompt of more than
--context - 1 tokens leaves no room for an answer and is left out, counted and printed. A prompt goes to val when
the hash of its text does. For messages, meta.json's "chat" record (the template and the end-of-turn id where
sampling stops) is what conversations carry, so the trained model exports and serves with it.
"""
import json
import os

from data.chat import ChatError
from data.chat_template import ChatTemplateError
from data.jsonl_job import built_tokenizer, jsonl_files, jsonl_job
from data.out_dir import check_val_fraction, done_job, finish_dataset, in_val, job_workspace
from data.prepare_chat import (
    load_template,
    marked_end_of_turn,
    template_failure,
    template_label,
    template_settings,
)
from data.prepare_preference import text_encoder
from data.prompts import TEXT, read_prompts
from data.readers import InputError
from data.tokenizers import parse_spec
from data.writer import SPLITS, ShardWriter, token_dtype, write_atomic

RECORDS = "{split}.prompts.jsonl"


def prepare_prompts(inputs: list[str], out_dir: str, tokenizer_spec="char", template_spec: str | None = None,
                    context: int = 1024, val_fraction: float = 0.01, force: bool = False) -> dict:
    """Write the prompt dataset of `inputs` to out_dir unless it is already there; returns its meta."""
    if context < 2:
        raise InputError(f"--context {context}: must be >= 2 (a prompt and an answer); fix: pass the model's "
                         f"block_size")
    check_val_fraction(val_fraction, empty_val=True)
    files = jsonl_files(inputs, "prompts")
    tokenizer_kind = parse_spec(tokenizer_spec)
    ready = tokenizer_kind[1] if tokenizer_kind[0] == "ready" else None
    prompts, records, lines, kinds = _read(files)
    text = TEXT in kinds
    name = source = template = None
    if not text:
        name, source, template = load_template(template_spec, tokenizer_spec, ready)
    elif template_spec is not None:
        raise InputError(f"--chat_template {template_spec}: {files[0]} holds text prompts, which are tokenized as "
                         f"they are, with no template; fix: leave --chat_template out")
    job = jsonl_job("prompts", files, tokenizer_spec, ready, source, context, val_fraction,
                    *template_settings(template))
    meta = done_job(out_dir, job, force, "these prompts")
    if meta is not None:
        return meta

    texts = [p if text else _rendered(template, name, p, where) for p, where in zip(prompts, lines)]
    tok = built_tokenizer(tokenizer_kind, texts)
    encode = text_encoder(tok) if text else (lambda t: tok.encode_with_offsets(t)[0])
    extra = {}
    if template is not None:
        extra["chat"] = _chat_record(template, name, tok, prompts[0], lines[0], context)
    workspace = job_workspace(out_dir, job)
    prefix = os.path.join(workspace, "shards", "prompts")
    kept, longest, dropped = _write(prefix, token_dtype(tok.vocab_size), encode, texts, records, lines, context,
                                    val_fraction, tokenizer_spec)
    if not kept["train"]:
        why = (f"every one is longer than --context {context} - 1 tokens" if dropped == len(prompts) else
               f"none fell in the train split (by prompt hash, val_fraction {val_fraction})")
        raise InputError(f"no prompt of the {len(prompts):,} to train on: {why}; fix: pass the model's block_size as "
                         f"--context, or a smaller --val_fraction")
    for split in SPLITS:
        write_atomic(os.path.join(workspace, RECORDS.format(split=split)), "".join(kept[split]).encode())
    print(f"{len(prompts):,} prompts: {dropped:,} left out as longer than --context {context} - 1 tokens; "
          f"{len(kept['train']):,} train and {len(kept['val']):,} val prompts, the longest {longest} tokens")
    extra["prompts"] = {"format": TEXT if text else "messages", "template": name, "context": context,
                        "longest": longest, "dropped_overlong": dropped,
                        **{f"{s}_prompts": len(kept[s]) for s in SPLITS}}
    return finish_dataset(out_dir, workspace, [prefix], tok, job, files, f"prompts by hash, val_fraction "
                          f"{val_fraction}", None, extra, empty_val=True,
                          beside=[RECORDS.format(split=s) for s in SPLITS])


def _write(prefix: str, dtype, encode, texts: list[str], records: list[dict], lines: list[str], context: int,
           val_fraction: float, tokenizer_spec) -> tuple[dict, int, int]:
    """Each prompt that leaves room for an answer into the shards at `prefix`; each split's records (JSONL lines,
    in the shards' order), the longest prompt's tokens and how many were left out as longer."""
    writer = ShardWriter(prefix, dtype)
    kept = {split: [] for split in SPLITS}
    longest, dropped = 0, 0
    for prompt_text, record, where in zip(texts, records, lines):
        try:
            ids = encode(prompt_text)
        except ValueError as e:
            raise InputError(f"{where}: the prompt does not encode with --tokenizer {tokenizer_spec} ({e}); fix: "
                             f"leave the record out, or write it in the tokenizer's characters") from None
        if len(ids) > context - 1:
            dropped += 1
            continue
        split = "val" if in_val(prompt_text, val_fraction) else "train"
        writer.write(split, [ids])
        kept[split].append(json.dumps({"where": where, "record": record}, ensure_ascii=False) + "\n")
        longest = max(longest, len(ids))
    writer.close()
    return kept, longest, dropped


def _read(files: list[str]) -> tuple[list, list[dict], list[str], set]:
    """Every file's prompts and records, where each was read, and the formats (text or messages, not both)."""
    prompts, records, lines, kinds = [], [], [], {}
    for path in files:
        try:
            for line, kind, prompt, record in read_prompts(path):
                kinds.setdefault(path, kind)
                prompts.append(prompt)
                records.append(record)
                lines.append(f"{path}:{line}")
        except ChatError as e:
            raise InputError(f"{e}; fix the record or leave it out") from None
    if len(set(kinds.values())) > 1:
        raise InputError(f"{', '.join(kinds)} hold prompts of text and of messages: one dataset holds one kind; fix: "
                         f"prepare them as two datasets")
    if not prompts:
        raise InputError(f"no prompt in {', '.join(files)}: the inputs are empty")
    return prompts, records, lines, set(kinds.values())


def _rendered(template, name: str, turns: list[dict], where: str) -> str:
    try:
        return template.render(turns, add_generation_prompt=True)[0]
    except ChatTemplateError as e:
        raise template_failure(e, name, f"the prompt {where}") from None


def _chat_record(template, name: str, tok, turns: list[dict], where: str, context: int) -> dict:
    """The chat record a conversation dataset carries (data/chat.py CHAT_KEYS): the end of the assistant's turn,
    where sampling stops, found by rendering the first prompt with an answer of one of its own characters."""
    first = next((c for c in turns[-1]["content"] if not c.isspace()), "a")
    try:
        end_of_turn = marked_end_of_turn(template, tok, turns + [{"role": "assistant", "content": first}])
    except ChatTemplateError as e:
        raise template_failure(e, name, f"the prompt {where} with an answer") from None
    if end_of_turn is None:
        raise InputError(f"{template_label(name)} renders no token of an answer to the prompt {where}, so where an "
                         f"answer ends is unknown; fix: correct the template, or pass another --chat_template FILE")
    return {"template": name, "chat_template": template.source, "special_tokens": template.special_tokens,
            "context": context, "end_of_turn_id": end_of_turn,
            "end_of_turn": tok.decode([end_of_turn])}


if __name__ == "__main__":
    from common.checks import not_a_command

    not_a_command("data.prepare_prompts", "python -m data.prepare --format prompts")
