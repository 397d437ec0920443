"""What clients that score and train read from `python -m scripts.serve` (tests/servers.py starts it): completions'
log-probabilities with the prompt echoed, and chat's, equal the model's full-window log-softmax (fp32, 1e-5),
greedy and sampled, alone and four at once; a prompt given as token ids, or a list of prompts, answers as its text
does, with the ids of prompt and answer; a prompt sent again is found in the prefix cache (its hits in /metrics)
and answers as it did; weights loaded into the running server answer as `sample.py` does on their export; a bad
value of each of these fields gets OpenAI's 4xx body, never a 5xx."""
import json
import sys

import httpx
import pytest
import torch

from data.documents import documents_seen
from harness import run
from model.generate import WindowDecoder
from servers import MESSAGE, Server, at_once, chat, chat_model_export, metric
from training.checkpoints.export import load_trained

pytestmark = pytest.mark.launch  # a server process (python -m pytest -m "not launch" skips it)

BLOCK = 128


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("scoring")
    return {"served": chat_model_export(folder / "served", BLOCK),
            "other_weights": chat_model_export(folder / "other_weights", BLOCK, seed=2),
            "other_shape": chat_model_export(folder / "other_shape", BLOCK // 2)}


@pytest.fixture(scope="module")
def server(exports):
    served = Server(exports["served"])
    yield served
    code, output = served.stop()
    assert code == 0 and "Traceback" not in output, output


class Reference:
    """The export's full-window forward pass, no cache: log-softmax rows and token strings."""

    def __init__(self, export: str):
        cfg, model, self.tokenizer, meta = load_trained(None, None, export)
        self.window = WindowDecoder(model.eval(), cfg.block_size, cfg.vocab_size, torch.device("cpu"),
                                    documents=documents_seen(cfg.document_masking, meta))

    @torch.no_grad()
    def logprobs(self, ids: list[int]) -> torch.Tensor:
        """(len(ids) - 1, vocab): row i scores ids[i + 1]."""
        slot, logits = self.window.start(ids, every=True)
        self.window.release(slot)
        return torch.log_softmax(logits.float(), dim=-1)[:-1]


def completion(server, prompt, **options) -> dict:
    body = {"model": "export", "prompt": prompt, "max_tokens": 8, "ignore_eos": True, "return_token_ids": True,
            **options}
    reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def check_echoed(choice: dict, reference: Reference, top: int) -> None:
    ids = choice["prompt_token_ids"] + choice["token_ids"]
    expected, scored = reference.logprobs(ids), choice["logprobs"]
    assert scored["tokens"] == [reference.tokenizer.decode([t]) for t in ids]
    assert "".join(scored["tokens"]) == choice["text"]  # the prompt echoed, then the answer
    assert scored["token_logprobs"][0] is None and scored["top_logprobs"][0] is None
    for i, (score, alternatives) in enumerate(zip(scored["token_logprobs"][1:], scored["top_logprobs"][1:])):
        assert abs(score - float(expected[i, ids[i + 1]])) < 1e-5
        best = expected[i].topk(top)
        wanted = {reference.tokenizer.decode([t]): v for t, v in zip(best.indices.tolist(), best.values.tolist())}
        wanted[scored["tokens"][i + 1]] = score  # the token's own, as vLLM adds it
        assert alternatives.keys() == wanted.keys()
        assert all(abs(alternatives[k] - v) < 1e-5 for k, v in wanted.items())


def test_echoed_and_drawn_logprobs_equal_the_full_window_greedy_and_sampled_alone_and_four_at_once(server, exports):
    reference = Reference(exports["served"])
    prompts = ["Reverse: king crown", "Reverse: night", "Reverse: crown crown king", "Reverse: a b c"]
    for options in ({"temperature": 0}, {"temperature": 1.0, "seed": 5}):
        alone = [completion(server, p, logprobs=3, echo=True, **options) for p in prompts]
        together = at_once([lambda p=p: completion(server, p, logprobs=3, echo=True, **options) for p in prompts])
        for reply in alone + together:
            check_echoed(reply["choices"][0], reference, top=3)
        assert [r["choices"][0]["token_ids"] for r in together] == [r["choices"][0]["token_ids"] for r in alone]


def test_a_stream_carries_the_same_scores_and_ids_as_the_whole_reply(server):
    body = {"model": "export", "prompt": "Reverse: king crown night", "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "logprobs": 2, "echo": True, "return_token_ids": True}
    whole = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    streamed = {"text": "", "tokens": [], "token_logprobs": [], "top_logprobs": [], "token_ids": []}
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                streamed["text"] += choice["text"]
                streamed["token_ids"] += choice["token_ids"]
                for key in ("tokens", "token_logprobs", "top_logprobs"):
                    streamed[key] += choice["logprobs"][key]
    assert streamed["text"] == whole["text"] and streamed["token_ids"] == whole["token_ids"]
    for key in ("tokens", "token_logprobs", "top_logprobs"):
        assert streamed[key] == whole["logprobs"][key], key


def test_chat_logprobs_equal_the_full_window(server, exports):
    reference = Reference(exports["served"])
    reply = chat(server, max_tokens=20, logprobs=True, top_logprobs=2, extra_body={"return_token_ids": True})
    choice = reply.choices[0]
    ids = reply.model_extra["prompt_token_ids"] + choice.model_extra["token_ids"]
    expected = reference.logprobs(ids)[len(reply.model_extra["prompt_token_ids"]) - 1:]
    content = choice.logprobs.content
    assert len(content) == reply.usage.completion_tokens == len(choice.model_extra["token_ids"])
    assert "".join(c.token for c in content).startswith(choice.message.content)
    for row, entry, token in zip(expected, content, choice.model_extra["token_ids"]):
        assert abs(entry.logprob - float(row[token])) < 1e-5 and entry.bytes == list(entry.token.encode())
        best = row.topk(2)
        assert [t.token for t in entry.top_logprobs] == [reference.tokenizer.decode([i]) for i in best.indices]
        assert all(abs(t.logprob - v) < 1e-5 for t, v in zip(entry.top_logprobs, best.values.tolist()))


def test_prompts_as_token_ids_and_lists_answer_as_their_text(server):
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "Reverse: king crown"}, timeout=30).json()["tokens"]
    as_text = completion(server, "Reverse: king crown", temperature=0)["choices"][0]
    as_ids = completion(server, ids, temperature=0)["choices"][0]
    assert (as_ids["text"], as_ids["token_ids"], as_ids["prompt_token_ids"]) == \
        (as_text["text"], as_text["token_ids"], ids)
    other = completion(server, "Reverse: night", temperature=0)["choices"][0]
    both = completion(server, [ids, "Reverse: night"], temperature=0, n=2)
    assert [(c["index"], c["text"]) for c in both["choices"]] == \
        [(0, as_text["text"]), (1, as_text["text"]), (2, other["text"]), (3, other["text"])]
    assert both["usage"]["prompt_tokens"] == len(ids) + len(other["prompt_token_ids"])
    assert both["usage"]["completion_tokens"] == 4 * 8
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": as_text["token_ids"]}, timeout=30).json()["prompt"]
    assert text == as_text["text"]


def test_a_prompt_sent_again_is_found_in_the_prefix_cache_and_answers_as_it_did(server, exports):
    prompt = "Reverse: " + " ".join(["night", "crown", "king"] * 5)  # 93 characters, a token each
    hits = metric(server, "megalite_prefix_cache_hits_total")
    queries = metric(server, "megalite_prefix_cache_queries_total")
    first, again = (completion(server, prompt, temperature=0, logprobs=2) for _ in range(2))
    assert metric(server, "megalite_prefix_cache_hits_total") - hits == 80  # 5 blocks of 16, the last token left
    assert metric(server, "megalite_prefix_cache_queries_total") - queries == 2 * 93
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    scores = [reply["choices"][0]["logprobs"]["token_logprobs"] for reply in (first, again)]
    assert all(abs(a - b) < 1e-5 for a, b in zip(*scores))


def test_loaded_weights_answer_as_sample_does_on_their_export(server, exports):
    def sampled(export: str) -> str:
        return run([sys.executable, "sample.py", "--export", export, "--chat", MESSAGE, "--temperature", "0",
                    "--max_new_tokens", "40"]).stdout[:-1]

    before, other = sampled(exports["served"]), sampled(exports["other_weights"])
    assert before != other  # the new weights answer otherwise: the comparison below can fail
    assert chat(server, max_tokens=40).choices[0].message.content == before
    try:
        reply = httpx.post(f"{server.url}/v1/load_weights", json={"path": exports["other_weights"]}, timeout=60)
        assert reply.status_code == 200 and reply.json() == {"status": "ok", "path": exports["other_weights"],
                                                             "step": 0}, reply.text
        assert chat(server, max_tokens=40).choices[0].message.content == other
    finally:
        httpx.post(f"{server.url}/v1/load_weights", json={"path": exports["served"]}, timeout=60).raise_for_status()
    assert chat(server, max_tokens=40).choices[0].message.content == before


COMPLETION = {"model": "export", "prompt": "Reverse: a", "max_tokens": 2}
CHAT = {"model": "export", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BAD = [  # (path, body, the error message's start)
    ("/v1/completions", {**COMPLETION, "logprobs": 21}, "logprobs must be in [0, 20], not 21"),
    ("/v1/completions", {**COMPLETION, "logprobs": True}, "logprobs must be a whole number"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs must be in [0, 20]"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs needs logprobs: true"),
    ("/v1/chat/completions", {**CHAT, "echo": True}, "echo is an option of /v1/completions"),
    ("/v1/completions", {**COMPLETION, "prompt": [1, 99999]}, "the token id 99999 is outside the vocabulary"),
    ("/v1/completions", {**COMPLETION, "prompt": [[1, 2], [-1]]}, "the token id -1 is outside the vocabulary"),
    ("/v1/completions", {**COMPLETION, "prompt": [[]]}, "prompt must be a non-empty string, a list of token ids"),
    ("/v1/completions", {**COMPLETION, "prompt": [1.5]}, "prompt must be a non-empty string, a list of token ids"),
    ("/detokenize", {"tokens": [99999]}, "the token id 99999 is outside the vocabulary"),
    ("/v1/load_weights", {}, "path must name an export or a run's out_dir"),
    ("/v1/load_weights", {"path": "/no/such/export"}, "path /no/such/export: no such folder"),
    ("/v1/load_weights", {"path": "{other_shape}"}, "path {other_shape}: another model (block_size=64 (served: 128))"),
]


@pytest.mark.parametrize("path,body,message", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_values_of_the_scoring_fields_get_openais_4xx(server, exports, path, body, message):
    body = {k: v.format(**exports) if isinstance(v, str) else v for k, v in body.items()}
    response = httpx.post(server.url + path, json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"].startswith(message.format(**exports)), error
    assert set(error) == {"message", "type", "param", "code"}
    assert httpx.get(f"{server.url}/health").status_code == 200
