"""Run a model's layer list as one plain nn.Module (ZeRO 0-3, CPU offload, no pipeline).

Built layer by layer exactly as DeepSpeed's PipelineModule builds its stages (torch seeded with
`seed + layer index` before each layer), so the same seed gives the same weights in either build.
"""
import torch
import torch.nn as nn
from deepspeed.pipe import TiedLayerSpec
from deepspeed.runtime.zero import register_external_parameter


class LayerStack(nn.Module):
    def __init__(self, specs: list, seed: int):
        super().__init__()
        self.layers = nn.ModuleList()
        self._calls = []  # (index into self.layers, forward_fn or None), one per spec
        owner = {}  # tie key -> index of the layer that owns the shared weight
        for i, spec in enumerate(specs):
            tie_key = spec.key if isinstance(spec, TiedLayerSpec) else None
            if tie_key is not None and tie_key in owner:
                self._calls.append((owner[tie_key], spec.forward_fn))
                # ZeRO-3 gathers a module's weights only around its own forward; the reuse (the LM
                # head) reads them from outside it, so they are gathered for the whole stack instead.
                for attr in spec.tied_weight_attr:
                    register_external_parameter(self, getattr(self.layers[owner[tie_key]], attr))
                continue
            torch.manual_seed(seed + i)
            self.layers.append(spec.build())
            if tie_key is not None:
                owner[tie_key] = len(self.layers) - 1
            self._calls.append((len(self.layers) - 1, getattr(spec, "forward_fn", None)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, forward_fn in self._calls:
            layer = self.layers[index]
            x = layer(x) if forward_fn is None else forward_fn(layer, x)
        return x
