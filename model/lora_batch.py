"""Several LoRA adapters over one frozen model, each sequence of a batch through its own or through none (vLLM's
multi-LoRA serving, S-LoRA's batching, on whole rows): a server holds one copy of the model and any number of
fine-tunes of it, a few megabytes each.

The model has no code for this. Forward hooks on the adapted linear maps add each row's (x A^T) B^T, alpha / r
folded into B, to the map's output: a batch of one adapter through its two matmuls, a batch of several through one
pair over all of the batch's adapters side by side, each row masked to its own adapter's columns (kept while the
batch holds the same adapters). Rows of the base model keep the map's output as it is, bit for bit, and rows of an
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
        # Per map, the batch's adapters side by side (_stacked), kept while the batch holds the same adapters, and
        # each row's columns among them, kept while its rows hold the same adapters in the same order.
        self.stacks: dict[str, tuple | None] = {}
        self.masks: dict[str, torch.Tensor] = {}
        self.stacked_for, self.masked_for = (), ()
        self.adapters: list[Adapter] = []  # a mixed batch's adapters, by serial
        self.keys: tuple = ((), ())  # their serials, and each row's (0: none)
        self.mixed = False  # whether the pass's rows run through more than one adapter (or none)

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
        self.mixed = bool(self.rows) and any(adapter is not rows[0] for adapter in rows)
        if self.mixed:  # the stacks' keys, once a pass
            self.adapters = sorted({a for a in rows if a is not None}, key=lambda a: a.serial)
            self.keys = tuple(a.serial for a in self.adapters), tuple(0 if a is None else a.serial for a in rows)
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
            if not self.mixed:  # one adapter, every row: its two matmuls
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
        one (its output untouched). The stacks (a copy of each adapter's weights, however many rows share it) are
        made again only when an adapter joins or leaves the batch; the masks whenever its rows change."""
        held, rows = self.keys
        if held != self.stacked_for:
            self.stacks, self.masks, self.stacked_for = {}, {}, held
        if rows != self.masked_for:
            self.masks, self.masked_for = {}, rows
        if name not in self.stacks:
            self.stacks[name] = _side_by_side([a for a in self.adapters if name in a.maps], name)
        if self.stacks[name] is None:
            return None
        a_t, b_t, columns = self.stacks[name]
        if name not in self.masks:
            mask = a_t.new_zeros(len(self.rows), 1, a_t.size(1))
            for row, adapter in enumerate(self.rows):
                if adapter in columns:
                    mask[row, 0, columns[adapter]] = 1
            self.masks[name] = mask
        return a_t, b_t, self.masks[name]


def _side_by_side(adapters: list[Adapter], name: str) -> tuple | None:
    """(A^T (in, R), B^T (R, out), each adapter's columns among the R) of the adapters' pairs on the map."""
    if not adapters:
        return None
    a_t = torch.cat([adapter.maps[name][0] for adapter in adapters]).T.contiguous()
    b_t = torch.cat([adapter.maps[name][1] for adapter in adapters], dim=1).T.contiguous()
    ends = list(itertools.accumulate(adapter.maps[name][0].size(0) for adapter in adapters))
    return a_t, b_t, {adapter: slice(end - adapter.maps[name][0].size(0), end) for adapter, end in zip(adapters, ends)}
