"""How the tests start runs and read their results: the tiny model's settings; train.py as N ranks forked from
the rank server (launch), as one process without a launcher (train_py), through the real `deepspeed` launcher
(deepspeed_launch) or one launcher per simulated node (launch_nodes); any command (run); and what a run
leaves behind: metrics.jsonl, exports, universal checkpoints."""
import contextlib
import fcntl
import glob
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A model small enough that a multi-process run takes seconds on 2 cores. Its MFU's denominator is given: every
# rank would measure its CPU's matmul peak at start, a tenth of such a run (tests/test_device.py tests the
# measurement, and the MFU line test of tests/test_gpu.py a run's).
TINY = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=32",
        "train.eval_windows=8", "train.eval_interval=1000", "train.log_interval=1", "sample.max_new_tokens=16",
        "train.peak_tflops=1"]
FP32 = ["ds.bf16.enabled=false"]
BF16 = ["ds.bf16.enabled=true"]  # the shipped configs say "auto": fp32 on a machine without bf16 arithmetic
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # N ranks share this machine's cores
# The CUDA_VISIBLE_DEVICES the suite was started with (JSON: null when unset), before conftest.py hid the GPUs.
STARTED_DEVICES = "TESTS_STARTED_CUDA_VISIBLE_DEVICES"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def one_rank_world():
    """A one-rank gloo world in this process, with the launcher's variables set only inside it; and torch's own
    F.linear back after it, which ZeRO-3's zero.Init replaces for the rest of the process (its memory-efficient
    linear)."""
    from unittest import mock

    import torch.nn.functional as F

    from training.launch.failure import join_process_group, leave_process_group
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    linear = F.linear
    with mock.patch.dict(os.environ, env):
        join_process_group()
        yield
        leave_process_group()
    F.linear = linear


def fresh_clone(folder) -> str:
    """The repo's files copied into `folder` as a clone has them: tracked and new ones, nothing ignored (no prepared
    data, no out/), for a test that must not see what this checkout has run."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.splitlines()
    for name in files:
        if os.path.isfile(os.path.join(REPO, name)):
            os.makedirs(os.path.dirname(os.path.join(folder, name)), exist_ok=True)
            shutil.copy2(os.path.join(REPO, name), os.path.join(folder, name))
    return str(folder)


def _checked(proc, what: str, check: bool):
    if check and proc.returncode != 0:
        raise AssertionError(f"{what} exited {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}"
                             f"\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def run(cmd: list[str], timeout: int = 600, check: bool = True, env: dict | None = None):
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    return _checked(proc, " ".join(cmd), check)


def benchmark(script: str, *args: str, env: dict | None = None):
    """`python benchmarks/SCRIPT ARGS` (or bash, for a shell script), its exit code not checked."""
    shell = ["bash"] if script.endswith(".sh") else [sys.executable]
    # PYTHON: the shell scripts' interpreter, this one (with torch and DeepSpeed) rather than the first python3
    return run([*shell, os.path.join("benchmarks", script), *args], check=False, timeout=120,
               env={"PYTHON": sys.executable, **(env or {})})


def made_once(tmp_path_factory, name: str, make: Callable[[Path], None]) -> Path:
    """A folder that `make(folder)` fills once in the whole run, for a session fixture that several test files use:
    xdist's workers, each of which builds its own session fixtures, share it. The first to ask makes it under a
    lock; the others wait for it."""
    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root  # the run's folder, above the workers'
    folder = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / ".made").exists():
            shutil.rmtree(folder, ignore_errors=True)  # a worker that failed making it
            folder.mkdir()
            make(folder)
            (folder / ".made").touch()
    return folder


def job_env(extra: dict | None = None) -> dict:
    """The environment of a launcher started by a test: one thread per rank, no wandb, unbuffered output."""
    return {**os.environ, **ONE_THREAD, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1", **(extra or {})}


def launch(nprocs: int, ds_config: str, out_dir, data_dir: str, overrides=(), check: bool = True, timeout=600,
           env: dict | None = None, config: str = "quickstart.yaml"):
    """train.py's N ranks, each with the torch.distributed variables a launcher sets, forked from a server that
    has imported torch, DeepSpeed and train.py once (tests/ranks.py): what `deepspeed --num_gpus N train.py ...`
    runs, without the launcher's start-up. The launchers themselves are tested with deepspeed_launch and in
    test_multinode.py, test_failure.py and test_launchers.py."""
    from ranks import run_ranks
    argv = launch_cmd([], "train.py", ds_config, out_dir, data_dir, overrides, config)[2:]
    port = free_port()
    try:
        proc = run_ranks(nprocs, argv, port, {**ONE_THREAD, "WANDB_MODE": "disabled", **(env or {})}, timeout)
    finally:
        release_shm(port)
    if check and proc.returncode != 0:
        raise AssertionError(f"{nprocs} ranks of train.py {' '.join(argv)} exited {proc.returncode}\n--- output\n"
                             f"{proc.stdout[-8000:]}")
    return proc


def train_py(args: list[str], check: bool = True, timeout=600, env: dict | None = None):
    """`python train.py ARGS`: one process without a launcher, forked from the rank server (tests/ranks.py)."""
    from ranks import run_ranks
    proc = run_ranks(None, list(args), 0, {"WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1", **(env or {})}, timeout)
    return _checked(proc, f"train.py {' '.join(args)}", check)


def sample_py(args: list[str], check: bool = True, timeout=600, env: dict | None = None):
    """`python sample.py ARGS`, forked from the rank server (tests/ranks.py) like train_py: the same main, stdout,
    stderr and exit code, without an interpreter importing torch. Its command line as typed is tested in
    test_readme_commands.py and test_command_line.py."""
    from ranks import run_tool
    proc = run_tool("sample", list(args), {"WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1", **(env or {})}, timeout)
    return _checked(proc, f"sample.py {' '.join(args)}", check)


def deepspeed_launch(nprocs: int, ds_config: str, out_dir, data_dir: str, overrides=(), check: bool = True,
                     timeout=600, env: dict | None = None, config: str = "quickstart.yaml", script: str = "train.py"):
    """`deepspeed --num_gpus N train.py ...`, as a user types it."""
    port = free_port()
    cmd = launch_cmd(["--num_gpus", str(nprocs), "--master_port", str(port)], script, ds_config, out_dir,
                     data_dir, overrides, config)
    try:
        return run(cmd, timeout=timeout, check=check, env={**ONE_THREAD, **(env or {})})
    finally:
        release_shm(port)


def launch_cmd(launcher_args: list[str], script: str, ds_config: str, out_dir, data_dir: str, overrides=(),
               config: str = "quickstart.yaml") -> list[str]:
    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    return [launcher, *launcher_args, script, "--config", os.path.join(REPO, "configs", config),
            "--ds_config", os.path.join(REPO, "ds_configs", ds_config), f"train.out_dir={out_dir}",
            f"data.dir={data_dir}", *TINY, *overrides]


def release_shm(port) -> list[str]:
    """Remove what DeepSpeed's CPU shm workspaces of a run on `port` left in /dev/shm, which a run that got as far
    as joining its process group never does (training/launch/failure.py): the paths removed."""
    leaked = glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*")
    for path in leaked:
        os.remove(path)
    return leaked


# pp=2 x dp=2 over two "nodes" of two ranks each; global batch 8 = micro 2 x accum 2 x dp 2.
PP2_DP2 = ["model.n_layer=4", "train.max_steps=4", "optim.warmup_steps=2", "optim.lr=3e-3",
           "ds.train_micro_batch_size_per_gpu=2", "ds.gradient_accumulation_steps=2", *FP32]


def two_node_hostfile(path, hosts=("node0", "node1")) -> str:
    path.write_text("".join(f"{host} slots=2\n" for host in hosts))
    return str(path)


def launch_nodes(hostfile: str, script: str, nodes: list[tuple], overrides=(), timeout=600, env=None) -> list[tuple]:
    """One launcher per node, as a user without ssh starts them: `deepspeed --hostfile H --no_ssh
    --node_rank K --master_addr ADDR ...` on each; they meet at the master address. `nodes` holds each
    node's (out_dir, data_dir); returns each launcher's (output, exit code). Each node runs pipe2.json."""
    port = free_port()
    cmds = [launch_cmd(["--hostfile", hostfile, "--no_ssh", "--node_rank", str(node), "--master_addr", "127.0.0.1",
                        "--master_port", str(port)], script, "pipe2.json", out_dir, data_dir, overrides)
            for node, (out_dir, data_dir) in enumerate(nodes)]
    # Each node's launcher heads a process group of its own, so that a job that does not end is stopped whole,
    # its ranks too, and says where each node was.
    procs = [subprocess.Popen(cmd, cwd=REPO, env=job_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True) for cmd in cmds]
    try:
        return [(proc.communicate(timeout=timeout)[0], proc.returncode) for proc in procs]
    except subprocess.TimeoutExpired:
        tails = [f"--- node {node}:\n{output_after_kill(proc)[-4000:]}" for node, proc in enumerate(procs)]
        raise AssertionError(f"the job did not end in {timeout} s\n" + "\n".join(tails)) from None
    finally:
        for proc in procs:
            kill_group(proc)
        release_shm(port)


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def output_after_kill(proc: subprocess.Popen) -> str:
    """What a process started with start_new_session printed, its group killed first."""
    kill_group(proc)
    try:
        return proc.communicate(timeout=10)[0]
    except subprocess.TimeoutExpired as e:  # a descendant outside the group still holds the pipe
        output = e.output or b""  # bytes, even from a text-mode pipe
        return output.decode(errors="replace") if isinstance(output, bytes) else output


def metrics(out_dir) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def train_losses(out_dir) -> list[float]:
    return [m["loss"] for m in metrics(out_dir) if "loss" in m]


def grad_norms(out_dir) -> list[float]:
    return [m["grad_norm"] for m in metrics(out_dir) if "grad_norm" in m]


def expected_lr(step: int, lr: float, min_lr: float, warmup: int, max_steps: int) -> float:
    """The README's schedule: linear warmup from 0 (step k at lr x k / warmup), then DeepSpeed's cosine,
    whose zero point is one step before the warmup's end (step 1 when warmup is 1), to min_lr at max_steps."""
    if step < warmup:
        return lr * step / warmup
    start = max(1, warmup - 1)
    progress = (step - start) / (max_steps - start)
    return min_lr + (lr - min_lr) * (1 + math.cos(math.pi * progress)) / 2


def tool(main, argv: list[str]) -> None:
    """A command's main(argv) in this process, as `python -m scripts.NAME ARGV` runs it without an interpreter's
    start (seconds of imports) and exit; a refusal (exit 2) fails the test with its message. The command lines
    themselves are tested in test_command_line.py and test_readme_commands.py."""
    try:
        main(argv)
    except SystemExit as e:
        raise AssertionError(f"{main.__module__} {' '.join(argv)} exited {e.code}") from e


def export(out_dir, tag: str) -> str:
    """`python -m scripts.export` of a run's checkpoint `tag`, into OUT_DIR/export/TAG."""
    import scripts.export  # imports torch: after conftest's pytest_configure has hidden the GPUs

    folder = os.path.join(out_dir, "export", tag)
    tool(scripts.export.main, ["--out_dir", str(out_dir), "--tag", tag, "--output", folder])
    return folder


def universal(run_dir, tag: str) -> str:
    """`python -m scripts.convert_checkpoint universal` of a run's checkpoint `tag`: the converted tag's folder."""
    import scripts.convert_checkpoint

    tool(scripts.convert_checkpoint.main, ["universal", "--out_dir", str(run_dir), "--tag", tag])
    return os.path.join(run_dir, "checkpoints", f"{tag}_universal")
