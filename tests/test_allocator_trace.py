"""benchmarks/allocator_trace.py's reading of a CUDA allocator trace, on a trace written by hand in torch's format
(torch.cuda.memory._snapshot()["device_traces"]): on a GPU the memory probe reads the real one."""
from benchmarks.allocator_trace import at_peak

SITE = "/venv/lib/python3.12/site-packages/"
TORCH = {"filename": SITE + "torch/nn/functional.py", "line": 3, "name": "linear"}
GATHER = {"filename": SITE + "deepspeed/runtime/zero/partition_parameters.py", "line": 10, "name": "all_gather"}
REDUCE = {"filename": SITE + "deepspeed/runtime/zero/stage3.py", "line": 20, "name": "reduce"}
PROBE = {"filename": "/work/repo/benchmarks/live_tensors.py", "line": 43, "name": "__torch_dispatch__"}


def event(action: str, addr: int, size: int, stream: int = 0, frames=()) -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": stream, "frames": list(frames)}


def test_the_peak_counts_what_python_freed_until_its_stream_is_done():
    trace = [
        event("free_completed", 9, 1000),  # allocated before the trace began: not this window's
        event("alloc", 1, 100, frames=[TORCH, GATHER]),
        event("alloc", 2, 50, stream=7, frames=[REDUCE]),
        event("free_requested", 2, 50, stream=7),  # Python let go; the reduction stream still holds it
        event("alloc", 3, 30, frames=[TORCH]),  # the peak: 180
        event("free_completed", 2, 50, stream=7),
        event("free_requested", 1, 100),
        event("free_completed", 1, 100),
        event("alloc", 4, 120, frames=[GATHER]),  # 150, under the peak
    ]
    assert at_peak(trace) == {"peak": 180, "largest": [
        [100, 0, "deepspeed/runtime/zero/partition_parameters.py:10 all_gather", "live"],
        [50, 7, "deepspeed/runtime/zero/stage3.py:20 reduce", "freed, awaiting its stream"],
        [30, 0, "?", "live"]]}


def test_allocations_from_one_place_and_stream_are_summed():
    trace = [event("alloc", a, 10, frames=[REDUCE]) for a in range(5)] + [event("alloc", 9, 20, stream=7)]
    assert at_peak(trace, n=1) == {"peak": 70, "largest": [[50, 0, "deepspeed/runtime/zero/stage3.py:20 reduce",
                                                            "live"]]}


def test_the_probes_own_dispatch_mode_is_not_an_origin():
    """The live-tensor count runs as a dispatch mode, whose frame is innermost in every allocation under it."""
    trace = [event("alloc", 1, 10, frames=[TORCH, PROBE, TORCH, GATHER]), event("alloc", 2, 5, frames=[PROBE])]
    assert at_peak(trace)["largest"] == [[10, 0, "deepspeed/runtime/zero/partition_parameters.py:10 all_gather",
                                          "live"], [5, 0, "?", "live"]]
