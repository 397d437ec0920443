"""A job whose rank fails ends in bounded time (training/launch/failure.py), through the real `deepspeed` launcher: a
rank that raises or hangs, or SIGTERM to the launcher, ends every rank, with the last checkpoint resumable; across
two simulated nodes, the job's abort key stops ranks whose failed peers keep their connections open."""
import os
import re
import signal
import subprocess
import time

import pytest

from harness import (
    FP32,
    PP2_DP2,
    REPO,
    free_port,
    job_env,
    launch,
    launch_cmd,
    launch_nodes,
    release_shm,
    two_node_hostfile,
)
from training.checkpoints import checkpoint

pytestmark = pytest.mark.launch  # several train.py processes per test (python -m pytest -m "not launch" skips them)

TIMEOUT_S = 10  # train.dist_timeout_s of the faulty jobs: ample for healthy ranks' collectives, short to wait out
FAULT = ["train.max_steps=50", f"train.dist_timeout_s={TIMEOUT_S}", *FP32]


def test_a_failed_rank_whose_connections_stay_open_stops_every_node_within_seconds(tmp_path, char_data):
    """Node 1's ranks (stage 1) report a failure in step 3 and keep their connections open for 10 s, as failed
    ranks can under NCCL: node 0's ranks see no broken connection and would wait for them for
    train.dist_timeout_s (300 s). The abort key the first of them set stops node 0's ranks in seconds."""
    hostfile = two_node_hostfile(tmp_path / "hostfile")
    start = time.monotonic()
    outputs = launch_nodes(hostfile, "tests/fault_train.py", [(tmp_path / "out", char_data)] * 2,
                           [*PP2_DP2, "train.max_steps=50", "train.dist_timeout_s=300"], timeout=280,
                           env={"MEGALITE_FAULT": "stall:2,3:3"})
    elapsed = time.monotonic() - start
    (node0, code0), (node1, code1) = outputs
    assert code0 != 0 and code1 != 0
    assert "failed while training step 3: RuntimeError: injected failure on rank 2" in node1
    # Node 0's ranks poll the key each on its own clock: the first to see it exits, and its launcher may stop the
    # other with SIGTERM before that one sees the key too. Each ends in seconds either way, saying why.
    aborted = r"stopped by the job's abort \(rank [23] \(.*\) failed while training step 3\) while training step 3"
    ends = {rank: re.search(rf"error: rank {rank} \(.*\) (stopped by SIGTERM while training step 3|{aborted})", node0)
            for rank in (0, 1)}
    assert all(ends.values()), node0[-3000:]
    assert any(re.fullmatch(aborted, end.group(1)) for end in ends.values()), node0[-3000:]
    assert elapsed < 120, f"the job took {elapsed:.0f} s"


def fault_run(tmp_path, char_data, fault: str, timeout: int) -> tuple[int, str, float, float]:
    """The faulty job's exit code, output, and seconds from its first training step (the last one before
    the fault) and from the first error line to the launcher's exit. However its ranks ended, they left nothing
    in /dev/shm."""
    port = free_port()
    cmd = launch_cmd(["--num_gpus", "2", "--master_port", str(port)], "tests/fault_train.py", "zero1.json", tmp_path,
                     char_data, FAULT)
    proc = subprocess.Popen(cmd, cwd=REPO, env=job_env({"MEGALITE_FAULT": fault}), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines, first_step, first_error, deadline = [], None, None, time.monotonic() + timeout
    try:
        for line in proc.stdout:  # the launcher closes its output when it exits
            lines.append(line)
            if first_step is None and line.startswith("step 1 |"):
                first_step = time.monotonic()
            if first_error is None and line.startswith("error:"):
                first_error = time.monotonic()
            assert time.monotonic() < deadline, "the job did not end:\n" + "".join(lines[-50:])
        proc.wait()
    finally:
        proc.kill()
        leaked = release_shm(port)
    end = time.monotonic()
    assert not leaked, f"DeepSpeed's shared-memory workspaces left behind: {leaked}"
    assert first_step is not None and first_error is not None, "".join(lines[-50:])
    return proc.returncode, "".join(lines), end - first_step, end - first_error


def test_a_rank_that_raises_ends_the_job_fast(tmp_path, char_data):
    code, output, since_training, since_error = fault_run(tmp_path, char_data, "raise:1:3", timeout=300)
    assert code != 0
    assert since_training < 60 and since_error < 30, f"ended {since_training:.0f} s after training began"
    assert "error: rank 1 (" in output and "failed while training step 3: RuntimeError: injected failure on " \
        "rank 1 at step 3" in output


def test_a_hanging_rank_ends_the_job_at_the_collective_timeout(tmp_path, char_data):
    """Rank 1 sleeps inside step 3; rank 0 waits for it in the step's all-reduce for train.dist_timeout_s (10 s)."""
    code, output, since_training, since_error = fault_run(tmp_path, char_data, "hang:1:3", timeout=300)
    assert code != 0
    # The timeout, the 5 s in which rank 0 waits for other ranks to time out too, and the launcher's stop.
    assert since_training < TIMEOUT_S + 5 + 15, f"the job ended {since_training:.0f} s after training began"
    assert "error: rank 0 (" in output and "timed out while training step 3" in output
    assert "rank(s) [1] did not time out within 5 s of them: those never reached the collective" in output
    # The hanging rank, stopped by the launcher or by the abort key rank 0 set, says where it was.
    assert re.search(r"error: rank 1 \(.*\) stopped by (SIGTERM|the job's abort \(.*\)) while training step 3", output)
    assert "time.sleep(3600)" in output


def test_a_rank_the_kernel_kills_ends_the_job_fast(tmp_path, char_data):
    """SIGKILL, as the OOM killer sends: nothing of the killed rank's own runs, yet the job ends and its
    shared memory is gone (fault_run)."""
    code, output, since_training, since_error = fault_run(tmp_path, char_data, "kill:1:3", timeout=300)
    assert code != 0
    assert since_training < 60 and since_error < 30, f"ended {since_training:.0f} s after training began"
    # The launcher names the first rank it finds ended: the killed one (-9), or rank 0, failed in its collective
    assert re.search(r"exits with return code = (-9|1)\n", output), output[-3000:]
    assert re.search(r"error: rank 0 \(.*\) (failed|stopped by SIGTERM) while training step 3", output), output[-3000:]


@pytest.mark.parametrize("target", ["runner", "process group"])
def test_sigterm_to_the_launcher_stops_every_rank_and_keeps_the_last_checkpoint(tmp_path, char_data, target):
    """`kill PID` of the deepspeed runner (which does not pass it on, on one node) or of its process group
    (Ctrl-C does that): every rank stops and the newest complete checkpoint resumes."""
    port = free_port()
    cmd = launch_cmd(["--num_gpus", "2", "--master_port", str(port)], "train.py", "zero1.json", tmp_path, char_data,
                     [*FP32, "train.max_steps=100000", "train.save_interval=2"])
    proc = subprocess.Popen(cmd, cwd=REPO, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    root = tmp_path / "checkpoints"
    try:
        deadline = time.time() + 240
        while len(checkpoint.complete_tags(root)) < 2 and time.time() < deadline:
            time.sleep(0.2)
        assert len(checkpoint.complete_tags(root)) >= 2, "no checkpoints were written"
        if target == "runner":
            os.kill(proc.pid, signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGTERM)
        stopped = time.time()
        while ranks_alive(tmp_path) and time.time() < stopped + 30:
            time.sleep(0.2)
        assert not ranks_alive(tmp_path), "ranks outlived the launcher"
        print(f"every rank stopped {time.time() - stopped:.1f} s after SIGTERM")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        output = proc.communicate()[0]
        release_shm(port)
    assert "stopped by" in output
    latest = (root / "latest").read_text().strip()
    resume_step = int(checkpoint.TAG.match(latest).group(1))
    resumed = launch(2, "zero1.json", tmp_path, char_data, [*FP32, f"train.max_steps={resume_step + 1}"])
    assert f"resumed from {root}/{latest} at step {resume_step}" in resumed.stdout


def ranks_alive(out_dir) -> bool:
    """Ranks of this run still running, found by their out_dir argument."""
    found = subprocess.run(["pgrep", "-f", f"train.out_dir={out_dir}"], capture_output=True, text=True).stdout
    return any(pid and int(pid) != os.getpid() for pid in found.split())
