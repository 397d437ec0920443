"""The ranks of a train.py run forked from a server process that imported torch, DeepSpeed and train.py once:
a run of N ranks costs its training, not N interpreters importing DeepSpeed behind a launcher.

Each rank gets the five torch.distributed variables a launcher sets (train.py reads them as it reads the
deepspeed launcher's) and writes to one stdout and one stderr, as ranks sharing a launcher's pipes do; run_ranks
returns them as a CompletedProcess whose return code is the first rank's non-zero exit code. The server is a
fresh interpreter (multiprocessing's forkserver): no rank inherits the test process's threads or process groups.
"""
import atexit
import multiprocessing
import os
import subprocess
import sys
import tempfile
from multiprocessing import forkserver

_SERVER = None
HERE = os.path.dirname(os.path.abspath(__file__))
TORCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _server():
    global _SERVER
    if _SERVER is None:
        _SERVER = multiprocessing.get_context("forkserver")
        _SERVER.set_forkserver_preload(["ranks_preload"])
        # Python 3.11's forkserver imports its preload on the interpreter's default path, not ours (and skips an
        # ImportError in silence): it finds tests/ and the repo through PYTHONPATH, set while it starts.
        saved = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join([HERE, os.path.dirname(HERE)] + ([saved] if saved else []))
        try:
            forkserver.ensure_running()
        finally:
            if saved is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = saved
    return _SERVER


def _rank(argv: list[str], env: dict, logs: tuple[str, str]) -> None:
    assert "ranks_preload" in sys.modules, "the rank server did not preload torch, DeepSpeed and train.py"
    for name in TORCH_VARS:  # a one-process run without a launcher finds none of them, as `python train.py`
        os.environ.pop(name, None)
    os.environ.update(env)
    for stream, log in enumerate(logs, start=1):
        os.dup2(os.open(log, os.O_WRONLY | os.O_APPEND), stream)
    import torch  # imported by the server already: OMP_NUM_THREADS set now would not reach its thread pool

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    import train
    from training.launch.failure import run_rank
    main = train.main
    if "MEGALITE_FAULT" in env:
        import fault_train
        main = fault_train.faulty(env["MEGALITE_FAULT"])
    if "MEGALITE_OPTIMIZER_DUMP" in env:
        import optimizer_dump
        main = optimizer_dump.dumping(env["MEGALITE_OPTIMIZER_DUMP"], main)
    if "MEGALITE_RL_CHECK" in env:
        import rl_check
        main = rl_check.checked(main)
    try:
        run_rank(main, argv)
    finally:  # a forked process ends in os._exit: run what an interpreter's exit runs (wandb finishes its run)
        atexit._run_exitfuncs()


def _tool(module: str, argv: list[str], env: dict, logs: tuple[str, str]) -> None:
    """`python -m MODULE ARGV` (or `python MODULE.py ARGV`) as its interpreter would run it: main(argv), the exit
    code a SystemExit carries (a traceback and 1 for any other exception, as Python prints them)."""
    os.environ.update(env)
    os.chdir(os.path.dirname(HERE))  # the repo, where the tests run commands
    for stream, log in enumerate(logs, start=1):
        os.dup2(os.open(log, os.O_WRONLY | os.O_APPEND), stream)
    import importlib
    import traceback
    code = 0
    try:
        importlib.import_module(module).main(argv)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:  # sys.exit("message"), as Python ends on it
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        atexit._run_exitfuncs()
    sys.exit(code)


def run_tool(module: str, argv: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """A command's main(argv) in one process forked from the rank server, which has imported torch and DeepSpeed
    already: its stdout, stderr and exit code, without an interpreter's start."""
    with tempfile.NamedTemporaryFile("r") as out, tempfile.NamedTemporaryFile("r") as err:
        process = _server().Process(target=_tool, args=(module, argv, env, (out.name, err.name)), daemon=True)
        process.start()
        try:
            process.join(timeout)
            if process.is_alive():
                raise subprocess.TimeoutExpired(f"{module} {' '.join(argv)}", timeout, out.read() + err.read())
        finally:
            process.kill()
        return subprocess.CompletedProcess([module, *argv], process.exitcode, out.read(), err.read())


def run_ranks(nprocs: int | None, argv: list[str], port: int, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """train.py's `argv` in `nprocs` ranks on `port`, or as one process without a launcher (nprocs None)."""
    with tempfile.NamedTemporaryFile("r") as out, tempfile.NamedTemporaryFile("r") as err:
        ranks = []
        for rank in range(nprocs or 1):
            rank_env = env if nprocs is None else {
                **env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nprocs),
                "LOCAL_SIZE": str(nprocs), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            ranks.append(_server().Process(target=_rank, args=(argv, rank_env, (out.name, err.name)), daemon=True))
            ranks[-1].start()
        try:
            for process in ranks:
                process.join(timeout)
            hung = [r for r, process in enumerate(ranks) if process.is_alive()]
            if hung:
                raise subprocess.TimeoutExpired(f"ranks {hung} of train.py {' '.join(argv)}", timeout,
                                                out.read() + err.read())
        finally:
            for process in ranks:
                process.kill()
        codes = [process.exitcode for process in ranks]
        return subprocess.CompletedProcess(argv, next((c for c in codes if c), 0), out.read(), err.read())
