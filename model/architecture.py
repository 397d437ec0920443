"""An architecture as one object (torchtitan's ModelSpec): everything the rest of the repo asks of a model,
declared at the bottom of the model's own file (model/gpt.py, model/llama.py, model/encoder.py) and found from
`model.arch` through model/registry.py. Code outside model/ asks the object, never compares `arch` with a name.
"""
import contextlib
from dataclasses import dataclass, field
from typing import Callable, Optional

from model.config import ModelConfig

# How a tensor moves between this repo's layout and Hugging Face's: as it is, transposed (GPT-2's Conv1D stores
# (in, out)), or cut to / padded from the real vocabulary (our embedding and head have `padded_vocab_size` rows).
SAME, TRANSPOSED, VOCAB_ROWS = "same", "transposed", "vocab"
# The key of a layout's entry for the blocks with experts, beside the class's own: (block class, EXPERTS).
EXPERTS = "experts"
# The models a Hugging Face layout holds: dense ones, with routed experts, or with a shared expert beside them.
DENSE, ROUTED, SHARED = "dense", "routed", "shared"


def _accepts_all(*_) -> None:
    pass


def _no_experts(config: dict) -> tuple[int, int]:
    return 0, 0


class TrainingHooks:
    """What a model adds to the training loop beyond its forward and loss (torchtitan's model-spec hooks): the
    loop calls each at its point, whatever the model; the base adds nothing. `model` is the module DeepSpeed
    trains (a plain module or a pipeline stage), `driver` the engine's (training/engines.py)."""

    def after_step(self, model, driver) -> None:
        """Collective, after each optimizer step."""

    def progress(self, model) -> tuple[dict, str]:
        """Collective, at each progress line: figures of the steps since the last call, and their text there
        (" | ..." or "")."""
        return {}, ""

    def evaluating(self, model):
        """A context around an evaluation's forwards."""
        return contextlib.nullcontext()

    def evaluation(self, model) -> tuple[dict, str]:
        """Collective, after an evaluation: its figures (metrics.jsonl names) and their text in its line."""
        return {}, ""


NO_HOOKS = TrainingHooks()


def _no_hooks(cfg: ModelConfig) -> TrainingHooks:
    return NO_HOOKS


@dataclass(frozen=True)
class HuggingFace:
    """The architecture in Hugging Face's layout (training/checkpoints/hf.py reads and writes it, both directions)."""
    architecture: str  # config.json's "architectures" entry, e.g. "GPT2LMHeadModel"
    scorer: str  # the entry of a model with a score head (model.head=score), e.g. "GPT2ForSequenceClassification"
    model_type: str  # config.json's "model_type": how an import recognizes the family
    # Per layer class: (our name within the layer, Hugging Face's, how it moves); "{i}" is the block's index.
    layers: dict
    config: Callable[[ModelConfig], dict]  # config.json's fields of this family, after the shared ones
    # the model settings a folder's config.json in this layout describes, beside its `settings` (a KeyError names
    # a field it lacks; a ConfigError a model this repo does not compute)
    read: Callable[[dict], dict]
    check: Callable[[ModelConfig], None] = _accepts_all  # raises ConfigError for a model the layout cannot hold
    # raises ConfigError for a folder's config.json (a dict) that cannot start this model, the message beginning with
    # how the folder is named ("train.init_from=DIR")
    check_folder: Callable[[dict, ModelConfig, str], None] = _accepts_all
    # (routed experts, shared experts) of a folder's config.json in this layout: what model.n_experts and
    # model.n_shared_experts must be to start from it
    folder_experts: Callable[[dict], tuple[int, int]] = _no_experts
    experts: str = DENSE  # the models it holds: DENSE, ROUTED or SHARED
    # ... and the model settings they have, (name, value) pairs: Qwen2's layout is the Llama's with qkv_bias=True
    settings: tuple = ()

    def holds(self, cfg: ModelConfig) -> bool:
        kind = SHARED if cfg.n_shared_experts else ROUTED if cfg.n_experts else DENSE
        return kind == self.experts and all(getattr(cfg, name) == value for name, value in self.settings)

    def pairs(self, spec) -> list:
        """(ours, theirs, how) of a layer of the model's layer list: a block with experts (built with moe=True)
        takes its class's entry under (class, EXPERTS) where the layout has one."""
        if spec.module_kwargs.get("moe") and (spec.typename, EXPERTS) in self.layers:
            return self.layers[spec.typename, EXPERTS]
        return self.layers[spec.typename]


@dataclass(frozen=True)
class Architecture:
    name: str  # the value of model.arch
    title: str  # how messages name it: "the GPT"
    layers: Callable[[ModelConfig], list]  # the ordered layer list (LayerSpecs): the model's single definition
    # The class of its transformer blocks: every pipeline stage must hold one; activation checkpointing and
    # torch.compile wrap only these (never the embedding: its input needs no grad).
    block: type
    # Tensor parallelism: per layer class, the submodule (or parameter) at each path and how it splits; "" is
    # the layer itself (model/parallelize.py applies it).
    plan: dict
    # Its Hugging Face layouts (none: an export keeps this repo's names); a model takes the first that holds it.
    # One class may have several (Qwen2-MoE's, with q/k/v biases and without): a folder is read by its class's.
    hf: tuple[HuggingFace, ...]
    mlp_matrices: int  # weight matrices of the MLP (FLOPs per token, the memory plan's MLP activations)
    mlp_width: Callable[[ModelConfig], int]  # the MLP's hidden width when model.ffn_hidden is unset
    tied_embeddings: str  # "always", "optional" (model.tie_embeddings) or "never": the LM head reuses the embedding
    # Rotary position tables: under document masking each token gathers its own cos and sin (the memory plan).
    rope: bool = False
    # RMSNorm: on a CPU torch composes it of fp32 operators, which keep 6 bytes an element more than a GPU's fused
    # kernel for the backward pass (the memory plan).
    rms_norm: bool = False
    grouped_query_attention: bool = False  # model.n_kv_head key/value heads, which tensor ranks split too
    # Features it lacks ("document_masking", "sequence_parallel", "mlp_tiling", "mixture_of_experts", and the
    # attention's settings of model/registry.py's ATTENTION_OPTIONS), each with the reason told to a run that asks
    # for it; it supports every other.
    unsupported: dict = field(default_factory=dict)
    # Model settings it never reads: weights of its models with other values of them compute the same (the GPT's
    # GELU for a Llama, which model.activation's comment promises: a GPT preset runs as a Llama).
    ignores: tuple[str, ...] = ()
    # check(cfg, c): its own range checks (c: common.checks.Checks), run by ModelConfig.check after the shared ones.
    check: Callable = _accepts_all
    training_hooks: Callable[[ModelConfig], TrainingHooks] = _no_hooks  # what a model of it adds to the loop

    def __repr__(self) -> str:
        return f"Architecture({self.name!r})"

    def mlp_hidden(self, cfg: ModelConfig) -> int:
        """The MLP's hidden width: model.ffn_hidden, else this architecture's own."""
        return cfg.ffn_hidden or self.mlp_width(cfg)

    def hf_layout(self, cfg: ModelConfig) -> Optional[HuggingFace]:
        """The Hugging Face layout of this model (None: none holds it)."""
        return next((hf for hf in self.hf if hf.holds(cfg)), None)

    def expert_hidden(self, cfg: ModelConfig) -> int:
        """An expert's SwiGLU width: model.expert_hidden, else the dense MLP's."""
        return cfg.expert_hidden or self.mlp_hidden(cfg)

    def shared_hidden(self, cfg: ModelConfig) -> int:
        """The shared expert's width: n_shared_experts experts' (0: none)."""
        return cfg.n_shared_experts * self.expert_hidden(cfg)

    def supports(self, feature: str) -> bool:
        return feature not in self.unsupported

    def ties(self, cfg: ModelConfig) -> bool:
        """Whether this model's LM head is its token embedding (a score head never is)."""
        if cfg.head != "lm":
            return False
        return self.tied_embeddings == "always" or (self.tied_embeddings == "optional" and cfg.tie_embeddings)
