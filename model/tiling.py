"""The MLP in tiles along the sequence (DeepSpeed's TiledMLP, from its Arctic long-sequence training): the forward
runs a tile of tokens at a time and keeps only the MLP's input; the backward computes each tile again, with its
gradients. A block then keeps d values a token for its MLP instead of 4 x ffn (GPT) or 8 x ffn (SwiGLU): for
long windows, beside sequence parallelism (train.mlp_tiles). Not with dropout: the recomputation would draw
other masks."""
import functools

import torch
import torch.nn as nn
from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

from common.checks import ConfigError
from model.config import ModelConfig
from model.layers import MLP, SwiGLU
from model.registry import architecture, supporting


def check_tiles(cfg: ModelConfig, tiles: int) -> None:
    if tiles == 1:
        return
    arch = architecture(cfg)
    if not arch.supports("mlp_tiling"):
        raise ConfigError(f"train.mlp_tiles={tiles} needs {supporting('mlp_tiling')}: "
                          f"{arch.unsupported['mlp_tiling']}; set train.mlp_tiles=1")
    if cfg.dropout > 0:
        raise ConfigError(f"train.mlp_tiles={tiles} computes the MLP again in its backward, which would draw other "
                          f"dropout masks than its forward: set model.dropout=0 or train.mlp_tiles=1")


def tile_mlps(model: nn.Module, tiles: int) -> nn.Module:
    """The built model (or stage) with each MLP computed in `tiles` tiles while gradients are on; returns it.
    The forward is swapped on each instance: parameter names and ZeRO-3's hooks stay the module's."""
    if tiles > 1:
        for module in model.modules():
            if isinstance(module, (MLP, SwiGLU)):
                module.forward = functools.partial(_tiled, module, type(module).forward, tiles)
    return model


def _tiled(module: nn.Module, forward, tiles: int, x: torch.Tensor) -> torch.Tensor:
    if not torch.is_grad_enabled():
        return forward(module, x)
    return TiledMLP.apply(forward, module, x, tiles, list(module.parameters()))
