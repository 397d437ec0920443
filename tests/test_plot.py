"""scripts.plot draws a real run's metrics.jsonl: every logged point, runs overlaid, steps or tokens; a bad
path or file is one `error:` line and exit code 2, with every file it would overwrite as it was (one table,
in process on conftest's `checkpointed_run`)."""
import json
import sys

import pytest

import scripts.plot
import training.plot
from harness import FP32, TINY, metrics, run, train_py
from refusals import assert_refused, command
from training.plot import read_run


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, char_data):
    out = tmp_path_factory.mktemp("plotted_run")
    train_py([f"data.dir={char_data}", f"train.out_dir={out}", *TINY, *FP32,
              "train.max_steps=4", "train.eval_interval=2", "ds.train_micro_batch_size_per_gpu=2"],
             env={"OMP_NUM_THREADS": "1"})
    return out


@pytest.fixture
def drawn(monkeypatch) -> dict:
    """Each panel's lines as (label, y values) by the panel's title, filled as plot() draws them (before it sets the
    title)."""
    import matplotlib.axes
    panels, set_title = {}, matplotlib.axes.Axes.set_title

    def titled(ax, title, *args, **kwargs):
        panels[title] = [(line.get_label(), list(line.get_ydata())) for line in ax.get_lines()]
        return set_title(ax, title, *args, **kwargs)
    monkeypatch.setattr(matplotlib.axes.Axes, "set_title", titled)
    return panels


def test_read_run_holds_every_logged_point(tiny_run):
    records = metrics(tiny_run)
    runs = read_run(str(tiny_run))
    assert runs["tokens_per_step"] == 2 * 32  # global batch 2 x context 32, from the logged tokens_seen
    for key in ("loss", "lr", "tokens_per_s", "val_loss", "train_loss"):
        assert runs["series"][key] == ([r["step"] for r in records if key in r], [r[key] for r in records if key in r])
    assert runs["series"]["mfu"][1] == [100 * r["mfu"] for r in records if "mfu" in r]
    assert runs["series"]["val_loss"][0] == [0, 2, 4]


def test_plot_writes_a_png_of_several_runs(tiny_run, tmp_path):
    png = tmp_path / "compare.png"
    proc = run([sys.executable, "-m", "scripts.plot", str(tiny_run), str(tiny_run), "--x", "tokens", "--output",
                str(png)])
    assert proc.stdout.strip() == f"wrote {png}"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    run([sys.executable, "scripts/plot.py", str(tiny_run)])  # as a script, default output beside the run
    assert (tiny_run / "metrics.png").read_bytes()[:4] == b"\x89PNG"


def test_a_run_that_scores_tasks_gets_an_accuracy_panel(tiny_run, tmp_path, drawn):
    """eval.tasks' accuracies (<task>_acc, <task>_acc_norm) make a fifth panel: the figure grows a column."""
    import shutil
    scored = tmp_path / "scored"
    shutil.copytree(tiny_run, scored)
    with open(scored / "metrics.jsonl", "a") as f:
        for step, acc in ((0, 0.25), (2, 0.3), (4, 0.35)):
            f.write(json.dumps({"step": step, "shake_acc": acc, "shake_acc_norm": acc + 0.01}) + "\n")
    assert training.plot.accuracy_series(read_run(str(scored))) == {"shake_acc": ("shake", "o--", "acc"),
                                                                    "shake_acc_norm": ("shake", "o-", "acc_norm")}

    def width(run_dir) -> int:  # of the PNG, from its header: 80 dpi x 11 or 16 inches
        training.plot.plot([read_run(str(run_dir))], str(tmp_path / "out.png"))
        return int.from_bytes((tmp_path / "out.png").read_bytes()[16:20], "big")
    assert (width(tiny_run), width(scored)) == (880, 1280)
    assert drawn["multiple-choice accuracy"] == [("scored: shake acc 0.350", [0.25, 0.3, 0.35]),
                                                 ("scored: shake acc_norm 0.360", [0.26, 0.31, 0.36])]


def test_a_preference_run_gets_a_reward_accuracy_panel(tiny_run, tmp_path, drawn):
    """Preference tuning's rewards_accuracy (each logged step) and val_rewards_accuracy (each evaluation) are drawn
    in a panel of their own, training and evaluation overlaid."""
    import shutil
    tuned = tmp_path / "tuned"
    shutil.copytree(tiny_run, tuned)
    with open(tuned / "metrics.jsonl", "a") as f:
        for step, acc in ((1, 0.5), (2, 0.75), (3, 0.75), (4, 1.0)):
            f.write(json.dumps({"step": step, "rewards_accuracy": acc}) + "\n")
        for step in (0, 2, 4):
            f.write(json.dumps({"step": step, "val_rewards_accuracy": step / 4}) + "\n")
    training.plot.plot([read_run(str(tuned))], str(tmp_path / "tuned.png"))
    assert drawn["reward accuracy (preference pairs)"] == [("tuned: train", [0.5, 0.75, 0.75, 1.0]),
                                                           ("tuned: val 1.0000", [0.0, 0.5, 1.0])]


def test_a_mixture_of_experts_gets_a_load_panel(tiny_run, tmp_path, drawn):
    """A run with experts logs expert_load_max each step: a panel of its own, beside preference tuning's."""
    import shutil
    moe = tmp_path / "moe"
    shutil.copytree(tiny_run, moe)
    with open(moe / "metrics.jsonl", "a") as f:
        for step, load in ((1, 1.9), (2, 1.5), (3, 1.2)):
            f.write(json.dumps({"step": step, "expert_load_max": load, "rewards_accuracy": 0.5}) + "\n")
    training.plot.plot([read_run(str(moe))], str(tmp_path / "moe.png"))
    assert drawn["expert load (busiest expert / mean, worst layer)"] == [("moe", [1.9, 1.5, 1.2])]
    assert "reward accuracy (preference pairs)" in drawn


def test_plot_names_a_directory_without_metrics(tmp_path):
    proc = run([sys.executable, "-m", "scripts.plot", str(tmp_path)], check=False)
    assert proc.returncode == 2 and proc.stderr.strip() == f"error: metrics file {tmp_path}/metrics.jsonl does not " \
        "exist; fix: pass the train.out_dir of a run that has logged a step"
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + '\n{"step": 2, "lo')
    proc = run([sys.executable, "-m", "scripts.plot", str(tmp_path)], check=False)
    assert "metrics.jsonl, line 2: not JSON" in proc.stderr


def metrics_torn(run_dir):
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "lo')



# (damage, flags, message) of scripts.plot.
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
    (lambda r: (r / "metrics.jsonl").write_text("".join(line for line in (r / "metrics.jsonl").read_text().splitlines(
        keepends=True) if "tokens_seen" not in line)), {"--x": "tokens"}, "--x tokens needs each run's tokens_seen"),
]


@pytest.mark.parametrize("damage,flags,message", PLOT_ROWS, ids=[f"row{i}" for i in range(len(PLOT_ROWS))])
def test_plot_refuses(paths, capsys, damage, flags, message):
    if damage:
        damage(paths["run"])
    assert_refused(scripts.plot.main, command({"RUN": "{run}"}, flags, paths), message, paths, capsys,
                   [paths["run"]])


def test_plot_force_replaces_the_earlier_image(paths, capsys):
    (paths["run"] / "metrics.png").write_bytes(b"an earlier plot")
    scripts.plot.main([str(paths["run"]), "--force"])
    assert (paths["run"] / "metrics.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in paths["run"].iterdir() if p.name.startswith(".")) == []  # no scratch left
