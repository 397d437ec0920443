"""The encoder LM of PyTorch's "DDP + pipeline parallelism" tutorial, at 1B parameters, made causal.

Scaled token embedding + sinusoidal positions, n_layer x nn.TransformerEncoderLayer, a linear decoder
over the (padded) vocabulary. The tutorial passed no attention mask, so each position could see the
token it predicts; here every layer gets the causal mask. Like model/gpt.py it is an ordered list of
single-tensor layers, so the same list builds the plain module and the PipelineModule.
"""
import math

import torch
import torch.nn as nn
from deepspeed.pipe import LayerSpec

from model.config import ModelConfig

INIT_RANGE = 0.1  # the tutorial's uniform init for the embedding and decoder


class EncoderEmbedding(nn.Module):
    """Token embedding scaled by sqrt(d_model), plus fixed sinusoidal positions, then dropout."""

    def __init__(self, padded_vocab_size: int, d_model: int, block_size: int, dropout: float):
        super().__init__()
        self.embedding = nn.Embedding(padded_vocab_size, d_model)
        nn.init.uniform_(self.embedding.weight, -INIT_RANGE, INIT_RANGE)
        self.scale = math.sqrt(d_model)
        position = torch.arange(block_size).unsqueeze(1)
        frequency = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        table = torch.zeros(block_size, d_model)
        table[:, 0::2] = torch.sin(position * frequency)
        table[:, 1::2] = torch.cos(position * frequency)
        self.register_buffer("positions", table, persistent=False)  # derived, never checkpointed
        self.drop = nn.Dropout(dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embedding(idx) * self.scale
        return self.drop(x + self.positions[: idx.size(1)].to(x.dtype))


class CausalEncoderLayer(nn.TransformerEncoderLayer):
    """nn.TransformerEncoderLayer (post-LN, ReLU, as in the tutorial) that always attends causally."""

    def __init__(self, d_model: int, n_head: int, ffn_hidden: int, dropout: float):
        super().__init__(d_model, n_head, ffn_hidden, dropout, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.size(1)
        mask = torch.full((T, T), float("-inf"), device=x.device, dtype=x.dtype).triu(1)
        return super().forward(x, src_mask=mask, is_causal=True)


class Decoder(nn.Linear):
    def __init__(self, d_model: int, padded_vocab_size: int):
        super().__init__(d_model, padded_vocab_size)
        nn.init.uniform_(self.weight, -INIT_RANGE, INIT_RANGE)
        nn.init.zeros_(self.bias)


def encoder_layers(cfg: ModelConfig) -> list:
    vocab = cfg.padded_vocab_size
    return [
        LayerSpec(EncoderEmbedding, vocab, cfg.n_embd, cfg.block_size, cfg.dropout),
        *[LayerSpec(CausalEncoderLayer, cfg.n_embd, cfg.n_head, cfg.ffn_hidden, cfg.dropout)
          for _ in range(cfg.n_layer)],
        LayerSpec(Decoder, cfg.n_embd, vocab),
    ]
