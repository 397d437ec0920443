"""Prompts for online RL as users have them (TRL's GRPO datasets): JSONL records with a "prompt", text or OpenAI
messages (a conversation's turns up to the assistant's answer), and whatever else the reward reads beside it (an
"answer" to match, a test to run), kept whole and handed to the reward with each completion.

    {"prompt": [{"role": "user", "content": "Reverse: king crown night"}], "answer": "night crown king"}
    {"prompt": "Q: 2 + 2 =", "answer": "4"}

One format a file (text or messages). A record that is not an object, has no prompt, or a prompt that is empty
or ends with the assistant's turn is refused with the file and line.
"""
from data.chat import ChatError, json_kind, prompt_turns, read_records

TEXT, MESSAGES = "text", "messages"


def prompt_record(record) -> tuple[str, str | list[dict], dict]:
    """(format, the prompt's text or turns, the record) of one record, checked."""
    if not isinstance(record, dict):
        raise ChatError(f"a record must be a JSON object, not {json_kind(record)}")
    if "prompt" not in record:
        raise ChatError(f"no \"prompt\" in it (found keys {sorted(record)}): a record holds the prompt, text or "
                        f"messages, and what the reward reads beside it")
    prompt = record["prompt"]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ChatError("the prompt is empty")
        return TEXT, prompt, record
    turns = prompt_turns(prompt, "prompt")
    if turns[-1]["role"] == "assistant":
        raise ChatError("the prompt ends with the assistant's turn: a prompt stops where the answer to sample begins")
    return MESSAGES, turns, record


def read_prompts(path: str):
    """(line number, format, prompt, record) of each record of a JSONL file, one format a file; ChatError names
    the file and line."""
    first = None
    for number, (kind, prompt, record) in read_records(path, prompt_record):
        first = first or kind
        if kind != first:
            raise ChatError(f"{path}:{number}: a prompt of {kind} in a file of prompts of {first}: keep one format a "
                            f"file")
        yield number, kind, prompt, record
