"""A run that diverges loses nothing (training/divergence.py): runs made to diverge at a known step (a NaN or a
spike injected into one step's output, tests/fault_train.py) under each train.on_nonfinite policy, in one
process and over two data-parallel ranks, bf16 and fp32: no non-finite checkpoint on disk, the finite ones kept,
the exact exit line, the skipped update, the rewound run's data position. The watch itself in process."""
import json
import math
import os
import shutil

import pytest
import torch

from harness import BF16, FP32, free_port, launch, launch_cmd, metrics, train_py
from training.checkpoints import checkpoint
from training.divergence import Watch

# A checkpoint every four steps (the newest kept), a progress line every five: a NaN injected at step 6 is seen
# at step 8, before its save, which would have pruned step 4.
EVERY_4 = ["train.max_steps=12", "train.save_interval=4", "train.keep_checkpoints=1", "train.log_interval=5"]
STOPPED = ("error: step 6: the loss or gradient norm is not finite (in 1 of steps 6-8); the newest finite checkpoint "
           "is step_000004 (train.resume=auto resumes it); fix: resume with a lower optim.lr, or with "
           "train.on_nonfinite=rewind")


def run(out, data, fault: str, overrides, nprocs: int = 1, ds_config: str = "zero0.json"):
    """train.py with MEGALITE_FAULT=fault: as one process without a launcher, or as nprocs ranks."""
    env = {"MEGALITE_FAULT": fault}
    if nprocs == 1:
        return train_py(launch_cmd([], "train.py", ds_config, out, data, overrides)[2:], check=False, env=env)
    return launch(nprocs, ds_config, out, data, overrides, check=False, env=env)


def weights(out, tag: str) -> dict:
    state = torch.load(os.path.join(out, "checkpoints", tag, "mp_rank_00_model_states.pt"), weights_only=True)
    return state["module"]


def assert_finite_checkpoints(out, tags: list[str]) -> None:
    assert checkpoint.complete_tags(os.path.join(out, "checkpoints")) == tags
    assert sorted(t for t in os.listdir(os.path.join(out, "checkpoints")) if checkpoint.TAG.match(t)) == tags
    for tag in tags:
        assert all(torch.isfinite(w).all() for w in weights(out, tag).values()), tag


def error_lines(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize("nprocs,ds_config,precision,fault", [
    pytest.param(1, "zero0.json", FP32, "nan:0:6", id="one-process-fp32"),  # torch's fused AdamW, found_inf
    pytest.param(1, "zero0.json", BF16, "nan:0:6", id="one-process-bf16"),  # DeepSpeed's unfused optimizer
    pytest.param(2, "zero1.json", BF16, "nan:1:6", id="dp2-bf16", marks=pytest.mark.launch),  # rank 1 only
    pytest.param(2, "zero2.json", FP32, "nan:0:6", id="dp2-fp32", marks=pytest.mark.launch),
])
def test_stop_ends_the_job_naming_the_step_and_keeps_the_finite_checkpoint(tmp_path, char_data, nprocs, ds_config,
                                                                          precision, fault):
    proc = run(tmp_path, char_data, fault, [*EVERY_4, *precision], nprocs, ds_config)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert error_lines(proc) == [STOPPED] and "Traceback" not in proc.stderr
    assert_finite_checkpoints(tmp_path, ["step_000004"])  # step 8's save never happened, step 4 was not pruned
    assert "--- sample ---" not in proc.stdout


@pytest.mark.parametrize("nprocs,ds_config,precision", [
    pytest.param(1, "zero0.json", FP32, id="one-process-fp32"),
    pytest.param(1, "zero1.json", BF16, id="one-process-bf16"),  # the bf16 optimizer's step on the device
    pytest.param(2, "zero2.json", BF16, id="dp2-bf16", marks=pytest.mark.launch),
])
def test_skip_leaves_the_weights_of_a_nonfinite_step_untouched(tmp_path, char_data, nprocs, ds_config, precision):
    overrides = ["train.max_steps=5", "train.save_interval=1", "train.keep_checkpoints=9", "train.on_nonfinite=skip"]
    proc = run(tmp_path, char_data, "nan:0:3", [*overrides, *precision], nprocs, ds_config)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ("WARNING: step 3: the loss or gradient norm is not finite: their updates were skipped "
            "(train.on_nonfinite=skip)") in proc.stdout
    assert_finite_checkpoints(tmp_path, [checkpoint.tag_for(s) for s in range(1, 6)])
    before, skipped, after = (weights(tmp_path, checkpoint.tag_for(s)) for s in (2, 3, 4))
    assert all(torch.equal(before[name], skipped[name]) for name in before)  # bitwise: no update at step 3
    assert not all(torch.equal(skipped[name], after[name]) for name in skipped)
    assert [m["nonfinite_steps"] for m in metrics(tmp_path) if "nonfinite_steps" in m] == [1]


def test_skip_stops_after_max_skipped_steps_in_a_row(tmp_path, char_data):
    overrides = ["train.max_steps=5", "train.save_interval=1", "train.on_nonfinite=skip", "train.max_skipped_steps=1"]
    proc = run(tmp_path, char_data, "nan:0:3", [*overrides, *FP32])
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert error_lines(proc) == ["error: step 3: the loss or gradient norm is not finite, 1 in a row: "
                                 "train.max_skipped_steps=1; the newest finite checkpoint is step_000002 "
                                 "(train.resume=auto resumes it); fix: resume with a lower optim.lr, or with "
                                 "train.on_nonfinite=rewind"]
    assert_finite_checkpoints(tmp_path, ["step_000001", "step_000002"])


def losses(records: list[dict]) -> dict:
    """{step: loss} of the progress records, a later record of a step replacing an earlier one."""
    return {m["step"]: m["loss"] for m in records if "loss" in m}


def test_rewind_reloads_the_newest_checkpoint_and_moves_the_data_on(tmp_path, char_data):
    """A NaN at step 7, seen there: back to step 4, and steps 5 to 12 train on the batches of steps 8 to 15; a run
    resumed from the rewound run's step 8 continues it exactly, so the checkpoint carries the data position."""
    overrides = ["train.max_steps=12", "train.save_interval=4", "train.keep_checkpoints=3", "train.on_nonfinite=rewind",
                 *FP32]
    rewound = tmp_path / "rewound"
    proc = run(rewound, char_data, "nan:0:7", overrides)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ("WARNING: step 7: the loss or gradient norm is not finite: rewound to step_000004 (rewind 1 of "
            "train.max_rewinds 3); the batches of steps 5-7 are left out: step 5 trains on the batch step 8 would "
            "have, 3 batches skipped in all") in proc.stdout
    assert_finite_checkpoints(rewound, ["step_000004", "step_000008", "step_000012"])
    records = metrics(rewound)
    assert {"step": 7, "rewound_to": 4, "batches_skipped": 3} in records
    mark = records.index({"step": 7, "rewound_to": 4, "batches_skipped": 3})
    before, after = losses(records[:mark]), losses(records[mark:])
    assert sorted(before) == list(range(1, 8)) and sorted(after) == list(range(5, 13))
    assert math.isnan(before[7]) and after[5] != before[5]  # step 5 again, on another batch
    with open(rewound / "checkpoints" / "step_000012" / checkpoint.RUN_STATE) as f:
        assert json.load(f)["batches_skipped"] == 3

    resumed = tmp_path / "resumed"
    shutil.copytree(rewound / "checkpoints" / "step_000008", resumed / "checkpoints" / "step_000008")
    (resumed / "checkpoints" / checkpoint.LATEST).write_text("step_000008")
    train_py(launch_cmd([], "train.py", "zero0.json", resumed, char_data, overrides)[2:])
    assert losses(metrics(resumed)) == {s: after[s] for s in range(9, 13)}


@pytest.mark.launch
def test_rewind_over_two_ranks_in_bf16(tmp_path, char_data):
    overrides = ["train.max_steps=8", "train.save_interval=2", "train.on_nonfinite=rewind", *BF16]
    proc = run(tmp_path, char_data, "nan:1:5", overrides, nprocs=2, ds_config="zero1.json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "WARNING: step 5: the loss or gradient norm is not finite: rewound to step_000004" in proc.stdout
    assert_finite_checkpoints(tmp_path, ["step_000004", "step_000006", "step_000008"])


@pytest.mark.parametrize("on_spike", ["warn", "stop"])
def test_a_spike_is_logged_and_can_stop_the_run(tmp_path, char_data, on_spike):
    overrides = ["train.max_steps=8", "train.save_interval=4", "train.spike_window=3", f"train.on_spike={on_spike}",
                 *FP32]
    proc = run(tmp_path, char_data, "spike:0:6", overrides)
    assert "WARNING: step 6: a loss spike, " in proc.stdout
    assert [m["step"] for m in metrics(tmp_path) if "loss_spike" in m] == [6]
    if on_spike == "warn":
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert_finite_checkpoints(tmp_path, ["step_000004", "step_000008"])
    else:
        assert proc.returncode == 3, proc.stdout + proc.stderr
        assert error_lines(proc) == ["error: step 6: a loss spike; the newest finite checkpoint is step_000004 "
                                     "(train.resume=auto resumes it); fix: resume with a lower optim.lr, or with "
                                     "train.on_spike=rewind"]


@pytest.fixture(scope="module")
def one_rank_group():
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


def test_the_watch_reads_the_first_bad_step_the_streak_and_the_first_spike(one_rank_group):
    watch = Watch(spike_factor=3.0, spike_window=2, device=torch.device("cpu"))
    for step, loss in enumerate([4.0, 2.0, float("nan"), float("inf"), 3.0, 9.5, 12.0, 2.9], start=1):
        watch.observe(step, torch.tensor(loss), update_skipped=False)
    verdict, loss = watch.read(torch.tensor(2.5))  # the mean of 4.0 and 2.0 is 3.0, 3.0 keeps it; 9.5 is above 9.0
    assert loss == 2.5  # the loss read with the verdict, its mean over the (one) rank
    assert (verdict.first_bad, verdict.bad_steps, verdict.longest_streak, verdict.spike) == (3, 2, 2, 6)
    assert verdict.spike_ratio == pytest.approx(9.5 / 3.0)
    watch.observe(9, torch.tensor(2.8), update_skipped=torch.tensor(True))  # a finite loss whose update was skipped
    watch.observe(10, torch.tensor(2.7), update_skipped=False)
    verdict, loss = watch.read()  # a new window: the earlier steps are gone
    assert (verdict.first_bad, verdict.bad_steps, verdict.longest_streak, verdict.spike, loss) == (9, 1, 1, None, None)
    assert watch.read()[0].first_bad is None


def test_a_spike_needs_the_minimum_rise_as_well_as_the_factor(one_rank_group):
    """A fine-tuned model's losses near 0 jump tenfold and more without diverging (0.002 to 0.035: the README's
    fine-tuning printed 3.2x-17.4x spikes; a DPO batch 0.54 after 0.036): no spike below train.spike_min_rise; a
    rise of nats still is one."""
    def first_spike(losses, min_rise):
        watch = Watch(spike_factor=3.0, spike_window=3, device=torch.device("cpu"), spike_min_rise=min_rise)
        for step, loss in enumerate(losses, start=1):
            watch.observe(step, torch.tensor(loss), update_skipped=False)
        return watch.read()[0].spike

    settling = [0.003, 0.002, 0.002, 0.035, 0.004, 0.03, 0.002, 0.54]  # the last: a DPO batch of harder pairs
    assert first_spike(settling, min_rise=0.0) == 4  # the factor alone: 17x its mean
    assert first_spike(settling, min_rise=1.0) is None
    assert first_spike([*settling, 1.9], min_rise=1.0) == 9  # nats above its mean
    assert first_spike([2.0, 2.1, 1.9, 2.4, 6.5], min_rise=1.0) == 5  # pretraining's spikes are both
