"""A run's start, before any process group: everything that can be checked first (`check_run`), the
ds_config DeepSpeed is given, assembled in one place (`effective_ds_config`), and the few lines that say what
the run is (`describe_*`), printed before step 0.

train.py runs all of it on every rank, so a bad setting stops the job before any process waits on another.
preflight.py runs the part that needs no dataset or checkpoint: `load_configs` and `configure`.
"""
import copy
import dataclasses
import json
import os
from dataclasses import dataclass

import torch
from deepspeed.accelerator import get_accelerator
from omegaconf import OmegaConf

from common.checks import ConfigError
from data.chat import chat_prompt
from data.loader import open_data
from data.meta import answer_ends
from data.tasks import Task
from data.token_data import KIND_WORDS, TokenData
from data.tokenizers import sampling_start
from model import architecture, build_model, model_layers
from model.architecture import TrainingHooks
from model.documents import KERNEL_NAMES, document_kernel
from model.parallelize import check_sequence_split
from model.sequence_parallel import check_sequence_parallel
from model.tensor_parallel import TensorParallel
from model.tiling import check_tiles
from training.checkpoints import checkpoint, hf, resume
from training.checkpoints.hf_folder import check_dataset_tokenizer
from training.checkpoints.space import check_disk, check_host_copy
from training.config import RunConfig, load_run_config, parse_args, split_overrides
from training.device import (
    check_op_build_locks,
    compute_dtype,
    keep_freed_host_memory,
    memory_capacity,
    onednn_matmuls,
    set_kernels,
)
from training.ds_config import load_ds_config
from training.evaluation.multiple_choice import open_tasks
from training.launch.launcher_env import ranks_on_this_node, set_distributed_env, threads_per_rank
from training.memory_plan import GB, layer_params, plan
from training.moe import check_experts, expert_parallel_size
from training.objectives import Objective, choose_objective
from training.optim import optimizer_and_schedule, schedule_note
from training.topology import (
    SP_KEY,
    Layout,
    Pipeline,
    deepspeed_batch,
    layout_record,
    pipeline_settings,
    resolve_layout,
    sequence_parallel_size,
    stage_partition,
    tensor_parallel_size,
    zero_stage,
)


@dataclass
class EngineSettings:
    """The ds_config DeepSpeed is given (the only one: ds_config.json saves it), and what follows from it for this
    process."""
    ds: dict
    layout: Layout
    pipe: Pipeline
    dtype: torch.dtype
    precision_note: str | None
    onednn_matmuls: bool  # fp32 matmuls through oneDNN (training/device.py)

    def layout_record(self) -> dict:
        return layout_record(self.layout, zero_stage(self.ds))


def effective_ds_config(ds: dict, cfg: RunConfig, world_size: int, device: torch.device,
                        load_universal: bool = False) -> EngineSettings:
    """The ds_config DeepSpeed is given, assembled here only, from the loaded one (left as it is): the batch
    triple completed for this world size and counted over DeepSpeed's data axis, which holds the sequence ranks
    (training/topology.py deepspeed_batch; the sequence-parallel degree, which DeepSpeed would divide by again,
    is read here and left out), bf16 "auto" resolved for the device, the run's optimizer and schedule, and
    universal loading for a run that resumes a universal checkpoint. Raises ConfigError for what the device,
    the world size or the run config cannot take."""
    dtype, precision_note = compute_dtype(ds, device, cfg.model.n_embd)
    pipe = pipeline_settings(ds)
    tp_size, sp_size = tensor_parallel_size(ds), sequence_parallel_size(ds)
    check_recompute(pipe, cfg, ds)
    layout = resolve_layout(ds, world_size, pipe.stages, tp_size, sp_size, expert_parallel_size(ds))
    check_experts(cfg.model, layout, zero_stage(ds), dtype == torch.float16,
                  cfg.train.compile, cfg.train.mlp_tiles)
    effective = copy.deepcopy(ds)
    effective.pop(SP_KEY, None)
    if ds.get("bf16", {}).get("enabled") == "auto":
        effective["bf16"]["enabled"] = dtype == torch.bfloat16
    effective.update(deepspeed_batch(layout))
    effective.update(optimizer_and_schedule(cfg, ds))
    if layout.tp_sequence:  # DeepSpeed's split of stage-boundary activations over the tensor ranks takes them for
        # copies; under sequence parallelism each rank's is its own slice, already a share
        effective["pipeline"] = {**effective.get("pipeline", {}), "pipe_partitioned": False, "grad_partitioned": False}
    if load_universal:
        effective.setdefault("checkpoint", {})["load_universal"] = True
    if pipe.recompute == "selective" and zero_stage(ds) == 3:
        effective["zero_optimization"]["memory_efficient_linear"] = False  # check_recompute says why
    return EngineSettings(effective, layout, pipe, dtype, precision_note,
                          onednn_matmuls(ds, device, cfg.model.n_embd))


def check_recompute(pipe: Pipeline, cfg: RunConfig, ds: dict) -> None:
    """Selective recomputation keeps the matmuls' outputs (model/recompute.py): which MLP tiles exist to drop, and
    to which ZeRO-3's memory-efficient linear (DeepSpeed's F.linear under ZeRO-3 by default) adds the bias in place
    through a view torch's checkpoint does not see, so that the kept output would carry the bias twice; under
    selective recomputation the effective ds_config turns it off. train.py's start and the dry run check it alike."""
    if pipe.recompute != "selective":
        return
    if zero_stage(ds) == 3 and ds["zero_optimization"].get("memory_efficient_linear") is True:
        raise ConfigError("pipeline.recompute=selective cannot keep the outputs of ZeRO-3's memory-efficient linear, "
                          "which adds the bias to them in place: leave zero_optimization.memory_efficient_linear "
                          "out (selective recomputation turns it off), or set ds.pipeline.recompute=full")
    if cfg.train.mlp_tiles > 1:
        raise ConfigError(f"pipeline.recompute=selective would keep the MLP's matmul outputs that "
                          f"train.mlp_tiles={cfg.train.mlp_tiles} exists to drop: set train.mlp_tiles=1, or "
                          f"ds.pipeline.recompute=full")


def with_vocabulary(cfg: RunConfig, data: TokenData) -> RunConfig:
    """The run config with model.vocab_size, when unset, the data's."""
    if cfg.model.vocab_size is not None:
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=data.meta["vocab_size"]))


def with_schedule_length(cfg: RunConfig, ds: dict, world_size: int, data: TokenData) -> RunConfig:
    """The run config with train.max_steps, under train.epochs, the steps those epochs of the data take at this
    world size's global batch."""
    if cfg.train.epochs is None:
        return cfg
    layout = resolve_layout(ds, world_size, pipeline_settings(ds).stages, tensor_parallel_size(ds),
                            sequence_parallel_size(ds))
    max_steps = data.steps_for_epochs(cfg.train.epochs, layout.global_batch)
    if cfg.train.stop_at_step is not None and cfg.train.stop_at_step > max_steps:
        raise ConfigError(f"train.stop_at_step={cfg.train.stop_at_step} is beyond the {max_steps} "
                          f"steps of train.epochs={cfg.train.epochs}: lower it")
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_steps=max_steps))


def load_configs(argv=None) -> tuple[RunConfig, dict]:
    """The run config and the ds_config of a command line (files, then key=value overrides), each checked."""
    args = parse_args(argv)
    run_overrides, ds_overrides = split_overrides(args.overrides)
    return load_run_config(args.config, run_overrides), load_ds_config(args.ds_config, ds_overrides)


@dataclass
class Setup:
    """This process placed in the job: the launcher that started it, its device, its engine's settings."""
    launcher: str  # deepspeed, torchrun, openmpi, mpich, slurm or none (training/launch/launcher_env.py)
    device: torch.device
    engine_settings: EngineSettings
    threads_note: str | None  # how many threads each rank took, where this process set them
    attention_note: str | None  # on a GPU, the attention kernel torch picks (training/device.py set_kernels)


def configure(cfg: RunConfig, ds: dict, load_universal: bool = False,
              data: TokenData | None = None) -> tuple[RunConfig, Setup]:
    """The launcher's environment read (RANK, WORLD_SIZE, ...), this rank's device made current, the run config
    resolved for the job (its schedule's length, under train.epochs of `data`), the ds_config assembled, and the
    kernels torch picks set (its matmul precision, on a GPU its attention kernel)."""
    launcher = set_distributed_env()
    cores = torch.get_num_threads()
    threads, threads_note = threads_per_rank(cores), None
    if threads:
        torch.set_num_threads(threads)
        threads_note = (f"torch threads: {torch.get_num_threads()} per rank ({cores} for one process, shared by the "
                        f"{ranks_on_this_node()} ranks on this node; OMP_NUM_THREADS sets them)")
    # Current before anything touches the device: NCCL binds a process group to the current device.
    device = torch.device(get_accelerator().device_name(int(os.environ["LOCAL_RANK"])))
    get_accelerator().set_device(device.index or 0)
    keep_freed_host_memory(device)
    world_size = int(os.environ["WORLD_SIZE"])
    if data is not None:
        cfg = with_schedule_length(cfg, ds, world_size, data)
    settings = effective_ds_config(ds, cfg, world_size, device, load_universal)
    attention = set_kernels(device, cfg.train, settings.onednn_matmuls, settings.dtype, cfg.model)
    attention_note = attention and (f"attention: torch's {attention} kernel "
                                    f"(train.sdpa_backend={cfg.train.sdpa_backend})")
    return cfg, Setup(launcher, device, settings, threads_note, attention_note)


@dataclass
class Run:
    """Everything check_run settled, for the phases of train.py to share, one level deep: what was asked (`cfg`,
    resolved: the vocabulary, the schedule's length), what this job resolved it to, and the ds_config DeepSpeed
    is given."""
    cfg: RunConfig
    ds: dict  # as DeepSpeed is given it, and ds_config.json saves it
    layout: Layout
    pipe: Pipeline
    dtype: torch.dtype
    launcher: str  # deepspeed, torchrun, openmpi, mpich, slurm or none (training/launch/launcher_env.py)
    device: torch.device
    data: TokenData
    tokenizer: object
    prompt_ids: list[int]
    stop_ids: tuple  # where the end-of-run sample stops (sample.chat's end of turn), none for a text prompt
    tasks: list[Task]  # eval.tasks, read and tokenized
    notes: list[str]  # printed once the engine is built
    n_params: int
    specs: list  # this rank's layer list (its tensor slice), on no device yet
    parts: list[int]  # the layer index where each pipeline stage starts, then the end
    resume_dir: str | None
    init_from: str | None
    discard: list[str]  # newer checkpoints than resume_dir's, deleted at start (train.discard_newer)
    objective: Objective  # what the loop trains for (training/objectives/)
    hooks: TrainingHooks  # what the model adds to the loop (its architecture's, model/architecture.py)

    def layout_record(self) -> dict:
        return layout_record(self.layout, zero_stage(self.ds))

    @property
    def tokens_per_step(self) -> int:
        """The tokens a step trains on: the data-parallel replicas' samples of the context (metrics, checkpoints)."""
        return self.layout.global_batch * self.cfg.model.block_size


def check_run(argv=None) -> Run:
    """Everything checkable before any process group: configs, data, prompt, tasks, model, layout, resume,
    init_from."""
    cfg, ds = load_configs(argv)
    check_op_build_locks()
    data = open_data(cfg.data.dir, cfg.data.tokenizer, cfg.model.block_size, cfg.data.sources,
                     cfg.model.document_masking, cfg.data.pack)
    cfg = with_vocabulary(cfg, data)  # the run record: resolved here and in configure, never changed after
    data.check_vocab(cfg.model.vocab_size)
    tokenizer = data.tokenizer()
    prompt_ids, stop_ids, prompt_note = encode_prompt(cfg.sample, data.meta, tokenizer)  # used at the end
    tasks = open_tasks(cfg.eval.tasks, cfg.eval.data_dir, cfg.eval.limit, tokenizer, cfg.model.block_size)
    check_tiles(cfg.model, cfg.train.mlp_tiles)
    n_params = count_parameters(cfg)
    resume_dir = resume.find_resume(cfg.train.out_dir, cfg.train.resume)
    saved = checkpoint.read_run_state(resume_dir) if resume_dir else None
    cfg, setup = configure(cfg, ds, load_universal=bool(saved and saved.get("universal")), data=data)
    settings = setup.engine_settings
    specs = model_layers(cfg.model, TensorParallel(settings.layout.tp_size))  # this rank's shapes, no group needed
    check_sequence_parallel(cfg.model, settings.layout.tp_size, settings.layout.sp_size)
    if settings.layout.tp_sequence:
        check_sequence_split(cfg.model, settings.layout.tp_size, settings.layout.sp_size)
    parts = stage_partition(specs, settings.pipe.stages, settings.pipe.partition, architecture(cfg.model).block)
    newer = []
    if saved:
        resume.check_compatible(saved, dataclasses.asdict(cfg.model), settings.layout_record(), resume_dir,
                                cfg.train.out_dir)
        data.check_resume(saved["data"], cfg.data.allow_changed)
        newer = resume.check_resume_point(cfg.train, resume_dir, saved["step"])
    planned = check_memory(cfg, settings.ds, settings.layout, setup.device)
    start = saved["step"] if saved else 0
    check_checkpoint_room(cfg, settings.ds, settings.layout, setup.device.type, planned, n_params, start, resume_dir)
    init_from = None if resume_dir else cfg.train.init_from
    if init_from:
        hf.check_hf_folder(init_from, cfg.model)
        check_dataset_tokenizer(init_from, data.meta)
    objective = choose_objective(cfg, data, settings.layout, init_from, saved)
    notes = [note for note in (settings.precision_note, setup.threads_note, setup.attention_note, prompt_note,
                               masking_note(cfg, data, setup.device),
                               schedule_note(cfg), objective.describe()) if note]
    return Run(cfg, settings.ds, settings.layout, settings.pipe, settings.dtype,
               setup.launcher, setup.device, data, tokenizer, prompt_ids, stop_ids, tasks, notes, n_params, specs,
               parts, resume_dir, init_from, newer, objective, architecture(cfg.model).training_hooks(cfg.model))


def check_memory(cfg: RunConfig, ds: dict, layout, device: torch.device) -> dict:
    """A layout whose memory plan (training/memory_plan.py) is over what a rank has cannot run: refused here, where
    it would be stopped by an out-of-memory error or the kernel's OOM killer minutes in. The plan counts what the
    model keeps, not the allocator's or the libraries' own, so a run it passes may still not fit (preflight.py and
    the planner hold it to 90% of a GPU); one it refuses cannot. Returns the plan."""
    planned = plan(cfg.model, ds, layout.world_size, cfg.train.mlp_tiles, device.type, cfg.train.compile)
    needed = in_host_memory(planned, "cpu", layout) if device.type == "cpu" else planned["total"]
    capacity, what = memory_capacity(device, ranks_on_this_node())
    if needed > capacity:
        raise ConfigError(f"the memory plan needs {needed / GB:.3g} GB a rank (training/memory_plan.py: model states "
                          f"{planned['states'] / GB:.3g}, activations {planned['activations'] / GB:.3g}), over "
                          f"{what}, {capacity / GB:.3g} GB: the run cannot fit; fix: a smaller "
                          f"ds.train_micro_batch_size_per_gpu (gradient_accumulation_steps keeps the batch), a "
                          f"shorter model.block_size, ZeRO-3 or more ranks (python -m scripts.memory_plan --config "
                          f"PRESET --plan --gpus N)")
    return planned


def in_host_memory(planned: dict, device_type: str, layout) -> float:
    """What the memory plan puts in a rank's host memory: a CPU rank's all; a GPU rank's share of the offloaded
    states, which DeepSpeed's estimators count for all the data ranks together."""
    if device_type == "cpu":
        return planned["total"] + planned["cpu"]
    return planned["cpu"] / layout.data_axis


def check_checkpoint_room(cfg: RunConfig, ds: dict, layout, device_type: str, planned: dict, n_params: int, start: int,
                          resume_dir: str | None) -> None:
    """The disk the run's checkpoints need and the host memory of a background save's copy beside what the memory
    plan puts there (training/checkpoints/space.py): train.py's start, and preflight.py on every rank."""
    check_disk(cfg.train, ds, n_params, start, resume_dir)
    check_host_copy(cfg.train, ds, layout, n_params, start, resume_dir, in_host_memory(planned, device_type, layout),
                    ranks_on_this_node())


def masking_note(cfg: RunConfig, data: TokenData, device: torch.device) -> str | None:
    """What document masking does in this run, and with which attention kernel."""
    if not cfg.model.document_masking:
        return None
    if not data.positions:
        if data.KIND != "text":  # each row one conversation, or one side of a pair: nothing to mask, nothing to say
            return None
        return "document masking: on, but the data has no document delimiter (one document): nothing to mask"
    kernel = KERNEL_NAMES[document_kernel(device.type, cfg.model.dropout)]
    return f"document masking: attention within each document, positions from its start; kernel: {kernel}"


def encode_prompt(settings, meta: dict, tokenizer) -> tuple[list[int], tuple, str | None]:
    """The end-of-run sample's prompt ids, the ids it stops at, and a note when a text prompt's ids are not the
    text's own (data.tokenizers.sampling_start): sample.chat's message through the dataset's chat template where it
    is set (sample.py --chat's), else sample.prompt."""
    if settings.chat is not None:
        try:
            ids, end = chat_prompt([{"role": "user", "content": settings.chat}], meta, tokenizer,
                                   f"sample.chat={settings.chat!r}", "set sample.prompt instead")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return ids, answer_ends(meta, end), None
    try:
        ids, note = sampling_start(settings.prompt, tokenizer)
    except ValueError as e:
        raise ConfigError(f"sample.prompt={settings.prompt!r} does not encode with the dataset's {tokenizer.name} "
                          f"tokenizer: {e}; fix: use characters of the training text in sample.prompt") from None
    return ids, (), note


def count_parameters(cfg: RunConfig) -> int:
    """The whole model's parameters (tied ones once), whatever ZeRO-3 or the stages hold locally. Built on the
    meta device, so a bad architecture stops here; the modules' own checks (torch's included) that the range
    checks missed surface as a ConfigError."""
    try:
        with torch.device("meta"):
            return sum(p.numel() for p in build_model(cfg.model).parameters())
    except (ValueError, AssertionError, RuntimeError, TypeError) as e:
        raise ConfigError(f"the model.* settings do not build a model ({type(e).__name__}: {e}); fix: change "
                          f"the model settings named there") from None


def describe_zero(ds: dict) -> str:
    """The ZeRO stage of the ds_config DeepSpeed is given, and where its offloads go."""
    zero = ds.get("zero_optimization", {})
    offloads = [f"{what} on the {zero[key]['device']}" for what, key in (("optimizer", "offload_optimizer"),
                ("parameters", "offload_param")) if zero.get(key, {}).get("device", "none") != "none"]
    return f"ZeRO-{zero.get('stage', 0)}" + (f" ({', '.join(offloads)})" if offloads else "")


def describe_model(model) -> str:
    """The architecture in a few words: what model.* shapes."""
    heads = f"{model.n_head} heads" + (f" ({model.n_kv_head} key/value)" if model.n_kv_head not in (None, model.n_head)
                                       else "")
    heads += f" {model.head_dim} wide" if model.head_dim else ""
    attention = [name for name, on in (("q/k/v biases", model.qkv_bias), ("per-head q/k norms", model.qk_norm)) if on]
    heads += f" ({', '.join(attention)})" if attention else ""
    experts = ""
    if model.n_experts:
        blocks = "every block" if model.moe_every == 1 else f"every {model.moe_every}th block"
        experts = (f", {model.n_experts} experts in {blocks}, {model.experts_per_token} per token "
                   f"({'dropless' if model.capacity_factor is None else f'capacity {model.capacity_factor}'})")
    lora = ""
    if model.lora_rank:
        lora = (f"; LoRA rank {model.lora_rank} (alpha {model.lora_alpha:g}) on {model.lora_targets}: "
                f"{sum(layer_params(model, trainable=True)):,} parameters train")
    return (f"{model.arch}: {model.n_layer} layers, {heads}, width {model.n_embd}, context {model.block_size}, "
            f"vocabulary {model.vocab_size:,}{experts}{lora}")


def describe_data(data) -> str:
    """Where the run reads its data (absolute: a relative data.dir is read from the current folder), how much
    of it, and its tokenizer."""
    sources = [f"{os.path.abspath(d.dir)} ({d.splits['train']:,} train and {d.splits['val']:,} val tokens"
               + (f", weight {w:g})" if len(data.datasets) > 1 else ")") for d, w in zip(data.datasets, data.weights)]
    return f"data: {'; '.join(sources)}; {KIND_WORDS[data.KIND]}, {data.meta['tokenizer']} tokenizer"


def describe_outputs(out_dir: str) -> str:
    """Where the run writes: its checkpoints, metrics and full configuration."""
    where = os.path.abspath(out_dir)
    return (f"out_dir: {where}: checkpoints/, metrics.jsonl, config.yaml and ds_config.json (the full "
            f"configuration; train.print_config=true prints it)")


def save_effective_config(cfg: RunConfig, ds: dict, layout: Layout) -> None:
    """The run config and the ds_config as this run took them, written beside its checkpoints; printed too with
    train.print_config=true (the start-up lines print0 the rest)."""
    run_yaml = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    ds_json = json.dumps(ds, indent=2)
    if cfg.train.print_config:
        print(f"run config:\n{run_yaml}ds_config:\n{ds_json}\nlayout: {layout.describe()}", flush=True)
    with open(os.path.join(cfg.train.out_dir, "config.yaml"), "w") as f:
        f.write(run_yaml)
    with open(os.path.join(cfg.train.out_dir, "ds_config.json"), "w") as f:
        f.write(ds_json + "\n")
