"""Architecture settings shared by every model in `model/` (the `model:` section of a run config)."""
from dataclasses import dataclass, fields
from typing import Optional

from common.checks import ConfigError

GELUS = ("gelu_tanh", "gelu")
# What the last layer computes: next-token logits over the vocabulary (lm), or one score per position (score:
# a reward model, transformers' *ForSequenceClassification with num_labels=1, trained by train.objective=reward).
HEADS = ("lm", "score")


@dataclass
class ModelConfig:
    arch: str = "gpt"  # an architecture of model/registry.py: "gpt" (model/gpt.py), "llama" or "encoder"
    # Defaults are GPT-2 small (124M); presets in configs/ override them.
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    block_size: int = 1024
    # None: taken from the prepared dataset's meta.json (65 for character-level Shakespeare).
    vocab_size: Optional[int] = None
    # Embedding rows are padded up to a multiple of this: 50257 -> 50304 makes the head matmul
    # tile cleanly on tensor cores. Padded logits are never sampled and learn to stay low.
    vocab_multiple: int = 64
    # Feed-forward width; null means 4 x n_embd (GPT-2), or Llama's rule for the 3-matrix SwiGLU MLP:
    # 2/3 of 4 x n_embd rounded up to a multiple of ffn_multiple_of. The encoder_1b preset sets 4096.
    ffn_hidden: Optional[int] = None
    ffn_multiple_of: int = 256
    dropout: float = 0.0
    bias: bool = True  # GPT only; nn.TransformerEncoderLayer always has biases, Llama never
    # The GPT's MLP's GELU (the Llama's SwiGLU and the encoder's ReLU ignore it, so a GPT preset runs as a Llama):
    # GPT-2's tanh approximation ("gelu_tanh", Hugging Face's "gelu_new") or the exact one ("gelu", nanoGPT's),
    # which aten computes 3-4 times faster on a CPU (docs/performance.md).
    activation: str = "gelu_tanh"
    # Llama only. Key/value heads for grouped-query attention (must divide n_head; 1 = multi-query);
    # null = n_head (plain multi-head attention).
    n_kv_head: Optional[int] = None
    # Llama only. Each head's width; null = n_embd / n_head. Qwen3-0.6B's heads are 128 wide at n_embd 1024 and 16
    # heads: the query and output projections map n_embd to and from n_head x head_dim.
    head_dim: Optional[int] = None
    qkv_bias: bool = False  # Llama only: biases on the query, key and value projections (Qwen2's)
    # Llama only: RMSNorm over each head's queries and keys before the rotation, a gain per head dimension (Qwen3's)
    qk_norm: bool = False
    norm_eps: float = 1e-5  # RMSNorm epsilon
    rope_theta: float = 10000.0
    # Llama-3.1 RoPE frequency scaling (null: none; Llama 3.1 uses factor 8, Llama 3.2 factor 32, with
    # low/high frequency factors 1 and 4 over an original context of 8192).
    rope_scale_factor: Optional[float] = None
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_context: int = 8192
    tie_embeddings: bool = False  # Llama's LM head shares the token embedding (the GPT always ties)
    # Attention within each document of a packed window, positions restarting at each document (GPT and
    # Llama; the dataset's meta.json names its delimiter; a dataset without one is a single document).
    document_masking: bool = False
    # Mixture of experts (Llama only; model/moe.py): 0 keeps every MLP dense. Otherwise every moe_every-th block's
    # MLP is n_experts SwiGLU experts of width expert_hidden (null: the dense MLP's width), experts_per_token of
    # them per token; capacity_factor null routes every token (dropless), else an expert takes at most that many
    # times its even share and drops the rest. router_aux_loss_coef weighs the load-balancing loss,
    # router_z_loss_coef the router's z-loss (ST-MoE: 1e-3; 0 computes none). router_bias_rate > 0 balances the
    # load without an auxiliary loss too (DeepSeek-V3): a per-expert bias on the choice, moved by this much a step.
    # n_shared_experts > 0 adds to each MoE block an always-on SwiGLU that many experts wide behind a sigmoid gate
    # (Qwen2-MoE's shared expert, DeepSeek-MoE's shared experts as one).
    n_experts: int = 0
    experts_per_token: int = 2
    moe_every: int = 1
    expert_hidden: Optional[int] = None
    capacity_factor: Optional[float] = None
    router_aux_loss_coef: float = 0.01
    router_z_loss_coef: float = 0.0
    router_bias_rate: float = 0.0
    n_shared_experts: int = 0
    # The output layer (HEADS): lm, the LM head; score, a Linear(n_embd, 1) in its place, read at a sequence's last
    # token (training/objectives/reward.py). Under tensor parallelism the score head is replicated.
    head: str = "lm"
    # Low-rank adapters (model/lora.py): 0 trains every weight. Otherwise each of the blocks' linear maps named in
    # lora_targets ("all", or a comma-separated list such as "attn.q,attn.v") gets rank-lora_rank adapters scaled
    # by lora_alpha / lora_rank, and the adapters alone train (a reward model's score head too). lora_dropout
    # drops the adapters' input while training (PEFT's), the frozen map's input kept whole.
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: str = "all"
    lora_dropout: float = 0.0

    def check(self, c) -> None:
        """Range checks (c: common.checks.Checks), run by load_run_config; the architecture's own are
        model/registry.py's check_architecture."""
        for key in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "vocab_multiple", "ffn_hidden",
                    "ffn_multiple_of", "n_kv_head", "head_dim", "rope_original_context", "experts_per_token",
                    "moe_every", "expert_hidden"):
            c.at_least(key, 1)
        c.that(self.head_dim is not None or self.n_embd % self.n_head == 0, "n_embd",
               f"be divisible by model.n_head={self.n_head}",
               f"make model.n_embd a multiple of {self.n_head}, or set model.head_dim")
        c.in_range("dropout", 0.0, 1.0, high_open=True)
        c.one_of("activation", GELUS)
        c.one_of("head", HEADS)
        c.that(self.n_kv_head is None or self.n_head % self.n_kv_head == 0, "n_kv_head",
               f"divide model.n_head={self.n_head}: each key/value head serves a whole group of query heads",
               f"choose a divisor of {self.n_head}")
        for key in ("norm_eps", "rope_theta", "rope_scale_factor", "rope_low_freq_factor", "capacity_factor"):
            c.above(key, 0)
        c.at_least("router_aux_loss_coef", 0)
        c.at_least("router_z_loss_coef", 0)
        c.at_least("router_bias_rate", 0)
        c.at_least("n_shared_experts", 0)
        c.that(not self.n_shared_experts or self.n_experts > 0, "n_shared_experts",
               "be 0 without experts (model.n_experts=0): a shared expert sits beside the routed ones",
               "set model.n_experts to 2 or more, or model.n_shared_experts=0")
        c.that(not self.router_bias_rate or self.experts_per_token >= 2, "router_bias_rate",
               "be 0 with model.experts_per_token=1 (DeepSpeed's top-1 weighs its expert by its probability, which "
               "a biased choice cannot keep)", "route to 2 or more experts, or set model.router_bias_rate=0")
        c.that(self.n_experts == 0 or self.n_experts >= 2, "n_experts",
               f"be 0 (dense MLPs) or at least 2 (now {self.n_experts})", "set model.n_experts to 0, or 2 or more")
        c.that(not self.n_experts or self.experts_per_token <= self.n_experts, "experts_per_token",
               f"be at most model.n_experts={self.n_experts}", f"choose 1 to {self.n_experts}")
        c.at_least("lora_rank", 0, "0 trains every weight")
        c.above("lora_alpha", 0)
        c.not_empty("lora_targets")
        c.in_range("lora_dropout", 0.0, 1.0, high_open=True)
        c.that(not self.lora_dropout or self.lora_rank, "lora_dropout",
               "be 0 without adapters (model.lora_rank=0): it drops the adapters' input",
               "set model.lora_rank, or model.lora_dropout=0")
        c.that(self.rope_high_freq_factor > self.rope_low_freq_factor, "rope_high_freq_factor",
               f"be above model.rope_low_freq_factor={self.rope_low_freq_factor}", "raise it (Llama 3.1: 4 and 1)")

    def is_moe_block(self, index: int) -> bool:
        """Whether block `index` (from 0) has a mixture of experts: every moe_every-th, the last of each run."""
        return self.n_experts > 0 and index % self.moe_every == self.moe_every - 1

    @property
    def generates(self) -> bool:
        """Whether the model has next-token logits to sample or score text with (a score head has none)."""
        return self.head == "lm"

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_width(self) -> int:
        """Each head's width: model.head_dim, else n_embd / n_head."""
        return self.head_dim or self.n_embd // self.n_head

    @property
    def q_width(self) -> int:
        """The query projection's outputs, the output projection's inputs: n_head x head_width."""
        return self.n_head * self.head_width

    @property
    def padded_vocab_size(self) -> int:
        if self.vocab_size is None:
            raise ValueError("model.vocab_size is unset: resolve it from the dataset's meta.json first")
        m = self.vocab_multiple
        return (self.vocab_size + m - 1) // m * m


# The Llama's rotary position settings, which the GPT's and the encoder's positions never read.
ROPE_SETTINGS = ("rope_theta", "rope_scale_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                 "rope_original_context")
# Settings that change how the model trains, not the weights it holds: a checkpoint resumes under others.
TRAINING_SETTINGS = ("dropout", "document_masking", "capacity_factor", "router_aux_loss_coef", "router_z_loss_coef",
                     "lora_dropout")


# The settings a record written before they existed lacks, at the defaults that record's model had: dense MLPs
# (no mixture of experts, no shared expert), GPT-2's tanh GELU and the LM head.
EARLIER_DEFAULTS = {name: getattr(ModelConfig, name) for name in (
    "n_experts", "experts_per_token", "moe_every", "expert_hidden", "capacity_factor", "router_aux_loss_coef",
    "router_z_loss_coef", "router_bias_rate", "n_shared_experts", "activation", "head", "head_dim", "qkv_bias",
    "qk_norm", "lora_rank", "lora_alpha", "lora_targets", "lora_dropout")}


def saved_settings_gaps(settings: dict) -> tuple[list[str], list[str]]:
    """(missing, unknown): the model settings a saved record (a checkpoint's run state, an export) lacks, and the
    ones it holds that this version does not know. Both mean another version of the repo wrote it."""
    names = [f.name for f in fields(ModelConfig)]
    return [n for n in names if n not in settings and n not in EARLIER_DEFAULTS], sorted(set(settings) - set(names))


def model_config(settings: dict, source: str) -> ModelConfig:
    """The ModelConfig of saved model settings; `source` names the file they were read from. Settings this
    version does not know, or lacks, were written by another version: refused, not guessed."""
    missing, unknown = saved_settings_gaps(settings)
    if unknown:
        raise ConfigError(f"{source} holds model settings this version does not know ({', '.join(unknown)}): it was "
                          f"written by a newer version of this repo; fix: read it with that version")
    if missing:
        raise ConfigError(f"{source} lacks the model settings {', '.join(missing)}: it was written by an earlier "
                          f"version of this repo, which this one does not read; fix: read it with that version, or "
                          f"start a run from its weights with train.init_from (a GPT or Llama export is a Hugging "
                          f"Face folder)")
    return ModelConfig(**{**EARLIER_DEFAULTS, **settings})
