"""One run an out_dir: a run's rank 0 holds an exclusive lock on <out_dir>/run.lock while it runs, so a second run
started on the same folder (a job submitted twice, a requeued job whose first copy still runs) is refused at start,
before it writes, rewinds or deletes anything of the first one's. The kernel drops the lock when its process ends,
however it ends (SIGKILL included): a crashed run leaves no stale lock. The file keeps the holder's words for the
refusal, and stays after the run."""
import fcntl
import os
import socket
import time

LOCK = "run.lock"
HELD: dict[str, int] = {}  # out_dir's real path -> the open file that holds its lock, for this process's lifetime


def take(out_dir: str) -> str | None:
    """Lock `out_dir` for this process (again, if it holds it already: an in-process run after another): None,
    else who holds it. A file system without locks (some Lustre mounts refuse flock) locks nothing."""
    where = os.path.realpath(out_dir)
    if where in HELD:
        return None
    fd = os.open(os.path.join(where, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 1024).decode(errors="replace").strip()
        os.close(fd)
        return holder or "another process"
    except OSError:  # ENOLCK, EOPNOTSUPP: no locks on this file system
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode())
    HELD[where] = fd
    return None


def refusal(out_dir: str, holder: str) -> str:
    return (f"train.out_dir {out_dir} is in use by another run ({holder}): two runs in one folder would overwrite "
            f"each other's checkpoints and metrics; fix: let that run end (or stop it), or set train.out_dir to "
            f"another folder")
