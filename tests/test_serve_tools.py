"""Tool calling through the server and the official `openai` client, on a random model over a byte-level BPE whose chat
template (the built-in hermes) renders tools and writes calls as Hermes' <tool_call> blocks: a named function's
answer is a call of it with arguments of its schema; `required`'s one or more calls of the tools given; `auto` reads
the calls the model writes (made to write them here through structured outputs) whole and streamed, its text before
them the content; earlier calls and tool results render into the prompt; each mistake is a 400 naming it. The
Responses API's function tools, function_call items out (whole and in its stream's events) and in (with
function_call_output items) are the same calls."""
import json
import re

import httpx
import openai
import pytest

from data.tokenizers import EOT
from servers import Server, chat_model_export, streamed_calls
from serving.responses import chat_body

pytestmark = pytest.mark.launch  # a server process
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city", "days"], "properties": {
            "city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["zone"], "properties": {
        "zone": {"type": "string", "maxLength": 6}}}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    served = Server(chat_model_export(tmp_path_factory.mktemp("tools"), block_size=1024, tokenizer="bpe:300",
                                      template="hermes"))
    yield served
    code, output = served.stop()
    assert code == 0 and "Traceback" not in output, output


def ask(server, **options):
    options = {"messages": ASK, "max_tokens": 150, **options}
    return server.client().chat.completions.create(model="export", tools=TOOLS, **options)


def valid(name: str, arguments: str) -> bool:
    """A call's arguments are of its tool's schema."""
    arguments = json.loads(arguments)
    if name == "get_weather":
        return set(arguments) == {"city", "days"} and arguments["city"] in ("Paris", "Rome") and \
            type(arguments["days"]) is int and 1 <= arguments["days"] <= 7
    return name == "get_time" and set(arguments) == {"zone"} and len(arguments["zone"]) <= 6


def test_a_named_function_is_called_with_arguments_of_its_schema(server):
    reply = ask(server, temperature=1, seed=1, n=3, tool_choice={"type": "function", "function": {"name": "get_time"}})
    for choice in reply.choices:
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_time" and valid(call.function.name, call.function.arguments)
        assert call.id.startswith("call_")
        assert choice.message.content is None and choice.finish_reason == "stop"  # OpenAI's for a forced call


def test_required_calls_one_or_more_of_the_tools(server):
    names = set()
    for seed in range(4):
        choice = ask(server, temperature=1, seed=seed, tool_choice="required", max_tokens=450).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        assert all(valid(call.function.name, call.function.arguments) for call in choice.message.tool_calls)
        names |= {call.function.name for call in choice.message.tool_calls}
    assert names == {"get_weather", "get_time"}  # the seeds choose either


CALL = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}</tool_call>'


def test_auto_reads_the_calls_the_model_writes_whole_and_streamed(server):
    written = {"structured_outputs": {"regex": re.escape(CALL)}}  # the model made to write a call
    choice = ask(server, temperature=0, extra_body=written).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure. "
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Rome", "days": 3}
    chunks = list(ask(server, temperature=0, extra_body=written, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Sure. "
    ((name, arguments, pieces),) = streamed_calls(chunks)
    assert (name, arguments) == ("get_weather", call.function.arguments) and pieces > 3  # written piece by piece
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    for text in ("It is sunny.", "Sure. <tool_call>{not json</tool_call>"):  # no call, or none that reads
        plain = ask(server, temperature=0, extra_body={"structured_outputs": {"regex": re.escape(text)}}).choices[0]
        assert plain.message.content == text and not plain.message.tool_calls and plain.finish_reason == "stop"


def test_parallel_tool_calls_false_gives_one_call_at_most(server):
    """OpenAI's parallel_tool_calls: false: auto keeps the first of the calls written (vLLM's rule), required's
    grammar admits one call."""
    twice = CALL + CALL.removeprefix("Sure. ")
    written = {"structured_outputs": {"regex": re.escape(twice)}}
    assert len(ask(server, temperature=0, extra_body=written, max_tokens=300).choices[0].message.tool_calls) == 2
    (call,) = ask(server, temperature=0, extra_body=written, max_tokens=300,
                  parallel_tool_calls=False).choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Rome", "days": 3}
    for seed in range(3):
        choice = ask(server, temperature=1, seed=seed, tool_choice="required", parallel_tool_calls=False,
                     max_tokens=450, extra_body={"return_token_ids": True}).choices[0]
        assert len(choice.message.tool_calls) == 1 and choice.finish_reason == "tool_calls", choice
        written = httpx.post(f"{server.url}/detokenize", json={"model": "export", "tokens": choice.token_ids},
                             timeout=30).json()["prompt"]
        assert len(json.loads(written)) == 1  # the model wrote one call: no tokens spent on calls dropped


def test_earlier_calls_and_their_results_render_into_the_prompt(server):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 1})}}
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]
    asked = {"model": "export", "messages": history, "tools": TOOLS}
    ids = httpx.post(f"{server.url}/tokenize", json=asked, timeout=30).json()["tokens"]
    prompt = httpx.post(f"{server.url}/detokenize", json={"model": "export", "tokens": ids},
                        timeout=30).json()["prompt"]
    assert prompt.startswith("System: you may call these tools") and '"name": "get_time"' in prompt
    assert prompt.endswith('Assistant: <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}'
                           '</tool_call>' + EOT + 'Tool: 18 degrees\nAssistant: ')  # trim_blocks: no newline
    assert ask(server, messages=history, temperature=0, tool_choice="none").choices[0].message.tool_calls is None


@pytest.mark.parametrize("options,message", [
    ({"tool_choice": {"type": "function", "function": {"name": "get_news"}}},
     "tool_choice must name one of the tools: get_weather, get_time"),
    ({"tool_choice": "always"}, "tool_choice must be none, auto, required or"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice required sets the answer's format: a response format cannot be given beside it"),
    ({"messages": [{"role": "tool", "content": "18 degrees"}]}, "messages[0] is a tool turn without its tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]},
     "messages[0].tool_calls[0] must be")])
def test_each_mistake_is_a_400_naming_it(server, options, message):
    with pytest.raises(openai.BadRequestError) as caught:
        ask(server, **options)
    assert caught.value.body["message"].startswith(message), caught.value.body


def test_a_stop_string_inside_a_token_cuts_the_answer_there_with_tools_and_without(server):
    """A byte-level BPE's token can hold the text before a stop string and the stop string's start both: the text
    before it comes with the answer's last delta."""
    def text_of(ids):
        return httpx.post(f"{server.url}/detokenize", json={"model": "export", "tokens": ids}, timeout=30
                          ).json()["prompt"]

    sampled = {"model": "export", "messages": ASK, "max_tokens": 60, "temperature": 1, "seed": 5}  # the same tokens
    for tools in ({}, {"tools": TOOLS}):  # tools: auto, whose calls no answer here writes
        free = server.client().chat.completions.create(**sampled, **tools, extra_body={"return_token_ids": True})
        content, ids = free.choices[0].message.content, free.choices[0].token_ids
        for i, token in enumerate(ids):
            piece, before = text_of([token]), text_of(ids[:i])
            if len(piece) >= 3 and piece.isascii() and piece.isprintable() and \
                    content.find(piece[1:]) == len(before) + 1:  # the stop string first seen inside this token
                stop, expected = piece[1:], content[:len(before) + 1]
                break
        else:
            raise AssertionError(f"no token of {ids} holds text before a stop string")
        for stream in (False, True):
            reply = server.client().chat.completions.create(**sampled, **tools, stop=[stop], stream=stream)
            text = "".join(c.choices[0].delta.content or "" for c in reply if c.choices) if stream else \
                reply.choices[0].message.content
            assert text == expected, (tools, stream)


FLAT = [{"type": "function", **tool["function"]} for tool in TOOLS]  # the Responses API's shape of the tools


def test_the_responses_api_calls_tools_as_function_call_items_whole_and_streamed(server):
    client = server.client()
    named = client.responses.create(model="export", input=ASK[0]["content"], tools=FLAT, temperature=1,
                                    tool_choice={"type": "function", "name": "get_time"}, max_output_tokens=150,
                                    extra_body={"seed": 3})
    (item,) = named.output
    assert item.type == "function_call" and item.name == "get_time" and named.status == "completed"
    assert valid(item.name, item.arguments)
    written = {"structured_outputs": {"regex": re.escape(CALL)}, "seed": 1}
    whole = client.responses.create(model="export", input=ASK[0]["content"], tools=FLAT, temperature=0,
                                    max_output_tokens=150, extra_body=written)
    assert [o.type for o in whole.output] == ["message", "function_call"] and whole.output_text == "Sure. "
    assert (whole.output[1].name, json.loads(whole.output[1].arguments)) == ("get_weather", {"city": "Rome", "days": 3})
    events = list(client.responses.create(model="export", input=ASK[0]["content"], tools=FLAT, temperature=0,
                                          max_output_tokens=150, extra_body=written, stream=True))
    kinds = [e.type for e in events]
    deltas, pieces = kinds.count("response.output_text.delta"), kinds.count("response.function_call_arguments.delta")
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", *["response.function_call_arguments.delta"] * pieces,
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert pieces > 3  # the arguments as the model writes them
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == \
        events[-1].response.output[1].arguments == whole.output[1].arguments
    done = [e.item.id for e in events if e.type == "response.output_item.done"]
    assert done == [item.id for item in events[-1].response.output]  # the items are the response's own
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_the_responses_apis_function_call_items_are_the_chat_turns_of_tool_use(server):
    call = {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 1})}
    items = [*ASK, {"type": "function_call", "call_id": "call_1", **call},
             {"type": "function_call_output", "call_id": "call_1", "output": "18 degrees"}]
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": call}]}, {"role": "tool", "tool_call_id": "call_1",
                                                                     "content": "18 degrees"}]
    read = chat_body({"input": items, "tools": FLAT, "tool_choice": {"type": "function", "name": "get_time"}})
    assert read["messages"] == messages and read["tools"] == TOOLS
    assert read["tool_choice"] == {"type": "function", "function": {"name": "get_time"}}
    sampled = {"model": "export", "temperature": 1, "tool_choice": "none"}
    answer = server.client().responses.create(input=items, tools=FLAT, max_output_tokens=40, **sampled,
                                              extra_body={"seed": 4}).output_text
    assert answer == server.client().chat.completions.create(messages=messages, tools=TOOLS, max_tokens=40, seed=4,
                                                             **sampled).choices[0].message.content
