"""Several LoRA adapters over one frozen model, each sequence of a batch through its own or through none (vLLM's
multi-LoRA serving, S-LoRA's batching, on whole rows): a server holds one copy of the model and any number of
fine-tunes of it, a few megabytes each.

The model has no code for this. Forward hooks on the adapted linear maps add each row's (x A^T) B^T, alpha / r
folded into B, to the map's output, one pair of matmuls for each adapter in the batch: rows of the base model keep
the map's output as it is, bit for bit, and rows of an adapter compute what its weights merged in would, to
rounding. model/lora.py's LoRALinear trains one adapter inside the map (tensor-parallel splits, dropout); this
serves many beside a plain module's maps, packed ones too (model/onednn.py), and adds nothing to a step whose
rows all run the base model.
"""
import itertools
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(eq=False)
class Adapter:
    """One fine-tune: for each linear map it adapts (the module's name in the model), A (r, in) and B (out, r)
    times its scale."""
    name: str
    maps: dict[str, tuple[torch.Tensor, torch.Tensor]]
    source: str = ""  # where it was read
    serial: int = field(default_factory=itertools.count(1).__next__)  # never reused, unlike a name


class BatchAdapters:
    def __init__(self, model: nn.Module):
        self.model = model
        self.linears = {name: m for name, m in model.named_modules() if type(m) is nn.Linear}
        self.hooked: set[str] = set()
        self.rows: list[Adapter | None] | None = None  # the pass under way's adapter of each row, None: none

    def shapes(self) -> dict[str, tuple[int, int]]:
        """(out, in) of each linear map an adapter may adapt, by its module name."""
        return {name: (m.out_features, m.in_features) for name, m in self.linears.items()}

    def prepare(self, adapter: Adapter) -> Adapter:
        """The adapter on the model's device and dtype, its maps hooked (an adapter checked against `shapes`)."""
        first = next(self.model.parameters())
        adapter.maps = {name: (a.to(first.device, first.dtype), b.to(first.device, first.dtype))
                        for name, (a, b) in adapter.maps.items()}
        for name in adapter.maps.keys() - self.hooked:
            self.linears[name].register_forward_hook(self._hook(name))
            self.hooked.add(name)
        return adapter

    @contextmanager
    def selected(self, rows: list[Adapter | None]):
        """The model's forward passes inside run row i through rows[i]."""
        self.rows = rows if any(rows) else None
        try:
            yield
        finally:
            self.rows = None

    def _hook(self, name: str):
        def add_adapters(module, args, output):
            if self.rows is None:
                return output
            x = args[0]
            for adapter, rows in _by_adapter(self.rows, x.size(0), x.device):
                if name not in adapter.maps:
                    continue
                a, b = adapter.maps[name]
                if rows is None:  # every row: no gathering
                    output = output + (x @ a.T) @ b.T
                else:
                    output = output.index_add(0, rows, (x[rows] @ a.T) @ b.T)
            return output
        return add_adapters


def _by_adapter(rows: list[Adapter | None], batch: int, device) -> list[tuple[Adapter, torch.Tensor | None]]:
    """Each adapter of the batch with the indices of its rows (None: all of them)."""
    if len(rows) != batch:
        raise ValueError(f"{len(rows)} rows' adapters selected for a batch of {batch}")
    groups: dict[Adapter, list[int]] = {}
    for i, adapter in enumerate(rows):
        if adapter is not None:
            groups.setdefault(adapter, []).append(i)
    return [(adapter, None if len(index) == batch else torch.tensor(index, device=device))
            for adapter, index in groups.items()]
