"""The one place that tells DeepSpeed's two engines apart. A driver holds the built engine and does what the
loop, the evaluation, the scorer and the sampler ask of it: a training step, evaluation losses, choice losses
(or any other value per row), next-token logits, and the end-of-run weight checks. The plain engine runs
micro-batches one by one; the pipeline engine takes all of a step's micro-batches at once and returns the loss
averaged over them and over the data-parallel ranks. `drive(engine)` picks the driver; nothing else asks which
engine it holds. `training_engine` builds a run's engine, `initialize` any engine."""
import contextlib
import functools
import importlib
import sys

import deepspeed
import torch
from deepspeed.runtime.pipe.engine import PipelineEngine

from model.generate import CachedDecoder, WindowDecoder
from model.kv_cache import attention_modules
from model.sequence_parallel import NO_SEQUENCE_PARALLEL, SequenceParallel, gathered_logits
from model.tensor_parallel import SINGLE, TensorParallel, gather_vocab, sequence_padded
from training.config import RunConfig
from training.evaluation.multiple_choice import row_losses
from training.objectives.next_token import NEXT_TOKEN
from training.optim import client_schedule, param_groups, start_schedule
from training.steps import adjust_engine, data_parallel_group, replicated_weights_in_sync, token_loss_sum


def training_engine(model: torch.nn.Module, cfg: RunConfig, ds: dict, mpu=None) -> deepspeed.DeepSpeedEngine:
    """The engine a run trains with, for train.py and the benchmarks alike: the model's two optimizer groups, the
    run's schedule (the ds_config's, or the one DeepSpeed cannot name), the repo's changes to the built engine, and
    the schedule put at training step 1. `ds` holds training/optim.py's optimizer_and_schedule sections."""
    engine = initialize(model, param_groups(model.named_parameters(), cfg.optim.weight_decay), ds, mpu,
                        client_schedule(cfg))
    adjust_engine(engine)
    start_schedule(engine)
    return engine


def initialize(model: torch.nn.Module, model_parameters, ds: dict, mpu=None,
               lr_scheduler=None) -> deepspeed.DeepSpeedEngine:
    """deepspeed.initialize, less one import it makes for an optimizer this repo never builds: its ZeRO and bf16
    optimizers import DeepSpeed's Muon while the engine is built, whatever the optimizer, to ask whether it is
    Muon, and Muon's module torch.compiles three functions as it is imported, which imports inductor: 1.5 s of
    every such rank's start on a 2-core Xeon. Imported first here, with its functions compiled at their first
    call instead, it costs nothing (a run with train.compile=true imports inductor for its own model).
    lr_scheduler: a schedule the ds_config cannot name (training/optim.py client_schedule), or None."""
    muon = "deepspeed.runtime.zero.muon.original_muon"
    if muon not in sys.modules:
        with _compile_at_first_call():
            importlib.import_module(muon)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model_parameters, config=ds, mpu=mpu,
                                      lr_scheduler=lr_scheduler)
    return engine


@contextlib.contextmanager
def _compile_at_first_call():
    """torch.compile, for the code imported meanwhile, as a decorator that compiles at the function's first call:
    DeepSpeed decorates with its own compiler.compile(), which returns torch.compile, and offers no lazy mode
    to ask for."""
    compile_now = torch.compile

    def compile_later(fn=None, **options):
        if fn is None:  # @torch.compile(mode=...)
            return lambda f: compile_later(f, **options)

        @functools.wraps(fn)
        def first_call_compiles(*args, **kwargs):
            if first_call_compiles.compiled is None:
                first_call_compiles.compiled = compile_now(fn, **options)
            return first_call_compiles.compiled(*args, **kwargs)
        first_call_compiles.compiled = None
        return first_call_compiles

    torch.compile = compile_later
    try:
        yield
    finally:
        torch.compile = compile_now


class PlainDriver:
    """DeepSpeed's DeepSpeedEngine (ZeRO 0-3, tensor and sequence parallel): every rank reads data, one
    micro-batch at a time."""
    feeds_data = True
    carries_positions = False  # the model takes a document-masked batch's positions beside its tokens

    def __init__(self, engine, tp: TensorParallel = SINGLE, sp: SequenceParallel = NO_SEQUENCE_PARALLEL):
        self.engine, self.tp, self.sp = engine, tp, sp

    @property
    def fixed_shape(self) -> bool:
        """Must every batch have the training shape? Sequence ranks split the whole window."""
        return self.sp.size > 1

    def start_step(self, step: int, grad_accum: int) -> None:
        """Before a training step: nothing to tell a plain engine."""

    @property
    def data_parallel_group(self):
        return data_parallel_group(self.engine)

    def train_step(self, micro_batches: list, objective=NEXT_TOKEN) -> torch.Tensor:
        """One optimizer step over the step's micro-batches; returns their mean loss, still on the device: the
        objective's (training/objectives/)."""
        engine = self.engine
        loss_fn = objective.step_loss(micro_batches, self)
        total = 0.0
        for inputs, labels in micro_batches:
            loss = loss_fn(engine(inputs), labels)
            engine.backward(loss)  # DeepSpeed scales by 1/grad_accum itself
            engine.step()  # steps the optimizer (and clips) only at the accumulation boundary
            total += loss.detach()
        return total / len(micro_batches)

    def from_loss_stage(self, values: torch.Tensor) -> torch.Tensor:
        """Collective: `values` as the ranks that compute the loss hold them (every rank here)."""
        return values

    @torch.no_grad()
    def eval_loss(self, batches: list, tokens: int) -> float:
        """Mean loss over the `tokens` target tokens of every data-parallel rank's batches (a fixed validation
        set: see data/token_data.py), the same for any layout."""
        engine = self.engine
        engine.eval()
        total = sum(token_loss_sum(engine(inputs), targets, self.tp).double() for inputs, targets in batches)
        engine.train()
        # Over the data-parallel ranks only: the tensor ranks of a replica hold the same sum.
        torch.distributed.all_reduce(total, group=data_parallel_group(engine))
        return total.item() / tokens

    def choice_losses(self, batches: list, vocab_size: int) -> torch.Tensor:
        """The summed loss of each row's scored targets (multiple-choice rows: training/evaluation/multiple_choice.py),
        for every row of this rank's batches, on every rank (the sequence ranks add up their slices')."""
        return self.row_values(batches, functools.partial(row_losses, vocab_size=vocab_size, tp=self.tp))

    @torch.no_grad()
    def row_values(self, batches: list, row_fn) -> torch.Tensor:
        """row_fn(outputs, labels) -> one value a row (a sum over its positions), for every row of this rank's
        batches, on every rank: the sequence ranks add up their slices' values."""
        engine = self.engine
        engine.eval()
        values = torch.cat([row_fn(engine(inputs), labels) for inputs, labels in batches])
        engine.train()
        return self._summed_over_sequence(values)

    def _summed_over_sequence(self, losses: torch.Tensor) -> torch.Tensor:
        if self.sp.size > 1:
            torch.distributed.all_reduce(losses, group=self.sp.group)
        return losses

    def decoder(self, micro_batch: int, block_size: int, vocab: tuple[int, int], with_positions: bool,
                slots: int = 1) -> WindowDecoder:
        """A decoder of `slots` sequences for model.generate, its logits whole on every rank; `vocab`: (real,
        padded) vocabulary sizes. Through a key/value cache where the attention runs whole on each rank (tensor
        ranks cache their heads), else (either sequence parallelism) a forward pass over the window a token."""
        forward = (lambda inputs, **options: gather_vocab(self.engine(inputs, **options), self.tp)) \
            if self.tp.size > 1 else self.engine
        if self.sp.size == 1 and not self.tp.sequence and attention_modules(self.engine.module):
            return CachedDecoder(self.engine.module, block_size, vocab[0], slots, forward=forward)
        return WindowDecoder(gathered_logits(sequence_padded(forward, self.tp), self.sp), block_size, vocab[0],
                             self.engine.device, slots)

    def weights_in_sync(self) -> dict:
        """The end-of-run checks of weights that nothing re-synchronizes: {name: all ranks' copies equal}."""
        if self.tp.size > 1:
            return {"replicated_weights_in_sync": replicated_weights_in_sync(self.engine.module, self.tp)}
        return {}


class PipelineDriver(PlainDriver):
    """DeepSpeed's PipelineEngine: only the first and last stages read data (inputs, targets); the last
    computes the loss, through the loss function the PipelineModule holds."""

    def __init__(self, engine: PipelineEngine, tp: TensorParallel = SINGLE,
                 sp: SequenceParallel = NO_SEQUENCE_PARALLEL):
        super().__init__(engine, tp, sp)
        self.feeds_data = engine.is_first_stage() or engine.is_last_stage()
        self.last_stage = engine.grid.stage_to_global(engine.num_stages - 1)

    fixed_shape = True  # the pipeline keeps the activation shapes of its first micro-batch
    carries_positions = True  # under document masking a batch is (tokens, positions), passed stage to stage

    def start_step(self, step: int, grad_accum: int) -> None:
        """PipelineModule reseeds dropout per micro-batch from its own count: a resumed run counts on."""
        self.engine.module.micro_offset = step * grad_accum

    def train_step(self, micro_batches: list, objective=NEXT_TOKEN) -> torch.Tensor:
        engine = self.engine
        if engine.is_last_stage():  # where the loss is computed
            engine.module.loss_fn = objective.step_loss(micro_batches, self)
        return engine.train_batch(iter(micro_batches))

    def from_loss_stage(self, values: torch.Tensor) -> torch.Tensor:
        """The last stage's `values`, sent along its pipeline."""
        torch.distributed.broadcast(values, src=self.last_stage, group=self.engine.grid.get_pipe_parallel_group())
        return values

    @torch.no_grad()
    def eval_loss(self, batches: list, tokens: int) -> float:
        """The pipeline engine averages its loss function's outputs over micro-batches and data-parallel
        ranks, so during evaluation that function returns the micro-batch's summed loss scaled by
        micro-batches x dp / tokens: the average is then the mean over the set."""
        engine, tp = self.engine, self.tp
        module, scale = engine.module, len(batches) * engine.dp_world_size / tokens
        training_loss = module.loss_fn
        module.loss_fn = lambda logits, targets: token_loss_sum(logits, targets, tp) * scale
        try:
            return float(engine.eval_batch(iter(batches), num_micro_batches=len(batches)))
        finally:
            module.loss_fn = training_loss

    @torch.no_grad()
    def row_values(self, batches: list, row_fn) -> torch.Tensor:
        """The last stage computes the rows' values and sends them along its pipeline."""
        engine = self.engine
        module, training_loss, monitor_on = engine.module, engine.module.loss_fn, engine.monitor.enabled
        module.loss_fn = row_fn
        # Work around DeepSpeed's eval_batch, made for one scalar loss: it adds each output into the training
        # loss accumulator (which only train_batch resets) and, with a monitor on, broadcasts and logs the
        # result as one.
        engine.total_loss, engine.monitor.enabled = None, False
        try:
            outputs = engine.eval_batch(iter(batches), num_micro_batches=len(batches), reduce_output=None,
                                        bcast_loss=False)
        finally:
            module.loss_fn, engine.monitor.enabled, engine.total_loss = training_loss, monitor_on, None
        rows = sum(len(labels[0] if isinstance(labels, tuple) else labels) for _, labels in batches)
        values = torch.cat(outputs).float() if engine.is_last_stage() else torch.empty(rows, device=engine.device)
        torch.distributed.broadcast(values, src=self.last_stage, group=engine.grid.get_pipe_parallel_group())
        return self._summed_over_sequence(values)

    def decoder(self, micro_batch: int, block_size: int, vocab: tuple[int, int], with_positions: bool,
                slots: int = 1) -> WindowDecoder:
        logits = PipelineLogits(self, micro_batch, block_size, vocab[1], with_positions)
        return WindowDecoder(logits, block_size, vocab[0], self.engine.device, slots)

    def weights_in_sync(self) -> dict:
        return {"tied_weights_in_sync": self._tied_weights_in_sync(), **super().weights_in_sync()}

    def _tied_weights_in_sync(self) -> bool:
        """Are the stage copies of each tied weight (the embedding on the first stage, the LM head on the
        last) bitwise equal? DeepSpeed all-reduces their gradients so that they never drift; this checks it
        over the same process groups it uses."""
        module = self.engine.module
        in_sync = torch.ones((), dtype=torch.int32, device=self.engine.device)
        for comm in module.tied_comms.values():  # only on ranks that hold a copy
            for attr in comm["weight_attr"]:
                weight = module._recursive_getattr(comm["module"], attr).detach()
                reference = weight.clone()
                torch.distributed.broadcast(reference, src=min(comm["ranks"]), group=comm["group"])
                in_sync &= int(torch.equal(reference, weight))
        torch.distributed.all_reduce(in_sync, op=torch.distributed.ReduceOp.MIN)
        return bool(in_sync.item())


class PipelineLogits:
    """Next-token logits of one sequence through a pipeline, for a WindowDecoder.

    The pipeline engine caches activation shapes from its first micro-batch, so the sequence is sent
    right-padded in a batch of training shape (causal attention keeps the padding out of its logits).
    The last stage holds the logits and broadcasts the last position's row along its pipeline."""

    def __init__(self, driver: PipelineDriver, micro_batch: int, block_size: int, padded_vocab_size: int,
                 with_positions: bool = False):
        """with_positions: the run trains under document masking, so its stages pass (hidden, positions); under
        sequence parallelism they always do, each rank sending its slice."""
        self.engine, self.tp, self.sp, self.last_stage = driver.engine, driver.tp, driver.sp, driver.last_stage
        self.shape, self.vocab, self.with_positions = (micro_batch, block_size), padded_vocab_size, with_positions

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
        # logits into its scalar loss accumulator and fails. A token loss: the training objective's may want other
        # labels (preference pairs'), and the next training step sets its own again.
        self.engine.module.loss_fn = functools.partial(token_loss_sum, tp=self.tp)
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


def drive(engine, tp: TensorParallel = SINGLE, sp: SequenceParallel = NO_SEQUENCE_PARALLEL) -> PlainDriver:
    """The driver of a built DeepSpeed engine."""
    if isinstance(engine, PipelineEngine):
        return PipelineDriver(engine, tp, sp)
    return PlainDriver(engine, tp, sp)


def train_step(engine, micro_batches: list, objective=NEXT_TOKEN) -> torch.Tensor:
    """One training step of a driver, or of a bare DeepSpeed engine (the benchmarks hold one), which gets one."""
    driver = engine if isinstance(engine, PlainDriver) else drive(engine)
    return driver.train_step(micro_batches, objective)
