"""What the CUDA caching allocator counted at its peak, read from its own trace (torch.cuda.memory's
_record_memory_history): the allocations made since the trace began that were counted at the peak, summed by the
stream that made them, whether Python had freed them already (a block freed while another stream may still use it,
record_stream's promise, stays counted until that stream's work is done), and the innermost frame outside torch that
allocated them. Where the allocator's peak runs over the live tensors' (benchmarks/live_tensors.py), this says where
the difference sits.

    start()
    ...steps...
    at_peak(stop())
"""
import collections

import torch

ENTRIES = 500_000  # the trace is a ring: a few steps of a 124M model make tens of thousands of events


def start() -> None:
    torch.cuda.memory._record_memory_history(max_entries=ENTRIES, stacks="python")


def stop() -> list[dict]:
    trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    torch.cuda.memory._record_memory_history(enabled=None)
    return trace


# the probe's own dispatch mode, on the stack of every allocation made under it
INSTRUMENTS = ("benchmarks/live_tensors.py",)


def origin(frames: list[dict]) -> str:
    """The innermost frame of the code that asked for the memory (this repo's, DeepSpeed's), not torch's own nor the
    probe's."""
    for frame in frames:
        filename = frame.get("filename", "")
        if "/torch/" not in filename and not filename.endswith(INSTRUMENTS):
            return f"{frame['filename'].rsplit('site-packages/', 1)[-1]}:{frame['line']} {frame['name']}"
    return "?"


def at_peak(trace: list[dict], n: int = 8) -> dict:
    """The peak of the bytes allocated after the trace began, and the n largest groups counted at it:
    [bytes, stream, where, "live" or "freed, awaiting its stream"]."""
    live: dict[int, list] = {}  # address: [bytes, stream, where, freed by Python]
    current = peak = 0
    counted: list[list] = []
    for event in trace:
        action, address = event["action"], event.get("addr")
        if action == "alloc":
            live[address] = [event["size"], event["stream"], origin(event.get("frames", [])), False]
            current += event["size"]
            if current > peak:
                peak, counted = current, [list(held) for held in live.values()]
        elif action == "free_requested" and address in live:
            live[address][3] = True
        elif action == "free_completed" and address in live:
            current -= live.pop(address)[0]
    summed = collections.Counter()
    for nbytes, stream, where, freed in counted:
        summed[(stream, where, freed)] += nbytes
    return {"peak": peak, "largest": [[nbytes, stream, where, "freed, awaiting its stream" if freed else "live"]
                                      for (stream, where, freed), nbytes in summed.most_common(n)]}
