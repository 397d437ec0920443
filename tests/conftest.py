"""Shared fixtures: the real Shakespeare text, prepared datasets, and runs of train.py through the
real `deepspeed` launcher (N CPU processes over gloo)."""
import glob
import json
import math
import os
import socket
import subprocess
import sys

import pytest

# The suite pins itself to the CPU, on a GPU machine too (its subprocesses inherit this): its equalities
# (1e-5, bitwise) are those of CPU kernels over gloo. GPU checks are benchmarks/record.sh's.
os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ["DS_ACCELERATOR"] = "cpu"

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# $SHAKESPEARE_TXT, else the shared copy beside the repo (CI), else the quickstart's download.
SHAKESPEARE = os.environ.get("SHAKESPEARE_TXT") or next(
    (p for p in (os.path.join(REPO, "..", "shared", "data", "tinyshakespeare.txt"),
                 os.path.join(REPO, "data", "shakespeare_char", "input.txt")) if os.path.isfile(p)), "")

# A model small enough that a multi-process run takes seconds on 2 cores.
TINY = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=32",
        "train.eval_windows=8", "train.eval_interval=1000", "train.log_interval=1", "sample.max_new_tokens=16"]
FP32 = ["ds.bf16.enabled=false"]
BF16 = ["ds.bf16.enabled=true"]  # the shipped configs say "auto": fp32 on a machine without bf16 arithmetic


@pytest.fixture(scope="session")
def shakespeare_path() -> str:
    if not os.path.isfile(SHAKESPEARE):
        pytest.fail("tinyshakespeare not found: set SHAKESPEARE_TXT to its path, or run "
                    "`python -m data.prepare` once to download it")
    return SHAKESPEARE


@pytest.fixture(scope="session")
def char_data(tmp_path_factory, shakespeare_path) -> str:
    out = str(tmp_path_factory.mktemp("shakespeare_char"))
    run([sys.executable, "-m", "data.prepare", "--tokenizer", "char", "--input", shakespeare_path, "--out_dir", out])
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cmd: list[str], timeout: int = 600, check: bool = True, env: dict | None = None):
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}"
                             f"\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def launch(nprocs: int, ds_config: str, out_dir, data_dir: str, overrides=(), check: bool = True, timeout=600,
           env: dict | None = None, config: str = "quickstart.yaml"):
    """train.py's N ranks, each with the torch.distributed variables a launcher sets, forked from a server that
    has imported torch, DeepSpeed and train.py once (tests/ranks.py): what `deepspeed --num_gpus N train.py ...`
    runs, without the launcher's start-up. The launchers themselves are tested with deepspeed_launch and in
    test_launch.py / test_launchers.py."""
    from ranks import run_ranks
    argv = launch_cmd([], "train.py", ds_config, out_dir, data_dir, overrides, config)[2:]
    port = free_port()
    try:
        proc = run_ranks(nprocs, argv, port, {**ONE_THREAD, "WANDB_MODE": "disabled", **(env or {})}, timeout)
    finally:
        release_shm(["--master_port", str(port)])
    if check and proc.returncode != 0:
        raise AssertionError(f"{nprocs} ranks of train.py {' '.join(argv)} exited {proc.returncode}\n--- output\n"
                             f"{proc.stdout[-8000:]}")
    return proc


def train_py(args: list[str], check: bool = True, timeout=600, env: dict | None = None):
    """`python train.py ARGS`: one process without a launcher, forked from the rank server (tests/ranks.py)."""
    from ranks import run_ranks
    proc = run_ranks(None, list(args), 0, {"WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1", **(env or {})}, timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"train.py {' '.join(args)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}"
                             f"\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def deepspeed_launch(nprocs: int, ds_config: str, out_dir, data_dir: str, overrides=(), check: bool = True,
                     timeout=600, env: dict | None = None, config: str = "quickstart.yaml", script: str = "train.py"):
    """`deepspeed --num_gpus N train.py ...`, as a user types it."""
    cmd = launch_cmd(["--num_gpus", str(nprocs), "--master_port", str(free_port())], script, ds_config, out_dir,
                     data_dir, overrides, config)
    try:
        return run(cmd, timeout=timeout, check=check, env={**ONE_THREAD, **(env or {})})
    finally:
        release_shm(cmd)


def launch_cmd(launcher_args: list[str], script: str, ds_config: str, out_dir, data_dir: str, overrides=(),
               config: str = "quickstart.yaml") -> list[str]:
    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    return [launcher, *launcher_args, script, "--config", os.path.join(REPO, "configs", config),
            "--ds_config", os.path.join(REPO, "ds_configs", ds_config), f"train.out_dir={out_dir}",
            f"data.dir={data_dir}", *TINY, *overrides]


ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # N ranks share this machine's cores


def release_shm(cmd: list[str]) -> None:
    """DeepSpeed's CPU shm workspace of a run that did not end cleanly (see training/failure.py)."""
    port = cmd[cmd.index("--master_port") + 1]
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
        os.remove(path)


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
