"""Megatron-lite GPT-2, written as an ordered list of layers.

The list (`gpt_layers`) is the single definition of the model: `model.stack.LayerStack` runs it as a
plain module and the pipeline builder hands the same specs to DeepSpeed's PipelineModule. So every
layer takes one tensor and returns one tensor, initializes itself (GPT-2 init) in its constructor,
and the LM head is the token embedding reused through a TiedLayerSpec.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from deepspeed.runtime.zero import GatheredParameters

from model.config import ModelConfig
from model.tensor_parallel import COLUMN, ROW, SINGLE, TensorParallel, VocabParallelEmbedding, parallelize, vocab_logits

INIT_STD = 0.02


def init_weights(module: nn.Module, n_layer: int, residual: tuple) -> None:
    """GPT-2 init, shared by the GPT and Llama blocks: matrices N(0, 0.02), the residual projections
    (names ending in `residual`) scaled by 1/sqrt(2 x n_layer), one per residual add; biases zero; norm
    weights keep their ones."""
    # Under ZeRO-3's zero.Init each nn.Linear is partitioned as soon as its own constructor returns,
    # so re-initializing it here needs the full tensors back (a no-op without ZeRO-3).
    with GatheredParameters(list(module.parameters()), modifier_rank=0):
        for name, p in module.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif name.endswith(residual):
                nn.init.normal_(p, mean=0.0, std=INIT_STD / math.sqrt(2 * n_layer))
            elif p.dim() == 2:
                nn.init.normal_(p, mean=0.0, std=INIT_STD)


def normal_init(weight: torch.Tensor) -> None:
    nn.init.normal_(weight, mean=0.0, std=INIT_STD)


class TokenEmbedding(VocabParallelEmbedding):
    """Token embedding (split by vocabulary under tensor parallelism); its weight doubles as the LM head.
    Kept alone in its module because TiedLayerSpec ties only `weight` across pipeline stages: anything
    else here would go stale."""

    def __init__(self, padded_vocab_size: int, n_embd: int, tp: TensorParallel = SINGLE):
        super().__init__(padded_vocab_size, n_embd, tp, normal_init)


def lm_head(embedding: TokenEmbedding, x: torch.Tensor) -> torch.Tensor:
    """Logits over the padded vocabulary (this rank's slice of it) through the tied embedding weight."""
    return vocab_logits(x, embedding.weight, embedding.tp)


class PositionEmbedding(nn.Module):
    def __init__(self, block_size: int, n_embd: int, dropout: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(block_size, n_embd))
        nn.init.normal_(self.weight, mean=0.0, std=INIT_STD)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(x + self.weight[: x.size(1)])


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"model.n_embd={n_embd} is not divisible by model.n_head={n_head}")
        self.head_dim = n_embd // n_head
        self.dropout = dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)  # fused: one GEMM for q, k and v
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # -1: the heads this rank holds (all of them, or its share under tensor parallelism)
        q, k, v = self.qkv(x).view(B, T, 3, -1, self.head_dim).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(B, T, -1)))


class MLP(nn.Module):
    def __init__(self, n_embd: int, hidden: int, dropout: float, bias: bool):
        super().__init__()
        self.fc = nn.Linear(n_embd, hidden, bias=bias)
        self.proj = nn.Linear(hidden, n_embd, bias=bias)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x), approximate="tanh")))


# Tensor parallelism (model/tensor_parallel.py): q|k|v split by heads, the MLP's hidden features split, each
# pair closed by a row-parallel projection.
BLOCK_SPLITS = {"attn.qkv": (COLUMN, 3), "attn.proj": ROW, "mlp.fc": COLUMN, "mlp.proj": ROW}


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, n_embd: int, n_head: int, mlp_hidden: int, n_layer: int, dropout: float, bias: bool,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, mlp_hidden, dropout, bias)
        init_weights(self, n_layer, residual=("attn.proj.weight", "mlp.proj.weight"))
        parallelize(self, BLOCK_SPLITS, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def gpt_layers(cfg: ModelConfig, tp: TensorParallel = SINGLE) -> list:
    """Embedding, position embedding, n_layer blocks, final LayerNorm, tied LM head."""
    embed = dict(padded_vocab_size=cfg.padded_vocab_size, n_embd=cfg.n_embd, tp=tp)
    return [
        TiedLayerSpec("embed", TokenEmbedding, **embed),
        LayerSpec(PositionEmbedding, cfg.block_size, cfg.n_embd, cfg.dropout),
        *[LayerSpec(Block, cfg.n_embd, cfg.n_head, cfg.mlp_hidden, cfg.n_layer, cfg.dropout, cfg.bias, tp)
          for _ in range(cfg.n_layer)],
        LayerSpec(nn.LayerNorm, cfg.n_embd, bias=cfg.bias),
        TiedLayerSpec("embed", TokenEmbedding, **embed, forward_fn=lm_head),
    ]
