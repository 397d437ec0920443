"""The pieces the architectures share: GPT-2 initialization, the token embedding, the LM head and the score head,
causal attention, rotary position embeddings, the final norms, and the two feed-forward networks (GELU and SwiGLU).

Plain modules with no parallel code: model/parallelize.py splits them after they are built. Under document
masking the layers pass (hidden states, positions) along (model/documents.py).
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.cpu_attention import cpu_causal_attention, has_cpu_kernel
from model.documents import document_attention, hidden_and_positions, with_positions

INIT_STD = 0.02


def normal_init(weight: torch.Tensor) -> None:
    if not weight.is_meta:
        nn.init.normal_(weight, mean=0.0, std=INIT_STD)


def init_weights(module: nn.Module, n_layer: int, residual: tuple) -> None:
    """GPT-2 init, shared by the GPT and Llama blocks: matrices N(0, 0.02), the residual projections
    (names ending in `residual`) scaled by 1/sqrt(2 x n_layer), one per residual add; biases zero; norm
    weights keep their ones. A model built on the meta device (to count or lay out its parameters) has no values
    to draw: torch's meta normal_ is a Python reference whose first call imports torch's compiler, 1.6 s of the
    start of every command that counts."""
    for name, p in module.named_parameters():
        if p.is_meta:
            continue
        if name.endswith("bias"):
            nn.init.zeros_(p)
        elif name.endswith(residual):
            nn.init.normal_(p, mean=0.0, std=INIT_STD / math.sqrt(2 * n_layer))
        elif p.dim() == 2:
            nn.init.normal_(p, mean=0.0, std=INIT_STD)


class TokenEmbedding(nn.Module):
    """Rows of the padded vocabulary. Kept alone in its module because TiedLayerSpec ties only `weight`
    across pipeline stages (anything else here would go stale) when its weight doubles as the LM head."""

    def __init__(self, padded_vocab_size: int, n_embd: int, init=normal_init):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(padded_vocab_size, n_embd))
        init(self.weight)

    def forward(self, inputs):
        idx, positions = hidden_and_positions(inputs)
        return with_positions(F.embedding(idx, self.weight), positions)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def lm_head(embedding: TokenEmbedding, x: torch.Tensor) -> torch.Tensor:
    """The tied LM head: logits over the padded vocabulary through the token embedding's weight."""
    return embedding.logits(x)


class LMHead(nn.Module):
    """An untied output matrix over the padded vocabulary (and a zero bias if asked)."""

    def __init__(self, n_embd: int, padded_vocab_size: int, init=normal_init, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(padded_vocab_size, n_embd))
        init(self.weight)
        self.bias = nn.Parameter(torch.zeros(padded_vocab_size)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ScoreHead(nn.Module):
    """A reward model's head in place of the LM head (model.head=score): one score per position, Linear(n_embd, 1)
    without a bias, initialized N(0, 0.02) as transformers' *ForSequenceClassification initializes its `score`
    (initializer_range). A row's score is read at its last token (training/objectives/reward.py)."""

    def __init__(self, n_embd: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, n_embd))
        normal_init(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float,
                     positions: torch.Tensor | None = None) -> torch.Tensor:
    """(batch, heads, time, head_dim) in and out. With fewer key/value heads than query heads (grouped-query
    attention), query head h reads key/value head h // (heads / kv_heads), without copying them. With
    positions (document masking), each token attends within its own document only. On a CPU, without dropout,
    model/cpu_attention.py's kernels (the keys and values repeated for grouped-query attention)."""
    if positions is not None:
        return document_attention(q, k, v, positions, dropout)
    if dropout == 0 and has_cpu_kernel(q):
        groups = q.size(1) // k.size(1)
        k, v = (k, v) if groups == 1 else (k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1))
        return cpu_causal_attention(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout,
                                          enable_gqa=k.size(1) != q.size(1))


def split_heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(batch, time, heads x head_dim) -> (batch, heads, time, head_dim). The heads are counted from the
    tensor: all of them, or the share a tensor-parallel rank holds."""
    B, T, _ = x.shape
    return x.view(B, T, -1, head_dim).transpose(1, 2)


def split_qkv(qkv: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v, each (batch, heads, time, head_dim), from a fused projection's (batch, time, q|k|v) (a
    tensor-parallel rank's: its heads of each). Split into thirds, not viewed as (.., 3, heads, head_dim) and
    permuted: the permute's backward stacks the three gradients and then copies them into the projection's
    layout, the split's writes them there once (one quickstart attention layer, forward and backward, 15% faster
    on a CPU; the same values)."""
    return tuple(split_heads(part, head_dim) for part in qkv.chunk(3, dim=-1))


def merge_heads(y: torch.Tensor) -> torch.Tensor:
    """The inverse of split_heads."""
    B, _, T, _ = y.shape
    return y.transpose(1, 2).reshape(B, T, -1)


def rope_frequencies(cfg) -> torch.Tensor:
    """Inverse frequencies theta^(-2i/d) of a ModelConfig's heads, with Llama 3.1's scaling when
    rope_scale_factor is set: long wavelengths divided by the factor, short ones kept, a smooth blend between."""
    d = cfg.head_width
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)
    if cfg.rope_scale_factor is None:
        return inv_freq
    factor, low, high, context = (cfg.rope_scale_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
                                  cfg.rope_original_context)
    wavelen = 2 * math.pi / inv_freq
    smooth = (context / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    return torch.where((wavelen >= context / high) & (wavelen <= context / low), blended, scaled)


def rope_buffers(cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the window's positions, (block_size, head_dim). On the meta device their shapes alone, as
    init_weights draws nothing there: torch's meta arithmetic runs Python references that import its compiler."""
    positions = torch.arange(cfg.block_size)
    if positions.is_meta:
        return torch.empty(cfg.block_size, cfg.head_width), torch.empty(cfg.block_size, cfg.head_width)
    return rope_tables(rope_frequencies(cfg), positions)


def rope_tables(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, (len(positions), head_dim), computed in fp32."""
    angles = torch.outer(positions.float(), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (batch, heads, time, head_dim) by position: dimension i pairs with i + head_dim / 2 (Hugging
    Face's layout, so its checkpoints load without permuting q and k). cos and sin are (time, head_dim), or
    (batch, 1, time, head_dim) for per-document positions."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


# sqrt(2 / pi) twice: 0.5 x (1 + tanh(u)) is x sigmoid(2u), the same function
GELU_SIGMOID_SCALE = 2 * math.sqrt(2 / math.pi)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation. When compiled, written through the sigmoid (in fp32): inductor's CPU code
    for tanh is 2-3 times slower than for the sigmoid (the baby GPT's compiled bf16 block, forward and
    backward, 9% slower on an AMX Xeon), while eager keeps aten's own kernel."""
    if not torch.compiler.is_compiling():
        return F.gelu(x, approximate="tanh")
    h = x.float()
    return (h * torch.sigmoid(GELU_SIGMOID_SCALE * (h + 0.044715 * h * h * h))).to(x.dtype)


# model.activation's GELUs (model/config.py)
GELU = {"gelu_tanh": gelu_tanh, "gelu": F.gelu}


class MLP(nn.Module):
    """GPT-2's feed-forward network: a GELU (model.activation) between two linear maps."""

    def __init__(self, n_embd: int, hidden: int, dropout: float, bias: bool, activation: str):
        super().__init__()
        self.fc = nn.Linear(n_embd, hidden, bias=bias)
        self.proj = nn.Linear(hidden, n_embd, bias=bias)
        self.drop = nn.Dropout(dropout)
        self.gelu = GELU[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.gelu(self.fc(x))))


class SwiGLU(nn.Module):
    """Llama's feed-forward network: down(silu(gate(x)) * up(x)), no biases."""

    def __init__(self, n_embd: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(n_embd, hidden, bias=False)
        self.up = nn.Linear(n_embd, hidden, bias=False)
        self.down = nn.Linear(hidden, n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class FinalLayerNorm(nn.LayerNorm):
    """The GPT's last norm, where the positions stop travelling with the hidden states: the head takes these
    alone."""

    def forward(self, inputs) -> torch.Tensor:
        return super().forward(hidden_and_positions(inputs)[0])


class FinalRMSNorm(nn.RMSNorm):
    """The Llama's last norm; see FinalLayerNorm."""

    def forward(self, inputs) -> torch.Tensor:
        return super().forward(hidden_and_positions(inputs)[0])
