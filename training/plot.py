"""Runs' metrics.jsonl drawn as one image: loss, learning rate, tokens/s, MFU, multiple-choice accuracy, the
reward accuracy of preference tuning, online RL's reward and a mixture of experts' load against steps or tokens,
several runs overlaid. The command: scripts/plot.py.
"""
import io
import json
import os

from common.checks import existing_dir, existing_file
from data.writer import write_atomic


class PlotError(ValueError):
    """A run directory that cannot be plotted; the message says why."""

PANELS = [("loss", "loss"), ("lr", "learning rate"), ("tokens_per_s", "tokens/s"), ("mfu", "MFU (%)")]
ACCURACY = ("accuracy", "multiple-choice accuracy")  # a fifth panel, for runs that score eval.tasks
REWARDS = ("rewards_accuracy", "reward accuracy (preference pairs)")  # and one for preference tuning
RL = ("reward", "online RL: the rollouts' mean reward; val pass@1 (greedy)")  # and one for online RL
EXPERTS = ("expert_load_max", "expert load (busiest expert / mean, worst layer)")  # and one for a mixture of experts
# Panels that overlay a training series (each logged step) and its evaluation (o--, its last value in the legend).
OVERLAID = {"loss": ("loss", "val_loss"), "rewards_accuracy": ("rewards_accuracy", "val_rewards_accuracy"),
            "reward": ("reward", "val_pass1")}
ACC_SUFFIXES = (("_acc_norm", "o-", "acc_norm"), ("_acc", "o--", "acc"))


def read_run(run_dir: str) -> dict:
    """The run's metrics as {key: ([steps], [values])} and its tokens per step (None if unknown)."""
    existing_dir(run_dir, "run folder", "pass the train.out_dir of a run")
    path = existing_file(os.path.join(run_dir, "metrics.jsonl"), "metrics file", "pass the train.out_dir of a run "
                         "that has logged a step")
    series = {}
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            try:
                record = json.loads(line)
            except ValueError:  # malformed JSON, or bytes that are not text
                raise PlotError(f"{path}, line {number}: not JSON (a torn last line of a killed run?); fix: remove "
                                f"that line") from None
            if not isinstance(record, dict) or "step" not in record:
                raise PlotError(f"{path}, line {number}: not a metrics record (a JSON object with a step); fix: pass "
                                f"the train.out_dir of a run, whose metrics.jsonl train.py writes")
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    steps, values = series.setdefault(key, ([], []))
                    steps.append(record["step"])
                    values.append(100 * value if key == "mfu" else value)
    seen = series.get("tokens_seen")  # the tokens trained on through each logged step
    return {"name": os.path.basename(os.path.normpath(run_dir)), "series": series,
            "tokens_per_step": seen[1][0] // seen[0][0] if seen and seen[0][0] else None}


def accuracy_series(run: dict) -> dict[str, tuple[str, str, str]]:
    """{series: (task, line style, metric)} of the run's eval.tasks accuracies (metrics <task>_acc[_norm])."""
    found = {}
    for series in run["series"]:
        for suffix, style, what in ACC_SUFFIXES:
            if series.endswith(suffix) and series not in found:
                found[series] = (series.removesuffix(suffix), style, what)
    return found


def panels_of(runs: list[dict]) -> list[tuple[str, str]]:
    """The four panels of every run, then those that some run's metrics call for."""
    extra = [ACCURACY] if any(accuracy_series(run) for run in runs) else []
    extra += [panel for panel in (REWARDS, RL, EXPERTS) if any(panel[0] in run["series"] for run in runs)]
    return PANELS + extra


def draw_run(panels: list, run: dict, color: str, scale: int) -> None:
    """One run's series on each (axes, (key, title)) of `panels`, its steps times `scale` (tokens a step, or 1)."""
    label = run["name"]
    for ax, (key, _) in panels:
        if key == "accuracy":
            for series, (task, style, what) in accuracy_series(run).items():
                steps, values = run["series"][series]
                ax.plot([s * scale for s in steps], values, style, color=color, markersize=4,
                        label=f"{label}: {task} {what} {values[-1]:.3f}")
        elif key in OVERLAID:
            for series, style, what in zip(OVERLAID[key], ("-", "o--"), ("train", "val")):
                if series in run["series"]:
                    steps, values = run["series"][series]
                    ax.plot([s * scale for s in steps], values, style, color=color, markersize=4,
                            label=f"{label}: {what}" + (f" {values[-1]:.4f}" if what == "val" else ""))
        elif key in run["series"]:
            steps, values = run["series"][key]
            ax.plot([s * scale for s in steps], values, "-", color=color, label=label)


def plot(runs: list[dict], output: str, x: str = "step") -> None:
    import matplotlib
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    if x == "tokens" and any(run["tokens_per_step"] is None for run in runs):
        raise PlotError("--x tokens needs each run's tokens_seen in its metrics.jsonl (train.py writes it at each "
                        "progress line); fix: plot by step")
    panels = panels_of(runs)
    columns = 2 if len(panels) == 4 else 3
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(11 if columns == 2 else 16, 3.5 * rows), constrained_layout=True)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    image = os.path.splitext(output)[1][1:].lower()
    if image not in fig.canvas.get_supported_filetypes():
        plt.close(fig)
        raise PlotError(f"--output {output} is not an image file matplotlib writes; fix: end it in .png (or .pdf, "
                        f".svg)")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        draw_run(list(zip(axes.flat, panels)), run, colors[i % len(colors)],
                 run["tokens_per_step"] if x == "tokens" else 1)
    for ax, (key, title) in zip(axes.flat, panels):
        ax.set_title(title)
        ax.set_xlabel("tokens" if x == "tokens" else "step")
        ax.grid(alpha=0.3)
        if key in ("loss", "accuracy", "rewards_accuracy", "reward") or len(runs) > 1:
            ax.legend(fontsize=8)
    per_step = {run["tokens_per_step"] for run in runs}
    if x == "step" and len(per_step) == 1 and None not in per_step:
        fig.suptitle(f"{', '.join(run['name'] for run in runs)} ({per_step.pop():,} tokens/step)")
    image_bytes = io.BytesIO()  # drawn whole first: a failed drawing leaves the earlier file, or none
    try:
        fig.savefig(image_bytes, dpi=80, format=image)
    finally:
        plt.close(fig)
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    write_atomic(output, image_bytes.getvalue())


if __name__ == "__main__":
    from common.checks import not_a_command

    not_a_command("training.plot", "python -m scripts.plot")
