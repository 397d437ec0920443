"""`python -m scripts.serve` talked to by the official `openai` client and httpx: answers equal to `sample.py --chat`
and transformers' generate on the export (greedy), streamed deltas adding up to the same text, exact finish reasons
and token counts, four concurrent streams each getting what it gets alone, seeded samples alike alone, twice and in
a batch, OpenAI's error body for each bad input with the server going on, refusals at start, a prompt cut to its
last tokens, and the chat page in headless Chromium at a 64-token context (tests/servers.py starts them)."""
import json
import os
import re
import sys

import httpx
import pytest
import torch

from chats import reverse_tasks
from harness import run
from hf_check import load_in_transformers
from model import build_model
from model.config import ModelConfig
from servers import BAD, MESSAGE, Server, at_once, chat, chat_model_export

pytestmark = pytest.mark.launch  # a server process (python -m pytest -m "not launch" skips it)


@pytest.fixture(scope="module")
def chat_export(tmp_path_factory) -> str:
    return chat_model_export(tmp_path_factory.mktemp("serve"), block_size=128)


@pytest.fixture(scope="module")
def server(chat_export):
    served = Server(chat_export)
    yield served
    code, output = served.stop()
    assert code == 0 and "Traceback" not in output, output
    assert MESSAGE not in output  # prompts are never logged


def test_models_lists_the_served_model(server):
    assert [m.id for m in server.client().models.list().data] == ["export"]


def test_a_greedy_answer_equals_sample_chat_and_transformers(server, chat_export):
    from data.chat import chat_prompt
    from training.checkpoints.export import load_trained

    reply = chat(server, max_tokens=40)
    answer = reply.choices[0].message.content
    sampled = run([sys.executable, "sample.py", "--export", chat_export, "--chat", MESSAGE, "--temperature", "0",
                   "--max_new_tokens", "40"]).stdout
    assert answer == sampled[:-1]  # print's newline
    cfg, _, tokenizer, meta = load_trained(None, None, chat_export)
    ids, end_of_turn = chat_prompt([{"role": "user", "content": MESSAGE}], meta, tokenizer, "", "")
    out = load_in_transformers(chat_export).generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False,
                                                     eos_token_id=end_of_turn, pad_token_id=end_of_turn)
    new = out[0, len(ids):].tolist()
    assert answer == tokenizer.decode([t for t in new if t != end_of_turn])
    assert reply.choices[0].finish_reason == ("stop" if end_of_turn in new else "length")
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(ids), len(new))
    assert reply.usage.total_tokens == len(ids) + len(new)


def test_streamed_deltas_add_up_to_the_answer(server):
    whole = chat(server, max_tokens=40)
    chunks = list(chat(server, max_tokens=40, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_a_length_limit_and_a_stop_string_end_the_answer_as_openai_says(server):
    full = chat(server, max_tokens=12)
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 12
    text = full.choices[0].message.content
    stop = text[5:7]
    cut = chat(server, max_tokens=12, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].message.content == text[:text.index(stop)]


def test_four_concurrent_streams_get_what_each_gets_alone(server):
    messages = [f"Reverse: {w}" for w in ("king crown", "night king night", "crown", "king king crown night")]
    alone = [chat(server, m, max_tokens=30).choices[0].message.content for m in messages]

    def stream(message):
        chunks = chat(server, message, max_tokens=30, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks)

    assert at_once([lambda m=m: stream(m) for m in messages]) == alone


def test_top_k_draws_among_the_k_most_likely_tokens(server):
    """vLLM's top_k: 1 answers greedily whatever the seed; 5 draws other answers; 0 and -1 leave sampling whole, and
    OpenAI's options left at their defaults (a penalty of 0, best_of 1) are taken."""
    def answer(seed=None, **options) -> str:
        reply = server.client().completions.create(model="export", prompt="Reverse: king crown", max_tokens=24,
                                                   seed=seed, **options)
        return reply.choices[0].text

    greedy = answer(temperature=0)
    assert [answer(seed, temperature=1, extra_body={"top_k": 1}) for seed in (1, 2, 3)] == [greedy] * 3
    assert {answer(seed, temperature=1, extra_body={"top_k": 5}) for seed in (1, 2, 3)} - {greedy}
    assert answer(7, temperature=1, extra_body={"top_k": 0}) == answer(7, temperature=1, extra_body={"top_k": -1}) \
        == answer(7, temperature=1, frequency_penalty=0, presence_penalty=0, best_of=1)


def test_seeded_samples_are_the_same_alone_twice_and_in_a_batch(server):
    def sample(seed: int, **options) -> list[str]:
        reply = server.client().completions.create(model="export", prompt="Reverse: king crown", max_tokens=24,
                                                   temperature=1, seed=seed, **options)
        return [c.text for c in sorted(reply.choices, key=lambda c: c.index)]

    alone = [sample(10 + i)[0] for i in range(4)]
    assert len(set(alone)) == 4  # the seeds draw different texts: the comparisons below can fail
    assert sample(10, n=4) == alone  # one request's n sequences take seeds 10..13, in one batch from the start
    assert [sample(10 + i)[0] for i in range(4)] == alone
    assert at_once([lambda i=i: sample(10 + i)[0] for i in range(4)]) == alone  # four requests batched together


def test_penalties_biases_and_min_tokens_answer_as_transformers_and_as_alone_in_a_batch(server, chat_export):
    """A chat request's repetition_penalty, logit_bias and min_tokens (greedy) answer as transformers' generate with
    the same three; frequency and presence penalties and min_p (seeded) each draw beside the others what they draw
    alone."""
    from data.chat import chat_prompt
    from training.checkpoints.export import load_trained

    _, _, tokenizer, meta = load_trained(None, None, chat_export)
    ids, end_of_turn = chat_prompt([{"role": "user", "content": MESSAGE}], meta, tokenizer, "", "")
    king = tokenizer.encode("k")[0]
    bias = {king: 1.0, end_of_turn: 100.0}  # the end of turn drawn the moment min_tokens lets it
    options = {"logit_bias": {str(t): b for t, b in bias.items()},
               "extra_body": {"repetition_penalty": 1.6, "min_tokens": 12}}
    reply = chat(server, max_tokens=40, extra_body={**options["extra_body"], "return_token_ids": True},
                 logit_bias=options["logit_bias"])
    out = load_in_transformers(chat_export).generate(
        torch.tensor([ids]), max_new_tokens=40, do_sample=False, repetition_penalty=1.6,
        sequence_bias={(t,): b for t, b in bias.items()}, min_new_tokens=12, eos_token_id=end_of_turn,
        pad_token_id=end_of_turn)
    new = out[0, len(ids):].tolist()
    assert reply.choices[0].token_ids == new and len(new) == 13 and reply.choices[0].finish_reason == "stop"
    unpenalized = chat(server, max_tokens=40, extra_body={"min_tokens": 12}, logit_bias=options["logit_bias"])
    assert reply.choices[0].message.content != unpenalized.choices[0].message.content

    def seeded(**ask) -> str:
        return chat(server, max_tokens=24, temperature=1, seed=3, **ask).choices[0].message.content

    asks = [{"frequency_penalty": 1.5}, {"presence_penalty": -1.0}, {"extra_body": {"min_p": 0.2}}, options]
    alone = [seeded(**ask) for ask in asks]
    assert len({seeded(), *alone}) == 5  # each option changes what the seed draws
    assert at_once([lambda ask=ask: seeded(**ask) for ask in asks]) == alone


def test_answers_under_vllms_choice_and_regex_follow_them_streamed_and_as_n_choices(server):
    choices = ["king crown night", "night crown king"]
    asked = {"structured_outputs": {"choice": choices}}
    reply = chat(server, max_tokens=40, temperature=1, seed=1, n=4, extra_body=asked)
    assert {c.message.content in choices and c.finish_reason == "stop" for c in reply.choices} == {True}
    assert {c.message.content for c in reply.choices} == set(choices)  # the seeds draw both
    chunks = chat(server, max_tokens=40, temperature=1, seed=1, n=4, stream=True, extra_body=asked)
    streamed = [""] * 4
    for chunk in chunks:
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == [c.message.content for c in sorted(reply.choices, key=lambda c: c.index)]
    words = chat(server, max_tokens=40, temperature=1, seed=2, extra_body={"structured_outputs": {
        "regex": "(king|crown|night)( (king|crown|night)){2}"}}).choices[0]
    assert re.fullmatch("(king|crown|night)( (king|crown|night)){2}", words.message.content)
    assert words.finish_reason == "stop"


@pytest.mark.parametrize("body,status,message", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_input_gets_openais_error_body_and_the_server_goes_on(server, body, status, message):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{server.url}/v1/chat/completions", content=content, timeout=30,
                          headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"].startswith(message) and set(error) == {"message", "type", "param", "code"}, error
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_an_unknown_path_or_method_gets_openais_error_body(server):
    for method, path, status in (("GET", "/v1/nowhere", 404), ("DELETE", "/v1/models", 405)):
        response = httpx.request(method, server.url + path, timeout=30)
        assert response.status_code == status
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"].startswith(f"{method} {path}: ")


def test_start_refuses_a_missing_export_one_without_its_tokenizer_and_a_port_in_use(tmp_path, chat_export, server):
    from data.prepare_chat import prepare_chat
    from training.checkpoints.export import write_export

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(t) + "\n" for t in reverse_tasks(20, seed=2)))
    meta = prepare_chat([str(tasks)], str(tmp_path / "data"), "bpe:300", context=64, val_fraction=0.1)
    cfg = ModelConfig(arch="llama", n_layer=1, n_head=2, n_embd=16, ffn_hidden=32, block_size=64,
                      vocab_size=meta["vocab_size"])
    bare = write_export(str(tmp_path / "bare"), cfg, build_model(cfg).state_dict(), meta, 0, str(tmp_path / "data"))
    os.remove(os.path.join(bare, meta["tokenizer_file"]))
    for args, message in [(["--export", str(tmp_path / "none")], "does not exist"),
                          (["--export", bare], f"{os.path.join(bare, meta['tokenizer_file'])} is missing: an "
                                               f"export's tokenizer stays beside its config.json"),
                          (["--export", chat_export, "--port", str(server.port)], f"--port {server.port}: cannot "
                                                                                   f"listen there"),
                          (["--export", chat_export, "--prefix_cache_mb", "-1"], "--prefix_cache_mb -1: must be at "
                                                                                  "least 0"),
                          (["--export", chat_export, "--port", "70000"], "--port 70000: must be a TCP port, 1 to "
                                                                         "65535"),
                          (["--export", chat_export, "--max_model_len", "500"], "--max_model_len 500: above the "
                           "model's context of 128 tokens; fix: pass 128 or less, or leave it out")]:
        proc = run([sys.executable, "-m", "scripts.serve", *args], check=False, timeout=120)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert message in proc.stderr, proc.stderr


def test_a_prompt_past_the_context_is_cut_to_its_last_tokens_when_asked(server):
    import openai

    long = " ".join(("king", "crown", "night")[i % 3] for i in range(50))  # 264 characters, a token each
    refusal = f"the prompt has {len(long)} tokens and the model's context is 128"
    with pytest.raises(openai.BadRequestError, match=refusal):
        server.client().completions.create(model="export", prompt=long, max_tokens=5, temperature=0)
    cut = server.client().completions.create(model="export", prompt=long, max_tokens=5, temperature=0,
                                             extra_body={"truncate_prompt_tokens": 100})
    last = server.client().completions.create(model="export", prompt=long[-100:], max_tokens=5, temperature=0)
    assert cut.usage.prompt_tokens == 100 and cut.choices[0].text == last.choices[0].text


def test_completions_continue_a_prompt_as_sample_does(server, chat_export):
    reply = server.client().completions.create(model="export", prompt="Reverse: a b", max_tokens=5, temperature=0)
    sampled = run([sys.executable, "sample.py", "--export", chat_export, "--prompt", "Reverse: a b", "--temperature",
                   "0", "--max_new_tokens", "5"]).stdout
    assert "Reverse: a b" + reply.choices[0].text == sampled[:-1]
    assert reply.choices[0].finish_reason == "length" and reply.usage.prompt_tokens == len("Reverse: a b")


def test_a_final_turn_continued_answers_as_a_completion_of_its_prompt(server):
    """vLLM's continue_final_message: the prompt ends where the last turn's content does (no end of turn, no new
    assistant turn), and the answer is what follows, as /v1/completions continues that text."""
    messages = [{"role": "user", "content": MESSAGE}, {"role": "assistant", "content": "nig"}]
    asked = {"model": "export", "messages": messages, "continue_final_message": True, "add_generation_prompt": False}
    ids = httpx.post(f"{server.url}/tokenize", json=asked, timeout=30).json()["tokens"]
    prompt = httpx.post(f"{server.url}/detokenize", json={"model": "export", "tokens": ids}, timeout=30).json()
    assert prompt["prompt"].endswith(f"User: {MESSAGE}\nAssistant: nig")
    reply = server.client().chat.completions.create(model="export", messages=messages, max_tokens=6, temperature=0,
                                                    extra_body={"continue_final_message": True})
    completion = server.client().completions.create(model="export", prompt=ids, max_tokens=6, temperature=0)
    answer = reply.choices[0].message.content
    assert answer and completion.choices[0].text.startswith(answer)
    assert reply.choices[0].finish_reason != "length" or answer == completion.choices[0].text


@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    """A server of the README's fine-tuned preset's context (64 tokens): a conversation outgrows it in two turns."""
    served = Server(chat_model_export(tmp_path_factory.mktemp("small"), block_size=64))
    yield served
    code, output = served.stop()
    assert code == 0 and "Traceback" not in output, output


def tokens(server, messages) -> int:
    return httpx.post(f"{server.url}/tokenize", json={"model": "export", "messages": messages}, timeout=30
                      ).json()["count"]


def test_the_page_streams_a_chat_past_a_small_context_keeping_its_newest_turns(small_server, browser):
    """Three turns with the page's default max tokens (the rest of the context): each answer streams in as the API
    gives it for the turns the page kept, the newest that leave a quarter of the context for the answer; the older
    ones are greyed, and the page says so once."""
    from selenium.webdriver.support.ui import WebDriverWait

    server, context = small_server, 64
    browser.get(f"{server.url}/")
    WebDriverWait(browser, 30).until(lambda b: b.find_element("id", "model").text == "export")
    # Every text the answer shows on its way: more than one means it streamed in, not arrived whole.
    browser.execute_script("""window.seen = []; new MutationObserver(() => {
        const answers = document.querySelectorAll('#log .assistant');
        if (answers.length) window.seen.push(answers[answers.length - 1].textContent);
    }).observe(document.getElementById('log'), {childList: true, subtree: true, characterData: true});""")
    conversation = []
    for turn, message in enumerate((MESSAGE, "Reverse: king", "Reverse: night crown")):
        browser.execute_script("window.seen = []")
        browser.find_element("id", "message").send_keys(message)
        browser.find_element("id", "go").click()
        WebDriverWait(browser, 60).until(lambda b: len(b.find_elements("css selector", "[data-done=true]")) > turn)
        shown = browser.find_elements("css selector", "#log .assistant")[-1].get_attribute("textContent")
        conversation.append({"role": "user", "content": message})
        kept = [m for m, div in zip(conversation, browser.find_elements("css selector", "#log div"))
                if "left-out" not in div.get_attribute("class")]
        assert kept[0]["role"] == "user" and kept[-1] == conversation[-1]
        assert len(kept) == 1 or tokens(server, kept) + context // 4 <= context  # they fit, with room to answer
        if len(kept) < len(conversation):  # and one exchange more would not
            assert tokens(server, conversation[-len(kept) - 2:]) + context // 4 > context
        api = server.client().chat.completions.create(model="export", messages=kept, temperature=0)
        assert shown == api.choices[0].message.content and shown
        assert len(set(browser.execute_script("return window.seen"))) > 2  # it grew as the tokens came
        conversation.append({"role": "assistant", "content": shown})
    shown = [e.get_attribute("textContent") for e in browser.find_elements("css selector", "#log div")]
    assert shown == [m["content"] for m in conversation]
    left_out = browser.find_elements("css selector", "#log .left-out")
    assert left_out and browser.find_element("id", "notice").is_displayed()
    assert browser.find_element("id", "notice").text == (
        f"Older turns no longer fit the model's context of {context} tokens with room for an answer: the model sees "
        "the newest turns only (the greyed ones are left out).")
