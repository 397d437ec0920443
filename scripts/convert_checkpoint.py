"""Convert a checkpoint: `universal` writes <tag>_universal beside it, in DeepSpeed's universal format, which
resumes on another layout (docs/checkpoints.md).

    python -m scripts.convert_checkpoint universal --out_dir out/run [--tag step_001000]
"""
import argparse

from common.checks import ConfigError, ToolParser, exit_bad_input
from training import checkpoint


def main(argv=None) -> None:
    parser = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    universal = commands.add_parser("universal", help="convert a checkpoint to DeepSpeed's universal format, "
                                                      "to resume it on another layout")
    universal.add_argument("--out_dir", required=True, help="the run's train.out_dir")
    universal.add_argument("--tag", help="default: the newest complete checkpoint")
    args = parser.parse_args(argv)
    try:
        checkpoint.to_universal(args.out_dir, args.tag)
    except ConfigError as e:
        exit_bad_input(e)


if __name__ == "__main__":
    main()
