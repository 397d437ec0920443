"""The server's scheduler in one process, on a Llama with the key/value cache: one slot reused for prompt after
prompt starts each at an empty cache and draws what a fresh decoder draws; a worker that dies ends every request
it holds and refuses every later one, reporting the failure once."""
import queue
import threading

import pytest
import torch

from model import build_model
from model.config import ModelConfig
from model.generate import CachedDecoder, Sampling, generate
from model.kv_cache import KVCache
from serving.scheduler import Scheduler, SchedulerFailed, Sequence

LLAMA = ModelConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=64, block_size=32,
                    vocab_size=20)
GREEDY = Sampling(max_new_tokens=6, temperature=0)


@pytest.fixture(scope="module")
def model():
    model = build_model(LLAMA, seed=3).eval()
    with torch.no_grad():  # weights that make each next token clear: no near ties between batch shapes
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


def events(sequence: Sequence, timeout: float = 60) -> list:
    """The sequence's events up to its last ("done" or "failed")."""
    seen = []
    while not seen or seen[-1][0] not in ("done", "failed"):
        seen.append(sequence.events.get(timeout=timeout))
    return seen


def test_one_slot_reused_starts_each_prompt_at_an_empty_cache(model, monkeypatch):
    prompts = [[1, 5, 7, 2, 9], [4, 4, 11], [2, 3, 5, 7, 11, 13, 17], [8, 1]]
    expected = [generate(CachedDecoder(model, LLAMA.block_size, LLAMA.vocab_size), p, GREEDY) for p in prompts]
    cached_before_prefill = []
    forward = KVCache.forward

    def recording(self, model, slots, tokens, positions):
        if tokens.size(1) > 1:  # a prompt's prefill
            cached_before_prefill.append([self.lengths[s] for s in slots])
        return forward(self, model, slots, tokens, positions)

    monkeypatch.setattr(KVCache, "forward", recording)
    scheduler = Scheduler(CachedDecoder(model, LLAMA.block_size, LLAMA.vocab_size, slots=1), slots=1, max_waiting=8)
    try:
        drawn = []
        for prompt in prompts:  # one after another: each takes the slot the one before left
            seen = events(scheduler.submit(Sequence(prompt, GREEDY)))
            drawn.append([value.id for kind, value in seen if kind == "token"])
            assert seen[-1] == ("done", "length")
    finally:
        scheduler.close()
    assert cached_before_prefill == [[0]] * len(prompts)
    assert drawn == expected


def test_a_worker_that_dies_fails_what_it_holds_and_everything_after_once(model):
    decoder = CachedDecoder(model, LLAMA.block_size, LLAMA.vocab_size, slots=1)
    step, steps, release = decoder.step, [], threading.Event()

    def failing(new):
        steps.append(new)
        if len(steps) == 2:  # the second decode step of the running sequence, with another one waiting
            release.wait(timeout=60)
            raise RuntimeError("the device is gone")
        return step(new)

    decoder.step = failing
    failures = queue.Queue()
    scheduler = Scheduler(decoder, slots=1, max_waiting=4, on_failure=failures.put)
    try:
        running = scheduler.submit(Sequence([1, 2, 3], Sampling(max_new_tokens=20, temperature=0)))
        waiting = scheduler.submit(Sequence([4, 5], GREEDY))
        release.set()
        why = "the model's worker failed (RuntimeError: the device is gone)"
        ran = events(running)
        assert [kind for kind, _ in ran] == ["admitted", "token", "token", "failed"] and ran[-1][1] == why
        assert events(waiting) == [("failed", why)]
        assert scheduler.failure == why and scheduler.stats() == (0, 0)
        with pytest.raises(SchedulerFailed, match=r"the model's worker failed \(RuntimeError"):
            scheduler.submit(Sequence([6], GREEDY))
        error = failures.get(timeout=10)
        assert isinstance(error, RuntimeError) and failures.empty()
        assert not scheduler.thread.is_alive()
    finally:
        scheduler.close()
