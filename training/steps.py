"""What the training loop asks of a DeepSpeed engine: a training step, a loss estimate, and logits for
sampling. The plain engine runs micro-batches one by one; the pipeline engine takes all of a step's
micro-batches at once and returns the loss averaged over them and over data-parallel ranks."""
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.utils import clip_grad_norm_


# Rows (tokens) of logits whose fp32 copy and softmax exist at once in the training loss: 8192 x 50304 x 4
# bytes is 1.6 GB, against 13 GB for GPT-2's micro batch 12 x 1024 taken whole (and as much again saved for
# the backward pass).
LOSS_CHUNK_ROWS = 8192


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, chunk_rows: int = LOSS_CHUNK_ROWS) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32. With gradients, a chunk of rows at a time under activation
    checkpointing: each chunk's fp32 logits and log-softmax are made in the forward pass, dropped, and made
    again in the backward pass, so they never exist for the whole batch (only the 16-bit logits do)."""
    logits, targets = logits.view(-1, logits.size(-1)), targets.reshape(-1)
    if not torch.is_grad_enabled() or logits.size(0) <= chunk_rows:
        return F.cross_entropy(logits.float(), targets)
    sums = [checkpoint(_loss_sum, rows, row_targets, use_reentrant=False)
            for rows, row_targets in zip(logits.split(chunk_rows), targets.split(chunk_rows))]
    return torch.stack(sums).sum() / targets.numel()


def _loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), targets, reduction="sum")


def mean_over_ranks(value: torch.Tensor) -> float:
    value = value.clone()
    torch.distributed.all_reduce(value)
    return value.item() / torch.distributed.get_world_size()


def keep_fp32_grad_norm(engine) -> None:
    """Work around DeepSpeed: in fp32 without ZeRO it clips the gradients (engine.clip_fp32_gradients) but
    drops the norm it computed, so get_global_grad_norm() stays None. Clip the same way and keep it."""
    if engine.zero_optimization() or engine.bfloat16_enabled() or engine.fp16_enabled() or not engine.gradient_clipping():
        return

    def clip_and_keep_norm() -> None:
        engine._global_grad_norm = clip_grad_norm_(engine.module.parameters(), engine.gradient_clipping(), mpu=engine.mpu)

    engine.clip_fp32_gradients = clip_and_keep_norm


def train_step(engine, micro_batches: list) -> torch.Tensor:
    """One optimizer step over the step's micro-batches; returns their mean loss, still on the device."""
    if isinstance(engine, PipelineEngine):
        return engine.train_batch(iter(micro_batches))
    total = 0.0
    for inputs, targets in micro_batches:
        loss = lm_loss(engine(inputs), targets)
        engine.backward(loss)  # DeepSpeed scales by 1/grad_accum itself
        engine.step()  # steps the optimizer (and clips) only at the accumulation boundary
        total += loss.detach()
    return total / len(micro_batches)


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed loss of the target tokens; padding rows (target -100, cross_entropy's ignore_index) add nothing."""
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), reduction="sum")


@torch.no_grad()
def eval_loss(engine, batches: list, tokens: int) -> float:
    """Mean loss over the `tokens` target tokens of every rank's batches (a fixed validation set: see
    data/loader.py), the same for any layout. The pipeline engine averages its loss function's outputs over
    micro-batches and data-parallel ranks, so during evaluation that function returns the micro-batch's
    summed loss scaled by micro-batches x dp / tokens: the average is then the mean over the set."""
    if isinstance(engine, PipelineEngine):
        module, scale = engine.module, len(batches) * engine.dp_world_size / tokens
        training_loss, module.loss_fn = module.loss_fn, lambda logits, targets: token_loss_sum(logits, targets) * scale
        try:
            return float(engine.eval_batch(iter(batches), num_micro_batches=len(batches)))
        finally:
            module.loss_fn = training_loss
    engine.eval()
    total = sum(token_loss_sum(engine(inputs), targets).double() for inputs, targets in batches)
    engine.train()
    torch.distributed.all_reduce(total)
    return total.item() / tokens


class PipelineLogits:
    """Next-token logits of one sequence through a pipeline, as a callable for model.generate.

    The pipeline engine caches activation shapes from its first micro-batch, so the sequence is sent
    right-padded in a batch of training shape (causal attention keeps the padding out of its logits).
    The last stage holds the logits and broadcasts the last position's row along its pipeline."""

    def __init__(self, engine: PipelineEngine, micro_batch: int, block_size: int, padded_vocab_size: int):
        self.engine, self.shape, self.vocab = engine, (micro_batch, block_size), padded_vocab_size
        self.last_stage = engine.grid.stage_to_global(engine.num_stages - 1)

    def __call__(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.size(1)
        batch = torch.zeros(self.shape, dtype=torch.long, device=idx.device)
        batch[0, :t] = idx[0]
        row = torch.empty(1, 1, self.vocab, device=idx.device)
        # A loss on dummy labels rides along: with compute_loss=False this DeepSpeed version adds the
        # logits into its scalar loss accumulator and fails.
        _, logits = self.engine.eval_batch(iter([(batch, batch)]), return_logits=True, bcast_loss=False,
                                           num_micro_batches=1)
        if self.engine.is_last_stage():
            row.copy_(logits[0:1, t - 1: t].float())
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
