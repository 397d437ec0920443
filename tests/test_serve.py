"""`python -m scripts.serve` on a free loopback port, talked to by the official `openai` client and httpx: answers
equal to `sample.py --chat` and transformers' generate on the export (greedy), streamed deltas adding up to the
same text, exact finish reasons and token counts, four concurrent streams each getting what it gets alone, seeded
samples alike alone, twice and in a batch, a client vanishing mid-stream freeing its slot, OpenAI's error body for
each bad input with the server going on, the API key on every route the app has, refusals at start, Ctrl-C, a
worker that dies (500s, a 503 health, exit 1), a burst past the slots and queue, and the chat page in headless
Chromium at a 64-token context. The model: a chat-tuned Llama's shape with random weights, exported with the chat
template of real prepared conversations."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from chats import reverse_tasks
from harness import REPO, free_port, run
from hf_check import load_in_transformers
from model import build_model
from model.config import ModelConfig

pytestmark = pytest.mark.launch  # a server process (python -m pytest -m "not launch" skips it)
KEY = "test-key-0123"
MESSAGE = "Reverse: king crown night"


def chat_model_export(folder, block_size: int) -> str:
    from data.prepare_chat import prepare_chat
    from training.export import write_export

    tasks = folder / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(t) + "\n" for t in reverse_tasks(50, seed=1)))
    prepare_chat([str(tasks)], str(folder / "data"), "char", context=64, val_fraction=0.1)
    meta = json.loads((folder / "data" / "meta.json").read_text())
    cfg = ModelConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=64, block_size=block_size,
                      vocab_size=meta["vocab_size"])
    model = build_model(cfg, seed=1)
    with torch.no_grad():  # weights that make each next token clear: greedy paths never hang on a near tie
        for p in model.parameters():
            p.normal_(0, 0.3)
    return write_export(str(folder / "export"), cfg, model.state_dict(), meta, step=0, data_dir=str(folder / "data"))


@pytest.fixture(scope="module")
def chat_export(tmp_path_factory) -> str:
    return chat_model_export(tmp_path_factory.mktemp("serve"), block_size=128)


class Server:
    def __init__(self, export: str, *args: str, script=("-m", "scripts.serve"), env: dict | None = None):
        """`script`: how the server is started (tests/fault_serve.py slows or breaks its decoder, through env)."""
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, *script, "--export", export, "--port", str(self.port),
                                      "--slots", "4", *args], cwd=REPO, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)
            assert self.proc.poll() is None, self.proc.stdout.read()
        raise AssertionError("the server did not answer /health within 120 s")

    def client(self, key: str = "unused"):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=60)

    def stop(self) -> tuple[int, str]:
        """Ctrl-C, as a user stops it: (exit code, everything it printed)."""
        self.proc.send_signal(signal.SIGINT)
        output = self.proc.communicate(timeout=30)[0]
        return self.proc.returncode, output


@pytest.fixture(scope="module")
def server(chat_export):
    served = Server(chat_export)
    yield served
    code, output = served.stop()
    assert code == 0 and "Traceback" not in output, output
    assert MESSAGE not in output  # prompts are never logged


def chat(server, message: str = MESSAGE, **options):
    return server.client().chat.completions.create(model="export", messages=[{"role": "user", "content": message}],
                                                   temperature=0, **options)


def test_models_lists_the_served_model(server):
    assert [m.id for m in server.client().models.list().data] == ["export"]


def test_a_greedy_answer_equals_sample_chat_and_transformers(server, chat_export):
    from data.chat import chat_prompt
    from training.export import load_trained

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
    together = [None] * 4

    def stream(i):
        chunks = chat(server, messages[i], max_tokens=30, stream=True)
        together[i] = "".join(c.choices[0].delta.content or "" for c in chunks)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert together == alone


def metric(server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    found = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


@pytest.fixture(scope="module")
def slow_server(chat_export):
    """2 slots and 2 queue places, the decoder at a larger model's pace (tests/fault_serve.py, 10 ms a step): a
    stream outlasts a client's reading of its first line, and a burst its own arrival."""
    served = Server(chat_export, "--slots", "2", "--max_queue", "2", script=("tests/fault_serve.py",),
                    env={"MEGALITE_SERVE_STEP_S": "0.01"})
    yield served
    code, output = served.stop()
    assert code == 0 and "Traceback" not in output, output


def test_a_client_that_vanishes_mid_stream_frees_its_slot(slow_server):
    server = slow_server
    before = metric(server, 'megalite_requests_total{reason="cancelled"}')
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=60, json={
            "model": "export", "messages": [{"role": "user", "content": MESSAGE}], "stream": True,
            "ignore_eos": True}) as response:
        next(response.iter_lines())
    wait_for(lambda: metric(server, 'megalite_requests_total{reason="cancelled"}') == before + 1, "cancelled")
    assert metric(server, "megalite_slots_in_use") == 0


BAD = [  # (body or raw bytes, status, the error message's start)
    (b"{not json", 400, "the request body is not valid JSON"),
    (b"\xff\xfe", 400, "the request body is not UTF-8"),
    ({"model": "export", "messages": []}, 400, "messages must be a non-empty list"),
    ({"model": "export", "messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0] has the unknown role"),
    ({"model": "export", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400,
     "max_tokens must be at least 1"),
    ({"model": "export", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 500}, 400, "max_tokens=500"),
    ({"model": "export", "messages": [{"role": "user", "content": "hi " * 60}]}, 400, "the prompt has"),
    ({"model": "export", "messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400,
     "temperature must be in [0, 2]"),
    ({"model": "export", "messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400, "top_p must be in (0, 1]"),
    ({"model": "export", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400,
     "tools are not supported"),
    ({"model": "export", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
     "only text content is supported"),
    ({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, 404, "the model 'gpt-9' is not served"),
]


@pytest.mark.parametrize("body,status,message", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_input_gets_openais_error_body_and_the_server_goes_on(server, body, status, message):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{server.url}/v1/chat/completions", content=content, timeout=30,
                          headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"].startswith(message) and set(error) == {"message", "type", "param", "code"}, error
    assert httpx.get(f"{server.url}/health").status_code == 200


@pytest.fixture(scope="module")
def browser():
    """Debian's headless Chromium driven through its ChromeDriver (Selenium), with no network beyond loopback."""
    missing = [name for name, path in [("chromium", "/usr/bin/chromium"), ("chromedriver", "/usr/bin/chromedriver")]
               if not shutil.which(path)]
    try:
        from selenium import webdriver
    except ImportError:
        missing.append("selenium (pip install '.[dev]')")
    if missing:  # CI installs them (.ci/run): there a missing one is a broken machine, not a reason to skip
        (pytest.fail if os.environ.get("CI") == "true" else pytest.skip)(
            f"the chat page test needs {', '.join(missing)}; .ci/run installs chromium and chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService("/usr/bin/chromedriver"))
    yield driver
    driver.quit()


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


def guarded_routes() -> list[tuple[str, str]]:
    """(method, path) of every route of the app outside its open paths: a new route is in this list by itself."""
    from fastapi.routing import APIRoute

    from serving.api import OPEN_PATHS, create_app

    app = create_app(served=None)  # the routes only: no handler runs
    return sorted((method, route.path) for route in app.routes if isinstance(route, APIRoute)
                  for method in route.methods if route.path not in OPEN_PATHS)


# A body each POST route answers 200 with the key.
GOOD_BODIES = {"/v1/completions": {"model": "export", "prompt": "Reverse: a", "max_tokens": 2},
               "/v1/chat/completions": {"model": "export", "messages": [{"role": "user", "content": "hi"}],
                                        "max_tokens": 2},
               "/tokenize": {"model": "export", "prompt": "Reverse: a"}}


def test_with_a_key_every_route_but_the_page_and_health_refuses_a_missing_or_wrong_one(chat_export):
    routes = guarded_routes()
    assert {("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
            ("POST", "/tokenize")} <= set(routes)
    served = Server(chat_export, "--api_key", KEY)
    try:
        for method, path in routes:
            body = GOOD_BODIES.get(path) if method == "POST" else None
            assert method == "GET" or body, f"{method} {path}: a new route needs a body in GOOD_BODIES"
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
                response = httpx.request(method, served.url + path, json=body, headers=headers, timeout=30)
                assert response.status_code == 401, (method, path, headers, response.text)
                assert response.json()["error"]["code"] == "invalid_api_key"
            response = httpx.request(method, served.url + path, json=body, timeout=30,
                                     headers={"Authorization": f"Bearer {KEY}"})
            assert response.status_code == 200, (method, path, response.text)
        for path in ("/", "/health"):  # the page asks for the key itself; a load balancer's probe has none
            assert httpx.get(served.url + path, timeout=30).status_code == 200
        import openai

        with pytest.raises(openai.AuthenticationError):
            served.client("wrong").completions.create(model="export", prompt="Reverse: a", max_tokens=2)
        assert served.client(KEY).models.list().data[0].id == "export"
    finally:
        code, output = served.stop()
    assert code == 0 and KEY not in output


def test_seeded_samples_are_the_same_alone_twice_and_in_a_batch(server):
    def sample(seed: int, **options) -> list[str]:
        reply = server.client().completions.create(model="export", prompt="Reverse: king crown", max_tokens=24,
                                                   temperature=1, seed=seed, **options)
        return [c.text for c in sorted(reply.choices, key=lambda c: c.index)]

    alone = [sample(10 + i)[0] for i in range(4)]
    assert len(set(alone)) == 4  # the seeds draw different texts: the comparisons below can fail
    assert sample(10, n=4) == alone  # one request's n sequences take seeds 10..13, in one batch from the start
    assert [sample(10 + i)[0] for i in range(4)] == alone
    together = [None] * 4

    def request(i):
        together[i] = sample(10 + i)[0]

    threads = [threading.Thread(target=request, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert together == alone


def test_start_refuses_a_missing_export_one_without_its_tokenizer_and_a_port_in_use(tmp_path, chat_export, server):
    from data.prepare_chat import prepare_chat
    from training.export import write_export

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
                                                                                   f"listen there")]:
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


def wait_for(condition, what: str, seconds: float = 30):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {seconds} s"
        time.sleep(0.05)


def test_a_dead_worker_answers_every_request_500_turns_health_503_and_exits_1(chat_export, tmp_path):
    """A fault in the decoder while one stream runs and two requests wait for the one slot: the stream ends in
    OpenAI's error event, the waiting ones and every later one are 500s naming the failure, /health turns 503, the
    traceback is printed once and the process exits 1."""
    import openai

    from fault_serve import FAULT

    trigger = tmp_path / "fail-now"
    served = Server(chat_export, "--slots", "1", script=("tests/fault_serve.py",),
                    env={"MEGALITE_SERVE_STEP_S": "0.02", "MEGALITE_SERVE_FAULT": str(trigger)})
    outcomes = {}

    def call(name, stream):
        try:
            reply = chat(served, max_tokens=80, stream=stream, extra_body={"ignore_eos": True})
            outcomes[name] = "".join(c.choices[0].delta.content or "" for c in reply) if stream else reply
        except openai.APIError as e:
            outcomes[name] = e

    try:
        threads = [threading.Thread(target=call, args=("running", True))]
        threads[0].start()
        wait_for(lambda: metric(served, "megalite_slots_in_use") == 1, "the stream holds the slot")
        threads += [threading.Thread(target=call, args=(name, stream)) for name, stream in
                    (("waiting", False), ("waiting stream", True))]
        for t in threads[1:]:
            t.start()
        wait_for(lambda: metric(served, "megalite_queue_length") == 2, "two requests wait")
        trigger.touch()
        for t in threads:
            t.join(timeout=60)
        failure = f"the model's worker failed (RuntimeError: {FAULT})"
        assert isinstance(outcomes["running"], openai.APIError) and failure in str(outcomes["running"])
        for name in ("waiting", "waiting stream"):
            assert isinstance(outcomes[name], openai.InternalServerError) and failure in outcomes[name].message
        health = httpx.get(f"{served.url}/health", timeout=10)
        assert health.status_code == 503 and health.json() == {"status": "failed", "error": failure}
        later = httpx.post(f"{served.url}/v1/completions", json={"prompt": "Reverse: a"}, timeout=10)
        assert later.status_code == 500 and later.json()["error"]["message"].startswith(failure)
        output = served.proc.communicate(timeout=60)[0]
    finally:
        if served.proc.poll() is None:
            served.proc.kill()
    assert served.proc.returncode == 1, output
    assert output.count("Traceback") == 1 and f"RuntimeError: {FAULT}" in output, output
    assert f"error: {failure}; answering 500 for" in output


def test_a_burst_past_slots_and_queue_leaves_the_server_as_it_was(slow_server):
    """Good streams, clients that vanish mid-stream, malformed and out-of-range bodies, all at once against 2 slots
    and 2 queue places: each good stream is its lone answer or a 429, each bad body its 4xx, no 5xx (and no
    traceback: the fixture's end); afterwards every slot and queue place is free and the server answers as
    before."""
    served = slow_server
    messages = [f"Reverse: {w}" for w in ("king crown", "night king night", "crown")]
    good = {"model": "export", "max_tokens": 60, "ignore_eos": True, "temperature": 0}
    before = [chat(served, m, max_tokens=20).choices[0].message.content for m in messages]
    alone = {m: chat(served, m, max_tokens=good["max_tokens"], extra_body={"ignore_eos": True}
                     ).choices[0].message.content for m in messages}
    results, start = [], threading.Barrier(6 + 3 + len(BAD))

    def stream(message):
        start.wait()
        body = {**good, "messages": [{"role": "user", "content": message}], "stream": True}
        with httpx.stream("POST", f"{served.url}/v1/chat/completions", json=body, timeout=60) as response:
            if response.status_code != 200:
                results.append(("good", response.status_code, json.loads(response.read())["error"]))
                return
            text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content", "")
                           for line in response.iter_lines() if line.startswith("data: {"))
            results.append(("good", 200, (message, text)))

    def vanish():
        start.wait()
        body = {**good, "messages": [{"role": "user", "content": MESSAGE}], "stream": True}
        with httpx.stream("POST", f"{served.url}/v1/chat/completions", json=body, timeout=60) as response:
            if response.status_code == 200:
                next(response.iter_lines())
            results.append(("vanished", response.status_code, None))

    def bad(body, status, message):
        start.wait()
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = httpx.post(f"{served.url}/v1/chat/completions", content=content, timeout=60,
                              headers={"content-type": "application/json"})
        results.append(("bad", response.status_code, (status, message, response.json()["error"]["message"])))

    threads = [threading.Thread(target=stream, args=(messages[i % 3],)) for i in range(6)]
    threads += [threading.Thread(target=vanish) for _ in range(3)]
    threads += [threading.Thread(target=bad, args=case) for case in BAD]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(results) == len(threads)
    assert all(status < 500 for _, status, _ in results), results
    streams = [(status, value) for kind, status, value in results if kind == "good"]
    assert {status for status, _ in streams} <= {200, 429}
    assert any(status == 429 for kind, status, _ in results if kind != "bad")  # the burst overflowed
    for status, value in streams:
        assert value[1] == alone[value[0]] if status == 200 else value["code"] == "queue_full", value
    for _, status, (expected, start_of_message, message) in (r for r in results if r[0] == "bad"):
        assert status == expected and message.startswith(start_of_message)
    wait_for(lambda: metric(served, "megalite_slots_in_use") == 0 == metric(served, "megalite_queue_length"),
             "every slot and queue place free")
    assert [chat(served, m, max_tokens=20).choices[0].message.content for m in messages] == before
