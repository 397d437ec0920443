"""Everything done to a model between its layer list and DeepSpeed, in one place and in this order:

1. tensor parallelism: each layer splits its weights over the tensor ranks as it is built (the architecture's
   plan, model/parallelize.py), and a mixture-of-experts block builds this rank's experts only (model/moe.py),
   in DeepSpeed's expert groups, its router losses weighed for the accumulation steps (training/moe.py);
2. activation checkpointing of every `checkpoint_interval` blocks, recomputed in full or selectively
   (model/recompute.py; model/stack.py, or DeepSpeed's PipelineModule; compiled, inside each block's graph);
3. the ZeRO-3 partition: each layer partitioned as soon as it is built, so no rank ever holds the whole model;
4. the pipeline: the layer list as a PipelineModule of the run's stages, the plain module otherwise;
5. sequence parallelism: attention over the sequence ranks (DeepSpeed's Ulysses layer);
6. MLP tiling (train.mlp_tiles);
7. compilation of each block (train.compile), which wraps the blocks in place and leaves the rest eager.

DeepSpeed's engine then brings data parallelism and the ZeRO stage's sharding of optimizer states."""
import functools

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator

from model import build_model, build_pipeline, compile_blocks
from model.moe import NO_EXPERT_PARALLEL
from model.sequence_parallel import NO_SEQUENCE_PARALLEL, SequenceParallel
from model.tensor_parallel import SINGLE, TensorParallel
from model.tiling import tile_mlps
from training.config import RunConfig
from training.moe import expert_groups, expert_parallel_size, weigh_router_losses
from training.steps import lm_loss
from training.topology import ACCUM, Pipeline, sixteen_bit_type, zero_stage


def parallelize(cfg: RunConfig, pipe: Pipeline, ds: dict, topo=None, tp: TensorParallel = SINGLE, grid=None,
                sp: SequenceParallel = NO_SEQUENCE_PARALLEL) -> tuple[torch.nn.Module, int]:
    """Collective: the model of `cfg` as this rank trains it, and how many blocks were compiled (train.compile).
    `pipe`: the run's stages (more than one: `topo` is the run's topology); `tp`: its tensor ranks, whose `grid`
    partitions ZeRO-3 within each slice; `sp`: its sequence ranks; `ds`: the ds_config as DeepSpeed is given
    it, whose expert-parallel degree shares out a model's experts in DeepSpeed's expert groups."""
    ep = expert_groups(expert_parallel_size(ds), pipe.stages) if cfg.model.n_experts else NO_EXPERT_PARALLEL
    # compiled, each block recomputes selectively inside its own graph (compile_blocks), not in the stack's checkpoint
    inside = cfg.train.compile and pipe.recompute == "selective"
    interval = 0 if inside else pipe.checkpoint_interval
    if pipe.stages > 1:
        loss = functools.partial(lm_loss, tp=tp, compiled=cfg.train.compile)
        model = build_pipeline(cfg.model, cfg.train.seed, topo, pipe.partition, loss, interval, tp, sp, ep,
                               pipe.recompute)
    elif zero_stage(ds) == 3:
        model = build_model(cfg.model, cfg.train.seed, interval, partition=zero3_partition(ds, tp, grid), tp=tp,
                            sp=sp, recompute=pipe.recompute)
    else:
        model = build_model(cfg.model, cfg.train.seed, interval, tp=tp, sp=sp, ep=ep, recompute=pipe.recompute)
    weigh_router_losses(model, cfg.model, ds.get(ACCUM, 1), sp)
    model = tile_mlps(model, cfg.train.mlp_tiles)
    return model, compile_blocks(model, cfg.model.arch, selective=inside) if cfg.train.compile else 0


def zero3_partition(ds: dict, tp: TensorParallel, grid):
    """What partitions each layer as it is built. It is built on the CPU, from the CPU generator, as in every
    other layout, then partitioned (zero.Init(module=)): inside zero.Init's context it would be made on the GPU
    by the GPU's generator, other weights for a seed. Under tensor parallelism it is partitioned over the
    data-parallel replicas of each slice."""
    group = grid.get_data_parallel_group() if tp.size > 1 else None
    sixteen = sixteen_bit_type(ds)

    def partition(layer: torch.nn.Module) -> None:
        # The engine casts a module's parameters to the 16-bit type, but not those zero.Init partitioned, which it
        # takes for made in that type inside zero.Init's context; zero.Init(module=) partitions them as they are,
        # so they are cast first (the buffers stay, as the engine leaves them), or ZeRO-3 would compute in fp32.
        for param in layer.parameters():
            if sixteen is not None and param.is_floating_point():
                param.data = param.data.to(sixteen)
        deepspeed.zero.Init(module=layer, config_dict_or_path=ds, data_parallel_group=group,
                            mpu=grid if tp.size > 1 else None)
        # zero.Init(module=) places the parameters only, and the engine moves no partitioned module to the
        # device: the buffers (the Llama's RoPE tables) go there here.
        for buffer in layer.buffers():
            buffer.data = buffer.data.to(get_accelerator().current_device_name())
    return partition
