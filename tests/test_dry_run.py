"""`python preflight.py --dry_run` (training/dry_run.py): a layout of 1,024 ranks checked without starting any:
DeepSpeed's topology's groups (tensor groups inside a node, pipelines, experts'), the stage boundaries and each
rank's parameters counted on the meta device; with --gpu_gb the memory plan against the GPUs, the planner's
choice named where it does not fit; what cannot run is one line."""
import os
import re

import pytest

from harness import REPO
from ranks import run_tool
from training.config import load_run_config
from training.ds_config import load_ds_config
from training.memory_plan import GB, plan

LLAMA_405B = ["--config", "configs/llama3.1_405b.yaml", "--ds_config", "ds_configs/llama3_405b_tp8_pp16.json"]


def dry_run(*argv: str, world: int = 1024, per_node: int = 8):
    return run_tool("preflight", ["--dry_run", "--world", str(world), "--gpus_per_node", str(per_node), *argv],
                    {}, 120)


def groups(stdout: str, axis: str) -> tuple[int, int, str, list[str]]:
    """(how many, of how many ranks, where, each group) of an axis' line."""
    count, size, where, lists = re.search(rf"^{axis} groups: (\d+) of (\d+), ([^:]+): (.*)$", stdout, re.M).groups()
    return int(count), int(size), where, lists.split()


def stages(stdout: str) -> list[tuple[str, str, int]]:
    return [(layers, ranks, int(held.replace(",", ""))) for layers, ranks, held in
            re.findall(r"^stage \d+: layers (\S+) .* on ranks (\S+): ([\d,]+) parameters per rank$", stdout, re.M)]


def test_the_llama_3_paper_layout_of_405b_on_1024_ranks():
    proc = dry_run(*LLAMA_405B)
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.splitlines()[0]
    assert first == ("dry run: world 1024 = dp 8 x pp 16 x tp 8 (sequence split); global batch 128 = micro 1 x accum "
                     "16 x dp 8; ZeRO-1; 128 nodes of 8")
    count, size, where, tensor = groups(proc.stdout, "tensor")
    assert (count, size, where, tensor[:2], tensor[-1]) == (128, 8, "each inside one node", ["[0-7]", "[8-15]"],
                                                           "[1016-1023]")
    assert groups(proc.stdout, "data")[:3] == (128, 8, "across nodes") and groups(proc.stdout, "data")[3][0] == \
        "[0-56/8]"
    assert groups(proc.stdout, "pipeline")[:3] == (64, 16, "across nodes")
    assert groups(proc.stdout, "pipeline")[3][:2] == ["[0-960/64]", "[1-961/64]"]
    held = stages(proc.stdout)
    assert [(layers, ranks) for layers, ranks, _ in held][::15] == [("0-7", "0-63"), ("120-128", "960-1023")]


def test_the_stages_hold_every_parameter_once():
    """Without tensor parallelism a rank holds its stage's parameters whole: the stages add up to the model."""
    held = stages(dry_run(*LLAMA_405B, "ds.tensor_model_parallel_size=1", "ds.tensor_sequence_parallel=false").stdout)
    assert len(held) == 16 and sum(n for _, _, n in held) == 405_853_388_800


def test_zero3_partitions_the_parameters_over_every_rank():
    proc = dry_run("--config", "configs/llama3.1_8b.yaml", "--ds_config", "ds_configs/llama3_8b_zero3.json")
    assert stages(proc.stdout) == [("0-34", "0-1023", round(8_030_261_248 / 1024))]


def test_expert_groups_are_deepspeeds():
    proc = dry_run("--config", "configs/llama_quickstart_moe.yaml", "--ds_config", "ds_configs/zero2.json",
                   "ds.expert_parallel_size=8", "model.n_experts=16", "model.vocab_size=65")
    assert proc.returncode == 0, proc.stderr
    assert groups(proc.stdout, "expert")[:3] == (128, 8, "each inside one node")
    assert groups(proc.stdout, "expert")[3][:2] == ["[0-7]", "[8-15]"]
    assert groups(proc.stdout, "expert-data")[:3] == (8, 128, "across nodes")
    assert groups(proc.stdout, "expert-data")[3][:2] == ["[0-1016/8]", "[1-1017/8]"]


def test_a_layout_over_the_gpus_memory_names_the_planners_choice():
    """With --gpu_gb the memory plan's figure is checked against the GPUs: 8B at micro-batch 12 x 8,192 tokens
    under ZeRO-1 on 8 GPUs does not fit 80 GB ones, and the refusal names a layout of the same batch that does."""
    cfg = load_run_config(os.path.join(REPO, "configs", "llama3.1_8b.yaml"), [])
    needed = plan(cfg.model, load_ds_config(os.path.join(REPO, "ds_configs", "zero1.json"), []), 8)["total"]
    proc = dry_run("--config", "configs/llama3.1_8b.yaml", "--ds_config", "ds_configs/zero1.json", "--gpu_gb", "80",
                   world=8)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith(f"error: this layout needs {needed / GB:.1f} GB a GPU by the memory plan, over "
                                  f"90% of 80 GB; the planner would choose dp ")
    assert "(python -m scripts.memory_plan --plan --gpus 8 --global_batch 96)" in proc.stderr
    fits = dry_run(*LLAMA_405B, "--gpu_gb", "80")
    assert fits.returncode == 0 and re.search(r"^memory: [\d.]+ GB a GPU by the memory plan, within 90% of 80 GB$",
                                              fits.stdout, re.M), fits.stdout


@pytest.mark.parametrize("argv,per_node,message", [
    (LLAMA_405B, 4, "error: tensor group [0-7] spans nodes [0, 1]: its all-reduces run in every layer and need a "
                    "node's links; fix: a tensor_model_parallel_size that divides --gpus_per_node 4"),
    (["--config", "configs/llama_quickstart.yaml"], 8, "error: --dry_run counts parameters: model.vocab_size is "
                                                       "unset (a run takes it from its dataset); fix: pass "
                                                       "model.vocab_size=N"),
    ([*LLAMA_405B, "ds.pipeline.stages=200"], 8, "error: 200 pipeline stages"),
    ([*LLAMA_405B, "--gpu_gb", "0"], 8, "error: --gpu_gb 0.0: must be > 0 (a GPU's memory in GB); fix: e.g. "
                                        "--gpu_gb 80, or leave it out to take the GPU's own"),
])
def test_what_cannot_run_is_one_line(argv, per_node, message):
    proc = dry_run(*argv, per_node=per_node)
    assert proc.returncode == 2 and proc.stderr.startswith(message), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
