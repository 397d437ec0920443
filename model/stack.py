"""Turn a model's layer list into a trainable module: a plain LayerStack (ZeRO 0-3, CPU offload) or a
DeepSpeed PipelineModule (pipeline stages x data parallel, ZeRO 0-1).

Both builds seed torch with `seed + layer index` before building each layer and checkpoint
activations the same way (every `interval` layers, transformer blocks only), so a seed gives the same
weights and the same losses whatever the layout.
"""
import torch
import torch.nn as nn
from deepspeed.runtime.activation_checkpointing.checkpointing import checkpoint
from deepspeed.pipe import PipelineModule, TiedLayerSpec
from deepspeed.runtime.zero import register_external_parameter


def seed_layer(seed) -> None:
    # int(): PipelineModule can hand over a numpy integer, which torch.manual_seed rejects.
    torch.manual_seed(int(seed))


class LayerStack(nn.Module):
    def __init__(self, specs: list, seed: int, checkpoint_interval: int = 0, checkpointable: tuple = ()):
        super().__init__()
        self.checkpoint_interval = checkpoint_interval
        self.checkpointable = set(checkpointable)
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
            seed_layer(seed + i)
            self.layers.append(spec.build())
            if tie_key is not None:
                owner[tie_key] = len(self.layers) - 1
            self._calls.append((len(self.layers) - 1, getattr(spec, "forward_fn", None)))

    def _run(self, calls: list, x: torch.Tensor) -> torch.Tensor:
        for index, forward_fn in calls:
            layer = self.layers[index]
            x = layer(x) if forward_fn is None else forward_fn(layer, x)
        return x

    def _is_checkpointable(self, calls: list) -> bool:
        return all(fn is None and type(self.layers[i]).__name__ in self.checkpointable for i, fn in calls)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.checkpoint_interval and torch.is_grad_enabled()):
            return self._run(self._calls, x)
        for start in range(0, len(self._calls), self.checkpoint_interval):
            calls = self._calls[start: start + self.checkpoint_interval]
            if self._is_checkpointable(calls):
                # DeepSpeed's checkpoint, as PipelineModule uses: recomputes the chunk in backward.
                x = checkpoint(lambda h, calls=calls: self._run(calls, h), x)
            else:
                x = self._run(calls, x)
        return x


def pipeline_module(specs: list, seed: int, stages: int, partition: str, loss_fn, checkpoint_interval: int = 0,
                    checkpointable: tuple = ()) -> PipelineModule:
    return PipelineModule(layers=specs, num_stages=stages, loss_fn=loss_fn, partition_method=partition,
                          activation_checkpoint_interval=checkpoint_interval,
                          checkpointable_layers=list(checkpointable), seed_layers=True, base_seed=seed,
                          seed_fn=seed_layer)
