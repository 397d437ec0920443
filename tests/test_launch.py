"""Launching across nodes, simulated on this machine, and jobs that fail fast: two launchers with --no_ssh
form one world, pdsh over ssh to a loopback sshd does the same, the preflight catches a node without data,
and a rank that raises, hangs or is signalled ends the whole job in bounded time."""
import os
import re
import shutil
import signal
import socket
import subprocess
import time

import pytest

from conftest import FP32, ONE_THREAD, REPO, free_port, launch, launch_cmd, release_shm, train_losses
from training import checkpoint

pytestmark = pytest.mark.launch  # several train.py processes per test (python -m pytest -m "not launch" skips them)

# pp=2 x dp=2 over two "nodes" of two ranks each; global batch 8 = micro 2 x accum 2 x dp 2.
PIPE = ["model.n_layer=4", "train.max_steps=4", "optim.warmup_steps=2", "optim.lr=3e-3",
        "ds.train_micro_batch_size_per_gpu=2", "ds.gradient_accumulation_steps=2", *FP32]
FAULT = ["train.max_steps=50", "train.dist_timeout_s=15", *FP32]


def two_node_hostfile(path, hosts=("node0", "node1")) -> str:
    path.write_text("".join(f"{host} slots=2\n" for host in hosts))
    return str(path)


def launch_nodes(hostfile: str, script: str, nodes: list[tuple], overrides=(), timeout=600, env=None) -> list[tuple]:
    """One launcher per node, as a user without ssh starts them: `deepspeed --hostfile H --no_ssh
    --node_rank K --master_addr ADDR ...` on each; they meet at the master address. `nodes` holds each
    node's (out_dir, data_dir); returns each launcher's (output, exit code)."""
    port = str(free_port())
    cmds = [launch_cmd(["--hostfile", hostfile, "--no_ssh", "--node_rank", str(node), "--master_addr", "127.0.0.1",
                        "--master_port", port], script, "pipe2.json", out_dir, data_dir, overrides)
            for node, (out_dir, data_dir) in enumerate(nodes)]
    env = {**os.environ, **ONE_THREAD, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1", **(env or {})}
    procs = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd in cmds]
    try:
        return [(proc.communicate(timeout=timeout)[0], proc.returncode) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
        release_shm(cmds[0])


@pytest.fixture(scope="module")
def one_launcher_losses(tmp_path_factory, char_data):
    out = tmp_path_factory.mktemp("one_launcher")
    launch(4, "pipe2.json", out, char_data, PIPE)
    return train_losses(out)


def test_two_launchers_without_ssh_train_like_one(tmp_path, char_data, one_launcher_losses):
    hostfile = two_node_hostfile(tmp_path / "hostfile")
    outputs = launch_nodes(hostfile, "train.py", [(tmp_path / "out", char_data)] * 2, PIPE)
    assert [code for _, code in outputs] == [0, 0], outputs[0][0][-3000:] + outputs[1][0][-3000:]
    losses = train_losses(tmp_path / "out")
    assert len(losses) == 4 and losses == pytest.approx(one_launcher_losses, abs=1e-5)
    node0 = outputs[0][0]
    assert "world 4 = dp 2 x pp 2" in node0  # rank 0's topology: stage 0 on node 0, stage 1 on node 1
    assert "stage 0: layers 0-3 (TokenEmbedding, PositionEmbedding, Block x2) on ranks [0, 1]" in node0
    assert "stage 1: layers 4-7 (Block x2, LayerNorm, TokenEmbedding) on ranks [2, 3]" in node0


def test_preflight_fails_ranks_that_share_a_gpu():
    from preflight import shared_devices
    gpu = "cuda:{} (NVIDIA H100 80GB HBM3, GPU-{}, NCCL 2.21.5)"
    reports = [{"rank": 0, "host": "a", "device": gpu.format(0, "aaa")},
               {"rank": 1, "host": "a", "device": gpu.format(0, "aaa")},
               {"rank": 2, "host": "b", "device": gpu.format(0, "aaa")},
               {"rank": 3, "host": "b", "device": gpu.format(1, "bbb")},
               {"rank": 4, "host": "c", "device": "cpu"}, {"rank": 5, "host": "c", "device": "cpu"}]
    assert shared_devices(reports) == [("GPU shared by ranks [0, 1]: give each rank its own GPU (--num_gpus, "
                                        "--include, or CUDA_VISIBLE_DEVICES)", [0, 1])]


def test_a_failed_rank_whose_connections_stay_open_stops_every_node_within_seconds(tmp_path, char_data):
    """Node 1's ranks (stage 1) report a failure in step 3 and keep their connections open for 30 s, as failed
    ranks can under NCCL: node 0's ranks see no broken connection and would wait for them for
    train.dist_timeout_s (300 s). The abort key the first of them set stops node 0's ranks in seconds."""
    hostfile = two_node_hostfile(tmp_path / "hostfile")
    start = time.monotonic()
    outputs = launch_nodes(hostfile, "tests/fault_train.py", [(tmp_path / "out", char_data)] * 2,
                           [*PIPE, "train.max_steps=50", "train.dist_timeout_s=300"], timeout=280,
                           env={"MEGALITE_FAULT": "stall:2,3:3"})
    elapsed = time.monotonic() - start
    (node0, code0), (node1, code1) = outputs
    assert code0 != 0 and code1 != 0
    assert "failed while training step 3: RuntimeError: injected failure on rank 2" in node1
    for rank in (0, 1):
        assert re.search(rf"error: rank {rank} \(.*\) stopped by the job's abort \(rank [23] \(.*\) failed while "
                         rf"training step 3\) while training step 3", node0), node0[-3000:]
    assert elapsed < 120, f"the job took {elapsed:.0f} s"


def test_preflight_passes_on_two_nodes_and_names_a_node_without_data(tmp_path, char_data):
    hostfile = two_node_hostfile(tmp_path / "hostfile")
    out = launch_nodes(hostfile, "preflight.py", [(tmp_path / "out", char_data)] * 2)
    assert [code for _, code in out] == [0, 0], out[1][0][-5000:]
    assert "preflight: world 4 = dp 2 x pp 2" in out[0][0] and "preflight passed" in out[0][0]
    assert out[0][0].count(": ok\n") == 4 and "writable and shared by every rank" in out[0][0]
    busbw = re.search(r"all-reduce bus bandwidth: ([\d.]+) GB/s \(16 MB fp32, rank 0's best of 5\)", out[0][0])
    assert busbw and float(busbw[1]) > 0, out[0][0][-2000:]

    missing = tmp_path / "not_on_node1"
    out = launch_nodes(hostfile, "preflight.py", [(tmp_path / "out", char_data), (tmp_path / "out", missing)])
    assert [code for _, code in out] == [1, 1]
    report = out[0][0]
    assert "preflight FAILED on 2 of 4 ranks" in report
    for rank in (2, 3):  # node 1's ranks, each with the fix
        assert f"rank    {rank} on " in report
    assert report.count(f"FAIL: data: no prepared dataset in {missing} (meta.json missing); prepare it with: "
                        f"python -m data.prepare") == 2
    assert report.count(": ok\n") == 2


def test_preflight_names_an_out_dir_that_is_not_shared(tmp_path, char_data):
    """Node 1 writes elsewhere: what a node-local disk looks like to a multi-node job."""
    hostfile = two_node_hostfile(tmp_path / "hostfile")
    (report, code), _ = launch_nodes(hostfile, "preflight.py", [(tmp_path / f"node{node}_disk", char_data)
                                                                 for node in (0, 1)])
    assert code == 1
    assert report.count(f"FAIL: train.out_dir {tmp_path / 'node1_disk'} is not shared with rank 0") == 2


@pytest.fixture
def loopback_sshd(tmp_path):
    """An sshd on 127.0.0.1 that lets this user in with a fresh key: the ssh half of a pdsh launch."""
    sshd = shutil.which("sshd") or "/usr/sbin/sshd"
    missing = [name for name, found in [("sshd (Debian: openssh-server)", os.path.exists(sshd)),
                                        ("pdsh (Debian: pdsh)", shutil.which("pdsh")), ("ssh", shutil.which("ssh"))]
               if not found]
    if missing:
        # CI installs them (.ci/run): there, a missing one is a broken CI machine, not a reason to skip.
        (pytest.fail if os.environ.get("CI") == "true" else pytest.skip)(
            f"the pdsh launch test needs {' and '.join(missing)}; .ci/run installs them with apt-get")
    keys = tmp_path / "ssh"
    keys.mkdir()
    for key in ("host_key", "user_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / key)], check=True)
    shutil.copy(keys / "user_key.pub", keys / "authorized_keys")
    try:
        os.makedirs("/run/sshd", exist_ok=True)  # its privilege-separation directory
    except PermissionError:
        (pytest.fail if os.environ.get("CI") == "true" else pytest.skip)(
            "sshd needs /run/sshd, which only root can create here")
    port = free_port()
    server = subprocess.Popen([sshd, "-D", "-e", "-f", "/dev/null", "-p", str(port), "-o", "ListenAddress=127.0.0.1",
                               "-o", f"HostKey={keys / 'host_key'}",
                               "-o", f"AuthorizedKeysFile={keys / 'authorized_keys'}",
                               "-o", "StrictModes=no", "-o", "PasswordAuthentication=no"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 20
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.1)
    else:
        server.kill()
        pytest.fail(f"sshd did not start: {server.communicate()[1]}")
    yield port, f"-i {keys / 'user_key'} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o BatchMode=yes"
    server.kill()
    server.wait()


def test_pdsh_over_ssh_trains_like_one_launcher(tmp_path, char_data, loopback_sshd, one_launcher_losses):
    """`deepspeed --hostfile` with two hosts that are both this machine, reached through ssh by pdsh; what the
    ranks need in their environment travels in a .deepspeed_env file (named by DS_ENV_FILE here)."""
    port, ssh_args = loopback_sshd
    hostfile = two_node_hostfile(tmp_path / "hostfile", hosts=("localhost", "127.0.0.1"))
    env_file = tmp_path / "deepspeed_env"
    env_file.write_text("OMP_NUM_THREADS=1\nWANDB_MODE=disabled\n")
    cmd = launch_cmd(["--hostfile", hostfile, "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
                      "--ssh_port", str(port), "--no_ssh_check"], "train.py", "pipe2.json", tmp_path / "out", char_data,
                     PIPE)
    env = {**os.environ, "PDSH_SSH_ARGS_APPEND": ssh_args, "DS_ENV_FILE": str(env_file)}
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    finally:
        release_shm(cmd)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-5000:]
    assert "pdsh -S -f 1024 -w localhost,127.0.0.1" in output  # DeepSpeed's own pdsh runner did the launch
    assert "export OMP_NUM_THREADS=1; export WANDB_MODE=disabled;" in output  # the env file travelled
    assert train_losses(tmp_path / "out") == pytest.approx(one_launcher_losses, abs=1e-5)


def fault_run(tmp_path, char_data, fault: str, timeout: int) -> tuple[int, str, float, float]:
    """The faulty job's exit code, output, and seconds from its first training step (the last one before
    the fault) and from the first error line to the launcher's exit."""
    cmd = launch_cmd(["--num_gpus", "2", "--master_port", str(free_port())], "tests/fault_train.py", "zero1.json",
                     tmp_path, char_data, FAULT)
    env = {**os.environ, **ONE_THREAD, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1", "MEGALITE_FAULT": fault}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
        release_shm(cmd)
    end = time.monotonic()
    assert first_step is not None and first_error is not None, "".join(lines[-50:])
    return proc.returncode, "".join(lines), end - first_step, end - first_error


def test_a_rank_that_raises_ends_the_job_fast(tmp_path, char_data):
    code, output, since_training, since_error = fault_run(tmp_path, char_data, "raise:1:3", timeout=300)
    assert code != 0
    assert since_training < 60 and since_error < 30, f"ended {since_training:.0f} s after training began"
    assert "error: rank 1 (" in output and "failed while training step 3: RuntimeError: injected failure on " \
        "rank 1 at step 3" in output


def test_a_hanging_rank_ends_the_job_at_the_collective_timeout(tmp_path, char_data):
    """Rank 1 sleeps inside step 3; rank 0 waits for it in the step's all-reduce for train.dist_timeout_s (15 s)."""
    code, output, since_training, since_error = fault_run(tmp_path, char_data, "hang:1:3", timeout=300)
    assert code != 0
    # The timeout, the 5 s in which rank 0 waits for other ranks to time out too, and the launcher's stop.
    assert since_training < 15 + 5 + 15, f"the job ended {since_training:.0f} s after training began"
    assert "error: rank 0 (" in output and "timed out while training step 3" in output
    assert "rank(s) [1] did not time out within 5 s of them: those never reached the collective" in output
    # The hanging rank, stopped by the launcher or by the abort key rank 0 set, says where it was.
    assert re.search(r"error: rank 1 \(.*\) stopped by (SIGTERM|the job's abort \(.*\)) while training step 3", output)
    assert "time.sleep(3600)" in output


@pytest.mark.parametrize("target", ["runner", "process group"])
def test_sigterm_to_the_launcher_stops_every_rank_and_keeps_the_last_checkpoint(tmp_path, char_data, target):
    """`kill PID` of the deepspeed runner (which does not pass it on, on one node) or of its process group
    (Ctrl-C does that): every rank stops and the newest complete checkpoint resumes."""
    cmd = launch_cmd(["--num_gpus", "2", "--master_port", str(free_port())], "train.py", "zero1.json", tmp_path,
                     char_data, [*FP32, "train.max_steps=100000", "train.save_interval=2"])
    env = {**os.environ, **ONE_THREAD, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
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
        release_shm(cmd)
    assert "stopped by" in output
    latest = (root / "latest").read_text().strip()
    resume_step = int(checkpoint.TAG.match(latest).group(1))
    resumed = launch(2, "zero1.json", tmp_path, char_data, [*FP32, f"train.max_steps={resume_step + 1}"])
    assert f"resumed from {root}/{latest} at step {resume_step}" in resumed.stdout


def ranks_alive(out_dir) -> bool:
    """Ranks of this run still running, found by their out_dir argument."""
    found = subprocess.run(["pgrep", "-f", f"train.out_dir={out_dir}"], capture_output=True, text=True).stdout
    return any(pid and int(pid) != os.getpid() for pid in found.split())
