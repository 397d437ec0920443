"""Plot one or more runs from their metrics.jsonl: loss (train and validation), learning rate, tokens/s, MFU
and, for a run that scores eval.tasks, multiple-choice accuracy against steps (or tokens), several runs
overlaid for comparison.

    python -m scripts.plot out/quickstart                        # writes out/quickstart/metrics.png
    python -m scripts.plot out/a out/b --x tokens --output compare.png

Tokens per step come from the run's saved ds_config.json (global batch) and config.yaml (context), so
runs with different batch sizes line up on the tokens axis. Needs matplotlib (`pip install '.[plot]'`).
An existing output is refused unless --force says to replace it; the image is written whole or not at all.
"""
import argparse
import os
import sys

if __package__ in (None, ""):  # `python scripts/plot.py`: import from the repo root, as `python -m` does
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from common.checks import ConfigError, ToolParser, exit_bad_input, new_output
from training.plot import PlotError, plot, read_run


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
