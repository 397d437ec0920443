"""Conversations (data/chat.py): the three record formats, rendering through a chat template, and the loss mask,
which must equal transformers' assistant mask; bad records named with their file and line."""
import json
import re

import pytest

from chats import CHATML, CONVERSATIONS, chatml_bpe
from corpora import byte_level_encoding
from data.chat import (
    BUILTIN_TEMPLATES,
    ChatError,
    conversation,
    read_conversations,
    tokenize,
)
from data.chat_template import ChatTemplate, ChatTemplateError
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


PART = '{"type": "text", "text": "..."}'


# (a record's line, the error's start: "$" ends it)
@pytest.mark.parametrize("line, message", [
    ("{not json", "not JSON"),
    ('{"text": "plain"}', "no conversation in it"),
    ('{"messages": [{"role": "wizard", "content": "hi"}]}', "messages[0] has the unknown role 'wizard'"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]}',
     "an assistant turn is empty"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "the conversation has no assistant turn"),
    ('{"conversations": []}', "\"conversations\" must be a non-empty list"),
    ('[1, 2]', "a record must be a JSON object"),
    ('{"messages": [{"role": ["user"], "content": "hi"}]}', "messages[0] has the unknown role ['user']"),
    ('{"messages": [{"role": "user", "content": 42}, {"role": "assistant", "content": "a"}]}',
     f"messages[0].content must be a string or a list of text parts {PART}, not a number (42)$"),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": null}]}',
     f"messages[1].content is null: a turn's content must be a string or a list of text parts {PART}$"),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": null, "tool_calls": []}]}',
     "messages[1].content is null, a turn of tool_calls: tool calls are not trained on$"),
    ('{"messages": [{"role": "user", "content": {"text": "q"}}, {"role": "assistant", "content": "a"}]}',
     f'messages[0].content must be a string or a list of text parts {PART}, not an object ({{"text": "q"}})$'),
    ('{"messages": [{"role": "user", "content": [{"type": "text", "text": "q"}, {"type": "image_url", "image_url": '
     '{"url": "x.png"}}]}, {"role": "assistant", "content": "a"}]}',
     f"messages[0].content[1] is a part of type 'image_url': only text parts {PART} are trained on$"),
    ('{"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}, {"role": "assistant", '
     '"content": "a"}]}', "messages[0].content[0] is a part of type 'input_audio'"),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [{"text": "a"}]}]}',
     "messages[1].content[0] is a part of type None"),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [{"type": "text", "text": 1}]}'
     ']}',
     "messages[1].content[0].text must be a string, not a number (1)$"),
    ('{"conversations": [{"from": "human", "value": ["q"]}, {"from": "gpt", "value": "a"}]}',
     f'conversations[0].value[0] must be a text part {PART}, not a string ("q")$'),
    ('{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": null}]}',
     "conversations[1].value is null"),
    ('{"instruction": "q", "output": 3}', '"output" must be a string, not a number (3)$'),
    ('{"instruction": ["q"], "input": "", "output": "a"}', '"instruction" must be a string, not a list (["q"])$'),
    ('{"instruction": "q", "input": false, "output": "a"}', '"input" must be a string, not a boolean (false)$'),
    ("[" * 100_000, "JSON nested too deeply to read$"),
], ids=["not-json", "no-messages", "unknown-role", "empty-answer", "no-assistant", "empty-list", "not-an-object",
        "role-list", "content-number", "content-null", "tool-calls", "content-object", "image-part", "audio-part",
        "untyped-part", "text-number", "sharegpt-strings", "sharegpt-null", "alpaca-output", "alpaca-instruction",
        "alpaca-input", "deep"])
def test_a_bad_record_is_named_with_its_file_and_line(tmp_path, line, message):
    path = tmp_path / "chats.jsonl"
    good = json.dumps({"messages": CONVERSATIONS[0]})
    path.write_text(f"{good}\n\n{good}\n{line}\n")
    with pytest.raises(ChatError) as e:
        list(read_conversations(str(path)))
    expected = f"{path}:4: {message.removesuffix('$')}"
    assert str(e.value) == expected if message.endswith("$") else str(e.value).startswith(expected)


def test_a_line_that_is_not_utf8_is_named_with_its_file_and_line(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_bytes(json.dumps({"messages": CONVERSATIONS[0]}).encode() + b"\n" + "{\"é\": 1}\n".encode("latin-1"))
    with pytest.raises(ChatError) as e:
        list(read_conversations(str(path)))
    assert str(e.value) == f"{path}:2: not UTF-8 text (byte 0xe9 at column 3)"


def test_text_parts_are_concatenated_into_the_turns_content():
    """OpenAI's content parts, in messages and in ShareGPT: the texts joined as they are; null is no input."""
    parts = [{"type": "text", "text": "Sort: "}, {"type": "text", "text": "3 1 2\n"}, {"type": "text", "text": ""}]
    answer = [{"type": "text", "text": "1 2 3"}]
    messages = {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": answer}]}
    sharegpt = {"conversations": [{"from": "human", "value": parts}, {"from": "gpt", "value": answer}]}
    turns = [{"role": "user", "content": "Sort: 3 1 2\n"}, {"role": "assistant", "content": "1 2 3"}]
    assert conversation(messages) == ("messages", turns) and conversation(sharegpt) == ("sharegpt", turns)
    assert conversation({"instruction": "Sort: 3 1 2\n", "input": None, "output": "1 2 3"})[1] == turns
    with pytest.raises(ChatError, match="an assistant turn is empty"):
        conversation({"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": []}]})


TURNS = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
LOOP = "{% for m in messages %}\n{% generation %}{{ m.content }}{% endgeneration %}\n"


@pytest.mark.parametrize("source, line, problem", [
    (LOOP + "{{ foo() }}{% endfor %}", 3, "UndefinedError: 'foo' is undefined"),
    (LOOP + "\n{{ settings.bos }}{% endfor %}", 4, "UndefinedError: 'settings' is undefined"),
    (LOOP + "{{ m.content | format(1) }}{% endfor %}", 3,
     "TypeError: not all arguments converted during string formatting"),
    (LOOP + "{% if m.role == 'user' %}\n{{ raise_exception('Only\\nassistants') }}{% endif %}{% endfor %}", 4,
     "raise_exception: Only assistants"),
    ("{% for m in messages %}{% generation %}\n\n{{ m.content.missing.deeper }}{% endgeneration %}{% endfor %}", 3,
     "UndefinedError: 'str object' has no attribute 'missing'"),
    ("{% macro turn(m) %}\n{{ m.nope() }}\n{% endmacro %}\n{% for m in messages %}{{ turn(m) }}{% endfor %}", 2,
     "UndefinedError: 'dict object' has no attribute 'nope'"),
], ids=["undefined-call", "undefined-attribute", "filter", "raise-exception", "in-generation", "in-macro"])
def test_a_template_that_fails_as_it_renders_names_its_line(source, line, problem):
    """The template's line of the innermost template frame of Jinja's traceback, and Jinja's message on one line."""
    with pytest.raises(ChatTemplateError) as e:
        ChatTemplate(source).render(TURNS)
    assert (e.value.line, e.value.problem, e.value.syntax) == (line, problem, False)
    assert e.value.refused == problem.startswith("raise_exception")
    assert e.value.describe("T", "C") == f"T fails at line {line} on C ({problem})"


@pytest.mark.parametrize("source, line, problem", [
    ("{% for m in messages %}\n\n{{ m.content }\n{% endfor %}", 3, "unexpected '}'"),
    ("{% for m in messages %}\n{{ m.content | shout }}{% endfor %}", 2, "No filter named 'shout'."),
    ("{% for m in messages %}\n{% generation %}{{ m.content }}", 2, "Unexpected end of template. Jinja was looking for "
     "the following tags: 'endgeneration'. The innermost block that needs to be closed is 'generation'."),
], ids=["syntax", "unknown-filter", "unclosed"])
def test_a_template_that_is_not_jinja_names_its_line(source, line, problem):
    with pytest.raises(ChatTemplateError) as e:
        ChatTemplate(source)
    assert (e.value.line, e.value.problem, e.value.syntax) == (line, problem, True)
    assert e.value.describe("T", "C") == f"T is not valid Jinja at line {line} ({problem})"


def test_train_on_everything_supervises_every_token(bpe):
    ids, mask = tokenize(CONVERSATIONS[1], ChatTemplate(CHATML), HFTokenizer(bpe, "bpe"), "everything")
    assert mask == [1] * len(ids) and len(ids) > 20


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Verona"}'}}
TOOL_USE = [{"role": "user", "content": "Is it raining in Verona?"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "rain, 9 degrees"},
            {"role": "assistant", "content": "It rains in Verona, good my lord."}]


def as_transformers(turns: list[dict]) -> list[dict]:
    """OpenAI's turns as transformers' templates take them (and vLLM gives them): a call's arguments an object."""
    def call(c):
        return {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
    return [{**t, "tool_calls": [call(c) for c in t["tool_calls"]]} if t.get("tool_calls") else t for t in turns]


def test_tool_use_renders_and_masks_as_transformers_does_with_the_hermes_template(bpe):
    """A record of tools and tool use (OpenAI's fine-tuning format): its turns read, the tools listed, the call and the
    answer supervised, transformers' ids and assistant mask."""
    from transformers import PreTrainedTokenizerFast

    record = {"messages": TOOL_USE, "tools": [WEATHER]}
    kind, turns = conversation(record)
    assert turns[1] == {"role": "assistant", "content": "", "tool_calls": as_transformers(TOOL_USE)[1]["tool_calls"]}
    assert turns[2] == {"role": "tool", "content": "rain, 9 degrees", "tool_call_id": "call_1"}
    template = BUILTIN_TEMPLATES["hermes"]
    reference = PreTrainedTokenizerFast(tokenizer_object=bpe)
    reference.chat_template = template
    expected = reference.apply_chat_template(as_transformers(TOOL_USE), tools=[WEATHER], tokenize=True,
                                             return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = tokenize(turns, ChatTemplate(template), HFTokenizer(bpe, "bpe"), "all", [WEATHER])
    assert (ids, mask) == (expected["input_ids"], expected["assistant_masks"])
    assert reference.decode([i for i, m in zip(ids, mask) if m]) == (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Verona"}}</tool_call>' + EOT +
        " It rains in Verona, good my lord." + EOT)  # " It": a token that straddles the answer's start
    text = reference.decode(ids)
    assert text.startswith("System: you may call these tools") and json.dumps(WEATHER["function"]) in text
    assert "Tool: rain, 9 degrees\n" in text


@pytest.mark.parametrize("record,message", [
    ({"messages": TOOL_USE, "tools": [{"type": "function"}]}, '"tools" must be a list of'),
    ({"messages": TOOL_USE, "tools": ["get_weather"]}, '"tools" must be a list of'),
    ({"messages": [TOOL_USE[0], {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]}]},
     "messages[1].tool_calls[0] must be"),
    ({"messages": [*TOOL_USE[:2], {"role": "tool", "content": "rain"}]}, "messages[2] is a tool turn without its "
                                                                          "tool_call_id")])
def test_a_malformed_tool_use_record_is_refused_naming_it(tmp_path, record, message):
    path = tmp_path / "tools.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(ChatError, match=re.escape(f"{path}:1: {message}")):
        list(read_conversations(str(path)))


THINKING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] TRIM}}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not "
            "enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")  # Qwen 3's switch


@pytest.mark.parametrize("trim", ["", "| trim "], ids=["kept", "trimmed"])
def test_a_templates_own_variables_and_a_continued_last_turn_render_as_transformers_renders_them(bpe, trim):
    """chat_template_kwargs' variables (Qwen 3's enable_thinking) reach the template; continue_final_message ends
    the text where the last turn's content does, its trailing space too where the template keeps it."""
    from transformers import PreTrainedTokenizerFast

    template = THINKING.replace("TRIM", trim)
    reference = PreTrainedTokenizerFast(tokenizer_object=bpe)
    reference.chat_template = template
    asked = [{"role": "user", "content": "Speak, good my lord."}]
    for thinking in (True, False):
        text, _ = ChatTemplate(template).render(asked, True, None, {"enable_thinking": thinking})
        assert text == reference.apply_chat_template(asked, add_generation_prompt=True, enable_thinking=thinking,
                                                     tokenize=False)
    assert ("<think>" in text) and "<think>" not in ChatTemplate(template).render(asked, True)[0]
    begun = [*asked, {"role": "assistant", "content": "I will, "}]
    text, _ = ChatTemplate(template).render(begun, False, None, None, continue_final=True)
    assert text == reference.apply_chat_template(begun, continue_final_message=True, tokenize=False)
    assert text.endswith("I will," if trim else "I will, ")
