"""What the preparers of JSONL records (conversations: data/prepare_chat.py, preference pairs:
data/prepare_preference.py, prompts: data/prepare_prompts.py) do alike around their own records: take the inputs,
name the job by what makes the dataset, and build a char or bpe tokenizer from the rendered texts."""
import hashlib
import json
import os

from data.readers import InputError, expand_inputs
from data.tokenizers import EOT, CharTokenizer, train_bpe


def jsonl_files(inputs: list[str], what: str) -> list[str]:
    """The files of `inputs`, each a .jsonl file of `what` (the records, for the message)."""
    files = expand_inputs(inputs)
    not_jsonl = [f for f in files if not f.endswith(".jsonl")]
    if not_jsonl:
        raise InputError(f"input {not_jsonl[0]} is not a .jsonl file: {what} are read from JSONL records")
    return files


def jsonl_job(kind: str, files: list[str], tokenizer_spec, ready, *settings) -> str:
    """What the dataset is made of: its kind, its inputs (path, size, mtime), the tokenizer (`ready`, parse_spec's
    ready one, by its fingerprint: a folder's tokenizer may change in place) and every setting that changes it."""
    stats = [(p, os.path.getsize(p), os.stat(p).st_mtime_ns) for p in files]
    fingerprint = ready.fingerprint() if ready is not None else None
    return hashlib.sha256(json.dumps([kind, stats, str(tokenizer_spec), fingerprint, *settings]).encode()).hexdigest()


def built_tokenizer(parsed: tuple, texts: list[str]):
    """The tokenizer of --tokenizer (parse_spec's reading); char and bpe:SIZE are built from the rendered texts."""
    kind, ready = parsed
    if kind == "ready":
        return ready
    if kind == "char":
        return CharTokenizer(sorted(set("".join(t.replace(EOT, "") for t in texts))), eot=True)
    return train_bpe(texts, ready)
