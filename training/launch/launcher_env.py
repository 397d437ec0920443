"""Which launcher started this process, mapped onto the environment torch.distributed reads.

torch.distributed's env:// rendezvous needs RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT:

- `deepspeed` and `torchrun` set all five: used as they are.
- `mpiexec`/`mpirun` (Open MPI: OMPI_COMM_WORLD_*; MPICH and Intel MPI's Hydra: PMI_RANK/PMI_SIZE), and
  `deepspeed --launcher openmpi|mpich`, which start ranks through them: DeepSpeed's own MPI discovery
  (`deepspeed.comm.comm.mpi_discovery`, through mpi4py): rank and size from MPI, rank 0's address
  broadcast to all, the local rank from the ranks' host names. MASTER_PORT is kept if set, else 29500.
- `srun` (Slurm, and `deepspeed --launcher slurm`, which runs srun): SLURM_PROCID, SLURM_LOCALID and
  SLURM_STEP_NUM_TASKS; the master is the first host of the step's node list (`scontrol show hostnames`),
  the port MASTER_PORT if set, else 20000 + the job id modulo 10000, so jobs sharing a node differ.
- nothing: a one-process world on a free local port.

MPI's variables win over Slurm's: mpiexec inside an allocation starts its daemons through srun, so its
ranks see a Slurm step too, one task per node. Everything here runs before any process group exists.
"""
import os
import socket
import subprocess

from common.checks import ConfigError

TORCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def detect_launcher(env=os.environ) -> str:
    """The launcher whose variables this process has: deepspeed/torchrun, openmpi, mpich, slurm or none."""
    if all(var in env for var in TORCH_VARS):
        return "torchrun" if "TORCHELASTIC_RUN_ID" in env else "deepspeed"
    if "OMPI_COMM_WORLD_SIZE" in env:
        return "openmpi"
    if "PMI_SIZE" in env and "PMI_RANK" in env:
        return "mpich"
    if "SLURM_STEP_NUM_TASKS" in env and "SLURM_PROCID" in env:
        return "slurm"
    return "none"


def launcher_rank(env=os.environ) -> tuple[str, str]:
    """(global rank, local rank) as the launcher numbers this process, before any mapping: for messages
    about bad input, which stop a rank before the process group exists."""
    for rank, local in (("RANK", "LOCAL_RANK"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"),
                        ("PMI_RANK", "MPI_LOCALRANKID"), ("SLURM_PROCID", "SLURM_LOCALID")):
        if rank in env:
            return env[rank], env.get(local, "?")
    return "0", "0"


# The variable each launcher sets to the count of ranks it started on this node.
LOCAL_RANK_COUNTS = ("LOCAL_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                     "SLURM_NTASKS_PER_NODE")


def ranks_on_this_node(env=os.environ) -> int:
    """How many ranks the launcher started on this node: deepspeed's LOCAL_SIZE, torchrun's LOCAL_WORLD_SIZE,
    Open MPI's, Hydra's (MPICH, Intel MPI) or Slurm's count; 1 without a launcher."""
    for var in LOCAL_RANK_COUNTS:
        if env.get(var, "").isdigit():
            return max(1, int(env[var]))
    return 1


def threads_per_rank(default_threads: int, env=os.environ) -> int | None:
    """torch's intra-op threads for each rank on this node, or None to leave them as they are: the launcher or
    the user set OMP_NUM_THREADS, or one rank has the node. Otherwise each rank of N takes its share of the
    default_threads one process would use (torch's count of the cores). The deepspeed launcher sets nothing, so
    every rank took all the cores: two ranks on 2 cores ran the quickstart at 2,200 tokens/s, against 34,700
    with one thread each (docs/performance.md)."""
    ranks = ranks_on_this_node(env)
    if "OMP_NUM_THREADS" in env or ranks == 1:
        return None
    return max(1, default_threads // ranks)


def set_distributed_env() -> str:
    """Fill in the torch.distributed variables from the launcher's own; returns the launcher's name."""
    launcher = detect_launcher()
    if launcher == "openmpi" or launcher == "mpich":
        try:
            from deepspeed.comm.comm import mpi_discovery
            mpi_discovery(distributed_port=int(os.environ.get("MASTER_PORT", 29500)), verbose=False)
        except ImportError as e:
            raise ConfigError(f"started by mpiexec ({launcher}) but mpi4py is missing ({e}): pip install "
                              f"'.[mpi]' (mpi4py, built against this MPI), or launch with deepspeed or torchrun")
    elif launcher == "slurm":
        os.environ.update(slurm_env(os.environ))
    elif launcher == "none":
        set_single_process_env()
    return launcher


def slurm_env(env) -> dict:
    """The torch.distributed variables of an srun task."""
    nodes = env.get("SLURM_STEP_NODELIST") or env["SLURM_NODELIST"]
    port = env.get("MASTER_PORT") or str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 10000)
    return {"RANK": env["SLURM_PROCID"], "LOCAL_RANK": env["SLURM_LOCALID"], "WORLD_SIZE": env["SLURM_STEP_NUM_TASKS"],
            "MASTER_ADDR": env.get("MASTER_ADDR") or first_host(nodes), "MASTER_PORT": port}


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list ("node[01-04],gpu7"), expanded by Slurm itself."""
    if not any(c in nodelist for c in "[],"):
        return nodelist
    try:
        hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                               check=True, timeout=30).stdout.split()
    except (OSError, subprocess.SubprocessError) as e:
        raise ConfigError(f"cannot expand the Slurm node list {nodelist!r} with scontrol ({e}): set MASTER_ADDR "
                          f"to the first node's address") from None
    return hosts[0]


def set_single_process_env() -> None:
    """Without a launcher, a one-process world needs only these variables (DeepSpeed would look for MPI)."""
    if "WORLD_SIZE" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
