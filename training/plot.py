"""Plot one or more runs from their metrics.jsonl: loss (train and validation), learning rate, tokens/s, MFU
and, for a run that scores eval.tasks, multiple-choice accuracy against steps (or tokens), several runs
overlaid for comparison.

    python -m training.plot out/quickstart                        # writes out/quickstart/metrics.png
    python -m training.plot out/a out/b --x tokens --output compare.png

Tokens per step come from the run's saved ds_config.json (global batch) and config.yaml (context), so
runs with different batch sizes line up on the tokens axis. Needs matplotlib (`pip install '.[plot]'`).
An existing output is refused unless --force says to replace it; the image is written whole or not at all.
"""
import argparse
import io
import json
import os
import sys

if __package__ in (None, ""):  # `python training/plot.py`: import from the repo root, as `python -m` does
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from common.checks import ConfigError, ToolParser, existing_dir, existing_file, exit_bad_input, new_output  # noqa: E402
from data.writer import write_atomic  # noqa: E402


class PlotError(ValueError):
    """A run directory that cannot be plotted; the message says why."""

PANELS = [("loss", "loss"), ("lr", "learning rate"), ("tokens_per_s", "tokens/s"), ("mfu", "MFU (%)")]
ACCURACY = ("accuracy", "multiple-choice accuracy")  # a fifth panel, for runs that score eval.tasks
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
    return {"name": os.path.basename(os.path.normpath(run_dir)), "series": series,
            "tokens_per_step": tokens_per_step(run_dir)}


def accuracy_series(run: dict) -> dict[str, tuple[str, str, str]]:
    """{series: (task, line style, metric)} of the run's eval.tasks accuracies (metrics <task>_acc[_norm])."""
    found = {}
    for series in run["series"]:
        for suffix, style, what in ACC_SUFFIXES:
            if series.endswith(suffix) and series not in found:
                found[series] = (series.removesuffix(suffix), style, what)
    return found


def tokens_per_step(run_dir: str) -> int | None:
    from omegaconf import OmegaConf
    try:
        with open(os.path.join(run_dir, "ds_config.json")) as f:
            batch = json.load(f)["train_batch_size"]
        return batch * OmegaConf.load(os.path.join(run_dir, "config.yaml")).model.block_size
    except Exception:  # noqa: BLE001 (a missing or unreadable file, whatever the parser raises: unknown)
        return None


def plot(runs: list[dict], output: str, x: str = "step") -> None:
    import matplotlib
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    if x == "tokens" and any(run["tokens_per_step"] is None for run in runs):
        raise PlotError("--x tokens needs each run's ds_config.json and config.yaml (written by train.py)")
    panels = PANELS + ([ACCURACY] if any(accuracy_series(run) for run in runs) else [])
    fig, axes = plt.subplots(2, 2 if len(panels) == 4 else 3, figsize=(11 if len(panels) == 4 else 16, 7),
                             constrained_layout=True)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    image = os.path.splitext(output)[1][1:].lower()
    if image not in fig.canvas.get_supported_filetypes():
        plt.close(fig)
        raise PlotError(f"--output {output} is not an image file matplotlib writes; fix: end it in .png (or .pdf, "
                        f".svg)")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        scale = run["tokens_per_step"] if x == "tokens" else 1
        color, label = colors[i % len(colors)], run["name"]
        for ax, (key, title) in zip(axes.flat, panels):
            if key == "accuracy":
                for series, (task, style, what) in accuracy_series(run).items():
                    steps, values = run["series"][series]
                    ax.plot([s * scale for s in steps], values, style, color=color, markersize=4,
                            label=f"{label}: {task} {what} {values[-1]:.3f}")
            elif key == "loss":
                for series, style, what in (("loss", "-", "train"), ("val_loss", "o--", "val")):
                    if series in run["series"]:
                        steps, values = run["series"][series]
                        ax.plot([s * scale for s in steps], values, style, color=color, markersize=4,
                                label=f"{label}: {what}" + (f" {values[-1]:.4f}" if series == "val_loss" else ""))
            elif key in run["series"]:
                steps, values = run["series"][key]
                ax.plot([s * scale for s in steps], values, "-", color=color, label=label)
    for ax, (key, title) in zip(axes.flat, panels):
        ax.set_title(title)
        ax.set_xlabel("tokens" if x == "tokens" else "step")
        ax.grid(alpha=0.3)
        if key in ("loss", "accuracy") or len(runs) > 1:
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


def main(argv=None) -> None:
    parser = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="train.out_dir of each run")
    parser.add_argument("--x", choices=("step", "tokens"), default="step", help="the horizontal axis")
    parser.add_argument("--output", help="PNG to write (default: RUN_DIR/metrics.png of the first run)")
    parser.add_argument("--force", action="store_true", help="replace an existing --output file")
    args = parser.parse_args(argv)
    try:
        runs = [read_run(d) for d in args.run_dirs]
        output = args.output or os.path.join(args.run_dirs[0], "metrics.png")
        if not (args.force and os.path.isfile(output)):  # --force replaces a file, never a folder
            new_output(output, "--output", "pass --force to replace it, or another --output" if os.path.isfile(output)
                       else "pass another --output", folder=False)
        plot(runs, output, args.x)
    except (PlotError, ConfigError) as e:
        exit_bad_input(e)
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
