"""train.py through the real `deepspeed` launcher: 2 CPU processes over gloo, the real engine."""
import json
import os
import sys

import pytest

from conftest import FP32, TINY, expected_lr, launch, metrics, run, train_losses

STEPS = ["train.max_steps=6", "optim.warmup_steps=2"]


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory, char_data):
    """The same fp32 run at dp=2 under ZeRO 0, 1, 2 and 3."""
    runs = {}
    for stage in (0, 1, 2, 3):
        out = tmp_path_factory.mktemp(f"zero{stage}")
        # Threshold 0: ZeRO-3 partitions every parameter, the tied embedding included.
        extra = ["ds.zero_optimization.stage3_param_persistence_threshold=0"] if stage == 3 else []
        launch(2, f"zero{stage}.json", out, char_data, [*STEPS, *FP32, *extra])
        runs[stage] = out
    return runs


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_1_and_2_match_zero_0_step_for_step(zero_runs, stage):
    reference, losses = train_losses(zero_runs[0]), train_losses(zero_runs[stage])
    assert len(losses) == len(reference) == 6
    assert losses == pytest.approx(reference, abs=1e-5)


def test_fp32_gradient_norm_is_reported_without_zero_too(zero_runs):
    """DeepSpeed reports the pre-clip norm under ZeRO but drops it at ZeRO-0 in fp32 (worked around)."""
    norms = {stage: [m["grad_norm"] for m in metrics(zero_runs[stage]) if "grad_norm" in m] for stage in (0, 1)}
    assert len(norms[0]) == 6 and norms[0] == pytest.approx(norms[1], rel=1e-4)


def test_zero_3_trains(zero_runs):
    losses = train_losses(zero_runs[3])
    assert len(losses) == 6
    assert losses[-1] < losses[0] - 0.05
    assert losses[0] == pytest.approx(train_losses(zero_runs[0])[0], abs=1e-5)  # same init, same data


def test_metrics_jsonl_records_every_measure(zero_runs):
    records = metrics(zero_runs[2])
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_gb"):
        assert all(isinstance(r[key], float) for r in steps), key
    # optim.lr=1e-3 and min_lr=1e-4 from the quickstart preset, warmup 2 of 6 steps
    assert [r["lr"] for r in steps] == pytest.approx([expected_lr(k, 1e-3, 1e-4, 2, 6) for k in range(1, 7)])
    assert steps[0]["lr"] == pytest.approx(5e-4) and steps[-1]["lr"] == pytest.approx(1e-4)
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evals] == [0, 6]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]


def test_effective_config_is_saved(zero_runs):
    with open(os.path.join(zero_runs[1], "ds_config.json")) as f:
        ds = json.load(f)
    assert ds["train_batch_size"] == 24 and ds["train_micro_batch_size_per_gpu"] == 12
    assert ds["zero_optimization"]["stage"] == 1 and ds["bf16"]["enabled"] is False
    assert ds["optimizer"]["type"] == "AdamW" and ds["scheduler"]["type"] == "WarmupCosineLR"
    with open(os.path.join(zero_runs[1], "config.yaml")) as f:
        assert "n_embd: 32" in f.read()


def test_grad_accumulation_4x1_matches_1x4(tmp_path, char_data):
    losses = {}
    for micro, accum in ((4, 1), (1, 4)):
        out = tmp_path / f"m{micro}a{accum}"
        launch(2, "zero1.json", out, char_data, [*STEPS, *FP32, f"ds.train_micro_batch_size_per_gpu={micro}",
                                                 f"ds.gradient_accumulation_steps={accum}"])
        losses[micro, accum] = train_losses(out)
    assert len(losses[4, 1]) == 6
    assert losses[1, 4] == pytest.approx(losses[4, 1], abs=1e-5)


def test_single_process_without_launcher_trains_and_samples(tmp_path, char_data):
    """`python train.py` (no launcher, bf16 as shipped): loss falls and a sample is printed."""
    proc = run([sys.executable, "train.py", "--ds_config", "ds_configs/zero0.json", f"train.out_dir={tmp_path}",
                f"data.dir={char_data}", *TINY, "train.max_steps=30", "optim.lr=3e-3", "optim.warmup_steps=5",
                "sample.max_new_tokens=40"])
    losses = train_losses(tmp_path)
    assert len(losses) == 30 and losses[-1] < losses[0] - 0.5
    sample = proc.stdout.split("--- sample ---\n")[1].split("\n----")[0]
    assert len(sample) == 41  # the one-character prompt plus 40 generated characters


def test_compiled_model_trains_like_the_eager_one(tmp_path, char_data):
    """train.compile=true goes through DeepSpeed's engine.compile (inductor, C++ on CPU): same fp32 losses."""
    losses = {}
    for compiled in (False, True):
        out = tmp_path / f"compile_{compiled}"
        run([sys.executable, "train.py", "--ds_config", "ds_configs/zero0.json", f"train.out_dir={out}",
             f"data.dir={char_data}", *TINY, *FP32, "train.max_steps=4", "optim.warmup_steps=1",
             f"train.compile={str(compiled).lower()}", "sample.max_new_tokens=4"], timeout=600)
        losses[compiled] = train_losses(out)
    assert len(losses[True]) == 4 and losses[True] == pytest.approx(losses[False], abs=1e-4)
    assert losses[True][-1] != losses[True][0]  # it trained


def test_zero_2_with_cpu_offload_matches_zero_2(zero_runs, tmp_path, char_data):
    """Optimizer states on the CPU (DeepSpeedCPUAdam, JIT-built on first use) change nothing numerically."""
    launch(2, "zero2_offload.json", tmp_path, char_data, [*STEPS, *FP32])
    assert train_losses(tmp_path) == pytest.approx(train_losses(zero_runs[2]), abs=1e-5)


def test_wandb_offline_records_one_run_from_rank_0(tmp_path, char_data):
    wandb_dir = tmp_path / "wandb_home"
    wandb_dir.mkdir()
    out = tmp_path / "run"
    launch(2, "zero1.json", out, char_data, ["train.max_steps=2", "ds.wandb.enabled=true", "ds.wandb.project=megalite-test"],
           env={"WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir)})
    runs = list((wandb_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1  # rank 1 never touched wandb
    history = list(runs[0].glob("run-*.wandb"))
    assert len(history) == 1 and history[0].stat().st_size > 0
