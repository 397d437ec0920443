"""Several LoRA adapters over one frozen model, each sequence of a batch through its own or through none (vLLM's
multi-LoRA serving, S-LoRA's batching, on whole rows): a server holds one copy of the model and any number of
fine-tunes of it, a few megabytes each.

The model has no code for this. Forward hooks on the adapted linear maps add each row's (x A^T) B^T, alpha / r
folded into B, to the map's output: a batch of one adapter through its two matmuls, a batch of several through one
batched pair over the rows' adapters stacked in their order (zeros for a row without one, kept while the same rows
decode together). Rows of the base model keep the map's output as it is, bit for bit, and rows of an adapter
compute what its weights merged in would, to rounding. model/lora.py's LoRALinear trains one adapter inside the map (tensor-parallel splits, dropout); this
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
            return output if stacked is None else output + (x @ stacked[0]) @ stacked[1]
        return add_adapters

    def _stacked(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(A^T, B^T) of each row's adapter on the map, (rows, in, r) and (rows, r, out), zeros for a row without
        one (its output untouched) and past an adapter's rank: one batched pair of matmuls for the whole batch.
        Made once for the rows' adapters in their order and kept while they decode together (a copy of their
        weights: rows x an adapter's), made again when a sequence joins or leaves."""
        key = tuple(0 if adapter is None else adapter.serial for adapter in self.rows)
        if key != self.stacked_for:
            self.stacks, self.stacked_for = {}, key
        if name not in self.stacks:
            pairs = [None if adapter is None else adapter.maps.get(name) for adapter in self.rows]
            ranks = [a.size(0) for a, _ in filter(None, pairs)]
            if not ranks:
                self.stacks[name] = None
            else:
                out, inner = self.linears[name].out_features, self.linears[name].in_features
                like = next(p for p in pairs if p is not None)[0]
                a_t = like.new_zeros(len(pairs), inner, max(ranks))
                b_t = like.new_zeros(len(pairs), max(ranks), out)
                for row, pair in enumerate(pairs):
                    if pair is not None:
                        a_t[row, :, :pair[0].size(0)] = pair[0].T
                        b_t[row, :pair[1].size(1)] = pair[1].T
                self.stacks[name] = (a_t, b_t)
        return self.stacks[name]
