"""Models as layer lists, and the two builds of a list: a plain module or a pipeline; their blocks compiled, and
what runs beside them eager."""
import functools
import sys

import torch
import torch.nn as nn

from model.architecture import Architecture
from model.config import ModelConfig
from model.lora import linear_maps, with_adapters
from model.moe import NO_EXPERT_PARALLEL, ExpertParallel, expert_parallel
from model.parallelize import check_tensor_parallel, parallelize
from model.recompute import recompute_selectively
from model.registry import ARCHITECTURES, architecture
from model.sequence_parallel import NO_SEQUENCE_PARALLEL, SequenceParallel, sequence_parallel
from model.stack import LayerStack, layer_names, pipeline_module
from model.tensor_parallel import SINGLE, TensorParallel

__all__ = ["ARCHITECTURES", "Architecture", "ExpertParallel", "architecture", "build_empty", "build_model",
           "build_pipeline", "compile_blocks", "eager", "layer_names", "model_layers"]


def model_layers(cfg: ModelConfig, tp: TensorParallel = SINGLE, ep: ExpertParallel = NO_EXPERT_PARALLEL) -> list:
    """The architecture's layer list, each layer splitting itself over `tp` as it is built, its experts this
    rank's of `ep`, its adapters added (model.lora_rank)."""
    check_tensor_parallel(cfg, tp.size)
    arch = architecture(cfg)
    specs = parallelize(expert_parallel(arch.layers(cfg), ep), arch.plan, tp, arch.block)
    return with_adapters(specs, cfg, linear_maps(arch.plan, arch.block))


def build_model(cfg: ModelConfig, seed: int = 0, checkpoint_interval: int = 0, partition=None,
                tp: TensorParallel = SINGLE, sp: SequenceParallel = NO_SEQUENCE_PARALLEL,
                ep: ExpertParallel = NO_EXPERT_PARALLEL, recompute: str = "full") -> nn.Module:
    """recompute: how the blocks checkpointed every `checkpoint_interval` recompute (model/recompute.py)."""
    stack = LayerStack(model_layers(cfg, tp, ep), seed, checkpoint_interval, (architecture(cfg).block,), partition,
                       recompute)
    return sequence_parallel(stack, sp, cfg.document_masking)


def build_empty(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The plain model of `cfg` on the CPU for a checkpoint's weights to be copied into: its parameters allocated at
    `dtype`, their values undrawn, its buffers computed (each module's init_buffers). Laid out on the meta device,
    where nothing is drawn: drawing a Hub model's 8B parameters only to overwrite them took minutes, at 4 bytes a
    parameter."""
    with torch.device("meta"):
        model = build_model(cfg)
    model = model.to(dtype).to_empty(device="cpu")
    for module in model.modules():
        if hasattr(module, "init_buffers"):
            module.init_buffers()
    return model


def build_pipeline(cfg: ModelConfig, seed: int, topology, partition: str, loss_fn, checkpoint_interval: int = 0,
                   tp: TensorParallel = SINGLE, sp: SequenceParallel = NO_SEQUENCE_PARALLEL,
                   ep: ExpertParallel = NO_EXPERT_PARALLEL, recompute: str = "full") -> nn.Module:
    """topology: DeepSpeed's PipeModelDataParallelTopology of the run (stages x data x tensor)."""
    module = pipeline_module(model_layers(cfg, tp, ep), seed, topology, partition, loss_fn, checkpoint_interval,
                             (architecture(cfg).block,), recompute)
    return sequence_parallel(module, sp, cfg.document_masking)


def compile_blocks(model: nn.Module, arch: str | Architecture, selective: bool = False) -> int:
    """torch.compile each transformer block in place (torchtitan's way): the blocks share their code, so
    one graph is compiled and reused by all, in far less time than the whole model as one graph, and what
    wraps the blocks (DeepSpeed's engine, full activation checkpointing) stays eager. `selective`: each block
    recomputed selectively inside its graph (model/recompute.py). Returns the blocks compiled.
    arch: the Architecture, or its model.arch name."""
    block = (ARCHITECTURES[arch] if isinstance(arch, str) else arch).block
    blocks = [m for m in model.modules() if type(m) is block]
    for block in blocks:
        if selective:
            recompute_selectively(block)
        block.compile()
    return len(blocks)


def eager(fn):
    """fn with torch.compile's graphs set aside (torch.compiler.set_stance("force_eager")): what sees batches of
    changing shapes, where a graph per shape would never pay. Entered at each call, not as set_stance's own
    decorator, which imports dynamo with the module (2 seconds of every process's start); where dynamo was never
    imported, nothing was compiled."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)
        with torch.compiler.set_stance("force_eager"):
            return fn(*args, **kwargs)
    return run

