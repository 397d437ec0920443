"""train.py with one rank made to fail or diverge, for the fail-fast and divergence tests; launched like train.py,
or given to the ranks tests/ranks.py forks (`Fault`, an observer of the loop: training/observers.py), which do so
when MEGALITE_FAULT is in their environment.

MEGALITE_FAULT=KIND:RANKS:STEP (RANKS: one rank or several, comma-separated; STEP: the rank's STEP-th training
step since it started, so a step trained again after a rewind is not hit twice), KIND being `raise` (an
exception in the training step), `hang` (a sleep inside the step, so the other ranks wait in the step's
collectives), `stall` (the rank reports its failure, then stays STALL_S with its connections open before it
exits: a failure its peers cannot see as a broken connection, as under NCCL, where only the abort key stops
them), `kill` (the rank sends itself SIGKILL, as the kernel's OOM killer does: no handler of its own runs), `usr1`
(the rank sends itself SIGUSR1, a scheduler's warning before preemption, and trains on), `nan` (the model's output
is NaN in that step: its loss and gradients are not finite) or `spike` (the output scaled by 100 in that step: a
finite loss far above the others).
"""
import functools
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train
from training.launch.failure import exit_now, report_failure, run_rank
from training.observers import Observer

SCALES = {"nan": float("nan"), "spike": 100.0}
# A stalled rank's open connections: long against the 2 s in which every rank's watcher polls the abort key, so its
# peers stop by the key (they say so) well before the connections close (they would say that instead).
STALL_S = 10


class Fault(Observer):
    """Makes this rank's training step fail or diverge as `fault` (KIND:RANKS:STEP) says."""

    def __init__(self, fault: str):
        self.kind, ranks, step = fault.split(":")
        self.ranks, self.step = ranks.split(","), int(step)
        self.steps_taken, self.scaled = 0, None

    def before_step(self, step: int, driver, micro_batches: list) -> None:
        self.steps_taken += 1
        # RANK read now: under mpiexec or srun, train.py sets it from the launcher's own variables at start.
        if os.environ.get("RANK", "0") not in self.ranks or self.steps_taken != self.step:
            return
        if self.kind in SCALES:  # the step's output scaled: its loss and gradients with it
            self.scaled = driver.engine.module.register_forward_hook(
                lambda module, inputs, output: output * SCALES[self.kind])
            return
        failure = RuntimeError(f"injected failure on rank {os.environ['RANK']} at step {self.step}")
        if self.kind == "raise":
            raise failure
        if self.kind in ("kill", "usr1"):
            os.kill(os.getpid(), signal.SIGKILL if self.kind == "kill" else signal.SIGUSR1)
            return
        if self.kind == "stall":
            report_failure(failure)
            time.sleep(STALL_S)
            exit_now(1)
        time.sleep(3600)

    def after_step(self, step: int, driver, loss) -> None:
        if self.scaled is not None:
            self.scaled.remove()
            self.scaled = None


def faulty(fault: str):
    """train.main with the fault of MEGALITE_FAULT's form."""
    return functools.partial(train.main, observers=[Fault(fault)])


if __name__ == "__main__":
    run_rank(faulty(os.environ["MEGALITE_FAULT"]))
