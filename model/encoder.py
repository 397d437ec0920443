"""The encoder LM of PyTorch's "DDP + pipeline parallelism" tutorial, at 1B parameters, made causal.

Scaled token embedding + sinusoidal positions, n_layer x nn.TransformerEncoderLayer, a linear decoder
over the (padded) vocabulary. The tutorial passed no attention mask, so each position could see the
token it predicts; here every layer gets the causal mask. Like model/gpt.py it is an ordered list of
single-tensor layers, so the same list builds the plain module and the PipelineModule.

The layer is nn.TransformerEncoderLayer written out (its parameter names, initialization and post-LN
numerics): tensor parallelism splits its weights, and the library layer's fused inference path would read
them whole.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec

from model.architecture import Architecture
from model.config import ROPE_SETTINGS, ModelConfig
from model.layers import LMHead, ScoreHead, TokenEmbedding, causal_attention, merge_heads, split_qkv
from model.tensor_parallel import COLUMN, ROW, VOCAB

INIT_RANGE = 0.1  # the tutorial's uniform init for the embedding and decoder


def uniform_init(weight: torch.Tensor) -> None:
    if not weight.is_meta:  # nothing to draw there (model/layers.py, init_weights)
        nn.init.uniform_(weight, -INIT_RANGE, INIT_RANGE)


class EncoderEmbedding(nn.Module):
    """Token embedding scaled by sqrt(d_model), plus fixed sinusoidal positions, then dropout."""

    def __init__(self, padded_vocab_size: int, d_model: int, block_size: int, dropout: float):
        super().__init__()
        self.embedding = TokenEmbedding(padded_vocab_size, d_model, uniform_init)
        self.scale = math.sqrt(d_model)
        self.register_buffer("positions", torch.empty(block_size, d_model), persistent=False)  # never checkpointed
        self.init_buffers()
        self.drop = nn.Dropout(dropout)

    def init_buffers(self) -> None:
        """The sinusoidal table, in fp32 (its shape alone on the meta device: model/layers.py, init_weights;
        build_empty)."""
        block_size, d_model = self.positions.shape
        self.positions = table = torch.zeros(block_size, d_model)
        if not table.is_meta:
            position = torch.arange(block_size).unsqueeze(1)
            frequency = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
            table[:, 0::2] = torch.sin(position * frequency)
            table[:, 1::2] = torch.cos(position * frequency)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embedding(idx) * self.scale
        return self.drop(x + self.positions[: idx.size(1)].to(x.dtype))


class SelfAttention(nn.Module):
    """nn.MultiheadAttention's parameters (in_proj_weight = q|k|v, in_proj_bias, out_proj), attending
    causally through scaled_dot_product_attention."""

    def __init__(self, reference: nn.MultiheadAttention):
        super().__init__()
        self.head_dim, self.dropout = reference.head_dim, reference.dropout
        self.in_proj_weight, self.in_proj_bias = reference.in_proj_weight, reference.in_proj_bias
        self.out_proj = reference.out_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = F.linear(x, self.in_proj_weight, self.in_proj_bias)  # the whole sequence's (see the GPT's attention)
        q, k, v = split_qkv(qkv, self.head_dim)
        y = causal_attention(q, k, v, self.dropout if self.training else 0.0)
        return self.out_proj(merge_heads(y))


class CausalEncoderLayer(nn.Module):
    """nn.TransformerEncoderLayer (post-LN, ReLU, as in the tutorial) that always attends causally. Built
    from the library layer, so a seed gives the library's initialization."""

    def __init__(self, d_model: int, n_head: int, ffn_hidden: int, dropout: float):
        super().__init__()
        reference = nn.TransformerEncoderLayer(d_model, n_head, ffn_hidden, dropout, batch_first=True)
        self.self_attn = SelfAttention(reference.self_attn)
        self.linear1, self.dropout, self.linear2 = reference.linear1, reference.dropout, reference.linear2
        self.norm1, self.norm2 = reference.norm1, reference.norm2
        self.dropout1, self.dropout2 = reference.dropout1, reference.dropout2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm1(x + self.dropout1(self.self_attn(x)))
        return self.norm2(x + self.dropout2(self.linear2(self.dropout(F.relu(self.linear1(x))))))


class Decoder(LMHead):
    def __init__(self, d_model: int, padded_vocab_size: int):
        super().__init__(d_model, padded_vocab_size, uniform_init, bias=True)


def encoder_layers(cfg: ModelConfig) -> list:
    vocab = cfg.padded_vocab_size
    return [
        LayerSpec(EncoderEmbedding, vocab, cfg.n_embd, cfg.block_size, cfg.dropout),
        *[LayerSpec(CausalEncoderLayer, cfg.n_embd, cfg.n_head, ENCODER.mlp_hidden(cfg), cfg.dropout)
          for _ in range(cfg.n_layer)],
        LayerSpec(Decoder, cfg.n_embd, vocab) if cfg.head == "lm" else LayerSpec(ScoreHead, cfg.n_embd),
    ]


def check(cfg: ModelConfig, c) -> None:
    c.that(cfg.n_embd % 2 == 0, "n_embd", "be even for the encoder (its sinusoidal positions pair sines with "
           "cosines)", "make model.n_embd an even multiple of model.n_head")


ENCODER = Architecture(
    name="encoder", title="the encoder", layers=encoder_layers, block=CausalEncoderLayer,
    # nn.MultiheadAttention's fused q|k|v is a bare parameter pair, not an nn.Linear: it splits by heads as one.
    plan={EncoderEmbedding: {"embedding": VOCAB},
          CausalEncoderLayer: {"self_attn.in_proj_weight": (COLUMN, 3), "self_attn.in_proj_bias": (COLUMN, 3),
                               "self_attn.out_proj": ROW, "linear1": COLUMN, "linear2": ROW},
          Decoder: {"": COLUMN}},
    hf=(), mlp_matrices=2, mlp_width=lambda cfg: 4 * cfg.n_embd, tied_embeddings="never",
    ignores=("activation", "bias", "norm_eps", "tie_embeddings", "ffn_multiple_of", *ROPE_SETTINGS),
    unsupported={
        "document_masking": "its sinusoidal positions and nn.TransformerEncoderLayer take no per-document positions",
        "sequence_parallel": "the encoder's attention (nn.MultiheadAttention) has no core to split over sequence ranks",
        "mlp_tiling": "the encoder's feed-forward maps are inside nn.TransformerEncoderLayer's own forward",
        "mixture_of_experts": "its feed-forward maps are inside nn.TransformerEncoderLayer's own forward",
        "lora": "nn.MultiheadAttention computes with its projections' weights, not through the maps",
        **dict.fromkeys(("head_dim", "qkv_bias", "qk_norm"), "nn.MultiheadAttention's heads are n_embd / n_head wide, "
                        "always biased and never normalized")},
    check=check,
)
