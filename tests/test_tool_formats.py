"""The formats `tool_choice` auto reads calls in, as a model's chat template writes them (serving/tools.py): Hermes'
and Qwen's <tool_call> blocks, Llama 3's JSON answers, Mistral's [TOOL_CALLS]. Each template is recognized by what
the published ones hold; each format's calls read from an answer (its text before them the content, none where they
do not read); templates are given a call's arguments as an object (transformers' convention, which Llama 3's,
Qwen's and Mistral's templates follow) and render as transformers renders them; Mistral's call ids are the 9
characters its templates demand. Through the server: a Llama 3 and a Mistral layout's calls read whole and streamed,
and the calls a reply gives sent back with their results render into the next prompt (an agent's loop)."""
import json
import re

import httpx
import pytest

from data.chat import BUILTIN_TEMPLATES, chat_prompt, request_turns
from data.chat_template import ChatTemplate
from data.tokenizers import EOT, CharTokenizer, train_bpe
from servers import BAD, streamed_calls
from serving.call_formats import call_format
from serving.errors import APIError
from serving.text import TextStream
from serving.tools import CallStream, read_tools
from test_chat import as_transformers
from test_text_stream import streamed

# Llama 3.1's layout on the plain one: tools in the system turn with its instruction, a call the assistant's whole
# turn, a tool's result a turn of the ipython role.
LLAMA3 = (
    "{% if tools %}System: Environment: ipython\nRespond in the format {\"name\": function name, \"parameters\": "
    "dictionary of argument name and its value}.\n{% for t in tools %}{{ t | tojson(indent=4) }}\n{% endfor %}"
    "{% endif %}{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}Assistant: {% generation %}{% if message.get('tool_calls') %}"
    "{% set call = message['tool_calls'][0]['function'] %}{\"name\": \"{{ call['name'] }}\", \"parameters\": "
    "{{ call['arguments'] | tojson }}}{% else %}{{ message['content'] }}{% endif %}" + EOT + "{% endgeneration %}\n"
    "{% elif message['role'] == 'tool' %}Ipython: {{ {'output': message['content']} | tojson }}\n"
    "{% else %}{{ message['role'] | capitalize }}: {{ message['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}Assistant: {% endif %}")
# Mistral's v3 layout: tools listed before the turns, calls a JSON array after [TOOL_CALLS] with their ids, which
# must be 9 characters, results in [TOOL_RESULTS].
MISTRAL = (
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{% generation %}"
    "{% if message.get('tool_calls') %}[TOOL_CALLS][{% for call in message['tool_calls'] %}"
    "{% if call['id'] | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with length "
    "9!') }}{% endif %}{{ {'name': call['function']['name'], 'arguments': call['function']['arguments'], "
    "'id': call['id']} | tojson }}{% if not loop.last %}, {% endif %}{% endfor %}]"
    "{% else %}{{ message['content'] }}{% endif %}" + EOT + "{% endgeneration %}"
    "{% elif message['role'] == 'tool' %}[TOOL_RESULTS]{{ {'content': message['content'], "
    "'call_id': message['tool_call_id']} | tojson }}[/TOOL_RESULTS]"
    "{% else %}[INST]{{ message['content'] }}[/INST]{% endif %}{% endfor %}")
QWEN = "{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>\n{\"name\": <function-name>}\n</tool_call>"
TEMPLATES = {"hermes": BUILTIN_TEMPLATES["hermes"], "qwen": QWEN, "llama3_json": LLAMA3, "mistral": MISTRAL}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city", "days"], "properties": {
        "city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
ROME = {"city": "Rome", "days": 3}


def auto(template: str):
    return read_tools({"tools": [WEATHER]}, template)


@pytest.mark.parametrize("template,name", [("hermes", "hermes"), ("qwen", "hermes"), ("llama3_json", "llama3_json"),
                                           ("mistral", "mistral")])
def test_each_template_is_read_in_the_format_it_writes_calls_in(template, name):
    assert call_format(TEMPLATES[template]).name == name


def test_auto_needs_a_template_that_writes_calls_in_a_format_read_here():
    template = BUILTIN_TEMPLATES["plain"]
    assert call_format(template) is None
    with pytest.raises(APIError, match=re.escape(
            "tool_choice auto reads the calls a model writes, and this model's chat template writes them in none of "
            "the formats read here (Hermes' and Qwen's <tool_call> blocks, Mistral's [TOOL_CALLS], Llama 3's JSON); "
            "fix: ask for tool_choice required or a named function")):
        auto(template).check_format()
    read_tools({"tools": [WEATHER], "tool_choice": "required"}, template).check_format()
    assert read_tools({"messages": []}, template) is None
    assert any("does not render tools" in message for _, _, message in BAD)  # one that reads no tools: a 400


def calls(template: str, text: str) -> list[tuple]:
    return [(c.name, json.loads(c.arguments)) for c in auto(TEMPLATES[template]).calls(text)]


def test_llama3_calls_are_the_whole_answer_one_or_more_objects():
    for text in ('{"name": "get_weather", "parameters": {"city": "Rome", "days": 3}}',
                 ' \n<|python_tag|>{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}'):
        assert calls("llama3_json", text) == [("get_weather", ROME)]
    two = '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}'
    assert calls("llama3_json", two) == [("a", {}), ("b", {"x": 1})]
    for text in ('It is {"name": "a", "parameters": {}}', '{"name": "a", "parameters": {}} and more', '{"name": "a"',
                 '{"city": "Rome"}', '{"name": 3, "parameters": {}}'):
        assert calls("llama3_json", text) == [], text  # not a call: the whole answer is content


def test_mistral_calls_follow_their_mark_as_an_array_or_one_by_one():
    array = 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}, ' \
            '{"name": "b", "arguments": {}}]'
    assert calls("mistral", array) == [("get_weather", ROME), ("b", {})]
    assert calls("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome", "days": 3}[TOOL_CALLS]b[ARGS]{}') == [
        ("get_weather", ROME), ("b", {})]  # v11 tokenizers' layout
    for text in ("It is sunny.", "[TOOL_CALLS][{not json", "[TOOL_CALLS]get_weather"):
        assert calls("mistral", text) == [], text
    ids = [c["id"] for c in CallStream(auto(MISTRAL)).whole(array)[0]]
    assert all(len(i) == 9 and i.isalnum() for i in ids) and ids[0] != ids[1]
    assert CallStream(auto(LLAMA3)).whole('{"name": "a", "parameters": {}}')[0][0]["id"].startswith("call_")


GROWN = [  # (template, tool_choice, an answer): its calls grown character by character
    ("hermes", "auto", 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}</tool_call>'
                       '<tool_call>{"arguments": {"x": [1, "]"]}, "name": "b"}</tool_call>'),
    ("llama3_json", "auto", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome", "days": 3}}; '
                            '{"name": "b", "parameters": {"x": -1.5e3}}'),
    ("mistral", "auto", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}, '
                        '{"name": "b", "arguments": {"x": "a\\"b"}}]'),
    ("mistral", "auto", '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome", "days": 3}[TOOL_CALLS]b[ARGS]{"x": null}'),
    ("hermes", "required", '[{"name": "get_weather", "parameters": {"city": "Rome", "days": 3}}, '
                           '{"name": "b", "parameters": {"x": true}}]'),
    ("hermes", {"type": "function", "function": {"name": "get_weather"}}, '{"city": "Rome", "days": 3}')]


@pytest.mark.parametrize("template,choice,text", GROWN, ids=["hermes", "llama3", "mistral", "mistral-v11", "required",
                                                             "named"])
def test_calls_go_out_in_pieces_as_they_are_written_and_add_up_to_the_whole_calls(template, choice, text):
    """OpenAI's stream of calls: a call's first piece has its index, id, type and name (sent once the name is
    written whole, calls in order), later ones its arguments' new text; put together they are the whole calls."""
    tools = read_tools({"tools": [WEATHER, {"type": "function", "function": {"name": "b"}}], "tool_choice": choice},
                       TEMPLATES[template])
    stream, pieces = CallStream(tools), []
    for n in range(1, len(text) + 1):
        pieces += stream.pieces(text[:n])
    calls, rest = stream.whole(text)
    assert len(calls) == (1 if isinstance(choice, dict) else 2) and len(pieces + rest) > 2 * len(calls)
    put = {}
    for piece in pieces + rest:
        if piece["index"] not in put:
            assert piece["index"] == len(put) and set(piece) == {"index", "id", "type", "function"}
            put[piece["index"]] = [piece["id"], piece["function"]["name"], ""]
        else:
            assert set(piece) == {"index", "function"} and set(piece["function"]) == {"arguments"}
        put[piece["index"]][2] += piece["function"]["arguments"]
    assert [tuple(put[k]) for k in sorted(put)] == [(c["id"], c["function"]["name"], c["function"]["arguments"])
                                                    for c in calls]
    assert json.loads(calls[0]["function"]["arguments"]) == ROME


def test_a_call_goes_out_once_its_name_is_written_and_one_that_does_not_read_is_no_call():
    stream = CallStream(auto(LLAMA3))
    assert stream.pieces('{"name": "get_wea') == [] and stream.pieces('{"arguments": {"city": "R') == []
    (piece,) = stream.pieces('{"name": "get_weather", "parameters": {"city": "R\ufffd')  # a character incomplete
    assert piece["function"] == {"name": "get_weather", "arguments": '{"city": "R'}
    assert stream.whole('{"name": "get_weather", "parameters": {"city": "R"} and more') == ([], [])


def test_llama3s_marks_end_the_content_only_where_the_answer_begins_with_one():
    marks = auto(LLAMA3).reading().marks

    def led(text: str) -> tuple[str, bool]:
        return streamed(text, [], leading=marks, tokenizer=CharTokenizer.from_text(text))
    assert led('  {"name": "a"}') == ("", True)  # nothing sent: the whitespace is no content either
    assert led('<|python_tag|>{"name"') == ("", True)
    assert led("It is {cold}") == ("It is {cold}", False)
    assert led("<|pyt") == ("<|pyt", False)  # held while it may begin the tag, sent at the end
    tokenizer = CharTokenizer.from_text(" It{")
    stream = TextStream(tokenizer, [], 0, marks)
    assert [stream.add(t)[0] for t in tokenizer.encode(" It{")] == ["", " I", "t", "{"]


@pytest.mark.parametrize("template", ["hermes", "llama3_json", "mistral"])
def test_history_renders_as_transformers_renders_it_with_the_arguments_an_object(template):
    from transformers import PreTrainedTokenizerFast

    call = {"id": "AbC123xyZ", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(ROME)}}
    messages = [{"role": "user", "content": "Weather in Rome?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "AbC123xyZ", "content": "18 degrees"}]
    text, _ = ChatTemplate(TEMPLATES[template]).render(request_turns(messages), True, [WEATHER])
    reference = PreTrainedTokenizerFast(tokenizer_object=train_bpe(["a b c"], 300).tokenizer)
    reference.chat_template = TEMPLATES[template]
    assert text == reference.apply_chat_template(as_transformers(messages), tools=[WEATHER], tokenize=False,
                                                 add_generation_prompt=True)
    assert '"parameters": {"city": "Rome", "days": 3}' in text if template == "llama3_json" else \
        '"arguments": {"city": "Rome", "days": 3}' in text  # an object, not a string of one


def test_mistrals_template_refusing_ids_it_did_not_make_is_a_refusal_of_the_messages():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(ROME)}}
    history = [{"role": "user", "content": "Weather in Rome?"},
               {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]
    tokenizer = train_bpe(["a b c"], 300)
    meta = {"chat": {"chat_template": MISTRAL, "context": 64, "end_of_turn_id": tokenizer.eot_id,
                     "end_of_turn": EOT}}
    with pytest.raises(ValueError) as refused:
        chat_prompt(request_turns(history), meta, tokenizer, "the chat", "use /v1/completions", [WEATHER])
    assert str(refused.value) == (
        "the chat: the model's chat template (meta.json chat.chat_template) fails at line 1 on the messages "
        "(raise_exception: Tool call IDs should be alphanumeric strings with length 9!); fix: send messages it takes")


# Through the server: a random model over a byte-level BPE made to write each format's calls (structured outputs).
WRITTEN = {"llama3_json": ('{"name": "get_weather", "parameters": {"city": "Rome", "days": 3}}', None),
           "mistral": ('Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}]',
                       "Sure. ")}
ASK = [{"role": "user", "content": "What is the weather in Rome?"}]


@pytest.fixture(scope="module", params=sorted(WRITTEN))
def server(request, tmp_path_factory):
    from servers import Server, template_export

    served = Server(template_export(tmp_path_factory.mktemp(request.param), TEMPLATES[request.param], 1024))
    served.format = request.param
    yield served
    code, output = served.stop()
    assert code == 0 and "Traceback" not in output, output


@pytest.mark.launch
def test_the_calls_a_model_writes_are_read_whole_and_streamed_and_go_round_an_agents_loop(server):
    text, content = WRITTEN[server.format]
    options = {"model": "export", "messages": ASK, "tools": [WEATHER], "max_tokens": 150, "temperature": 0,
               "extra_body": {"structured_outputs": {"regex": re.escape(text)}}}
    client = server.client()
    choice = client.chat.completions.create(**options).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == content
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", ROME)
    chunks = list(client.chat.completions.create(**options, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (content or "")
    ((name, arguments, pieces),) = streamed_calls(chunks)
    assert (name, arguments) == ("get_weather", call.function.arguments) and pieces > 3  # written piece by piece
    history = [*ASK, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "18 degrees"}]
    ids = httpx.post(f"{server.url}/tokenize", json={"model": "export", "messages": history, "tools": [WEATHER]},
                     timeout=30).json()["tokens"]
    prompt = httpx.post(f"{server.url}/detokenize", json={"model": "export", "tokens": ids}, timeout=30).json()
    assert "18 degrees" in prompt["prompt"] and ('"city": "Rome", "days": 3}' in prompt["prompt"])
    answer = client.chat.completions.create(model="export", messages=history, tools=[WEATHER], max_tokens=5)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
