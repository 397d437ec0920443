"""Continuous batching: concurrent requests share one model through a CachedDecoder of a fixed number of slots
(vLLM's scheduling, on fixed slots where vLLM pages its cache). A request joins the running batch at the next
step, its prompt prefilled into a free slot, and leaves the moment it finishes or is cancelled (its client went
away), freeing the slot for the next in the queue. The model runs on the scheduler's one thread; requests come
and go from any thread, each reading its tokens from its own queue as they are drawn.

Requests admitted in one step with the same prompt (one request's n samples, an RL group) are prefilled once and
the prompt's cache copied into each one's slot. Other work on the model runs on the same thread between two steps
(`between_steps`: reading new weights), or once the running requests have finished, none admitted meanwhile
(`pause_for`: swapping them in).

Every torch operation of a server runs on this one thread, the one that loaded the model (the server runs the
loop on its main thread: `run`). A second thread doing torch work has a second OpenMP team, and with more OpenMP
threads than cores libgomp stops spinning between parallel regions: a decode step of the Llama-124M shape on 2
cores takes 27-29 ms instead of 19-20 (fp32).

If that thread dies (a fault in the model, the device gone), every request it held and every later one is told
so at once ("failed", the reason): a server whose model cannot run must not accept requests it will never answer.
"""
import queue
import threading
import time
import traceback
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from model.generate import CachedDecoder, Sampling, choose, logprobs


class QueueFull(Exception):
    """Every slot is busy and the waiting line is at its bound."""


class SchedulerFailed(Exception):
    """The scheduler's thread died: no request will be answered again."""


class Drawn(NamedTuple):
    """A token drawn, with its log-probability and the `logprobs` most likely tokens' [(id, log-probability)]
    where its sequence asked for them."""
    id: int
    logprob: float | None = None
    top: tuple | list = ()


@dataclass(eq=False)
class Sequence:
    """One sequence to generate: its events arrive on `events` as ("admitted", None) when it leaves the queue for a
    slot; ("prompt", [(log-probability, top)] of the prompt's tokens after its first) where `prompt_logprobs` asks;
    ("token", Drawn) for each token and finally ("done", reason), reason "stop" (a stop id drawn), "length"
    (max_new_tokens) or "cancelled"; or at any point ("failed", why) if the scheduler died. `logprobs` and
    `prompt_logprobs`: how many of the most likely tokens to give beside each token's own score (None: no scores).
    `adapter`: the LoRA adapter it runs through (model/lora_batch.py), None for the model alone. `constraint`: the
    grammar its answer follows (serving/structured.py), None for free text."""
    prompt: list[int]
    sampling: Sampling
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    adapter: object = None
    constraint: object = None
    events: queue.Queue = field(default_factory=queue.Queue)
    submitted: float = field(default_factory=time.monotonic)
    cancelled: str | None = None  # why it was stopped from outside
    answer: list[int] = field(default_factory=list)  # the tokens drawn so far
    pending: int | None = None  # the last token drawn, fed to the model at the next step
    generator: torch.Generator = field(default=None)


class Scheduler:
    def __init__(self, decoder: CachedDecoder, slots: int, max_waiting: int, observe=None, on_failure=None,
                 thread: bool = True):
        """observe(event, request, value): the metrics' hook ("admitted", "token", "finished"). on_failure(error):
        called once, on the scheduler's thread, if it dies (default: print the traceback). thread: run on a thread
        of its own, else the caller runs `run` on the thread it chooses."""
        self.decoder, self.slots, self.max_waiting = decoder, slots, max_waiting
        self.observe = observe or (lambda *_: None)
        self.on_failure = on_failure or traceback.print_exception
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}  # by slot
        self.admitting: list[Sequence] = []  # taken from the queue, their prompts being prefilled
        self.work: list[tuple[object, Future, bool]] = []  # (work, its future, whether no request may run)
        self.changed = threading.Condition()
        self.stopping = False
        self.failure: str | None = None  # why the scheduler's thread died
        self.thread = threading.Thread(target=self.run, name="scheduler", daemon=True) if thread else None
        if self.thread:
            self.thread.start()

    def submit(self, request: Sequence) -> Sequence:
        with self.changed:
            if self.failure:
                raise SchedulerFailed(self.failure)
            # Counted whole: a burst lands in the queue before the loop has moved any of it into a free slot.
            if len(self.running) + len(self.admitting) + len(self.waiting) >= self.slots + self.max_waiting:
                raise QueueFull(f"{self.slots} requests running and {len(self.waiting)} waiting")
            request.generator = torch.Generator().manual_seed(request.seed if request.seed is not None
                                                               else torch.seed())
            self.waiting.append(request)
            self.changed.notify()
        return request

    def cancel(self, request: Sequence, reason: str = "cancelled") -> None:
        """Stop a request (its client went away, or a stop string ended its text: `reason` "stop"); its slot is
        free from the next step on."""
        with self.changed:
            if not request.cancelled:
                request.cancelled = reason
            self.changed.notify()

    def stats(self) -> tuple[int, int]:
        """(requests waiting, slots in use)."""
        with self.changed:
            return len(self.waiting), len(self.running) + len(self.admitting)

    def between_steps(self, work) -> Future:
        """work() run on the scheduler's thread between two steps, the requests going on after it. The future holds
        what it returns or raises."""
        return self._queue_work(work, idle=False)

    def pause_for(self, work) -> Future:
        """work() run on the scheduler's thread once the requests running now have finished; those waiting are
        admitted after it."""
        return self._queue_work(work, idle=True)

    def close(self) -> None:
        with self.changed:
            self.stopping = True
            self.changed.notify()
        if self.thread:
            self.thread.join(timeout=30)

    def run(self) -> None:
        """The loop, on the calling thread, until close() or a failure."""
        try:
            self._loop()
        except BaseException as error:  # anything that ends the thread ends every request with it
            self._fail(error)

    def _fail(self, error: BaseException) -> None:
        with self.changed:
            self.failure = f"the model's worker failed ({type(error).__name__}: {error})"
            held = [*self.waiting, *self.admitting, *self.running.values()]
            work, self.work = self.work, []
            self.waiting.clear()
            self.admitting.clear()
            self.running.clear()
        for _, done, _ in work:
            done.set_exception(SchedulerFailed(self.failure))
        for request in held:
            request.events.put(("failed", self.failure))
            self.observe("finished", request, "failed")
        self.on_failure(error)

    @torch.no_grad()
    def _loop(self) -> None:
        while True:
            with self.changed:
                self.changed.wait_for(lambda: self.stopping or self.waiting or self.running or self.work)
                if self.stopping:
                    return
                cancelled = [(slot, r) for slot, r in self.running.items() if r.cancelled]
                admitted, pausing = [], any(idle for _, _, idle in self.work)
                while (self.waiting and not pausing
                       and len(self.running) - len(cancelled) + len(admitted) < self.slots):
                    request = self.waiting.popleft()
                    if request.cancelled:
                        request.events.put(("done", request.cancelled))
                        self.observe("finished", request, request.cancelled)
                    else:
                        request.events.put(("admitted", None))
                        admitted.append(request)
                self.admitting = list(admitted)
            for slot, request in cancelled:
                self._finish(slot, request, request.cancelled)
            self._run_work(idle=not self.running and not admitted)
            prefilled = {}
            started = [(request, *self._start(request, prefilled)) for request in admitted]
            for request, slot, logits in started:  # after every start: a drawn stop frees a slot a fork copies
                self.observe("admitted", request, None)
                self._draw(slot, request, logits)
            feeding = {slot: [r.pending] for slot, r in self.running.items()
                       if r.pending is not None and r not in admitted}
            if feeding:
                logits = self.decoder.step(feeding)
                for slot in feeding:
                    self._draw(slot, self.running[slot], logits[slot])

    def _start(self, request: Sequence, prefilled: dict) -> tuple[int, torch.Tensor]:
        """The request's slot and the logits of its first draw: its prompt prefilled, or copied from the slot of an
        earlier request of this step with the same prompt and adapter (`prefilled`, by both)."""
        every = request.prompt_logprobs is not None
        key = (tuple(request.prompt), every, request.adapter)
        if key in prefilled:
            source, logits = prefilled[key]
            slot = self.decoder.fork(source)
        else:
            slot, logits = prefilled[key] = self.decoder.start(request.prompt, every, request.adapter)
        with self.changed:
            self.running[slot] = request
            self.admitting.remove(request)
        if every:
            window = request.prompt[-len(logits):]
            request.events.put(("prompt", logprobs(logits[:-1], window[1:], request.prompt_logprobs)))
            logits = logits[-1]
        return slot, logits

    def _queue_work(self, work, idle: bool) -> Future:
        done = Future()
        with self.changed:
            if self.failure:
                raise SchedulerFailed(self.failure)
            self.work.append((work, done, idle))
            self.changed.notify()
        return done

    def _run_work(self, idle: bool) -> None:
        """The work that may run now: all between-steps work, and the pausing kind where no request runs."""
        with self.changed:
            due = [item for item in self.work if idle or not item[2]]
            self.work = [item for item in self.work if item not in due]
        for work, done, _ in due:
            try:
                done.set_result(work())
            except Exception as error:  # the caller's to report (a file that cannot be read); the scheduler goes on
                done.set_exception(error)

    def _draw(self, slot: int, request: Sequence, logits: torch.Tensor) -> None:
        constraint = request.constraint
        token = choose(logits if constraint is None else constraint.masked(logits), request.sampling,
                       request.generator, request.prompt, request.answer)
        request.answer.append(token)
        # The model's own log-probabilities, before the grammar (no -inf for a token it rules out).
        scores = () if request.logprobs is None else logprobs(logits[None], [token], request.logprobs)[0]
        request.events.put(("token", Drawn(token, *scores)))
        self.observe("token", request, token)
        if token in request.sampling.stop_ids or (constraint is not None and constraint.advance(token)):
            self._finish(slot, request, "stop")
        elif len(request.answer) == request.sampling.max_new_tokens:
            self._finish(slot, request, "length")
        else:
            request.pending = token

    def _finish(self, slot: int, request: Sequence, reason: str) -> None:
        with self.changed:
            del self.running[slot]
        self.decoder.release(slot)
        request.pending = None
        request.events.put(("done", reason))
        self.observe("finished", request, reason)
