"""Turn a model's layer list into a trainable module: a plain LayerStack (ZeRO 0-3, CPU offload) or a
DeepSpeed PipelineModule (pipeline stages x data parallel, ZeRO 0-1).

Both builds seed torch with `seed + layer index` before building each layer and checkpoint
activations the same way (every `interval` layers, transformer blocks only, recomputed in full or selectively:
model/recompute.py), so a seed gives the same weights and the same losses whatever the layout.
"""
import torch
import torch.nn as nn
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.zero import register_external_parameter

from model.recompute import checkpoint_function


def seed_layer(seed) -> None:
    # int(): PipelineModule can hand over a numpy integer, which torch.manual_seed rejects.
    torch.manual_seed(int(seed))


def layer_names(specs: list) -> list[str]:
    """Each layer's parameter-name prefix, as both builds name it: "<layer index>", or "tied_modules.<key>"
    for a tied layer, wherever it recurs."""
    return [f"tied_modules.{spec.key}" if isinstance(spec, TiedLayerSpec) else str(i) for i, spec in enumerate(specs)]


class _BuiltThen:
    """A LayerSpec whose build() passes the new layer through its steps in order, each `step(layer) -> layer`:
    tensor parallelism's split (model/parallelize.py), then LoRA's adapters (model/lora.py). PipelineModule builds
    each stage's layers itself, so the steps travel with the specs."""
    def build(self, log=False) -> nn.Module:
        layer = super().build(log)
        for step in self.steps:
            layer = step(layer)
        return layer


class _LayerSpecThen(_BuiltThen, LayerSpec):
    pass


class _TiedLayerSpecThen(_BuiltThen, TiedLayerSpec):
    pass


def built_then(spec: LayerSpec, step) -> LayerSpec:
    """`spec`, its layer passed through `step` once built, after the steps it has: the same layer class,
    arguments and tie."""
    if not isinstance(spec, _BuiltThen):
        if isinstance(spec, TiedLayerSpec):
            spec = _TiedLayerSpecThen(spec.key, spec.typename, *spec.module_args, forward_fn=spec.forward_fn,
                                      tied_weight_attr=spec.tied_weight_attr, **spec.module_kwargs)
        else:
            spec = _LayerSpecThen(spec.typename, *spec.module_args, **spec.module_kwargs)
        spec.steps = ()
    spec.steps = (*spec.steps, step)
    return spec


class LayerStack(nn.Module):
    """The layer list run in order as one module. Parameters are named as PipelineModule names them
    ("<layer index>.<name>", tied layers "tied_modules.<key>.<name>"), so a checkpoint taken under
    one build can be resumed or exported under the other."""

    def __init__(self, specs: list, seed: int, checkpoint_interval: int = 0, checkpointable: tuple = (),
                 partition=None, recompute: str = "full"):
        """checkpointable: the layer classes activation checkpointing may wrap. partition(layer), if given, is
        called on each new layer as soon as it is built (ZeRO-3's)."""
        super().__init__()
        self.checkpoint_interval = checkpoint_interval
        self.checkpoint = checkpoint_function(recompute)
        self.checkpointable = set(checkpointable)
        self.tied_modules = nn.ModuleDict()
        self._calls = []  # (layer, forward_fn or None), one per spec, in order
        for i, spec in enumerate(specs):
            if isinstance(spec, TiedLayerSpec) and spec.key in self.tied_modules:
                layer = self.tied_modules[spec.key]
                # ZeRO-3 gathers a module's weights only around its own forward; the reuse (the LM
                # head) reads them from outside it, so they are gathered for the whole stack instead.
                for attr in spec.tied_weight_attr:
                    register_external_parameter(self, getattr(layer, attr))
            else:
                seed_layer(seed + i)
                layer = spec.build()
                if partition is not None:
                    partition(layer)
                if isinstance(spec, TiedLayerSpec):
                    self.tied_modules[spec.key] = layer
                else:
                    self.add_module(str(i), layer)
            self._calls.append((layer, getattr(spec, "forward_fn", None)))

    @staticmethod
    def _run(calls: list, x):
        """x: a tensor, or (tensor, positions) under document masking, passed from layer to layer as is."""
        for layer, forward_fn in calls:
            x = layer(x) if forward_fn is None else forward_fn(layer, x)
        return x

    def _is_checkpointable(self, calls: list) -> bool:
        return all(fn is None and type(layer) in self.checkpointable for layer, fn in calls)

    def forward(self, x, last_position: bool = False) -> torch.Tensor:
        """last_position: only the last position goes on past the last transformer block (the layers after it,
        the final norm and the head, work per position): the logits of generation's next token, at a prompt's
        prefill without a head over every position."""
        if last_position:
            blocks = [i for i, (layer, _) in enumerate(self._calls) if type(layer) in self.checkpointable]
            x = self._run(self._calls[:blocks[-1] + 1], x)
            x = tuple(part[:, -1:] for part in x) if isinstance(x, tuple) else x[:, -1:]
            return self._run(self._calls[blocks[-1] + 1:], x)
        if not (self.checkpoint_interval and torch.is_grad_enabled()):
            return self._run(self._calls, x)
        for start in range(0, len(self._calls), self.checkpoint_interval):
            calls = self._calls[start: start + self.checkpoint_interval]
            if self._is_checkpointable(calls):
                # As PipelineModule calls its checkpoint: tensors as arguments, so a (hidden, positions) tuple
                # goes in spread and comes back whole.
                def chunk(*h, calls=calls):
                    return self._run(calls, h if len(h) > 1 else h[0])
                x = self.checkpoint(chunk, *(x if isinstance(x, tuple) else (x,)))
            else:
                x = self._run(calls, x)
        return x


def pipeline_module(specs: list, seed: int, topology, partition: str, loss_fn, checkpoint_interval: int = 0,
                    checkpointable: tuple = (), recompute: str = "full") -> PipelineModule:
    return PipelineModule(layers=specs, topology=topology, loss_fn=loss_fn, partition_method=partition,
                          activation_checkpoint_interval=checkpoint_interval,
                          activation_checkpoint_func=checkpoint_function(recompute),
                          checkpointable_layers=[c.__name__ for c in checkpointable], seed_layers=True, base_seed=seed,
                          seed_fn=seed_layer)
