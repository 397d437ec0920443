"""Preference pairs as users have them: a prompt, the answer preferred (chosen) and the one not (rejected), read
from JSONL and checked, one format a file, the three that Hugging Face's preference sets and TRL use:

- standard: {"prompt": "...", "chosen": "...", "rejected": "..."}, plain text;
- conversational: {"prompt": [messages], "chosen": [messages], "rejected": [messages]}, the answers the
  assistant's turn(s) after the prompt's;
- implicit prompt: {"chosen": [messages], "rejected": [messages]}, whole conversations whose shared first turns
  are the prompt (UltraFeedback binarized, Anthropic HH), split where the two first differ, as TRL splits them.

Messages are read as data/chat.py reads a conversation's (roles, text parts). A pair whose answers are equal or
empty, or whose fields are missing or of the wrong kind, is refused with the file and line.
"""
from dataclasses import dataclass

from data.chat import ChatError, json_kind, prompt_turns, read_records

ANSWERS = ("chosen", "rejected")


@dataclass(frozen=True)
class Pair:
    """One preference: text (standard) or turns (conversational), the prompt's and each answer's."""
    prompt: str | list[dict]
    chosen: str | list[dict]
    rejected: str | list[dict]


def preference_pair(record) -> tuple[str, Pair]:
    """(format, Pair) of one record, checked."""
    if not isinstance(record, dict):
        raise ChatError(f"a record must be a JSON object, not {json_kind(record)}")
    missing = [key for key in ANSWERS if key not in record]
    if missing:
        raise ChatError(f"no preference pair in it: expected \"chosen\" and \"rejected\" (and a \"prompt\" unless "
                        f"they are whole conversations), found keys {sorted(record)}")
    if isinstance(record["chosen"], str):
        kind, pair = "standard", _standard(record)
    elif "prompt" in record:
        kind, pair = "conversational", Pair(prompt_turns(record["prompt"], "prompt"),
                                            *(_answer(prompt_turns(record[key], key), key) for key in ANSWERS))
    else:
        kind, pair = "implicit prompt", _split(prompt_turns(record["chosen"], "chosen"),
                                               prompt_turns(record["rejected"], "rejected"))
    if pair.chosen == pair.rejected:
        raise ChatError("the chosen and rejected answers are equal: nothing to prefer")
    return kind, pair


def _standard(record: dict) -> Pair:
    if "prompt" not in record:
        raise ChatError("a pair of text answers needs its \"prompt\"")
    for key in ("prompt", "chosen", "rejected"):
        if not isinstance(record[key], str):
            raise ChatError(f"\"{key}\" must be a string, as \"chosen\" is, not {json_kind(record[key])}")
    for key in ANSWERS:
        if not record[key].strip():
            raise ChatError(f"the {key} answer is empty")
    return Pair(record["prompt"], record["chosen"], record["rejected"])


def _answer(turns: list[dict], key: str, first: int = 0) -> list[dict]:
    """The turns of an answer, record[key][first:]: the assistant's first, no assistant turn empty."""
    if not turns:
        other = "rejected" if key == "chosen" else "chosen"
        raise ChatError(f"the {key} conversation ends where the {other} one goes on: it holds no answer of its own")
    if turns[0]["role"] != "assistant":
        raise ChatError(f"{key}[{first}] is a turn of {turns[0]['role']!r}: an answer starts with the assistant's "
                        f"turn")
    for i, turn in enumerate(turns, first):
        if turn["role"] == "assistant" and not turn["content"].strip():
            raise ChatError(f"{key}[{i}], an assistant turn of the {key} answer, is empty")
    return turns


def _split(chosen: list[dict], rejected: list[dict]) -> Pair:
    """The shared first turns as the prompt, the rest as each answer."""
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == 0:
        raise ChatError("the chosen and rejected conversations share no first turn to be their prompt: give "
                        "a \"prompt\" field, or whole conversations that begin alike")
    return Pair(chosen[:shared], _answer(chosen[shared:], "chosen", shared),
                _answer(rejected[shared:], "rejected", shared))


def read_pairs(path: str):
    """(line number, format, Pair) of each record of a JSONL file, one format a file; ChatError names the file
    and line."""
    first = None
    for number, (kind, pair) in read_records(path, preference_pair):
        first = first or kind
        if kind != first:
            raise ChatError(f"{path}:{number}: a {kind} pair in a file of {first} pairs: keep one format a file")
        yield number, kind, pair
