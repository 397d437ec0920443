"""Conversations (data/chat.py): the three record formats, rendering through a chat template, and the loss mask,
which must equal transformers' assistant mask; bad records named with their file and line."""
import json

import pytest

from chats import CHATML, CONVERSATIONS, chatml_bpe
from corpora import byte_level_encoding
from data.chat import BUILTIN_TEMPLATES, ChatError, ChatTemplate, conversation, read_conversations, tokenize
from data.tokenizers import EOT, CharTokenizer, HFTokenizer, TiktokenTokenizer

# No separator between a user turn and the answer: a token can straddle the answer's first character (transformers
# counts it as the assistant's).
TIGHT = ("{% for message in messages %}"
         "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}"
         "{% else %}{{ message['content'] }}{% endif %}{% endfor %}")


@pytest.fixture(scope="module")
def bpe(shakespeare_path):
    return chatml_bpe(shakespeare_path)


@pytest.mark.parametrize("train_on", ["all", "last"])
@pytest.mark.parametrize("turns", CONVERSATIONS, ids=["one-turn", "multi-turn", "spaces"])
def test_the_mask_is_transformers_assistant_mask(bpe, turns, train_on):
    from transformers import PreTrainedTokenizerFast

    reference = PreTrainedTokenizerFast(tokenizer_object=bpe)
    reference.chat_template = CHATML
    expected = reference.apply_chat_template(turns, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = tokenize(turns, ChatTemplate(CHATML), HFTokenizer(bpe, "bpe"), train_on)
    assert ids == expected["input_ids"]
    if train_on == "all":
        assert mask == expected["assistant_masks"]
        assert reference.decode([i for i, m in zip(ids, mask) if m]) == \
            "".join(t["content"] + "<|im_end|>" for t in turns if t["role"] == "assistant")
    else:  # the last assistant turn's part of transformers' mask
        last = reference.decode([i for i, m in zip(ids, mask) if m])
        assert last == turns[-1]["content"] + "<|im_end|>"
        assert all(m <= e for m, e in zip(mask, expected["assistant_masks"]))


def test_a_token_straddling_the_answers_start_is_supervised_as_transformers_does(bpe):
    from transformers import PreTrainedTokenizerFast

    reference = PreTrainedTokenizerFast(tokenizer_object=bpe)
    reference.chat_template = TIGHT
    turns = [{"role": "user", "content": "I love t"}, {"role": "assistant", "content": "hee"}]
    expected = reference.apply_chat_template(turns, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = tokenize(turns, ChatTemplate(TIGHT), HFTokenizer(bpe, "bpe"))
    assert (ids, mask) == (expected["input_ids"], expected["assistant_masks"])
    assert reference.decode([i for i, m in zip(ids, mask) if m]) == " thee<|im_end|>"  # " thee" straddles


@pytest.mark.parametrize("make", ["char", "tiktoken"])
def test_the_builtin_template_supervises_the_answers_and_their_end_of_text(make):
    turns = CONVERSATIONS[1]
    if make == "char":
        text = "".join(t["content"] for t in turns) + "ASUYasuy:!\n"
        tokenizer = CharTokenizer.from_text(text, eot=True)
    else:
        tokenizer = TiktokenTokenizer(byte_level_encoding())
    ids, mask = tokenize(turns, ChatTemplate(BUILTIN_TEMPLATES["plain"]), tokenizer)
    assert ids.count(tokenizer.eot_id) == 2  # the written-out end-of-text is the token, not its characters
    supervised = [i for i, m in zip(ids, mask) if m]
    assert tokenizer.decode(supervised) == "For grief — ay, é, and more." + EOT + "Anon." + EOT
    assert tokenizer.decode(ids).startswith("System: Answer in verse.\nUser: Why weep'st thou?\nAssistant: For")


def test_the_three_formats_are_one_conversation():
    messages = {"messages": [{"role": "user", "content": "Sort: 3 1 2"}, {"role": "assistant", "content": "1 2 3"}]}
    sharegpt = {"conversations": [{"from": "human", "value": "Sort: 3 1 2"}, {"from": "gpt", "value": "1 2 3"}]}
    alpaca = {"instruction": "Sort:", "input": "3 1 2", "output": "1 2 3"}
    kinds = [conversation(r) for r in (messages, sharegpt, alpaca)]
    assert [k for k, _ in kinds] == ["messages", "sharegpt", "alpaca"]
    assert kinds[0][1] == kinds[1][1]
    assert kinds[2][1] == [{"role": "user", "content": "Sort:\n\n3 1 2"}, {"role": "assistant", "content": "1 2 3"}]
    assert conversation({"instruction": "Sort: 3 1 2", "input": "", "output": "1 2 3"})[1] == kinds[0][1]


@pytest.mark.parametrize("line, message", [
    ("{not json", "not JSON"),
    ('{"text": "plain"}', "no conversation in it"),
    ('{"messages": [{"role": "wizard", "content": "hi"}]}', "messages[0] has the unknown role 'wizard'"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]}',
     "an assistant turn is empty"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "the conversation has no assistant turn"),
    ('{"conversations": []}', "\"conversations\" must be a non-empty list"),
    ('[1, 2]', "a record must be a JSON object"),
], ids=["not-json", "no-messages", "unknown-role", "empty-answer", "no-assistant", "empty-list", "not-an-object"])
def test_a_bad_record_is_named_with_its_file_and_line(tmp_path, line, message):
    path = tmp_path / "chats.jsonl"
    good = json.dumps({"messages": CONVERSATIONS[0]})
    path.write_text(f"{good}\n\n{good}\n{line}\n")
    with pytest.raises(ChatError) as e:
        list(read_conversations(str(path)))
    assert str(e.value).startswith(f"{path}:4: {message}")


def test_train_on_everything_supervises_every_token(bpe):
    ids, mask = tokenize(CONVERSATIONS[1], ChatTemplate(CHATML), HFTokenizer(bpe, "bpe"), "everything")
    assert mask == [1] * len(ids) and len(ids) > 20
