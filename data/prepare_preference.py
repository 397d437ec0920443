"""Preference pairs into a dataset for DPO: `python -m data.prepare --format preference`.

    python -m data.prepare --format preference --input pairs.jsonl --tokenizer PATH/tokenizer.json --context 1024

Each pair of the JSONL inputs (data/preference.py: standard text, conversational, implicit prompt; one format a
file, and text or conversations, not both, in one dataset) is tokenized as TRL's DPOTrainer tokenizes it, so a
model trained here and one trained by TRL see the same ids:

- standard: the tokenizer's end-of-text is appended to each answer that does not end with it (where the tokenizer
  has one); prompt = encode(prompt), chosen = encode(prompt + chosen), rejected likewise;
- conversational and implicit prompt: prompt = encode(render(prompt turns, add_generation_prompt)), chosen =
  encode(render(prompt turns + chosen turns)), rejected likewise, with the template --format chat would use
  (data/prepare_chat.py's chat_template(); no {% generation %} marks are needed).

The prompt ends where its ids stop being a prefix of both sequences (TRL's common_prefix_length: a template may
render the prompt alone differently, or tokens merge across the boundary). Each pair is written as two documents
in one split, chosen then rejected (document 2k is pair k's chosen, 2k + 1 its rejected), with its loss mask
beside (train.mask, val.mask): 0 on the prompt, 1 on every token after it, TRL's completion mask.

A sequence longer than --context + 1 tokens (what a training window holds) is fitted (--overlong truncate): the
prompt loses tokens from its start, the same in both, down to one; then the answers are cut at their ends. With
--overlong drop the pair is left out. A pair left with no answer token in a sequence is left out. A pair goes to
val when the hash of its prompt does, so all pairs of one prompt share a split; val may be empty, train may not.
"""
import json
import os

from data.chat import ChatError
from data.chat_template import ChatTemplateError
from data.jsonl_job import built_tokenizer, jsonl_files, jsonl_job
from data.out_dir import check_val_fraction, done_job, finish_dataset, in_val, job_workspace
from data.preference import read_pairs
from data.prepare_chat import (
    load_template,
    marked_end_of_turn,
    template_failure,
    template_label,
    template_settings,
)
from data.readers import InputError
from data.tokenizers import HFTokenizer, parse_spec
from data.writer import ShardWriter, token_dtype

STANDARD = "standard"


def prepare_preference(inputs: list[str], out_dir: str, tokenizer_spec="char", template_spec: str | None = None,
                       context: int = 1024, overlong: str = "truncate", val_fraction: float = 0.01,
                       force: bool = False) -> dict:
    """Write the preference dataset of `inputs` to out_dir unless it is already there; returns its meta."""
    if context < 1:
        raise InputError(f"--context {context}: must be >= 1; fix: pass the model's block_size")
    check_val_fraction(val_fraction, empty_val=True)
    files = jsonl_files(inputs, "preference pairs")
    tokenizer_kind = parse_spec(tokenizer_spec)
    ready = tokenizer_kind[1] if tokenizer_kind[0] == "ready" else None
    pairs, lines, formats = _read(files)
    standard = STANDARD in formats.values()
    name = source = template = None
    if not standard:
        name, source, template = load_template(template_spec, tokenizer_spec, ready)
    elif template_spec is not None:
        raise InputError(f"--chat_template {template_spec}: {files[0]} holds standard text pairs, which are "
                         f"tokenized as they are, with no template; fix: leave --chat_template out")
    job = jsonl_job("preference", files, tokenizer_spec, ready, source, context, overlong, val_fraction,
                    *template_settings(template))
    meta = done_job(out_dir, job, force, "these preference pairs")
    if meta is not None:
        return meta

    texts = [_texts(pair, template, name, where) for pair, where in zip(pairs, lines)]
    tok = built_tokenizer(tokenizer_kind, [t for three in texts for t in three])
    eos = tok.decode([tok.eot_id]) if standard and tok.eot_id is not None else None
    record = {}
    if template is not None:  # before any writing: a template that fails here ends the preparation at once
        record["chat"] = _chat_record(template, name, tok, pairs[0], lines[0], tokenizer_spec, context)
    workspace = job_workspace(out_dir, job)
    prefix = os.path.join(workspace, "shards", "preference")
    encoded = (_tokenized(three, eos, tok, standard, where, tokenizer_spec) for three, where in zip(texts, lines))
    counts = _write(prefix, token_dtype(tok.vocab_size), pairs, encoded, context, overlong, val_fraction)
    _check_train(counts, len(pairs), context, overlong, val_fraction)
    print(f"{len(pairs):,} preference pairs: {counts['truncated']:,} cut to {context + 1:,} tokens, "
          f"{counts['dropped_overlong']:,} left out as longer (--overlong {overlong}), "
          f"{counts['dropped_unsupervised']:,} left out with no answer token within the context; "
          f"{counts['train_pairs']:,} train and {counts['val_pairs']:,} val pairs")
    record["preference"] = {"formats": formats, "template": name, "chat_template": source, "context": context,
                            "overlong": overlong, "pairs": len(pairs), **counts, "eos_appended": eos is not None}
    return finish_dataset(out_dir, workspace, [prefix], tok, job, files,
                          f"pairs by prompt hash, val_fraction {val_fraction}", None, record, empty_val=True)


def _write(prefix: str, dtype, pairs: list, encoded, context: int, overlong: str, val_fraction: float) -> dict:
    """Each pair's two documents (`encoded`: the chosen ids, the rejected ids, the prompt's length), fitted to the
    context, into the shards at `prefix`; the counts of meta.json's preference record."""
    writer = ShardWriter(prefix, dtype, masks=True)
    counts = {"truncated": 0, "dropped_overlong": 0, "dropped_unsupervised": 0, "train_pairs": 0, "val_pairs": 0}
    for pair, (chosen, rejected, prompt_len) in zip(pairs, encoded):
        if max(len(chosen), len(rejected)) > context + 1:
            if overlong == "drop":
                counts["dropped_overlong"] += 1
                continue
            chosen, rejected, prompt_len = fit(chosen, rejected, prompt_len, context + 1)
            counts["truncated"] += 1
        if max(prompt_len, 1) >= min(len(chosen), len(rejected)):  # the first token is never a target
            counts["dropped_unsupervised"] += 1
            continue
        split = "val" if in_val(_prompt_key(pair.prompt), val_fraction) else "train"
        writer.write(split, [chosen, rejected], [_mask(chosen, prompt_len), _mask(rejected, prompt_len)])
        counts[f"{split}_pairs"] += 1
    writer.close()
    return counts


def _read(files: list[str]) -> tuple[list, list[str], dict]:
    """The pairs of every file, where each was read ("file:line"), and each file's format; text pairs and
    conversations in one dataset are refused (its chat record, the template, holds for conversations only)."""
    pairs, lines, formats = [], [], {}
    for path in files:
        try:
            for line, kind, pair in read_pairs(path):
                formats.setdefault(path, kind)
                pairs.append(pair)
                lines.append(f"{path}:{line}")
        except ChatError as e:
            raise InputError(f"{e}; fix the record or leave it out") from None
        first_path, first = next(iter(formats.items()), (path, None))
        if path in formats and (formats[path] == STANDARD) != (first == STANDARD):
            raise InputError(f"{path} holds {formats[path]} pairs, {first_path} {first} pairs: one dataset holds "
                             f"text pairs or conversations, not both; fix: prepare them as two datasets")
    if not pairs:
        raise InputError(f"no preference pair in {', '.join(files)}: the inputs are empty")
    return pairs, lines, formats


def _texts(pair, template, name: str | None, where: str) -> tuple[str, str, str]:
    """The prompt's text and each whole sequence's, before end-of-text is appended to standard answers."""
    if template is None:
        return pair.prompt, pair.prompt + pair.chosen, pair.prompt + pair.rejected
    try:
        return (template.render(pair.prompt, add_generation_prompt=True)[0],
                template.render(pair.prompt + pair.chosen)[0], template.render(pair.prompt + pair.rejected)[0])
    except ChatTemplateError as e:
        raise template_failure(e, name, f"the pair {where}") from None


def _tokenized(texts: tuple[str, str, str], eos: str | None, tok, standard: bool, where: str,
               tokenizer_spec) -> tuple[list, list, int]:
    """TRL's ids of a pair (read at `where`): the chosen and rejected sequences and the length of the prompt they
    share."""
    prompt, chosen, rejected = texts
    if eos is not None:  # TRL's add_eos, which it applies to text answers only
        chosen, rejected = (t if t.endswith(eos) else t + eos for t in (chosen, rejected))
    encode = text_encoder(tok) if standard else (lambda text: tok.encode_with_offsets(text)[0])
    try:
        prompt_ids, chosen_ids, rejected_ids = (encode(t) for t in (prompt, chosen, rejected))
    except ValueError as e:  # a character outside a given character vocabulary
        raise _untokenizable(e, where, tokenizer_spec) from None
    return chosen_ids, rejected_ids, min(common_prefix_length(prompt_ids, chosen_ids),
                                         common_prefix_length(prompt_ids, rejected_ids))


def text_encoder(tok):
    """How TRL encodes text, transformers' tokenizer(text): a tokenizer.json's own special tokens (its
    post-processor's, a Llama's BOS) are added; a rendered template (apply_chat_template) adds none."""
    if isinstance(tok, HFTokenizer):
        return lambda text: tok.tokenizer.encode(text).ids
    return lambda text: tok.encode_with_offsets(text)[0]  # special tokens written out become theirs


def common_prefix_length(ids: list[int], other: list[int]) -> int:
    """How many first ids the two share (TRL's common_prefix_length)."""
    length = 0
    for a, b in zip(ids, other):
        if a != b:
            break
        length += 1
    return length


def fit(chosen: list[int], rejected: list[int], prompt_len: int, limit: int) -> tuple[list, list, int]:
    """The pair within `limit` tokens a sequence: the prompt's first tokens dropped from both (one kept), then
    each sequence cut at its end. The prompt stays one in both."""
    excess = max(len(chosen), len(rejected)) - limit
    cut = max(min(excess, prompt_len - 1), 0)
    return chosen[cut:][:limit], rejected[cut:][:limit], prompt_len - cut


def _mask(ids: list[int], prompt_len: int) -> list[int]:
    return [0] * prompt_len + [1] * (len(ids) - prompt_len)


def _prompt_key(prompt) -> str:
    """The text a pair's split is drawn from: its prompt, as text (turns as JSON: no template changes the split)."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False, sort_keys=True)


def _check_train(counts: dict, pairs: int, context: int, overlong: str, val_fraction: float) -> None:
    """A dataset trains only with a pair in its train split; val may be empty."""
    if counts["train_pairs"]:
        return
    if not counts["val_pairs"]:
        fix = "pass the model's block_size as --context" + (", or --overlong truncate" if overlong == "drop" else "")
        raise InputError(f"none of the {pairs:,} preference pairs keeps an answer token within --context {context} "
                         f"(--overlong {overlong}); fix: {fix}")
    raise InputError(f"none of the {pairs:,} preference pairs fell in the train split (pairs by prompt hash, "
                     f"val_fraction {val_fraction}); fix: pass a smaller --val_fraction, or pairs of more prompts")


def _chat_record(template, name: str, tok, pair, where: str, tokenizer_spec, context: int) -> dict:
    """What export and serving read of a conversation dataset (data/chat.py CHAT_KEYS), and the template's name."""
    try:
        end_of_turn = _end_of_turn(template, tok, pair)
    except ChatTemplateError as e:  # prompt + the first chosen turn alone is a conversation not rendered before
        raise template_failure(e, name, f"the pair {where}") from None
    except ValueError as e:
        raise _untokenizable(e, where, tokenizer_spec) from None
    if end_of_turn is None:
        raise InputError(f"{template_label(name)} renders no token of the chosen answer of {where}; fix: correct "
                         f"the template, or pass another --chat_template FILE")
    return {"template": name, "chat_template": template.source, "special_tokens": template.special_tokens,
            "context": context, "end_of_turn_id": end_of_turn,
            "end_of_turn": tok.decode([end_of_turn])}


def _end_of_turn(template, tok, pair) -> int | None:
    """The token that ends the first chosen assistant turn, where generation stops (marked_end_of_turn)."""
    return marked_end_of_turn(template, tok, pair.prompt + pair.chosen[:1])


def _untokenizable(e: ValueError, where: str, tokenizer_spec) -> InputError:
    return InputError(f"{where}: the pair does not encode with --tokenizer {tokenizer_spec} ({e}); fix: leave the "
                      f"record out, or write it in the tokenizer's characters")


if __name__ == "__main__":
    from common.checks import not_a_command

    not_a_command("data.prepare_preference", "python -m data.prepare --format preference")
