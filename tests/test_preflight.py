"""preflight.py on two nodes simulated on this machine: it passes where every rank reads the data and writes
to one shared train.out_dir, and names each rank of a node without the data or with a disk of its own; ranks
that share a GPU fail it; a layout over the GPUs' memory by the memory plan fails it, and one whose checkpoints
cannot fit out_dir's disk."""
import re

import pytest

from harness import launch_nodes, two_node_hostfile
from ranks import run_tool

pytestmark = pytest.mark.launch  # several train.py processes per test (python -m pytest -m "not launch" skips them)


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


def test_preflight_passes_on_two_nodes_and_names_a_node_without_data(tmp_path, char_data):
    hostfile = two_node_hostfile(tmp_path / "hostfile")
    out = launch_nodes(hostfile, "preflight.py", [(tmp_path / "out", char_data)] * 2)
    assert [code for _, code in out] == [0, 0], out[1][0][-5000:]
    assert "preflight: world 4 = dp 2 x pp 2" in out[0][0] and "preflight passed" in out[0][0]
    assert out[0][0].count(": ok\n") == 4 and "writable and shared by every rank" in out[0][0]
    assert list((tmp_path / "out").iterdir()) == []  # no probe left behind
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


def test_preflight_checks_the_memory_plan_against_the_gpus(tmp_path, char_data):
    """--gpu_gb (a GPU's own memory by default, none on a CPU): the memory plan's figure, and a layout over the
    GPUs' memory failed with the planner's word on it."""
    argv = ["--config", "configs/llama_quickstart.yaml", "--ds_config", "ds_configs/zero0.json",
            f"data.dir={char_data}", f"train.out_dir={tmp_path}"]
    fits = run_tool("preflight", [*argv, "--gpu_gb", "80"], {}, 120)
    assert fits.returncode == 0 and "\nmemory: 0.0 GB a GPU by the memory plan, within 90% of 80 GB\n" in fits.stdout
    over = run_tool("preflight", [*argv, "--gpu_gb", "0.000001"], {}, 120)
    assert over.returncode == 1 and ("cpu: FAIL: this layout needs 0.0 GB a GPU by the memory plan, over 90% of "
                                     "1e-06 GB; no layout of this batch fits them: add GPUs or lower the batch"
                                     ) in over.stdout
    assert "memory:" not in run_tool("preflight", argv, {}, 120).stdout  # a CPU's memory is not planned


def test_preflight_names_a_disk_too_small_for_the_runs_checkpoints(tmp_path, char_data):
    """A 206B-parameter GPT (counted on the meta device, never built) writes 2.89 TB a checkpoint in bf16 (asked for
    by name: "auto" takes fp32 on a CPU without bf16 arithmetic): more than this machine's disk, which the
    quickstart's 9.8 MB checkpoints fit."""
    argv = ["--ds_config", "ds_configs/zero0.json", f"data.dir={char_data}", f"train.out_dir={tmp_path}"]
    assert run_tool("preflight", argv, {}, 120).returncode == 0
    big = run_tool("preflight", [*argv, "model.n_embd=16384", "model.n_layer=64", "model.n_head=128",
                                      "ds.bf16.enabled=true"], {}, 120)
    assert big.returncode == 1
    assert re.search(rf"cpu: FAIL: the checkpoints this run writes need 5\.77 TB more in {tmp_path}/checkpoints "
                     rf"\(2 at once: 2\.89 TB each, 14 bytes a parameter\), where the disk has [\d.]+ [GT]B free; "
                     rf"fix: free space there, lower train.keep_checkpoints \(now 3\)", big.stdout), big.stdout
