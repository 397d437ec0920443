"""Megatron-lite GPT-2, written as an ordered list of layers.

The list (`gpt_layers`) is the single definition of the model: `model.stack.LayerStack` runs it as a
plain module and the pipeline builder hands the same specs to DeepSpeed's PipelineModule. So every
layer takes one activation and returns one (a tensor, or under document masking the tuple (tensor,
positions): model/documents.py), initializes itself (GPT-2 init) in its constructor, and the LM head is
the token embedding reused through a TiedLayerSpec.
"""
import torch
import torch.nn as nn
from deepspeed.pipe import LayerSpec, TiedLayerSpec

from model.config import ModelConfig
from model.documents import hidden_and_positions, with_positions
from model.layers import (
    MLP,
    FinalLayerNorm,
    TokenEmbedding,
    causal_attention,
    init_weights,
    lm_head,
    merge_heads,
    normal_init,
)


class PositionEmbedding(nn.Module):
    """Learned positions: the window's (0, 1, ...), or each token's position within its document."""

    def __init__(self, block_size: int, n_embd: int, dropout: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(block_size, n_embd))
        normal_init(self.weight)
        self.drop = nn.Dropout(dropout)

    def forward(self, inputs):
        x, positions = hidden_and_positions(inputs)
        at = self.weight[: x.size(1)] if positions is None else self.weight[positions]
        return with_positions(self.drop(x + at), positions)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool):
        super().__init__()
        self.head_dim = n_embd // n_head
        self.dropout = dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)  # fused: one GEMM for q, k and v
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_drop = nn.Dropout(dropout)
        self.core = causal_attention  # model/sequence_parallel.py swaps it for the sequence-parallel one

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, -1, self.head_dim).permute(2, 0, 3, 1, 4)
        y = self.core(q, k, v, self.dropout if self.training else 0.0, positions)
        return self.resid_drop(self.proj(merge_heads(y)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, n_embd: int, n_head: int, mlp_hidden: int, n_layer: int, dropout: float, bias: bool):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, mlp_hidden, dropout, bias)
        init_weights(self, n_layer, residual=("attn.proj.weight", "mlp.proj.weight"))

    def forward(self, inputs):
        x, positions = hidden_and_positions(inputs)
        x = x + self.attn(self.ln_1(x), positions)
        return with_positions(x + self.mlp(self.ln_2(x)), positions)


def gpt_layers(cfg: ModelConfig) -> list:
    """Embedding, position embedding, n_layer blocks, final LayerNorm, tied LM head."""
    embed = dict(padded_vocab_size=cfg.padded_vocab_size, n_embd=cfg.n_embd)
    return [
        TiedLayerSpec("embed", TokenEmbedding, **embed),
        LayerSpec(PositionEmbedding, cfg.block_size, cfg.n_embd, cfg.dropout),
        *[LayerSpec(Block, cfg.n_embd, cfg.n_head, cfg.mlp_hidden, cfg.n_layer, cfg.dropout, cfg.bias)
          for _ in range(cfg.n_layer)],
        LayerSpec(FinalLayerNorm, cfg.n_embd, bias=cfg.bias),
        TiedLayerSpec("embed", TokenEmbedding, **embed, forward_fn=lm_head),
    ]
