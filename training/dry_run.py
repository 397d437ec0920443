"""A layout checked at any scale without starting a rank (`python preflight.py --dry_run --world N --gpus_per_node G`):
DeepSpeed's own topology of N ranks (PipeModelDataParallelTopology, which needs no process group) and the groups
this repo and DeepSpeed make over it, each printed and checked: the tensor groups (an all-reduce every layer: they
must stay inside a node), the sequence groups (an all-to-all every layer: a note when they leave one), the data
groups, the pipelines and, with experts, DeepSpeed's expert and expert-data groups (consecutive blocks of
expert_parallel_size ranks of a stage, and the ranks at that stride). Then the stage boundaries, and each stage's
parameters per rank, counted on the meta device."""
from common.checks import ConfigError
from training.config import RunConfig
from training.layout_planner import Assumptions, plan_layouts
from training.memory_plan import ALLOWANCE, GB, fits, layer_params, plan, repeated_ties, stages_of
from training.moe import check_experts, expert_parallel_size
from training.startup import check_recompute
from training.topology import (
    group_lists,
    pipeline_settings,
    resolve_layout,
    sequence_parallel_size,
    tensor_parallel_size,
    topology,
    zero_stage,
)


def dry_run(cfg: RunConfig, ds: dict, world: int, gpus_per_node: int, gpu_gb: float | None = None) -> str:
    """The report of the layout of `cfg` and `ds` on `world` ranks, `gpus_per_node` to a node; ConfigError where
    it cannot run (the checks train.py makes at start, tensor groups that cross nodes, and with `gpu_gb` a
    memory plan over the GPUs' memory)."""
    if world % gpus_per_node:
        raise ConfigError(f"--world {world} is not a whole number of nodes of --gpus_per_node {gpus_per_node}")
    pipe, tp, sp, ep = pipeline_settings(ds), tensor_parallel_size(ds), sequence_parallel_size(ds), \
        expert_parallel_size(ds)
    layout = resolve_layout(dict(ds), world, pipe.stages, tp, sp, ep)
    zero = zero_stage(ds)
    check_recompute(pipe, cfg, ds)
    check_experts(cfg.model, layout, zero, ds.get("fp16", {}).get("enabled") is True, cfg.train.compile,
                  cfg.train.mlp_tiles)
    groups = group_lists(topology(layout), sp)
    if ep > 1:
        groups["expert"], groups["expert-data"] = expert_group_lists(world, pipe.stages, ep)
    node = lambda ranks: {r // gpus_per_node for r in ranks}  # noqa: E731
    crossing = [g for g in groups["tensor"] if len(node(g)) > 1]
    if crossing:
        raise ConfigError(f"tensor group {compact(crossing[0])} spans nodes {sorted(node(crossing[0]))}: its "
                          f"all-reduces run in every layer and need a node's links; fix: a tensor_model_parallel_size "
                          f"that divides --gpus_per_node {gpus_per_node}")
    lines = [f"dry run: {layout.describe()}; ZeRO-{zero}; {world // gpus_per_node} nodes of {gpus_per_node}"]
    for axis, lists in groups.items():
        where = "each inside one node" if all(len(node(g)) == 1 for g in lists) else "across nodes"
        lines.append(f"{axis} groups: {len(lists)} of {len(lists[0])}, {where}: {' '.join(map(compact, lists))}")
    if "sequence" in groups and any(len(node(g)) > 1 for g in groups["sequence"]):
        lines.append("note: sequence groups cross nodes; Ulysses' all-to-alls in every layer then run between nodes")
    lines += stage_lines(cfg, layout, pipe, tp, ep, zero)
    if gpu_gb:
        lines.append(memory_check(cfg, ds, layout, gpus_per_node, gpu_gb))
    return "\n".join(lines)


def memory_check(cfg: RunConfig, ds: dict, layout, gpus_per_node: int, gpu_gb: float) -> str:
    """The memory plan's figure for the layout against `gpu_gb` GPUs (training/memory_plan.py fits); where it does
    not fit, ConfigError naming the layout the planner would choose for the same batch. The plan counts what the
    model keeps and leaves the allocator's own out: it refuses too little, never too much."""
    needed = plan(cfg.model, ds, layout.world_size, cfg.train.mlp_tiles, compiled=cfg.train.compile)["total"]
    if fits(needed, gpu_gb):
        return f"memory: {needed / GB:.1f} GB a GPU by the memory plan, within {1 - ALLOWANCE:.0%} of {gpu_gb:g} GB"
    fitting = [r for r in plan_layouts(cfg.model, layout.world_size, gpus_per_node, layout.global_batch,
                                       Assumptions(gpu_gb=gpu_gb)) if r["fits"]]
    choice = (f"the planner would choose {fitting[0]['layout'].describe()} (python -m scripts.memory_plan --plan "
              f"--gpus {layout.world_size} --global_batch {layout.global_batch})" if fitting else
              "no layout of this batch fits them: add GPUs or lower the batch")
    raise ConfigError(f"this layout needs {needed / GB:.1f} GB a GPU by the memory plan, over {1 - ALLOWANCE:.0%} of "
                      f"{gpu_gb:g} GB; {choice}")


def expert_group_lists(world: int, stages: int, ep: int) -> tuple[list, list]:
    """DeepSpeed's expert-parallel groups (consecutive blocks of ep ranks within each stage's block of ranks) and
    expert-data-parallel groups (a stage's ranks at stride ep): deepspeed.utils.groups'
    _create_expert_and_data_parallel, as training/moe.py calls it, without its process groups."""
    per_stage = world // stages
    expert, expert_data = [], []
    for stage in range(stages):
        first = stage * per_stage
        expert += [list(range(first + i, first + i + ep)) for i in range(0, per_stage, ep)]
        expert_data += [list(range(first + i, first + per_stage, ep)) for i in range(ep)]
    return expert, expert_data


def stage_lines(cfg: RunConfig, layout, pipe, tp: int, ep: int, zero: int) -> list[str]:
    """Each stage's layers, ranks and parameters per rank (its tensor rank's slices, its expert-parallel rank's
    experts; under ZeRO-3 a data rank's partition of them)."""
    specs, parts = stages_of(cfg.model, tp, pipe.stages, pipe.partition)
    counts = layer_params(cfg.model, tp, ep)
    for tie in repeated_ties(specs):  # the tied head owns no weights of its own
        counts[tie] = 0
    per_stage = layout.world_size // pipe.stages
    lines = []
    for stage in range(pipe.stages):
        layers = specs[parts[stage]: parts[stage + 1]]
        names = [spec.typename.__name__ for spec in layers]
        held = sum(counts[parts[stage]: parts[stage + 1]]) / (layout.data_axis if zero == 3 else 1)
        counted = ", ".join(f"{n} x{names.count(n)}" if names.count(n) > 1 else n for n in dict.fromkeys(names))
        lines.append(f"stage {stage}: layers {parts[stage]}-{parts[stage + 1] - 1} ({counted}) on ranks "
                     f"{stage * per_stage}-{(stage + 1) * per_stage - 1}: {held:,.0f} parameters per rank")
    return lines


def compact(ranks: list[int]) -> str:
    """[a-b] for consecutive ranks, [a-b/s] for every s-th from a to b, else the list."""
    if len(ranks) == 1:
        return f"[{ranks[0]}]"
    step = ranks[1] - ranks[0]
    if all(b - a == step for a, b in zip(ranks, ranks[1:])):
        return f"[{ranks[0]}-{ranks[-1]}]" if step == 1 else f"[{ranks[0]}-{ranks[-1]}/{step}]"
    return f"[{','.join(map(str, ranks))}]"
