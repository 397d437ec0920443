"""Checkpoints through the real launcher: exact resume, resume on another layout through DeepSpeed's
universal format, a save killed midway, bad checkpoints refused untouched, and export."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from harness import FP32, REPO, TINY, export, free_port, launch, metrics, sample_py, train_py, universal
from hf_check import assert_export_matches_transformers
from refusals import assert_refused_at_start
from training.checkpoints import checkpoint

pytestmark = pytest.mark.launch  # several train.py processes per test (python -m pytest -m "not launch" skips them)

# Global batch 8 in every layout; 6 steps with a checkpoint at step 3.
RUN = ["train.max_steps=6", "train.save_interval=3", "optim.warmup_steps=2", "optim.lr=3e-3", *FP32]
LAYOUTS = {  # name: (ds_config, processes, overrides)
    "zero1": ("zero1.json", 2, ["ds.train_micro_batch_size_per_gpu=4"]),
    "zero2": ("zero2.json", 2, ["ds.train_micro_batch_size_per_gpu=4"]),
    "zero3": ("zero3.json", 2, ["ds.train_micro_batch_size_per_gpu=4"]),
    "zero3_bf16": ("zero3.json", 2, ["ds.train_micro_batch_size_per_gpu=4", "ds.bf16.enabled=true"]),
    "zero1_bf16": ("zero1.json", 2, ["ds.train_micro_batch_size_per_gpu=4", "ds.bf16.enabled=true"]),
    "pp2": ("pipe2.json", 2, ["ds.train_micro_batch_size_per_gpu=4", "ds.gradient_accumulation_steps=2"]),
    # Dropout masks drawn from (seed, rank, step), bf16 master weights in the checkpoint; only the newest
    # checkpoint kept.
    "zero1_bf16_dropout": ("zero1.json", 2, ["ds.train_micro_batch_size_per_gpu=4", "model.dropout=0.1",
                                             "ds.bf16.enabled=true", "train.keep_checkpoints=1"]),
    "pp2_dropout": ("pipe2.json", 2, ["ds.train_micro_batch_size_per_gpu=4", "ds.gradient_accumulation_steps=2",
                                      "model.dropout=0.1", "train.keep_checkpoints=1"]),
}


def steps(out_dir, first=4):
    return [(m["step"], m["loss"], m["lr"]) for m in metrics(out_dir) if "loss" in m and m["step"] >= first]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, char_data):
    """Each layout run 6 steps without interruption (checkpoints at 3 and 6)."""
    runs = {}
    for name, (ds_config, nprocs, overrides) in LAYOUTS.items():
        runs[name] = tmp_path_factory.mktemp(f"straight_{name}")
        launch(nprocs, ds_config, runs[name], char_data, [*RUN, *overrides])
    return runs


@pytest.mark.parametrize("name", LAYOUTS)
def test_stop_and_resume_continues_exactly(straight, tmp_path, char_data, name):
    ds_config, nprocs, overrides = LAYOUTS[name]
    first = launch(nprocs, ds_config, tmp_path, char_data, [*RUN, *overrides, "train.stop_at_step=3"])
    assert "starting fresh" in first.stdout
    assert checkpoint.complete_tags(tmp_path / "checkpoints") == ["step_000003"]
    second = launch(nprocs, ds_config, tmp_path, char_data, [*RUN, *overrides])  # train.resume=auto
    assert f"resumed from {tmp_path}/checkpoints/step_000003 at step 3" in second.stdout
    resumed, uninterrupted = steps(tmp_path), steps(straight[name])
    assert [s for s, _, _ in resumed] == [4, 5, 6]
    assert resumed == uninterrupted  # losses and learning rates, exactly
    assert [m["step"] for m in metrics(tmp_path) if "loss" in m] == [1, 2, 3, 4, 5, 6]  # one metrics file, appended
    if "train.keep_checkpoints=1" in overrides:
        assert checkpoint.complete_tags(tmp_path / "checkpoints") == ["step_000006"]
        assert [t for t in os.listdir(tmp_path / "checkpoints") if checkpoint.TAG.match(t)] == ["step_000006"]


@pytest.mark.parametrize("name,without", [("zero1_bf16_dropout", "zero1"), ("pp2_dropout", "pp2")])
def test_dropout_is_on_in_the_resumed_runs(straight, name, without):
    """The runs above compare something: dropout changes every loss of the same run without it."""
    with_dropout, plain = steps(straight[name], first=1), steps(straight[without], first=1)
    assert all(a[1] != b[1] for a, b in zip(with_dropout, plain)) and len(with_dropout) == 6
    assert [lr for _, _, lr in with_dropout] == [lr for _, _, lr in plain]


def assert_resumed(proc, out_dir, tag_dir, step=3, last=6):
    """A resume, not a fresh start that happens to train alike: the run says so and logs only later steps."""
    assert f"resumed from {tag_dir} at step {step}" in proc.stdout and "starting fresh" not in proc.stdout
    records = metrics(out_dir)
    assert [m["step"] for m in records if "loss" in m] == list(range(step + 1, last + 1))
    assert [m["step"] for m in records if "val_loss" in m] == [last]  # no step-0 evaluation


def universal_copy(source_run, destination) -> str:
    """The step-3 checkpoint of a run, converted with `python -m scripts.convert_checkpoint universal`."""
    shutil.copytree(source_run / "checkpoints", destination / "checkpoints")
    return universal(destination, "step_000003")


@pytest.fixture(scope="module")
def pp2_dp2(tmp_path_factory, char_data):
    out = tmp_path_factory.mktemp("pp2_dp2")
    launch(4, "pipe2.json", out, char_data,
           [*RUN, "ds.train_micro_batch_size_per_gpu=2", "ds.gradient_accumulation_steps=2"])
    return out


@pytest.mark.parametrize("stages,nprocs,accum", [(1, 2, 2), (2, 2, 4)], ids=["pp1xdp2", "pp2xdp1"])
def test_pipeline_checkpoint_resumes_on_another_layout(pp2_dp2, tmp_path, char_data, stages, nprocs, accum):
    universal = universal_copy(pp2_dp2, tmp_path / "converted")
    out = tmp_path / "resumed"
    proc = launch(nprocs, "pipe2.json", out, char_data, [*RUN, "ds.train_micro_batch_size_per_gpu=2",
                                                         f"ds.gradient_accumulation_steps={accum}",
                                                         f"ds.pipeline.stages={stages}", f"train.resume={universal}"])
    assert_resumed(proc, out, universal)
    resumed, uninterrupted = steps(out), steps(pp2_dp2)
    assert [s for s, _, _ in resumed] == [4, 5, 6]
    assert [loss for _, loss, _ in resumed] == pytest.approx([loss for _, loss, _ in uninterrupted], abs=1e-5)
    assert [lr for _, _, lr in resumed] == pytest.approx([lr for _, _, lr in uninterrupted])


@pytest.mark.parametrize("source,ds_config,nprocs,accum", [
    ("zero2", "zero2.json", 1, 2), ("zero2", "zero1.json", 2, 1), ("zero2", "pipe2.json", 2, 2),
    ("zero3", "zero3.json", 1, 2), ("zero3_bf16", "zero3.json", 2, 1), ("zero1_bf16", "zero1.json", 2, 1)],
    ids=["zero2-to-dp1", "zero2-to-zero1", "zero2-to-pp2", "zero3-to-dp1", "zero3-bf16", "zero1-bf16"])
def test_a_universal_checkpoint_resumes_at_another_size_zero_stage_or_pipeline(straight, tmp_path, char_data, source,
                                                                               ds_config, nprocs, accum):
    """ZeRO-2 at dp=2, resumed at dp=1, under ZeRO-1 (another partitioning of the optimizer states), or over two
    pipeline stages (the tied embedding held by both); ZeRO-3 at dp=2 under ZeRO-3 at dp=1; in bf16 (the fp32
    masters converted, the 16-bit weights made from them) ZeRO-3 and ZeRO-1 (DeepSpeed's bf16 optimizer) at their own
    layouts, where bf16 keeps the losses of the run uninterrupted."""
    universal = universal_copy(straight[source], tmp_path / "converted")
    out = tmp_path / "resumed"
    precision = [o for o in LAYOUTS[source][2] if o.startswith("ds.bf16")]
    proc = launch(nprocs, ds_config, out, char_data, [*RUN, "ds.train_micro_batch_size_per_gpu=4",
                                                      f"ds.gradient_accumulation_steps={accum}",
                                                      f"train.resume={universal}", *precision])
    assert_resumed(proc, out, universal)
    resumed, uninterrupted = steps(out), steps(straight[source])
    assert [loss for _, loss, _ in resumed] == pytest.approx([loss for _, loss, _ in uninterrupted], abs=1e-5)
    assert [lr for _, _, lr in resumed] == pytest.approx([lr for _, _, lr in uninterrupted], rel=1e-12)


def test_kill_during_save_leaves_the_previous_checkpoint_resumable(tmp_path, char_data):
    """SIGKILL the whole job while a checkpoint directory exists without its manifest."""
    overrides = [*FP32, "train.save_interval=1", "train.keep_checkpoints=2", "model.n_embd=128", "model.n_head=4"]
    cmd = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", "2", "--master_port",
           str(free_port()), "train.py", "--ds_config", os.path.join(REPO, "ds_configs", "zero1.json"),
           f"train.out_dir={tmp_path}", f"data.dir={char_data}", *TINY, *overrides, "train.max_steps=200"]
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    root, partial, deadline = tmp_path / "checkpoints", None, time.time() + 240
    try:
        while partial is None and proc.poll() is None and time.time() < deadline:
            complete = checkpoint.complete_tags(root)
            candidates = [t for t in os.listdir(root) if checkpoint.TAG.match(t)] if root.exists() else []
            partial = next((t for t in candidates if complete and t not in complete and t > complete[-1]), None)
            time.sleep(0.002)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert partial is not None, "never caught a save in progress"
    latest = (root / "latest").read_text().strip()
    assert latest < partial and os.path.exists(root / latest / "manifest.json")
    # The next start (its ranks forked: the launcher is not what this tests) resumes from the newest complete
    # checkpoint and finishes.
    resume_step = int(checkpoint.TAG.match(latest).group(1))
    proc = launch(2, "zero1.json", tmp_path, char_data, [*overrides, f"train.max_steps={resume_step + 2}"], timeout=300)
    assert f"resumed from {root}/{latest} at step {resume_step}" in proc.stdout


# Bad checkpoints: each refused before any engine exists, with nothing written or removed.

@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory, char_data):
    out = tmp_path_factory.mktemp("one_process")
    train_py(["--ds_config", "ds_configs/zero1.json", f"train.out_dir={out}",
              f"data.dir={char_data}", *TINY, *FP32, "train.max_steps=4", "train.save_interval=2"])
    return out


def file_stats(folder):
    """Every file and folder under `folder`, with its size and modification time: a rewrite shows, same bytes too."""
    return sorted((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*"))


def resume_fails(out_dir, char_data, *overrides, ds_config="zero1.json"):
    before = file_stats(out_dir)
    proc = train_py(["--ds_config", f"ds_configs/{ds_config}", f"train.out_dir={out_dir}",
                     f"data.dir={char_data}", *TINY, *FP32, "train.max_steps=6", *overrides], check=False, timeout=120)
    assert_refused_at_start(proc)
    assert file_stats(out_dir) == before
    return proc.stderr


@pytest.fixture
def damaged(one_process_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(one_process_run, copy)
    return copy


def test_a_run_already_at_max_steps_only_samples(damaged, char_data):
    checkpoints, records = file_stats(damaged / "checkpoints"), (damaged / "metrics.jsonl").read_bytes()
    proc = train_py(["--ds_config", "ds_configs/zero1.json", f"train.out_dir={damaged}",
                     f"data.dir={char_data}", *TINY, *FP32, "train.max_steps=4"])
    assert f"resumed from {damaged}/checkpoints/step_000004 at step 4" in proc.stdout
    assert "--- sample ---" in proc.stdout and "step 5" not in proc.stdout and "saved" not in proc.stdout
    # no training, evaluation or save: checkpoints and metrics untouched
    assert file_stats(damaged / "checkpoints") == checkpoints and (damaged / "metrics.jsonl").read_bytes() == records


def test_other_architecture_is_refused(damaged, char_data):
    assert ("the checkpoint holds a different model architecture (model.n_layer: 2 in the checkpoint, 3 now)"
            in resume_fails(damaged, char_data, "model.n_layer=3"))


def test_missing_tag_lists_the_complete_ones(damaged, char_data):
    assert ("train.resume=step_000099: no such checkpoint. Complete ones in "
            f"{damaged}/checkpoints: step_000002, step_000004") in resume_fails(damaged, char_data,
                                                                                "train.resume=step_000099")


def test_truncated_file_is_reported_corrupt(damaged, char_data):
    path = damaged / "checkpoints" / "step_000004" / "mp_rank_00_model_states.pt"
    with open(path, "r+b") as f:
        f.truncate(1000)
    error = resume_fails(damaged, char_data)
    assert f"checkpoint file {path} is corrupt: 1,000 bytes" in error and "step_000002" in error


def test_missing_zero_shard_is_an_error_not_a_warning(damaged, char_data):
    shard = damaged / "checkpoints" / "step_000004" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    shard.unlink()
    assert f"checkpoint file {shard} is missing" in resume_fails(damaged, char_data)


def test_fresh_start_never_overwrites_checkpoints(damaged, char_data):
    assert "already holds checkpoints (newest: step_000004); a fresh run would overwrite them" in \
        resume_fails(damaged, char_data, "train.resume=none")


def test_a_checkpoint_of_an_earlier_version_is_refused_not_converted(damaged, char_data):
    """A layout saved before tensor parallelism (no "tp"): one line that says what it is and what to do."""
    tag = damaged / "checkpoints" / "step_000004"
    state = json.loads((tag / "run_state.json").read_text())
    del state["layout"]["tp"]
    (tag / "run_state.json").write_text(json.dumps(state))
    manifest = json.loads((tag / "manifest.json").read_text())
    manifest["files"]["run_state.json"] = (tag / "run_state.json").stat().st_size
    (tag / "manifest.json").write_text(json.dumps(manifest))
    assert (f"error: checkpoint run state {tag}/run_state.json lacks layout.tp: it was saved by an earlier version of "
            f"this repo, which this one does not read; fix: resume or export it with that version (python -m "
            f"scripts.export), then start from the export with train.init_from=EXPORT_DIR\n") in resume_fails(damaged,
                                                                                                    char_data)


def test_other_layout_without_universal_format_says_how_to_convert(straight, tmp_path, char_data):
    copy = tmp_path / "run"
    shutil.copytree(straight["zero2"], copy)
    error = resume_fails(copy, char_data, "ds.train_micro_batch_size_per_gpu=4", ds_config="zero2.json")
    assert ("the checkpoint was saved at dp=2 x pp=1 with ZeRO-2, this run is dp=1 x pp=1 with ZeRO-2" in error
            and "python -m scripts.convert_checkpoint universal" in error)


# Export.

@pytest.fixture(scope="module")
def exports(tmp_path_factory, char_data, straight):
    """The same training (global batch 8, same data) under ZeRO-0, ZeRO-3 and 2 pipeline stages."""
    folders = {"pp2": export(straight["pp2"], "step_000006")}
    for stage in (0, 3):
        out = tmp_path_factory.mktemp(f"export_zero{stage}")
        launch(2, f"zero{stage}.json", out, char_data, [*RUN, "ds.train_micro_batch_size_per_gpu=4",
                                                        "ds.zero_optimization.stage3_param_persistence_threshold=0"])
        folders[f"zero{stage}"] = export(out, "step_000006")
    return folders


@pytest.mark.parametrize("layout", ["zero0", "zero3", "pp2"])
def test_exports_load_in_transformers_with_equal_logits(exports, layout):
    """GPT2LMHeadModel loads the export as it is and computes this repo's logits (fp32, 1e-5)."""
    assert_export_matches_transformers(exports[layout], tokens=32)


@pytest.mark.parametrize("layout", ["zero3", "pp2"])
def test_exports_match_the_zero0_export(exports, layout):
    reference = load_file(f"{exports['zero0']}/model.safetensors")
    tensors = load_file(f"{exports[layout]}/model.safetensors")
    assert sorted(tensors) == sorted(reference)
    for name, tensor in tensors.items():
        assert tensor.numel() > 0 and tensor.dtype == torch.float32, name
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-5, msg=name)


def test_sample_from_checkpoint_and_export_agree(straight):
    out = straight["pp2"]
    export(out, "step_000006")
    args = ["--max_new_tokens", "30", "--seed", "3", "--prompt", "ROMEO:"]
    def sample(*source):  # the generated text, without DeepSpeed's timestamped log lines
        stdout = sample_py([*source, *args]).stdout
        return "\n".join(line for line in stdout.splitlines() if not line.startswith("[20"))

    from_checkpoint = sample("--out_dir", str(out))
    from_export = sample("--export", str(out / "export" / "step_000006"))
    assert from_checkpoint == from_export and from_checkpoint.startswith("ROMEO:") and len(from_checkpoint) == 36
    config = json.load(open(out / "export" / "step_000006" / "config.json"))
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["n_layer"] == 2 and config["vocab_size"] == 65
