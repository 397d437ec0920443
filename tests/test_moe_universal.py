"""A mixture of experts' checkpoint converted to the universal format (training/checkpoints/universal_moe.py) holds
every weight and Adam moment its run held, bit for bit, an expert's under its global index, and resumes on
another layout (expert-parallel degree, data-parallel degree, ZeRO stage, pipeline stages) as the run would have
gone on: the same losses, router losses, expert loads and gradient norms. What cannot be converted is refused in
one line."""
import glob
import shutil

import pytest
import torch

from harness import TINY, launch, metrics, train_py, universal
from moe_runs import MOE
from training.checkpoints.universal import unconvertible

ROUTING = ("loss", "grad_norm", "lr", "moe_aux_loss", "router_z_loss", "expert_load_max", "expert_load_mean")


def converted(moe_runs, name: str, tag: str, tmp_path) -> str:
    shutil.copytree(moe_runs[name] / "checkpoints", tmp_path / "checkpoints")
    return universal(tmp_path, tag)


@pytest.mark.launch
@pytest.mark.parametrize("name,tag", [("ep2", "step_000002"), ("dp2", "step_000004"), ("ep2_dp4", "step_000002")])
def test_conversion_holds_every_weight_and_moment_bit_for_bit(moe_runs, tmp_path, name, tag):
    """ep=2 (each rank's experts numbered from 0, one partition each), ep=1 x dp=2 (each expert group's states
    partitioned over both ranks) and ep=2 x dp=4 (both): every parameter's fp32 weight and moments equal what the
    engines held."""
    folder = converted(moe_runs, name, tag, tmp_path)
    held = {}
    for path in glob.glob(str(moe_runs[f"{name}_held"] / "rank*.pt")):
        held.update(torch.load(path, weights_only=True))
    assert any(".deepspeed_experts.3." in key for key in held) and len(held) == 41
    assert sorted(held) == sorted(p.split("/")[-2] for p in glob.glob(f"{folder}/zero/*/fp32.pt"))
    for key, states in held.items():
        for state, tensor in states.items():
            assert torch.equal(torch.load(f"{folder}/zero/{key}/{state}.pt", weights_only=True)["param"], tensor), \
                (key, state)


def steps(out_dir) -> list[dict]:
    return [m for m in metrics(out_dir) if "loss" in m]


@pytest.mark.launch
@pytest.mark.parametrize("layout", ["one", "dp2_zero1", "pp2", "pp2_ep2", "bias_one"])
def test_a_converted_checkpoint_resumes_on_another_layout(moe_runs, tmp_path, char_data, layout):
    """ep=2 x ZeRO-2 stopped at step 2, converted, resumed for steps 3-4 on one process (ZeRO-0, 2 accumulation
    steps), at ep=1 x dp=2 under ZeRO-1, over 2 pipeline stages, and over 2 stages of ep=2 (4 ranks): steps 3-4
    as the ep=2 run took them (a micro-batch of 4 everywhere: the load-balancing loss is a micro-batch's). With
    a biased router its bias comes along (the one-process run's steps 3-4, bias included)."""
    source = "bias_ep2" if layout.startswith("bias") else "ep2"
    folder = converted(moe_runs, source, "step_000002", tmp_path)
    extra = ["model.router_bias_rate=0.01", "model.router_aux_loss_coef=0"] if layout.startswith("bias") else []
    args = [*MOE, *extra, "ds.train_micro_batch_size_per_gpu=4", f"train.resume={folder}"]
    out = tmp_path / "resumed"
    if layout == "dp2_zero1":
        launch(2, "zero1.json", out, char_data, args)
    elif layout == "pp2":
        launch(2, "pipe2.json", out, char_data, [*args, "ds.gradient_accumulation_steps=2"])
    elif layout == "pp2_ep2":
        launch(4, "pipe2.json", out, char_data, [*args, "ds.gradient_accumulation_steps=1",
                                                 "ds.expert_parallel_size=2"])
    else:
        train_py(["--config", "configs/quickstart.yaml", "--ds_config", "ds_configs/zero0.json",
                  f"data.dir={char_data}", *TINY, *args, "ds.gradient_accumulation_steps=2", f"train.out_dir={out}"])
    resumed, reference = steps(out), steps(moe_runs[source])[2:]
    assert [m["step"] for m in resumed] == [3, 4]
    for key in ROUTING + (("router_bias_max",) if extra else ()):
        assert [m[key] for m in resumed] == pytest.approx([m[key] for m in reference], rel=1e-5), key


@pytest.mark.launch
def test_a_layout_change_without_conversion_says_how_to_convert(moe_runs, char_data):
    proc = train_py(["--config", "configs/quickstart.yaml", f"train.out_dir={moe_runs['ep2']}", f"data.dir={char_data}",
                     *TINY, *MOE, "train.max_steps=6"], check=False)
    assert proc.returncode == 2
    assert ("the checkpoint was saved at dp=2 x pp=1 x ep=2 with ZeRO-2, this run is dp=1 x pp=1 with ZeRO-0: its "
            "optimizer state only fits the old layout. Convert it first: python -m scripts.convert_checkpoint "
            f"universal --out_dir {moe_runs['ep2']} --tag step_000004") in proc.stderr


@pytest.mark.parametrize("layout,message", [
    ({"zero_stage": 0, "pp": 1, "tp": 1}, "/run/step_000002 is a mixture of experts' ZeRO-0 checkpoint, whose "
     "optimizer state no converter reads: resume it on its own layout (pp=1, tp=1, ZeRO-0), or train with ZeRO-1 "
     "or 2 (ds_configs/zero2.json) to change the layout later"),
    ({"zero_stage": 1, "pp": 2, "tp": 1}, "/run/step_000002 is a mixture of experts' checkpoint at pp=2, tp=1, "
     "ZeRO-1: its experts convert from one pipeline stage and one tensor rank only. Resume it on its own layout, or "
     "train at pp=1, tp=1 to change the layout later"),
])
def test_what_cannot_be_converted_is_named(layout, message):
    saved = {"layout": {"dp": 2, "ep": 2, **layout}, "config": {"model": {"n_experts": 4}}}
    assert unconvertible("/run/step_000002", saved) == message
