"""Pipeline parallelism through the real launcher, for the GPT and the encoder stack: losses equal the
plain (pp=1) build step for step, the tie holds across stages, and bad layouts fail before training."""
import os

import pytest

from common.checks import ConfigError
from harness import BF16, FP32, grad_norms, launch, metrics, train_losses
from model import ARCHITECTURES, model_layers
from model.config import ModelConfig
from model.gpt import Block
from training.topology import Layout, describe_stages, pipeline_settings, resolve_layout, stage_partition

pytestmark = pytest.mark.launch  # several train.py processes per test (python -m pytest -m "not launch" skips them)

ARCHS = {"gpt": "quickstart.yaml", "encoder": "encoder_tiny.yaml"}
# Global batch 8 in every layout: micro 2 x accumulation (8 / 2 / dp).
FAST = ["model.n_layer=4", "train.max_steps=6", "optim.warmup_steps=2", "optim.lr=3e-3",
        "ds.train_micro_batch_size_per_gpu=2", *FP32]


def run_layout(tmp_path_factory, char_data, arch: str, stages: int, dp: int, extra=()):
    out = tmp_path_factory.mktemp(f"{arch}_pp{stages}_dp{dp}")
    launch(stages * dp, "pipe2.json", out, char_data,
           [*FAST, f"ds.pipeline.stages={stages}", f"ds.gradient_accumulation_steps={4 // dp}", *extra],
           config=ARCHS[arch])
    return out


@pytest.fixture(scope="module")
def plain_runs(tmp_path_factory, char_data):
    """The pp=1 reference: the plain module on one process."""
    return {arch: run_layout(tmp_path_factory, char_data, arch, 1, 1) for arch in ARCHS}


@pytest.fixture(scope="module")
def plain(plain_runs):
    return {arch: train_losses(out) for arch, out in plain_runs.items()}


# pp3 runs without ZeRO: DeepSpeed's fp32 clip_grad_norm_ once counted only the first stage's weights there.
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("stages,dp,zero", [(2, 1, 1), (3, 1, 0), (2, 2, 1)], ids=["pp2", "pp3-zero0", "pp2xdp2"])
def test_pipeline_losses_and_grad_norms_equal_plain_ones(tmp_path_factory, char_data, plain_runs, plain, arch,
                                                         stages, dp, zero):
    out = run_layout(tmp_path_factory, char_data, arch, stages, dp, [f"ds.zero_optimization.stage={zero}"])
    losses = train_losses(out)
    assert len(losses) == 6
    assert losses == pytest.approx(plain[arch], abs=1e-5)
    assert grad_norms(out) == pytest.approx(grad_norms(plain_runs[arch]), abs=1e-5)
    assert plain[arch][-1] < plain[arch][0] - 0.1  # the reference really trains
    if arch == "gpt":  # the tied embedding (first stage) and LM head (last stage) stayed bitwise equal
        assert [m["tied_weights_in_sync"] for m in metrics(out) if "tied_weights_in_sync" in m] == [True]


def test_four_stages_start_from_the_same_weights(tmp_path_factory, char_data, plain):
    """Layer-seeded init: pp=4 (one block per stage) trains exactly like pp=1."""
    assert train_losses(run_layout(tmp_path_factory, char_data, "gpt", 4, 1)) == pytest.approx(plain["gpt"], abs=1e-5)


@pytest.mark.parametrize("arch,stages", [("gpt", 2), ("encoder", 1)])
def test_activation_checkpointing_changes_no_loss(tmp_path_factory, char_data, plain, arch, stages):
    reference = plain[arch] if stages == 1 else train_losses(run_layout(tmp_path_factory, char_data, arch, stages, 1))
    out = run_layout(tmp_path_factory, char_data, arch, stages, 1, ["ds.pipeline.activation_checkpoint_interval=1"])
    assert train_losses(out) == pytest.approx(reference, abs=1e-5)


def test_bf16_pipeline_trains_with_the_tie_bitwise_equal(tmp_path, char_data):
    """In bf16: DeepSpeed's bf16 optimizer steps each stage's copy of the tied embedding from the same
    all-reduced gradient, so the 16-bit copies stay bitwise equal."""
    launch(2, "pipe2.json", tmp_path, char_data, [*BF16, "train.max_steps=20", "optim.warmup_steps=2", "optim.lr=3e-3"])
    losses = train_losses(tmp_path)
    assert len(losses) == 20 and sum(losses[-3:]) / 3 < losses[0] - 0.5
    assert [m["tied_weights_in_sync"] for m in metrics(tmp_path) if "tied_weights_in_sync" in m] == [True]


def test_world_not_divisible_by_stages_fails_on_every_rank_before_training(tmp_path, char_data):
    proc = launch(3, "pipe2.json", tmp_path, char_data, check=False, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "2 pipeline stages do not divide the world size 3" in output and "step 0" not in output
    assert not os.path.exists(tmp_path / "metrics.jsonl")


# Layout checks, without starting any process.

def test_zero_2_with_stages_suggests_the_pipe_configs():
    with pytest.raises(ConfigError, match=r"ZeRO stage 2 cannot be combined with pipeline parallelism \(pipeline.stages"
                                          r"=2\).*Use ds_configs/pipe2.json or pipe4.json \(ZeRO-1\)"):
        pipeline_settings({"zero_optimization": {"stage": 2}, "pipeline": {"stages": 2}})
    assert pipeline_settings({"zero_optimization": {"stage": 3}}).stages == 1  # no pipeline: any ZeRO stage


def test_unknown_pipeline_key():
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['stage'\] in the ds_config's pipeline section"):
        pipeline_settings({"pipeline": {"stage": 2}})


def tiny(arch="gpt", n_layer=4, vocab_size=65):
    return ModelConfig(arch=arch, n_layer=n_layer, n_head=2, n_embd=32, ffn_hidden=64, block_size=16,
                       vocab_size=vocab_size)


def test_more_stages_than_blocks():
    with pytest.raises(ConfigError, match=r"5 pipeline stages but the model has 4 transformer blocks"):
        stage_partition(model_layers(tiny()), 5, "parameters", Block)


def test_partition_that_starves_a_stage_suggests_type_partition():
    # A 50k vocabulary outweighs three 32-wide blocks: balanced by parameters over 3 stages, the first
    # stage would hold the token embedding alone.
    specs = model_layers(tiny(n_layer=3, vocab_size=50257))
    with pytest.raises(ConfigError, match=r"leaves stage 0 without a transformer block \(it would hold "
                                          r"\['TokenEmbedding'\]\): use \"partition\": \"type:Block\""):
        stage_partition(specs, 3, "parameters", Block)
    assert stage_partition(specs, 3, "type:Block", Block) == [0, 3, 4, 7]


@pytest.mark.parametrize("arch", ARCHS)
def test_parameter_balanced_stages_hold_blocks(arch):
    specs = model_layers(tiny(arch, n_layer=6))
    parts = stage_partition(specs, 3, "parameters", ARCHITECTURES[arch].block)
    text = describe_stages(specs, parts, Layout(world_size=6, pipeline_stages=3, micro_batch=1, grad_accum=1))
    assert text.count("\n") == 2 and "on ranks [4, 5]" in text
    assert all(ARCHITECTURES[arch].block.__name__ in line for line in text.splitlines())


def test_batch_triple_with_pipeline_names_dp_pp_and_world():
    with pytest.raises(ConfigError, match=r"x dp \(2, = world 8 / pp 4\)"):
        resolve_layout({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2,
                        "gradient_accumulation_steps": 2}, 8, 4)


def test_memory_plan_model_states():
    from training.memory_plan import plan

    cfg = tiny(n_layer=4)
    with __import__("torch").device("meta"):
        from model import build_model
        n = sum(p.numel() for p in build_model(cfg).parameters())  # the tied head counted once

    def zero(stage: int) -> dict:
        return {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}, "bf16": {"enabled": True},
                "data_types": {"grad_accum_dtype": "fp32"}}

    def kept_and_gradients(p: dict) -> tuple:
        return p["states"], p["gradients"]

    # FP16_Optimizer: 16-bit weights, fp32 master and Adam moments kept; 16-bit gradients and their fp32 copy
    assert kept_and_gradients(plan(cfg, zero(0), 1)) == (14 * n, 6 * n)
    # BF16_Optimizer: 16-bit weights and fp32 gradients whole, master and moments partitioned; 16-bit gradients
    assert kept_and_gradients(plan(cfg, zero(1), 4)) == (6 * n + 12 * n / 4, 2 * n)
    assert kept_and_gradients(plan(cfg, zero(2), 4)) == (2 * n + 12 * n / 4, 6 * n / 4)  # the gradients partitioned
    piped = plan(cfg, {**zero(1), "gradient_accumulation_steps": 4, "pipeline": {"stages": 2}}, 4)
    assert piped["params_per_gpu"] < n and piped["layout"] == "world 4 = dp 2 x pp 2"
    # activations: 2 micro-batches in flight on the first stage, 2 blocks each (no dropout: no masks), plus the
    # logits (the vocabulary padded to 128): 16-bit and their gradient, and the loss's fp32 copy and log-softmax
    tokens = 2 * 16
    assert cfg.dropout == 0 and cfg.padded_vocab_size == 128
    assert piped["activations"] == 2 * 2 * tokens * (16 * 32 + 4 * 64) + (4 + 8) * tokens * 128
