"""Low-rank adapters (LoRA, Hu et al. 2021) on a model's linear maps (model.lora_rank > 0): each targeted map
computes x W^T + b + (alpha / r) (x A^T) B^T with A (r x in) and B (out x r) trained and W, b frozen, as is every
other weight of the model but a reward model's score head. B starts at zero, so the adapted model starts as the
model it adapts. While training, model.lora_dropout drops the adapters' x (PEFT's lora_dropout), not the frozen
map's.

The adapters are added to each layer as it is built, after the layer's own seeded initialization (so its weights
are those of the same seed without adapters) and tensor parallelism's split, in every build alike: the plain module,
a pipeline's stages, ZeRO-3's layers (partitioned after), a tensor rank's slice, a checkpoint's reader. A map
keeps its weight's name (`attn.q.weight`), so checkpoints, Hugging Face's tables and `train.init_from` read the
model's weights as they would without adapters; the adapters are `attn.q.lora_a` and `attn.q.lora_b`. An export
merges them into the weights (`merged`).
"""
import dataclasses
import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.config import ModelConfig
from model.layers import ScoreHead
from model.recompute import recomputed
from model.stack import built_then
from model.tensor_parallel import (
    COLUMN,
    ROW,
    SINGLE,
    ColumnParallelLinear,
    RowParallelLinear,
    column_slice,
    from_row_split,
    row_slice,
    sum_over_tensor_ranks,
    to_split_input,
)

ADAPTER_NAMES = ("lora_a", "lora_b")
ALL = "all"


class LoRALinear(nn.Module):
    """A linear map's frozen weight and bias, under their own names, beside its trained adapters. Under tensor
    parallelism (the map one of model/tensor_parallel.py's) each adapter splits as the map does: a column-split
    map's B by its output rows, A whole, whose gradient, each rank's part of the sum, is summed over the tensor
    ranks; a row-split map's A by its input columns, B whole, after the partial sums, likewise summed. Both terms
    go through the map's one collective. Drawn whole and then split, as the map's weights are, so a seed gives the
    same adapters at every degree; a row-split map's dropout mask likewise (`_dropped`)."""

    def __init__(self, base: nn.Module, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.dropout = dropout
        self.split = COLUMN if isinstance(base, ColumnParallelLinear) else ROW if isinstance(base, RowParallelLinear) \
            else None
        self.scale, self.tp = alpha / rank, getattr(base, "tp", SINGLE)
        self.weight, self.bias = base.weight, base.bias
        self.out_features, self.in_features = base.weight.shape  # this rank's
        like = {"dtype": base.weight.dtype, "device": base.weight.device}
        a = torch.empty(rank, self.in_features * (self.tp.size if self.split == ROW else 1), **like)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # nn.Linear's own initialization, as PEFT's
        b = torch.zeros(self.out_features * (self.tp.size if self.split == COLUMN else 1), rank, **like)
        self.lora_a = row_slice(a, self.tp) if self.split == ROW else nn.Parameter(a)
        self.lora_b = column_slice(b, self.tp, base.weight.fused_parts) if self.split == COLUMN else nn.Parameter(b)
        if self.split:
            self._sum_gradient(self.lora_a if self.split == COLUMN else self.lora_b)

    def _sum_gradient(self, p: nn.Parameter) -> None:
        p.register_hook(lambda grad: sum_over_tensor_ranks(grad.clone(), self.tp))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.split == ROW:
            with recomputed():  # as RowParallelLinear's: partial sums and their sum, neither kept
                y = from_row_split(self._maps(x, None), self.tp)
            return y if self.bias is None else y + self.bias
        return self._maps(to_split_input(x, self.tp) if self.split == COLUMN else x, self.bias)

    def _maps(self, x: torch.Tensor, bias) -> torch.Tensor:
        adapted = F.linear(F.linear(self._dropped(x), self.lora_a), self.lora_b)
        return F.linear(x, self.weight, bias) + adapted * self.scale

    def _dropped(self, x: torch.Tensor) -> torch.Tensor:
        """The adapters' input under dropout. A row-split map's ranks hold slices of one input, and a replica's
        tensor ranks draw from one generator state (train.py): each draws the whole input's mask, as one process
        would, and keeps a copy of its slice's columns (the whole mask freed), as F.dropout computes on a CPU (mask /
        (1 - p), times x)."""
        if not (self.training and self.dropout):
            return x
        if self.split != ROW:
            return F.dropout(x, self.dropout)
        start, stop = self.tp.shard(x.size(-1) * self.tp.size)
        mask = x.new_empty(*x.shape[:-1], x.size(-1) * self.tp.size).bernoulli_(1 - self.dropout)
        return x * mask[..., start:stop].div(1 - self.dropout)

    def extra_repr(self) -> str:
        return f"rank={self.lora_a.size(0)}, split={self.split}, dropout={self.dropout}"


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
    """The layer list whose layers get their adapters as they are built, after tensor parallelism's split; as it
    is without model.lora_rank."""
    if not cfg.lora_rank:
        return specs
    step = functools.partial(add_adapters, targets=lora_targets(cfg, maps), cfg=cfg)
    return [built_then(spec, step) for spec in specs]


def add_adapters(layer: nn.Module, targets: list[str], cfg: ModelConfig) -> nn.Module:
    """Freeze the layer's weights (a score head's excepted) and put adapters on its maps named in `targets` (those
    it has as linear maps, whole or split: a mixture of experts' feed-forward maps are DeepSpeed's experts, left
    frozen)."""
    if isinstance(layer, ScoreHead):
        return layer
    layer.requires_grad_(False)
    for path in targets:
        parent, _, child = path.rpartition(".")
        try:
            owner = layer.get_submodule(parent) if parent else layer
        except AttributeError:  # a part some layers of the class lack, or another class of layer
            continue
        if type(getattr(owner, child, None)) in (nn.Linear, ColumnParallelLinear, RowParallelLinear):
            setattr(owner, child, LoRALinear(getattr(owner, child), cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout))
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
