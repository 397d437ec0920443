"""train.py with one rank made to fail, for the fail-fast tests; launched like train.py.

MEGALITE_FAULT=KIND:RANKS:STEP (RANKS: one rank or several, comma-separated), KIND being `raise` (an
exception in the training step), `hang` (a sleep inside the step, so the other ranks wait in the step's
collectives) or `stall` (the rank reports its failure, then stays 30 s with its connections open before it
exits: a failure its peers cannot see as a broken connection, as under NCCL, where only the abort key stops
them).
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train  # noqa: E402
from training.failure import exit_now, report_failure, run_rank  # noqa: E402

kind, fault_rank, fault_step = os.environ["MEGALITE_FAULT"].split(":")
real_train_step = train.train_step
steps_taken = 0


def faulty_train_step(engine, micro_batches, *args, **kwargs):
    global steps_taken
    steps_taken += 1
    if os.environ["RANK"] in fault_rank.split(",") and steps_taken == int(fault_step):
        if kind == "raise":
            raise RuntimeError(f"injected failure on rank {os.environ['RANK']} at step {fault_step}")
        if kind == "stall":
            try:
                raise RuntimeError(f"injected failure on rank {os.environ['RANK']} at step {fault_step}")
            except RuntimeError as e:
                report_failure(e)
            time.sleep(30)
            exit_now(1)
        time.sleep(3600)
    return real_train_step(engine, micro_batches, *args, **kwargs)


train.train_step = faulty_train_step
run_rank(train.main)
