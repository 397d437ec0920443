"""Preference pairs read as users write them (data/preference.py): the standard, conversational and
implicit-prompt records, the implicit prompt split where TRL splits it, and every bad record refused with its file
and line."""
import json

import pytest

from data.chat import ChatError
from data.preference import Pair, read_pairs

USER = {"role": "user", "content": "Reverse: king crown"}
SYSTEM = {"role": "system", "content": "Answer briefly."}
RIGHT = {"role": "assistant", "content": "crown king"}
WRONG = {"role": "assistant", "content": "king crown"}


def pairs_of(tmp_path, *records) -> list:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return list(read_pairs(str(path)))


def test_each_format_reads_into_its_pair(tmp_path):
    standard = pairs_of(tmp_path, {"prompt": "Reverse: a b\n", "chosen": "b a", "rejected": "a b"}, "",
                        {"prompt": "Reverse: c d\n", "chosen": "d c", "rejected": "c d", "score": 3})
    assert standard == [(1, "standard", Pair("Reverse: a b\n", "b a", "a b")),
                        (3, "standard", Pair("Reverse: c d\n", "d c", "c d"))]
    conversational = pairs_of(tmp_path, {"prompt": [SYSTEM, USER], "chosen": [RIGHT], "rejected": [
        {"role": "assistant", "content": [{"type": "text", "text": "king "}, {"type": "text", "text": "crown"}]}]})
    assert conversational == [(1, "conversational", Pair([SYSTEM, USER], [RIGHT], [WRONG]))]


def test_an_implicit_prompt_is_the_turns_both_conversations_share(tmp_path):
    follow_up = [{"role": "user", "content": "Again"}]
    read = pairs_of(tmp_path, {"chosen": [SYSTEM, USER, RIGHT, *follow_up, RIGHT], "rejected": [SYSTEM, USER, WRONG]},
                    {"chosen": [USER, RIGHT, *follow_up, RIGHT], "rejected": [USER, RIGHT, *follow_up, WRONG]})
    assert [kind for _, kind, _ in read] == ["implicit prompt"] * 2
    assert read[0][2] == Pair([SYSTEM, USER], [RIGHT, *follow_up, RIGHT], [WRONG])
    assert read[1][2] == Pair([USER, RIGHT, *follow_up], [RIGHT], [WRONG])


BAD = [  # (record as a JSONL line, the message after "FILE:LINE: ")
    ("[1, 2]", "a record must be a JSON object, not a list ([1, 2])"),
    ('{"prompt": "p", "chosen": "a"}', "no preference pair in it: expected \"chosen\" and \"rejected\""),
    ('{"chosen": "a", "rejected": "b"}', "a pair of text answers needs its \"prompt\""),
    ('{"prompt": "p", "chosen": "a", "rejected": 3}', "\"rejected\" must be a string, as \"chosen\" is, not a number"),
    ('{"prompt": "p", "chosen": " ", "rejected": "b"}', "the chosen answer is empty"),
    ('{"prompt": "p", "chosen": "same", "rejected": "same"}', "the chosen and rejected answers are equal: nothing "
                                                              "to prefer"),
    (json.dumps({"prompt": [USER], "chosen": [USER], "rejected": [WRONG]}),
     "chosen[0] is a turn of 'user': an answer starts with the assistant's turn"),
    (json.dumps({"prompt": [USER], "chosen": [RIGHT], "rejected": [{"role": "assistant", "content": ""}]}),
     "rejected[0], an assistant turn of the rejected answer, is empty"),
    (json.dumps({"prompt": [USER], "chosen": [RIGHT], "rejected": [{"role": "robot", "content": "x"}]}),
     "rejected[0] has the unknown role 'robot'"),
    (json.dumps({"prompt": [], "chosen": [RIGHT], "rejected": [WRONG]}), "\"prompt\" must be a non-empty list"),
    (json.dumps({"prompt": [USER], "chosen": [RIGHT], "rejected": [RIGHT]}), "the chosen and rejected answers are "
                                                                               "equal"),
    (json.dumps({"chosen": [USER, RIGHT], "rejected": [SYSTEM, USER, WRONG]}), "the chosen and rejected "
                                                                                "conversations share no first turn"),
    (json.dumps({"chosen": [USER, RIGHT], "rejected": [USER, RIGHT, USER, WRONG]}), "the chosen conversation ends "
                                                                                    "where the rejected one goes on"),
    (json.dumps({"chosen": [USER, RIGHT, USER, RIGHT], "rejected": [USER, RIGHT, SYSTEM, WRONG]}),
     "chosen[2] is a turn of 'user': an answer starts with the assistant's turn"),
    ("{not json", "not JSON (Expecting property name enclosed in double quotes)"),
]


@pytest.mark.parametrize("line, message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_a_bad_record_is_refused_with_its_file_and_line(tmp_path, line, message):
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"}) + "\n" + line + "\n")
    with pytest.raises(ChatError) as refused:
        list(read_pairs(str(path)))
    assert str(refused.value).startswith(f"{path}:2: {message}"), refused.value


def test_one_format_a_file_and_bytes_that_are_not_utf8(tmp_path):
    with pytest.raises(ChatError, match=r"pairs.jsonl:2: a conversational pair in a file of standard pairs: keep "
                                        r"one format a file"):
        pairs_of(tmp_path, {"prompt": "p", "chosen": "a", "rejected": "b"},
                 {"prompt": [USER], "chosen": [RIGHT], "rejected": [WRONG]})
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "caf\xe9", "chosen": "a", "rejected": "b"}\n')
    with pytest.raises(ChatError, match=r"latin1.jsonl:1: not UTF-8 text \(byte 0xe9 at column 16\)"):
        list(read_pairs(str(path)))
