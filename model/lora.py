"""Low-rank adapters (LoRA, Hu et al. 2021) on a model's linear maps (model.lora_rank > 0): each targeted map
computes x W^T + b + (alpha / r) (x A^T) B^T with A (r x in) and B (out x r) trained and W, b frozen, as is every
other weight of the model but a reward model's score head. B starts at zero, so the adapted model starts as the
model it adapts.

The adapters are added to each layer as it is built, after the layer's own seeded initialization (so its weights
are those of the same seed without adapters), in every build alike: the plain module, a pipeline's stages, ZeRO-3's
layers (partitioned after), a checkpoint's reader. A map keeps its weight's name (`attn.q.weight`), so checkpoints,
Hugging Face's tables and `train.init_from` read the model's weights as they would without adapters; the
adapters are `attn.q.lora_a` and `attn.q.lora_b`. An export merges them into the weights (`merged`).
"""
import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, TiedLayerSpec

from model.config import ModelConfig
from model.layers import ScoreHead
from model.stack import spec_as
from model.tensor_parallel import COLUMN, ROW

ADAPTER_NAMES = ("lora_a", "lora_b")
ALL = "all"


class LoRALinear(nn.Module):
    """An nn.Linear's frozen weight and bias, under their own names, beside its trained adapters."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.in_features, self.out_features, self.scale = base.in_features, base.out_features, alpha / rank
        self.weight, self.bias = base.weight, base.bias
        like = {"dtype": base.weight.dtype, "device": base.weight.device}
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features, **like))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))  # nn.Linear's own initialization, as PEFT's
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, **like))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + F.linear(F.linear(x, self.lora_a), self.lora_b) * self.scale

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={self.lora_a.size(0)}"


def linear_maps(plan: dict, block: type) -> list[str]:
    """The linear maps of an architecture's block, as its tensor-parallel plan names them (each a column- or
    row-parallel map): the maps LoRA can target."""
    return [path for path, rule in plan.get(block, {}).items() if (rule[0] if isinstance(rule, tuple) else rule)
            in (COLUMN, ROW)]


def lora_targets(cfg: ModelConfig, maps: list[str]) -> list[str]:
    """model.lora_targets as the block's map paths: "all" of them, or a comma-separated subset."""
    if cfg.lora_targets == ALL:
        return maps
    return [name.strip() for name in cfg.lora_targets.split(",")]


def check_targets(cfg: ModelConfig, maps: list[str], title: str, c) -> None:
    """model.lora_targets names linear maps of the architecture's blocks (c: common.checks.Checks)."""
    unknown = [name for name in lora_targets(cfg, maps) if name not in maps]
    c.that(not cfg.lora_rank or not unknown, "lora_targets",
           f"name linear maps of {title}'s blocks, not {', '.join(unknown)}",
           f"name some of {', '.join(maps)}, or set it to {ALL}")


def with_adapters(specs: list, cfg: ModelConfig, maps: list[str]) -> list:
    """The layer list whose layers get their adapters as they are built (PipelineModule builds each stage's layers
    itself, so the adapters travel with the specs); as it is without model.lora_rank."""
    if not cfg.lora_rank:
        return specs
    out = []
    for spec in specs:
        spec = spec_as(spec, _AdaptedLayerSpec, _AdaptedTiedLayerSpec)
        spec.targets, spec.cfg = lora_targets(cfg, maps), cfg
        out.append(spec)
    return out


class _AdaptOnBuild:
    def build(self, log=False) -> nn.Module:
        return add_adapters(super().build(log), self.targets, self.cfg)


class _AdaptedLayerSpec(_AdaptOnBuild, LayerSpec):
    pass


class _AdaptedTiedLayerSpec(_AdaptOnBuild, TiedLayerSpec):
    pass


def add_adapters(layer: nn.Module, targets: list[str], cfg: ModelConfig) -> nn.Module:
    """Freeze the layer's weights (a score head's excepted) and put adapters on its maps named in `targets` (those
    it has as nn.Linear: a mixture of experts' feed-forward maps are DeepSpeed's experts, left frozen)."""
    if isinstance(layer, ScoreHead):
        return layer
    layer.requires_grad_(False)
    for path in targets:
        parent, _, child = path.rpartition(".")
        try:
            owner = layer.get_submodule(parent) if parent else layer
        except AttributeError:  # a part some layers of the class lack, or another class of layer
            continue
        if type(getattr(owner, child, None)) is nn.Linear:
            setattr(owner, child, LoRALinear(getattr(owner, child), cfg.lora_rank, cfg.lora_alpha))
    return layer


def is_adapter(name: str) -> bool:
    return name.rpartition(".")[2] in ADAPTER_NAMES


def merged(cfg: ModelConfig, state: dict) -> tuple[ModelConfig, dict]:
    """The model without adapters that computes what `state`'s does: each adapted weight W + (alpha / r) B A, in
    fp32 and back to its dtype, and the model config without LoRA. A model without adapters is returned as it is."""
    if not cfg.lora_rank:
        return cfg, state
    scale = cfg.lora_alpha / cfg.lora_rank
    out = {name: tensor for name, tensor in state.items() if not is_adapter(name)}
    for name in state:
        if name.endswith(".lora_a"):
            prefix = name[: -len("lora_a")]
            weight = out[f"{prefix}weight"]
            delta = state[f"{prefix}lora_b"].float() @ state[name].float()
            out[f"{prefix}weight"] = (weight.float() + scale * delta).to(weight.dtype)
    off = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name.startswith("lora_")}
    return dataclasses.replace(cfg, **off), out
