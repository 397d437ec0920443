"""A mixture of experts' checkpoint converted to the universal format (training/checkpoints/experts.py) holds
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
@pytest.mark.parametrize("name,tag", [("ep2", "step_000002"), ("dp2", "step_000004"), ("ep2_dp4", "step_000002"),
                                      ("pp2", "step_000002"), ("z0_ep2", "step_000002")])
def test_conversion_holds_every_weight_and_moment_bit_for_bit(moe_runs, tmp_path, name, tag):
    """ep=2 (each rank's experts numbered from 0, one partition each), ep=1 x dp=2 (each expert group's states
    partitioned over both ranks), ep=2 x dp=4 (both), 2 pipeline stages (a stage's files each) and ep=2 without
    ZeRO (each expert-parallel rank's whole optimizer state): every parameter's fp32 weight and moments equal
    what the engines held."""
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


# Where a checkpoint saved at step 2 resumes: (the run that saved it, ranks, ds_config, settings); 1 rank: one
# process under ZeRO-0. "ep2": ep=2 x ZeRO-2; "pp2": 2 pipeline stages under ZeRO-1.
LAYOUTS = {
    "one": ("ep2", 1, "zero0.json", ["ds.gradient_accumulation_steps=2"]),
    "dp2_zero1": ("ep2", 2, "zero1.json", []),
    "pp2": ("ep2", 2, "pipe2.json", ["ds.gradient_accumulation_steps=2"]),
    "pp2_ep2": ("ep2", 4, "pipe2.json", ["ds.gradient_accumulation_steps=1", "ds.expert_parallel_size=2"]),
    # bf16: DeepSpeed's bf16 optimizers look up each expert group's process group by its name, which the
    # checkpoint's ep=2 must not carry to ep=1.
    "dp2_bf16": ("ep2", 2, "zero1.json", ["ds.bf16.enabled=true"]),
    "bias_one": ("bias_ep2", 1, "zero0.json", ["ds.gradient_accumulation_steps=2", "model.router_bias_rate=0.01",
                                               "model.router_aux_loss_coef=0"]),
    "from_pp2_one": ("pp2", 1, "zero0.json", ["ds.gradient_accumulation_steps=2"]),
    "from_pp2_ep2": ("pp2", 2, "zero2.json", ["ds.expert_parallel_size=2"]),
    "from_zero0_one": ("z0_ep2", 1, "zero0.json", ["ds.gradient_accumulation_steps=2"]),
    "from_zero0_dp2_zero1": ("z0_ep2", 2, "zero1.json", []),
}
# The run whose steps 3-4 a resumed one must take: the saving run's own, or (for one that stopped at step 2) the
# same run's under ZeRO-2.
GOES_ON_AS = {"z0_ep2": "ep2"}


@pytest.mark.launch
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_converted_checkpoint_resumes_on_another_layout(moe_runs, tmp_path, char_data, layout):
    """ep=2 x ZeRO-2 stopped at step 2, converted, resumed for steps 3-4 on one process (ZeRO-0, 2 accumulation
    steps), at ep=1 x dp=2 under ZeRO-1, over 2 pipeline stages, and over 2 stages of ep=2 (4 ranks); 2 pipeline
    stages converted and resumed on one process and at ep=2; ep=2 without ZeRO resumed on one process and at
    ep=1 x dp=2: steps 3-4 as the saving run took them (a micro-batch of 4 everywhere: the load-balancing loss is
    a micro-batch's); in bf16, within its rounding. With a biased router its bias comes along."""
    source, ranks, ds_config, settings = LAYOUTS[layout]
    args = [*MOE, "ds.train_micro_batch_size_per_gpu=4", *settings,
            f"train.resume={converted(moe_runs, source, 'step_000002', tmp_path)}"]
    out = tmp_path / "resumed"
    if ranks == 1:
        train_py(["--config", "configs/quickstart.yaml", "--ds_config", f"ds_configs/{ds_config}",
                  f"data.dir={char_data}", *TINY, *args, f"train.out_dir={out}"])
    else:
        launch(ranks, ds_config, out, char_data, args)
    resumed, reference = steps(out), steps(moe_runs[GOES_ON_AS.get(source, source)])[2:]
    assert [m["step"] for m in resumed] == [3, 4]
    keys = ("loss",) if "bf16" in layout else ROUTING + (("router_bias_max",) if source == "bias_ep2" else ())
    for key in keys:
        tolerance = 1e-3 if "bf16" in layout else 1e-5
        assert [m[key] for m in resumed] == pytest.approx([m[key] for m in reference], rel=tolerance), key


@pytest.mark.launch
def test_a_layout_change_without_conversion_says_how_to_convert(moe_runs, char_data):
    proc = train_py(["--config", "configs/quickstart.yaml", f"train.out_dir={moe_runs['ep2']}", f"data.dir={char_data}",
                     *TINY, *MOE, "train.max_steps=6"], check=False)
    assert proc.returncode == 2
    assert ("the checkpoint was saved at dp=2 x pp=1 x ep=2 with ZeRO-2, this run is dp=1 x pp=1 with ZeRO-0: its "
            "optimizer state only fits the old layout. Convert it first: python -m scripts.convert_checkpoint "
            f"universal --out_dir {moe_runs['ep2']} --tag step_000004") in proc.stderr


@pytest.mark.parametrize("layout,message", [
    ({"zero_stage": 0, "pp": 2, "tp": 1}, "/run/step_000002 is a mixture of experts' ZeRO-0 checkpoint over 2 "
     "pipeline stages, whose optimizer state no converter reads: resume it on its own layout (pp=2, tp=1, ZeRO-0), "
     "or train with ZeRO-1 to change the layout later"),
    ({"zero_stage": 1, "pp": 1, "tp": 2}, "/run/step_000002 is a mixture of experts' checkpoint at pp=1, tp=2, "
     "ZeRO-1: its experts convert from one tensor rank only. Resume it on its own layout, or train at tp=1 to "
     "change the layout later"),
])
def test_what_cannot_be_converted_is_named(layout, message):
    saved = {"layout": {"dp": 2, "ep": 2, **layout}, "config": {"model": {"n_experts": 4}}}
    assert unconvertible("/run/step_000002", saved) == message
