"""Timing runners side by side on a shared machine: each takes its warm-up steps untimed, then they take
turns of a few timed steps each, so a slow spell of the machine hits all of them."""
import time

from deepspeed.accelerator import get_accelerator


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
