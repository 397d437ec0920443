"""Resuming, one process: a ZeRO-0 checkpoint under ZeRO-2 through the conversion its refusal names, universal
checkpoints under ZeRO-0, an older tag with newer ones present (refused, then each fix it names followed),
train.stop_at_step at or before the resumed step, and a finished run scoring its eval.tasks. An out_dir another
run holds is refused to a job of two ranks under the `deepspeed` launcher; SIGUSR1 to one rank of two saves
both and stops them, and the run resumes as if never stopped."""
import json
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys

import pytest

from common.checks import ConfigError
from harness import BF16, FP32, REPO, deepspeed_launch, launch, launch_cmd, metrics, run, train_py, universal
from refusals import assert_one_error_line, assert_refused_at_start, snapshot
from training.checkpoints import checkpoint

# 4 steps, a checkpoint at 2 and 4; a learning rate at which the optimizer state matters.
RUN = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=32", "train.eval_windows=8",
       "train.log_interval=1", "sample.max_new_tokens=1", "train.max_steps=4", "train.save_interval=2",
       "optim.warmup_steps=2", "optim.lr=3e-3", "eval.limit=48"]


def train(out, data, *overrides, ds_config="zero0.json", check=True):
    """`python train.py` of the tiny run in `out`."""
    return train_py(launch_cmd([], "train.py", ds_config, out, data, [*RUN, *overrides])[2:], check=check,
                    env={"OMP_NUM_THREADS": "1"})


def steps(out_dir) -> list[tuple[int, float, float]]:
    return [(m["step"], m["loss"], m["lr"]) for m in metrics(out_dir) if "loss" in m]


def error_line(proc) -> str:
    return next(line for line in proc.stderr.splitlines() if line.startswith("error: "))


@pytest.fixture(scope="module")
def straight(tmp_path_factory, char_data, shakespeare_task):
    """The run uninterrupted: ZeRO-0 in fp32 (scoring the Shakespeare task) and in bf16, ZeRO-1 in fp32."""
    runs = {}
    for name, ds_config, overrides in [("zero0_fp32", "zero0.json", [*FP32, f"eval.tasks=[{shakespeare_task}]"]),
                                       ("zero0_bf16", "zero0.json", BF16), ("zero1_fp32", "zero1.json", FP32)]:
        runs[name] = tmp_path_factory.mktemp(name)
        train(runs[name], char_data, *overrides, ds_config=ds_config)
    return runs


def at_step_2(run_dir, destination):
    """A run stopped at step 2: its step-2 checkpoint alone, `latest` naming it."""
    shutil.copytree(run_dir / "checkpoints" / "step_000002", destination / "checkpoints" / "step_000002")
    (destination / "checkpoints" / checkpoint.LATEST).write_text("step_000002")
    return destination


def test_a_zero0_checkpoint_resumes_under_zero2_through_the_conversion_its_refusal_names(straight, tmp_path,
                                                                                          char_data):
    """The README's `python train.py`, then zero2.json in the same out_dir: refused, naming a conversion that
    works, which continues the run as it would have gone on."""
    out = at_step_2(straight["zero0_fp32"], tmp_path)
    refused = train(out, char_data, *FP32, ds_config="zero2.json", check=False)
    assert_refused_at_start(refused)
    assert_one_error_line(refused.stderr, "the checkpoint was saved at dp=1 x pp=1 with ZeRO-0, this run is dp=1 x "
                          "pp=1 with ZeRO-2: ... Convert it first: python -m scripts.convert_checkpoint universal "
                          f"--out_dir {out} --tag step_000002, then resume with train.resume=step_000002_universal; or "
                          "start this layout fresh in another train.out_dir$", {})
    convert, resume = re.search(r"Convert it first: (.*), then resume with (\S+);", error_line(refused)).groups()
    run([sys.executable if word == "python" else word for word in shlex.split(convert)])
    proc = train(out, char_data, *FP32, resume, ds_config="zero2.json")
    assert f"resumed from {out}/checkpoints/step_000002_universal at step 2" in proc.stdout
    resumed, uninterrupted = steps(out), steps(straight["zero0_fp32"])[2:]
    assert [s for s, _, _ in resumed] == [3, 4]
    assert [loss for _, loss, _ in resumed] == pytest.approx([loss for _, loss, _ in uninterrupted], abs=1e-5)
    assert [lr for _, _, lr in resumed] == pytest.approx([lr for _, _, lr in uninterrupted], rel=1e-12)


@pytest.mark.parametrize("source,precision", [("zero1_fp32", FP32), ("zero0_bf16", BF16)],
                         ids=["fp32-from-zero1", "bf16-from-zero0"])
def test_a_universal_checkpoint_resumes_under_zero0(straight, tmp_path, char_data, source, precision):
    """DeepSpeed's conversion of a ZeRO-1 checkpoint into torch's AdamW; this repo's of a ZeRO-0 bf16 one into
    DeepSpeed's bf16 optimizer and its fp32 masters, continuing bit for bit."""
    converted = universal(at_step_2(straight[source], tmp_path / "converted"), "step_000002")
    out = tmp_path / "resumed"
    proc = train(out, char_data, *precision, f"train.resume={converted}")
    assert f"resumed from {converted} at step 2" in proc.stdout
    resumed, uninterrupted = steps(out), steps(straight[source])[2:]
    assert [s for s, _, _ in resumed] == [3, 4]
    if source == "zero0_bf16":
        assert resumed == uninterrupted
    else:
        assert [loss for _, loss, _ in resumed] == pytest.approx([loss for _, loss, _ in uninterrupted], abs=1e-5)
        assert [lr for _, _, lr in resumed] == pytest.approx([lr for _, _, lr in uninterrupted], rel=1e-12)


def test_an_older_tag_is_refused_while_newer_checkpoints_exist_and_each_fix_works(straight, tmp_path, char_data):
    out = tmp_path / "run"
    shutil.copytree(straight["zero0_fp32"], out)
    older = f"{out}/checkpoints/step_000002"
    before = snapshot(out)
    refused = train(out, char_data, *FP32, "train.resume=step_000002", check=False)
    assert_refused_at_start(refused)
    assert_one_error_line(refused.stderr, f"resuming {older} (step 2) would overwrite the newer checkpoints in "
                          f"{out}/checkpoints (step_000004); fix: set train.discard_newer=true to delete them, or "
                          f"resume it in another train.out_dir (train.out_dir=NEW_DIR train.resume={older})$", {})
    assert snapshot(out) == before
    uninterrupted = steps(straight["zero0_fp32"])

    elsewhere = tmp_path / "elsewhere"  # the second fix: the run goes on in another out_dir, this one untouched
    train(elsewhere, char_data, *FP32, f"train.resume={older}")
    assert steps(elsewhere) == uninterrupted[2:] and snapshot(out) == before

    # The first fix, stopped at step 3: step 4 is gone, not left for train.resume=auto to pick up after a stop.
    proc = train(out, char_data, *FP32, "train.resume=step_000002", "train.discard_newer=true", "train.stop_at_step=3")
    assert "deleted the newer checkpoints step_000004 (train.discard_newer=true)" in proc.stdout
    assert (f"resumed from {older} at step 2; metrics.jsonl's 3 records past step 2 moved to "
            f"metrics.after_step_000002.jsonl") in proc.stdout
    assert checkpoint.complete_tags(out / "checkpoints") == ["step_000002", "step_000003"]
    train(out, char_data, *FP32)  # train.resume=auto
    assert steps(out) == uninterrupted  # each step once: 1 and 2 kept, 3 and 4 trained again
    aside = [json.loads(line) for line in (out / "metrics.after_step_000002.jsonl").read_text().splitlines()]
    assert aside == [m for m in metrics(straight["zero0_fp32"]) if m["step"] > 2]


def test_stop_at_step_at_or_before_the_resumed_step_is_refused(straight, tmp_path, char_data):
    out = tmp_path / "run"
    shutil.copytree(straight["zero0_fp32"], out)
    before = snapshot(out)
    refused = train(out, char_data, *FP32, "train.max_steps=6", "train.stop_at_step=4", check=False)
    assert_refused_at_start(refused)
    assert_one_error_line(refused.stderr, f"train.stop_at_step=4 is not past step 4, where the run resumes "
                          f"({out}/checkpoints/step_000004): there is nothing to train; fix: set it between 5 and "
                          f"train.max_steps=6, or leave it out$", {})
    assert snapshot(out) == before
    train(out, char_data, *FP32, "train.max_steps=6", "train.stop_at_step=5")
    assert [s for s, _, _ in steps(out)] == [1, 2, 3, 4, 5]


def test_a_finished_run_given_eval_tasks_scores_them_at_its_last_step(straight, tmp_path, char_data, shakespeare_task):
    out = tmp_path / "run"
    shutil.copytree(straight["zero0_fp32"], out)
    checkpoints = snapshot(out / "checkpoints")
    proc = train(out, char_data, *FP32, f"eval.tasks=[{shakespeare_task}]")
    assert "the run is at step 4, train.max_steps=4: nothing to train; scoring eval.tasks, then sampling" in proc.stdout
    trained = next(m for m in metrics(straight["zero0_fp32"]) if m["step"] == 4 and "val_loss" in m)
    assert (f"step 4: train loss {trained['train_loss']:.4f}, val loss {trained['val_loss']:.4f}; shakespeare acc "
            f"{trained['shakespeare_acc']:.4f}, acc_norm {trained['shakespeare_acc_norm']:.4f}") in proc.stdout
    assert metrics(out)[-1] == {"step": 4, "shakespeare_acc": trained["shakespeare_acc"],
                                "shakespeare_acc_norm": trained["shakespeare_acc_norm"]}
    assert snapshot(out / "checkpoints") == checkpoints and "step 5" not in proc.stdout


def test_an_out_dir_another_run_holds_is_refused_until_that_run_ends(tmp_path, char_data):
    """Every rank of a job refused (rank 0 holds the lock; all leave the process group together, exit 2, where one
    left to interpreter shutdown aborted in gloo's destructors now and then) and nothing in the folder written; the
    holder SIGKILLed, as a crashed run ends, leaves no stale lock."""
    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from training.launch.out_dir_lock import take; "
                               "assert take(sys.argv[1]) is None; print('held', flush=True); time.sleep(300)",
                               str(out)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        before = snapshot(out)
        refused = deepspeed_launch(2, "zero0.json", out, char_data, [*RUN, *FP32], check=False, timeout=180)
        assert_refused_at_start(refused)
        output = refused.stdout + refused.stderr
        assert "exits with return code = 2" in output and "Fatal Python error" not in output, output
        assert_one_error_line(refused.stderr, f"error: train.out_dir {out} is in use by another run (pid {holder.pid} "
                              f"on {socket.gethostname()}, since ... ): two runs in one folder would overwrite each "
                              f"other's checkpoints and metrics; fix: let that run end (or stop it), or set "
                              f"train.out_dir to another folder$", {})
        assert snapshot(out) == before
    finally:
        holder.kill()
        holder.wait()
    train(out, char_data, *FP32)
    assert [s for s, _, _ in steps(out)] == [1, 2, 3, 4]


def test_sigusr1_to_one_rank_saves_every_rank_at_the_next_log_step_and_the_run_resumes_as_if_never_stopped(
        tmp_path, char_data):
    """Rank 1 of two is sent SIGUSR1 in step 3 (tests/fault_train.py), as a scheduler warns a job before it
    preempts it; the log step after it, 4, tells rank 0 too: both save step 4, exit 128 + SIGUSR1, and the same
    command goes on from there to the losses of a run never stopped."""
    settings = [*RUN, *FP32, "train.max_steps=8", "train.log_interval=2", "train.save_interval=100"]
    straight = launch(2, "zero1.json", tmp_path / "straight", char_data, settings)
    out = tmp_path / "stopped"
    stopped = launch(2, "zero1.json", out, char_data, settings, check=False, env={"MEGALITE_FAULT": "usr1:1:3"})
    assert stopped.returncode == 128 + signal.SIGUSR1, stopped.stdout + stopped.stderr
    assert "stopped at step 4, as SIGUSR1 asked: the same command resumes it" in stopped.stdout
    assert "error:" not in stopped.stdout + stopped.stderr and "Traceback" not in stopped.stderr
    assert checkpoint.complete_tags(out / "checkpoints") == ["step_000004"]
    resumed = launch(2, "zero1.json", out, char_data, settings)
    assert f"resumed from {out}/checkpoints/step_000004 at step 4" in resumed.stdout
    assert steps(out) == steps(tmp_path / "straight") and "saved step_000008" in straight.stdout


def test_a_resumed_runs_checkpoints_are_counted_at_the_size_of_the_one_it_resumes(straight, tmp_path, monkeypatch):
    """Resumed at step 2 of 6 with checkpoints every 2 steps (2 kept): steps 4 and 6 save, 2 at once with step 2's
    beside them, each the bytes its manifest lists."""
    from types import SimpleNamespace

    from training.checkpoints import space
    from training.config import DEFAULT_CONFIG, load_run_config
    out = at_step_2(straight["zero0_fp32"], tmp_path / "run")
    tag = out / "checkpoints" / "step_000002"
    one = sum(path.stat().st_size for path in tag.iterdir() if path.name != checkpoint.MANIFEST)
    train_cfg = load_run_config(DEFAULT_CONFIG, [f"train.out_dir={out}", "train.max_steps=6", "train.save_interval=2",
                                                 "train.keep_checkpoints=2"]).train
    monkeypatch.setattr(space.shutil, "disk_usage", lambda path: SimpleNamespace(free=2 * one))
    space.check_disk(train_cfg, {}, 10**12, 2, str(tag))  # the parameters are not what counts
    monkeypatch.setattr(space.shutil, "disk_usage", lambda path: SimpleNamespace(free=2 * one - 1))
    with pytest.raises(ConfigError, match=rf"need {space.size(2 * one)} more in {out}/checkpoints \(2 at once: "
                                          rf"{space.size(one)} each, as the one resumed\)"):
        space.check_disk(train_cfg, {}, 10**12, 2, str(tag))


WSD = ["optim.schedule=wsd", "optim.decay_fraction=0.25", "optim.lr=1e-3", "optim.min_lr=1e-4", *FP32]


def test_a_wsd_run_resumes_on_its_schedule_and_a_longer_run_extends_its_stable_phase(tmp_path, char_data):
    """Stopped at step 4 of 8 and resumed, a WSD run is the uninterrupted one, rate and loss; the same checkpoint
    resumed with train.max_steps=12 and optim.lr=2e-3 holds 2e-3 to step 9 and decays over the last 3 (the schedule
    follows the resumed run's settings, not the checkpoint's). torch's scheduler finds the mark it puts on the
    optimizer's step, which ZeRO-0 in fp32 wraps (training/steps.py): it warns of nothing."""
    straight = train(tmp_path / "straight", char_data, *WSD, "train.max_steps=8")
    assert "Warning" not in straight.stderr, straight.stderr
    train(tmp_path / "stopped", char_data, *WSD, "train.max_steps=8", "train.stop_at_step=4")
    shutil.copytree(tmp_path / "stopped", tmp_path / "longer")
    train(tmp_path / "stopped", char_data, *WSD, "train.max_steps=8")
    assert steps(tmp_path / "stopped") == steps(tmp_path / "straight")
    assert [lr for _, _, lr in steps(tmp_path / "straight")] == pytest.approx(
        [5e-4, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 1e-4 + 9e-4 * (1 - 0.5 ** 0.5), 1e-4], rel=1e-9)
    train(tmp_path / "longer", char_data, *WSD, "train.max_steps=12", "optim.lr=2e-3")
    decay = [1e-4 + 1.9e-3 * (1 - (k / 3) ** 0.5) for k in (1, 2, 3)]
    assert [lr for _, _, lr in steps(tmp_path / "longer")] == pytest.approx([5e-4, *[1e-3] * 3, *[2e-3] * 5,
                                                                             *decay], rel=1e-9)
