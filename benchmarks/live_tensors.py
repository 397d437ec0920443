"""The bytes of live tensor storages and their peak, counted as each operator makes them: on a CPU, what the CUDA
allocator's `memory_allocated` counts on a GPU (less its rounding). A CPU's resident set holds the heap and the
libraries too, and never shows a buffer allocated but not yet written; this counts storages alone, so the memory
plan can be checked against a step on the CPU (benchmarks/gpu_probes.py, memory_against_plan).

    with LiveTensors() as live:
        ...build and step an engine...
    live.peak, live.largest_at_peak()

Counted: every storage an operator returns while the mode is on (views and in-place results once), until Python
frees it. Not counted: tensors made before the mode, or outside torch's dispatcher (torch.from_numpy)."""
import collections
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveTensors(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.current = self.peak = 0
        self._live: dict[int, tuple] = {}  # data pointer: (weak reference, bytes, operator, shape)
        self._at_peak: list = []

    def reset_peak(self) -> None:
        self.peak, self._at_peak = self.current, []

    def bytes_of(self, data_ptr: int) -> int:
        """The bytes of the live storage at this address that the mode counts, 0 if none."""
        held = self._live.get(data_ptr)
        return held[1] if held is not None else 0

    def largest_at_peak(self, n: int = 12) -> list[tuple[int, str, tuple]]:
        """The storages live at the peak, summed by the operator and shape that made them, largest first."""
        summed = collections.Counter()
        for _, nbytes, op, shape in self._at_peak:
            summed[(op, shape)] += nbytes
        return [(nbytes, op, shape) for (op, shape), nbytes in summed.most_common(n)]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                self._track(tensor, func)
        return out

    def _track(self, tensor: torch.Tensor, func) -> None:
        storage = tensor.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        held = self._live.get(key)
        if nbytes == 0 or (held is not None and held[0]() is storage):
            return
        if held is not None:  # a freed storage whose address came back before its reference's callback ran
            self._free(key, held[0])
        ref = weakref.ref(storage, lambda dead, key=key: self._free(key, dead))
        self._live[key] = (ref, nbytes, str(func), tuple(tensor.shape))
        self.current += nbytes
        if self.current > self.peak:
            self.peak, self._at_peak = self.current, list(self._live.values())

    def _free(self, key: int, ref) -> None:
        held = self._live.get(key)
        if held is not None and held[0] is ref:
            del self._live[key]
            self.current -= held[1]
