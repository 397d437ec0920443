"""Two nodes simulated on this machine, two ranks each: two `deepspeed` launchers with --no_ssh form one world,
and pdsh over ssh to a loopback sshd does the same; each trains pp=2 x dp=2 with the losses of one 4-process
launcher."""
import os
import shutil
import socket
import subprocess
import time

import pytest
from torch.utils.cpp_extension import _get_build_directory

from harness import (
    PP2_DP2,
    REPO,
    free_port,
    launch,
    launch_cmd,
    launch_nodes,
    release_shm,
    train_losses,
    two_node_hostfile,
)

pytestmark = pytest.mark.launch  # several train.py processes per test (python -m pytest -m "not launch" skips them)


@pytest.fixture(scope="module")
def one_launcher_losses(tmp_path_factory, char_data):
    out = tmp_path_factory.mktemp("one_launcher")
    launch(4, "pipe2.json", out, char_data, PP2_DP2)
    return train_losses(out)


def test_two_launchers_without_ssh_train_like_one(tmp_path, char_data, one_launcher_losses):
    hostfile = two_node_hostfile(tmp_path / "hostfile")
    outputs = launch_nodes(hostfile, "train.py", [(tmp_path / "out", char_data)] * 2, PP2_DP2)
    assert [code for _, code in outputs] == [0, 0], outputs[0][0][-3000:] + outputs[1][0][-3000:]
    losses = train_losses(tmp_path / "out")
    assert len(losses) == 4 and losses == pytest.approx(one_launcher_losses, abs=1e-5)
    node0 = outputs[0][0]
    assert "world 4 = dp 2 x pp 2" in node0  # rank 0's topology: stage 0 on node 0, stage 1 on node 1
    assert "stage 0: layers 0-3 (TokenEmbedding, PositionEmbedding, Block x2) on ranks [0, 1]" in node0
    assert "stage 1: layers 4-7 (Block x2, FinalLayerNorm, TokenEmbedding) on ranks [2, 3]" in node0


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
    # PATH as a user sets it for the nodes: ssh's own would give the ranks the system's ninja, and a ninja of
    # another version rebuilds each of DeepSpeed's JIT ops the other one built
    env_file.write_text(f"OMP_NUM_THREADS=1\nWANDB_MODE=disabled\nPATH={os.environ['PATH']}\n")
    master_port = free_port()
    cmd = launch_cmd(["--hostfile", hostfile, "--master_addr", "127.0.0.1", "--master_port", str(master_port),
                      "--ssh_port", str(port), "--no_ssh_check"], "train.py", "pipe2.json", tmp_path / "out", char_data,
                     PP2_DP2)
    env = {**os.environ, "PDSH_SSH_ARGS_APPEND": ssh_args, "DS_ENV_FILE": str(env_file)}
    shm_op = os.path.join(_get_build_directory("deepspeed_shm_comm", verbose=False), "deepspeed_shm_comm.so")
    built = os.stat(shm_op).st_mtime_ns
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    finally:
        release_shm(master_port)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-5000:]
    assert "pdsh -S -f 1024 -w localhost,127.0.0.1" in output  # DeepSpeed's own pdsh runner did the launch
    assert "export OMP_NUM_THREADS=1; export WANDB_MODE=disabled;" in output  # the env file travelled
    assert os.stat(shm_op).st_mtime_ns == built, "the ranks rebuilt DeepSpeed's shm op the one-launcher run built"
    assert train_losses(tmp_path / "out") == pytest.approx(one_launcher_losses, abs=1e-5)
