"""A prepared dataset's meta.json as its readers take it (the loader, export, sampling): read from its folder, or
from the copy an export carries, and checked to be of the format this version reads. data/out_dir.py writes it."""
import os

from common.checks import ConfigError, existing_dir, json_file
from data.out_dir import FORMAT


def read_meta(data_dir: str, what: str, fix: str) -> dict:
    """The meta.json of the prepared dataset in data_dir, checked (check_meta); `what` names the folder."""
    existing_dir(data_dir, what, fix)
    path = os.path.join(data_dir, "meta.json")
    return check_meta(json_file(path, "dataset meta", fix), f"dataset meta {path}", fix)


def check_meta(meta: dict, where: str, fix: str) -> dict:
    """A dataset's meta (its meta.json, or the copy an export carries) of a format this version reads, holding
    what its readers need: the tokenizer, the vocabulary size and, for characters, the characters."""
    if not isinstance(meta, dict):
        raise ConfigError(f"{where} is not a JSON object; fix: {fix}")
    version = meta.get("format", 1)  # format 1, the first, wrote no "format"
    if version != FORMAT:
        raise ConfigError(f"{where} is of format {version!r}, this version reads format {FORMAT} only (written by "
                          f"another version of data.prepare); fix: {fix}")
    needed = ("tokenizer", "vocab_size") + (("chars",) if meta.get("tokenizer") == "char" else ())
    missing = [key for key in needed if key not in meta]
    if missing:
        raise ConfigError(f"{where} lacks {', '.join(missing)} (written by another version of data.prepare, or "
                          f"another tool); fix: {fix}")
    return meta


def drawn_vocabulary(model_vocab: int, meta: dict) -> int:
    """The ids generation draws from: the model's vocabulary less any embedding rows past its tokenizer's ids (a
    Hugging Face Qwen's 151,936 rows for 151,669 ids), which no text decodes from."""
    return min(model_vocab, meta["vocab_size"])


def answer_ends(meta: dict, end: int | None) -> tuple:
    """The ids that end an answer: `end` (the end of turn or of text; None for none) and those the model's generation
    config names beside it (meta's "stop_ids": a Hugging Face folder's generation_config.json eos_token_id, such as
    Llama 3.1's <|eom_id|> and <|end_of_text|> beside its <|eot_id|>)."""
    return tuple(dict.fromkeys(i for i in (end, *meta.get("stop_ids", ())) if i is not None))
