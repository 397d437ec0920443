"""Every command-line tool answers a bad path or a bad file with one line, `error: ...`, and exit code 2, no
traceback, and leaves every file it would have overwritten as it was. One table per tool, run in process
through the tool's main(argv) on one tiny run (two checkpoints, an export), damaged afresh for each row; one
row of each tool also as the command a user types."""
import gzip
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import zstandard

import data.prepare
import sample
import training.checkpoint
import training.export
import training.plot
from conftest import FP32, TINY, run, train_py
from data.readers import Piece, documents

TAG = "checkpoints/step_000002"  # the newest of the run's two checkpoints
SHARD = "mp_rank_00_model_states.pt"
EXPORT = "export/step_000001"  # the run's first checkpoint, exported


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, char_data):
    """Two steps of one process (ZeRO-0), a checkpoint after each, and the export of the first."""
    out = tmp_path_factory.mktemp("tools_run")
    train_py([f"data.dir={char_data}", f"train.out_dir={out}", *TINY, *FP32,
         "train.max_steps=2", "train.save_interval=1", "ds.train_micro_batch_size_per_gpu=2",
         "sample.max_new_tokens=1"], env={"OMP_NUM_THREADS": "1"})
    training.export.main(["--out_dir", str(out), "--tag", "step_000001"])
    return out


@pytest.fixture
def paths(tiny_run, tmp_path, char_data) -> dict:
    """A fresh copy of the run to damage, and the names the tables use."""
    copy = tmp_path / "run"
    shutil.copytree(tiny_run, copy)
    return {"tmp": tmp_path, "run": copy, "root": copy / "checkpoints", "tag": copy / TAG, "export": copy / EXPORT,
            "data": char_data}


def snapshot(*folders) -> dict:
    """Every file under `folders`, with the digest of its bytes."""
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest()
            for folder in folders for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def command(base: dict, flags: dict, paths: dict) -> list[str]:
    """The argv of `base` with the row's `flags` (None leaves one out, True is a switch; a key that is not a
    flag is a positional argument), its {names} filled in."""
    argv = []
    for key, value in {**base, **flags}.items():
        if value is not None:
            argv += ([key] if key.startswith("--") else []) + ([] if value is True else [value.format(**paths)])
    return argv


def assert_one_error_line(stderr: str, message: str, paths: dict) -> None:
    """`message`'s parts (split at " ... ") in order in the one error line; a trailing "$" ends the line."""
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    line, position = lines[0], 0
    for part in message.format(**paths).removesuffix("$").split(" ... "):
        found = line.find(part, position)
        assert found >= 0, f"{part!r} not in {line!r}"
        position = found + len(part)
    assert not message.endswith("$") or position == len(line), line


def assert_refused(main, argv: list[str], message: str, paths: dict, capsys, keep) -> None:
    """main(argv) exits 2 with one `error:` line holding `message`; every file under `keep` is as it was."""
    before = snapshot(*keep)
    with pytest.raises(SystemExit) as stop:
        main(argv)
    stderr = capsys.readouterr().err
    assert stop.value.code == 2, stderr
    assert_one_error_line(stderr, message, paths)
    assert before.items() <= snapshot(*keep).items()  # nothing removed, nothing rewritten


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


def truncated(run_dir):
    with open(run_dir / TAG / SHARD, "r+b") as f:
        f.truncate(1000)


def only_tag_truncated(run_dir):
    shutil.rmtree(run_dir / "checkpoints" / "step_000001")
    truncated(run_dir)


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


def metrics_torn(run_dir):
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "lo')


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
     "(python -m training.export), then start from the export with train.init_from=EXPORT_DIR$", "all"),
    ("before-tensor-parallelism", run_state(lambda s, _: s["layout"].pop("tp")), "checkpoint run state "
     "{tag}/run_state.json lacks layout.tp: it was saved by an earlier version of this repo, which this one does not "
     "read; fix: resume or export it with that version", "all"),
    ("before-the-data-record", run_state(lambda s, _: s.pop("data")), "checkpoint run state {tag}/run_state.json "
     "lacks data: it was saved by an earlier version of this repo", "all"),
]
READERS = {"export": (training.export.main, {"--out_dir": "{run}", "--output": "{tmp}/new_export"}),
           "sample": (sample.main, {"--out_dir": "{run}"}),
           "universal": (training.checkpoint.main, {"command": "universal", "--out_dir": "{run}"})}


CHECKPOINT_CASES = [(f"{tool}-{name}", tool, damage, message) for name, damage, message, tools in CHECKPOINTS
                    for tool in READERS if tools == "all" or tool in tools.split()]


@pytest.mark.parametrize("tool,damage,message", [case[1:] for case in CHECKPOINT_CASES],
                         ids=[case[0] for case in CHECKPOINT_CASES])
def test_a_damaged_checkpoint_is_refused_by_each_tool(paths, capsys, tool, damage, message):
    damage(paths["run"])
    main, base = READERS[tool]
    assert_refused(main, command(base, {}, paths), message, paths, capsys, [paths["tmp"]])


def test_a_corrupt_tag_never_advises_itself(paths):
    """The issue's case: the only tag corrupt, and a resume that names the fix, not the same tag."""
    only_tag_truncated(paths["run"])
    with pytest.raises(training.checkpoint.ConfigError) as error:
        training.checkpoint.read_run_state(str(paths["tag"]))
    assert "step_000002" not in str(error.value).split("fix:")[1]


# (flags, message) of training.export, on the intact run.
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
    assert_refused(training.export.main, command({"--out_dir": "{run}"}, flags, paths), message, paths, capsys,
                   [paths["run"]])


def test_export_again_is_nothing_to_do_and_force_replaces_the_earlier_export(paths, capsys):
    before = snapshot(paths["export"])
    training.export.main(["--out_dir", str(paths["run"]), "--tag", "step_000001"])
    assert "already holds the export of" in capsys.readouterr().out and snapshot(paths["export"]) == before
    training.export.main(["--out_dir", str(paths["run"]), "--output", str(paths["export"]), "--force"])
    assert json.loads((paths["export"] / "config.json").read_text())["megalite"]["step"] == 2
    assert sorted(os.listdir(paths["export"].parent)) == ["step_000001"]  # no scratch folder left beside it


def test_a_failed_export_leaves_the_earlier_one_whole(paths, monkeypatch):
    before = snapshot(paths["export"])

    def disk_full(tensors, path, metadata=None):  # half the weights written, then no room for the rest
        with open(path, "wb") as f:
            f.write(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(training.export, "save_file", disk_full)
    with pytest.raises(OSError):
        training.export.export(str(paths["tag"]), str(paths["export"]), force=True)
    assert snapshot(paths["export"]) == before and sorted(os.listdir(paths["export"].parent)) == ["step_000001"]


def test_a_failed_conversion_is_one_line_and_leaves_no_half_checkpoint(paths, monkeypatch):
    target = paths["tmp"] / "step_000002_universal"
    (paths["tag"] / "zero_pp_rank_0_mp_rank_00_optim_states.pt").touch()  # what the converter is run on

    def converter_fails(cmd, **kwargs):
        target.mkdir()
        return training.checkpoint.subprocess.CompletedProcess(cmd, 1, "", "Traceback (most recent call last):\n"
                                                               "  ...\nValueError: shard 3 is short\n")

    monkeypatch.setattr(training.checkpoint.subprocess, "run", converter_fails)
    with pytest.raises(training.checkpoint.ConfigError) as error:
        training.checkpoint.convert(str(paths["tag"]), str(target))
    assert "\n" not in str(error.value) and "Traceback" not in str(error.value)
    assert "(ValueError: shard 3 is short); fix: see its whole output" in str(error.value) and not target.exists()


# (flags, message) of `python -m training.checkpoint universal`, on the intact run.
UNIVERSAL_ROWS = [
    ({"--out_dir": "{tmp}/missing"}, "--out_dir {tmp}/missing does not exist; fix: pass the train.out_dir of a run"),
    ({"--tag": "step_000009"}, "--tag=step_000009: no such checkpoint"),
    ({}, "{tag} has no ZeRO optimizer shards (a ZeRO-0 checkpoint), which DeepSpeed's converter needs"),
]


@pytest.mark.parametrize("flags,message", UNIVERSAL_ROWS, ids=["out_dir", "tag", "zero0"])
def test_universal_refuses(paths, capsys, flags, message):
    assert_refused(training.checkpoint.main, command(READERS["universal"][1], flags, paths), message, paths, capsys,
                   [paths["run"]])


def test_universal_refuses_a_universal_checkpoint(paths, capsys):
    run_state(lambda s, _: s.update(universal=True))(paths["run"])
    assert_refused(training.checkpoint.main, ["universal", "--out_dir", str(paths["run"])], "--tag step_000002 is "
                   "already in the universal format; fix: resume it with train.resume=step_000002", paths, capsys,
                   [paths["run"]])


# (damage, flags, message) of sample.py: its paths, and exports that are damaged or not exports at all.
SAMPLE_ROWS = [
    (None, {"--out_dir": "{tmp}/missing"}, "--out_dir {tmp}/missing does not exist"),
    (None, {"--tag": "step_000009"}, "--tag=step_000009: no such checkpoint"),
    (None, {"--out_dir": None, "--export": "{tmp}/missing"}, "--export {tmp}/missing does not exist; fix: pass a "
                                                             "folder written by python -m training.export"),
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


# (damage, flags, message) of training.plot.
PLOT_ROWS = [
    (None, {"RUN": "{tmp}/missing"}, "run folder {tmp}/missing does not exist; fix: pass the train.out_dir of a run"),
    (None, {"RUN": "{run}/metrics.jsonl"}, "run folder {run}/metrics.jsonl is a file, not a folder"),
    (None, {"RUN": "{root}"}, "metrics file {root}/metrics.jsonl does not exist"),
    (lambda r: (r / "metrics.jsonl").write_text(""), {}, "metrics file {run}/metrics.jsonl is empty; fix: pass the "
                                                         "train.out_dir of a run that has logged a step"),
    (metrics_torn, {}, "{run}/metrics.jsonl, line ... : not JSON (a torn last line of a killed run?); fix: remove "
                       "that line"),
    (lambda r: (r / "metrics.jsonl").write_text("[1, 2]\n"), {}, "{run}/metrics.jsonl, line 1: not a metrics record"),
    (lambda r: (r / "metrics.png").write_bytes(b"an earlier plot"), {}, "--output {run}/metrics.png already exists "
     "and would be overwritten; fix: pass --force to replace it, or another --output"),
    (None, {"--output": "{run}/metrics.jsonl"}, "--output {run}/metrics.jsonl already exists and would be "
                                                "overwritten; fix: pass --force"),
    (None, {"--output": "{run}/metrics.jsonl", "--force": True}, "--output {run}/metrics.jsonl is not an image file "
                                                                 "matplotlib writes; fix: end it in .png"),
    (None, {"--output": "{run}/checkpoints", "--force": True}, "--output {run}/checkpoints is a folder, not a file; "
                                                               "fix: pass another --output$"),
    (None, {"--output": "{run}/metrics.jsonl/plot.png"}, "--output {run}/metrics.jsonl/plot.png cannot be created: "
                                                         "{run}/metrics.jsonl is a file"),
    (lambda r: (r / "ds_config.json").unlink(), {"--x": "tokens"}, "--x tokens needs each run's ds_config.json"),
]


@pytest.mark.parametrize("damage,flags,message", PLOT_ROWS, ids=[f"row{i}" for i in range(len(PLOT_ROWS))])
def test_plot_refuses(paths, capsys, damage, flags, message):
    if damage:
        damage(paths["run"])
    assert_refused(training.plot.main, command({"RUN": "{run}"}, flags, paths), message, paths, capsys,
                   [paths["run"]])


def test_plot_force_replaces_the_earlier_image(paths, capsys):
    (paths["run"] / "metrics.png").write_bytes(b"an earlier plot")
    training.plot.main([str(paths["run"]), "--force"])
    assert (paths["run"] / "metrics.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in paths["run"].iterdir() if p.name.startswith(".")) == []  # no scratch left


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """Input files that are not what their names say, and a good one."""
    folder = tmp_path_factory.mktemp("bad_inputs")
    records = b"".join(json.dumps({"text": f"document {i} " * 20}).encode() + b"\n" for i in range(2000))
    (folder / "text.txt").write_text("some text\n\nmore text\n")
    (folder / "not_gzip.jsonl.gz").write_bytes(records)
    (folder / "cut.jsonl.gz").write_bytes(gzip.compress(records)[:500])
    (folder / "not_zstd.jsonl.zst").write_bytes(records)
    (folder / "cut.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(records)[:500])
    (folder / "not_parquet.parquet").write_bytes(records)
    (folder / "empty.jsonl").write_bytes(b"")
    (folder / "tokenizer_folder").mkdir()
    return folder


# (flags, message) of data.prepare; each row changes one thing from --input text.txt --out_dir OUT.
PREPARE_ROWS = [
    ({"--input": "{inputs}/not_gzip.jsonl.gz"}, "input {inputs}/not_gzip.jsonl.gz is not gzip data, or is cut short "
                                                "(BadGzipFile: Not a gzipped file ... fix: make it again (gzip FILE)"),
    ({"--input": "{inputs}/cut.jsonl.gz"}, "input {inputs}/cut.jsonl.gz is not gzip data, or is cut short (EOFError"),
    ({"--input": "{inputs}/not_zstd.jsonl.zst"}, "input {inputs}/not_zstd.jsonl.zst is not zstd data, or is cut "
                                                 "short (ZstdError"),
    ({"--input": "{inputs}/cut.jsonl.zst"}, "input {inputs}/cut.jsonl.zst is not zstd data, or is cut short "
                                            "(EOFError: the file ends inside a zstd frame)"),
    ({"--input": "{inputs}/not_parquet.parquet"}, "{inputs}/not_parquet.parquet is not a readable Parquet file"),
    ({"--input": "{inputs}/empty.jsonl"}, "no documents in {inputs}/empty.jsonl: the inputs are empty"),
    ({"--input": "{inputs}/missing.txt"}, "input {inputs}/missing.txt not found"),
    ({"--out_dir": "{inputs}/text.txt"}, "--out_dir {inputs}/text.txt is a file, not a folder; fix: pass a folder "
                                         "for the dataset"),
    ({"--out_dir": "{inputs}/text.txt/out"}, "--out_dir {inputs}/text.txt/out cannot be created: {inputs}/text.txt "
                                             "is a file"),
    ({"--out_dir": "{data}"}, "--out_dir {data} already holds a dataset, of other inputs or options, that this one "
                              "would replace; fix: pass --force to replace it, or another --out_dir"),
    ({"--tokenizer": "{inputs}/tokenizer_folder"}, "--tokenizer {inputs}/tokenizer_folder is a folder, not a file"),
    ({"--workers": "0"}, "--workers 0: must be >= 1; fix: pass the number of processes that tokenize"),
    ({"--chunk_mb": "0"}, "--chunk_mb 0.0: must be > 0"),
    ({"--chunk_mb": "-1"}, "--chunk_mb -1.0: must be > 0"),
    ({"--val_fraction": "0"}, "--val_fraction 0.0 must be between 0 and 1"),
]


@pytest.mark.parametrize("flags,message", PREPARE_ROWS, ids=[next(iter(f)) + "=" + list(f.values())[0][-14:]
                                                             for f, _ in PREPARE_ROWS])
def test_prepare_refuses(inputs, char_data, tmp_path, capsys, flags, message):
    paths = {"inputs": inputs, "data": char_data}
    base = {"--input": "{inputs}/text.txt", "--out_dir": str(tmp_path / "out"), "--workers": "1"}
    assert_refused(data.prepare.main, command(base, flags, paths), message, paths, capsys, [inputs, char_data])


def test_prepare_force_replaces_a_dataset(inputs, tmp_path):
    out, other = str(tmp_path / "out"), tmp_path / "other.txt"
    other.write_text("another text, longer than the first one")
    data.prepare.main(["--input", str(inputs / "text.txt"), "--out_dir", out])
    data.prepare.main(["--input", str(other), "--out_dir", out, "--force"])
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["source"] == [str(other)]


def test_a_zstd_file_of_several_frames_reads_whole(tmp_path):
    lines = [json.dumps({"text": f"document {i}"}) + "\n" for i in range(3000)]
    compress = zstandard.ZstdCompressor().compress
    (tmp_path / "frames.jsonl.zst").write_bytes(b"".join(compress("".join(lines[i:i + 700]).encode())
                                                         for i in range(0, 3000, 700)))
    assert list(documents(Piece(str(tmp_path / "frames.jsonl.zst"), "jsonl.zst"))) == [f"document {i}"
                                                                                       for i in range(3000)]


# One row of each tool as a user types it: (command, damage, message).
AS_TYPED = [
    ([sys.executable, "-m", "data.prepare", "--input", "{inputs}/not_gzip.jsonl.gz", "--out_dir", "{tmp}/out"], None,
     "input {inputs}/not_gzip.jsonl.gz is not gzip data"),
    ([sys.executable, "-m", "training.export", "--out_dir", "{run}", "--output", "{run}/metrics.jsonl"], None,
     "--output {run}/metrics.jsonl is a file, not a folder"),
    ([sys.executable, "sample.py", "--out_dir", "{run}"], only_tag_truncated, "is corrupt: 1,000 bytes, ... fix: "
     "there is no other complete checkpoint in {root}"),
    ([sys.executable, "-m", "training.checkpoint", "universal", "--out_dir", "{run}"], truncated, "is corrupt: 1,000 "
     "bytes, ... fix: resume from another tag: step_000001$"),
    ([sys.executable, "-m", "training.plot", "{run}", "--output", "{run}/metrics.jsonl", "--force"], None,
     "--output {run}/metrics.jsonl is not an image file matplotlib writes"),
    ([sys.executable, "preflight.py", "--min_busbw", "-1"], None, "--min_busbw -1.0: must be >= 0"),
]


@pytest.mark.parametrize("cmd,damage,message", AS_TYPED, ids=[next(p for p in row[0][1:] if p != "-m")
                                                               for row in AS_TYPED])
def test_each_tool_as_typed(paths, inputs, cmd, damage, message):
    paths = {**paths, "inputs": inputs}
    if damage:
        damage(paths["run"])
    before = snapshot(paths["run"], inputs)
    proc = run([part.format(**paths) for part in cmd], check=False, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert_one_error_line(proc.stderr, message, paths)
    assert before.items() <= snapshot(paths["run"], inputs).items()


# (the tool as typed, a command line argparse refuses, the error line's words): argparse's own errors end in one
# `error:` line and exit 2 too, naming the tool as the user typed it (common.checks.ToolParser).
BAD_COMMAND_LINES = [
    ("train.py", ["--bogus"], "error: train.py: unrecognized arguments: --bogus; fix: see train.py --help"),
    ("preflight.py", ["--min_busbw", "x"], "error: preflight.py: argument --min_busbw: invalid float value: 'x'"),
    ("sample.py", [], "error: sample.py: one of the arguments --out_dir --export is required"),
    ("-m data.prepare", ["--workers", "x"], "error: python -m data.prepare: argument --workers: invalid int value: "
                                            "'x'; fix: see python -m data.prepare --help"),
    ("-m training.export", [], "error: python -m training.export: the following arguments are required: --out_dir"),
    ("-m training.checkpoint", ["convert"], "error: python -m training.checkpoint: argument command: invalid choice"),
    ("-m training.plot", [], "error: python -m training.plot: the following arguments are required: RUN_DIR"),
    ("-m training.memory_plan", [], "error: python -m training.memory_plan: the following arguments are required"),
    ("benchmarks/throughput.py", ["--steps", "x"], "error: throughput.py: argument --steps: invalid int value"),
]


@pytest.mark.parametrize("tool, args, message", BAD_COMMAND_LINES, ids=[row[0] for row in BAD_COMMAND_LINES])
@pytest.mark.filterwarnings("ignore:.*found in sys.modules after import of package")  # runpy on imported modules
def test_a_bad_command_line_is_one_error_line(tool, args, message, monkeypatch, capsys):
    """In this process through each tool's `__main__` block, but for the two that set up a rank (signal handlers,
    a fault handler), which run as typed."""
    import runpy
    if tool in ("train.py", "preflight.py"):
        proc = run([sys.executable, tool, *args], check=False, timeout=120)
        code, stderr = proc.returncode, proc.stderr
    else:
        monkeypatch.setattr(sys, "path", list(sys.path))  # scripts put the repo on it again
        monkeypatch.setattr(sys, "argv", [tool.split()[-1], *args])
        with pytest.raises(SystemExit) as ended:
            if tool.startswith("-m "):
                runpy.run_module(tool[3:], run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(os.path.join(os.path.dirname(os.path.dirname(__file__)), tool), run_name="__main__")
        code, stderr = ended.value.code, capsys.readouterr().err
    assert code == 2, stderr
    assert [line for line in stderr.splitlines() if line.startswith("error:")] == [line for line in stderr.splitlines()
                                                                                  if message in line]
    assert message in stderr and "usage:" not in stderr
