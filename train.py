"""Train a GPT (or the 1B encoder stack) with the DeepSpeed engine.

    python train.py                                             # one process, CPU quickstart
    deepspeed --num_gpus 8 train.py --ds_config ds_configs/zero2.json --config configs/gpt2_124m.yaml
    deepspeed --num_gpus 4 train.py --ds_config ds_configs/pipe2.json    # 2 stages x 2 data parallel
    deepspeed --num_gpus 8 train.py --ds_config ds_configs/pipe2_tp2.json  # 2 stages x 2 data x 2 tensor
    python train.py train.max_steps=100 model.n_layer=2 ds.zero_optimization.stage=1

The ds_config JSON owns the engine (batch, ZeRO, precision, clipping, pipeline stages, tensor-parallel
degree); the run YAML owns everything else.
"""
import common  # noqa: F401 (first: its filter of DeepSpeed's log must be in place before DeepSpeed is imported)

# isort: split
import functools
import os
import socket
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

import deepspeed
import torch
from omegaconf import OmegaConf

from data.loader import prefetched
from model import eager
from model.cpu_attention import float32_matmul_precision
from model.generate import Sampling, generate
from model.sequence_parallel import SequenceParallel
from model.tensor_parallel import TensorParallel
from training.checkpoints import checkpoint, hf, resume, universal
from training.checkpoints.background_save import BackgroundWriter
from training.checkpoints.space import saves_at
from training.config import RunConfig
from training.device import peak_flops, peak_memory_gb, seed_step
from training.divergence import Guard, Verdict
from training.engines import PlainDriver, drive, training_engine
from training.evaluation.multiple_choice import ChoiceScorer
from training.launch import out_dir_lock
from training.launch.failure import (
    PHASE,
    SAVE_ASKED,
    RefusedOnEveryRank,
    SavedAndStopped,
    join_process_group,
    leave_process_group,
    print_line,
    run_rank,
)
from training.metrics import MetricsLog, Throughput, flops_per_token
from training.noise import silence_known_noise
from training.observers import Observer, Observers
from training.parallelize import parallelize
from training.startup import (
    Run,
    check_run,
    describe_data,
    describe_model,
    describe_outputs,
    describe_zero,
    save_effective_config,
)
from training.steps import data_parallel_group
from training.topology import (
    GLOBAL,
    describe_hosts,
    describe_stages,
    describe_topology,
    parallel_groups,
    topology,
)


def main(argv=None, observers: Sequence[Observer] = ()) -> None:
    """Check the run, build the engine, train, finish. `observers` see the loop (training/observers.py)."""
    silence_known_noise()
    run = check_run(argv)  # every check that needs no other process: a bad setting stops here, on every rank
    rank = build_engine(run, Observers(observers))
    PHASE.now(f"preparing the {run.objective.name} objective")
    prepared = run.objective.prepare(run, rank)  # what it computes before step 1, if anything
    if prepared:
        rank.print0(prepared)
    rank.observers.before_training(run, rank)
    last_step = train(run, rank)
    finish(run, rank, last_step)


@dataclass
class Rank:
    """This process once its engine is built: its place in the process groups, its engine, where it reports."""
    index: int  # the global rank
    dp_rank: int
    tp: TensorParallel
    sp: SequenceParallel
    print0: Callable[[str], None]  # prints on rank 0 only
    model: torch.nn.Module
    engine: deepspeed.DeepSpeedEngine
    driver: PlainDriver  # what the loop asks of the engine, whichever DeepSpeed built (training/engines.py)
    start_step: int
    batches_skipped: int  # by rewinds (training/divergence.py): step s trains on the batch of step s + this
    log: MetricsLog
    scorer: ChoiceScorer | None  # this rank's share of eval.tasks
    universal_info: dict  # what DeepSpeed's universal converter needs to know of the model (training/checkpoints/)
    observers: Observers  # what sees the loop (benchmarks)


def build_engine(run: Run, observers: Observers) -> Rank:
    """The process group, the topology over it, the model, DeepSpeed's engine, and the checkpoint loaded."""
    cfg, layout = run.cfg, run.layout
    index, print0, topo = join_job(run)
    groups = parallel_groups(topo, layout.sp_size, layout.tp_sequence)
    grid, tp = groups.grid, groups.tp

    PHASE.now("building the model and the DeepSpeed engine")
    ds = run.ds
    model, compiled = parallelize(cfg, run.pipe, ds, topo, tp, grid, groups.sp)
    if compiled:
        print0(f"compiling {compiled} blocks (torch.compile) at the first step")
    if run.init_from:
        fresh = hf.load_into(model, run.init_from, cfg.model, tp)
        print0(f"initialized from {run.init_from}" + (f"; {', '.join(fresh)} not there: its initialization, "
                                                      f"N(0, 0.02)" if fresh else ""))
    # A PipelineModule brings its own grid; passing an mpu beside it is an error in DeepSpeed.
    mpu = grid if layout.tp_size > 1 and layout.pipeline_stages == 1 else None
    engine = training_engine(model, cfg, ds, mpu)
    if cfg.train.background_save:
        # DeepSpeed's plug point for its writers
        engine.checkpoint_engine = BackgroundWriter(engine._config)
    universal_info = universal.universal_info(cfg.model, layout.tp_size)
    driver = drive(engine, tp, groups.sp)
    assert getattr(model, "parts", run.parts) == run.parts, \
        f"PipelineModule chose stage boundaries {model.parts}, expected {run.parts}"

    start_step, batches_skipped = start_point(run, engine, index, print0)
    # Against the engine's own count of samples, the x of its monitor events (sequence ranks counted in).
    log = MetricsLog(cfg.train.out_dir, engine.monitor, is_writer=index == 0, append=bool(run.resume_dir),
                     samples_per_step=ds[GLOBAL])
    if index == 0 and run.ds.get("wandb", {}).get("enabled"):
        import wandb  # DeepSpeed's monitor started the run (rank 0 only); it records no configuration
        wandb.config.update({"run": OmegaConf.to_container(OmegaConf.structured(cfg)), "ds_config": run.ds})
    scorer = ChoiceScorer(run.tasks, cfg.model.block_size, groups.dp_rank, layout.dp, layout.micro_batch,
                          driver.fixed_shape, layout.sp_size) if run.tasks else None
    if scorer:
        print0(f"multiple-choice tasks scored at each evaluation: {scorer.describe()}")
    return Rank(index, groups.dp_rank, tp, groups.sp, print0, model, engine, driver, start_step, batches_skipped, log,
                scorer, universal_info, observers)


def start_point(run: Run, engine, index: int, print0: Callable[[str], None]) -> tuple[int, int]:
    """The checkpoint loaded, if the run resumes one: the step it starts after and the batches rewinds skipped."""
    out_dir = run.cfg.train.out_dir
    if not run.resume_dir:
        print0(f"starting fresh: no checkpoint to resume in {checkpoint.checkpoint_root(out_dir)}")
        return 0, 0
    PHASE.now(f"loading {run.resume_dir}")
    state = checkpoint.load(engine, run.resume_dir)
    start_step = state["step"]
    moved = None
    if index == 0:  # what steps after start_step left behind: this run writes them anew
        if run.discard:
            resume.discard(out_dir, run.discard)
            print0(f"deleted the newer checkpoints {', '.join(run.discard)} (train.discard_newer=true)")
        moved = resume.set_aside_metrics(out_dir, start_step)
    torch.distributed.barrier()  # before any rank saves
    print0(f"resumed from {run.resume_dir} at step {start_step}" + (f"; {moved}" if moved else ""))
    return start_step, state.get("batches_skipped", 0)


def join_job(run: Run) -> tuple[int, Callable[[str], None], object]:
    """This rank in the job's process group: its global rank, its `print0`, and DeepSpeed's topology of the job,
    which rank 0 reports with the effective configuration."""
    layout = run.layout
    PHASE.now(f"joining the process group (world {layout.world_size})")
    join_process_group(run.cfg.train.dist_timeout_s)
    index = torch.distributed.get_rank()
    print0 = functools.partial(print_line, file=sys.stdout) if index == 0 else lambda *_: None
    out_dir = run.cfg.train.out_dir
    os.makedirs(out_dir, exist_ok=True)
    holder = out_dir_lock.take(out_dir) if index == 0 else None  # another run's, if any: rank 0's word for all
    seen = [None] * layout.world_size  # (host, holder) of every rank
    torch.distributed.all_gather_object(seen, (socket.gethostname(), holder))
    if seen[0][1]:
        raise RefusedOnEveryRank(out_dir_lock.refusal(out_dir, seen[0][1]))
    hostnames = [host for host, _ in seen]
    topo = topology(layout)
    if index == 0:
        save_effective_config(run.cfg, run.ds, layout)
        started = "one process, no launcher" if run.launcher == "none" else run.launcher
        print0(f"topology ({started}): {describe_hosts(hostnames)}; {layout.describe()}; {describe_zero(run.ds)}")
        print0(describe_stages(run.specs, run.parts, layout))
        if layout.tp_size > 1 or layout.sp_size > 1:
            print0(describe_topology(topo, layout.sp_size))
        print0(describe_data(run.data))
        print0(describe_outputs(run.cfg.train.out_dir))
    return index, print0, topo


def train(run: Run, rank: Rank) -> int:
    """The training loop, from the step after the start (or the checkpoint) to the last; returns the last."""
    cfg = run.cfg
    meter = throughput_meter(run, rank)
    if not run.resume_dir:
        PHASE.now("evaluating at step 0")
        evaluate(run, rank, 0)
    last_step = cfg.train.last_step
    if rank.start_step >= last_step:  # resumed at its end: what a user asks of a finished run is its scores
        rank.print0(f"the run is at step {rank.start_step}, train.max_steps={cfg.train.max_steps}: nothing to train; "
                 + ("scoring eval.tasks, then sampling" if rank.scorer else "sampling"))
        if rank.scorer:
            PHASE.now(f"evaluating at step {rank.start_step}")
            evaluate(run, rank, rank.start_step, log_losses=False)  # the losses of this step are logged already
    guard = Guard(cfg.train, rank.engine, rank.print0, rank.log.log, SAVE_ASKED.is_set)
    step = rank.start_step
    while step < last_step:  # again from a checkpoint after each rewind
        step = train_steps(run, rank, meter, guard, step, last_step)
    return last_step


def train_steps(run: Run, rank: Rank, meter: Throughput, guard: Guard, start: int, last_step: int) -> int:
    """Steps start + 1 to last_step; returns the last, or the step a rewind went back to."""
    cfg, layout, engine = run.cfg, run.layout, rank.engine
    feeds_data = rank.driver.feeds_data
    steps = range(start + 1, last_step + 1)
    batches = prefetched(lambda s: [rank.sp.split(*batch) for batch in run.data.step_batches(
        cfg.train.seed, s + rank.batches_skipped, rank.dp_rank, layout, run.device)] if feeds_data else [], steps)
    for step, micro_batches in zip(steps, batches):
        # Dropout masks, like the data, are a pure function of (seed, rank, step): a resumed run
        # draws what an uninterrupted one would. PipelineModule reseeds per micro-batch from its own count.
        # The tensor ranks of a replica draw alike: their replicated activations must stay equal. (Megatron
        # draws attention dropout per head slice from a second generator; here the slices' masks repeat.)
        seed_step(hash((cfg.train.seed, rank.index // layout.tp_size, step)) % 2**63, run.device)
        rank.driver.start_step(step, layout.grad_accum)
        PHASE.now(f"training step {step}")
        lr = engine.get_lr()[0]
        micro_batches = run.objective.step_batches(step, micro_batches, rank.driver)
        rank.observers.before_step(step, rank.driver, micro_batches)
        loss = rank.driver.train_step(micro_batches, run.objective)
        rank.observers.after_step(step, rank.driver, loss)
        run.hooks.after_step(rank.model, rank.driver)
        guard.observe(step, loss)
        meter.step()
        completed = checkpoint.settle(engine, wait=False)  # a save written in the background since
        if completed:
            rank.print0(f"saved {completed}")
        if step == start + 1:
            # The first step after start, resume or rewind pays for warm-up (allocations, kernel choices, a
            # compiled graph) after the step-0 evaluation or the checkpoint load: none of it is throughput.
            meter.pause()
        logs = step % cfg.train.log_interval == 0 or step == last_step
        saves = saves_at(step, last_step, cfg.train.save_interval)
        # The watch is read where the loss is (its progress line), and before a save: no non-finite model saved.
        verdict = log_progress(run, rank, step, loss, lr, meter, guard) if logs else \
            guard.watch.read()[0] if saves else None
        if verdict:
            rewound = guard.act(verdict, step, rank.batches_skipped)
            if rewound:
                step, rank.batches_skipped = rewound
                return step
        if (cfg.train.eval_interval and step % cfg.train.eval_interval == 0) or step == last_step:
            PHASE.now(f"evaluating at step {step}")
            evaluate(run, rank, step)
            meter.pause()  # evaluation time is not training throughput
        stop = verdict is not None and verdict.stop_asked
        if saves or stop:
            PHASE.now(f"saving the checkpoint of step {step}")
            save(run, rank, step, wait=step == last_step or stop)
            meter.pause()
        if stop:
            rank.print0(f"stopped at step {step}, as SIGUSR1 asked: the same command resumes it")
            raise SavedAndStopped()
    return last_step


def throughput_meter(run: Run, rank: Rank) -> Throughput:
    """Tokens/s and MFU against the device's peak, once the run has said what it trains."""
    cfg, layout, dtype = run.cfg, run.layout, run.dtype
    peak, peak_source = peak_flops(run.device, dtype, cfg.train.peak_tflops, tf32=cfg.train.tf32)
    tokens_per_step = run.tokens_per_step
    rank.print0(f"model: {run.n_params:,} parameters ({describe_model(cfg.model)}); {tokens_per_step:,} tokens/step; "
             f"{dtype}; MFU against {peak / 1e12:.3g} TFLOP/s per device ({peak_source})")
    for note in run.notes:
        rank.print0(note)
    return Throughput(tokens_per_step, flops_per_token(cfg.model) * tokens_per_step / layout.world_size, peak)


def log_progress(run: Run, rank: Rank, step: int, loss: torch.Tensor, lr: float, meter: Throughput,
                 guard: Guard) -> Verdict:
    """A progress line and its metrics record: the loss over all ranks, speed, gradient norm, memory; returns
    the divergence watch's verdict, read with the loss."""
    rank.observers.before_log(run, step)
    verdict, loss = guard.watch.read(loss)  # the loop's only host synchronization (docs/performance.md)
    tokens_per_s, mfu = meter.read()  # None for an interval holding only the warm-up step
    grad_norm = rank.engine.get_global_grad_norm()  # before clipping, which DeepSpeed does
    grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
    memory, reserved = peak_memory_gb(run.device)
    figures, said = run.objective.progress(rank.driver)  # the objective's own, means since the last line
    model_figures, model_said = run.hooks.progress(rank.model)  # the model's own figures (its hooks)
    rank.log.log(step, loss=loss, lr=lr, grad_norm=grad_norm, tokens_per_s=tokens_per_s, mfu=mfu,
                 tokens_seen=step * run.tokens_per_step, peak_mem_gb=memory, reserved_gb=reserved, **figures,
                 **model_figures,
                 **run.data.epochs_used((step + rank.batches_skipped) * run.layout.global_batch))
    speed = f"{tokens_per_s:,.0f} tok/s | MFU {100 * mfu:.1f}%" if tokens_per_s else "warm-up, not timed"
    rank.print0(f"step {step} | loss {loss:.4f}{said}{model_said} | lr {lr:.2e} | grad norm {grad_norm:.3f} | "
                f"{speed} | mem {memory:.2f} GB ({reserved:.2f} reserved)")
    rank.observers.after_log(run, step)
    return verdict


@eager  # padded, variable batches: never worth a recompilation
def evaluate(run: Run, rank: Rank, step: int, log_losses: bool = True) -> None:
    """The mean loss of each split's fixed validation windows and the eval.tasks accuracies, logged (the losses
    unless log_losses is false) and printed."""
    with run.hooks.evaluating(rank.model):
        splits = {split: run.objective.evaluate(run, rank, split, run.cfg.train.eval_windows)
                  for split in ("train", "val")}
    losses = {split: values["loss"] for split, values in splits.items()}
    figures = {f"{split}_{name}": value for split, values in splits.items() for name, value in values.items()
               if name != "loss"}
    model_figures, model_said = run.hooks.evaluation(rank.model)
    scores = {}
    if rank.scorer:
        batches = [rank.sp.split(*batch) for batch in rank.scorer.batches(
            run.device, with_positions=rank.driver.carries_positions and run.data.positions)]
        row_losses = rank.driver.choice_losses(batches, run.cfg.model.vocab_size)
        scores = rank.scorer.scores(row_losses, data_parallel_group(rank.engine))
    record = {f"{task}_{metric}": value for task, accuracies in scores.items()
              for metric, value in zip(("acc", "acc_norm"), accuracies)}
    if log_losses:
        record = {"train_loss": losses["train"], "val_loss": losses["val"], **figures, **model_figures, **record}
    rank.log.log(step, **record)
    tasks = "".join(f"; {task} acc {acc:.4f}, acc_norm {norm:.4f}" for task, (acc, norm) in scores.items())
    rank.print0(f"step {step}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}{model_said}"
                f"{run.objective.evaluation_text(figures)}{tasks}")


def save(run: Run, rank: Rank, step: int, wait: bool) -> None:
    """Collective: the checkpoint of `step`, with what resuming it needs to know before any engine exists;
    complete on return unless written in the background and not `wait`."""
    cfg = run.cfg
    run_state = {"tag": checkpoint.tag_for(step), "step": step,
                 "tokens_seen": step * run.tokens_per_step,
                 "config": OmegaConf.to_container(OmegaConf.structured(cfg)),
                 "layout": run.layout_record(), "data": run.data.record(),
                 "batches_skipped": rank.batches_skipped, **run.objective.record()}
    tag = checkpoint.save(rank.engine, cfg.train.out_dir, step, run_state, cfg.train.keep_checkpoints,
                          rank.universal_info)
    if checkpoint.settle(rank.engine, wait=wait) or not cfg.train.background_save:
        rank.print0(f"saved {tag}")
    else:
        rank.print0(f"saving {tag}: its files are written in the background")


OUT_OF_SYNC = {"tied_weights_in_sync": "the tied embedding and LM head differ between the first and last stage",
               "replicated_weights_in_sync": "a replicated weight (a norm, a row-parallel bias) differs between "
                                             "tensor-parallel ranks"}


def finish(run: Run, rank: Rank, last_step: int) -> None:
    """The end of a run: the copies of each shared weight checked alike, a sample printed, the group left."""
    cfg, engine = run.cfg, rank.engine
    for check, in_sync in rank.driver.weights_in_sync().items():
        rank.log.log(last_step, **{check: in_sync})
        if not in_sync:
            rank.print0(f"WARNING: {OUT_OF_SYNC[check]}")
    rank.log.close()

    if not cfg.model.generates:  # a score head (a reward model) has no next token to sample
        leave_process_group()
        return
    PHASE.now("sampling")
    vocab = (cfg.model.vocab_size, cfg.model.padded_vocab_size)
    decoder = rank.driver.decoder(run.layout.micro_batch, cfg.model.block_size, vocab, run.data.positions)
    rank.print0(f"--- sample ---\n{sample(engine, decoder, cfg, run.tokenizer, run.prompt_ids, run.stop_ids)}\n"
                f"--------------")
    leave_process_group()


@torch.no_grad()
@eager  # a growing sequence: every length would be a new graph
def sample(engine, decoder, cfg: RunConfig, tokenizer, prompt_ids: list[int], stop_ids: tuple = ()) -> str:
    """Every rank runs the same seeded generation: ZeRO-3 and pipelines need all of them to take part. The
    window is one document, as in every layout (a pipeline's stages and sequence ranks see no delimiters)."""
    generator = torch.Generator().manual_seed(cfg.sample.seed)
    engine.eval()
    settings = cfg.sample
    # A token's matmuls are a few rows each: oneDNN's bf16 mode (training/device.py) would convert every weight
    # for each of them, which took the quickstart's sample twice as long as full fp32.
    with float32_matmul_precision("highest"):
        out = generate(decoder, prompt_ids, Sampling(settings.max_new_tokens, settings.temperature, settings.top_k,
                                                     settings.top_p, stop_ids), generator)
    engine.train()
    return tokenizer.decode(prompt_ids + out)


if __name__ == "__main__":
    run_rank(main)
