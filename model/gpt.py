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

from common.checks import ConfigError
from model.architecture import SAME, TRANSPOSED, VOCAB_ROWS, Architecture, HuggingFace
from model.config import ROPE_SETTINGS, ModelConfig
from model.documents import hidden_and_positions, with_positions
from model.layers import (
    MLP,
    FinalLayerNorm,
    ScoreHead,
    TokenEmbedding,
    causal_attention,
    init_weights,
    lm_head,
    merge_heads,
    normal_init,
    split_qkv,
)
from model.tensor_parallel import COLUMN, ROW, VOCAB


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
        qkv = self.qkv(x)  # its time is the whole sequence, also where x is a slice of it (sequence parallelism)
        q, k, v = split_qkv(qkv, self.head_dim)
        y = self.core(q, k, v, self.dropout if self.training else 0.0, positions)
        return self.resid_drop(self.proj(merge_heads(y)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, n_embd: int, n_head: int, mlp_hidden: int, n_layer: int, dropout: float, bias: bool,
                 activation: str = "gelu_tanh"):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, mlp_hidden, dropout, bias, activation)
        init_weights(self, n_layer, residual=("attn.proj.weight", "mlp.proj.weight"))

    def forward(self, inputs):
        x, positions = hidden_and_positions(inputs)
        x = x + self.attn(self.ln_1(x), positions)
        return with_positions(x + self.mlp(self.ln_2(x)), positions)


def gpt_layers(cfg: ModelConfig) -> list:
    """Embedding, position embedding, n_layer blocks, final LayerNorm, tied LM head or score head."""
    embed = dict(padded_vocab_size=cfg.padded_vocab_size, n_embd=cfg.n_embd)
    head = TiedLayerSpec("embed", TokenEmbedding, **embed, forward_fn=lm_head) if cfg.head == "lm" else \
        LayerSpec(ScoreHead, cfg.n_embd)
    return [
        TiedLayerSpec("embed", TokenEmbedding, **embed),
        LayerSpec(PositionEmbedding, cfg.block_size, cfg.n_embd, cfg.dropout),
        *[LayerSpec(Block, cfg.n_embd, cfg.n_head, GPT.mlp_hidden(cfg), cfg.n_layer, cfg.dropout, cfg.bias,
                    cfg.activation) for _ in range(cfg.n_layer)],
        LayerSpec(FinalLayerNorm, cfg.n_embd, bias=cfg.bias),
        head,
    ]


# Hugging Face's GPT2LMHeadModel (GPT2ForSequenceClassification: its `score`): (our name, theirs, how it moves) per
# layer class; "{i}" is the block's index.
HF_BLOCK = [("ln_1.weight", "ln_1.weight", SAME), ("ln_1.bias", "ln_1.bias", SAME),
            ("attn.qkv.weight", "attn.c_attn.weight", TRANSPOSED), ("attn.qkv.bias", "attn.c_attn.bias", SAME),
            ("attn.proj.weight", "attn.c_proj.weight", TRANSPOSED), ("attn.proj.bias", "attn.c_proj.bias", SAME),
            ("ln_2.weight", "ln_2.weight", SAME), ("ln_2.bias", "ln_2.bias", SAME),
            ("mlp.fc.weight", "mlp.c_fc.weight", TRANSPOSED), ("mlp.fc.bias", "mlp.c_fc.bias", SAME),
            ("mlp.proj.weight", "mlp.c_proj.weight", TRANSPOSED), ("mlp.proj.bias", "mlp.c_proj.bias", SAME)]
HF_LAYERS = {TokenEmbedding: [("weight", "transformer.wte.weight", VOCAB_ROWS)],
             PositionEmbedding: [("weight", "transformer.wpe.weight", SAME)],
             Block: [(ours, f"transformer.h.{{i}}.{theirs}", how) for ours, theirs, how in HF_BLOCK],
             FinalLayerNorm: [("weight", "transformer.ln_f.weight", SAME), ("bias", "transformer.ln_f.bias", SAME)],
             ScoreHead: [("weight", "score.weight", SAME)]}


# model.activation's name in a GPT2Config; transformers also calls the tanh GELU gelu_pytorch_tanh and gelu_fast
HF_GELU = {"gelu_tanh": "gelu_new", "gelu": "gelu"}
HF_GELU_ALIASES = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh", **{v: k for k, v in HF_GELU.items()}}


def hf_config(cfg: ModelConfig) -> dict:
    return {"n_positions": cfg.block_size, "n_ctx": cfg.block_size, "n_embd": cfg.n_embd, "n_layer": cfg.n_layer,
            "n_head": cfg.n_head, "n_inner": GPT.mlp_hidden(cfg), "activation_function": HF_GELU[cfg.activation],
            "layer_norm_epsilon": 1e-5, "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout,
            "attn_pdrop": cfg.dropout}


def read_hf_config(config: dict) -> dict:
    """The model settings a GPT2Config describes (what hf_config writes, read back)."""
    theirs = config.get("activation_function", "gelu_new")
    if theirs not in HF_GELU_ALIASES:
        raise ConfigError(f"its activation_function is {theirs}, which this repo's GPT does not compute (it computes "
                          f"{', '.join(HF_GELU_ALIASES)})")
    return {"vocab_size": config["vocab_size"], "n_embd": config["n_embd"], "n_layer": config["n_layer"],
            "n_head": config["n_head"], "block_size": config["n_positions"], "ffn_hidden": config.get("n_inner"),
            "activation": HF_GELU_ALIASES[theirs], "bias": True}


def check_hf(cfg: ModelConfig) -> None:
    if not cfg.bias:
        raise ConfigError("Hugging Face's GPT-2 layout needs biases: this model has model.bias=false")


def check_hf_folder(config: dict, cfg: ModelConfig, named: str) -> None:
    """A GPT2Config that train.init_from reads must compute this run's GELU."""
    theirs = config.get("activation_function", "gelu_new")
    if HF_GELU_ALIASES.get(theirs) != cfg.activation:
        fix = (f"set model.activation={HF_GELU_ALIASES[theirs]}" if theirs in HF_GELU_ALIASES else
               f"pick a GPT-2 whose activation_function is one of {', '.join(HF_GELU_ALIASES)}")
        raise ConfigError(f"{named}: its activation_function is {theirs}, this run's model.activation "
                          f"is {cfg.activation} ({HF_GELU[cfg.activation]} there); fix: {fix}")


GPT = Architecture(
    name="gpt", title="the GPT", layers=gpt_layers, block=Block,
    # Attention splits by heads (q|k|v), the MLP by hidden features, each pair closed by a row-parallel map; the
    # embedding (and so the tied LM head) by vocabulary rows.
    plan={TokenEmbedding: {"": VOCAB},
          Block: {"attn.qkv": (COLUMN, 3), "attn.proj": ROW, "mlp.fc": COLUMN, "mlp.proj": ROW}},
    hf=(HuggingFace("GPT2LMHeadModel", "GPT2ForSequenceClassification", "gpt2", HF_LAYERS, hf_config, read_hf_config,
                    check_hf, check_hf_folder),),
    mlp_matrices=2, mlp_width=lambda cfg: 4 * cfg.n_embd, tied_embeddings="always",
    ignores=("norm_eps", "tie_embeddings", "ffn_multiple_of", *ROPE_SETTINGS),
    unsupported={"mixture_of_experts": "its MLPs are GPT-2's dense GELU networks; the Llama's become Mixtral's "
                                       "mixtures of SwiGLU experts",
                 "head_dim": "its fused q|k|v projection is n_embd wide, each head n_embd / n_head",
                 "qkv_bias": "model.bias sets all of its biases", "qk_norm": "GPT-2's attention has no per-head norms"},
)
