"""The server's scheduler in one process, on a Llama with the key/value cache: one slot reused for prompt after
prompt starts each at an empty cache and draws what a fresh decoder draws; requests of one prompt admitted together
are prefilled once and draw what each draws alone with its seed; the log-probabilities of drawn tokens and of an
echoed prompt equal the full window's forward pass, alone and batched; work paused for (new weights) runs once the
running requests have finished and before any waiting one starts; a worker that dies ends every request it holds
and refuses every later one, reporting the failure once."""
import queue
import threading

import pytest
import torch

from model.config import ModelConfig
from model.generate import CachedDecoder, Sampling, WindowDecoder, generate
from model.kv_cache import KVCache
from model_checks import decisive_model
from serving.scheduler import Scheduler, SchedulerFailed, Sequence

LLAMA = ModelConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=64, block_size=32,
                    vocab_size=20)
GREEDY = Sampling(max_new_tokens=6, temperature=0)


@pytest.fixture(scope="module")
def model():
    return decisive_model(LLAMA, seed=3)


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


def test_one_prompt_admitted_four_times_is_prefilled_once_and_draws_as_each_alone(model, monkeypatch):
    prompt, sampling = [1, 5, 7, 2, 9, 4], Sampling(max_new_tokens=8, temperature=1.0)
    alone = [generate(CachedDecoder(model, LLAMA.block_size, LLAMA.vocab_size), prompt, sampling,
                      torch.Generator().manual_seed(seed)) for seed in range(10, 14)]
    assert len({tuple(a) for a in alone}) == 4  # the seeds draw apart: the comparison below can fail
    prefills, forward = [], KVCache.forward

    def recording(self, model, slots, tokens, positions):
        if tokens.size(1) > 1:
            prefills.append(slots)
        return forward(self, model, slots, tokens, positions)

    monkeypatch.setattr(KVCache, "forward", recording)
    scheduler = Scheduler(CachedDecoder(model, LLAMA.block_size, LLAMA.vocab_size, slots=4), slots=4, max_waiting=4)
    try:
        with scheduler.changed:  # all four in the queue before the scheduler's next step
            sequences = [scheduler.submit(Sequence(prompt, sampling, seed)) for seed in range(10, 14)]
        drawn = [[value.id for kind, value in events(s) if kind == "token"] for s in sequences]
    finally:
        scheduler.close()
    assert len(prefills) == 1 and drawn == alone


def test_logprobs_of_drawn_and_echoed_tokens_equal_the_full_windows_forward_alone_and_batched(model):
    prompts = [[1, 5, 7, 2, 9], [4, 4, 11, 3], [2, 3, 5, 7, 11, 13, 17]]
    window = WindowDecoder(model, LLAMA.block_size, LLAMA.vocab_size, torch.device("cpu"))
    for together in (1, 3):
        scheduler = Scheduler(CachedDecoder(model, LLAMA.block_size, LLAMA.vocab_size, slots=together),
                              slots=together, max_waiting=8)
        try:
            sequences = [scheduler.submit(Sequence(p, Sampling(max_new_tokens=6, temperature=temperature), seed=1,
                                                   logprobs=3, prompt_logprobs=2))
                         for p in prompts for temperature in (0, 1.0)]
            seen = [events(s) for s in sequences]
        finally:
            scheduler.close()
        for sequence, ran in zip(sequences, seen):
            drawn = [value for kind, value in ran if kind == "token"]
            prompt_scores = next(value for kind, value in ran if kind == "prompt")
            ids = sequence.prompt + [d.id for d in drawn]
            with torch.no_grad():
                slot, logits = window.start(ids, every=True)
            window.release(slot)
            expected = torch.log_softmax(logits.float(), dim=-1)
            scores = [(s, top) for s, top in prompt_scores] + [(d.logprob, d.top) for d in drawn]
            assert len(scores) == len(ids) - 1 and [len(top) for _, top in scores] == \
                [2] * (len(sequence.prompt) - 1) + [3] * len(drawn)
            for i, (score, top) in enumerate(scores):
                assert abs(score - float(expected[i, ids[i + 1]])) < 1e-5
                best = expected[i].topk(len(top))
                assert [t for t, _ in top] == best.indices.tolist()
                assert torch.allclose(torch.tensor([v for _, v in top]), best.values, atol=1e-5, rtol=0)


def test_new_weights_wait_for_the_running_request_and_come_before_the_waiting_one(model):
    decoder = CachedDecoder(model, LLAMA.block_size, LLAMA.vocab_size, slots=1)
    step, held, release = decoder.step, threading.Event(), threading.Event()

    def holding(new):
        held.set()
        release.wait(timeout=60)
        return step(new)

    decoder.step = holding
    order = []
    scheduler = Scheduler(decoder, slots=2, max_waiting=4,
                          observe=lambda event, request, _: order.append((event, request.prompt[0]))
                          if event != "token" else None)
    try:
        running = scheduler.submit(Sequence([1, 2, 3], GREEDY))
        assert held.wait(timeout=60)  # its first decode step is under way
        swapped = scheduler.pause_for(lambda: order.append("weights") or 42)
        waiting = scheduler.submit(Sequence([4, 5], GREEDY))
        release.set()
        assert swapped.result(timeout=60) == 42
        events(running), events(waiting)
    finally:
        scheduler.close()
    assert order == [("admitted", 1), ("finished", 1), "weights", ("admitted", 4), ("finished", 4)]


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
