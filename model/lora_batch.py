"""Several LoRA adapters over one frozen model, each sequence of a batch through its own or through none (vLLM's
multi-LoRA serving, S-LoRA's batching, on whole rows): a server holds one copy of the model and any number of
fine-tunes of it, a few megabytes each.

The model has no code for this. Forward hooks on the adapted linear maps add each row's (x A^T) B^T, alpha / r
folded into B, to the map's output: a batch of one adapter through its two matmuls, a batch of several through one
pair over all of the batch's adapters side by side, each row masked to its own adapter's columns (kept while the
same rows decode together). Rows of the base model keep the map's output as it is, bit for bit, and rows of an
adapter compute what its weights merged in would, to rounding. model/lora.py's LoRALinear trains one adapter inside
the map (tensor-parallel splits, dropout); this serves many beside a plain module's maps, packed ones too
(model/onednn.py), and adds nothing to a step whose rows all run the base model.
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
        self.stacks: dict[str, tuple | None] = {}  # each map's adapters of the rows' order, stacked (_stacked)
        self.stacked_for: tuple = ()

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
            x, first = args[0], self.rows[0]
            if len(self.rows) != x.size(0):
                raise ValueError(f"{len(self.rows)} rows' adapters selected for a batch of {x.size(0)}")
            if all(adapter is first for adapter in self.rows):  # one adapter, every row: its two matmuls
                if name not in first.maps:
                    return output
                a, b = first.maps[name]
                return output + (x @ a.T) @ b.T
            stacked = self._stacked(name)
            if stacked is None:
                return output
            a_t, b_t, mask = stacked
            return output + ((x @ a_t) * mask) @ b_t
        return add_adapters

    def _stacked(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(A^T, B^T, mask) of the batch's adapters on the map: their A^T side by side (in, R), their B^T one above
        the other (R, out), and for each row the columns of its own adapter (rows, 1, R), none for a row without
        one (its output untouched). Made once for the rows' adapters in their order, kept while they decode
        together (a copy of each adapter's weights, however many rows share it)."""
        key = tuple(0 if adapter is None else adapter.serial for adapter in self.rows)
        if key != self.stacked_for:
            self.stacks, self.stacked_for = {}, key
        if name not in self.stacks:
            adapters = list(dict.fromkeys(a for a in self.rows if a is not None and name in a.maps))
            if not adapters:
                self.stacks[name] = None
            else:
                a_t = torch.cat([adapter.maps[name][0] for adapter in adapters]).T.contiguous()
                b_t = torch.cat([adapter.maps[name][1] for adapter in adapters], dim=1).T.contiguous()
                starts = dict(zip(adapters, itertools.accumulate([0] + [a.maps[name][0].size(0) for a in adapters])))
                mask = a_t.new_zeros(len(self.rows), 1, a_t.size(1))
                for row, adapter in enumerate(self.rows):
                    if adapter in starts:
                        mask[row, 0, starts[adapter]:starts[adapter] + adapter.maps[name][0].size(0)] = 1
                self.stacks[name] = (a_t, b_t, mask)
        return self.stacks[name]
