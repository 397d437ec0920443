"""Convert a checkpoint: `universal` writes <tag>_universal beside it, in DeepSpeed's universal format, which
resumes on another layout (docs/checkpoints.md).

    python -m scripts.convert_checkpoint universal --out_dir out/run [--tag step_001000]
"""
import argparse
import os
import shutil

from common import freeze_imports
from common.checks import ConfigError, ToolParser, exit_bad_input
from training.checkpoints import checkpoint, experts, universal
from training.checkpoints.export import frozen_weights


def main(argv=None) -> None:
    parser = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    convert = commands.add_parser("universal", help="convert a checkpoint to DeepSpeed's universal format, to "
                                                    "resume it on another layout")
    convert.add_argument("--out_dir", required=True, help="the run's train.out_dir")
    convert.add_argument("--tag", help="default: the newest complete checkpoint")
    args = parser.parse_args(argv)
    try:
        to_universal(args.out_dir, args.tag)
    except ConfigError as e:
        exit_bad_input(e)


def to_universal(out_dir: str, tag: str | None) -> str:
    """Convert a complete checkpoint to DeepSpeed's universal format, as <tag>_universal beside it."""
    source = checkpoint.find_checkpoint(out_dir, tag)
    tag = os.path.basename(source)
    saved = checkpoint.read_run_state(source)
    if saved.get("universal"):
        raise ConfigError(f"--tag {tag} is already in the universal format; fix: resume it with train.resume={tag}, "
                          f"or convert the tag it was made from")
    reason = universal.unconvertible(source, saved)
    if reason:
        raise ConfigError(reason)
    target = f"{source}_universal"
    if os.path.exists(os.path.join(target, checkpoint.MANIFEST)):
        print(f"{target} already exists")
        return target
    shutil.rmtree(target, ignore_errors=True)  # the leftovers of an interrupted conversion
    layout = saved["layout"]
    if saved["config"]["model"].get("n_experts"):
        try:
            if universal.has_optimizer_shards(source):
                experts.convert(source, target, layout["dp"], layout.get("ep", 1), layout["pp"],
                                checkpoint.load_state_file)
            else:
                experts.convert_zero0(source, target, saved, layout.get("ep", 1), checkpoint.load_state_file)
        except ValueError as e:
            raise ConfigError(f"{e}; fix: {checkpoint.elsewhere(source, 'convert another tag')}") from None
    elif universal.has_optimizer_shards(source):
        universal.convert(source, target)
    else:
        states = checkpoint.load_state_file(os.path.join(source, "mp_rank_00_model_states.pt"))
        try:
            universal.convert_zero0(source, target, saved, states)
        except ValueError as e:
            raise ConfigError(f"{e}; fix: {checkpoint.elsewhere(source, 'convert another tag')}") from None
    universal.write_entries(target, frozen_weights(source))  # LoRA's, which no optimizer holds
    checkpoint.mark_complete(target, {**saved, "tag": f"{tag}_universal", "universal": True})
    where = ("under ZeRO-3 at any data-parallel size" if layout["zero_stage"] == 3 else
             "at any data-parallel size, pipeline stage count or ZeRO stage from 0 to 2"
             + (" and any expert-parallel degree" if saved["config"]["model"].get("n_experts") else
                " and any tensor-parallel degree"))
    print(f"wrote {target}: resume it {where} with train.resume={tag}_universal")
    return target


if __name__ == "__main__":
    freeze_imports()
    main()
