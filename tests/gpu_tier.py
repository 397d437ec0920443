"""What the GPU tier's checks share (tests/test_gpu.py, tests/test_gpu_probes.py): the device a check is
parametrized over, and a probe (benchmarks/gpu_probes.py) run in a child process on it. The tests' own process
hides its GPUs (conftest.py), so a child gets back the CUDA_VISIBLE_DEVICES the tests were started with. A check's
`cuda` case carries the `gpu` mark and is skipped where CUDA is absent; its `cpu` case, where a CPU stand-in exists,
runs in the normal suite."""
import json
import os
import subprocess
import sys

import pytest
import torch

from harness import REPO, STARTED_DEVICES

PROBE = "from benchmarks.gpu_probes import main; main()"


def child_environment(device: str) -> dict:
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    if device == "cuda":
        env["DS_ACCELERATOR"] = "cuda"
        started = json.loads(os.environ[STARTED_DEVICES])
        if started is None:
            env.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            env["CUDA_VISIBLE_DEVICES"] = started
    return env


def cuda_available() -> bool:
    """torch.cuda.is_available() where the GPUs are given back: in a child, and only with a CUDA build of torch."""
    if torch.version.cuda is None and torch.version.hip is None:
        return False
    answer = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                            env=child_environment("cuda"), capture_output=True, text=True, timeout=120)
    return answer.stdout.strip() == "True"


NO_CUDA = pytest.mark.skipif(not cuda_available(), reason="no CUDA device: torch.cuda.is_available() is False with "
                                                          "the CUDA_VISIBLE_DEVICES the tests were started with")
CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.launch, NO_CUDA])
CPU = pytest.param("cpu", marks=pytest.mark.launch)
DEVICES = [CPU, CUDA]



def probe(device: str, name: str, out, *args, timeout: int = 900, env: dict | None = None):
    proc = subprocess.run([sys.executable, "-c", PROBE, name, str(out), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env={**child_environment(device), **(env or {})})
    assert proc.returncode == 0, (f"probe {name} on {device} exited {proc.returncode}\n--- stdout\n"
                                  f"{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return proc
