"""`python -m data.prepare --format chat`: conversations into tokens and loss masks (data/prepare_chat.py). The
masks written are transformers' assistant masks; the three record formats give one dataset; overlong
conversations are cut or left out and counted; bad records end the preparation with their file and line."""
import sys

import pytest

from chats import CHATML, CONVERSATIONS, chatml_folder, documents, write_jsonl
from data.prepare_chat import prepare_chat
from data.readers import InputError
from harness import run

# Short conversations enough for both splits at val_fraction 0.3.
FILLER = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"answer {i}"}] for i in range(12)]


def all_documents(out_dir) -> list:
    return sorted(documents(out_dir, "train") + documents(out_dir, "val"))


@pytest.fixture(scope="module")
def chatml_tokenizer(tmp_path_factory, shakespeare_path):
    return chatml_folder(tmp_path_factory.mktemp("chatml"), shakespeare_path)


def test_the_written_masks_are_transformers_assistant_masks(tmp_path, chatml_tokenizer):
    from transformers import PreTrainedTokenizerFast

    inputs = write_jsonl(tmp_path / "chats.jsonl", [{"messages": turns} for turns in CONVERSATIONS * 4])
    meta = prepare_chat([inputs], str(tmp_path / "out"), str(chatml_tokenizer / "tokenizer.json"),
                        val_fraction=0.3)
    reference = PreTrainedTokenizerFast(tokenizer_file=str(chatml_tokenizer / "tokenizer.json"))
    reference.chat_template = CHATML
    expected = sorted(
        (out["input_ids"], out["assistant_masks"]) for out in
        (reference.apply_chat_template(turns, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
         for turns in CONVERSATIONS * 4))
    assert all_documents(tmp_path / "out") == expected
    assert meta["chat"]["template"].endswith("tokenizer_config.json")
    assert meta["chat"]["formats"] == {inputs: "messages"}
    assert meta["chat"]["train_supervised_tokens"] + meta["chat"]["val_supervised_tokens"] == \
        sum(sum(mask[1:]) for _, mask in expected)


def test_the_three_formats_prepare_one_dataset(tmp_path):
    pairs = [("Sort: 3 1 2", "1 2 3"), ("Reverse: a b", "b a"), ("Echo: hi", "hi")]
    records = {
        "messages": [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
                     for q, a in pairs],
        "sharegpt": [{"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]} for q, a in pairs],
        "alpaca": [{"instruction": q, "input": "", "output": a} for q, a in pairs],
    }
    prepared = {}
    for kind, rows in records.items():
        meta = prepare_chat([write_jsonl(tmp_path / f"{kind}.jsonl", rows)], str(tmp_path / kind), "char",
                            val_fraction=0.3)
        assert list(meta["chat"]["formats"].values()) == [kind]
        prepared[kind] = all_documents(tmp_path / kind)
    assert prepared["messages"] == prepared["sharegpt"] == prepared["alpaca"]


@pytest.mark.parametrize("overlong, kept, counts", [("truncate", 13, {"truncated": 1, "dropped_overlong": 0}),
                                                    ("drop", 12, {"truncated": 0, "dropped_overlong": 1})])
def test_overlong_conversations_are_cut_or_left_out_and_counted(tmp_path, overlong, kept, counts):
    turns = [*FILLER, [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a very long answer " * 5}]]
    inputs = write_jsonl(tmp_path / "c.jsonl", [{"messages": t} for t in turns])
    meta = prepare_chat([inputs], str(tmp_path / "out"), "char", context=40, overlong=overlong, val_fraction=0.3)
    assert {k: meta["chat"][k] for k in counts} == counts
    lengths = [len(tokens) for tokens, _ in all_documents(tmp_path / "out")]
    assert len(lengths) == kept and max(lengths) <= 41


def test_a_conversation_cut_before_its_answer_is_left_out(tmp_path):
    turns = [[{"role": "user", "content": "a long question " * 5}, {"role": "assistant", "content": "yes"}], *FILLER]
    inputs = write_jsonl(tmp_path / "c.jsonl", [{"messages": t} for t in turns])
    meta = prepare_chat([inputs], str(tmp_path / "out"), "char", context=30, val_fraction=0.3)
    assert meta["chat"]["dropped_unsupervised"] == 1 and len(all_documents(tmp_path / "out")) == 12


def test_a_bad_record_ends_the_preparation_with_its_file_and_line(tmp_path):
    inputs = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATIONS[0]}, {"messages": [
        {"role": "user", "content": "hi"}]}])
    proc = run([sys.executable, "-m", "data.prepare", "--format", "chat", "--input", inputs, "--out_dir",
                str(tmp_path / "out")], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"error: {inputs}:2: the conversation has no assistant turn" in proc.stderr
    assert not (tmp_path / "out" / "meta.json").exists()


def test_mixed_formats_in_one_file_and_templates_without_marks_are_refused(tmp_path, chatml_tokenizer):
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [{"messages": CONVERSATIONS[0]},
                                                   {"instruction": "q", "output": "a"}])
    with pytest.raises(InputError, match=r"mixed.jsonl:2: a alpaca record in a file of messages records"):
        prepare_chat([mixed], str(tmp_path / "a"), "char")
    unmarked = tmp_path / "unmarked.jinja"
    unmarked.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    good = write_jsonl(tmp_path / "good.jsonl", [{"messages": CONVERSATIONS[0]}])
    with pytest.raises(InputError, match=r"marks no assistant part"):
        prepare_chat([good], str(tmp_path / "b"), "char", str(unmarked))
