"""A mixture of experts' checkpoints, where DeepSpeed's own handling falls short: the save under tensor parallelism at
expert-parallel degree 1 (`every_tensor_rank_writes`), and the conversion to DeepSpeed's universal format, which
DeepSpeed's converter does not write (DeepSpeed issue 5716).

The converter merges every group's ZeRO partitions over the whole data-parallel world, where an expert group is
partitioned over the ranks that hold the same experts and its parameters are named by their place on their rank.
`convert` writes what DeepSpeed's loader reads of a universal checkpoint: each parameter's fp32 weight and Adam
moments whole under zero/<name>/, an expert's under the name a one-rank model gives it (its global index), so that
any expert-parallel degree finds its own (`expert_names` maps them back at load). Its source is a ZeRO-1 or ZeRO-2
checkpoint of one tensor rank, at any data-parallel and expert-parallel degree and over any pipeline stages
(universal.unconvertible refuses the others). DeepSpeed's expert groups there are consecutive blocks of ep ranks
of a stage: its data-parallel rank r holds expert block r % ep, and is partition r // ep of the ranks that hold
the same block."""
import contextlib
import glob
import os
import shutil
from collections import defaultdict

import torch
from deepspeed.checkpoint.constants import (
    BASE_OPTIMIZER_STATE,
    CAT_DIM,
    FP32_WEIGHT_KEY,
    OPTIMIZER_STATE_DICT,
    PARAM,
    PARAM_GROUPS,
    PARAM_SLICE_MAPPINGS,
    SINGLE_PARTITION_OF_FP32_GROUPS,
)
from deepspeed.utils import groups
from deepspeed.utils.bwc import bwc_tensor_model_parallel_world_size

from model.moe import global_expert_names
from training.checkpoints import universal

MODEL_STATES = "mp_rank_*_model_states.pt"
EXPERT_FILES = "layer_*_expert_*_model_states.pt"
EXPERTS = ".deepspeed_experts."  # in an expert parameter's name, before its index
# DeepSpeed names an expert parameter group by its expert-parallel degree ("ep_size_2"), and its loader copies a
# saved group's settings over the running one's: the name must not travel to another degree.
LAYOUT_SETTINGS = ("name",)


@contextlib.contextmanager
def every_tensor_rank_writes(engine):
    """Within it, DeepSpeed's save of a mixture of experts writes every tensor rank's files at expert-parallel degree
    1. DeepSpeed lets the first rank of each expert-data-parallel group write (the experts, the module, the
    experts' optimizer states), and that group spans the tensor ranks when the experts are not shared out over
    them: the other tensor ranks wrote nothing, so a resume found no model-states file of theirs and an export
    merged one slice. Here every rank of the first data-parallel replica writes, each its own mp_rank files (the
    experts' copies, alike on every tensor rank, once per rank)."""
    if not engine.has_moe_layers or bwc_tensor_model_parallel_world_size(engine.mpu) == 1 or \
            groups._get_expert_parallel_world_size(groups._get_max_expert_size_name()) > 1:
        yield  # DeepSpeed's writers write every file
        return
    writer = engine.checkpoint_engine
    first_replica = engine.mpu.get_data_parallel_rank() == 0
    writer.is_data_parallel_writer = lambda rank: first_replica
    try:
        yield
    finally:
        del writer.is_data_parallel_writer


def convert(source: str, target: str, dp: int, ep: int, stages: int, load) -> None:
    """Write the universal form of `source` (saved at data-parallel degree `dp`, expert-parallel degree `ep`, over
    `stages` pipeline stages) to `target`. load: reads one of its torch files safely."""
    try:
        first = None
        for stage in range(stages):
            states = load(os.path.join(source, _model_states(stage)))
            shards = [load(_shard(source, rank, stage)) for rank in range(dp)]
            _convert_stage(source, target, states, shards, ep)
            first = first or shards[0][OPTIMIZER_STATE_DICT]
        sharded = (BASE_OPTIMIZER_STATE, PARAM_SLICE_MAPPINGS, SINGLE_PARTITION_OF_FP32_GROUPS)
        torch.save({**{k: v for k, v in first.items() if k not in sharded},
                    PARAM_GROUPS: _layout_free(first[BASE_OPTIMIZER_STATE][PARAM_GROUPS])},
                   os.path.join(target, "zero", "optimizer_state.pt"))
        for path in [*glob.glob(os.path.join(source, MODEL_STATES)), *glob.glob(os.path.join(source, EXPERT_FILES))]:
            shutil.copy2(path, target)  # what export and sampling read, and DeepSpeed's run counters
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)  # half a conversion is no checkpoint
        raise


def convert_zero0(source: str, target: str, saved: dict, ep: int, load) -> None:
    """A ZeRO-0 checkpoint of a mixture of experts (one stage, one tensor rank; `saved`: its run state) in the
    universal format, as universal.convert_zero0 writes a dense one. Each expert-parallel rank's whole optimizer
    state is a file of its own (expp_rank_<e>_mp_rank_00_optim_states.pt), in the order its optimizer took the
    parameters: the dense matrices, the dense vectors, then that rank's experts (DeepSpeed moves them to a group of
    their own). Each expert is written under its global index."""
    order, info = universal.optimizer_order(saved, source), universal.one_rank_info(saved, source)
    dense, routed = [p for p in order if EXPERTS not in p[0]], [p for p in order if EXPERTS in p[0]]
    local = saved["config"]["model"]["n_experts"] // ep
    states = load(os.path.join(source, _model_states(0)))
    expert_files = sorted(glob.glob(os.path.join(source, EXPERT_FILES)))
    weights = {**states["module"], **{k: v for path in expert_files for k, v in load(path).items()}}
    try:
        for rank in range(ep):
            mine = [p for p in routed if rank * local <= _expert_index(p[0]) < (rank + 1) * local]
            optimizer = load(os.path.join(source, f"expp_rank_{rank}_mp_rank_00_optim_states.pt"))["optimizer"]
            adam = universal.write_parameters(target, dense + mine, optimizer, weights, source, info,
                                              skip=frozenset(name for name, _ in dense) if rank else frozenset())
            if rank == 0:
                torch.save({"ds_version": states["ds_version"], PARAM_GROUPS: _layout_free(adam[PARAM_GROUPS])},
                           os.path.join(target, "zero", "optimizer_state.pt"))
        _save_buffers(target, states)
        torch.save({**states, "optimizer": None}, os.path.join(target, _model_states(0)))
        for path in expert_files:
            shutil.copy2(path, target)
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)  # half a conversion is no checkpoint
        raise


def _layout_free(param_groups: list) -> list:
    """The optimizer's groups without what names their layout (an expert group's degree)."""
    return [{k: v for k, v in group.items() if not (group.get("moe") and k in LAYOUT_SETTINGS)}
            for group in param_groups]


def _convert_stage(source: str, target: str, states: dict, shards: list, ep: int) -> None:
    """One pipeline stage's parameters (`states`: its model-states file; `shards`: its ranks' ZeRO shards) and
    buffers into `target`. A parameter two stages hold (the tied embedding) is written by the first."""
    shapes = {name: torch.Size(shape) for group in states["param_shapes"] for name, shape in group.items()}
    pieces, steps = _fragments(shards, ep, _local_experts(states["num_experts"], ep))
    for name, by_key in pieces.items():
        if os.path.exists(os.path.join(target, "zero", name)):
            continue
        local = _local_name(name)
        for key, parts in by_key.items():
            whole = torch.cat([parts[i] for i in sorted(parts)])
            if whole.numel() != shapes[local].numel():
                raise ValueError(f"{source}: the ZeRO shards hold {whole.numel()} of {name}'s "
                                 f"{shapes[local].numel()} values ({key}), so it cannot be converted")
            _save(target, name, key, {PARAM: whole.view(shapes[local]), CAT_DIM: 0})
        _save(target, name, "step", steps[name])
    _save_buffers(target, states)


def _save_buffers(target: str, states: dict) -> None:
    """A model-states file's buffers (a biased router's bias), which are not the optimizer's and which DeepSpeed's
    loader does not read."""
    universal.write_entries(target, {name: states["module"][name] for name in states["buffer_names"]})


def _model_states(stage: int) -> str:
    return f"mp_rank_{stage:02d}_model_states.pt"


def _shard(source: str, rank: int, stage: int) -> str:
    paths = glob.glob(os.path.join(source, f"*zero_pp_rank_{rank}_mp_rank_{stage:02d}_optim_states.pt"))
    if len(paths) != 1:
        raise ValueError(f"{source} lacks the ZeRO shard of data-parallel rank {rank} of stage {stage}, so it cannot "
                         f"be converted")
    return paths[0]


def _local_experts(num_experts: list, ep: int) -> int:
    """Experts per rank: every MoE layer of this repo's models holds the same number."""
    if len(set(num_experts)) != 1:
        raise ValueError(f"the MoE layers hold {num_experts} experts: one number for every layer is converted")
    return num_experts[0] // ep


def _fragments(shards: list, ep: int, local_experts: int) -> tuple[dict, dict]:
    """Every parameter's fragments by its global name: {name: {state: {partition index: flat tensor}}}, and its
    optimizer step."""
    pieces, steps = defaultdict(lambda: defaultdict(dict)), {}
    for rank, shard in enumerate(shards):
        optimizer = shard[OPTIMIZER_STATE_DICT]
        base = optimizer[BASE_OPTIMIZER_STATE]
        for index, group in enumerate(base[PARAM_GROUPS]):
            experts = group.get("moe", False)
            partition = rank // ep if experts else rank
            state = base["state"][index]
            flat = {FP32_WEIGHT_KEY: optimizer[SINGLE_PARTITION_OF_FP32_GROUPS][index],
                    **{key: value for key, value in state.items() if key != "step"}}
            for name, address in optimizer[PARAM_SLICE_MAPPINGS][index].items():
                if experts:
                    name = _global_name(name, (rank % ep) * local_experts)
                for key, tensor in flat.items():
                    pieces[name][key][partition] = tensor.narrow(0, address.start, address.numel).clone()
                steps[name] = state["step"]
    return pieces, steps


def _expert_index(name: str) -> int:
    return int(name.split(EXPERTS)[1].split(".", 1)[0])


def _global_name(name: str, first: int) -> str:
    """An expert parameter's name on its rank, whose experts are numbered from 0, with its global index."""
    head, tail = name.split(EXPERTS)
    local, rest = tail.split(".", 1)
    return f"{head}{EXPERTS}{first + int(local)}.{rest}"


def _local_name(name: str) -> str:
    """The name of the same parameter of expert 0 (the model states' shapes name each rank's own)."""
    if EXPERTS not in name:
        return name
    head, tail = name.split(EXPERTS)
    return f"{head}{EXPERTS}0.{tail.split('.', 1)[1]}"


def _save(target: str, name: str, key: str, value) -> None:
    folder = os.path.join(target, "zero", name)
    os.makedirs(folder, exist_ok=True)
    torch.save(value, os.path.join(folder, f"{key}.pt"))


class expert_names:
    """Within it, the engine names each expert parameter as a one-rank model does (DeepSpeed's universal loader
    finds a parameter's folder by the engine's name for it, which numbers a rank's experts from 0)."""

    def __init__(self, engine):
        self.names, self.renamed = engine.param_names, global_expert_names(engine.module)

    def __enter__(self):
        self.saved = dict(self.names)
        for param, name in self.names.items():
            self.names[param] = self.renamed.get(name, name)

    def __exit__(self, *exc):
        self.names.update(self.saved)
