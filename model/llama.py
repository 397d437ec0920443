"""Llama (RMSNorm, rotary position embeddings, SwiGLU, grouped-query attention), as an ordered list of layers.

Same conventions as model/gpt.py: one activation in and out of every layer, so the list builds the plain module
and the PipelineModule alike; GPT-2 init; no biases; the LM head is its own matrix unless
`model.tie_embeddings`, then the token embedding through a TiedLayerSpec (tied across the first and last
pipeline stage). Projections are separate nn.Linear modules (q, k, v, o; gate, up, down), the layout of
Hugging Face's checkpoints, which load as they are.
"""
import torch
import torch.nn as nn
from deepspeed.pipe import LayerSpec, TiedLayerSpec

from common.checks import ConfigError
from model.architecture import SAME, VOCAB_ROWS, Architecture, HuggingFace
from model.config import ModelConfig
from model.documents import hidden_and_positions, with_positions
from model.layers import (
    FinalRMSNorm,
    LMHead,
    ScoreHead,
    SwiGLU,
    TokenEmbedding,
    apply_rope,
    causal_attention,
    init_weights,
    lm_head,
    merge_heads,
    rope_frequencies,
    rope_tables,
    split_heads,
)
from model.moe import NO_EXPERT_PARALLEL, ExpertParallel, MoEFeedForward
from model.moe_hooks import router_hooks
from model.tensor_parallel import COLUMN, ROW, VOCAB


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
        self.core = causal_attention  # model/sequence_parallel.py swaps it for the sequence-parallel one

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = (split_heads(proj(x), self.head_dim) for proj in (self.q, self.k, self.v))
        if positions is None:
            cos, sin = self.cos[:x.size(1)], self.sin[:x.size(1)]
        else:  # each token rotated by its position within its document; the heads share it
            cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        y = self.core(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, self.dropout if self.training else 0.0,
                      positions)
        return self.o(merge_heads(y))


class LlamaBlock(nn.Module):
    """Pre-RMSNorm block: x + attention(norm(x)), then + SwiGLU(norm(x)), or + a mixture of SwiGLU experts
    (Mixtral's block) where `moe`; `ep`: the expert-parallel degree and rank (model/moe.py)."""

    def __init__(self, cfg: ModelConfig, moe: bool = False, ep: ExpertParallel = NO_EXPERT_PARALLEL):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        if moe:
            self.mlp = MoEFeedForward(cfg.n_embd, cfg.expert_hidden or LLAMA.mlp_hidden(cfg), cfg.n_experts,
                                      cfg.experts_per_token, cfg.n_layer, cfg.capacity_factor, ep,
                                      balancing_bias=cfg.router_bias_rate > 0)
        else:
            self.mlp = SwiGLU(cfg.n_embd, LLAMA.mlp_hidden(cfg))
        init_weights(self, cfg.n_layer, residual=("attn.o.weight", "mlp.down.weight"))
        if moe:
            self.mlp.init_experts()

    def forward(self, inputs):
        x, positions = hidden_and_positions(inputs)
        x = x + self.attn(self.attn_norm(x), positions)
        return with_positions(x + self.mlp(self.mlp_norm(x)), positions)


def llama_layers(cfg: ModelConfig) -> list:
    """Token embedding, n_layer blocks, final RMSNorm, LM head (tied to the embedding if asked) or score head."""
    embed = dict(padded_vocab_size=cfg.padded_vocab_size, n_embd=cfg.n_embd)
    if cfg.head == "score":
        first, head = LayerSpec(TokenEmbedding, **embed), LayerSpec(ScoreHead, cfg.n_embd)
    elif cfg.tie_embeddings:
        first, head = (TiedLayerSpec("embed", TokenEmbedding, **embed),
                       TiedLayerSpec("embed", TokenEmbedding, **embed, forward_fn=lm_head))
    else:
        first, head = LayerSpec(TokenEmbedding, **embed), LayerSpec(LMHead, cfg.n_embd, cfg.padded_vocab_size)
    return [first, *[LayerSpec(LlamaBlock, cfg, moe=cfg.is_moe_block(i)) for i in range(cfg.n_layer)],
            LayerSpec(FinalRMSNorm, cfg.n_embd, eps=cfg.norm_eps), head]


def mlp_width(cfg: ModelConfig) -> int:
    """SwiGLU has three matrices: 2/3 of 4d keeps the MLP's FLOPs, rounded up to model.ffn_multiple_of."""
    m = cfg.ffn_multiple_of
    return (int(8 * cfg.n_embd / 3) + m - 1) // m * m


def check(cfg: ModelConfig, c) -> None:
    c.that(cfg.head_dim % 2 == 0, "n_embd", f"give an even head size n_embd / n_head (now {cfg.head_dim}): rotary "
           f"embeddings rotate pairs of dimensions", "choose model.n_embd and model.n_head with an even quotient")


# Hugging Face's LlamaForCausalLM (LlamaForSequenceClassification: `score` in place of `lm_head`): (our name,
# theirs) per block; every tensor moves as it is.
HF_BLOCK = [("attn_norm.weight", "input_layernorm.weight"), ("attn.q.weight", "self_attn.q_proj.weight"),
            ("attn.k.weight", "self_attn.k_proj.weight"), ("attn.v.weight", "self_attn.v_proj.weight"),
            ("attn.o.weight", "self_attn.o_proj.weight"), ("mlp_norm.weight", "post_attention_layernorm.weight"),
            ("mlp.gate.weight", "mlp.gate_proj.weight"), ("mlp.up.weight", "mlp.up_proj.weight"),
            ("mlp.down.weight", "mlp.down_proj.weight")]
HF_LAYERS = {TokenEmbedding: [("weight", "model.embed_tokens.weight", VOCAB_ROWS)],
             LlamaBlock: [(ours, f"model.layers.{{i}}.{theirs}", SAME) for ours, theirs in HF_BLOCK],
             FinalRMSNorm: [("weight", "model.norm.weight", SAME)],
             LMHead: [("weight", "lm_head.weight", VOCAB_ROWS)],
             ScoreHead: [("weight", "score.weight", SAME)]}


# Hugging Face's MixtralForCausalLM: the Llama's attention and norms; the MLP is block_sparse_moe, its router
# `gate` and each expert's w1 (gate), w3 (up) and w2 (down). "{e}": each global expert.
EXPERT = "mlp.moe.deepspeed_moe.experts.deepspeed_experts.{e}"
HF_MIXTRAL_BLOCK = [*HF_BLOCK[:6], ("mlp.moe.deepspeed_moe.gate.wg.weight", "block_sparse_moe.gate.weight"),
                    (f"{EXPERT}.gate.weight", "block_sparse_moe.experts.{e}.w1.weight"),
                    (f"{EXPERT}.up.weight", "block_sparse_moe.experts.{e}.w3.weight"),
                    (f"{EXPERT}.down.weight", "block_sparse_moe.experts.{e}.w2.weight")]
HF_MIXTRAL_LAYERS = {**HF_LAYERS, LlamaBlock: [(ours, f"model.layers.{{i}}.{theirs}", SAME)
                                               for ours, theirs in HF_MIXTRAL_BLOCK]}


def hf_config(cfg: ModelConfig) -> dict:
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scale_factor is not None:
        rope.update(rope_type="llama3", factor=cfg.rope_scale_factor, low_freq_factor=cfg.rope_low_freq_factor,
                    high_freq_factor=cfg.rope_high_freq_factor,
                    original_max_position_embeddings=cfg.rope_original_context)
    return {"hidden_size": cfg.n_embd, "intermediate_size": LLAMA.mlp_hidden(cfg), "num_hidden_layers": cfg.n_layer,
            "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
            "max_position_embeddings": cfg.block_size, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
            "rope_parameters": rope, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
            "attention_dropout": cfg.dropout}


def hf_mixtral_config(cfg: ModelConfig) -> dict:
    return {**hf_config(cfg), "intermediate_size": cfg.expert_hidden or LLAMA.mlp_hidden(cfg),
            "num_local_experts": cfg.n_experts, "num_experts_per_tok": cfg.experts_per_token,
            "router_aux_loss_coef": cfg.router_aux_loss_coef, "output_router_logits": False,
            "router_jitter_noise": 0.0, "sliding_window": None}


def check_mixtral(cfg: ModelConfig) -> None:
    if cfg.moe_every != 1:
        raise ConfigError(f"Hugging Face's Mixtral layout has experts in every block: this model has them in every "
                          f"{cfg.moe_every}th (model.moe_every={cfg.moe_every})")
    if cfg.router_bias_rate:
        raise ConfigError("Hugging Face's Mixtral layout has no per-expert bias on the router's choice "
                          "(model.router_bias_rate > 0): the export would route otherwise")
    if cfg.experts_per_token < 2:
        raise ConfigError("Hugging Face's Mixtral renormalizes the chosen experts' weights, which makes a top-1 "
                          "expert's weight 1; DeepSpeed's top-1 weighs it by its probability "
                          "(model.experts_per_token=1): the export would compute another model")


LLAMA = Architecture(
    name="llama", title="the Llama", layers=llama_layers, block=LlamaBlock,
    # Attention splits by heads (query and key/value heads alike, so each rank keeps whole groups), the MLP by
    # hidden features, each closed by a row-parallel map; the embedding and LM head by vocabulary rows.
    plan={TokenEmbedding: {"": VOCAB},
          LlamaBlock: {"attn.q": COLUMN, "attn.k": COLUMN, "attn.v": COLUMN, "attn.o": ROW,
                       "mlp.gate": COLUMN, "mlp.up": COLUMN, "mlp.down": ROW},
          LMHead: {"": COLUMN}},
    hf=HuggingFace("LlamaForCausalLM", "LlamaForSequenceClassification", "llama", HF_LAYERS, hf_config),
    mlp_matrices=3, mlp_width=mlp_width, tied_embeddings="optional", rope=True, grouped_query_attention=True,
    check=check,
    hf_moe=HuggingFace("MixtralForCausalLM", "MixtralForSequenceClassification", "mixtral", HF_MIXTRAL_LAYERS,
                       hf_mixtral_config, check_mixtral),
    training_hooks=lambda cfg: router_hooks(cfg, len(llama_layers(cfg))),
)
