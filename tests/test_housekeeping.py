"""Checkpoint and metrics housekeeping on fabricated directories, in process: pruning, leftovers of a
killed save, unfinished tags, layout changes refused, metrics.jsonl kept across runs."""
import dataclasses
import json
import os

import pytest
import torch

from common.checks import ConfigError
from data.writer import write_atomic
from model.config import ModelConfig
from scripts.convert_checkpoint import to_universal
from training.checkpoints import checkpoint, resume
from training.metrics import MetricsLog

MODEL = dataclasses.asdict(ModelConfig(n_layer=2, n_embd=32, vocab_size=65))


def plan_resume(out_dir: str, asked: str, model: dict, layout: dict) -> tuple[str | None, dict | None]:
    """What train.py's start-up does with a checkpoint (training/startup.py check_run): find, read, check."""
    tag_dir = resume.find_resume(out_dir, asked)
    saved = checkpoint.read_run_state(tag_dir) if tag_dir else None
    if saved:
        resume.check_compatible(saved, model, layout, tag_dir, out_dir)
    return tag_dir, saved


def fake_checkpoint(root, step: int, complete: bool = True, layout=None, suffix: str = "") -> str:
    """A tag directory with one shard; complete ones get run_state.json and the manifest, as save() writes."""
    tag = checkpoint.tag_for(step) + suffix
    tag_dir = os.path.join(root, tag)
    os.makedirs(tag_dir)
    torch.save({"module": {"weight": torch.zeros(4)}}, os.path.join(tag_dir, "mp_rank_00_model_states.pt"))
    if complete:
        layout = layout or {"world": 2, "dp": 2, "pp": 1, "tp": 1, "sp": 1, "zero_stage": 1}
        checkpoint.mark_complete(tag_dir, {"tag": tag, "step": step, "config": {"model": MODEL}, "layout": layout,
                                           "data": {"sources": []}})
    return tag


def test_prune_keeps_the_newest_complete_and_drops_leftovers_of_killed_saves(tmp_path):
    root = str(tmp_path)
    for step in (1, 2, 4, 5):
        fake_checkpoint(root, step)
    fake_checkpoint(root, 3, complete=False)  # a save killed midway, older than the newest complete one
    fake_checkpoint(root, 6, complete=False)  # a save in progress (or killed) after the newest complete one
    (tmp_path / "notes").mkdir()  # not a checkpoint: never touched
    checkpoint.prune(root, keep=2)
    assert sorted(os.listdir(root)) == ["notes", "step_000004", "step_000005", "step_000006"]
    checkpoint.prune(root, keep=0)  # never fewer than one
    assert checkpoint.complete_tags(root) == ["step_000005"]


def test_resume_auto_ignores_an_unfinished_newer_save(tmp_path):
    root = str(tmp_path / "checkpoints")
    fake_checkpoint(root, 3)
    write_atomic(os.path.join(root, checkpoint.LATEST), b"step_000003")
    fake_checkpoint(root, 6, complete=False)
    assert resume.find_resume(str(tmp_path), "auto") == os.path.join(root, "step_000003")


def test_an_unfinished_tag_asked_for_by_name_is_refused(tmp_path):
    root = str(tmp_path / "checkpoints")
    fake_checkpoint(root, 3)
    fake_checkpoint(root, 6, complete=False)
    with pytest.raises(ConfigError) as error:
        plan_resume(str(tmp_path), "step_000006", MODEL,
                    {"world": 2, "dp": 2, "pp": 1, "tp": 1, "sp": 1, "zero_stage": 1})
    assert str(error.value) == (f"{root}/step_000006 is not a complete checkpoint (no manifest.json: its save never "
                                f"finished). Resume from an earlier tag: step_000003")


@pytest.mark.parametrize("now,changed", [
    ({"world": 2, "dp": 1, "pp": 2, "tp": 1, "sp": 1, "zero_stage": 1}, "dp=1 x pp=2 with ZeRO-1"),
    ({"world": 2, "dp": 2, "pp": 1, "tp": 1, "sp": 1, "zero_stage": 2}, "dp=2 x pp=1 with ZeRO-2"),
    ({"world": 2, "dp": 2, "pp": 1, "tp": 1, "sp": 1, "zero_stage": 0}, "dp=2 x pp=1 with ZeRO-0"),
    ({"world": 4, "dp": 2, "pp": 1, "tp": 2, "sp": 1, "zero_stage": 1}, "dp=2 x pp=1 x tp=2 with ZeRO-1"),
    # The same data axis (dp x sp = 2), but other windows on each rank: not a layout to resume as it is.
    ({"world": 2, "dp": 1, "pp": 1, "tp": 1, "sp": 2, "zero_stage": 1}, "dp=1 x pp=1 x sp=2 with ZeRO-1"),
], ids=["pipeline", "zero-stage-up", "zero-stage-down", "tensor-parallel", "sequence-parallel"])
def test_a_changed_pipeline_tensor_parallel_or_zero_stage_is_refused(tmp_path, now, changed):
    root = str(tmp_path / "checkpoints")
    fake_checkpoint(root, 3, layout={"world": 2, "dp": 2, "pp": 1, "tp": 1, "sp": 1, "zero_stage": 1})
    with pytest.raises(ConfigError) as error:
        plan_resume(str(tmp_path), "step_000003", MODEL, now)
    assert (f"the checkpoint was saved at dp=2 x pp=1 with ZeRO-1, this run is {changed}: its optimizer state only "
            f"fits the old layout. Convert it first: python -m scripts.convert_checkpoint universal --out_dir "
            f"{tmp_path} --tag step_000003, then resume with train.resume=step_000003_universal; or start this layout "
            f"fresh in another train.out_dir") == str(error.value)


def test_tensor_parallel_checkpoints_that_cannot_reshard_say_so(tmp_path):
    """ZeRO-0 ones (no optimizer shards for DeepSpeed's converter) at another degree, and ZeRO-3 ones at tp > 1
    sent to the converter: refused, with the way forward, the checkpoint untouched."""
    root = str(tmp_path / "checkpoints")
    fake_checkpoint(root, 3, layout={"world": 2, "dp": 1, "pp": 1, "tp": 2, "sp": 1, "zero_stage": 0})
    with pytest.raises(ConfigError) as error:
        plan_resume(str(tmp_path), "step_000003", MODEL,
                    {"world": 1, "dp": 1, "pp": 1, "tp": 1, "sp": 1, "zero_stage": 0})
    assert str(error.value) == (
        "the checkpoint was saved at tensor-parallel degree 2 without ZeRO, this run has 1: DeepSpeed's universal "
        "converter, which reshards, needs ZeRO optimizer shards. Resume it with tensor_model_parallel_size=2, or "
        "start from its weights (python -m scripts.export, then train.init_from=EXPORT_DIR)")
    fake_checkpoint(root, 4, layout={"world": 4, "dp": 2, "pp": 1, "tp": 2, "sp": 1, "zero_stage": 3})
    with pytest.raises(ConfigError, match=r"is a ZeRO-3 checkpoint at tensor-parallel degree 2: DeepSpeed's converter "
                                          r"merges ZeRO-3 shards of one tensor slice only. Resume it at tp=2"):
        to_universal(str(tmp_path), "step_000004")
    assert sorted(os.listdir(root)) == ["step_000003", "step_000004"]


def test_universal_checkpoints_resume_on_any_layout_and_zero0_at_any_dp(tmp_path):
    root = str(tmp_path / "checkpoints")
    tag = fake_checkpoint(root, 3, layout={"world": 4, "dp": 2, "pp": 2, "tp": 1, "sp": 1, "zero_stage": 1},
                          suffix="_universal")
    with open(os.path.join(root, tag, checkpoint.RUN_STATE)) as f:
        state = json.load(f)
    checkpoint.mark_complete(os.path.join(root, tag), {**state, "universal": True})
    tag_dir, saved = plan_resume(str(tmp_path), tag, MODEL,
                                 {"world": 1, "dp": 1, "pp": 1, "tp": 1, "sp": 1, "zero_stage": 2})
    assert tag_dir and saved["universal"]  # training/startup.py then asks DeepSpeed for universal loading
    fake_checkpoint(root, 4, layout={"world": 2, "dp": 2, "pp": 1, "tp": 1, "sp": 1, "zero_stage": 0})
    assert plan_resume(str(tmp_path), "step_000004", MODEL,
                       {"world": 1, "dp": 1, "pp": 1, "tp": 1, "sp": 1, "zero_stage": 0})[0]


@pytest.mark.parametrize("made_from,now,fix", [(1, 3, "a ZeRO-0, 1 or 2 ds_config (e.g. ds_configs/zero2.json)"),
                                                (3, 0, "ds_configs/zero3.json")], ids=["zero1-to-3", "zero3-to-0"])
def test_a_universal_checkpoint_crossing_zero3_is_refused(tmp_path, made_from, now, fix):
    """DeepSpeed's ZeRO-3 writes and reads model-states files of other names than ZeRO 0-2: a universal checkpoint
    made on one side does not load on the other (DeepSpeed fails midway in the load)."""
    root = str(tmp_path / "checkpoints")
    tag = fake_checkpoint(root, 3, layout={"world": 2, "dp": 2, "pp": 1, "tp": 1, "sp": 1, "zero_stage": made_from},
                          suffix="_universal")
    with open(os.path.join(root, tag, checkpoint.RUN_STATE)) as f:
        state = json.load(f)
    checkpoint.mark_complete(os.path.join(root, tag), {**state, "universal": True})
    with pytest.raises(ConfigError) as error:
        plan_resume(str(tmp_path), tag, MODEL, {"world": 1, "dp": 1, "pp": 1, "tp": 1, "sp": 1, "zero_stage": now})
    assert str(error.value) == (f"the checkpoint is a universal one made from a ZeRO-{made_from} checkpoint, this "
                                f"run is ZeRO-{now}: DeepSpeed loads one made from ZeRO-3 under ZeRO-3 only, and one "
                                f"made from ZeRO 0-2 under ZeRO 0-2 only; fix: resume it with {fix}")


def test_metrics_jsonl_of_an_earlier_run_is_kept_and_a_resume_appends(tmp_path):
    def write_run(value, append=False):
        log = MetricsLog(str(tmp_path), None, is_writer=True, append=append, samples_per_step=8)
        log.log(1, loss=value)
        log.close()

    def lines(name):
        return (tmp_path / name).read_text().splitlines()

    write_run(1.0)
    write_run(2.0)  # a fresh run in the same out_dir
    write_run(3.0)
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl", "metrics.jsonl.1", "metrics.jsonl.2"]
    assert [lines(n) for n in ("metrics.jsonl.1", "metrics.jsonl.2", "metrics.jsonl")] == \
        [['{"step": 1, "loss": 1.0}'], ['{"step": 1, "loss": 2.0}'], ['{"step": 1, "loss": 3.0}']]
    write_run(4.0, append=True)  # a resumed run continues the current file
    assert lines("metrics.jsonl") == ['{"step": 1, "loss": 3.0}', '{"step": 1, "loss": 4.0}']
    other_rank = MetricsLog(str(tmp_path), None, is_writer=False, append=False, samples_per_step=8)
    other_rank.log(1, loss=5.0)  # other ranks write nothing
    assert len(os.listdir(tmp_path)) == 3 and len(lines("metrics.jsonl")) == 2


def test_a_resume_moves_the_records_past_its_step_aside_each_time_into_a_new_file(tmp_path):
    """What a resumed run logs again (the steps after its checkpoint, a line a kill cut short) leaves metrics.jsonl
    for a file of its own; nothing is lost, and a second resume at the same step keeps the first one's file."""
    records = [{"step": 0, "val_loss": 4.0}, {"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0},
               {"step": 2, "val_loss": 2.5}, {"step": 3, "loss": 1.0}]
    body = "".join(json.dumps(r) + "\n" for r in records) + '{"step": 4, "lo'
    (tmp_path / "metrics.jsonl").write_text(body)
    moved = resume.set_aside_metrics(str(tmp_path), 2)
    assert moved == "metrics.jsonl's 2 records past step 2 moved to metrics.after_step_000002.jsonl"
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == [json.dumps(r) for r in records[:4]]
    assert (tmp_path / "metrics.after_step_000002.jsonl").read_text() == json.dumps(records[4]) + '\n{"step": 4, "lo\n'
    assert resume.set_aside_metrics(str(tmp_path), 2) is None  # nothing past step 2 any more
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 3, "loss": 1.5}) + "\n")
    resume.set_aside_metrics(str(tmp_path), 2)
    assert (tmp_path / "metrics.after_step_000002.2.jsonl").read_text() == '{"step": 3, "loss": 1.5}\n'
    assert len((tmp_path / "metrics.after_step_000002.jsonl").read_text().splitlines()) == 2


def test_discarding_newer_checkpoints_moves_latest_first(tmp_path, monkeypatch):
    """train.discard_newer: `latest` names the newest checkpoint that stays before any is deleted, so a kill
    midway leaves train.resume=auto a complete one."""
    root = str(tmp_path / "checkpoints")
    for step in (2, 4, 6):
        fake_checkpoint(root, step)
    fake_checkpoint(root, 4, suffix="_universal")
    write_atomic(os.path.join(root, checkpoint.LATEST), b"step_000006")
    rmtree = resume.shutil.rmtree

    def remove(path, *args, **kwargs):
        assert open(os.path.join(root, checkpoint.LATEST)).read() == "step_000002"
        rmtree(path, *args, **kwargs)
    monkeypatch.setattr(resume.shutil, "rmtree", remove)
    resume.discard(str(tmp_path), ["step_000004", "step_000004_universal", "step_000006"])
    assert sorted(os.listdir(root)) == ["latest", "step_000002"]
    assert resume.find_resume(str(tmp_path), "auto") == os.path.join(root, "step_000002")


class Killed(Exception):
    """The process dies here."""


def test_the_commit_order_leaves_auto_resume_a_complete_checkpoint_at_every_point(tmp_path, monkeypatch):
    """checkpoint.save's writes in order: DeepSpeed's files, run_state.json, the manifest, then `latest`, then the
    pruning. A kill before each of them in turn (not at a random moment, which nearly always lands in DeepSpeed's
    long write) leaves train.resume=auto a complete checkpoint: the previous one until `latest` names the new."""
    monkeypatch.setattr(torch.distributed, "barrier", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *args, **kwargs: 0)
    layout = {"world": 1, "dp": 1, "pp": 1, "tp": 1, "sp": 1, "zero_stage": 0}
    state = {"tag": "step_000002", "step": 2, "config": {"model": MODEL}, "layout": layout, "data": {"sources": []}}

    class Engine:  # writes a shard as DeepSpeed's save_checkpoint does, leaving `latest` to the caller
        has_moe_layers = False
        checkpoint_engine = None  # DeepSpeed's own writer: the save is complete on return (test_background_save.py)

        def save_checkpoint(self, root, tag, client_state, save_latest):
            assert save_latest is False
            os.makedirs(os.path.join(root, tag))
            torch.save({"module": {"weight": torch.ones(4)}}, os.path.join(root, tag, "mp_rank_00_model_states.pt"))

    def run_save(out, kill_at=None) -> list[str]:
        """checkpoint.save of step 2 over a run whose step 1 is complete; the writes it got to, in order."""
        root = os.path.join(out, "checkpoints")
        fake_checkpoint(root, 1, layout=layout)
        write_atomic(os.path.join(root, checkpoint.LATEST), b"step_000001")
        done = []

        def event(name, real):
            def write(*args, **kwargs):
                if len(done) == kill_at:
                    raise Killed(name)
                done.append(name if name != "write" else os.path.basename(args[0]))
                return real(*args, **kwargs)
            return write
        with monkeypatch.context() as writes:
            writes.setattr(Engine, "save_checkpoint", event("deepspeed", Engine.save_checkpoint))
            writes.setattr(checkpoint, "write_atomic", event("write", write_atomic))
            writes.setattr(checkpoint, "prune", event("prune", checkpoint.prune))
            try:
                checkpoint.save(Engine(), out, 2, state, keep=1, uc_info={})
            except Killed:
                pass
        return done

    order = run_save(str(tmp_path / "whole"))
    assert order == ["deepspeed", checkpoint.RUN_STATE, checkpoint.MANIFEST, checkpoint.LATEST, "prune"]
    for kill_at in range(len(order)):
        out = str(tmp_path / f"killed_before_{order[kill_at]}")
        run_save(out, kill_at)
        tag_dir, saved = plan_resume(out, "auto", MODEL, layout)
        assert saved["step"] == (2 if kill_at > order.index(checkpoint.LATEST) else 1), order[kill_at]
