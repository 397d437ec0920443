"""What the training loop asks of a DeepSpeed engine: a training step, a loss estimate, and logits for
sampling. The plain engine runs micro-batches one by one; the pipeline engine takes all of a step's
micro-batches at once and returns the loss averaged over them and over data-parallel ranks."""
import functools

import torch
from deepspeed.runtime.pipe.engine import PipelineEngine
from torch.utils.checkpoint import checkpoint

from data.loader import IGNORE
from model.sequence_parallel import NO_SEQUENCE_PARALLEL, SequenceParallel
from model.tensor_parallel import SINGLE, TensorParallel, cross_entropy_sum, gather_vocab, split_rule
from training.multiple_choice import row_losses

# Rows (tokens) of logits whose fp32 copy and softmax exist at once in the training loss: 8192 x 50304 x 4
# bytes is 1.6 GB, against 13 GB for GPT-2's micro batch 12 x 1024 taken whole (and as much again saved for
# the backward pass).
LOSS_CHUNK_ROWS = 8192


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, chunk_rows: int = LOSS_CHUNK_ROWS,
            tp: TensorParallel = SINGLE, divisor: torch.Tensor | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32 (or the sum over `divisor`: supervised_share), over logits of the
    whole vocabulary or, under tensor parallelism, of this rank's slice of it. With gradients, a chunk of rows
    at a time under activation checkpointing: each chunk's fp32 logits and log-softmax are made in the forward
    pass, dropped, and made again in the backward pass, so they never exist for the whole batch (only the
    16-bit logits do)."""
    logits, targets = logits.view(-1, logits.size(-1)), targets.reshape(-1)
    divisor = targets.numel() if divisor is None else divisor
    if not torch.is_grad_enabled() or logits.size(0) <= chunk_rows:
        return cross_entropy_sum(logits, targets, tp) / divisor
    sums = [checkpoint(cross_entropy_sum, rows, row_targets, tp, use_reentrant=False)
            for rows, row_targets in zip(logits.split(chunk_rows), targets.split(chunk_rows))]
    return torch.stack(sums).sum() / divisor


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
    total = torch.stack([g.double().square().sum() for g in counted]).sum() if counted else \
        torch.zeros((), dtype=torch.float64, device=device)
    if mpu is not None:
        torch.distributed.all_reduce(total, group=mpu.get_model_parallel_group())
    return total.sqrt()


def train_step(engine, micro_batches: list, tp: TensorParallel = SINGLE, supervised: bool = False) -> torch.Tensor:
    """One optimizer step over the step's micro-batches; returns their mean loss, still on the device. With
    `supervised` (conversations), the loss is the mean over the global batch's supervised tokens."""
    if isinstance(engine, PipelineEngine):
        if supervised and engine.is_last_stage():  # where the loss is computed
            share = supervised_share(micro_batches, data_parallel_group(engine), engine.dp_world_size)
            engine.module.loss_fn = functools.partial(lm_loss, tp=tp, divisor=share)
        return engine.train_batch(iter(micro_batches))
    divisor = None
    if supervised:
        divisor = supervised_share(micro_batches, data_parallel_group(engine), engine.dp_world_size)
    total = 0.0
    for inputs, targets in micro_batches:
        loss = lm_loss(engine(inputs), targets, tp=tp, divisor=divisor)
        engine.backward(loss)  # DeepSpeed scales by 1/grad_accum itself
        engine.step()  # steps the optimizer (and clips) only at the accumulation boundary
        total += loss.detach()
    return total / len(micro_batches)


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor, tp: TensorParallel = SINGLE) -> torch.Tensor:
    """Summed loss of the target tokens; padding rows (target -100, cross_entropy's ignore_index) add nothing."""
    return cross_entropy_sum(logits.view(-1, logits.size(-1)), targets.reshape(-1), tp)


@torch.no_grad()
def eval_loss(engine, batches: list, tokens: int, tp: TensorParallel = SINGLE) -> float:
    """Mean loss over the `tokens` target tokens of every data-parallel rank's batches (a fixed validation
    set: see data/loader.py), the same for any layout. The pipeline engine averages its loss function's
    outputs over micro-batches and data-parallel ranks, so during evaluation that function returns the
    micro-batch's summed loss scaled by micro-batches x dp / tokens: the average is then the mean over the set."""
    if isinstance(engine, PipelineEngine):
        module, scale = engine.module, len(batches) * engine.dp_world_size / tokens
        training_loss = module.loss_fn
        module.loss_fn = lambda logits, targets: token_loss_sum(logits, targets, tp) * scale
        try:
            return float(engine.eval_batch(iter(batches), num_micro_batches=len(batches)))
        finally:
            module.loss_fn = training_loss
    engine.eval()
    total = sum(token_loss_sum(engine(inputs), targets, tp).double() for inputs, targets in batches)
    engine.train()
    # Over the data-parallel ranks only: the tensor ranks of a replica hold the same sum.
    torch.distributed.all_reduce(total, group=data_parallel_group(engine))
    return total.item() / tokens


@torch.no_grad()
def choice_losses(engine, batches: list, vocab_size: int, tp: TensorParallel = SINGLE,
                  sp: SequenceParallel = NO_SEQUENCE_PARALLEL) -> torch.Tensor:
    """The summed loss of each row's scored targets (multiple-choice rows: training/multiple_choice.py), for every
    row of this rank's batches, on every rank (a pipeline's last stage computes them and sends them along; the
    sequence ranks add up their slices')."""
    losses = _slice_choice_losses(engine, batches, vocab_size, tp)
    if sp.size > 1:
        torch.distributed.all_reduce(losses, group=sp.group)
    return losses


def _slice_choice_losses(engine, batches: list, vocab_size: int, tp: TensorParallel) -> torch.Tensor:
    if not isinstance(engine, PipelineEngine):
        engine.eval()
        losses = torch.cat([row_losses(engine(inputs), targets, vocab_size, tp) for inputs, targets in batches])
        engine.train()
        return losses
    module, training_loss, monitor_on = engine.module, engine.module.loss_fn, engine.monitor.enabled
    module.loss_fn = functools.partial(row_losses, vocab_size=vocab_size, tp=tp)
    # Work around DeepSpeed's eval_batch, made for one scalar loss: it adds each output into the training loss
    # accumulator (which only train_batch resets) and, with a monitor on, broadcasts and logs the result as one.
    engine.total_loss, engine.monitor.enabled = None, False
    try:
        outputs = engine.eval_batch(iter(batches), num_micro_batches=len(batches), reduce_output=None,
                                    bcast_loss=False)
    finally:
        module.loss_fn, engine.monitor.enabled, engine.total_loss = training_loss, monitor_on, None
    rows = sum(len(targets) for _, targets in batches)
    losses = torch.cat(outputs).float() if engine.is_last_stage() else torch.empty(rows, device=engine.device)
    last_stage = engine.grid.stage_to_global(engine.num_stages - 1)
    torch.distributed.broadcast(losses, src=last_stage, group=engine.grid.get_pipe_parallel_group())
    return losses


class PipelineLogits:
    """Next-token logits of one sequence through a pipeline, as a callable for model.generate.

    The pipeline engine caches activation shapes from its first micro-batch, so the sequence is sent
    right-padded in a batch of training shape (causal attention keeps the padding out of its logits).
    The last stage holds the logits and broadcasts the last position's row along its pipeline."""

    def __init__(self, engine: PipelineEngine, micro_batch: int, block_size: int, padded_vocab_size: int,
                 tp: TensorParallel = SINGLE, with_positions: bool = False,
                 sp: SequenceParallel = NO_SEQUENCE_PARALLEL):
        """with_positions: the run trains under document masking, so its stages pass (hidden, positions); under
        sequence parallelism they always do, each rank sending its slice."""
        self.engine, self.shape, self.vocab, self.tp = engine, (micro_batch, block_size), padded_vocab_size, tp
        self.with_positions, self.sp = with_positions, sp
        self.last_stage = engine.grid.stage_to_global(engine.num_stages - 1)

    def __call__(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.size(1)
        batch = torch.zeros(self.shape, dtype=torch.long, device=idx.device)
        batch[0, :t] = idx[0]
        row = torch.zeros(1, 1, self.vocab, device=idx.device)
        inputs = batch
        if self.with_positions:  # one document per row
            inputs = (batch, torch.arange(self.shape[1], device=idx.device).expand(self.shape).contiguous())
        inputs, labels = self.sp.split(inputs, batch)
        # A loss on dummy labels rides along: with compute_loss=False this DeepSpeed version adds the
        # logits into its scalar loss accumulator and fails.
        _, logits = self.engine.eval_batch(iter([(inputs, labels)]), return_logits=True, bcast_loss=False,
                                           num_micro_batches=1)
        if self.engine.is_last_stage():
            held = self.sp.part(self.shape[1])
            if held.start <= t - 1 < held.stop:  # the sequence rank holding the last position
                row.copy_(gather_vocab(logits[0:1, t - 1 - held.start: t - held.start].float(), self.tp))
            if self.sp.size > 1:
                torch.distributed.all_reduce(row, group=self.sp.group)
        torch.distributed.broadcast(row, src=self.last_stage, group=self.engine.grid.get_pipe_parallel_group())
        return row


def tied_weights_in_sync(engine: PipelineEngine) -> bool:
    """Are the stage copies of each tied weight (the embedding on the first stage, the LM head on the
    last) bitwise equal? DeepSpeed all-reduces their gradients so that they never drift; this checks it
    over the same process groups it uses."""
    module = engine.module
    in_sync = torch.ones((), dtype=torch.int32, device=engine.device)
    for comm in module.tied_comms.values():  # only on ranks that hold a copy
        for attr in comm["weight_attr"]:
            weight = module._recursive_getattr(comm["module"], attr).detach()
            reference = weight.clone()
            torch.distributed.broadcast(reference, src=min(comm["ranks"]), group=comm["group"])
            in_sync &= int(torch.equal(reference, weight))
    torch.distributed.all_reduce(in_sync, op=torch.distributed.ReduceOp.MIN)
    return bool(in_sync.item())


def replicated_weights_in_sync(module: torch.nn.Module, tp: TensorParallel) -> bool:
    """Are the weights every tensor rank holds whole (norms, row-parallel biases, positions) bitwise equal
    across the tensor ranks? Nothing in DeepSpeed re-synchronizes them: equal initialization, batches and
    gradients keep them so, and this checks it. Under ZeRO-3 each rank compares its own partition."""
    in_sync = torch.ones((), dtype=torch.int32, device=next(module.parameters()).device)
    source = torch.distributed.get_global_rank(tp.group, 0)
    for p in module.parameters():
        if split_rule(p) is None:
            weight = getattr(p, "ds_tensor", p).detach()
            reference = weight.clone()
            torch.distributed.broadcast(reference, src=source, group=tp.group)
            in_sync &= int(torch.equal(reference, weight))
    torch.distributed.all_reduce(in_sync, op=torch.distributed.ReduceOp.MIN)
    return bool(in_sync.item())
