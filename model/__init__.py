"""Models as layer lists, and the builders that turn a list into a trainable module."""
import torch.nn as nn

from model.config import ModelConfig
from model.gpt import gpt_layers
from model.stack import LayerStack

LAYER_LISTS = {"gpt": gpt_layers}


def model_layers(cfg: ModelConfig) -> list:
    if cfg.arch not in LAYER_LISTS:
        raise ValueError(f"unknown model.arch={cfg.arch!r}; choose one of {sorted(LAYER_LISTS)}")
    return LAYER_LISTS[cfg.arch](cfg)


def build_model(cfg: ModelConfig, seed: int = 0) -> nn.Module:
    return LayerStack(model_layers(cfg), seed)
