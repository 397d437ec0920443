"""OpenAI's Responses API (POST /v1/responses) driven by the official `openai` client: the answer, its usage and its
status are chat completions' for the same conversation (a string input, instructions as the system turn, a list of
messages of text parts); the stream's events come in the API's order, numbered, their deltas adding up to the
answer; a length limit makes the response incomplete; its sampling options and text.format reach the sampler; what
this server cannot do is a 400 naming it."""
import json

import httpx
import openai
import pytest

from servers import MESSAGE, Server, chat, chat_model_export

pytestmark = pytest.mark.launch  # a server process (python -m pytest -m "not launch" skips it)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    served = Server(chat_model_export(tmp_path_factory.mktemp("responses"), block_size=256, system="Reverse words."))
    yield served
    code, output = served.stop()
    assert code == 0 and "Traceback" not in output, output


def respond(server, temperature: float = 0, **options):
    return server.client().responses.create(model="export", temperature=temperature, **options)


def test_an_answer_is_chat_completions_for_the_same_conversation(server):
    for max_tokens in (40, 5):
        asked = chat(server, max_tokens=max_tokens)
        got = respond(server, input=MESSAGE, max_output_tokens=max_tokens)
        assert got.output_text == asked.choices[0].message.content
        assert (got.usage.input_tokens, got.usage.output_tokens) == (asked.usage.prompt_tokens,
                                                                    asked.usage.completion_tokens)
        finished = asked.choices[0].finish_reason == "stop"
        assert got.status == ("completed" if finished else "incomplete") and got.output[0].role == "assistant"
        assert (got.incomplete_details is None) is finished
    assert not finished and got.incomplete_details.reason == "max_output_tokens"  # 5 tokens cut the answer


def test_instructions_and_a_list_of_messages_are_the_chat_turns(server):
    turns = [{"role": "user", "content": "Reverse: king crown"}, {"role": "assistant", "content": "crown king"},
             {"role": "user", "content": MESSAGE}]
    expected = server.client().chat.completions.create(
        model="export", temperature=0, max_tokens=30, messages=[{"role": "system", "content": "Reverse words."},
                                                                *turns]).choices[0].message.content
    parts = [{"role": t["role"], "content": [{"type": "input_text" if t["role"] == "user" else "output_text",
                                               "text": t["content"]}]} for t in turns]
    got = respond(server, instructions="Reverse words.", input=parts, max_output_tokens=30)
    assert got.output_text == expected
    developer = [{"role": "developer", "content": "Reverse words."}, *turns]
    assert respond(server, input=developer, max_output_tokens=30).output_text == expected


def test_the_stream_is_the_apis_events_in_order_adding_up_to_the_answer(server):
    whole = respond(server, input=MESSAGE, max_output_tokens=40)
    events = list(respond(server, input=MESSAGE, max_output_tokens=40, stream=True))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas > 1 and kinds == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * deltas, "response.output_text.done", "response.content_part.done",
        "response.output_item.done", f"response.{whole.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_sampling_options_and_the_text_format_reach_the_sampler(server):
    seeded = [respond(server, input=MESSAGE, max_output_tokens=24, temperature=1, extra_body={"seed": s}).output_text
              for s in (1, 2, 1)]
    assert seeded[0] == seeded[2] != seeded[1]
    asked = chat(server, max_tokens=24, temperature=1, seed=1, top_p=0.5, extra_body={"top_k": 3})
    got = respond(server, input=MESSAGE, max_output_tokens=24, temperature=1, top_p=0.5,
                  extra_body={"seed": 1, "top_k": 3})
    assert got.output_text == asked.choices[0].message.content and got.top_p == 0.5
    choice = respond(server, input=MESSAGE, max_output_tokens=24, extra_body={
        "structured_outputs": {"choice": ["night", "crown king"]}})
    assert choice.output_text in ("night", "crown king") and choice.status == "completed"
    with pytest.raises(openai.BadRequestError, match="cannot be written with this model's vocabulary"):
        respond(server, input=MESSAGE, text={"format": {"type": "json_schema", "name": "x", "schema": {
            "type": "object"}}})


@pytest.mark.parametrize("body,message", [
    ({"input": MESSAGE, "previous_response_id": "resp_1"}, "previous_response_id is not supported by this server: "
                                                           "this server stores no responses"),
    ({"input": MESSAGE, "background": True}, "background is not supported"),
    ({"input": MESSAGE, "tools": [{"type": "function", "name": "f"}]}, "the chat: the model's chat template does "
                                                                        "not render tools"),
    ({"input": MESSAGE, "tools": [{"type": "web_search"}]}, "tools[0] must be a function"),
    ({"input": MESSAGE, "include": ["message.output_text.logprobs"]}, "include is not supported"),
    ({"input": [{"type": "file_search_call", "id": "fs_1"}]}, "input[0] must be a message of role user, assistant, "
                                                              "system or developer, a function_call, a "
                                                              "function_call_output or a reasoning item"),
    ({"input": [{"type": "reasoning", "summary": [], "content": [{"type": "summary_text", "text": "x"}]},
                {"role": "user", "content": MESSAGE}]}, "input[0]: a reasoning item's content must be reasoning_text "
                                                        "parts"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0]: only text content is supported"),
    ({"input": ""}, "input must be a non-empty string or list of messages"),
    ({"input": MESSAGE, "text": "json"}, "text must be an object"),
    ({"input": MESSAGE, "max_output_tokens": 0}, "max_tokens must be at least 1")])
def test_what_this_server_cannot_do_is_a_400_naming_it(server, body, message):
    response = httpx.post(f"{server.url}/v1/responses", content=json.dumps({"model": "export", **body}), timeout=30,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["message"].startswith(message), response.text
