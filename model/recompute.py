"""Activation recomputation of the checkpointed blocks (the ds_config's pipeline.activation_checkpoint_interval and
pipeline.recompute), one function for both builds: LayerStack calls it on its chunks of blocks, PipelineModule takes
it as its activation_checkpoint_func; a compiled block (train.compile) runs it inside its own graph
(recompute_selectively).

- "full": the block keeps only its input and runs its whole forward again in the backward pass (DeepSpeed's
  checkpoint: about a third more FLOPs a step).
- "selective": the block also keeps the outputs of its matmuls and its attention, and runs again only the cheap ops
  between them (norms, RoPE, activation functions, dropout with its RNG state replayed, residual adds): torch's
  selective checkpoint with torchtitan's op-level policy, every matmul kept (torchtitan recomputes every second
  one). No matmul runs twice; the block keeps about half of what it keeps unchecked (training/memory_plan.py
  counts it). Under tensor parallelism the row-parallel maps' partial sums are not kept (`recomputed`): the
  attention's projection and its reduction run again, and the MLP's unless torch's recomputation stops before it
  (it stops once the block's backward pass has what it needs; where that falls depends on how the linear maps save
  their inputs, which ZeRO-3 changes).
"""
import contextlib
import threading

import torch
from deepspeed.runtime.activation_checkpointing.checkpointing import checkpoint as full_checkpoint
from torch.utils.checkpoint import (
    CheckpointPolicy,
    _CachedTorchDispatchMode,
    checkpoint,
    create_selective_checkpoint_contexts,
)
from torch.utils.flop_counter import flop_registry

import model.cpu_attention  # noqa: F401  registers torch.ops.megalite

# The operators whose FLOPs torch's flop counter counts (matmuls, convolutions, the fused attention kernels), and
# those it does not know: a CPU's flash attention and this repo's CPU kernel (model/cpu_attention.py).
KEPT = frozenset(flop_registry) | {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
                                   torch.ops.megalite.causal_attention}


_unkept = threading.local()  # a forward pass on another thread keeps its own


@contextlib.contextmanager
def recomputed():
    """Under selective recomputation, what runs inside is run again in the backward pass, matmuls too: where
    keeping an output would cost more memory than the block's other outputs together (a row-parallel map's partial
    sums, whole on every tensor rank)."""
    depth = getattr(_unkept, "depth", 0)
    _unkept.depth = depth + 1
    try:
        yield
    finally:
        _unkept.depth = depth


def _kept_kind(op) -> bool:
    return getattr(op, "overloadpacket", op) in KEPT  # a higher-order operator (FlexAttention) is its own packet


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if _kept_kind(op) and not getattr(_unkept, "depth", 0):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class _MatchKeptOperators(_CachedTorchDispatchMode):
    """torch's mode for the recomputation, which hands each operator the policy kept its output from the forward
    pass, in order, but matching only the kinds the policy keeps. torch's own matches every operator, and stops where
    the recomputation runs one the forward pass did not: ZeRO-3's gathers and releases of the weights run others in
    the backward pass ("aten.empty.memory_format encountered during backward but not found in storage"). The policy
    recomputes every other operator anyway. (A subclass of torch's private class: where torch changes it,
    tests/test_recompute.py and the ZeRO-3 run of tests/test_tensor_parallel.py fail.)"""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _kept_kind(func):
            return super().__torch_dispatch__(func, types, args, kwargs)
        return func(*args, **(kwargs or {}))


def _contexts():
    caching, cached = create_selective_checkpoint_contexts(_keep_matmuls)
    # torch 2.11 (the GPU images') asks the policy again in the recomputation and requires the flag; later versions
    # ignore the one and default the other
    return caching, _MatchKeptOperators(_keep_matmuls, cached.storage, cached.allow_cache_entry_mutation)


def selective_checkpoint(function, *args):
    """function(*args) keeping its matmuls' and attention's outputs for the backward pass, recomputing the rest."""
    return checkpoint(function, *args, use_reentrant=False, context_fn=_contexts)


def recompute_selectively(block: torch.nn.Module) -> None:
    """Swap in a forward that checkpoints the block's own, selectively: compiled, the checkpoint is inside the
    block's graph (torchtitan's order), whose partitioner keeps what the policy keeps; torch's selective checkpoint
    cannot wrap a compiled block from outside (it finds the outputs it kept changed)."""
    forward = block.forward

    def checkpointed(inputs):
        return selective_checkpoint(forward, inputs)
    block.forward = checkpointed


def checkpoint_function(recompute: str):
    """The checkpoint a chunk of blocks runs under: function(chunk_forward, *tensors) -> outputs."""
    return selective_checkpoint if recompute == "selective" else full_checkpoint
