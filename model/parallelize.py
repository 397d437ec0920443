"""Tensor parallelism applied to an architecture's layer list, from its plan (torchtitan's way: the model
has no parallel code; the plan, declared with its Architecture, names which of its maps split and how).

Each layer is built whole from its seed, as at tp = 1, and then split: the split layers of
model/tensor_parallel.py take this rank's slice of the whole weights. So one seed gives the same full
weights at every degree.

Under Megatron's sequence parallelism the first block cuts the hidden state to this rank's slice of the sequence,
the split maps gather and scatter it, and every layer from there on sums the gradients of its replicated weights
over the tensor ranks, each of which saw a slice.
"""
import functools

import torch.nn as nn

from common.checks import ConfigError
from model.config import ModelConfig
from model.moe import MoEFeedForward
from model.registry import architecture
from model.stack import built_then
from model.tensor_parallel import (
    COLUMN,
    PER_HEAD,
    VOCAB,
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
    column_slice,
    split_rule,
    split_sequence,
    sum_over_tensor_ranks,
    to_split_input,
)


def check_tensor_parallel(cfg: ModelConfig, size: int) -> None:
    """What a tensor-parallel degree must divide: each rank holds whole heads (whole groups of query heads
    under grouped-query attention), an equal share of the MLP's features and of the padded vocabulary."""
    if size == 1:
        return
    arch = architecture(cfg)
    shares = {"model.n_head": cfg.n_head, "the padded vocabulary (model.vocab_size rounded up to model."
              "vocab_multiple)": cfg.padded_vocab_size, "the MLP width (model.ffn_hidden)": arch.mlp_hidden(cfg)}
    if cfg.n_shared_experts:
        shares["the shared expert's width (model.n_shared_experts x the experts' width)"] = arch.shared_hidden(cfg)
    if arch.grouped_query_attention:
        shares["the key/value heads (model.n_kv_head)"] = cfg.kv_heads
    for what, count in shares.items():
        if count % size:
            raise ConfigError(f"tensor_model_parallel_size={size} does not divide {what} = {count}: every tensor-"
                              f"parallel rank holds an equal share. Choose a degree that divides it")


def check_sequence_split(cfg: ModelConfig, tp_size: int, sp_size: int) -> None:
    """What Megatron's sequence parallelism (ds_config tensor_sequence_parallel) cannot run with, refused."""
    refusals = [
        (cfg.block_size % tp_size, f"tensor_model_parallel_size={tp_size} does not divide model.block_size="
                                   f"{cfg.block_size}: each tensor rank holds an equal slice of the sequence"),
        (sp_size > 1, f"Ulysses' sequence_parallel_size={sp_size} slices the sequence already"),
        (cfg.n_experts, "DeepSpeed's MoE layer shares the tokens out over the tensor ranks itself"),
        (cfg.dropout > 0, f"model.dropout={cfg.dropout} would draw the same mask for every tensor rank's slice"),
        (cfg.head != "lm", "the score head is not split, and reads every position"),
    ]
    for refused, why in refusals:
        if refused:
            raise ConfigError(f"tensor_sequence_parallel=true cannot run here: {why}; fix: remove "
                              f"tensor_sequence_parallel from the ds_config")


def parallelize(specs: list, plan: dict, tp: TensorParallel, block: type) -> list:
    """The layer list whose layers split themselves over `tp` as they are built. plan: the Architecture's, per layer
    class; block: its block class, where the sequence is cut under sequence parallelism."""
    if tp.size == 1:
        return specs
    first = next(i for i, spec in enumerate(specs) if spec.typename is block) if tp.sequence else len(specs)
    return [built_then(spec, functools.partial(_split, plan=plan.get(spec.typename, {}), tp=tp,
                                               cuts_sequence=i == first, sliced=i >= first))
            if spec.typename in plan or i >= first else spec for i, spec in enumerate(specs)]


def _split(layer: nn.Module, plan: dict, tp: TensorParallel, cuts_sequence: bool, sliced: bool) -> nn.Module:
    layer = apply_plan(layer, plan, tp)
    if cuts_sequence:
        layer.register_forward_pre_hook(lambda _, args: (split_sequence(args[0], tp), *args[1:]))
    if sliced:  # every replicated weight from here on sees a slice of the sequence
        sum_gradients_over_tensor_ranks(layer, tp)
    return layer


def apply_plan(layer: nn.Module, plan: dict, tp: TensorParallel) -> nn.Module:
    """Swap the planned maps of a freshly built layer for this rank's slice of them; returns the layer (a
    new module where the plan splits the layer itself)."""
    for path, rule in plan.items():
        if not path:
            return _split_module(layer, rule, tp)
        parent, _, child = path.rpartition(".")
        try:
            owner = layer.get_submodule(parent) if parent else layer
        except AttributeError:  # a part some layers of the class lack: the shared expert of a block without one
            continue
        if isinstance(owner, MoEFeedForward):
            continue  # experts stay whole: DeepSpeed's layer shares the tokens out over the tensor ranks
        target = getattr(owner, child)
        if target is None:  # a part this model leaves out (the per-head norms of a Llama without them)
            continue
        if rule == PER_HEAD:
            sum_gradients_over_tensor_ranks(target, tp)
        elif isinstance(target, nn.Parameter):
            kind, parts = _rule(rule)
            assert kind == COLUMN, f"{path}: a bare parameter splits column-wise only"
            setattr(owner, child, column_slice(target, tp, parts))
            _copy_input_to_tensor_ranks(owner, tp)
        else:
            setattr(owner, child, _split_module(target, rule, tp))
    return layer


def _rule(rule) -> tuple[str, int]:
    return (rule, 1) if isinstance(rule, str) else rule


def _split_module(module: nn.Module, rule, tp: TensorParallel) -> nn.Module:
    kind, parts = _rule(rule)
    if kind == VOCAB:
        return VocabParallelEmbedding(module, tp)
    return ColumnParallelLinear(module, tp, parts) if kind == COLUMN else RowParallelLinear(module, tp)


def _copy_input_to_tensor_ranks(module: nn.Module, tp: TensorParallel) -> None:
    """Megatron's f (or the sequence's gather) in front of a module computing with bare column-split parameters,
    once per module."""
    if not getattr(module, "_copies_input_to_tensor_ranks", False):
        module.register_forward_pre_hook(lambda _, args: (to_split_input(args[0], tp), *args[1:]))
        module._copies_input_to_tensor_ranks = True


def sum_gradients_over_tensor_ranks(module: nn.Module, tp: TensorParallel) -> None:
    """Each replicated weight of `module` that computes on this rank's part alone (a slice of the sequence, its
    heads) gets the sum of the ranks' gradients as each backward makes them, before DeepSpeed's own hooks take them
    (so gradient accumulation, ZeRO's reduction and the norm see the sum); once, however many reasons apply. Marked
    `sequence_parallel`, Megatron's name."""
    for p in module.parameters():
        if split_rule(p) is None and p.requires_grad and not getattr(p, "sequence_parallel", False):
            p.sequence_parallel = True
            p.register_hook(lambda grad: sum_over_tensor_ranks(grad.clone(), tp))
