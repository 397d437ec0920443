"""The ranks of a train.py run forked from a server process that imported torch, DeepSpeed and train.py once:
a run of N ranks costs its training, not N interpreters importing DeepSpeed behind a launcher.

Each rank gets the five torch.distributed variables a launcher sets (train.py reads them as it reads the
deepspeed launcher's) and writes to one log, as ranks sharing a launcher's pipe do; run_ranks returns it as a
CompletedProcess whose return code is the first rank's non-zero exit code. The server is forked before the
parent runs any torch work, so no rank inherits a thread pool or a process group.
"""
import atexit
import multiprocessing
import os
import subprocess
import tempfile

_SERVER = None


def _server():
    global _SERVER
    if _SERVER is None:
        _SERVER = multiprocessing.get_context("forkserver")
        _SERVER.set_forkserver_preload(["ranks_preload"])
    return _SERVER


def _rank(argv: list[str], env: dict, log: str) -> None:
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    import torch  # imported by the server already: OMP_NUM_THREADS set now would not reach its thread pool

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    import train
    from training.failure import run_rank
    try:
        run_rank(train.main, argv)
    finally:  # a forked process ends in os._exit: run what an interpreter's exit runs (wandb finishes its run)
        atexit._run_exitfuncs()


def run_ranks(nprocs: int, argv: list[str], port: int, env: dict, timeout: float) -> subprocess.CompletedProcess:
    with tempfile.NamedTemporaryFile("r", prefix="ranks_", suffix=".log") as log:
        ranks = []
        for rank in range(nprocs):
            rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nprocs),
                        "LOCAL_SIZE": str(nprocs), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            ranks.append(_server().Process(target=_rank, args=(argv, rank_env, log.name), daemon=True))
            ranks[-1].start()
        try:
            for process in ranks:
                process.join(timeout)
            hung = [r for r, process in enumerate(ranks) if process.is_alive()]
            if hung:
                raise subprocess.TimeoutExpired(f"ranks {hung} of train.py {' '.join(argv)}", timeout, log.read())
        finally:
            for process in ranks:
                process.kill()
        codes = [process.exitcode for process in ranks]
        return subprocess.CompletedProcess(argv, next((c for c in codes if c), 0), log.read(), "")
