"""Ulysses sequence parallelism, applied to a built model: each rank of a sequence-parallel group holds a slice
of every window's sequence; around attention an all-to-all trades it for a slice of the heads (DeepSpeed's
DistributedAttention), the model's own attention core runs over the whole sequence for those heads, and a
second all-to-all trades back. Everything else (embeddings, norms, MLP, head, loss) is per token and runs on
the slice as it is.

The model has no parallel code: its attention modules call `self.core(q, k, v, dropout, positions)`, the plain
causal (or document) attention of model/layers.py; `sequence_parallel` swaps each core for a `UlyssesCore`.
Under sequence parallelism every layer's input carries positions (the loader ships each token's position in its
window, or in its document under document masking): learned positions and RoPE read them for the slice, and
the cores gather the whole window's for the document mask, once a forward pass.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from deepspeed.sequence.layer import DistributedAttention

from common.checks import ConfigError
from model.config import ModelConfig
from model.layers import causal_attention
from model.registry import architecture, supporting


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's place in its sequence-parallel group: `size` ranks, each holding 1/size of the sequence."""
    size: int = 1
    rank: int = 0
    group: object = None

    def split(self, inputs, targets) -> tuple:
        """This rank's slice of a batch of windows: inputs as (token ids, positions), the positions the window's
        own (0, 1, ...) where the batch carries none, and the targets alike. Targets that are a tuple carry values
        of whole rows after the per-token targets: those stay whole."""
        if self.size == 1:
            return inputs, targets
        tokens, positions = inputs if isinstance(inputs, tuple) else (inputs, None)
        if positions is None:
            positions = torch.arange(tokens.size(1), device=tokens.device).expand_as(tokens)
        part = self.part(tokens.size(1))
        sliced = (targets[0][:, part], *targets[1:]) if isinstance(targets, tuple) else targets[:, part]
        return (tokens[:, part], positions[:, part].contiguous()), sliced

    def part(self, length: int) -> slice:
        n = length // self.size
        return slice(self.rank * n, (self.rank + 1) * n)


NO_SEQUENCE_PARALLEL = SequenceParallel()


def check_sequence_parallel(cfg: ModelConfig, tp_size: int, sp_size: int) -> None:
    """Refuse what Ulysses cannot split: a context or a head count the degrees do not divide, an architecture
    without it."""
    if sp_size == 1:
        return
    arch = architecture(cfg)
    if not arch.supports("sequence_parallel"):
        raise ConfigError(f"sequence_parallel_size > 1 needs {supporting('sequence_parallel')}: "
                          f"{arch.unsupported['sequence_parallel']}")
    if cfg.block_size % sp_size:
        raise ConfigError(f"sequence_parallel_size={sp_size} does not divide model.block_size={cfg.block_size}: each "
                          f"sequence rank holds an equal slice of the window; choose a degree that divides it")
    for what, count in (("the query heads (model.n_head)", cfg.n_head), ("the key/value heads (model.n_kv_head)",
                                                                          cfg.kv_heads)):
        if count % (tp_size * sp_size):
            raise ConfigError(f"tensor x sequence-parallel degree {tp_size} x {sp_size} does not divide {what} = "
                              f"{count}: the all-to-all gives each sequence rank whole heads of its tensor slice; "
                              f"lower sequence_parallel_size or tensor_model_parallel_size")


class WindowPositions:
    """The whole window's positions (batch, time) from every rank's slice: where its documents begin. A forward
    pass hands one positions tensor from layer to layer, so it is gathered once, at the first layer, and the
    others find it (the same tensor, unchanged since: its version counter) gathered already."""

    def __init__(self, sp: SequenceParallel):
        self.sp, self.last = sp, (None, -1, None)  # (slice, its version, the whole window's)

    def __call__(self, positions: torch.Tensor) -> torch.Tensor:
        held, version, whole = self.last
        if positions is not held or positions._version != version:
            slices = [torch.empty_like(positions) for _ in range(self.sp.size)]
            dist.all_gather(slices, positions.contiguous(), group=self.sp.group)
            whole = torch.cat(slices, dim=1)
            self.last = (positions, positions._version, whole)
        return whole


class UlyssesCore(nn.Module):
    """An attention core over a sequence slice: (batch, heads, time / sp, head_dim) in and out."""

    def __init__(self, sp: SequenceParallel, window_positions: WindowPositions | None):
        """window_positions: under document masking, the gatherer every core of the model shares."""
        super().__init__()
        self.window_positions = window_positions
        # q, k, v as (batch, time, heads, head_dim): scatter the heads (2), gather the sequence (1).
        self.attention = DistributedAttention(self._whole_sequence, sp.group, scatter_idx=2, gather_idx=1)

    def forward(self, q, k, v, dropout: float, positions: torch.Tensor | None) -> torch.Tensor:
        whole = self.window_positions(positions) if self.window_positions else None
        out = self.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0, None, dropout, whole)
        return out.transpose(1, 2)

    @staticmethod
    def _whole_sequence(q, k, v, dropout: float, positions: torch.Tensor | None) -> torch.Tensor:
        """The model's attention for this rank's heads over the whole sequence: (batch, time, heads / sp, dim)."""
        return causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout,
                                positions).transpose(1, 2)


def sequence_parallel(model: nn.Module, sp: SequenceParallel, document_masking: bool) -> nn.Module:
    """The built model (or layer) with every attention core swapped for a UlyssesCore over `sp`; returns it."""
    if sp.size == 1:
        return model
    window_positions = WindowPositions(sp) if document_masking else None
    for module in [m for m in model.modules() if getattr(m, "core", None) is causal_attention]:
        module.core = UlyssesCore(sp, window_positions)
    return model


def gathered_logits(forward, sp: SequenceParallel):
    """`forward` (token ids -> logits) for generation under sequence parallelism: each sequence rank runs its
    slice of the ids, right-padded to a multiple of the degree (causal attention keeps the padding out of the
    logits before it), and the slices' logits are gathered."""
    if sp.size == 1:
        return forward

    def run(idx: torch.Tensor) -> torch.Tensor:
        t = idx.size(1)
        ids = torch.nn.functional.pad(idx, (0, -t % sp.size))
        logits = forward(sp.split(ids, ids)[0]).contiguous()
        slices = [torch.empty_like(logits) for _ in range(sp.size)]
        dist.all_gather(slices, logits, group=sp.group)
        return torch.cat(slices, dim=1)[:, :t]
    return run
