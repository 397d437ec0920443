"""How a rank ends when something goes wrong, so that a job of many processes fails fast and says why.

- Bad input raises ConfigError before any training: exit 2, the message printed once per node (found once the
  process group is up, by every rank at once, RefusedOnEveryRank: the group left cleanly first).
- A run that diverges under train.on_nonfinite=stop (training/divergence.py) raises Diverged on every rank at
  the same step: exit 3, the message printed once per node, the process group left cleanly.
- Any other exception: this rank prints which rank, host and phase failed, then exits at once; the
  DeepSpeed launcher sees the non-zero code and stops the node's other ranks.
- A collective that waits longer than train.dist_timeout_s raises on every rank still waiting; those ranks
  record it in the job's key-value store, and the lowest of them names the ranks that never arrived.
- SIGINT/SIGTERM (Ctrl-C, the launcher stopping its ranks, a scheduler) and the loss of the launcher that
  started this rank: the rank prints where it was and exits. Checkpoints are never left half-visible (the
  `latest` pointer moves only after a complete save), so the last complete one survives.
- SIGUSR1 to any rank (a scheduler's warning before it preempts the job: Slurm's --signal=USR1@SECONDS): every
  rank saves a checkpoint at the next log step, leaves the process group and exits 128 + SIGUSR1
  (SavedAndStopped; the divergence watch's read tells every rank).
- Whatever ends a rank once the process group is up also sets the job's abort key in the job's key-value
  store, which every rank's watcher thread polls: the whole job stops within seconds, on every node and
  backend. A launcher stops only its own node's ranks, and under NCCL a collective timeout is torch's
  watchdog aborting the process from C++, so none of the reports above run there; without the key, ranks
  on other nodes would wait out the timeout. An abort dumps every thread's Python stack (faulthandler).
"""
import datetime
import faulthandler
import glob
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback

import deepspeed
import torch

from common import freeze_imports
from common.checks import ConfigError
from training.divergence import Diverged
from training.launch.launcher_env import launcher_rank


class Phase:
    """What this rank is doing, for the failure messages."""

    def __init__(self):
        self.what = "reading the configuration"

    def now(self, what: str) -> None:
        self.what = what


PHASE = Phase()
SAVE_ASKED = threading.Event()  # this rank was sent SIGUSR1
TIMEOUT_KEY = "megalite/timed_out/{rank}"
DIVERGED = 3  # the exit code of a run that diverged


class JobStore:
    """The abort key in the job's store (MASTER_ADDR:MASTER_PORT: rank 0's process, or torchrun's agent), each
    use through a client connection of its own, so the watcher thread never shares one with the main thread.
    Watched from the moment the process group is up until the rank starts leaving it at the end."""

    def __init__(self):
        self.watching = None  # the watcher's client while watched

    @staticmethod
    def key() -> str:
        # torchrun's restarts reuse the store: each restart gets its own key.
        return f"megalite/abort/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"

    @staticmethod
    def client(timeout_s: float):
        return torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                          timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)

    def watch(self) -> None:
        self.watching = self.client(10)

    def stop_watching(self) -> None:
        self.watching = None

    def abort(self, reason: str) -> None:
        """Set the key, the first reason only (a rank the abort stops must not overwrite why). Best effort."""
        if self.watching is None:
            return
        self.watching = None  # this rank is ending: its own watcher must not report the abort it sets
        try:
            # A live store answers in milliseconds. A gone one (its rank already stopped) is refused at once, and
            # torch's client retries a refusal until its timeout, twice: a long timeout only delays this rank's exit.
            store = self.client(2)
            if store.add(self.key() + "/count", 1) == 1:
                store.set(self.key(), reason)
        except Exception:  # the store's host may be the rank that failed
            pass

    def aborted(self) -> str | None:
        """Why the job is aborting, or None. A store that no longer answers is its host gone: an abort too."""
        store = self.watching
        if store is None:
            return None
        try:
            return store.get(self.key()).decode() if store.check([self.key()]) else None
        except Exception:
            return None if self.watching is None else "the loss of the job's store (rank 0 or torchrun's agent)"


JOB = JobStore()


def collective_timeout(seconds: int) -> datetime.timedelta:
    """The timeout for every process group, DeepSpeed's own included: it creates its data- and
    pipeline-parallel groups with torch's module default (30 min on gloo) and takes no timeout for them,
    so the default itself is set before any group exists."""
    timeout = datetime.timedelta(seconds=seconds)
    torch.distributed.distributed_c10d.default_pg_timeout = timeout
    torch.distributed.distributed_c10d.default_pg_nccl_timeout = timeout
    return timeout


def this_rank() -> str:
    rank, local_rank = launcher_rank()  # torchrun's, deepspeed's, MPI's or Slurm's numbering
    return f"rank {rank} ({socket.gethostname()}, local rank {local_rank})"


def is_timeout(error: BaseException) -> bool:
    return "timed out" in str(error).lower() or "timeout" in type(error).__name__.lower()


def ranks_that_never_arrived(grace_s: float) -> str:
    """Every rank that timed out waiting records it in the store; after a grace period for the others to
    time out too, the ranks with no record are those that never reached the collective. Only the lowest
    waiting rank reports them. Best effort: the store lives in rank 0's process."""
    try:
        store = torch.distributed.distributed_c10d._get_default_store()  # no public accessor
        store.set_timeout(datetime.timedelta(seconds=5))
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        store.set(TIMEOUT_KEY.format(rank=rank), PHASE.what)
        time.sleep(grace_s)
        waiting = [r for r in range(world) if store.check([TIMEOUT_KEY.format(rank=r)])]
    except Exception:  # the store's host may be the rank that died
        return ""
    missing = [r for r in range(world) if r not in waiting]
    if rank != min(waiting) or not missing:
        return ""
    return (f"ranks {waiting} timed out waiting; rank(s) {missing} did not time out within {grace_s:.0f} s of "
            f"them: those never reached the collective (they hang, and print where when the launcher stops "
            f"them, or died without a report)")


def print_line(text: str, file=None) -> None:
    """The whole line in one write: ranks that share a pipe (torchrun, mpiexec and srun merge their output)
    never split each other's lines, so an error line always starts a line of the job's output."""
    print(f"{text}\n", end="", file=file or sys.stderr, flush=True)


def report_failure(error: BaseException) -> None:
    """One line that names this rank, its host and what it was doing, then the traceback."""
    if is_timeout(error):
        print_line(f"error: {this_rank()} timed out while {PHASE.what}: it waited in a collective for another rank "
                   f"longer than train.dist_timeout_s ({type(error).__name__}: {str(error).splitlines()[0]})")
        # Ranks reach a collective up to a step apart, so they time out that far apart too.
        grace_s = min(60.0, max(5.0, 0.1 * torch.distributed.distributed_c10d.default_pg_timeout.total_seconds()))
        if culprits := ranks_that_never_arrived(grace_s):
            print_line(f"error: {culprits}")
        JOB.abort(f"{this_rank()} timed out while {PHASE.what}")
    else:
        print_line(f"error: {this_rank()} failed while {PHASE.what}: {type(error).__name__}: {error}")
        JOB.abort(f"{this_rank()} failed while {PHASE.what}")
    print_line(traceback.format_exc().rstrip("\n"))


def join_process_group(dist_timeout_s: int | None = None) -> None:
    """Join the job's process group; from here a rank that fails stops the whole job (JOB, stop_on_signals).
    DeepSpeed's CPU backend maps a shared-memory all-reduce workspace per rank (about 64 MB in /dev/shm) and
    never unlinks it; once every rank has mapped its peers' (the barrier), each removes its own name, so not
    even a killed run leaves it behind. The mappings outlive the names."""
    deepspeed.init_distributed(**({} if dist_timeout_s is None else {"timeout": collective_timeout(dist_timeout_s)}))
    JOB.watch()
    # Every rank has one or none: DeepSpeed maps them where all ranks share a host and the accelerator is a CPU.
    workspace = glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{os.environ.get('MASTER_ADDR')}_"
                          f"{os.environ.get('MASTER_PORT')}_{os.environ.get('LOCAL_RANK')}")
    if workspace:
        torch.distributed.barrier()
        os.remove(workspace[0])


def leave_process_group() -> None:
    """The clean end of a rank: wait for every rank, then tear down the process group while the peers are
    still there (left to interpreter shutdown, a rank whose peers had gone could abort in gloo's
    destructors: "terminate called without an active exception"). Rank 0's store goes with it, so the
    watcher stops polling first. Through DeepSpeed's teardown, which lets go of the groups it keeps (a world's
    clone, the data-parallel group) with it: a later world in the same process (the tests') would find them stale."""
    JOB.stop_watching()
    torch.distributed.barrier()
    deepspeed.comm.destroy_process_group()


def exit_now(code: int) -> None:
    """Exit without interpreter shutdown, which tears down process groups and can wait on the very peers
    that failed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def launcher_parent() -> int | None:
    """The pid that started this rank's DeepSpeed launcher, or None when the launcher is not ours to watch.
    deepspeed's runner does not pass SIGTERM on to its node launcher on a single node, so ranks would
    outlive a killed runner; they watch for the launcher being orphaned instead."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            if b"deepspeed.launcher.launch" not in f.read():
                return None
        with open(f"/proc/{os.getppid()}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:  # no /proc: not Linux
        return None


def stop_on_signals(poll_s: float = 2.0) -> None:
    """Stop this rank on SIGINT/SIGTERM, when its launcher's parent is gone, or when the job's abort key is
    set. A watcher thread does it, not a Python signal handler: those run only between bytecodes of the main
    thread, which may be blocked in a collective; the watcher runs whenever the main thread releases the
    GIL (collectives and sleeps do)."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: None)  # the watcher acts; the main thread carries on until then
    # Between two bytecodes of the main thread, or by the watcher where that thread waits in a collective
    signal.signal(signal.SIGUSR1, lambda *_: SAVE_ASKED.set())
    main_thread, launcher_ppid = threading.main_thread(), launcher_parent()

    def stop(reason: str, code: int, announce: bool = True, linger_s: float = 0.0) -> None:
        frames = traceback.format_stack(sys._current_frames()[main_thread.ident])[-6:]
        print_line(f"error: {this_rank()} stopped by {reason} while {PHASE.what}; it was in:\n{''.join(frames)}")
        if announce:
            JOB.abort(f"{this_rank()} stopped by {reason} while {PHASE.what}")
        time.sleep(linger_s)
        exit_now(code)

    def watch() -> None:
        while True:
            if select.select([read_fd], [], [], poll_s)[0]:
                signum = os.read(read_fd, 1)[0]
                if signum == signal.SIGUSR1:
                    SAVE_ASKED.set()
                else:
                    stop(signal.Signals(signum).name, 128 + signum)
            # A dead launcher re-parents this rank, a dead runner its launcher: either way the parent changes.
            if launcher_ppid is not None and launcher_parent() != launcher_ppid:
                stop("the loss of the deepspeed launcher that started it", 128 + signal.SIGTERM)
            if reason := JOB.aborted():
                # Rank 0's process hosts the store: it stays a poll longer, so the others read why first.
                hosts_store = torch.distributed.is_initialized() and torch.distributed.get_rank() == 0
                stop(f"the job's abort ({reason})", 1, announce=False, linger_s=poll_s + 1 if hosts_store else 0.0)

    threading.Thread(target=watch, name="stop-watcher", daemon=True).start()


class SavedAndStopped(Exception):
    """Every rank saved at the same step, as SIGUSR1 asked: exit 128 + SIGUSR1, the group left cleanly."""


class RefusedOnEveryRank(ConfigError):
    """Bad input found once the process group is up, by every rank at once (another run's out_dir): exit 2, the
    group left cleanly."""


def run_rank(main, argv=None) -> None:
    """main(argv) with this repo's exit codes: 2 for bad input (before any training), 3 for a run that diverged
    (training/divergence.py), 1 for a failed rank, 128 + the signal for a stopped one."""
    freeze_imports()
    faulthandler.enable(all_threads=True)  # a C++ abort (NCCL's watchdog) still shows where Python was
    stop_on_signals()
    try:
        main(argv)
    except ConfigError as e:
        if launcher_rank()[1] in ("0", "?"):  # one copy of the message per node
            print_line(f"error: {e}")
        if isinstance(e, RefusedOnEveryRank):
            leave_process_group()
        sys.exit(2)
    except Diverged as e:  # every rank stops here, at the same step: the group is left cleanly
        if launcher_rank()[1] in ("0", "?"):
            print_line(f"error: {e}")
        leave_process_group()
        sys.exit(DIVERGED)
    except SavedAndStopped:
        leave_process_group()
        sys.exit(128 + signal.SIGUSR1)
    except SystemExit:
        raise
    except BaseException as e:
        report_failure(e)
        exit_now(1)
