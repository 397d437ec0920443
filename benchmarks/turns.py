"""Timing runners side by side on a shared machine: each takes its warm-up steps untimed, then they take
turns of a few timed steps each, so a slow spell of the machine hits all of them."""
import time

from deepspeed.accelerator import get_accelerator

# The profiler's CPU events that are operators, not the autograd engine's or a compiled graph's wrappers
CPU_OPERATORS = ("aten::", "mkldnn::", "megalite::")


def timed_turns(runners: dict, warmup: int, steps: int, chunk: int) -> dict[str, float]:
    """runners: name -> run(step), called for steps 1..warmup+steps in order, runner by runner within a
    turn (a runner may read what an earlier one did at the same step). Returns each runner's seconds over
    its timed steps (warmup+1 onwards), measured between device synchronizations."""
    for run in runners.values():
        for step in range(1, warmup + 1):
            run(step)
    seconds = dict.fromkeys(runners, 0.0)
    for first in range(warmup + 1, warmup + steps + 1, chunk):
        turn = range(first, min(first + chunk, warmup + steps + 1))
        for name, run in runners.items():
            get_accelerator().synchronize()
            start = time.perf_counter()
            for step in turn:
                run(step)
            get_accelerator().synchronize()
            seconds[name] += time.perf_counter() - start
    return seconds


def profiled(runners: dict, first: int, steps: int, top: int = 15) -> dict[str, list[dict]]:
    """Each runner's steps first..first+steps-1 under torch.profiler: its `top` operations by self time where the
    work is done, each with its share of that runner's total. On a GPU those are the kernels (an aten operator's
    device time is its kernels', counted once), else the CPU's operators: aten's, oneDNN's and this repo's own
    (a custom operator's self time is the Python work around the aten operators it calls)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = get_accelerator().device_name() == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    tables = {}
    for name, run in runners.items():
        get_accelerator().synchronize()
        with profile(activities=activities) as prof:
            for step in range(first, first + steps):
                run(step)
            get_accelerator().synchronize()
        if cuda:
            events = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
            self_time = lambda e: e.self_device_time_total  # noqa: E731
        else:
            events = [e for e in prof.key_averages() if e.key.startswith(CPU_OPERATORS)]
            self_time = lambda e: e.self_cpu_time_total  # noqa: E731
        total = sum(self_time(e) for e in events) or 1
        events.sort(key=self_time, reverse=True)
        tables[name] = [{"op": e.key[:100], "share": self_time(e) / total, "ms_per_step": self_time(e) / 1e3 / steps,
                         "calls_per_step": e.count / steps} for e in events[:top]]
    return tables
