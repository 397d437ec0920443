"""Llama (RMSNorm, rotary position embeddings, SwiGLU, grouped-query attention), as an ordered list of layers.

Same conventions as model/gpt.py, whose token embedding and init it shares: one tensor in and out of
every layer, so the list builds the plain module and the PipelineModule alike; no biases; the LM head is
its own matrix unless `model.tie_embeddings`, then the token embedding through a TiedLayerSpec (tied
across the first and last pipeline stage). Projections are separate nn.Linear modules (q, k, v, o; gate,
up, down) so tensor parallelism can split them column- or row-wise. RoPE follows Hugging Face's layout
(the two halves of each head rotate together), so its checkpoints load without permuting q and k.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, TiedLayerSpec

from model.config import ModelConfig
from model.gpt import TokenEmbedding, init_weights, lm_head, normal_init
from model.tensor_parallel import COLUMN, ROW, SINGLE, TensorParallel, VocabParallelHead, parallelize


def check_llama(cfg: ModelConfig) -> None:
    """Shapes RoPE and grouped-query attention cannot take; ValueError naming the fix."""
    if cfg.n_embd % cfg.n_head:
        raise ValueError(f"model.n_embd={cfg.n_embd} is not divisible by model.n_head={cfg.n_head}")
    if cfg.n_head % cfg.kv_heads:
        raise ValueError(f"model.n_kv_head={cfg.kv_heads} does not divide model.n_head={cfg.n_head}: each key/value "
                         f"head serves a whole group of query heads (choose a divisor of {cfg.n_head})")
    if cfg.head_dim % 2:
        raise ValueError(f"head size n_embd / n_head = {cfg.head_dim} is odd: rotary embeddings rotate pairs of "
                         f"dimensions, so choose model.n_embd and model.n_head with an even quotient")


def rope_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies theta^(-2i/d), with Llama 3.1's scaling when rope_scale_factor is set: long
    wavelengths divided by the factor, short ones kept, a smooth blend between."""
    d = cfg.head_dim
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


def rope_tables(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, (len(positions), head_dim), computed in fp32."""
    angles = torch.outer(positions.float(), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (batch, heads, time, head_dim) by position: dimension i pairs with i + head_dim / 2."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.dropout = cfg.dropout
        self.q = nn.Linear(cfg.n_embd, cfg.n_head * cfg.head_dim, bias=False)
        self.k = nn.Linear(cfg.n_embd, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v = nn.Linear(cfg.n_embd, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o = nn.Linear(cfg.n_head * cfg.head_dim, cfg.n_embd, bias=False)
        cos, sin = rope_tables(rope_frequencies(cfg), torch.arange(cfg.block_size))
        # Derived from the config, never checkpointed. DeepSpeed's bf16 casts them as Hugging Face does.
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # -1: the heads this rank holds (all, or its share of the query and of the key/value heads)
        q = self.q(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        cos, sin = self.cos[:T].to(x.dtype), self.sin[:T].to(x.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # enable_gqa: query head h reads key/value head h // (n_head / n_kv_head), without copying them.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0,
                                           enable_gqa=k.size(1) != q.size(1))
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, n_embd: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(n_embd, hidden, bias=False)
        self.up = nn.Linear(n_embd, hidden, bias=False)
        self.down = nn.Linear(hidden, n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


# Tensor parallelism (model/tensor_parallel.py): query and key/value heads split alike (each rank keeps whole
# groups of grouped-query attention), the SwiGLU's hidden features split, o and down row-parallel.
BLOCK_SPLITS = {"attn.q": COLUMN, "attn.k": COLUMN, "attn.v": COLUMN, "attn.o": ROW,
                "mlp.gate": COLUMN, "mlp.up": COLUMN, "mlp.down": ROW}


class LlamaBlock(nn.Module):
    """Pre-RMSNorm block: x + attention(norm(x)), then + SwiGLU(norm(x))."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg.n_embd, cfg.mlp_hidden)
        init_weights(self, cfg.n_layer, residual=("attn.o.weight", "mlp.down.weight"))
        parallelize(self, BLOCK_SPLITS, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class LMHead(VocabParallelHead):
    """The untied output matrix over the padded vocabulary (split by vocabulary under tensor parallelism)."""

    def __init__(self, n_embd: int, padded_vocab_size: int, tp: TensorParallel = SINGLE):
        super().__init__(n_embd, padded_vocab_size, tp, normal_init)


def llama_layers(cfg: ModelConfig, tp: TensorParallel = SINGLE) -> list:
    """Token embedding, n_layer blocks, final RMSNorm, LM head (tied to the embedding if asked)."""
    check_llama(cfg)
    embed = dict(padded_vocab_size=cfg.padded_vocab_size, n_embd=cfg.n_embd, tp=tp)
    if cfg.tie_embeddings:
        first, head = (TiedLayerSpec("embed", TokenEmbedding, **embed),
                       TiedLayerSpec("embed", TokenEmbedding, **embed, forward_fn=lm_head))
    else:
        first, head = LayerSpec(TokenEmbedding, **embed), LayerSpec(LMHead, cfg.n_embd, cfg.padded_vocab_size, tp)
    return [first, *[LayerSpec(LlamaBlock, cfg, tp) for _ in range(cfg.n_layer)],
            LayerSpec(nn.RMSNorm, cfg.n_embd, eps=cfg.norm_eps), head]
