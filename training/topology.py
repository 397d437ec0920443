"""Parallel layout maths, in one place: world = pp x dp x sp x tp, the batch triple, the pipeline stages, and
DeepSpeed's topology and grid over them.

DeepSpeed requires train_batch_size == micro_batch x grad_accum x dp but its error names the world
size; with pipeline stages and tensor parallelism dp = world / (pp x tp), so we derive and check the
triple ourselves first. Every check here runs before any process group exists.

Sequence parallelism (Ulysses, model/sequence_parallel.py) lives inside DeepSpeed's data axis: the topology's
data axis counts dp x sp ranks, and each run of sp consecutive ones splits the same windows' sequence. So ZeRO
partitions and reduces gradients over data x sequence ranks, and the engines' mean over their data axis of
each rank's mean over its slice is the mean over the whole sequence, for the plain engine and the pipeline
engine alike (DeepSpeed's own sequence-data-parallel path sums over sp ranks in the plain engine only). The
batch triple counts the data-parallel ranks; DeepSpeed is given the data axis's (`deepspeed_batch`).
"""
import re
from dataclasses import dataclass

import torch

from common.checks import ConfigError

MICRO = "train_micro_batch_size_per_gpu"
ACCUM = "gradient_accumulation_steps"
GLOBAL = "train_batch_size"


@dataclass(frozen=True)
class Layout:
    world_size: int
    pipeline_stages: int
    micro_batch: int
    grad_accum: int
    tp_size: int = 1
    sp_size: int = 1
    ep_size: int = 1  # expert parallelism: groups of data-parallel ranks that share out the experts
    tp_sequence: bool = False  # Megatron's sequence parallelism inside the tensor groups

    @property
    def dp(self) -> int:
        return self.world_size // (self.pipeline_stages * self.tp_size * self.sp_size)

    @property
    def data_axis(self) -> int:
        """DeepSpeed's data-parallel degree: the data-parallel replicas x the sequence ranks of each."""
        return self.dp * self.sp_size

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.dp

    def describe(self) -> str:
        sp = f" x sp {self.sp_size}" if self.sp_size > 1 else ""
        tp = f" x tp {self.tp_size}{' (sequence split)' if self.tp_sequence else ''}" if self.tp_size > 1 else ""
        ep = f" (experts over ep {self.ep_size})" if self.ep_size > 1 else ""
        return (f"world {self.world_size} = dp {self.dp}{ep}{sp} x pp {self.pipeline_stages}{tp}; global batch "
                f"{self.global_batch} = micro {self.micro_batch} x accum {self.grad_accum} x dp {self.dp}")


# The ds_config's tensor-parallel degree. Ours, not DeepSpeed's: its "tensor_parallel" section switches on
# AutoTP, which cannot be combined with pipeline stages (the layers are ours: model/tensor_parallel.py).
TP_KEY = "tensor_model_parallel_size"


def tensor_parallel_size(ds: dict) -> int:
    """The degree, checked against what this repo can combine it with."""
    tp_size = ds.get(TP_KEY, 1)  # a positive integer (training/ds_config.py DS_NUMBERS)
    if tp_size > 1 and ds.get("tensor_parallel", {}).get("autotp_size", 0) > 1:
        raise ConfigError(f"{TP_KEY}={tp_size} and DeepSpeed's AutoTP (tensor_parallel.autotp_size) are both set: the "
                          f"model's own tensor-parallel layers replace AutoTP here; remove the tensor_parallel section")
    return tp_size


# Megatron's sequence parallelism over the tensor ranks (model/tensor_parallel.py): ours too, beside TP_KEY.
TP_SEQUENCE_KEY = "tensor_sequence_parallel"


def tensor_sequence_parallel(ds: dict, tp_size: int) -> bool:
    on = ds.get(TP_SEQUENCE_KEY, False)
    if not isinstance(on, bool):
        raise ConfigError(f"{TP_SEQUENCE_KEY}={on!r}: must be true or false; fix: set ds.{TP_SEQUENCE_KEY}=true "
                          f"or false")
    if on and tp_size == 1:
        raise ConfigError(f"{TP_SEQUENCE_KEY}=true splits the sequence over the tensor ranks, and {TP_KEY} is 1: "
                          f"set {TP_KEY} > 1, or remove {TP_SEQUENCE_KEY}")
    return on


# The ds_config's sequence-parallel degree: DeepSpeed's key, read here. DeepSpeed is given the batch of its
# data axis instead (`deepspeed_batch`), with which its own reading of the key would disagree.
SP_KEY = "sequence_parallel_size"


def sequence_parallel_size(ds: dict) -> int:
    return ds.get(SP_KEY, 1)  # a positive integer (training/ds_config.py DS_NUMBERS)


def resolve_layout(ds: dict, world_size: int, pipeline_stages: int = 1, tp_size: int = 1,
                   sp_size: int = 1, ep_size: int = 1) -> Layout:
    """The layout of the ds_config's batch triple at this world size, its missing member derived, checked
    to hold. `ds` is left as it is: training/startup.py writes the triple into the ds_config it assembles."""
    model_ranks = pipeline_stages * tp_size * sp_size
    if world_size % model_ranks:
        degrees = [(name, size) for name, size in (("tensor-parallel", tp_size), ("sequence-parallel", sp_size))
                   if size > 1]
        factors = [f"{pipeline_stages} pipeline stages", *(f"{name} degree {size}" for name, size in degrees)]
        what = " x ".join(factors) + (f" = {model_ranks}" if degrees else "")
        raise ConfigError(f"{what} do not divide the world size {world_size}: launch a multiple of {model_ranks} "
                          f"processes or change pipeline.stages / {TP_KEY} / {SP_KEY}")
    dp = world_size // model_ranks
    derived = f"= world {world_size} / pp {pipeline_stages}" + "".join(
        f" / {name} {size}" for name, size in (("tp", tp_size), ("sp", sp_size)) if size > 1)
    micro, accum, batch = ds.get(MICRO), ds.get(ACCUM), ds.get(GLOBAL)  # positive integers or None (DS_NUMBERS)
    if micro is None and batch is None:
        raise ConfigError(f"the ds_config sets neither {MICRO} nor {GLOBAL}: set at least one")
    if batch is None:
        accum = accum or 1
        batch = micro * accum * dp
    elif micro is None:
        accum = accum or 1
        if batch % (accum * dp):
            raise ConfigError(f"{GLOBAL}={batch} is not divisible by {ACCUM} ({accum}) x dp ({dp}, "
                              f"{derived}): no whole micro batch fits")
        micro = batch // (accum * dp)
    elif accum is None:
        if batch % (micro * dp):
            raise ConfigError(f"{GLOBAL}={batch} is not divisible by {MICRO} ({micro}) x dp ({dp}, "
                              f"{derived}): no whole number of "
                              f"accumulation steps fits")
        accum = batch // (micro * dp)
    if batch != micro * accum * dp:
        raise ConfigError(
            f"{GLOBAL} ({batch}) != {MICRO} ({micro}) x {ACCUM} ({accum}) x dp ({dp}, "
            f"{derived}) = {micro * accum * dp}. Fix one of them, or drop "
            f"{GLOBAL} from the ds_config and it is derived.")
    return Layout(world_size, pipeline_stages, micro, accum, tp_size, sp_size, ep_size,
                  tensor_sequence_parallel(ds, tp_size))


def zero_stage(ds: dict) -> int:
    return ds.get("zero_optimization", {}).get("stage", 0)


def sixteen_bit_type(ds: dict) -> torch.dtype | None:
    """The 16-bit type the engine casts the weights to, by an effective ds_config (bf16 "auto" resolved); None: fp32."""
    return torch.float16 if ds.get("fp16", {}).get("enabled") else \
        torch.bfloat16 if ds.get("bf16", {}).get("enabled") else None


def layout_record(layout: Layout, zero: int) -> dict:
    """The layout as checkpoints record it (run_state.json's "layout")."""
    return {"world": layout.world_size, "dp": layout.dp, "pp": layout.pipeline_stages, "tp": layout.tp_size,
            "sp": layout.sp_size, "ep": layout.ep_size, "zero_stage": zero}


def deepspeed_batch(layout: Layout) -> dict:
    """The batch triple as DeepSpeed counts it: over its data axis, sequence ranks included."""
    return {MICRO: layout.micro_batch, ACCUM: layout.grad_accum, GLOBAL: layout.global_batch * layout.sp_size}


# The ds_config's "pipeline" section. DeepSpeed parses it (any keys, no checks) but builds nothing from
# it; train.py passes these to PipelineModule. Keys outside this set are typos.
RECOMPUTE = ("full", "selective")  # pipeline.recompute: model/recompute.py
PIPELINE_KEYS = {"stages", "partition", "activation_checkpoint_interval", "recompute", "seed_layers",
                 "pipe_partitioned", "grad_partitioned"}


@dataclass(frozen=True)
class Pipeline:
    stages: int = 1
    partition: str = "parameters"  # PipelineModule's partition_method: parameters, uniform or type:<regex>
    checkpoint_interval: int = 0  # activation checkpointing every N layers (blocks only); 0 = off
    recompute: str = "full"  # what a checkpointed block runs again: all of it, or all but its matmuls (selective)


def pipeline_settings(ds: dict) -> Pipeline:
    section = ds.get("pipeline", {})
    unknown = sorted(set(section) - PIPELINE_KEYS)
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in the ds_config's pipeline section; known: "
                          f"{sorted(PIPELINE_KEYS)}")
    stages = section.get("stages", 1)  # numbers checked with the ds_config's others (training/ds_config.py DS_NUMBERS)
    interval = section.get("activation_checkpoint_interval", 0)
    recompute = section.get("recompute", "full")
    if recompute not in RECOMPUTE:
        raise ConfigError(f"pipeline.recompute={recompute!r}: must be one of {', '.join(RECOMPUTE)} (what a "
                          f"checkpointed block runs again in the backward pass); fix: set ds.pipeline.recompute to one")
    if recompute == "selective" and not interval:
        raise ConfigError("pipeline.recompute=selective recomputes checkpointed blocks, and none is: fix: set "
                          "ds.pipeline.activation_checkpoint_interval=1 (every block) beside it")
    partition = section.get("partition", "parameters")
    if partition == "best":  # DeepSpeed's placeholder default; not a PipelineModule method
        partition = "parameters"
    zero = zero_stage(ds)
    if stages > 1 and zero >= 2:
        raise ConfigError(f"ZeRO stage {zero} cannot be combined with pipeline parallelism (pipeline.stages="
                          f"{stages}): DeepSpeed shards gradients across the pipeline engine's micro-batches only "
                          f"with ZeRO 0/1. Use ds_configs/pipe2.json or pipe4.json (ZeRO-1), or set pipeline.stages=1")
    return Pipeline(stages, partition, interval, recompute)


def stage_partition(specs: list, stages: int, method: str, block_class: type) -> list[int]:
    """The layer boundaries PipelineModule will choose (its rule, with layers counted on the meta device),
    checked before any process group starts: every stage must hold at least one transformer block (block_class,
    the Architecture's block)."""
    import torch
    from deepspeed.runtime.utils import partition_balanced, partition_uniform

    names = [spec.typename.__name__ for spec in specs]
    n_blocks = sum(spec.typename is block_class for spec in specs)
    if stages > n_blocks:
        raise ConfigError(f"{stages} pipeline stages but the model has {n_blocks} transformer blocks: each stage needs "
                          f"at least one. Use at most {n_blocks} stages or more model.n_layer")
    if method == "uniform":
        parts = partition_uniform(num_items=len(specs), num_parts=stages)
    elif method == "parameters":
        with torch.device("meta"):
            weights = [sum(p.numel() for p in spec.build().parameters()) for spec in specs]
        parts = partition_balanced(weights=weights, num_parts=stages)
    elif method.startswith("type:"):
        pattern = re.compile(method.split(":", 1)[1], re.IGNORECASE)
        parts = partition_balanced(weights=[int(bool(pattern.search(n))) for n in names], num_parts=stages)
    else:
        raise ConfigError(f"pipeline.partition={method!r} is not one of parameters, uniform, type:<layer class>")
    for stage in range(stages):
        if not any(spec.typename is block_class for spec in specs[parts[stage]: parts[stage + 1]]):
            raise ConfigError(f"pipeline.partition={method!r} leaves stage {stage} without a transformer block (it "
                              f"would hold {names[parts[stage]: parts[stage + 1]] or 'nothing'}): use \"partition\": "
                              f"\"type:{block_class.__name__}\"")
    return parts


def describe_stages(specs: list, parts: list[int], layout: Layout) -> str:
    """One line per stage: its layers and the global ranks that hold it."""
    lines = []
    for stage in range(layout.pipeline_stages):
        names = [spec.typename.__name__ for spec in specs[parts[stage]: parts[stage + 1]]]
        counted = ", ".join(f"{n} x{names.count(n)}" if names.count(n) > 1 else n for n in dict.fromkeys(names))
        # DeepSpeed's topology orders ranks pipe-major (then data, then tensor): stage s holds a block of them.
        per_stage = layout.data_axis * layout.tp_size
        ranks = list(range(stage * per_stage, (stage + 1) * per_stage))
        lines.append(f"stage {stage}: layers {parts[stage]}-{parts[stage + 1] - 1} ({counted}) on ranks {ranks}")
    return "\n".join(lines)


def describe_hosts(hostnames: list[str]) -> str:
    """Which ranks run on which host, from every rank's hostname in rank order."""
    ranks = {}
    for rank, host in enumerate(hostnames):
        ranks.setdefault(host, []).append(rank)
    return "; ".join(f"{host}: ranks {r[0]}-{r[-1]}" if len(r) > 1 else f"{host}: rank {r[0]}"
                     for host, r in ranks.items())


def topology(layout: Layout):
    """DeepSpeed's (pipe, data, model) topology: tensor-parallel peers are adjacent ranks (one node), then the
    sequence ranks of a replica, then data-parallel replicas, then stages."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    return PipeModelDataParallelTopology(num_pp=layout.pipeline_stages, num_mp=layout.tp_size,
                                         num_dp=layout.data_axis)


@dataclass(frozen=True)
class Groups:
    """This rank's process groups: DeepSpeed's grid (the engine's mpu, None without stages or tensor
    parallelism), its tensor-parallel and sequence-parallel groups, and which data-parallel replica it is in."""
    grid: object
    tp: object
    sp: object
    dp_rank: int


def parallel_groups(topo, sp_size: int = 1, tp_sequence: bool = False) -> Groups:
    """The groups of this rank over the topology (a PipelineModule makes its own grid from the same topology).
    Collective: every rank creates every group, in one order."""
    import torch.distributed as dist
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid

    from model.sequence_parallel import NO_SEQUENCE_PARALLEL, SequenceParallel
    from model.tensor_parallel import SINGLE, TensorParallel

    rank = dist.get_rank()
    sp = NO_SEQUENCE_PARALLEL
    for ranks in topo.get_axis_comm_lists("data") if sp_size > 1 else []:
        for start in range(0, len(ranks), sp_size):
            members = ranks[start: start + sp_size]
            group = dist.new_group(members)
            if rank in members:
                sp = SequenceParallel(sp_size, members.index(rank), group)
    dp_rank = topo.get_coord(rank).data // sp_size
    if topo.get_dim("pipe") == 1 and topo.get_dim("model") == 1:
        return Groups(None, SINGLE, sp, dp_rank)
    grid = PipelineParallelGrid(topology=topo)
    size = grid.get_tensor_model_parallel_world_size()
    tp = TensorParallel(size, grid.get_tensor_model_parallel_rank(), grid.get_slice_parallel_group(), tp_sequence) \
        if size > 1 else SINGLE
    return Groups(grid, tp, sp, dp_rank)


def group_lists(topo, sp_size: int = 1) -> dict[str, list[list[int]]]:
    """The ranks of each tensor-parallel, sequence-parallel (sp_size > 1), data-parallel and pipeline group of the
    topology, by axis name."""
    alone = [[r] for r in range(topo.world_size())]  # an axis of size 1: DeepSpeed lists no groups
    lists = {axis: topo.get_axis_comm_lists(axis) or alone for axis in ("model", "data", "pipe")}
    sequence = [ranks[i: i + sp_size] for ranks in lists["data"] for i in range(0, len(ranks), sp_size)]
    data = [ranks[i::sp_size] for ranks in lists["data"] for i in range(sp_size)]
    return {"tensor": lists["model"], **({"sequence": sequence} if sp_size > 1 else {}), "data": data,
            "pipeline": lists["pipe"]}


def describe_topology(topo, sp_size: int = 1) -> str:
    """Which ranks form each tensor-parallel, sequence-parallel, data-parallel and pipeline group, and each
    rank's coordinates."""
    groups = [f"{axis} groups {lists}" for axis, lists in group_lists(topo, sp_size).items()]
    sequence_rank = (lambda c: f", sequence rank {c.data % sp_size}") if sp_size > 1 else (lambda c: "")
    ranks = [f"rank {r}: stage {c.pipe}, tensor rank {c.model}{sequence_rank(c)}, data rank {c.data // sp_size}"
             for r, c in ((r, topo.get_coord(r)) for r in range(topo.world_size()))]
    return "\n".join(["; ".join(groups), *ranks])
