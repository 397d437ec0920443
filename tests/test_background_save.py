"""Checkpoints written in the background (training/checkpoints/background_save.py) by the real DeepSpeed engine in this
process: the files are a synchronous save's bytes, training goes on during the write, and a checkpoint counts only
once every file is down; a failed write is raised on the loop. Seconds, no launcher."""
import dataclasses
import os
import threading
import time
from unittest import mock

import pytest
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from omegaconf import OmegaConf

from engine_checks import engine_for, run_config, train_steps
from harness import one_rank_world
from model_checks import SMALL_GPT
from training.checkpoints import background_save, checkpoint
from training.checkpoints.background_save import BackgroundWriter


@pytest.fixture(scope="module", autouse=True)
def process_group():
    with one_rank_world():
        yield


ZERO1 = {"zero_optimization": {"stage": 1}}


def save(engine, out_dir, step: int) -> str:
    """checkpoint.save as train.py calls it, with a run state resuming would accept (SMALL_GPT, one rank)."""
    config = OmegaConf.to_container(OmegaConf.structured(run_config(model=dataclasses.asdict(SMALL_GPT))))
    run_state = {"tag": checkpoint.tag_for(step), "step": step, "config": config, "data": {},
                 "layout": {"dp": 1, "pp": 1, "tp": 1, "zero_stage": 1}}
    return checkpoint.save(engine, str(out_dir), step, run_state, keep=3, uc_info={})


def deepspeed_files(tag_dir) -> dict[str, bytes]:
    """Every file DeepSpeed wrote into a checkpoint, with its bytes (not the repo's run state and manifest)."""
    return {name: open(os.path.join(tag_dir, name), "rb").read() for name in sorted(os.listdir(tag_dir))
            if name not in (checkpoint.RUN_STATE, checkpoint.MANIFEST)}


@pytest.fixture
def engine():
    engine = engine_for(run_config(train={"max_steps": 8}), ZERO1)
    train_steps(engine, 2)
    return engine


def test_the_files_are_the_bytes_of_a_synchronous_save(engine, tmp_path):
    save(engine, tmp_path / "sync", 2)
    engine.checkpoint_engine = BackgroundWriter(engine._config)
    save(engine, tmp_path / "background", 2)
    assert checkpoint.settle(engine) == "step_000002"
    sync, background = (deepspeed_files(tmp_path / run / "checkpoints" / "step_000002")
                        for run in ("sync", "background"))
    assert sorted(sync) == ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    assert background == sync


def test_training_goes_on_during_the_write_and_the_checkpoint_counts_once_it_is_down(engine, tmp_path):
    """The writer's thread held inside its first file: the loop steps on, the files keep the saved step's
    state, and until every file is down the previous checkpoint is the one a resume (or a kill) finds: whenever the
    manifest or `latest` is written, no file of the writer's is unfinished and the files are the synchronous
    save's."""
    writer = engine.checkpoint_engine = BackgroundWriter(engine._config)
    out, root = tmp_path / "run", tmp_path / "run" / "checkpoints"
    save(engine, out, 2)
    assert checkpoint.settle(engine) == "step_000002"
    train_steps(engine, 1)
    engine.checkpoint_engine = TorchCheckpointEngine(engine._config)
    save(engine, tmp_path / "sync", 3)  # what the background save of step 3 must write
    sync = deepspeed_files(tmp_path / "sync" / "checkpoints" / "step_000003")
    engine.checkpoint_engine = writer
    release, write, write_atomic = threading.Event(), background_save.write_state, checkpoint.write_atomic
    completions = []

    def held(*args):
        release.wait(timeout=60)
        time.sleep(0.3)  # a completion that did not wait for the files comes in here
        write(*args)

    def completing(path, data):
        name = os.path.basename(path)
        if name in (checkpoint.MANIFEST, checkpoint.LATEST) and "step_000003" in str(path) + str(data):
            completions.append((name, writer._files.unfinished_tasks,
                                deepspeed_files(root / "step_000003") == sync))
        write_atomic(path, data)

    with mock.patch.object(background_save, "write_state", held), mock.patch.object(checkpoint, "write_atomic",
                                                                                    completing):
        save(engine, out, 3)
        train_steps(engine, 2)  # the weights and optimizer states move on while the files are written
        assert checkpoint.settle(engine, wait=False) is None
        assert not os.path.exists(root / "step_000003" / checkpoint.MANIFEST)
        assert checkpoint.complete_tags(root) == ["step_000002"]
        assert checkpoint.find_checkpoint(str(out)) == str(root / "step_000002")
        assert checkpoint.read_run_state(str(root / "step_000002"))["step"] == 2
        release.set()
        assert checkpoint.settle(engine) == "step_000003"
    assert completions == [(checkpoint.MANIFEST, 0, True), (checkpoint.LATEST, 0, True)]
    assert checkpoint.find_checkpoint(str(out)) == str(root / "step_000003")
    assert checkpoint.read_run_state(str(root / "step_000003"))["step"] == 3
    assert deepspeed_files(root / "step_000003") == deepspeed_files(tmp_path / "sync" / "checkpoints" / "step_000003")


def test_a_failed_write_is_raised_on_the_loop_and_the_checkpoint_never_counts(engine, tmp_path):
    engine.checkpoint_engine = BackgroundWriter(engine._config)
    out = tmp_path / "run"

    def full(*args):
        raise OSError(28, "No space left on device")

    with mock.patch.object(background_save, "write_state", full):
        save(engine, out, 2)
        with pytest.raises(OSError, match="writing a checkpoint file failed: OSError: .*No space left on device"):
            checkpoint.settle(engine)
    assert checkpoint.complete_tags(out / "checkpoints") == []
    assert not os.path.exists(out / "checkpoints" / checkpoint.LATEST)
