"""Models as layer lists, and the two builds of a list: a plain module or a pipeline."""
import torch.nn as nn

from model.config import ModelConfig
from model.encoder import encoder_layers
from model.gpt import gpt_layers
from model.llama import llama_layers
from model.parallelize import check_tensor_parallel, parallelize
from model.sequence_parallel import NO_SEQUENCE_PARALLEL, SequenceParallel, sequence_parallel
from model.stack import LayerStack, layer_names, pipeline_module
from model.tensor_parallel import SINGLE, TensorParallel

LAYER_LISTS = {"gpt": gpt_layers, "llama": llama_layers, "encoder": encoder_layers}
# The layer class of each model's transformer blocks: every pipeline stage must hold one, and
# activation checkpointing wraps only these (never the embedding: its input needs no grad).
BLOCK_CLASS = {"gpt": "Block", "llama": "LlamaBlock", "encoder": "CausalEncoderLayer"}

__all__ = ["BLOCK_CLASS", "build_model", "build_pipeline", "compile_blocks", "layer_names", "model_layers"]


def model_layers(cfg: ModelConfig, tp: TensorParallel = SINGLE) -> list:
    """The architecture's layer list, each layer splitting itself over `tp` as it is built."""
    check_tensor_parallel(cfg, tp.size)
    return parallelize(LAYER_LISTS[cfg.arch](cfg), cfg.arch, tp)


def build_model(cfg: ModelConfig, seed: int = 0, checkpoint_interval: int = 0, place=None,
                tp: TensorParallel = SINGLE, sp: SequenceParallel = NO_SEQUENCE_PARALLEL) -> nn.Module:
    stack = LayerStack(model_layers(cfg, tp), seed, checkpoint_interval, (BLOCK_CLASS[cfg.arch],), place)
    return sequence_parallel(stack, sp, cfg.document_masking)


def build_pipeline(cfg: ModelConfig, seed: int, topology, partition: str, loss_fn, checkpoint_interval: int = 0,
                   tp: TensorParallel = SINGLE, sp: SequenceParallel = NO_SEQUENCE_PARALLEL) -> nn.Module:
    """topology: DeepSpeed's PipeModelDataParallelTopology of the run (stages x data x tensor)."""
    module = pipeline_module(model_layers(cfg, tp), seed, topology, partition, loss_fn, checkpoint_interval,
                             (BLOCK_CLASS[cfg.arch],))
    return sequence_parallel(module, sp, cfg.document_masking)


def compile_blocks(model: nn.Module, arch: str) -> int:
    """torch.compile each transformer block in place (torchtitan's way): the blocks share their code, so
    one graph is compiled and reused by all, in far less time than the whole model as one graph, and what
    wraps the blocks (DeepSpeed's engine, activation checkpointing) stays eager. Returns the blocks compiled."""
    blocks = [m for m in model.modules() if type(m).__name__ == BLOCK_CLASS[arch]]
    for block in blocks:
        block.compile()
    return len(blocks)
