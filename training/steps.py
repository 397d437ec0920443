"""The arithmetic of a training step whatever the engine: the chunked language-model loss, the supervised
share of a batch, the gradient norm as ZeRO counts it, the check of weights nothing re-synchronizes, and what
the repo changes in a built engine.
training/engines.py drives the engines with them."""
import functools
import math

import torch
from deepspeed.moe.utils import is_moe_param
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
from torch.utils.checkpoint import checkpoint

from data.token_data import IGNORE
from model.tensor_parallel import SINGLE, TensorParallel, cross_entropy_sum, split_rule

# Rows (tokens) of logits whose fp32 log-softmax exists at once in the training loss: 8192 x 50304 x 4 bytes
# is 1.6 GB, against 2.5 GB for GPT-2's micro batch 12 x 1024 taken whole.
LOSS_CHUNK_ROWS = 8192


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, chunk_rows: int = LOSS_CHUNK_ROWS,
            tp: TensorParallel = SINGLE, divisor: torch.Tensor | None = None, compiled: bool = False) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32 (or the sum over `divisor`: supervised_share), over logits of the
    whole vocabulary or, under tensor parallelism, of this rank's slice of it. With gradients, a chunk of rows
    at a time, so that the fp32 log-softmax never exists for the whole batch (only the 16-bit logits do):
    CrossEntropyWithGradient on one rank; over a vocabulary split by tensor ranks, each chunk under activation
    checkpointing (made in the forward pass, dropped, made again in the backward pass). `compiled` (train.compile)
    makes each chunk of one rank's loss with inductor's kernels (fused_chunk)."""
    logits, targets = logits.view(-1, logits.size(-1)), targets.reshape(-1)
    divisor = targets.numel() if divisor is None else divisor
    if not torch.is_grad_enabled():
        return cross_entropy_sum(logits, targets, tp) / divisor
    if tp.size == 1:
        return CrossEntropyWithGradient.apply(logits, targets, chunk_rows, divisor, compiled)
    sums = [checkpoint(cross_entropy_sum, rows, row_targets, tp, use_reentrant=False)
            for rows, row_targets in zip(logits.split(chunk_rows), targets.split(chunk_rows))]
    return torch.stack(sums).sum() / divisor


class CrossEntropyWithGradient(torch.autograd.Function):
    """Mean (summed over `divisor`) cross-entropy of (rows, vocab) logits whose gradient is made in the forward pass, a
    chunk of rows at a time, in the logits' dtype: (softmax - the target's one-hot) / divisor, from an fp32
    log-softmax read straight from the 16-bit logits, shifted by log(divisor) before the exponential (and by
    infinity for rows whose target is -100, which add nothing); eager_chunk, or fused_chunk compiled. Against
    F.cross_entropy of the fp32 logits under checkpointing, it makes no fp32 copy of the logits and no second
    log-softmax (on a GPU the loss was a quarter of a GPT-2 124M step: docs/performance.md), and keeps the logits'
    gradient in place of the logits (the same bytes) from the forward pass to the backward pass, which scales it in
    place by the upstream gradient: 1 unless DeepSpeed divides the loss by gradient accumulation steps (or scales it
    for fp16). That product is exact on a CPU; a GPU's kernel rounds the factor to 16 bits first, exact for powers
    of two. The graph is not for a second backward pass."""

    @staticmethod
    def forward(ctx, logits, targets, chunk_rows, divisor, compiled):
        grad = torch.empty_like(logits)
        # a number's logarithm on the host: a tensor made from it on a GPU would wait for the device
        log_divisor = divisor.float().log() if torch.is_tensor(divisor) else math.log(divisor)
        chunk = compiled_chunk() if compiled else eager_chunk
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for rows, row_targets, row_grad in zip(logits.split(chunk_rows), targets.split(chunk_rows),
                                               grad.split(chunk_rows)):
            total -= chunk(rows, row_targets, row_grad, log_divisor, divisor)
        ctx.save_for_backward(grad)
        return total / divisor

    @staticmethod
    def backward(ctx, upstream):
        grad, = ctx.saved_tensors
        return grad.mul_(upstream), None, None, None, None


def eager_chunk(rows, targets, grad, log_divisor, divisor) -> torch.Tensor:
    """A chunk's summed target log-probability, its loss's gradient written into `grad`, through an fp32
    log-softmax of the chunk that the exponential and the one-hot's subtraction then update in place."""
    valid = targets != IGNORE
    picked = targets.clamp(min=0).unsqueeze(1)
    probs = torch.log_softmax(rows, dim=-1, dtype=torch.float32)
    target = torch.where(valid, probs.gather(1, picked).squeeze(1), 0.0)
    # in place, fp32: a CPU's kernels cast a result into another dtype (or scatter into bf16) slowly
    probs.sub_(torch.where(valid, log_divisor, float("inf")).unsqueeze(1)).exp_()
    probs.scatter_(1, picked, torch.where(valid, (target.exp() - 1) / divisor, 0.0).unsqueeze(1))
    grad.copy_(probs)
    return target.sum()


def fused_chunk(rows, targets, grad, log_divisor, divisor) -> torch.Tensor:
    """eager_chunk's arithmetic written for inductor to fuse: reductions that read the 16-bit chunk for its
    log-sum-exp, and one kernel that writes the gradient from it, with no fp32 copy of the chunk in memory: about
    8 bytes of memory traffic an entry, where eager_chunk's fp32 passes move about 30 (docs/performance.md)."""
    valid = targets != IGNORE
    picked = targets.clamp(min=0).unsqueeze(1)
    x = rows.float()
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    target = torch.where(valid, (x.gather(1, picked) - lse).squeeze(1), 0.0)
    probs = torch.exp(x - torch.where(valid.unsqueeze(1), lse + log_divisor, float("inf")))
    one_hot = torch.arange(x.size(1), device=x.device) == picked
    grad.copy_(torch.where(one_hot, torch.where(valid, (target.exp() - 1) / divisor, 0.0).unsqueeze(1), probs))
    return target.sum()


@functools.cache
def compiled_chunk():
    """fused_chunk compiled, made at its first use: torch.compile imports dynamo, seconds that a process which never
    compiles should not pay. dynamic=False: a step's chunks come in two sizes at most (the whole ones and the rest),
    each compiled once."""
    return torch.compile(fused_chunk, dynamic=False)


def supervised_share(micro_batches: list, group, data_parallel: int) -> torch.Tensor:
    """The supervised targets of the whole global batch over (micro-batches x data-parallel ranks), on the device.
    A micro-batch's summed loss divided by it, DeepSpeed's mean over micro-batches and ranks is the mean over
    the global batch's supervised tokens: a short answer weighs as much as its tokens, whatever the layout."""
    count = sum((targets != IGNORE).sum() for _, targets in micro_batches).float()
    torch.distributed.all_reduce(count, group=group)
    return count / (len(micro_batches) * data_parallel)


def data_parallel_group(engine):
    """The process group of the engine's data-parallel replicas (None: all ranks, when every rank is one)."""
    return engine.mpu.get_data_parallel_group() if engine.mpu else None


def adjust_engine(engine) -> None:
    """What the repo changes in a built DeepSpeed engine, for train.py and the benchmarks alike."""
    keep_fp32_grad_norm(engine)
    fp32_step_skips_nonfinite(engine)
    no_all_reduce_over_one_rank(engine)
    no_overflow_scan_in_bf16(engine)
    no_step_before_the_first(engine)
    bf16_step_on_the_device(engine)


def fp32_step_skips_nonfinite(engine) -> None:
    """Give torch's fused AdamW, which ZeRO-0 in fp32 steps through unwrapped and unchecked, the found_inf flag that
    makes it skip an update on the device (as torch's GradScaler does), from the gradient norm: the divergence
    guard reads it (training/divergence.py)."""
    if engine.zero_optimization() or engine.bfloat16_enabled() or engine.fp16_enabled():
        return
    optimizer = engine.optimizer
    assert optimizer.defaults.get("fused"), "ZeRO-0 in fp32 steps through torch's fused AdamW (training/optim.py)"
    params = [p for group in optimizer.param_groups for p in group["params"]]
    optimizer.found_inf = torch.zeros((), dtype=torch.float32, device=params[0].device)
    step = optimizer.step

    @functools.wraps(step)  # keeps the mark of torch's LR scheduler (optim.schedule=wsd) on the optimizer's step
    def step_unless_nonfinite(*args, **kwargs):
        if engine.gradient_clipping():  # clipping has just computed the norm (keep_fp32_grad_norm)
            norm = engine._global_grad_norm
        else:  # over every stage and tensor rank of the replica, kept for the log as clipping keeps it
            norm = engine._global_grad_norm = grad_norm([p for p in params if p.grad is not None], engine.mpu)
        optimizer.found_inf.copy_(~torch.isfinite(norm))
        return step(*args, **kwargs)

    optimizer.step = step_unless_nonfinite


def bf16_step_on_the_device(engine) -> None:
    """Work around DeepSpeed's bf16 optimizer (BF16_Optimizer: ZeRO-1 in bf16, the GPU default), whose step makes
    the host wait for the device: the gradient norm checked finite, the clipping test `clip_coef < 1`, and on a
    GPU the norm's non-finite entries masked twice with a -1 made on the host (docs/performance.md); a GPU then
    idles while the host launches the rest of the step. The same arithmetic on the device: the norm of the same
    fp32 gradients (the fp32 sum of their squared norms), the clipping factor clamped at 1, and a step whose norm
    is not finite skipped by torch's fused AdamW through found_inf, as fp32_step_skips_nonfinite does (its update
    and its step count). Such a step is the found_inf flag's (training/divergence.py), not DeepSpeed's
    skipped_steps, and the schedule moves on past it. A mixture of experts (a norm per expert group) and Muon keep
    DeepSpeed's step."""
    bf16 = engine.optimizer
    if (not isinstance(bf16, BF16_Optimizer) or bf16.has_moe_layers or bf16._uses_muon
            or not bf16.optimizer.defaults.get("fused")):
        return
    adam = bf16.optimizer
    bf16.found_inf = adam.found_inf = torch.zeros((), dtype=torch.float32, device=engine.device)

    @torch.no_grad()
    def step(closure=None) -> None:
        bf16.overflow = False
        norms = torch._foreach_norm(bf16.get_grads_for_norm()[0], 2)
        total = torch.stack(norms).pow(2).sum()
        if bf16.mpu is not None:
            torch.distributed.all_reduce(total, group=bf16.mpu.get_model_parallel_group())
        norm = bf16._global_grad_norm = total.pow(0.5)
        adam.found_inf.copy_(~torch.isfinite(norm))
        if bf16.clip_grad > 0:
            torch._foreach_mul_(bf16.get_grads_for_norm(for_clipping=True),
                                (bf16.clip_grad / (norm + 1e-6)).clamp(max=1.0))
        for param, grad in zip(bf16.fp32_groups_flat_partition, bf16.fp32_groups_gradient_flat_partition):
            param.grad = grad.to(param.dtype)
        adam.step()
        if bf16.grad_acc_dtype is not torch.float32:
            for param in bf16.fp32_groups_flat_partition:
                param.grad = None
        bf16._lazy_init_hp_params_optimizer_state()
        bf16.update_lp_params()
        bf16.clear_hp_grads()

    bf16.step = step


def no_overflow_scan_in_bf16(engine) -> None:
    """Work around DeepSpeed's 16-bit optimizer without ZeRO (FP16_UnfusedOptimizer) in bf16: before each step it
    scans every gradient for an inf or a NaN (an amax and an amin a tensor, and a host synchronization: 2% of the
    baby GPT's bf16 step on a CPU), then skips the step in the same way when the gradient norm is not finite,
    which any inf or NaN makes it. bf16 has no loss scale to lower, so the norm decides alone. That norm leaves
    the experts' gradients out: a mixture of experts keeps the scan."""
    if (engine.bfloat16_enabled() and isinstance(engine.optimizer, FP16_UnfusedOptimizer)
            and not engine.has_moe_layers):
        engine.optimizer.overflow_checker.check = lambda *_, **__: False


def no_step_before_the_first(engine) -> None:
    """Work around DeepSpeed's 16-bit optimizer without ZeRO (FP16_UnfusedOptimizer: ZeRO-0 in bf16 or fp16): as it
    is built it makes its Adam states by stepping once on zero gradients, which AdamW does not take for nothing: the
    masters decay once at the base rate (optim.lr x weight_decay) and the step count starts at 1, so that the first
    real step is corrected as a second (its update about 0.74 of a first's). ZeRO-1 and after take no such step.
    The masters are made again from the 16-bit weights, as the optimizer made them, and the states dropped: AdamW
    makes them at the first step, and a checkpoint's load puts its own."""
    optimizer = engine.optimizer
    if not isinstance(optimizer, FP16_UnfusedOptimizer):
        return
    with torch.no_grad():
        for masters, weights in zip(optimizer.fp32_groups, optimizer.fp16_groups):
            for master, weight in zip(masters, weights):
                master.copy_(weight)
    optimizer.optimizer.state.clear()


def no_all_reduce_over_one_rank(engine) -> None:
    """Work around DeepSpeed without ZeRO, or with its bf16 optimizer (ZeRO-1 in bf16), on one data-parallel (and
    sequence-parallel) rank: it still all-reduces the gradients over that one rank after each step, copying them
    into flat buckets of communication_data_type and back (5% of a bf16 baby GPT's step on a CPU). A mean over one
    rank is the identity, bit for bit, so the reduction is switched off as DeepSpeed's pipeline engine switches
    off its own. ZeRO's other optimizers copy the gradients into their partitions in that reduction: they keep
    it."""
    if ((engine.zero_optimization_stage() == 0 or isinstance(engine.optimizer, BF16_Optimizer))
            and engine.seq_dp_world_size == 1 and engine.gradient_predivide_factor() == 1.0):
        engine.enable_backward_allreduce = False


def keep_fp32_grad_norm(engine) -> None:
    """Work around DeepSpeed in fp32 without ZeRO: it clips the gradients (engine.clip_fp32_gradients) but
    drops the norm it computed, so get_global_grad_norm() stays None; and its clip_grad_norm_ counts the
    replicated parameters only where the grid's model-parallel rank is 0, which under a pipeline grid spans
    stages x tensor ranks, so every stage but the first would go uncounted. Clip with grad_norm, and keep it."""
    if (engine.zero_optimization() or engine.bfloat16_enabled() or engine.fp16_enabled()
            or not engine.gradient_clipping()):
        return

    def clip_and_keep_norm() -> None:
        params = [p for p in engine.module.parameters() if p.grad is not None]
        engine._global_grad_norm = norm = grad_norm(params, engine.mpu)
        # On the device, no host synchronization: the factor is 1 when the norm is within the limit.
        torch._foreach_mul_([p.grad for p in params], (engine.gradient_clipping() / (norm + 1e-6)).clamp(max=1.0))

    engine.clip_fp32_gradients = clip_and_keep_norm


def grad_norm(params: list, mpu=None) -> torch.Tensor:
    """The L2 norm of the whole model's gradient, counted as ZeRO counts it: a tensor-parallel slice on
    every tensor rank, a replicated parameter on tensor rank 0 only, a tied copy (ds_pipe_replicated) once,
    summed over the stages and tensor ranks of this data-parallel replica (the grid's model-parallel group)."""
    tensor_rank = mpu.get_tensor_model_parallel_rank() if mpu is not None else 0
    counted = [p.grad.detach() for p in params if not getattr(p, "ds_pipe_replicated", False)
               and (tensor_rank == 0 or split_rule(p) is not None)]
    device = params[0].device if params else None
    # torch's own total norm (one foreach kernel, accumulating in fp32 as ZeRO does), squared in fp64 to be summed
    # over the ranks: a tensor at a time in fp64 cost the quickstart's step 1.3 ms, 6% of it, against 0.2.
    total = torch.nn.utils.get_total_norm(counted, foreach=True).double().square() if counted else \
        torch.zeros((), dtype=torch.float64, device=device)
    if mpu is not None:
        torch.distributed.all_reduce(total, group=mpu.get_model_parallel_group())
    return total.sqrt()


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor, tp: TensorParallel = SINGLE) -> torch.Tensor:
    """Summed loss of the target tokens; padding rows (target -100, cross_entropy's ignore_index) add nothing."""
    return cross_entropy_sum(logits.view(-1, logits.size(-1)), targets.reshape(-1), tp)


def replicated_weights_in_sync(module: torch.nn.Module, tp: TensorParallel) -> bool:
    """Are the weights every tensor rank holds whole (norms, row-parallel biases, positions) bitwise equal
    across the tensor ranks? Nothing in DeepSpeed re-synchronizes them: equal initialization, batches and
    gradients keep them so, and this checks it. Under ZeRO-3 each rank compares its own partition. A mixture of
    experts' experts (DeepSpeed's is_moe_param) are each rank's own when its expert group is the tensor group."""
    in_sync = torch.ones((), dtype=torch.int32, device=next(module.parameters()).device)
    source = torch.distributed.get_global_rank(tp.group, 0)
    for p in module.parameters():
        if split_rule(p) is None and not is_moe_param(p):
            weight = getattr(p, "ds_tensor", p).detach()
            reference = weight.clone()
            torch.distributed.broadcast(reference, src=source, group=tp.group)
            in_sync &= int(torch.equal(reference, weight))
    torch.distributed.all_reduce(in_sync, op=torch.distributed.ReduceOp.MIN)
    return bool(in_sync.item())
