"""The tools that read a run's checkpoints and exports (python -m scripts.export, sample.py, python -m
scripts.convert_checkpoint universal, python -m scripts.evaluate) answer a bad path or a damaged file with one line,
`error: ...`, and exit code 2, no traceback, and leave every file they would have overwritten as it was. One
table per tool, run in process through the tool's main(argv) on one tiny run (conftest's `checkpointed_run`:
two checkpoints, an export), damaged afresh for each row."""
import json
import os
import shutil
from pathlib import Path

import pytest

import sample
import scripts.convert_checkpoint
import scripts.evaluate
import scripts.export
import training.checkpoints.checkpoint
import training.checkpoints.export
import training.checkpoints.universal
from refusals import EXPORT, SHARD, TAG, assert_refused, command, only_tag_truncated, snapshot, truncated

# Damage done to the run's copy before a row runs.

def rewrite(tag_dir: Path, name: str, body: bytes) -> None:
    """A checkpoint file replaced and the manifest told its new size: only what the file holds is wrong."""
    (tag_dir / name).write_bytes(body)
    manifest = json.loads((tag_dir / "manifest.json").read_text())
    manifest["files"][name] = len(body)
    (tag_dir / "manifest.json").write_text(json.dumps(manifest))


def run_state(change):
    def damage(run_dir):
        state = json.loads((run_dir / TAG / "run_state.json").read_text())
        change(state, run_dir)
        rewrite(run_dir / TAG, "run_state.json", json.dumps(state).encode())
    return damage


def export_config(change):
    def damage(run_dir):
        path = run_dir / EXPORT / "config.json"
        config = json.loads(path.read_text())
        change(config)
        path.write_text(json.dumps(config))
    return damage



def not_torch(run_dir):
    path = run_dir / TAG / SHARD
    path.write_bytes(b"\0" * path.stat().st_size)  # the size the manifest holds


# The model settings that came with Llama: a checkpoint saved before it lacks them.
LLAMA_SETTINGS = ("arch", "n_kv_head", "norm_eps", "rope_theta", "rope_scale_factor", "rope_low_freq_factor",
                  "rope_high_freq_factor", "rope_original_context", "tie_embeddings")


def dataset_of_another_version(state, run_dir):
    (run_dir / "data").mkdir()
    (run_dir / "data" / "meta.json").write_text(json.dumps({"format": 3, "tokenizer": "char", "vocab_size": 65}))
    state["config"]["data"]["dir"] = str(run_dir / "data")


# (id, damage, message, tools): a damaged checkpoint, refused alike by every tool that reads it that far.
CHECKPOINTS = [
    ("truncated-only-tag", only_tag_truncated, "checkpoint file {tag}/" + SHARD + " is corrupt: 1,000 bytes, ... when "
     "saved; fix: there is no other complete checkpoint in {root}: start fresh with train.resume=none in another "
     "train.out_dir, or restore the checkpoint's files from a copy$", "all"),
    ("truncated", truncated, "checkpoint file {tag}/" + SHARD + " is corrupt: 1,000 bytes, ... saved; fix: resume "
     "from another tag: step_000001$", "all"),
    ("not-torch", not_torch, "checkpoint file {tag}/" + SHARD + " is corrupt: it is not a torch file ( ... ); fix: "
     "resume from another tag: step_000001$", "all"),
    ("missing-file", lambda r: (r / TAG / SHARD).unlink(), "checkpoint file {tag}/" + SHARD + " is missing ... fix: "
     "restore the file, or resume from another tag: step_000001$", "all"),
    ("unfinished", lambda r: (r / TAG / "manifest.json").unlink(), "{tag} is not a complete checkpoint (no "
     "manifest.json: its save never finished). Resume from an earlier tag: step_000001$", "all"),
    ("manifest-not-json", lambda r: (r / TAG / "manifest.json").write_text("{oops"), "checkpoint manifest "
     "{tag}/manifest.json is not JSON (", "all"),
    ("manifest-without-files", lambda r: (r / TAG / "manifest.json").write_text('{"sizes": {}}'), "checkpoint "
     "manifest {tag}/manifest.json lacks files (written by another version of this repo", "all"),
    ("run-state-not-json", lambda r: rewrite(r / TAG, "run_state.json", b"\x80 not json"), "checkpoint run state "
     "{tag}/run_state.json is not JSON", "all"),
    ("run-state-of-another-version", run_state(lambda s, _: s.pop("layout")), "checkpoint run state "
     "{tag}/run_state.json lacks layout.dp, layout.pp, layout.zero_stage (written by another version of this repo, "
     "or another tool); fix: resume from another tag: step_000001$", "all"),
    ("latest-damaged", lambda r: (r / "checkpoints" / "latest").write_text("garbage"), "{root}/latest names no "
     "checkpoint ('garbage'): it is damaged; fix: write the newest complete tag into it (step_000002), or name one "
     "with --tag=TAG", "all"),
    ("no-checkpoint", lambda r: shutil.rmtree(r / "checkpoints"), "--out_dir {run} holds no complete checkpoint",
     "all"),
    ("newer-model-settings", run_state(lambda s, _: s["config"]["model"].update(n_future=3)), "checkpoint run state "
     "{tag}/run_state.json holds model settings this version does not know (n_future)", "export sample"),
    ("dataset-moved", run_state(lambda s, r: s["config"]["data"].update(dir=str(r / "moved"))), "the run's dataset "
     "(data.dir) {run}/moved does not exist; fix: run this from the folder the run was started in, or prepare its "
     "dataset again", "export sample"),
    ("dataset-of-another-version", run_state(dataset_of_another_version), "dataset meta {run}/data/meta.json is of "
     "format 3, this version reads format 2 only (written by another version of data.prepare)", "export sample"),
    # Checkpoints of earlier versions: refused, not converted (no release ever wrote them).
    ("before-llama", run_state(lambda s, _: [s["config"]["model"].pop(k) for k in LLAMA_SETTINGS]), "checkpoint run "
     "state {tag}/run_state.json lacks " + ", ".join(f"config.model.{k}" for k in LLAMA_SETTINGS) + ": it was saved "
     "by an earlier version of this repo, which this one does not read; fix: resume or export it with that version "
     "(python -m scripts.export), then start from the export with train.init_from=EXPORT_DIR$", "all"),
    ("before-tensor-parallelism", run_state(lambda s, _: s["layout"].pop("tp")), "checkpoint run state "
     "{tag}/run_state.json lacks layout.tp: it was saved by an earlier version of this repo, which this one does not "
     "read; fix: resume or export it with that version", "all"),
    ("before-the-data-record", run_state(lambda s, _: s.pop("data")), "checkpoint run state {tag}/run_state.json "
     "lacks data: it was saved by an earlier version of this repo", "all"),
]
READERS = {"export": (scripts.export.main, {"--out_dir": "{run}", "--output": "{tmp}/new_export"}),
           "sample": (sample.main, {"--out_dir": "{run}"}),
           "universal": (scripts.convert_checkpoint.main, {"command": "universal", "--out_dir": "{run}"}),
           "evaluate": (scripts.evaluate.main, {"--out_dir": "{run}", "--tasks": "{tmp}/task.jsonl"})}


CHECKPOINT_CASES = [(f"{tool}-{name}", tool, damage, message) for name, damage, message, tools in CHECKPOINTS
                    for tool in READERS if tools == "all" or tool in tools.split()]


@pytest.mark.parametrize("tool,damage,message", [case[1:] for case in CHECKPOINT_CASES],
                         ids=[case[0] for case in CHECKPOINT_CASES])
def test_a_damaged_checkpoint_is_refused_by_each_tool(paths, capsys, tool, damage, message):
    damage(paths["run"])
    # scripts.evaluate checks its task files before the checkpoint: a good one, so that the checkpoint is reached
    (paths["tmp"] / "task.jsonl").write_text('{"ctx": "ROMEO:", "endings": ["sir", "lord"], "label": 0}\n')
    main, base = READERS[tool]
    assert_refused(main, command(base, {}, paths), message, paths, capsys, [paths["tmp"]])


def test_a_corrupt_tag_never_advises_itself(paths):
    """The issue's case: the only tag corrupt, and a resume that names the fix, not the same tag."""
    only_tag_truncated(paths["run"])
    with pytest.raises(training.checkpoints.checkpoint.ConfigError) as error:
        training.checkpoints.checkpoint.read_run_state(str(paths["tag"]))
    assert "step_000002" not in str(error.value).split("fix:")[1]


# (flags, message) of scripts.export, on the intact run.
EXPORT_ROWS = [
    ({"--out_dir": "{tmp}/missing"}, "--out_dir {tmp}/missing does not exist; fix: pass the train.out_dir of a run"),
    ({"--out_dir": "{run}/metrics.jsonl"}, "--out_dir {run}/metrics.jsonl is a file, not a folder; fix: pass the "
                                           "train.out_dir of a run"),
    ({"--tag": "step_000009"}, "--tag=step_000009: no such checkpoint. Complete ones in {root}: step_000001, "
                               "step_000002"),
    ({"--output": "{run}/metrics.jsonl"}, "--output {run}/metrics.jsonl is a file, not a folder; fix: pass another "
                                          "--output (--force replaces only an earlier export)"),
    ({"--output": "{run}/metrics.jsonl", "--force": True}, "--output {run}/metrics.jsonl is a file, not a folder"),
    ({"--output": "{run}/checkpoints"}, "--output {run}/checkpoints already exists and would be overwritten; fix: "
                                        "pass another --output (--force replaces only an earlier export)"),
    ({"--output": "{run}/checkpoints", "--force": True}, "--output {run}/checkpoints already exists and would be "
                                                         "overwritten"),
    ({"--output": "{export}"}, "--output {export} already exists and would be overwritten; fix: pass --force to "
                               "replace that export, or another --output"),
    ({"--output": "{run}/metrics.jsonl/export"}, "--output {run}/metrics.jsonl/export cannot be created: "
                                                 "{run}/metrics.jsonl is a file"),
]


@pytest.mark.parametrize("flags,message", EXPORT_ROWS, ids=[f"row{i}" for i in range(len(EXPORT_ROWS))])
def test_export_refuses(paths, capsys, flags, message):
    assert_refused(scripts.export.main, command({"--out_dir": "{run}"}, flags, paths), message, paths, capsys,
                   [paths["run"]])


def test_export_again_is_nothing_to_do_and_force_replaces_the_earlier_export(paths, capsys):
    before = snapshot(paths["export"])
    scripts.export.main(["--out_dir", str(paths["run"]), "--tag", "step_000001"])
    assert "already holds the export of" in capsys.readouterr().out and snapshot(paths["export"]) == before
    scripts.export.main(["--out_dir", str(paths["run"]), "--output", str(paths["export"]), "--force"])
    assert json.loads((paths["export"] / "config.json").read_text())["megalite"]["step"] == 2
    assert sorted(os.listdir(paths["export"].parent)) == ["step_000001"]  # no scratch folder left beside it


def test_a_failed_export_leaves_the_earlier_one_whole(paths, monkeypatch):
    before = snapshot(paths["export"])

    def disk_full(tensors, path, metadata=None):  # half the weights written, then no room for the rest
        with open(path, "wb") as f:
            f.write(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(training.checkpoints.export, "save_file", disk_full)
    with pytest.raises(OSError):
        training.checkpoints.export.export(str(paths["tag"]), str(paths["export"]), force=True)
    assert snapshot(paths["export"]) == before and sorted(os.listdir(paths["export"].parent)) == ["step_000001"]


def test_a_failed_conversion_is_one_line_and_leaves_no_half_checkpoint(paths, monkeypatch):
    target = paths["tmp"] / "step_000002_universal"
    (paths["tag"] / "zero_pp_rank_0_mp_rank_00_optim_states.pt").touch()  # what the converter is run on

    def converter_fails(args):
        target.mkdir()
        print("*** 1. Extracting ZeRO fragments")
        raise ValueError("shard 3 is short")

    monkeypatch.setattr(training.checkpoints.universal.ds_to_universal, "main", converter_fails)
    with pytest.raises(training.checkpoints.universal.ConfigError) as error:
        training.checkpoints.universal.convert(str(paths["tag"]), str(target))
    assert "\n" not in str(error.value) and "Traceback" not in str(error.value)
    assert "(ValueError: shard 3 is short); fix: see its whole output" in str(error.value) and not target.exists()


# (flags, message) of `python -m scripts.convert_checkpoint universal`, on the intact run.
UNIVERSAL_ROWS = [
    ({"--out_dir": "{tmp}/missing"}, "--out_dir {tmp}/missing does not exist; fix: pass the train.out_dir of a run"),
    ({"--tag": "step_000009"}, "--tag=step_000009: no such checkpoint"),
]


@pytest.mark.parametrize("flags,message", UNIVERSAL_ROWS, ids=["out_dir", "tag"])
def test_universal_refuses(paths, capsys, flags, message):
    assert_refused(scripts.convert_checkpoint.main, command(READERS["universal"][1], flags, paths), message, paths,
                   capsys, [paths["run"]])


def test_universal_refuses_a_zero0_pipeline_checkpoint_naming_what_works(paths, capsys):
    """ZeRO-0 over pipeline stages in fp32 keeps its optimizer state in per-stage files that no converter reads
    (one stage and one tensor rank convert)."""
    run_state(lambda s, _: s["layout"].update(pp=2, world=2))(paths["run"])
    assert_refused(scripts.convert_checkpoint.main, ["universal", "--out_dir", str(paths["run"])], "{tag} is a ZeRO-0 "
                   "checkpoint over 2 pipeline stages, whose optimizer state no converter reads: resume it on its own "
                   "layout (pp=2, tp=1), or start a new run from its weights: python -m scripts.export --out_dir "
                   "{run} --tag step_000002, then train.init_from={run}/export/step_000002$", paths, capsys,
                   [paths["run"]])


def test_universal_refuses_a_universal_checkpoint(paths, capsys):
    run_state(lambda s, _: s.update(universal=True))(paths["run"])
    assert_refused(scripts.convert_checkpoint.main, ["universal", "--out_dir", str(paths["run"])], "--tag step_000002 "
                   "is already in the universal format; fix: resume it with train.resume=step_000002", paths, capsys,
                   [paths["run"]])


# (damage, flags, message) of sample.py: its paths, and exports that are damaged or not exports at all.
SAMPLE_ROWS = [
    (None, {"--out_dir": "{tmp}/missing"}, "--out_dir {tmp}/missing does not exist"),
    (None, {"--tag": "step_000009"}, "--tag=step_000009: no such checkpoint"),
    (None, {"--out_dir": None, "--export": "{tmp}/missing"}, "--export {tmp}/missing does not exist; fix: pass a "
                                                             "folder written by python -m scripts.export"),
    (None, {"--out_dir": None, "--export": "{run}/metrics.jsonl"}, "--export {run}/metrics.jsonl is a file, not a "
                                                                   "folder"),
    (None, {"--out_dir": None, "--export": "{run}"}, "export config {run}/config.json does not exist"),
    (lambda r: (r / EXPORT / "config.json").write_text("{oops"), {}, "export config {export}/config.json is not JSON"),
    (lambda r: (r / EXPORT / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}'), {},
     "export config {export}/config.json lacks megalite.model, megalite.tokenizer (written by another version"),
    (export_config(lambda c: c["megalite"]["model"].update(n_future=3)), {}, "export config {export}/config.json "
     "holds model settings this version does not know (n_future)"),
    (export_config(lambda c: c["megalite"]["tokenizer"].update(format=9)), {}, "the tokenizer record of export "
     "config {export}/config.json is of format 9, this version reads format 2 only"),
    (export_config(lambda c: [c["megalite"]["model"].pop(k) for k in LLAMA_SETTINGS]), {}, "export config "
     "{export}/config.json lacks the model settings " + ", ".join(LLAMA_SETTINGS) + ": it was written by an earlier "
     "version of this repo, which this one does not read; fix: read it with that version, or start a run from its "
     "weights with train.init_from (a GPT or Llama export is a Hugging Face folder)$"),
    (export_config(lambda c: c["megalite"]["tokenizer"].pop("chars")), {}, "the tokenizer record of export config "
     "{export}/config.json lacks chars"),
    (lambda r: (r / EXPORT / "model.safetensors").write_bytes(b"not safetensors"), {}, "export weights "
     "{export}/model.safetensors are not a safetensors file ("),
    (lambda r: (r / EXPORT / "model.safetensors").write_bytes(b""), {}, "export weights {export}/model.safetensors "
                                                                          "is empty"),
    (export_config(lambda c: c["megalite"]["model"].update(n_layer=3)), {}, "export weights "
     "{export}/model.safetensors lack the tensor 'transformer.h.2.ln_1.weight' that its config.json's model needs"),
    (export_config(lambda c: c["megalite"]["model"].update(n_embd=64)), {}, "the weights of {export} do not fit its "
     "model settings (Error(s) in loading state_dict"),
]


@pytest.mark.parametrize("damage,flags,message", SAMPLE_ROWS, ids=[f"row{i}" for i in range(len(SAMPLE_ROWS))])
def test_sample_refuses(paths, capsys, damage, flags, message):
    if damage:
        damage(paths["run"])
        flags = {"--out_dir": None, "--export": "{export}"}
    assert_refused(sample.main, command({"--out_dir": "{run}"}, flags, paths), message, paths, capsys,
                   [paths["run"]])

