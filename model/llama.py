"""Llama (RMSNorm, rotary position embeddings, SwiGLU, grouped-query attention), as an ordered list of layers.

Same conventions as model/gpt.py: one activation in and out of every layer, so the list builds the plain module
and the PipelineModule alike; GPT-2 init; no biases; the LM head is its own matrix unless
`model.tie_embeddings`, then the token embedding through a TiedLayerSpec (tied across the first and last
pipeline stage). Projections are separate nn.Linear modules (q, k, v, o; gate, up, down), the layout of
Hugging Face's checkpoints, which load as they are.
"""
from typing import Callable

import torch
import torch.nn as nn
from deepspeed.pipe import LayerSpec, TiedLayerSpec

from common.checks import ConfigError
from model.architecture import EXPERTS, ROUTED, SAME, SHARED, VOCAB_ROWS, Architecture, HuggingFace
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
    rope_buffers,
    split_heads,
)
from model.moe import NO_EXPERT_PARALLEL, ExpertParallel, MoEFeedForward
from model.moe_hooks import router_hooks
from model.tensor_parallel import COLUMN, PER_HEAD, ROW, VOCAB


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_width
        self.dropout = cfg.dropout
        self.q = nn.Linear(cfg.n_embd, cfg.q_width, bias=cfg.qkv_bias)
        self.k = nn.Linear(cfg.n_embd, cfg.kv_heads * cfg.head_width, bias=cfg.qkv_bias)
        self.v = nn.Linear(cfg.n_embd, cfg.kv_heads * cfg.head_width, bias=cfg.qkv_bias)
        self.o = nn.Linear(cfg.q_width, cfg.n_embd, bias=False)
        # Qwen3's per-head norms: one gain per head dimension, shared by the heads (each tensor rank applies it to
        # its own heads: model/parallelize.py sums its gradient over them)
        self.q_norm, self.k_norm = ((nn.RMSNorm(cfg.head_width, eps=cfg.norm_eps),
                                     nn.RMSNorm(cfg.head_width, eps=cfg.norm_eps)) if cfg.qk_norm else (None, None))
        self.cfg = cfg
        # Derived from the config, never checkpointed. DeepSpeed's bf16 casts them as Hugging Face does.
        self.register_buffer("cos", None, persistent=False)
        self.register_buffer("sin", None, persistent=False)
        self.init_buffers()
        self.core = causal_attention  # model/sequence_parallel.py swaps it for the sequence-parallel one

    def init_buffers(self) -> None:
        """The rotary tables of the config's positions (their shapes alone on the meta device; build_empty)."""
        self.cos, self.sin = rope_buffers(self.cfg)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = (split_heads(proj(x), self.head_dim) for proj in (self.q, self.k, self.v))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if positions is None:
            cos, sin = self.cos[:q.size(2)], self.sin[:q.size(2)]  # q's time: the whole sequence's
        else:  # each token rotated by its position within its document; the heads share it
            cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        y = self.core(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, self.dropout if self.training else 0.0,
                      positions)
        return self.o(merge_heads(y))


class LlamaBlock(nn.Module):
    """Pre-RMSNorm block: x + attention(norm(x)), then + SwiGLU(norm(x)), or + a mixture of SwiGLU experts
    (Mixtral's block, Qwen2-MoE's with a shared expert) where `moe`; `ep`: the expert-parallel degree and rank
    (model/moe.py)."""

    def __init__(self, cfg: ModelConfig, moe: bool = False, ep: ExpertParallel = NO_EXPERT_PARALLEL):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        if moe:
            self.mlp = MoEFeedForward(cfg.n_embd, LLAMA.expert_hidden(cfg), cfg.n_experts, cfg.experts_per_token,
                                      cfg.n_layer, cfg.capacity_factor, ep, balancing_bias=cfg.router_bias_rate > 0,
                                      shared_hidden=LLAMA.shared_hidden(cfg))
        else:
            self.mlp = SwiGLU(cfg.n_embd, LLAMA.mlp_hidden(cfg))
        init_weights(self, cfg.n_layer, residual=("attn.o.weight", "mlp.down.weight", "mlp.shared_mlp.down.weight"))
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
    if cfg.head_dim:
        c.that(cfg.head_dim % 2 == 0, "head_dim", "be even: rotary embeddings rotate pairs of dimensions",
               "choose an even model.head_dim")
    else:
        c.that(cfg.head_width % 2 == 0, "n_embd", f"give an even head size n_embd / n_head (now {cfg.head_width}): "
               f"rotary embeddings rotate pairs of dimensions",
               "choose model.n_embd and model.n_head with an even quotient")


# Hugging Face's LlamaForCausalLM (LlamaForSequenceClassification: `score` in place of `lm_head`): (our name,
# theirs) per block; every tensor moves as it is. Qwen2's and Qwen3's name them alike, with q/k/v biases (Qwen2's)
# or per-head norms (Qwen3's) in the attention.
HF_ATTENTION = [("attn_norm.weight", "input_layernorm.weight"), ("attn.q.weight", "self_attn.q_proj.weight"),
                ("attn.k.weight", "self_attn.k_proj.weight"), ("attn.v.weight", "self_attn.v_proj.weight"),
                ("attn.o.weight", "self_attn.o_proj.weight")]
HF_QKV_BIAS = [(f"attn.{x}.bias", f"self_attn.{x}_proj.bias") for x in "qkv"]
HF_QK_NORM = [(f"attn.{x}_norm.weight", f"self_attn.{x}_norm.weight") for x in "qk"]
HF_MLP_NORM = [("mlp_norm.weight", "post_attention_layernorm.weight")]
HF_MLP = [("mlp.gate.weight", "mlp.gate_proj.weight"), ("mlp.up.weight", "mlp.up_proj.weight"),
          ("mlp.down.weight", "mlp.down_proj.weight")]
HF_BLOCK = [*HF_ATTENTION, *HF_MLP_NORM, *HF_MLP]
HF_QWEN2_BLOCK = [*HF_ATTENTION, *HF_QKV_BIAS, *HF_MLP_NORM, *HF_MLP]
HF_QWEN3_BLOCK = [*HF_ATTENTION, *HF_QK_NORM, *HF_MLP_NORM, *HF_MLP]
# The attention settings of the layouts' models: Llama's, Mixtral's and Qwen2-MoE's; Qwen2's (and Qwen2-MoE's with
# biases); Qwen3's and Qwen3-MoE's
PLAIN_ATTENTION = (("qkv_bias", False), ("qk_norm", False))
QWEN2_ATTENTION = (("qkv_bias", True), ("qk_norm", False))
QWEN3_ATTENTION = (("qkv_bias", False), ("qk_norm", True))


def hf_layers(block: list) -> dict:
    """The Llama's layout, its blocks in `block`'s (our name, theirs within the block) pairs."""
    return {TokenEmbedding: [("weight", "model.embed_tokens.weight", VOCAB_ROWS)],
            LlamaBlock: [(ours, f"model.layers.{{i}}.{theirs}", SAME) for ours, theirs in block],
            FinalRMSNorm: [("weight", "model.norm.weight", SAME)],
            LMHead: [("weight", "lm_head.weight", VOCAB_ROWS)],
            ScoreHead: [("weight", "score.weight", SAME)]}


HF_LAYERS = hf_layers(HF_BLOCK)


# Hugging Face's MixtralForCausalLM: the Llama's attention and norms; the MLP is block_sparse_moe, its router
# `gate` and each expert's w1 (gate), w3 (up) and w2 (down). "{e}": each global expert.
EXPERT = "mlp.moe.deepspeed_moe.experts.deepspeed_experts.{e}"
ROUTER = "mlp.moe.deepspeed_moe.gate.wg.weight"
HF_MIXTRAL_BLOCK = [*HF_ATTENTION, *HF_MLP_NORM, (ROUTER, "block_sparse_moe.gate.weight"),
                    (f"{EXPERT}.gate.weight", "block_sparse_moe.experts.{e}.w1.weight"),
                    (f"{EXPERT}.up.weight", "block_sparse_moe.experts.{e}.w3.weight"),
                    (f"{EXPERT}.down.weight", "block_sparse_moe.experts.{e}.w2.weight")]
# Hugging Face's Qwen3MoeForCausalLM and Qwen2MoeForCausalLM: the Llama's attention (Qwen3's with its per-head
# norms, Qwen2's with q/k/v biases or without: its qkv_bias) and norms, and the dense MLP's names in their blocks
# without experts; a block with experts has its router `gate` and each expert's gate_proj, up_proj and down_proj;
# Qwen2-MoE's the shared expert's too, and the shared expert's sigmoid gate.
HF_QWEN_EXPERTS = [(ROUTER, "mlp.gate.weight"), *[(f"{EXPERT}.{ours}.weight", f"mlp.experts.{{e}}.{ours}_proj.weight")
                                                  for ours in ("gate", "up", "down")]]
HF_QWEN3_MOE_BLOCK = [*HF_ATTENTION, *HF_QK_NORM, *HF_MLP_NORM, *HF_QWEN_EXPERTS]
HF_SHARED_EXPERT = [*[(f"mlp.shared_mlp.{ours}.weight", f"mlp.shared_expert.{ours}_proj.weight")
                      for ours in ("gate", "up", "down")], ("mlp.shared_gate.weight", "mlp.shared_expert_gate.weight")]
HF_QWEN2_MOE_BLOCK = [*HF_ATTENTION, *HF_MLP_NORM, *HF_QWEN_EXPERTS, *HF_SHARED_EXPERT]
HF_BIASED_QWEN2_MOE_BLOCK = [*HF_ATTENTION, *HF_QKV_BIAS, *HF_MLP_NORM, *HF_QWEN_EXPERTS, *HF_SHARED_EXPERT]


def with_experts(dense: list, block: list) -> dict:
    """The Llama's layout, its blocks without experts in `dense`'s pairs, those with experts in `block`'s."""
    return {**hf_layers(dense),
            (LlamaBlock, EXPERTS): [(ours, f"model.layers.{{i}}.{theirs}", SAME) for ours, theirs in block]}


def hf_config(cfg: ModelConfig) -> dict:
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scale_factor is not None:
        rope.update(rope_type="llama3", factor=cfg.rope_scale_factor, low_freq_factor=cfg.rope_low_freq_factor,
                    high_freq_factor=cfg.rope_high_freq_factor,
                    original_max_position_embeddings=cfg.rope_original_context)
    return {"hidden_size": cfg.n_embd, "intermediate_size": LLAMA.mlp_hidden(cfg), "num_hidden_layers": cfg.n_layer,
            "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_width,
            "max_position_embeddings": cfg.block_size, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
            "rope_parameters": rope, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
            "attention_dropout": cfg.dropout}


def hf_qwen_config(cfg: ModelConfig) -> dict:
    """Qwen3's: the Llama's (neither Qwen names an MLP bias), every layer attending over the whole window."""
    config = {**hf_config(cfg), "use_sliding_window": False, "max_window_layers": cfg.n_layer}
    return {key: value for key, value in config.items() if key != "mlp_bias"}


def hf_qwen2_config(cfg: ModelConfig) -> dict:
    """Qwen2's: Qwen3's without attention_bias (Qwen2's q, k and v always have biases, its o never)."""
    return {key: value for key, value in hf_qwen_config(cfg).items() if key != "attention_bias"}


def hf_mistral_config(cfg: ModelConfig) -> dict:
    """Mistral's: the Llama's names and computation, with no sliding window (neither Mistral names a bias)."""
    config = {**hf_config(cfg), "sliding_window": None}
    return {key: value for key, value in config.items() if key not in ("attention_bias", "mlp_bias")}


def hf_mixtral_config(cfg: ModelConfig) -> dict:
    return {**hf_config(cfg), "intermediate_size": LLAMA.expert_hidden(cfg),
            "num_local_experts": cfg.n_experts, "num_experts_per_tok": cfg.experts_per_token,
            "router_aux_loss_coef": cfg.router_aux_loss_coef, "output_router_logits": False,
            "router_jitter_noise": 0.0, "sliding_window": None}


def hf_qwen2_moe_config(cfg: ModelConfig) -> dict:
    """Its blocks with experts are every decoder_sparse_step-th, the last of each run (blocks n-1, 2n-1, ...: ours
    of model.moe_every); the others keep the dense MLP (intermediate_size). norm_topk_prob: the chosen experts'
    weights renormalized, as DeepSpeed's top-k for k >= 2; its top-1 weighs the expert by its probability."""
    return {**hf_qwen3_moe_config(cfg), "shared_expert_intermediate_size": LLAMA.shared_hidden(cfg),
            "qkv_bias": cfg.qkv_bias}


def hf_qwen3_moe_config(cfg: ModelConfig) -> dict:
    return {**hf_qwen_config(cfg), "num_experts": cfg.n_experts, "num_experts_per_tok": cfg.experts_per_token,
            "moe_intermediate_size": LLAMA.expert_hidden(cfg), "norm_topk_prob": cfg.experts_per_token > 1,
            "decoder_sparse_step": cfg.moe_every, "mlp_only_layers": [], "router_aux_loss_coef":
            cfg.router_aux_loss_coef, "output_router_logits": False}


# Llama 3.1's RoPE frequency scaling: config.json's numbers and the model settings that hold them
LLAMA3_ROPE = {"factor": "rope_scale_factor", "low_freq_factor": "rope_low_freq_factor",
               "high_freq_factor": "rope_high_freq_factor", "original_max_position_embeddings": "rope_original_context"}


def rope_of(config: dict) -> dict:
    """A config.json's rotary settings: rope_parameters, or rope_scaling and rope_theta in older files."""
    rope = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    return {**rope, "rope_theta": rope.get("rope_theta", config.get("rope_theta", 10000.0))}


def read_config(config: dict) -> dict:
    """The model settings a Llama-family config.json describes (what hf_config writes, read back); a field it lacks
    takes transformers' default. A KeyError names a shape field it lacks."""
    rope = rope_of(config)
    heads, width = config["num_attention_heads"], config["hidden_size"]
    settings = {"vocab_size": config["vocab_size"], "n_embd": width, "n_layer": config["num_hidden_layers"],
                "n_head": heads, "n_kv_head": config.get("num_key_value_heads") or heads,
                "head_dim": None if config.get("head_dim") in (None, width // heads) else config["head_dim"],
                "ffn_hidden": config["intermediate_size"], "block_size": config.get("max_position_embeddings", 2048),
                "norm_eps": config.get("rms_norm_eps", 1e-6), "rope_theta": rope["rope_theta"],
                "tie_embeddings": config.get("tie_word_embeddings", False)}
    if rope.get("rope_type", rope.get("type")) == "llama3":
        settings.update({name: rope[key] for key, name in LLAMA3_ROPE.items() if key in rope})
    return settings


def read_mixtral_config(config: dict) -> dict:
    return {**read_config(config), "n_experts": config["num_local_experts"],
            "experts_per_token": config["num_experts_per_tok"], "expert_hidden": config["intermediate_size"]}


def read_qwen3_moe_config(config: dict) -> dict:
    return {**read_config(config), "n_experts": qwen3_moe_experts(config)[0] or config["num_experts"],
            "experts_per_token": config["num_experts_per_tok"], "expert_hidden": config["moe_intermediate_size"],
            "moe_every": config.get("decoder_sparse_step", 1)}


def read_qwen2_moe_config(config: dict) -> dict:
    """... its shared expert a whole number of routed experts wide (model.n_shared_experts), else refused."""
    shared = qwen2_moe_experts(config)[1]
    if shared != int(shared):
        raise ConfigError(f"its shared expert is {shared:g} routed experts wide (shared_expert_intermediate_size / "
                          f"moe_intermediate_size), where this repo's is a whole number of them")
    return {**read_qwen3_moe_config(config), "n_shared_experts": int(shared)}


def check_unbiased_router(cfg: ModelConfig, layout: str) -> None:
    if cfg.router_bias_rate:
        raise ConfigError(f"Hugging Face's {layout} layout has no per-expert bias on the router's choice "
                          f"(model.router_bias_rate > 0): the export would route otherwise")


def check_mixtral(cfg: ModelConfig) -> None:
    if cfg.moe_every != 1:
        raise ConfigError(f"Hugging Face's Mixtral layout has experts in every block: this model has them in every "
                          f"{cfg.moe_every}th (model.moe_every={cfg.moe_every})")
    check_unbiased_router(cfg, "Mixtral")
    if cfg.experts_per_token < 2:
        raise ConfigError("Hugging Face's Mixtral renormalizes the chosen experts' weights, which makes a top-1 "
                          "expert's weight 1; DeepSpeed's top-1 weighs it by its probability "
                          "(model.experts_per_token=1): the export would compute another model")


def check_qwen2_moe(cfg: ModelConfig) -> None:
    check_unbiased_router(cfg, "Qwen2-MoE")


def check_qwen3_moe(cfg: ModelConfig) -> None:
    check_unbiased_router(cfg, "Qwen3-MoE")


def mixtral_experts(config: dict) -> tuple[int, int]:
    return config.get("num_local_experts", 0), 0


def qwen3_moe_experts(config: dict) -> tuple[int, int]:
    return config.get("num_experts", config.get("num_local_experts", 0)), 0


def qwen2_moe_experts(config: dict) -> tuple[int, float]:
    """The shared expert counted in experts of the routed ones' width."""
    return qwen3_moe_experts(config)[0], config.get("shared_expert_intermediate_size", 0) / config.get(
        "moe_intermediate_size", 1)


def folder_check(expected: Callable[[ModelConfig], dict]) -> Callable[[dict, ModelConfig, str], None]:
    """A layout's check of a folder's config.json: the settings Hugging Face's class can hold and this run's model
    does not compute (sliding-window attention, say) are `expected`'s values, or absent. Where a model setting of
    the same name computes the folder's (Qwen2-MoE's qkv_bias), the line names it."""
    def check_folder(config: dict, cfg: ModelConfig, named: str) -> None:
        for key, ours in expected(cfg).items():
            if config.get(key, ours) != ours:
                fix = (f"set model.{key}={str(config[key]).lower()}" if hasattr(cfg, key) else
                       "pick another folder")
                raise ConfigError(f"{named}: its config.json has {key}={config[key]}, which this "
                                  f"run's model does not compute ({key}={ours} for its model.*): {fix}")
    return check_folder


def check_mistral_folder(config: dict, cfg: ModelConfig, named: str) -> None:
    """Mistral 7B v0.1 attends over a sliding window of 4,096 tokens: no restriction in a context no longer."""
    window = config.get("sliding_window")
    if window is not None and window < cfg.block_size:
        raise ConfigError(f"{named}: its config.json has sliding_window={window}, attention over "
                          f"the last {window} tokens only, which this run's model does not compute at "
                          f"model.block_size={cfg.block_size}: set model.block_size={window} or less")


def qwen_expects(cfg: ModelConfig) -> dict:
    """Every layer's attention over the whole window, no bias on Qwen3's o_proj."""
    return {"use_sliding_window": False, "attention_bias": False}


def qwen_moe_expects(cfg: ModelConfig) -> dict:
    """... and the chosen experts' weights renormalized as DeepSpeed's top-k does for k >= 2 (not for top-1), the
    last block of each model.moe_every with experts, and Qwen2-MoE's q/k/v biases as this run's."""
    return {**qwen_expects(cfg), "norm_topk_prob": cfg.experts_per_token > 1, "mlp_only_layers": [],
            "qkv_bias": cfg.qkv_bias}


LLAMA = Architecture(
    name="llama", title="the Llama", layers=llama_layers, block=LlamaBlock,
    # Attention splits by heads (query and key/value heads alike, so each rank keeps whole groups; the per-head
    # norms stay whole), the MLP and a block's shared expert by hidden features, each closed by a row-parallel map
    # (the shared expert's gate stays whole); the embedding and LM head by vocabulary rows.
    plan={TokenEmbedding: {"": VOCAB},
          LlamaBlock: {"attn.q": COLUMN, "attn.k": COLUMN, "attn.v": COLUMN, "attn.o": ROW,
                       "attn.q_norm": PER_HEAD, "attn.k_norm": PER_HEAD,
                       "mlp.gate": COLUMN, "mlp.up": COLUMN, "mlp.down": ROW, "mlp.shared_mlp.gate": COLUMN,
                       "mlp.shared_mlp.up": COLUMN, "mlp.shared_mlp.down": ROW},
          LMHead: {"": COLUMN}},
    hf=(HuggingFace("LlamaForCausalLM", "LlamaForSequenceClassification", "llama", HF_LAYERS, hf_config,
                    read_config, settings=PLAIN_ATTENTION),
        HuggingFace("Qwen2ForCausalLM", "Qwen2ForSequenceClassification", "qwen2", hf_layers(HF_QWEN2_BLOCK),
                    hf_qwen2_config, read_config, check_folder=folder_check(qwen_expects), settings=QWEN2_ATTENTION),
        HuggingFace("Qwen3ForCausalLM", "Qwen3ForSequenceClassification", "qwen3", hf_layers(HF_QWEN3_BLOCK),
                    hf_qwen_config, read_config, check_folder=folder_check(qwen_expects), settings=QWEN3_ATTENTION),
        # Read, never written: the Llama's layout holds the same model and comes first.
        HuggingFace("MistralForCausalLM", "MistralForSequenceClassification", "mistral", HF_LAYERS, hf_mistral_config,
                    read_config, check_folder=check_mistral_folder, settings=PLAIN_ATTENTION),
        HuggingFace("MixtralForCausalLM", "MixtralForSequenceClassification", "mixtral",
                    with_experts(HF_BLOCK, HF_MIXTRAL_BLOCK), hf_mixtral_config, read_mixtral_config, check_mixtral,
                    folder_experts=mixtral_experts, experts=ROUTED, settings=PLAIN_ATTENTION),
        HuggingFace("Qwen3MoeForCausalLM", "Qwen3MoeForSequenceClassification", "qwen3_moe",
                    with_experts(HF_QWEN3_BLOCK, HF_QWEN3_MOE_BLOCK), hf_qwen3_moe_config, read_qwen3_moe_config,
                    check_qwen3_moe, folder_check(qwen_moe_expects), qwen3_moe_experts, experts=ROUTED,
                    settings=QWEN3_ATTENTION),
        *[HuggingFace("Qwen2MoeForCausalLM", "Qwen2MoeForSequenceClassification", "qwen2_moe",
                      with_experts(dense, block), hf_qwen2_moe_config, read_qwen2_moe_config, check_qwen2_moe,
                      folder_check(qwen_moe_expects), qwen2_moe_experts, experts=SHARED, settings=settings)
          for dense, block, settings in ((HF_BLOCK, HF_QWEN2_MOE_BLOCK, PLAIN_ATTENTION),
                                         (HF_QWEN2_BLOCK, HF_BIASED_QWEN2_MOE_BLOCK, QWEN2_ATTENTION))]),
    mlp_matrices=3, mlp_width=mlp_width, tied_embeddings="optional", rope=True, rms_norm=True,
    grouped_query_attention=True, ignores=("activation", "bias"),
    check=check,
    training_hooks=lambda cfg: router_hooks(cfg, len(llama_layers(cfg))),
)
