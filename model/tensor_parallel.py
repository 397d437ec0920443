"""Megatron-style tensor parallelism: the split layers, their collectives and the vocab-parallel loss.
model/parallelize.py puts these layers in place of an architecture's plain ones.

A layer is always built whole, from its seed, and initialized as at tp = 1; model/parallelize.py then swaps
its linear maps for this rank's slice. So one seed gives the same full weights at every tensor-parallel degree
(GPT-NeoX's way), at the cost of one whole layer in memory for a moment while the model is built.

    column-parallel  y_r = x W_r^T + b_r         output features split: q/k/v heads, MLP up and gate
    row-parallel     y = sum_r x_r W_r^T + b     input features split: attention and MLP output
    vocab-parallel   embedding rows, LM-head logits and the cross-entropy split over the vocabulary

A column-parallel map followed by a row-parallel one costs one all-reduce forward (after the row map) and
one backward (before the column map), Megatron's f and g. Under Megatron's sequence parallelism
(`sequence`) the all-reduce becomes a reduce-scatter along the sequence and the column map's input an
all-gather (the same bytes moved): between the maps (norms, residual adds) each rank holds 1/size of every
window's positions, and so of the activations kept for the backward. The blocks' input is split there, and the
gradients of the replicated weights the slices pass through (norm gains, row-parallel biases) are summed over
the tensor ranks as they are made (model/parallelize.py). Split parameters carry DeepSpeed's
`tensor_model_parallel` mark (ZeRO and the bf16 optimizer count their gradient norm on every tensor rank);
replicated ones (norms, row-parallel biases) stay bitwise equal across tensor ranks because those ranks see
the same batches and gradients. At tp = 1 these are the plain layers, with no communication.
"""
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from model.documents import hidden_and_positions, with_positions
from model.recompute import recomputed


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in its tensor-parallel group. `group` is None at size 1, and when only shapes are
    wanted (a model built on the meta device before any process group exists)."""
    size: int = 1
    rank: int = 0
    group: Any = None
    sequence: bool = False  # Megatron's sequence parallelism between the split maps

    def shard(self, full: int) -> tuple[int, int]:
        """[start, stop) of this rank's equal share of `full` rows, features or heads."""
        part = full // self.size
        return self.rank * part, (self.rank + 1) * part


SINGLE = TensorParallel()

# How a linear map splits: "column", "row", or ("column", parts) for a fused weight of `parts` equal
# blocks; "vocab" for an embedding's rows. Every split parameter records its rule (split_rule), which
# checkpoint resharding and export read back. "per_head": a module that stays whole but computes on this rank's
# heads alone (Qwen3's per-head norms), so its gradient is summed over the tensor ranks.
COLUMN, ROW, VOCAB, PER_HEAD = "column", "row", "vocab", "per_head"


def _all_reduce(x: torch.Tensor, tp: TensorParallel, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if tp.group is not None:
        dist.all_reduce(x, op=op, group=tp.group)
    return x


class _CopyToTensorRanks(torch.autograd.Function):
    """Megatron's f: identity forward; backward sums the input's gradient over the tensor ranks, each of
    which used the input for its own slice of the output."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.contiguous(), ctx.tp), None


class _ReduceFromTensorRanks(torch.autograd.Function):
    """Megatron's g: forward sums the partial outputs of the tensor ranks; backward is the identity (what
    follows is replicated, so every rank already holds the whole gradient)."""

    @staticmethod
    def forward(ctx, x, tp):
        return _all_reduce(x.contiguous(), tp)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def sum_over_tensor_ranks(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return _all_reduce(x, tp)


def _along_sequence(collective, x: torch.Tensor, tp: TensorParallel, parts: float) -> torch.Tensor:
    """`collective` (output, input) over dim 1 of (batch, time, ...) x: the collectives split dim 0, so time goes
    first; the output's time is `parts` x the input's."""
    first = x.transpose(0, 1).contiguous()
    out = first.new_empty((int(first.size(0) * parts), *first.shape[1:]))
    collective(out, first, group=tp.group)
    return out.transpose(0, 1)


def _gather_sequence(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return _along_sequence(dist.all_gather_into_tensor, x, tp, tp.size)


def _scatter_sequence(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return _along_sequence(dist.reduce_scatter_tensor, x, tp, 1 / tp.size)


def _slice_sequence(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    part = x.size(1) // tp.size
    return x[:, tp.rank * part:(tp.rank + 1) * part].contiguous()


class _AlongSequence(torch.autograd.Function):
    """`there` (x, tp) along the sequence forward, and `back`, its transpose, on the gradient. Megatron-SP's pairs:
    gather / reduce-scatter before a column map, reduce-scatter / gather after a row map, and slice / gather where
    the slices begin (a hidden state every tensor rank holds whole)."""

    @staticmethod
    def forward(ctx, x, tp, there, back):
        ctx.tp, ctx.back = tp, back
        return there(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return ctx.back(grad, ctx.tp), None, None, None


def split_sequence(inputs, tp: TensorParallel):
    """The hidden state of `inputs` (a tensor, or (tensor, positions)) cut to this rank's slice of the sequence;
    the positions stay whole, for the attention, which sees the whole sequence."""
    x, positions = hidden_and_positions(inputs)
    if x.size(1) % tp.size:
        raise ValueError(f"a sequence of {x.size(1)} positions does not split over {tp.size} tensor ranks")
    return with_positions(_AlongSequence.apply(x, tp, _slice_sequence, _gather_sequence), positions)


def to_split_input(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The input of a column-split map (or of the vocabulary-split logits): the sequence gathered under
    sequence parallelism, else Megatron's f."""
    return _AlongSequence.apply(x, tp, _gather_sequence, _scatter_sequence) if tp.sequence else \
        copy_to_tensor_ranks(x, tp)


def from_row_split(y: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The output of a row-split map: reduce-scattered along the sequence under sequence parallelism, else all-
    reduced (Megatron's g)."""
    return _AlongSequence.apply(y, tp, _scatter_sequence, _gather_sequence) if tp.sequence else \
        reduce_from_tensor_ranks(y, tp)


def sequence_padded(forward, tp: TensorParallel):
    """`forward` (token ids -> logits) for generation under sequence parallelism: the ids right-padded to a
    multiple of the degree (causal attention keeps the padding out of the logits before it), the logits cut back."""
    if not tp.sequence:
        return forward

    def run(idx: torch.Tensor, **options) -> torch.Tensor:
        t = idx.size(1)
        return forward(F.pad(idx, (0, -t % tp.size)), **options)[:, :t]
    return run


def copy_to_tensor_ranks(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return x if tp.size == 1 else _CopyToTensorRanks.apply(x, tp)


def reduce_from_tensor_ranks(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return x if tp.size == 1 else _ReduceFromTensorRanks.apply(x, tp)


def gather_vocab(logits: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Whole-vocabulary logits from each rank's slice (sampling and evaluation only: no gradient)."""
    if tp.size == 1:
        return logits
    parts = [torch.empty_like(logits) for _ in range(tp.size)]
    dist.all_gather(parts, logits.contiguous(), group=tp.group)
    return torch.cat(parts, dim=-1)


def _mark_split(p: nn.Parameter, dim: int, parts: int = 1) -> nn.Parameter:
    # DeepSpeed's and Megatron's names (runtime/utils.py is_model_parallel_parameter, partition_dim), plus
    # the block count of a fused weight: what split_rule reads back for resharding and export.
    p.tensor_model_parallel, p.partition_dim, p.fused_parts = True, dim, parts
    return p


def split_rule(p: torch.Tensor):
    """How a parameter is split: None (replicated), COLUMN, ROW or (COLUMN, parts)."""
    if not getattr(p, "tensor_model_parallel", False):
        return None
    kind = COLUMN if p.partition_dim == 0 else ROW
    return (kind, p.fused_parts) if p.fused_parts > 1 else kind


def _rows(full: torch.Tensor, tp: TensorParallel, parts: int) -> torch.Tensor:
    """This rank's share of each of the `parts` equal row blocks of `full` (a fused q|k|v weight has
    three, each split by heads), concatenated: the local weight has the full weight's block layout."""
    blocks = full.chunk(parts, dim=0)
    start, stop = tp.shard(blocks[0].size(0))
    return torch.cat([b[start:stop] for b in blocks]).clone()


class ColumnParallelLinear(nn.Module):
    """This rank's output features of `full` (bias included)."""

    def __init__(self, full: nn.Linear, tp: TensorParallel, parts: int = 1):
        super().__init__()
        self.tp = tp
        self.weight = _mark_split(nn.Parameter(_rows(full.weight.detach(), tp, parts)), 0, parts)
        self.bias = None if full.bias is None else _mark_split(nn.Parameter(_rows(full.bias.detach(), tp, parts)), 0,
                                                               parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(to_split_input(x, self.tp), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """This rank's input features of `full`; the bias is replicated and added once, after the sum."""

    def __init__(self, full: nn.Linear, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        start, stop = tp.shard(full.in_features)
        self.weight = _mark_split(nn.Parameter(full.weight.detach()[:, start:stop].clone()), 1)
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Its matmul's output is a partial sum of the whole sequence's width, the reduction's is its sum (whole, or
        # a slice of the sequence): selective recomputation keeps neither and runs both again.
        with recomputed():
            y = from_row_split(F.linear(x, self.weight), self.tp)
        return y if self.bias is None else y + self.bias


def column_slice(full: torch.Tensor, tp: TensorParallel, parts: int = 1) -> nn.Parameter:
    """This rank's rows of a weight or bias used as a column-parallel map outside an nn.Linear."""
    return _mark_split(nn.Parameter(_rows(full.detach(), tp, parts)), 0, parts)


def row_slice(full: torch.Tensor, tp: TensorParallel) -> nn.Parameter:
    """This rank's columns (input features) of a weight used as a row-parallel map outside an nn.Linear."""
    start, stop = tp.shard(full.size(1))
    return _mark_split(nn.Parameter(full.detach()[:, start:stop].clone()), 1)


def shard_parameter(full: torch.Tensor, rule, tp: TensorParallel) -> torch.Tensor:
    """This rank's slice of a whole parameter, by its split rule (loading whole weights into a split model)."""
    if rule is None or tp.size == 1:
        return full
    kind, parts = (rule, 1) if isinstance(rule, str) else rule
    if kind == ROW:
        start, stop = tp.shard(full.size(1))
        return full[:, start:stop]
    return _rows(full, tp, parts)


def merge_parameter(slices: list[torch.Tensor], rule) -> torch.Tensor:
    """The whole parameter from every tensor rank's slice, in rank order (the inverse of shard_parameter)."""
    if rule is None or len(slices) == 1:
        return slices[0]
    kind, parts = (rule, 1) if isinstance(rule, str) else rule
    if kind == ROW:
        return torch.cat(slices, dim=1)
    blocks = [s.chunk(parts, dim=0) for s in slices]
    return torch.cat([torch.cat([b[i] for b in blocks]) for i in range(parts)])


class VocabParallelEmbedding(nn.Module):
    """Rows [start, stop) of a whole token embedding (padded vocabulary) on this rank; a token outside them
    looks up zeros here and its row on the rank that holds it, and the sum over ranks is the embedding.
    As a tied LM head its rows give this rank's slice of the logits."""

    def __init__(self, full: nn.Module, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.start, stop = tp.shard(full.weight.size(0))
        self.weight = _mark_split(nn.Parameter(full.weight.detach()[self.start:stop].clone()), 0)

    def forward(self, inputs):
        idx, positions = hidden_and_positions(inputs)
        local = idx - self.start
        outside = (local < 0) | (local >= self.weight.size(0))
        x = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return with_positions(reduce_from_tensor_ranks(x, self.tp), positions)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(to_split_input(x, self.tp), self.weight)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-row cross-entropy over logits split by vocabulary (Megatron's): three all-reduces of one number
    per row (max, target logit, sum of exponentials) instead of gathering the vocabulary. Rows whose
    target is -100 (padding) add zero loss and zero gradient."""

    @staticmethod
    def forward(ctx, logits, targets, tp):
        # one fp32 copy, shifted and exponentiated in place: 4 bytes an entry where three copies took 12
        shifted = logits.to(torch.float32, copy=True)
        peak = _all_reduce(shifted.max(dim=-1).values, tp, dist.ReduceOp.MAX)
        shifted.sub_(peak.unsqueeze(-1))
        start = tp.rank * shifted.size(-1)
        local = targets - start
        here = (local >= 0) & (local < shifted.size(-1))
        rows = torch.arange(shifted.size(0), device=shifted.device)
        target_logit = _all_reduce(shifted[rows, local.clamp(0, shifted.size(-1) - 1)] * here, tp)
        exp = shifted.exp_()
        total = _all_reduce(exp.sum(dim=-1), tp)
        valid = targets != -100
        ctx.save_for_backward(exp.div_(total.unsqueeze(-1)), local, here & valid, valid)
        return (total.log() - target_logit) * valid

    @staticmethod
    def backward(ctx, grad):
        softmax, local, hit, valid = ctx.saved_tensors
        rows = torch.arange(softmax.size(0), device=softmax.device)
        softmax[rows[hit], local[hit]] -= 1.0
        return softmax.mul_((grad * valid).unsqueeze(-1)), None, None


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Summed next-token loss, in fp32, of (rows, vocab or vocab slice) logits; -100 targets add nothing."""
    if tp.size == 1:
        return F.cross_entropy(logits.float(), targets, reduction="sum")
    return _VocabParallelCrossEntropy.apply(logits, targets, tp).sum()


def cross_entropy_rows(logits: torch.Tensor, targets: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The next-token loss of each row of (rows, vocab or vocab slice) logits, in fp32; a -100 target's is 0."""
    if tp.size == 1:
        return F.cross_entropy(logits.float(), targets, reduction="none")
    return _VocabParallelCrossEntropy.apply(logits, targets, tp)
