"""Models as layer lists, and the two builds of a list: a plain module or a pipeline."""
import torch.nn as nn

from model.config import ModelConfig
from model.encoder import encoder_layers
from model.gpt import gpt_layers
from model.llama import llama_layers
from model.tensor_parallel import SINGLE, TensorParallel
from model.stack import LayerStack, pipeline_module

LAYER_LISTS = {"gpt": gpt_layers, "llama": llama_layers, "encoder": encoder_layers}
# The layer class of each model's transformer blocks: every pipeline stage must hold one, and
# activation checkpointing wraps only these (never the embedding: its input needs no grad).
BLOCK_CLASS = {"gpt": "Block", "llama": "LlamaBlock", "encoder": "CausalEncoderLayer"}


def model_layers(cfg: ModelConfig, tp: TensorParallel = SINGLE) -> list:
    if cfg.arch not in LAYER_LISTS:
        raise ValueError(f"unknown model.arch={cfg.arch!r}; choose one of {sorted(LAYER_LISTS)}")
    check_tensor_parallel(cfg, tp.size)
    return LAYER_LISTS[cfg.arch](cfg, tp)


def check_tensor_parallel(cfg: ModelConfig, size: int) -> None:
    """What a tensor-parallel degree must divide: each rank holds whole heads (whole groups of query heads
    under grouped-query attention), an equal share of the MLP's features and of the padded vocabulary."""
    if size == 1:
        return
    shares = {"model.n_head": cfg.n_head, "the padded vocabulary (model.vocab_size rounded up to model."
              "vocab_multiple)": cfg.padded_vocab_size, "the MLP width (model.ffn_hidden)": cfg.mlp_hidden}
    if cfg.arch == "llama":
        shares["the key/value heads (model.n_kv_head)"] = cfg.kv_heads
    for what, count in shares.items():
        if count % size:
            raise ValueError(f"tensor_model_parallel_size={size} does not divide {what} = {count}: every tensor-"
                             f"parallel rank holds an equal share. Choose a degree that divides it")


def build_model(cfg: ModelConfig, seed: int = 0, checkpoint_interval: int = 0, place=None,
                tp: TensorParallel = SINGLE) -> nn.Module:
    return LayerStack(model_layers(cfg, tp), seed, checkpoint_interval, (BLOCK_CLASS[cfg.arch],), place)


def build_pipeline(cfg: ModelConfig, seed: int, topology, partition: str, loss_fn, checkpoint_interval: int = 0,
                   tp: TensorParallel = SINGLE) -> nn.Module:
    """topology: DeepSpeed's PipeModelDataParallelTopology of the run (stages x data x tensor)."""
    return pipeline_module(model_layers(cfg, tp), seed, topology, partition, loss_fn, checkpoint_interval,
                           (BLOCK_CLASS[cfg.arch],))


def compile_blocks(model: nn.Module, arch: str) -> int:
    """torch.compile each transformer block in place (torchtitan's way): the blocks share their code, so
    one graph is compiled and reused by all, in far less time than the whole model as one graph, and what
    wraps the blocks (DeepSpeed's engine, activation checkpointing) stays eager. Returns the blocks compiled."""
    blocks = [m for m in model.modules() if type(m).__name__ == BLOCK_CLASS[arch]]
    for block in blocks:
        block.compile()
    return len(blocks)
