"""Export a checkpoint as one safetensors file of full fp32 weights plus a config.json.

    python -m scripts.export --out_dir out/gpt2_124m [--tag step_005000] [--output DIR] [--force]
    python -m scripts.export --out_dir out/lora_run --adapter      # a LoRA run's adapters alone, in PEFT's layout

Any checkpoint works: ZeRO 0-3, with pipeline stages or not, or already universal. GPT and Llama weights are written
in Hugging Face's layout (training/checkpoints/hf.py), so `GPT2LMHeadModel` / `LlamaForCausalLM.from_pretrained(DIR)`
load them; encoder weights keep this repo's names. config.json also carries this repo's model settings
and the tokenizer, for `sample.py --export DIR`.

The export is written into a scratch folder beside DIR and renamed into place, so a failed export never
leaves half of one; an existing DIR is refused (--force replaces an earlier export), unless it already holds
the export of this very checkpoint (nothing to do). A LoRA run's export merges its adapters into the weights;
--adapter writes them alone instead (training/checkpoints/adapter.py), default folder <out_dir>/export/<tag>_adapter.
"""
import argparse
import os

from common import freeze_imports
from common.checks import ConfigError, ToolParser, exit_bad_input
from training.checkpoints import checkpoint
from training.checkpoints.adapter import export_adapter
from training.checkpoints.export import export


def main(argv=None) -> None:
    parser = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out_dir", required=True, help="the run's train.out_dir")
    parser.add_argument("--tag", help="default: the newest complete checkpoint")
    parser.add_argument("--output", help="a new folder (default: <out_dir>/export/<tag>)")
    parser.add_argument("--force", action="store_true", help="replace an earlier export in --output")
    parser.add_argument("--adapter", action="store_true", help="a LoRA run's adapters alone, in PEFT's layout, for "
                        "the Hugging Face model it started from (train.init_from)")
    args = parser.parse_args(argv)
    try:
        tag_dir = checkpoint.find_checkpoint(args.out_dir, args.tag)
        name = os.path.basename(tag_dir) + ("_adapter" if args.adapter else "")
        output = args.output or os.path.join(args.out_dir, "export", name)
        (export_adapter if args.adapter else export)(tag_dir, output, args.force)
    except ConfigError as e:
        exit_bad_input(e)


if __name__ == "__main__":
    freeze_imports()
    main()
