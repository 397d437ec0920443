"""Train a GPT (or the 1B encoder stack) with the DeepSpeed engine.

    python train.py                                             # one process, CPU quickstart
    deepspeed --num_gpus 8 train.py --ds_config ds_configs/zero2.json --config configs/gpt2_124m.yaml
    deepspeed --num_gpus 4 train.py --ds_config ds_configs/pipe2.json    # 2 stages x 2 data parallel
    deepspeed --num_gpus 8 train.py --ds_config ds_configs/pipe2_tp2.json  # 2 stages x 2 data x 2 tensor
    python train.py train.max_steps=100 model.n_layer=2 ds.zero_optimization.stage=1

The ds_config JSON owns the engine (batch, ZeRO, precision, clipping, pipeline stages, tensor-parallel
degree); the run YAML owns everything else.
"""
import dataclasses
import functools
import json
import os
import socket
import sys

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.pipe.engine import PipelineEngine
from omegaconf import OmegaConf

from data.loader import TokenData, prefetched
from data.tokenizers import sampling_start
from model import BLOCK_CLASS, build_model, build_pipeline, compile_blocks, model_layers
from model.generate import generate
from model.tensor_parallel import SINGLE, TensorParallel, gather_vocab
from training import checkpoint, hf
from common.checks import ConfigError
from training.config import RunConfig, load_ds_config, load_run_config, parse_args, split_overrides
from training.failure import JOB, PHASE, collective_timeout, leave_process_group, print_line, run_rank
from training.launcher_env import set_distributed_env
from training.device import compute_dtype, peak_flops, peak_memory_gb
from training.metrics import MetricsLog, Throughput, flops_per_token
from training.noise import silence_known_noise
from training.optim import optimizer_and_schedule, param_groups, start_schedule
from training.steps import (PipelineLogits, eval_loss, keep_fp32_grad_norm, lm_loss, mean_over_ranks,
                            replicated_weights_in_sync, tied_weights_in_sync, train_step)
from training.topology import (Layout, Pipeline, describe_hosts, describe_stages, describe_topology, parallel_groups,
                               pipeline_settings, resolve_layout, stage_partition, tensor_parallel_size, topology)


def main(argv=None) -> None:
    silence_known_noise()
    args = parse_args(argv)
    run_overrides, ds_overrides = split_overrides(args.overrides)
    cfg = load_run_config(args.config, run_overrides)
    ds = load_ds_config(args.ds_config, ds_overrides)
    data = TokenData(cfg.data.dir, cfg.data.tokenizer, cfg.model.block_size, cfg.data.sources)
    if cfg.model.vocab_size is None:
        cfg.model.vocab_size = data.meta["vocab_size"]
    data.check_vocab(cfg.model.vocab_size)
    tokenizer = data.tokenizer()
    prompt_ids, prompt_note = encode_prompt(cfg.sample.prompt, tokenizer)  # used at the end, checked now
    n_params = count_parameters(cfg)  # builds the model on the meta device: a bad architecture stops here
    launcher = set_distributed_env()  # deepspeed, torchrun, mpiexec, srun or none: RANK, WORLD_SIZE, ...
    # The device before anything touches it (NCCL binds a process group to the current device), then the
    # precision it computes in.
    device = torch.device(get_accelerator().device_name(int(os.environ["LOCAL_RANK"])))
    get_accelerator().set_device(device.index or 0)
    dtype, precision_note = compute_dtype(ds, device)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high" if cfg.train.tf32 else "highest")  # TF32 or full fp32 matmuls
        torch.backends.cudnn.allow_tf32 = cfg.train.tf32
    pipe = pipeline_settings(ds)
    tp_size = tensor_parallel_size(ds)
    if cfg.train.compile and pipe.stages > 1:
        raise ConfigError("train.compile=true works on the plain module only: use a ds_config without pipeline "
                          "stages or set train.compile=false")
    layout = resolve_layout(ds, int(os.environ["WORLD_SIZE"]), pipe.stages, tp_size)
    try:  # this rank's shapes, no process group yet: enough to check and partition the layer list
        specs = model_layers(cfg.model, TensorParallel(tp_size))
    except ValueError as e:  # a shape the architecture cannot take (model/ knows no ConfigError)
        raise ConfigError(str(e)) from None
    parts = stage_partition(specs, pipe.stages, pipe.partition, BLOCK_CLASS[cfg.model.arch])
    ds.update(optimizer_and_schedule(cfg, ds))
    layout_record = {"world": layout.world_size, "dp": layout.dp, "pp": layout.pipeline_stages, "tp": tp_size,
                     "zero_stage": ds.get("zero_optimization", {}).get("stage", 0)}
    resume_dir = checkpoint.plan_resume(cfg.train.out_dir, cfg.train.resume, dataclasses.asdict(cfg.model),
                                        layout_record, ds)
    if resume_dir:
        data.check_resume(checkpoint.read_run_state(resume_dir).get("data"), cfg.data.allow_changed)
    init_from = None if resume_dir else cfg.train.init_from
    if init_from:
        hf.check_hf_folder(init_from, cfg.model)

    PHASE.now(f"joining the process group (world {layout.world_size})")
    deepspeed.init_distributed(timeout=collective_timeout(cfg.train.dist_timeout_s))
    JOB.watch()  # from here a rank that fails stops the whole job (training/failure.py)
    rank = torch.distributed.get_rank()
    say = functools.partial(print_line, file=sys.stdout) if rank == 0 else lambda *_: None
    hostnames = [None] * layout.world_size
    torch.distributed.all_gather_object(hostnames, socket.gethostname())
    os.makedirs(cfg.train.out_dir, exist_ok=True)
    topo = topology(layout)
    if rank == 0:
        save_effective_config(cfg, ds, layout)
        started = "one process, no launcher" if launcher == "none" else launcher
        say(f"topology ({started}): {describe_hosts(hostnames)}; {layout.describe()}")
        say(describe_stages(specs, parts, layout))
        if tp_size > 1:
            say(describe_topology(topo))
    grid, tp = parallel_groups(topo)
    dp_rank = grid.get_data_parallel_rank() if grid else rank

    PHASE.now("building the model and the DeepSpeed engine")

    model = build(cfg, pipe, ds, topo, tp, grid)
    if cfg.train.compile:
        say(f"compiling {compile_blocks(model, cfg.model.arch)} blocks (torch.compile) at the first step")
    if init_from:
        hf.load_into(model, init_from, cfg.model, tp)
        say(f"initialized from {init_from}")
    groups = param_groups(model.named_parameters(), cfg.optim.weight_decay)
    # A PipelineModule brings its own grid; passing an mpu beside it is an error in DeepSpeed.
    mpu = grid if tp_size > 1 and pipe.stages == 1 else None
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=ds, mpu=mpu)
    keep_fp32_grad_norm(engine)
    uc_info = checkpoint.universal_info(whole_model_parameters(cfg, tp_size), tp_size)
    start_schedule(engine)
    pipelined = isinstance(engine, PipelineEngine)
    if pipelined:
        assert model.parts == parts, f"PipelineModule chose stage boundaries {model.parts}, expected {parts}"

    start_step = 0
    if resume_dir:
        PHASE.now(f"loading {resume_dir}")
        start_step = checkpoint.load(engine, resume_dir)
        say(f"resumed from {resume_dir} at step {start_step}")
    else:
        say(f"starting fresh: no checkpoint to resume in {checkpoint.checkpoint_root(cfg.train.out_dir)}")
    log = MetricsLog(cfg.train.out_dir, engine.monitor, is_writer=rank == 0, append=bool(resume_dir),
                     samples_per_step=layout.global_batch)
    if rank == 0 and ds.get("wandb", {}).get("enabled"):
        import wandb  # DeepSpeed's monitor started the run (rank 0 only); it records no configuration
        wandb.config.update({"run": OmegaConf.to_container(OmegaConf.structured(cfg)), "ds_config": ds})
    peak, peak_source = peak_flops(device, dtype, cfg.train.peak_tflops, tf32=cfg.train.tf32)
    tokens_per_step = layout.global_batch * cfg.model.block_size
    meter = Throughput(tokens_per_step, flops_per_token(cfg.model) * tokens_per_step / layout.world_size, peak)
    say(f"model: {n_params:,} parameters; {layout.describe()}; {tokens_per_step:,} tokens/step; {dtype}; "
        f"MFU against {peak / 1e12:.3g} TFLOP/s per device ({peak_source})")
    for note in (precision_note, prompt_note):
        if note:
            say(note)

    @torch.compiler.set_stance("force_eager")  # padded, variable batches: never worth a recompilation
    def evaluate(step: int) -> None:
        windows = cfg.train.eval_windows
        losses = {split: eval_loss(engine, list(data.eval_batches(split, windows, dp_rank, layout, device)),
                                   windows * cfg.model.block_size, tp)
                  for split in ("train", "val")}
        log.log(step, train_loss=losses["train"], val_loss=losses["val"])
        say(f"step {step}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")

    if not resume_dir:
        PHASE.now("evaluating at step 0")
        evaluate(0)
    last_step = min(cfg.train.max_steps, cfg.train.stop_at_step or cfg.train.max_steps)
    # Only the first and last pipeline stages read data (inputs, targets); the others get none.
    feeds_data = not pipelined or engine.is_first_stage() or engine.is_last_stage()
    steps = range(start_step + 1, last_step + 1)
    batches = prefetched(lambda s: data.step_batches(cfg.train.seed, s, dp_rank, layout, device) if feeds_data else [],
                         steps)
    for step, micro_batches in zip(steps, batches):
        # Dropout masks, like the data, are a pure function of (seed, rank, step): a resumed run
        # draws what an uninterrupted one would. PipelineModule reseeds per micro-batch from its own count.
        # The tensor ranks of a replica draw alike: their replicated activations must stay equal. (Megatron
        # draws attention dropout per head slice from a second generator; here the slices' masks repeat.)
        torch.manual_seed(hash((cfg.train.seed, rank // tp_size, step)) % 2**63)
        if pipelined:
            model.micro_offset = step * layout.grad_accum
        PHASE.now(f"training step {step}")
        lr = engine.get_lr()[0]
        loss = train_step(engine, micro_batches, tp)
        meter.step()
        if step == start_step + 1:
            # The first step after start or resume pays for warm-up (allocations, kernel choices, a compiled
            # graph) after the step-0 evaluation or the checkpoint load: none of it is throughput.
            meter.pause()
        if step % cfg.train.log_interval == 0 or step == last_step:
            loss = mean_over_ranks(loss)  # this loop's only host synchronization (README: Host synchronizations)
            tokens_per_s, mfu = meter.read()  # None for an interval holding only the warm-up step
            grad_norm = engine.get_global_grad_norm()  # before clipping, which DeepSpeed does
            grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
            memory, reserved = peak_memory_gb(device)
            log.log(step, loss=loss, lr=lr, grad_norm=grad_norm, tokens_per_s=tokens_per_s, mfu=mfu,
                    peak_mem_gb=memory, reserved_gb=reserved, **data.epochs_used(step * layout.global_batch))
            speed = f"{tokens_per_s:,.0f} tok/s | MFU {100 * mfu:.1f}%" if tokens_per_s else "warm-up, not timed"
            say(f"step {step} | loss {loss:.4f} | lr {lr:.2e} | grad norm {grad_norm:.3f} | {speed} | "
                f"mem {memory:.2f} GB ({reserved:.2f} reserved)")
        if (cfg.train.eval_interval and step % cfg.train.eval_interval == 0) or step == last_step:
            PHASE.now(f"evaluating at step {step}")
            evaluate(step)
            meter.pause()  # evaluation time is not training throughput
        if (cfg.train.save_interval and step % cfg.train.save_interval == 0) or step == last_step:
            PHASE.now(f"saving the checkpoint of step {step}")
            run_state = {"tag": checkpoint.tag_for(step), "step": step, "tokens_seen": step * tokens_per_step,
                         "config": OmegaConf.to_container(OmegaConf.structured(cfg)), "layout": layout_record,
                         "data": data.record()}
            say(f"saved {checkpoint.save(engine, cfg.train.out_dir, step, run_state, cfg.train.keep_checkpoints, uc_info)}")
            meter.pause()
    if pipelined:
        in_sync = tied_weights_in_sync(engine)
        log.log(last_step, tied_weights_in_sync=in_sync)
        if not in_sync:
            say("WARNING: the tied embedding and LM head differ between the first and last stage")
    if tp_size > 1:
        in_sync = replicated_weights_in_sync(engine.module, tp)
        log.log(last_step, replicated_weights_in_sync=in_sync)
        if not in_sync:
            say("WARNING: a replicated weight (a norm, a row-parallel bias) differs between tensor-parallel ranks")
    log.close()

    PHASE.now("sampling")
    if pipelined:
        forward = PipelineLogits(engine, layout.micro_batch, cfg.model.block_size, cfg.model.padded_vocab_size, tp)
    else:
        forward = (lambda idx: gather_vocab(engine(idx), tp)) if tp_size > 1 else engine
    say(f"--- sample ---\n{sample(engine, forward, cfg, tokenizer, prompt_ids, device)}\n--------------")
    leave_process_group()


def build(cfg: RunConfig, pipe: Pipeline, ds: dict, topo=None, tp: TensorParallel = SINGLE, grid=None) -> torch.nn.Module:
    """The model's layer list as a PipelineModule (more than one stage: topo is the run's topology) or as a
    plain module (split over the tensor ranks of `tp`, whose `grid` partitions ZeRO-3 within each slice)."""
    if pipe.stages > 1:
        return build_pipeline(cfg.model, cfg.train.seed, topo, pipe.partition, functools.partial(lm_loss, tp=tp),
                              pipe.checkpoint_interval, tp)
    # Under ZeRO-3 each layer is partitioned as soon as it is built: no rank ever holds the whole model. It is
    # built on the CPU, from the CPU generator, as in every other layout, then partitioned (zero.Init(module=)):
    # inside zero.Init's context it would be made on the GPU by the GPU's generator, other weights for a seed.
    # Under tensor parallelism it is partitioned over the data-parallel replicas of each slice.
    if ds.get("zero_optimization", {}).get("stage", 0) == 3:
        group = grid.get_data_parallel_group() if tp.size > 1 else None

        def partition(layer):
            deepspeed.zero.Init(module=layer, config_dict_or_path=ds, data_parallel_group=group,
                                mpu=grid if tp.size > 1 else None)
        return build_model(cfg.model, cfg.train.seed, pipe.checkpoint_interval, place=partition, tp=tp)
    return build_model(cfg.model, cfg.train.seed, pipe.checkpoint_interval, tp=tp)


def count_parameters(cfg: RunConfig) -> int:
    """The whole model's parameters (tied ones once), whatever ZeRO-3 or the stages hold locally. The
    modules' own checks (torch's included) that the range checks missed surface as a ConfigError."""
    try:
        with torch.device("meta"):
            return sum(p.numel() for p in build_model(cfg.model).parameters())
    except (ValueError, AssertionError, RuntimeError, TypeError) as e:
        raise ConfigError(f"the model.* settings do not build a model ({type(e).__name__}: {e}); fix: change "
                          f"the model settings named there") from None


def whole_model_parameters(cfg: RunConfig, tp_size: int) -> list:
    """Every layer's parameters as one tensor rank holds them, on the meta device: a pipeline stage holds only
    its own, and DeepSpeed's universal converter reads one stage's file for the whole model's rules."""
    with torch.device("meta"):
        return list(build_model(cfg.model, tp=TensorParallel(tp_size)).named_parameters())


def encode_prompt(prompt: str, tokenizer) -> tuple[list[int], str | None]:
    try:
        return sampling_start(prompt, tokenizer)
    except ValueError as e:
        raise ConfigError(f"sample.prompt={prompt!r} does not encode with the dataset's {tokenizer.name} "
                          f"tokenizer: {e}; fix: use characters of the training text in sample.prompt") from None


@torch.no_grad()
@torch.compiler.set_stance("force_eager")  # a growing sequence: every length would be a new graph
def sample(engine, forward, cfg: RunConfig, tokenizer, prompt_ids: list[int], device) -> str:
    """Every rank runs the same seeded generation: ZeRO-3 and pipelines need all of them to take part."""
    prompt = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    generator = torch.Generator().manual_seed(cfg.sample.seed)
    engine.eval()
    out = generate(forward, prompt, cfg.sample.max_new_tokens, cfg.model.block_size, cfg.model.vocab_size,
                   cfg.sample.temperature, cfg.sample.top_k, generator)
    engine.train()
    return tokenizer.decode(out[0].tolist())


def save_effective_config(cfg: RunConfig, ds: dict, layout: Layout) -> None:
    run_yaml = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    ds_json = json.dumps(ds, indent=2)
    print(f"run config:\n{run_yaml}ds_config:\n{ds_json}\nlayout: {layout.describe()}", flush=True)
    with open(os.path.join(cfg.train.out_dir, "config.yaml"), "w") as f:
        f.write(run_yaml)
    with open(os.path.join(cfg.train.out_dir, "ds_config.json"), "w") as f:
        f.write(ds_json + "\n")


if __name__ == "__main__":
    run_rank(main)
