"""A key/value cache for generation: each attention layer keeps the keys and values of the tokens a sequence has
seen, so a new token costs one position's forward pass instead of the whole window's.

The model has no caching code. Its attention modules call `self.core(q, k, v, dropout, positions)` (the seam
model/sequence_parallel.py uses too); while `KVCache.attached(...)` is open, each core writes the new keys and
values into the cache and attends over all that the sequence holds. The input goes in as (tokens, positions),
the document-masking convention (model/documents.py): each new token's position within its document, which
learned positions and RoPE read, so a sequence goes on where its cache ends.

The cache has a fixed number of slots of block_size tokens, each slot a sequence with its own length: sequences
of different lengths decode together, a token each a step, with no padding. A token attends to the earlier
tokens of its own document (a position of 0 starts the next one), so a prompt of several documents is masked as
training masked it. Grouped-query attention caches its key/value heads only.
"""
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from model.layers import causal_attention


def attention_modules(model: torch.nn.Module) -> list:
    """The modules whose attention a cache can take over: those running the plain causal core."""
    return [m for m in model.modules() if getattr(m, "core", None) is causal_attention]


def cache_bytes(cfg, slots: int, block_size: int, dtype: torch.dtype) -> int:
    """What a cache for the model of `cfg` (a ModelConfig) holds once every attention layer has written: the keys and
    values of `slots` x `block_size` positions at its key/value heads, and each position's document index."""
    return slots * block_size * (2 * cfg.n_layer * cfg.kv_heads * cfg.head_width * dtype.itemsize + 8)


class KVCache:
    def __init__(self, slots: int, block_size: int):
        self.slots, self.block_size = slots, block_size
        self.lengths = [0] * slots  # tokens cached in each slot
        self.keys: list[torch.Tensor] = []  # per attention layer: (slots, kv_heads, block_size, head_dim)
        self.values: list[torch.Tensor] = []
        self.documents = None  # (slots, block_size): the document index of each cached token
        self._pass = None  # the forward pass under way: where its tokens go, what they may attend to

    def free(self, slot: int) -> None:
        self.lengths[slot] = 0

    def read(self, slot: int, start: int, end: int) -> torch.Tensor:
        """A copy of the keys and values of the slot's tokens start..end: (2, layers, kv_heads, end - start,
        head_dim)."""
        return torch.stack([torch.stack([k[slot, :, start:end] for k in self.keys]),
                            torch.stack([v[slot, :, start:end] for v in self.values])])

    def write(self, slot: int, kv: torch.Tensor, positions: torch.Tensor) -> None:
        """The slot's first tokens made those whose keys and values `kv` holds (as `read` gives them), at
        `positions` (n,) within their documents; the slot holds those n tokens and nothing after."""
        n = kv.size(3)
        for layer, (k, v) in enumerate(zip(self.keys, self.values)):
            k[slot, :, :n] = kv[0, layer]
            v[slot, :, :n] = kv[1, layer]
        self.documents[slot, :n] = (positions == 0).cumsum(0)  # as forward numbers them from an empty slot
        self.lengths[slot] = n

    def copy(self, source: int, target: int) -> None:
        """The target slot made a copy of the source's tokens (one prompt's prefill shared by several samples)."""
        n = self.lengths[source]
        for k, v in zip(self.keys, self.values):
            k[target, :, :n] = k[source, :, :n]
            v[target, :, :n] = v[source, :, :n]
        if self.documents is not None:
            self.documents[target] = self.documents[source]
        self.lengths[target] = n

    @contextmanager
    def attached(self, attentions: list):
        """The cores of `attentions` (attention_modules of a model) swapped for this cache's while the block runs."""
        if not attentions:
            raise ValueError("the model has no attention core to cache (a sequence-parallel or encoder model)")
        for layer, module in enumerate(attentions):
            module.core = _CachedCore(self, layer)
        try:
            yield
        finally:
            for module in attentions:
                module.core = causal_attention

    def forward(self, model, slots: list[int], tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The logits (rows, t, vocab) of `tokens` (rows, t), appended to each row's slot after its cached tokens,
        at `positions` (rows, t) within their documents; `model` maps (tokens, positions) to logits and runs
        with this cache attached."""
        rows, t = tokens.shape
        starts = torch.tensor([self.lengths[s] for s in slots], device=tokens.device)
        if int(starts.max()) + t > self.block_size:
            raise ValueError(f"a slot would hold more than block_size={self.block_size} tokens")
        slot_index = torch.tensor(slots, device=tokens.device)
        written = starts[:, None] + torch.arange(t, device=tokens.device)  # (rows, t): where the new tokens go
        if self.documents is None:
            self.documents = torch.zeros(self.slots, self.block_size, dtype=torch.long, device=tokens.device)
        # A row goes on in its last cached token's document; each position 0 starts the next.
        last = self.documents[slot_index, (starts - 1).clamp(min=0)] * (starts > 0)
        documents = last[:, None] + (positions == 0).cumsum(dim=1)
        self.documents[slot_index[:, None], written] = documents
        span = int(starts.max()) + t
        # Rows in consecutive slots (a batch that came in together) read their cache as a view, not a gathered copy.
        read = slice(slots[0], slots[0] + rows) if slots == list(range(slots[0], slots[0] + rows)) else slot_index
        self._pass = (slot_index, read, written, span, *self._mask(slot_index, written, span, documents))
        try:
            logits = model((tokens, positions))
        finally:
            self._pass = None
        for s in slots:
            self.lengths[s] += t
        return logits

    def _mask(self, slot_index, written, span: int, documents) -> tuple[torch.Tensor | None, bool]:
        """(the attention mask, (rows, 1, t, span), or None; whether attention is plainly causal). One sequence
        in one document needs no mask: a prefill from its start is causal, a token a step sees all before it."""
        one_document = bool((self.documents[slot_index, 0] == documents[:, -1]).all())
        if slot_index.numel() == 1 and one_document and (int(written[0, 0]) == 0 or written.size(1) == 1):
            return None, written.size(1) > 1
        keys = torch.arange(span, device=written.device)
        mask = (keys <= written[:, :, None]) & (self.documents[slot_index, :span][:, None, :] == documents[:, :, None])
        return mask.unsqueeze(1), False

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One layer's attention of the pass under way: (rows, heads, t, head_dim) in and out."""
        slot_index, read, written, span, mask, causal = self._pass
        if layer == len(self.keys):  # the first pass through this layer: its tensors, at its heads and dtype
            shape = (self.slots, k.size(1), self.block_size, k.size(3))
            self.keys.append(k.new_zeros(shape))
            self.values.append(v.new_zeros(shape))
        cached_k, cached_v = self.keys[layer], self.values[layer]
        if slot_index.numel() == 1:  # one sequence (a prefill, a lone stream): slices, no gathering copies
            slot, start = int(slot_index), int(written[0, 0])
            cached_k[slot, :, start:start + k.size(2)] = k[0]
            cached_v[slot, :, start:start + v.size(2)] = v[0]
            k, v = cached_k[slot:slot + 1, :, :span], cached_v[slot:slot + 1, :, :span]
        else:
            rows = slot_index[:, None]
            cached_k[rows, :, written] = k.transpose(1, 2)  # indexed (rows, t, heads, head_dim)
            cached_v[rows, :, written] = v.transpose(1, 2)
            k, v = cached_k[read, :, :span], cached_v[read, :, :span]
        if q.size(2) == 1 and q.device.type == "cpu" and q.dtype != torch.float32:
            return one_query_attention(q, k, v, mask)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              enable_gqa=k.size(1) != q.size(1))


def one_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """A decode step's attention, one query a row, as two matmuls and a softmax, in fp32. On a CPU in bf16,
    scaled_dot_product_attention's kernels take 2.4 ms for 16 rows of 12 heads over 300 keys where this takes 0.32:
    a step of 16 sequences at the Llama-124M shape 45 -> 25 ms, of one 13.9 -> 12.7 ms (2-core AMD EPYC). In fp32
    they are as fast. q (rows, heads, 1, head_dim); k, v (rows, kv_heads, keys, head_dim); mask (rows, 1, 1, keys)."""
    rows, heads, _, dim = q.shape
    grouped = q.view(rows, k.size(1), heads // k.size(1), dim)  # each key/value head's query heads
    scores = (grouped.float() @ k.float().transpose(-1, -2)) * dim ** -0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v.float()).to(v.dtype).view(rows, heads, 1, dim)


class _CachedCore:
    """An attention core that reads and writes one layer of a KVCache (dropout: generation runs in eval)."""

    def __init__(self, cache: KVCache, layer: int):
        self.cache, self.layer = cache, layer

    def __call__(self, q, k, v, dropout: float, positions=None) -> torch.Tensor:
        return self.cache.attend(self.layer, q, k, v)
