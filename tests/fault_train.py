"""train.py with one rank made to fail, for the fail-fast tests; launched like train.py.

MEGALITE_FAULT=KIND:RANK:STEP, KIND being `raise` (an exception in the training step) or `hang` (a sleep
inside the step, so the other ranks wait in the step's collectives).
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train  # noqa: E402
from training.failure import run_rank  # noqa: E402

kind, fault_rank, fault_step = os.environ["MEGALITE_FAULT"].split(":")
real_train_step = train.train_step
steps_taken = 0


def faulty_train_step(engine, micro_batches):
    global steps_taken
    steps_taken += 1
    if os.environ["RANK"] == fault_rank and steps_taken == int(fault_step):
        if kind == "raise":
            raise RuntimeError(f"injected failure on rank {fault_rank} at step {fault_step}")
        time.sleep(3600)
    return real_train_step(engine, micro_batches)


train.train_step = faulty_train_step
run_rank(train.main)
