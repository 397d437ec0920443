"""train.py with one rank made to fail or diverge, for the fail-fast and divergence tests; launched like train.py,
or injected into the ranks tests/ranks.py forks (`inject`), which do so when MEGALITE_FAULT is in their environment.

MEGALITE_FAULT=KIND:RANKS:STEP (RANKS: one rank or several, comma-separated; STEP: the rank's STEP-th training
step since it started, so a step trained again after a rewind is not hit twice), KIND being `raise` (an
exception in the training step), `hang` (a sleep inside the step, so the other ranks wait in the step's
collectives), `stall` (the rank reports its failure, then stays STALL_S with its connections open before it
exits: a failure its peers cannot see as a broken connection, as under NCCL, where only the abort key stops
them), `nan` (the model's output is NaN in that step: its loss and gradients are not finite) or `spike` (the
output scaled by 100 in that step: a finite loss far above the others).
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train
from training.failure import exit_now, report_failure, run_rank

SCALES = {"nan": float("nan"), "spike": 100.0}
# A stalled rank's open connections: long against the 2 s in which every rank's watcher polls the abort key, so its
# peers stop by the key (they say so) well before the connections close (they would say that instead).
STALL_S = 10


def inject(fault: str) -> None:
    """Make train.train_step fail or diverge on this rank as `fault` (KIND:RANKS:STEP) says."""
    kind, fault_ranks, fault_step = fault.split(":")
    real_train_step = train.train_step
    steps_taken = 0

    def faulty_train_step(driver, micro_batches, *args, **kwargs):
        nonlocal steps_taken
        steps_taken += 1
        if os.environ.get("RANK", "0") not in fault_ranks.split(",") or steps_taken != int(fault_step):
            return real_train_step(driver, micro_batches, *args, **kwargs)
        if kind in SCALES:
            scaled = driver.engine.module.register_forward_hook(lambda module, inputs, output: output * SCALES[kind])
            try:
                return real_train_step(driver, micro_batches, *args, **kwargs)
            finally:
                scaled.remove()
        if kind == "raise":
            raise RuntimeError(f"injected failure on rank {os.environ['RANK']} at step {fault_step}")
        if kind == "stall":
            try:
                raise RuntimeError(f"injected failure on rank {os.environ['RANK']} at step {fault_step}")
            except RuntimeError as e:
                report_failure(e)
            time.sleep(STALL_S)
            exit_now(1)
        time.sleep(3600)

    train.train_step = faulty_train_step


if __name__ == "__main__":
    inject(os.environ["MEGALITE_FAULT"])
    run_rank(train.main)
