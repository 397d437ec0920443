"""train.py under every common launcher: torchrun, mpiexec (Open MPI, through DeepSpeed's MPI discovery),
`deepspeed --launcher openmpi`, srun in a real single-node Slurm cluster and `deepspeed --launcher slurm`.
Each gives the DeepSpeed launcher's losses for the same layout (fp32, to 1e-5): torchrun, mpiexec and srun two pipeline
stages, which train only when both ranks agree on the world and on which stage each is; DeepSpeed's own openmpi and
slurm backends two data-parallel ranks. A rank that raises ends each job non-zero within 60 s, naming the rank."""
import getpass
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest

from harness import FP32, REPO, free_port, job_env, launch, launch_cmd, release_shm, train_losses
from training.launch.launcher_env import detect_launcher, launcher_rank, slurm_env, threads_per_rank

pytestmark = pytest.mark.launch  # several train.py processes per test (python -m pytest -m "not launch" skips them)

STEPS = ["train.max_steps=3", "optim.warmup_steps=1", "optim.lr=3e-3", "ds.train_micro_batch_size_per_gpu=2",
         "ds.gradient_accumulation_steps=2", *FP32]
LAYOUTS = {"dp2": "zero1.json", "pp2": "pipe2.json"}
FAULT = ["train.max_steps=50", "train.dist_timeout_s=30", *FP32]
AS_ROOT = os.geteuid() == 0
BIN = os.path.dirname(sys.executable)


def script_args(script: str, ds_config: str, out_dir, data_dir: str, overrides) -> list[str]:
    """`train.py --config ... --ds_config ... overrides`, exactly as the deepspeed launcher tests pass them."""
    return launch_cmd([], script, ds_config, out_dir, data_dir, overrides)[1:]


def run_job(cmd: list[str], port: int, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, cwd=REPO, env=job_env({"MASTER_PORT": str(port), **(env or {})}),
                              capture_output=True, text=True, timeout=timeout)
    finally:
        release_shm(port)


def assert_trained(proc, out_dir, expected, launcher: str):
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-5000:]
    assert f"topology ({launcher}): " in output  # train.py saw which launcher started it
    assert train_losses(out_dir) == pytest.approx(expected, abs=1e-5)


def assert_fails_fast(cmd: list[str], port: int, env: dict | None = None):
    """Rank 1 raises in step 3 (tests/fault_train.py): the job must end non-zero within 60 s of training's first
    step, with the failing rank named. Output is read as it comes, to time it."""
    env = job_env({"MASTER_PORT": str(port), "MEGALITE_FAULT": "raise:1:3", **(env or {})})
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, first_step, first_error = [], None, None
    try:
        for line in proc.stdout:  # the launcher closes its output when it exits
            lines.append(line)
            first_step = first_step or (time.monotonic() if line.startswith("step 1 |") else None)
            first_error = first_error or (time.monotonic() if line.startswith("error: rank 1 (") else None)
        proc.wait(timeout=120)
    finally:
        proc.kill()
        release_shm(port)
    end, output = time.monotonic(), "".join(lines)
    assert proc.returncode != 0 and first_step and first_error, output[-3000:]
    print(f"ended {end - first_step:.1f} s after step 1, {end - first_error:.1f} s after the error")
    assert end - first_step < 60, f"the job ended {end - first_step:.0f} s after training began"
    assert "failed while training step 3: RuntimeError: injected failure on rank 1" in output, output[-3000:]


@pytest.fixture(scope="module")
def deepspeed_losses(tmp_path_factory, char_data):
    """The reference: `deepspeed --num_gpus 2` for each layout."""
    losses = {}
    for layout, ds_config in LAYOUTS.items():
        out = tmp_path_factory.mktemp(f"deepspeed_{layout}")
        launch(2, ds_config, out, char_data, STEPS)
        losses[layout] = train_losses(out)
        assert len(losses[layout]) == 3
    return losses


def test_the_deepspeed_launcher_gives_each_rank_its_share_of_the_cores(tmp_path, char_data):
    """`deepspeed --num_gpus 2` sets no thread count on a CPU: each rank took every core, and two ranks on 2 cores
    ran 15 times slower than with one thread each. Without OMP_NUM_THREADS each rank now takes its share, and the
    start-up says so."""
    port = free_port()
    cmd = launch_cmd(["--num_gpus", "2", "--master_port", str(port)], "train.py", "zero0.json", tmp_path, char_data,
                     ["train.max_steps=1", *FP32])
    env = {name: value for name, value in job_env().items() if name != "OMP_NUM_THREADS"}
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    finally:
        release_shm(port)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    share = re.search(r"torch threads: (\d+) per rank \((\d+) for one process, shared by the 2 ranks on this node; "
                      r"OMP_NUM_THREADS sets them\)", proc.stdout)
    assert share, proc.stdout[-3000:]
    assert int(share[1]) == max(1, int(share[2]) // 2)


# --- torchrun ---------------------------------------------------------------------------------------------

def torchrun_logs(tmp_path) -> list[str]:
    """torchrun's log folder in the test's, where by default it makes one in /tmp a run and leaves it there."""
    return ["--log-dir", str(tmp_path / "torchrun")]


def test_torchrun_trains_like_the_deepspeed_launcher(tmp_path, char_data, deepspeed_losses):
    port = free_port()
    cmd = [os.path.join(BIN, "torchrun"), "--nproc_per_node", "2", "--master_port", str(port), *torchrun_logs(tmp_path),
           *script_args("train.py", "pipe2.json", tmp_path, char_data, STEPS)]
    assert_trained(run_job(cmd, port), tmp_path, deepspeed_losses["pp2"], "torchrun")


def test_torchrun_ends_fast_when_a_rank_raises(tmp_path, char_data):
    port = free_port()
    cmd = [os.path.join(BIN, "torchrun"), "--nproc_per_node", "2", "--master_port", str(port), *torchrun_logs(tmp_path),
           *script_args("tests/fault_train.py", "zero1.json", tmp_path, char_data, FAULT)]
    assert_fails_fast(cmd, port)


# --- MPI --------------------------------------------------------------------------------------------------

def mpiexec_args() -> list[str]:
    if not shutil.which("mpiexec") or not shutil.which("ompi_info"):
        pytest.skip("the MPI launch tests need Open MPI (Debian: openmpi-bin); .ci/run installs it")
    pytest.importorskip("mpi4py", reason="the MPI launch tests need mpi4py: pip install '.[mpi]'")
    # Two ranks share this machine's cores; as root Open MPI wants an explicit go-ahead.
    return ["mpiexec", "-n", "2", "--bind-to", "none", *(["--allow-run-as-root"] if AS_ROOT else [])]


def test_mpiexec_trains_like_the_deepspeed_launcher(tmp_path, char_data, deepspeed_losses):
    port = free_port()
    cmd = [*mpiexec_args(), sys.executable, *script_args("train.py", "pipe2.json", tmp_path, char_data, STEPS)]
    assert_trained(run_job(cmd, port), tmp_path, deepspeed_losses["pp2"], "openmpi")


def test_mpiexec_ends_fast_when_a_rank_raises(tmp_path, char_data):
    port = free_port()
    cmd = [*mpiexec_args(), sys.executable, *script_args("tests/fault_train.py", "zero1.json", tmp_path, char_data,
                                                          FAULT)]
    assert_fails_fast(cmd, port)


def test_deepspeed_openmpi_backend_trains_like_the_deepspeed_launcher(tmp_path, char_data, deepspeed_losses):
    """DeepSpeed's own mpirun command line (`--launcher openmpi`); one host, forced through the multi-node path."""
    mpiexec_args()
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    port = free_port()
    launcher_args = "--bind-to none --mca btl_tcp_if_include lo" + (" --allow-run-as-root" if AS_ROOT else "")
    cmd = [os.path.join(BIN, "deepspeed"), "--launcher", "openmpi", "--hostfile", str(hostfile), "--force_multi",
           "--no_ssh_check", "--master_addr", "127.0.0.1", "--launcher_args", launcher_args,
           *script_args("train.py", "zero1.json", tmp_path / "out", char_data, STEPS)]
    proc = run_job(cmd, port)
    assert "mpirun -n 2 -hostfile" in proc.stdout + proc.stderr  # DeepSpeed's runner built the command
    assert_trained(proc, tmp_path / "out", deepspeed_losses["dp2"], "openmpi")


# --- Slurm ------------------------------------------------------------------------------------------------

SLURM_CONF = """ClusterName=megalite
SlurmctldHost={host}(127.0.0.1)
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
AuthInfo=socket={dir}/munge.sock
CredType=cred/munge
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
"""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A real single-node Slurm cluster on localhost (munged, slurmctld, slurmd, from Debian's slurm-wlm),
    configured under a temporary directory; skipped, with the reason, unless it is up within a minute."""
    daemons = [shutil.which(name) or f"/usr/sbin/{name}" for name in ("munged", "slurmctld", "slurmd")]
    missing = [d for d in daemons + [shutil.which("srun") or "srun"] if not os.path.exists(d)]
    if missing:
        pytest.skip(f"no Slurm here ({', '.join(missing)} missing; Debian: slurm-wlm munge): the environment "
                    f"mapping is tested in-process instead")
    work = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool"):
        (work / sub).mkdir()
    shutil.copy("/etc/munge/munge.key", work / "munge.key") if os.access("/etc/munge/munge.key", os.R_OK) else \
        (work / "munge.key").write_bytes(os.urandom(128))
    os.chmod(work / "munge.key", 0o600)
    conf = work / "slurm.conf"
    conf.write_text(SLURM_CONF.format(host=socket.gethostname(), user=getpass.getuser(), dir=work,
                                      ctld_port=free_port(), slurmd_port=free_port(), cpus=os.cpu_count()))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    log = open(work / "daemons.log", "w")
    procs = [subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT) for cmd in (
        [daemons[0], "-F", "--force", "-S", str(work / "munge.sock"), "--key-file", str(work / "munge.key"),
         "--pid-file", str(work / "munged.pid"), "--log-file", str(work / "munged.log"), "--seed-file",
         str(work / "munge.seed")],
        [daemons[1], "-D", "-f", str(conf)], [daemons[2], "-D", "-f", str(conf)])]
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True).stdout.strip()
            if state == "idle":
                break
            time.sleep(1)
        else:
            logs = "".join((work / name).read_text()[-1000:] for name in ("slurmctld.log", "slurmd.log")
                           if (work / name).exists())
            pytest.skip(f"the single-node Slurm cluster did not come up within 60 s (state {state!r}); "
                        f"the environment mapping is tested in-process instead. Logs: {logs}")
        yield env
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)
        log.close()


def srun_args() -> list[str]:
    # --kill-on-bad-exit: a rank that fails ends the step (the README's sbatch example sets it too).
    return ["srun", "-n", "2", "--kill-on-bad-exit=1"]


def test_srun_trains_like_the_deepspeed_launcher(tmp_path, char_data, deepspeed_losses, slurm):
    port = free_port()
    cmd = [*srun_args(), sys.executable, *script_args("train.py", "pipe2.json", tmp_path, char_data, STEPS)]
    assert_trained(run_job(cmd, port, slurm), tmp_path, deepspeed_losses["pp2"], "slurm")


def test_srun_ends_fast_when_a_rank_raises(tmp_path, char_data, slurm):
    port = free_port()
    cmd = [*srun_args(), sys.executable, *script_args("tests/fault_train.py", "zero1.json", tmp_path, char_data,
                                                       FAULT)]
    assert_fails_fast(cmd, port, slurm)


def test_deepspeed_slurm_backend_trains_like_the_deepspeed_launcher(tmp_path, char_data, deepspeed_losses, slurm):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"{socket.gethostname()} slots=2\n")
    port = free_port()
    cmd = [os.path.join(BIN, "deepspeed"), "--launcher", "slurm", "--hostfile", str(hostfile), "--force_multi",
           "--no_ssh_check", "--master_addr", "127.0.0.1", "--launcher_args=--kill-on-bad-exit=1",
           *script_args("train.py", "zero1.json", tmp_path / "out", char_data, STEPS)]
    proc = run_job(cmd, port, slurm)
    assert "srun -n 2 --kill-on-bad-exit=1" in proc.stdout + proc.stderr  # DeepSpeed's runner built the command
    assert_trained(proc, tmp_path / "out", deepspeed_losses["dp2"], "slurm")


def test_slurm_node_list_expands_through_scontrol(slurm, monkeypatch):
    from training.launch.launcher_env import first_host
    monkeypatch.setenv("SLURM_CONF", slurm["SLURM_CONF"])
    assert first_host("gpu[07-09,12],cpu1") == "gpu07"


# --- the environment mapping, in-process ------------------------------------------------------------------

OPEN_MPI = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
HYDRA = {"PMI_SIZE": "4", "PMI_RANK": "2", "MPI_LOCALRANKID": "0"}
SRUN = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_STEP_NUM_TASKS": "8", "SLURM_NTASKS": "8",
        "SLURM_STEP_NODELIST": "node7", "SLURM_NODELIST": "node7", "SLURM_JOB_ID": "123456"}
TORCH = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}


@pytest.mark.parametrize("env,launcher,rank", [
    (TORCH, "deepspeed", ("1", "1")),
    ({**TORCH, "TORCHELASTIC_RUN_ID": "x"}, "torchrun", ("1", "1")),
    (OPEN_MPI, "openmpi", ("3", "1")),
    (HYDRA, "mpich", ("2", "0")),
    (SRUN, "slurm", ("5", "1")),
    # mpiexec inside an allocation: its daemons run in a Slurm step, one task per node; MPI's numbers win.
    ({**SRUN, "SLURM_STEP_NUM_TASKS": "2", **OPEN_MPI}, "openmpi", ("3", "1")),
    # a batch script itself: Slurm numbers it, but no srun step started it: one process.
    ({"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "1"}, "none", ("0", "0")),
    ({}, "none", ("0", "0")),
])
def test_launcher_is_detected_from_its_environment(env, launcher, rank):
    assert detect_launcher(env) == launcher
    assert launcher_rank(env) == rank


@pytest.mark.parametrize("env,cores,threads", [
    ({"LOCAL_SIZE": "2"}, 2, 1),  # deepspeed --num_gpus 2
    ({"LOCAL_SIZE": "4"}, 2, 1),  # never fewer than one
    ({"LOCAL_WORLD_SIZE": "8"}, 96, 12),  # torchrun, which sets OMP_NUM_THREADS=1 itself past one rank
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "3"}, 16, 5),
    ({"MPI_LOCALNRANKS": "2"}, 16, 8),
    ({"SLURM_NTASKS_PER_NODE": "4"}, 64, 16),
    ({"LOCAL_SIZE": "2", "OMP_NUM_THREADS": "2"}, 2, None),  # the user's or the launcher's setting stands
    ({"LOCAL_SIZE": "1"}, 2, None),  # one rank has the node
    ({}, 2, None),
])
def test_each_rank_on_a_node_takes_its_share_of_the_cores(env, cores, threads):
    assert threads_per_rank(cores, env) == threads


def test_srun_task_maps_onto_torch_distributed():
    assert slurm_env(SRUN) == {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "MASTER_ADDR": "node7",
                               "MASTER_PORT": str(20000 + 123456 % 10000)}
    assert slurm_env({**SRUN, "MASTER_PORT": "29400", "MASTER_ADDR": "10.0.0.1"})["MASTER_PORT"] == "29400"
