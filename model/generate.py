"""Autoregressive generation: how a sequence draws its next token (Sampling, choose), and decoders that give the
next-token logits of several sequences at once: `CachedDecoder` through a key/value cache (model/kv_cache.py), a
token a step; `WindowDecoder` for a model that cannot cache (a pipeline, sequence-parallel ranks, the encoder),
by a forward pass over the whole window for every token. Both read a sequence the same way, so they draw the same
tokens: its last block_size tokens (a longer one slides, dropping its oldest token and filling the cache again),
each at its position within its document when `documents` says where documents start (data/documents.py), else
at its index in the window. With `adapters` (model/lora_batch.py), each sequence runs through the LoRA adapter it
started with, or through none.
"""
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from model.kv_cache import KVCache, attention_modules
from model.prefix_cache import PrefixCache

DTYPES = ("auto", "fp32", "bf16")  # a command's --dtype


def generation_dtype(device: str, dtype: str) -> torch.dtype:
    """The weights' dtype of --dtype (one of DTYPES): auto is bf16 on a GPU, fp32 on the CPU."""
    return torch.bfloat16 if dtype == "bf16" or (dtype == "auto" and device != "cpu") else torch.float32


class SamplingError(ValueError):
    """A sampling setting out of range; `setting` names it."""

    def __init__(self, setting: str, message: str):
        super().__init__(message)
        self.setting = setting


@dataclass(frozen=True)
class Sampling:
    """How one sequence draws its tokens, each option as OpenAI's and vLLM's APIs mean it, applied in vLLM's order:
    min_tokens, logit_bias and the penalties change the logits (`shaped`); greedy takes the most likely token there;
    else the logits are divided by the temperature and the token drawn among min_p's, top_k's and top_p's."""
    max_new_tokens: int
    temperature: float = 1.0  # 0: the most likely token
    top_k: int | None = None  # draw among the k most likely only
    top_p: float = 1.0  # draw among the fewest most likely tokens whose probabilities add up to top_p
    stop_ids: tuple = ()  # a drawn id that ends the sequence (an end of turn or of text), kept as its last token
    min_p: float = 0.0  # draw among the tokens at least min_p times as likely as the most likely one
    repetition_penalty: float = 1.0  # a token of the prompt or the answer: its logit divided by it (times it if < 0)
    frequency_penalty: float = 0.0  # taken from a token's logit once for each time the answer holds it
    presence_penalty: float = 0.0  # taken from the logit of each token the answer holds
    logit_bias: tuple = ()  # (id, bias) pairs, each bias added to its token's logit
    min_tokens: int = 0  # no stop id drawn before the answer has this many tokens

    def __post_init__(self):
        """A SamplingError naming the first setting out of range."""
        for ok, setting, rule in [
                (self.max_new_tokens >= 0, "max_new_tokens", ">= 0"),
                (self.temperature >= 0, "temperature", ">= 0 (0: greedy)"),
                (self.top_k is None or self.top_k >= 1, "top_k", "at least 1"),
                (0 < self.top_p <= 1, "top_p", "in (0, 1]"),
                (0 <= self.min_p <= 1, "min_p", "in [0, 1]"),
                (self.repetition_penalty > 0, "repetition_penalty", "above 0 (1: none)"),
                (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "in [-2, 2]"),
                (-2 <= self.presence_penalty <= 2, "presence_penalty", "in [-2, 2]"),
                (0 <= self.min_tokens <= self.max_new_tokens, "min_tokens",
                 f"in [0, {self.max_new_tokens}] (at most the tokens asked for)")]:
            if not ok:
                raise SamplingError(setting, f"{setting}={getattr(self, setting)}: must be {rule}")
        for token, bias in self.logit_bias:
            if token < 0:
                raise SamplingError("logit_bias", f"logit_bias: token id {token} must be at least 0")
            if not -100 <= bias <= 100:
                raise SamplingError("logit_bias", f"logit_bias: token {token}'s bias {bias} must be in [-100, 100]")


def shaped(logits: torch.Tensor, sampling: Sampling, prompt=(), answer=()) -> torch.Tensor:
    """The fp32 logits (vocab,) as min_tokens, logit_bias and the penalties leave them after `prompt` and the
    `answer` drawn so far: the stop ids ruled out while the answer is shorter than min_tokens; each bias added;
    the repetition penalty on every token of the prompt and the answer; the frequency and presence penalties
    (OpenAI's) on the answer's."""
    s, logits = sampling, logits.float()
    if len(answer) < s.min_tokens and s.stop_ids:
        logits = logits.index_fill(0, torch.tensor(s.stop_ids, device=logits.device), float("-inf"))
    if s.logit_bias:
        ids, biases = zip(*s.logit_bias)
        logits = logits.index_add(0, torch.tensor(ids, device=logits.device),
                                  torch.tensor(biases, dtype=logits.dtype, device=logits.device))
    if s.repetition_penalty != 1:
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[torch.tensor([*prompt, *answer], dtype=torch.long, device=logits.device)] = True
        penalized = torch.where(logits > 0, logits / s.repetition_penalty, logits * s.repetition_penalty)
        logits = torch.where(seen, penalized, logits)
    if (s.frequency_penalty or s.presence_penalty) and answer:
        counts = torch.bincount(torch.tensor(answer, device=logits.device), minlength=logits.numel()).float()
        logits = logits - s.frequency_penalty * counts - s.presence_penalty * (counts > 0).float()
    return logits


def choose(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None, prompt=(),
           answer=()) -> int:
    """The next token from a row of logits over the real vocabulary (padding ids already cut off), after `prompt`
    and the tokens of the `answer` drawn so far."""
    logits = shaped(logits, sampling, prompt, answer)
    if sampling.temperature == 0:
        return int(logits.argmax())
    logits = logits / sampling.temperature
    if sampling.min_p:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < sampling.min_p * probs.max(), float("-inf"))
    if sampling.top_k is not None:
        kth = torch.topk(logits, min(sampling.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p < 1.0:
        ordered, order = probs.sort(descending=True)
        outside = ordered.cumsum(0) - ordered >= sampling.top_p  # the mass before it already reaches top_p
        probs = probs.scatter(0, order, ordered.masked_fill(outside, 0.0))
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """For each row of logits (rows, vocab) and its token: the token's log-probability and the `top` most likely
    tokens with theirs, from the fp32 log-softmax of the model's own logits (before temperature, top-k or top-p)."""
    scores = torch.log_softmax(logits.float(), dim=-1)
    chosen = scores.gather(1, torch.tensor(tokens, device=scores.device)[:, None])[:, 0].tolist()
    if not top:
        return [(score, []) for score in chosen]
    values, ids = scores.topk(min(top, scores.size(1)), dim=-1)
    return [(score, list(zip(i, v))) for score, i, v in zip(chosen, ids.tolist(), values.tolist())]


class WindowDecoder:
    """Next-token logits of up to `slots` sequences, each by a forward pass over its whole window.
    `forward` maps token ids (1, T) on `device`, or (ids, positions) when `documents` is given, to logits."""

    def __init__(self, forward, block_size: int, vocab_size: int, device: torch.device, slots: int = 1,
                 documents=None, adapters=None):
        self.forward, self.block_size, self.vocab_size, self.documents = forward, block_size, vocab_size, documents
        self.device, self.adapters = device, adapters
        self.windows: dict[int, list[int]] = {}
        self.adapter_of: dict[int, object] = {}  # each slot's adapter (None: the model alone)
        self.free = list(range(slots))

    def start(self, prompt: list[int], every: bool = False, adapter=None) -> tuple[int, torch.Tensor]:
        """A slot for a sequence beginning with `prompt` (at least one token) run through `adapter`, and its
        next-token logits; with `every`, the logits after each of the window's tokens, (tokens, vocab_size), the last
        row the next one's."""
        slot = self._claim(adapter)
        window = self.windows[slot] = list(prompt)[-self.block_size:]
        return slot, self._window_logits(slot, window, every)

    def fork(self, slot: int) -> int:
        """A new slot holding a copy of the slot's sequence: several samples of one prompt prefilled once."""
        new = self._claim(self.adapter_of[slot])
        self.windows[new] = list(self.windows[slot])
        return new

    def step(self, new: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Each slot's next-token logits (vocab_size,) after its sequence is extended by new[slot]."""
        out = {}
        for slot, tokens in new.items():
            window = self.windows[slot] = (self.windows[slot] + tokens)[-self.block_size:]
            out[slot] = self._window_logits(slot, window, every=False)
        return out

    def release(self, slot: int) -> None:
        del self.windows[slot], self.adapter_of[slot]
        self.free.append(slot)

    def _claim(self, adapter) -> int:
        if not self.free:
            raise RuntimeError("every slot holds a sequence")
        if adapter is not None and self.adapters is None:
            raise ValueError("an adapter for a decoder built without adapters")
        slot = self.free.pop(0)
        self.adapter_of[slot] = adapter
        return slot

    def _selected(self, slots: list[int]):
        """The model's passes inside run each of `slots`, in order, through its adapter."""
        return nullcontext() if self.adapters is None else self.adapters.selected([self.adapter_of[s] for s in slots])

    def _window_logits(self, slot: int, window: list[int], every: bool) -> torch.Tensor:
        ids = torch.tensor([window], device=self.device)
        with self._selected([slot]):
            logits = self.forward(ids if self.documents is None else (ids, self.positions(window)))
        logits = logits[0, :, :self.vocab_size]
        return logits if every else logits[-1]

    def positions(self, window: list[int]) -> torch.Tensor:
        """(1, len(window)) each token's position within its document, counted from the window's start."""
        if self.documents is None:
            return torch.arange(len(window), device=self.device)[None]
        return torch.from_numpy(self.documents.positions(np.array([window]))).to(self.device)


class CachedDecoder(WindowDecoder):
    """Next-token logits through a KVCache: a sequence's prompt goes through the model once (prefill), then each
    step feeds every sequence its one new token, together in one forward pass. `model` is the module whose
    attention the cache attaches to (a LayerStack); `forward` (default: the model) maps (ids, positions) to
    logits through it, passing LayerStack's last_position on. With a `prefix_cache` (model/prefix_cache.py), a
    prompt's beginning prefilled before is copied from there, not computed again."""

    def __init__(self, model: torch.nn.Module, block_size: int, vocab_size: int, slots: int = 1, documents=None,
                 forward=None, prefix_cache: PrefixCache | None = None, adapters=None):
        super().__init__(forward or model, block_size, vocab_size, next(model.parameters()).device, slots, documents,
                         adapters)
        self.model, self.cache, self.prefix_cache = model, KVCache(slots, block_size), prefix_cache
        self.attentions = attention_modules(model)
        self.window_positions: dict[int, list[int]] = {}

    def start(self, prompt: list[int], every: bool = False, adapter=None) -> tuple[int, torch.Tensor]:
        slot = self._claim(adapter)
        window = self.windows[slot] = list(prompt)[-self.block_size:]
        # Every position's logits need every position computed: such a prefill neither reads nor fills the cache.
        return slot, self._prefill(slot, window, every, self.prefix_cache if not every else None)

    def fork(self, slot: int) -> int:
        new = super().fork(slot)
        self.window_positions[new] = list(self.window_positions[slot])
        self.cache.copy(slot, new)
        return new

    def step(self, new: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        out, decoding = {}, {}
        for slot, tokens in new.items():
            if len(tokens) == 1 and 0 < len(self.windows[slot]) < self.block_size:
                decoding[slot] = tokens[0]
            else:  # a full window that slides: the kept tokens go through again
                window = self.windows[slot] = (self.windows[slot] + tokens)[-self.block_size:]
                out[slot] = self._prefill(slot, window, every=False, prefix_cache=None)
        if decoding:
            slots = list(decoding)
            positions = [self._next_position(slot, token) for slot, token in decoding.items()]
            for slot, token, position in zip(slots, decoding.values(), positions):
                self.windows[slot].append(token)
                self.window_positions[slot].append(position)
            logits = self._forward(slots, torch.tensor([[t] for t in decoding.values()], device=self.device),
                                   torch.tensor([[p] for p in positions], device=self.device))
            out.update(zip(slots, logits[:, -1]))
        return out

    def _prefill(self, slot: int, window: list[int], every: bool, prefix_cache: PrefixCache | None) -> torch.Tensor:
        """The slot's cache filled with the window from its start: the last position's logits, or every one's."""
        positions = self.positions(window)
        self.window_positions[slot] = positions[0].tolist()
        self.cache.free(slot)
        reused, adapter = 0, self.adapter_of[slot]
        root = None if adapter is None else ("adapter", adapter.serial)  # an adapter's keys and values are its own
        if prefix_cache is not None and (chain := prefix_cache.lookup(window, root)):
            reused = len(chain) * prefix_cache.block
            self.cache.write(slot, torch.cat([block.kv for block in chain], dim=3), positions[0, :reused])
        ids = torch.tensor([window[reused:]], device=self.device)
        logits = self._forward([slot], ids, positions[:, reused:], every)[0]
        if prefix_cache is not None:
            prefix_cache.store(window, lambda start, end: self.cache.read(slot, start, end), root)
        return logits if every else logits[-1]

    def release(self, slot: int) -> None:
        super().release(slot)
        self.cache.free(slot)
        del self.window_positions[slot]

    def _forward(self, slots: list[int], ids: torch.Tensor, positions: torch.Tensor,
                 every: bool = False) -> torch.Tensor:
        """The logits (rows, t, vocab_size) of each row's tokens, appended to its slot: t is 1, the last
        position's, unless `every`."""
        with self.cache.attached(self.attentions), self._selected(slots):
            logits = self.cache.forward(lambda inputs: self.forward(inputs, last_position=not every), slots, ids,
                                        positions)
            return logits[:, :, :self.vocab_size]

    def _next_position(self, slot: int, token: int) -> int:
        previous = self.windows[slot][-1]
        if self.documents is not None and self.documents.positions(np.array([[previous, token]]))[0, 1] == 0:
            return 0  # the token starts a document
        return self.window_positions[slot][-1] + 1


def decoder_for(model: torch.nn.Module, block_size: int, vocab_size: int, slots: int = 1, documents=None,
                forward=None, prefix_cache: PrefixCache | None = None, adapters=None) -> WindowDecoder:
    """A CachedDecoder where the model's attention can be cached (with the prefix cache, if given), else a
    WindowDecoder over `forward`."""
    if attention_modules(model):
        return CachedDecoder(model, block_size, vocab_size, slots, documents, forward, prefix_cache, adapters)
    return WindowDecoder(forward or model, block_size, vocab_size, next(model.parameters()).device, slots, documents,
                         adapters)


@torch.no_grad()
def generate(decoder: WindowDecoder, prompt: list[int], sampling: Sampling,
             generator: torch.Generator | None = None) -> list[int]:
    """The tokens drawn after `prompt`: max_new_tokens of them, or fewer up to and including a stop id."""
    return list(generated(decoder, prompt, sampling, generator))


def generated(decoder: WindowDecoder, prompt: list[int], sampling: Sampling,
              generator: torch.Generator | None = None):
    """generate's tokens one at a time, as each is drawn (a terminal chat prints them so)."""
    if sampling.max_new_tokens == 0:
        return
    slot, logits = decoder.start(prompt)
    out = []
    try:
        while len(out) < sampling.max_new_tokens:
            out.append(choose(logits, sampling, generator, prompt, out))
            yield out[-1]
            if out[-1] in sampling.stop_ids or len(out) == sampling.max_new_tokens:
                break
            logits = decoder.step({slot: [out[-1]]})[slot]
    finally:
        decoder.release(slot)
