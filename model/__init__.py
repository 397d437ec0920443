"""Models as layer lists, and the two builds of a list: a plain module or a pipeline."""
import torch.nn as nn

from model.config import ModelConfig
from model.encoder import encoder_layers
from model.gpt import gpt_layers
from model.llama import llama_layers
from model.stack import LayerStack, pipeline_module

LAYER_LISTS = {"gpt": gpt_layers, "llama": llama_layers, "encoder": encoder_layers}
# The layer class of each model's transformer blocks: every pipeline stage must hold one, and
# activation checkpointing wraps only these (never the embedding: its input needs no grad).
BLOCK_CLASS = {"gpt": "Block", "llama": "LlamaBlock", "encoder": "CausalEncoderLayer"}


def model_layers(cfg: ModelConfig) -> list:
    if cfg.arch not in LAYER_LISTS:
        raise ValueError(f"unknown model.arch={cfg.arch!r}; choose one of {sorted(LAYER_LISTS)}")
    return LAYER_LISTS[cfg.arch](cfg)


def build_model(cfg: ModelConfig, seed: int = 0, checkpoint_interval: int = 0, place=None) -> nn.Module:
    return LayerStack(model_layers(cfg), seed, checkpoint_interval, (BLOCK_CLASS[cfg.arch],), place)


def build_pipeline(cfg: ModelConfig, seed: int, stages: int, partition: str, loss_fn,
                   checkpoint_interval: int = 0) -> nn.Module:
    return pipeline_module(model_layers(cfg), seed, stages, partition, loss_fn, checkpoint_interval,
                           (BLOCK_CLASS[cfg.arch],))


def compile_blocks(model: nn.Module, arch: str) -> int:
    """torch.compile each transformer block in place (torchtitan's way): the blocks share their code, so
    one graph is compiled and reused by all, in far less time than the whole model as one graph, and what
    wraps the blocks (DeepSpeed's engine, activation checkpointing) stays eager. Returns the blocks compiled."""
    blocks = [m for m in model.modules() if type(m).__name__ == BLOCK_CLASS[arch]]
    for block in blocks:
        block.compile()
    return len(blocks)
