"""Attention kept inside each document of a packed window.

A batch under document masking carries, beside its token ids, each token's position within its document
(data/documents.py derives them from the delimiters): a position of 0 starts a document. The layers pass
(hidden states, positions) along as one tuple, which PipelineModule sends between stages like any
activation; `hidden_and_positions` and `with_positions` are the two ends of that convention. Without
document masking a layer's input is the tensor alone and nothing here runs.

Two kernels compute the same thing, chosen by `document_kernel`:
- "dense": scaled_dot_product_attention with a block-diagonal causal boolean mask, (batch, 1, T, T), built
  per attention call. Runs everywhere, forward and backward, with dropout; the backward keeps the mask,
  converted to the compute dtype: T entries a token a block (training/memory_plan.py counts them).
- "flex": FlexAttention with a block mask that never materialises the T x T mask (torchtitan's way), compiled.
  On CUDA only: torch has no FlexAttention backward on the CPU. No dropout.
"""
import functools

import torch
import torch.nn.functional as F


def hidden_and_positions(inputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A layer's input: the tensor alone, or (tensor, positions) under document masking."""
    return inputs if isinstance(inputs, tuple) else (inputs, None)


def with_positions(x: torch.Tensor, positions: torch.Tensor | None):
    """A layer's output in the form its input came in."""
    return x if positions is None else (x, positions)


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """(batch, T) document index of each token within its window: one more at every position 0."""
    return (positions == 0).cumsum(dim=1)


def dense_document_mask(positions: torch.Tensor) -> torch.Tensor:
    """(batch, 1, T, T) boolean: query t may attend to key s iff s <= t and both are in one document."""
    ids = document_ids(positions)
    T = positions.size(1)
    causal = torch.ones(T, T, dtype=torch.bool, device=positions.device).tril()
    return (ids.unsqueeze(2) == ids.unsqueeze(1)).logical_and_(causal).unsqueeze(1)


def document_kernel(device_type: str, dropout: float) -> str:
    """"flex" where FlexAttention trains (CUDA) and no attention dropout is asked for, else "dense"."""
    return "flex" if device_type == "cuda" and dropout == 0.0 else "dense"


KERNEL_NAMES = {"flex": "FlexAttention block mask (compiled; no T x T mask)",
                "dense": "scaled_dot_product_attention with a dense block-diagonal mask"}


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                       dropout: float) -> torch.Tensor:
    """Causal attention within documents, (batch, heads, T, head_dim) in and out; fewer key/value heads than
    query heads is grouped-query attention."""
    if document_kernel(q.device.type, dropout) == "flex":
        return flex_document_attention(q, k, v, positions)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=dense_document_mask(positions), dropout_p=dropout,
                                          enable_gqa=k.size(1) != q.size(1))


def flex_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            positions: torch.Tensor) -> torch.Tensor:
    from torch.nn.attention.flex_attention import create_block_mask

    ids = document_ids(positions)

    def same_document_causal(b, h, q_index, kv_index):
        return (ids[b, q_index] == ids[b, kv_index]) & (q_index >= kv_index)

    B, _, T, _ = q.shape
    block_mask = create_block_mask(same_document_causal, B, None, T, T, device=q.device)
    return _flex(q.device.type)(q, k, v, block_mask=block_mask, enable_gqa=k.size(1) != q.size(1))


@functools.cache
def _flex(device_type: str):
    """FlexAttention compiled on CUDA: eager, it materialises the scores. The CPU (forward only, for the GPU
    tier's check of this path against the dense mask) runs it eager."""
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=False) if device_type == "cuda" else flex_attention
