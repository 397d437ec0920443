"""A thinking model's answers (serving/answer.py, vLLM's reasoning parsers' rule): the text before </think> is the
reasoning (`reasoning_content`), the rest the content, whole and streamed (every reasoning delta before the content),
where the answer begins with <think> or the prompt opened one; the calls of tools read from the content alone;
Qwen 3's enable_thinking false (the prompt closes an empty think) answers in content; an answer cut while thinking is
all reasoning; the Responses API gives a reasoning item before the message, its events in order, and takes it back
as the next request's input; earlier turns' reasoning_content reaches the template."""
import json
import re
from types import SimpleNamespace

import httpx
import pytest

from data.tokenizers import EOT, CharTokenizer
from serving.answer import Answer
from serving.reasoning import thinking

# Qwen 3's behaviour on the plain layout: an answer writes its thinking in <think>...</think> before the reply,
# enable_thinking false closes an empty one in the prompt; earlier turns' reasoning rendered; tools as hermes does.
TEMPLATE = (
    "{% if tools %}System: tools {% for tool in tools %}{{ tool['function']['name'] }} {% endfor %}<tool_call>\n"
    "{% endif %}{% for message in messages %}{% if message['role'] == 'assistant' %}Assistant: {% generation %}"
    "{% if message.get('reasoning_content') %}<think>{{ message['reasoning_content'] }}</think>{% endif %}"
    "{{ message['content'] }}" + EOT + "{% endgeneration %}\n"
    "{% else %}{{ message['role'] | capitalize }}: {{ message['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}Assistant: {% if enable_thinking is defined and not enable_thinking %}"
    "<think></think>{% endif %}{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Rome?"}]
THOUGHT = "<think>Rome is in Italy.</think>It is sunny."


def test_how_an_answer_thinks_is_read_from_the_template_and_the_prompt():
    assert thinking("{{ messages }}", "User: hi\nAssistant: ") is None  # the template writes no reasoning
    assert thinking(TEMPLATE, "User: hi\nAssistant: ") == "may"
    assert thinking(TEMPLATE, "User: hi\nAssistant: <think></think>") == "may"  # enable_thinking false
    assert thinking(TEMPLATE, "<think>a</think>\nUser: hi\nAssistant: <think>\n") == "open"  # DeepSeek-R1's


def cut(text: str, think: str, stops=(), tokens: int | None = None, grammar: str | None = None
        ) -> tuple[list[tuple[str, str]], str]:
    """The (reasoning, content) each token of `text` sends (the last the answer's end, after `tokens` of them
    where given), and the reason it ended."""
    tokenizer = CharTokenizer.from_text(text + "x")
    answer = Answer(tokenizer, SimpleNamespace(stops=list(stops), tools=None, grammar=grammar), 0, think)
    sent = []
    for token in tokenizer.encode(text)[:tokens]:
        piece, stopped = answer.add(token)
        sent.append((piece.reasoning, piece.content))
        if stopped:
            return sent, piece.reason
    last = answer.last("length" if tokens else "stop")
    return sent + [(last.reasoning, last.content)], last.reason


def joined(sent) -> tuple[str, str]:
    return "".join(r for r, _ in sent), "".join(c for _, c in sent)


def test_the_text_before_think_ends_is_the_reasoning_and_every_piece_of_it_comes_first():
    sent, _ = cut(" <think>Rome is in Italy.</think>It is sunny.", "may")
    assert joined(sent) == ("Rome is in Italy.", "It is sunny.")
    first_content = next(i for i, (_, c) in enumerate(sent) if c)
    assert not any(r for r, _ in sent[first_content:]) and not any("<" in r for r, _ in sent)  # </think> held back
    assert joined(cut("Rome is in Italy.</think>It is sunny.", "open")[0]) == ("Rome is in Italy.", "It is sunny.")
    assert joined(cut("It is sunny.", "may")[0]) == ("", "It is sunny.")  # no <think>: content
    assert joined(cut("<thi", "may")[0]) == ("", "<thi")  # too short to say: content
    assert joined(cut(THOUGHT, "may", tokens=12)[0]) == ("Rome ", "")  # cut while thinking: reasoning
    sent, reason = cut(THOUGHT, "may", stops=["sun"])  # stop strings end the content, not the reasoning
    assert joined(sent) == ("Rome is in Italy.", "It is ") and reason == "stop"
    assert joined(cut("<think>It is sunny.</think>Sure.", "may", stops=["sun"])[0]) == ("It is sunny.", "Sure.")
    assert joined(cut('{"a": 1}', "open", grammar="json")[0]) == ("", '{"a": 1}')  # a grammar's answer: no thought


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from servers import Server, template_export

    served = Server(template_export(tmp_path_factory.mktemp("thinking"), TEMPLATE, block_size=1024))
    yield served
    code, output = served.stop()
    assert code == 0 and "Traceback" not in output, output


def written(text: str, **options) -> dict:
    """A random model made to write `text` (structured outputs)."""
    return {"model": "export", "messages": ASK, "max_tokens": 150, "temperature": 0,
            "extra_body": {"structured_outputs": {"regex": re.escape(text)}, **options}}


def thought_tokens(server) -> int:
    """The reasoning tokens usage counts of THOUGHT's answer: checked to be those up to and including the one
    that completes </think>."""
    reply = server.client().chat.completions.create(**written(THOUGHT, return_token_ids=True))
    ids = reply.choices[0].token_ids

    def text(n: int) -> str:
        return httpx.post(f"{server.url}/detokenize", json={"model": "export", "tokens": ids[:n]}, timeout=30
                          ).json()["prompt"]
    thought = next(n for n in range(1, len(ids) + 1) if "</think>" in text(n))
    assert reply.usage.completion_tokens_details.reasoning_tokens == thought
    return thought


@pytest.mark.launch
def test_a_thinking_answer_is_reasoning_then_content_whole_and_streamed(server):
    client = server.client()
    message = client.chat.completions.create(**written(THOUGHT)).choices[0].message
    assert (message.reasoning, message.reasoning_content, message.content) == (
        "Rome is in Italy.", "Rome is in Italy.", "It is sunny.")  # vLLM's newer name and its older one
    chunks = list(client.chat.completions.create(**written(THOUGHT), stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = [getattr(d, "reasoning_content", None) or "" for d in deltas]
    assert "".join(reasoning) == "Rome is in Italy." and sum(map(bool, reasoning)) > 2  # as it is written
    assert "".join(d.content or "" for d in deltas) == "It is sunny."
    last_reasoning = max(i for i, r in enumerate(reasoning) if r)
    assert not any(d.content for d in deltas[:last_reasoning + 1])
    assert thought_tokens(server) > 2
    plain = client.chat.completions.create(**written("It is sunny.", chat_template_kwargs={"enable_thinking": False}))
    assert plain.usage.completion_tokens_details.reasoning_tokens == 0
    assert (plain.choices[0].message.reasoning_content, plain.choices[0].message.content) == (None, "It is sunny.")
    cut_short = client.chat.completions.create(**{**written(THOUGHT), "max_tokens": 10}).choices[0]
    assert cut_short.finish_reason == "length" and cut_short.message.content is None
    assert cut_short.message.reasoning_content and "Rome is in Italy.".startswith(cut_short.message.reasoning_content)


@pytest.mark.launch
def test_calls_are_read_from_the_content_after_the_reasoning(server):
    call = '<think>I need the weather.</think><tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}' \
           '</tool_call>'
    choice = server.client().chat.completions.create(**written(call), tools=[WEATHER]).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content == "I need the weather."
    (made,) = choice.message.tool_calls
    assert (made.function.name, json.loads(made.function.arguments)) == ("get_weather", {"city": "Rome"})
    history = [*ASK, {"role": "assistant", "content": "It is sunny.", "reasoning": "Rome is in Italy."},
               {"role": "user", "content": "Thanks."}]  # vLLM's newer name: the template reads reasoning_content
    ids = httpx.post(f"{server.url}/tokenize", json={"model": "export", "messages": history}, timeout=30).json()
    prompt = httpx.post(f"{server.url}/detokenize", json={"model": "export", "tokens": ids["tokens"]},
                        timeout=30).json()["prompt"]
    assert "Assistant: <think>Rome is in Italy.</think>It is sunny." in prompt


@pytest.mark.launch
def test_the_responses_api_gives_the_reasoning_an_item_before_the_message(server):
    client = server.client()
    options = {"model": "export", "input": ASK[0]["content"], "temperature": 0, "max_output_tokens": 150,
               "extra_body": {"structured_outputs": {"regex": re.escape(THOUGHT)}}}
    whole = client.responses.create(**options)
    assert [o.type for o in whole.output] == ["reasoning", "message"] and whole.output_text == "It is sunny."
    assert whole.output[0].content[0].text == "Rome is in Italy."
    assert whole.usage.output_tokens_details.reasoning_tokens == thought_tokens(server)
    events = list(client.responses.create(**options, stream=True))
    kinds = [e.type for e in events]
    thought, said = kinds.count("response.reasoning_text.delta"), kinds.count("response.output_text.delta")
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     *["response.reasoning_text.delta"] * thought, "response.reasoning_text.done",
                     "response.output_item.done", "response.output_item.added", "response.content_part.added",
                     *["response.output_text.delta"] * said, "response.output_text.done",
                     "response.content_part.done", "response.output_item.done", "response.completed"]
    done = [e.item.id for e in events if e.type == "response.output_item.done"]
    assert done == [item.id for item in events[-1].response.output]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Rome is in Italy."
    # the output sent back as the next request's input, as clients do: the reasoning is the turn's, as in chat
    following = {**options, "input": [ASK[0], *[o.model_dump() for o in whole.output],
                                      {"role": "user", "content": "Thanks."}], "max_output_tokens": 1}
    history = [*ASK, {"role": "assistant", "content": "It is sunny.", "reasoning_content": "Rome is in Italy."},
               {"role": "user", "content": "Thanks."}]
    chat = client.chat.completions.create(model="export", messages=history, max_tokens=1)
    assert client.responses.create(**following).usage.input_tokens == chat.usage.prompt_tokens
    bare = [history[0], {"role": "assistant", "content": "It is sunny."}, history[2]]
    without = client.chat.completions.create(model="export", messages=bare, max_tokens=1)
    assert without.usage.prompt_tokens < chat.usage.prompt_tokens


# TEMPLATE, and DeepSeek-R1's way where a request asks (open_thought): the generation prompt opens the thought
OPENING = TEMPLATE.replace("<think></think>{% endif %}{% endif %}",
                           "<think></think>{% elif open_thought %}<think>{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def marked(tmp_path_factory, shakespeare_path):
    """A Hugging Face folder of a random Llama whose tokenizer writes <think> and </think> as a token each (Qwen 3's
    and DeepSeek-R1's do), served: (the server, its tokenizer)."""
    from chats import chatml_bpe
    from hf_check import transformers_model
    from model.config import ModelConfig
    from servers import Server

    folder = tmp_path_factory.mktemp("marked")
    tokenizer = chatml_bpe(shakespeare_path)
    tokenizer.add_special_tokens(["<think>", "</think>"])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": OPENING, "eos_token": EOT}))
    transformers_model(ModelConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=64,
                                   block_size=256, vocab_size=512), folder)
    served = Server(str(folder))
    yield served, tokenizer
    code, output = served.stop()
    assert code == 0 and "Traceback" not in output, output


@pytest.mark.launch
def test_a_grammar_begins_after_the_thought_where_its_marks_are_tokens(marked):
    """vLLM's structured outputs under a reasoning parser: the thought is free, the grammar rules the content. The
    random model is steered by logit biases and a repetition penalty of 2, which halves a token's biased logit once
    drawn: a word (80) is drawn once, then </think> (60); where the answer may think, <think> (100) first, which the
    grammar alone would rule out; kept from <think>, it answers by the grammar from its first token."""
    server, tokenizer = marked
    think, thought = tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>")
    word = tokenizer.encode(" lord").ids[0]

    def ask(variables: dict, bias: dict) -> dict:
        return httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "messages": ASK, "max_tokens": 20, "temperature": 0, "return_token_ids": True, "repetition_penalty": 2,
            "logit_bias": {str(token): value for token, value in bias.items()}, "chat_template_kwargs": variables,
            "structured_outputs": {"choice": ["sunny", "rainy"]}}).json()["choices"][0]

    opened = ask({"open_thought": True}, {word: 80, thought: 60})
    assert opened["token_ids"][:2] == [word, thought]
    assert opened["message"]["reasoning_content"] == tokenizer.decode([word])
    assert opened["message"]["content"] in ("sunny", "rainy") and opened["finish_reason"] == "stop"
    may = ask({}, {think: 100, word: 80, thought: 60})
    assert may["token_ids"][:3] == [think, word, thought]
    assert may["message"]["reasoning_content"] == tokenizer.decode([word])
    assert may["message"]["content"] in ("sunny", "rainy")
    plain = ask({}, {think: -100})  # no thought: the grammar's from the first token
    assert plain["message"].get("reasoning_content") is None and plain["message"]["content"] in ("sunny", "rainy")
