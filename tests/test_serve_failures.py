"""The server's promises under stress, each seen red with its break (docs/testing.md): the API key on every route
the app has, a client that vanishes mid-stream freeing its slot, a worker that dies (every request a 500, /health
503, the traceback once, exit 1), and a burst past the slots and the queue that leaves the server as it was."""
import json
import threading

import httpx
import pytest

from servers import BAD, KEY, MESSAGE, Server, adapter_folder, chat, chat_model_export, metric, wait_for

pytestmark = pytest.mark.launch  # server processes


@pytest.fixture(scope="module")
def chat_export(tmp_path_factory) -> str:
    return chat_model_export(tmp_path_factory.mktemp("serve"), block_size=128)


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


def guarded_routes() -> list[tuple[str, str]]:
    """(method, path) of every route of the app outside its open paths: a new route, declared on serving/api.py's
    router as every route is, is in this list by itself."""
    from serving.api import OPEN_PATHS, routes

    return sorted((method, route.path) for route in routes.routes for method in route.methods
                  if route.path not in OPEN_PATHS)


# A body each POST route answers 200 with the key.


GOOD_BODIES = {"/v1/completions": {"model": "export", "prompt": "Reverse: a", "max_tokens": 2},
               "/v1/chat/completions": {"model": "export", "messages": [{"role": "user", "content": "hi"}],
                                        "max_tokens": 2},
               "/v1/responses": {"model": "export", "input": "hi", "max_output_tokens": 2},
               "/tokenize": {"model": "export", "prompt": "Reverse: a"},
               "/detokenize": {"model": "export", "tokens": [1, 2]},
               "/v1/load_weights": {"path": "{export}"},  # the served export again
               "/v1/load_lora_adapter": {"lora_name": "tuned", "lora_path": "{adapter}"},
               "/v1/unload_lora_adapter": {"lora_name": "tuned"}}  # after its load: the routes go in order


def test_with_a_key_every_route_but_the_page_and_health_refuses_a_missing_or_wrong_one(chat_export, tmp_path):
    routes = guarded_routes()
    adapter = adapter_folder(chat_export, tmp_path / "adapter")
    assert {("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
            ("POST", "/v1/responses"),
            ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/tokenizer_info"),
            ("POST", "/v1/load_weights")} <= set(routes)
    served = Server(chat_export, "--api_key", KEY)
    try:
        for method, path in routes:
            body = GOOD_BODIES.get(path) if method == "POST" else None
            body = body and json.loads(json.dumps(body).replace("{export}", chat_export).replace("{adapter}", adapter))
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


def test_a_dead_worker_answers_every_request_500_turns_health_503_and_exits_1(chat_export, tmp_path):
    """A fault in the decoder while two streams run (chat's, the Responses API's) and three requests wait for the
    two slots: each stream ends in its API's error event, the waiting ones and every later one are 500s naming the
    failure, /health turns 503, the traceback is printed once and the process exits 1."""
    import openai

    from fault_serve import FAULT

    trigger = tmp_path / "fail-now"
    served = Server(chat_export, "--slots", "2", script=("tests/fault_serve.py",),
                    env={"MEGALITE_SERVE_STEP_S": "0.02", "MEGALITE_SERVE_FAULT": str(trigger)})
    outcomes = {}

    def call(name, stream):
        try:
            if "responses" in name:
                reply = served.client().responses.create(model="export", input=MESSAGE, max_output_tokens=80,
                                                         stream=stream, extra_body={"ignore_eos": True})
                outcomes[name] = list(reply) if stream else reply
                return
            reply = chat(served, max_tokens=80, stream=stream, extra_body={"ignore_eos": True})
            outcomes[name] = "".join(c.choices[0].delta.content or "" for c in reply) if stream else reply
        except openai.APIError as e:
            outcomes[name] = e

    try:
        threads = [threading.Thread(target=call, args=(name, True)) for name in ("running", "running responses")]
        for t in threads:
            t.start()
        wait_for(lambda: metric(served, "megalite_slots_in_use") == 2, "the streams hold the slots")
        threads += [threading.Thread(target=call, args=(name, stream)) for name, stream in
                    (("waiting", False), ("waiting stream", True), ("waiting responses", False))]
        for t in threads[2:]:
            t.start()
        wait_for(lambda: metric(served, "megalite_queue_length") == 3, "three requests wait")
        trigger.touch()
        for t in threads:
            t.join(timeout=60)
        failure = f"the model's worker failed (RuntimeError: {FAULT})"
        assert isinstance(outcomes["running"], openai.APIError) and failure in str(outcomes["running"])
        events = outcomes["running responses"]
        assert events[-1].type == "error" and events[-1].message.startswith(failure), events[-1]
        assert "response.output_text.delta" in {e.type for e in events}  # it failed mid-stream
        for name in ("waiting", "waiting stream", "waiting responses"):
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
