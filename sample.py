"""Generate text from a trained model, on one process, no DeepSpeed engine needed.

    python sample.py --out_dir out/quickstart                     # the newest checkpoint of a run
    python sample.py --out_dir out/quickstart --tag step_001000 --prompt "ROMEO:" --num_samples 3
    python sample.py --export out/quickstart/export/step_002000   # an export (safetensors + config.json)
"""
import argparse
import sys

import torch

from common.checks import ConfigError, ToolParser, exit_bad_input
from data.tokenizers import TokenizerError, sampling_start, tokenizer_from_meta
from model import build_model
from model.generate import generate
from training import checkpoint
from training.export import consolidated_state_dict, load_export, run_dataset, run_model


def load(args) -> tuple:
    """(model config, model with its weights, tokenizer) from an export or a run's checkpoint."""
    if args.export:
        cfg, state, meta = load_export(args.export)
        return cfg, with_weights(cfg, state, args.export), tokenizer_from_meta(meta, args.export)
    tag_dir = checkpoint.find_checkpoint(args.out_dir, args.tag)
    run_state = checkpoint.read_run_state(tag_dir)
    meta, data_dir = run_dataset(tag_dir, run_state)
    cfg = run_model(tag_dir, run_state)
    return cfg, with_weights(cfg, consolidated_state_dict(tag_dir), tag_dir), tokenizer_from_meta(meta, data_dir)


def with_weights(cfg, state: dict, source: str):
    """The model of `cfg` holding `state`, the weights read from `source`."""
    model = build_model(cfg)
    try:
        model.load_state_dict(state)
    except RuntimeError as e:  # names or shapes that another model's export would have
        why = " ".join(str(e).split())[:300]
        raise ConfigError(f"the weights of {source} do not fit its model settings ({why}); fix: export the "
                          f"checkpoint again with python -m training.export") from None
    return model


def main(argv=None) -> None:
    parser = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--out_dir", help="a run's train.out_dir: sample from its checkpoint")
    source.add_argument("--export", help="a folder written by python -m training.export")
    parser.add_argument("--tag", help="with --out_dir: the checkpoint tag (default: the newest)")
    parser.add_argument("--prompt", default="\n")
    parser.add_argument("--max_new_tokens", type=int, default=500)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top_k", type=int, default=200)
    parser.add_argument("--num_samples", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    try:
        cfg, model, tokenizer = load(args)
    except (ConfigError, TokenizerError) as e:
        exit_bad_input(e)
    try:
        prompt_ids, note = sampling_start(args.prompt, tokenizer)
    except ValueError as e:  # a prompt character outside a char tokenizer's vocabulary
        exit_bad_input(f"--prompt {args.prompt!r}: {e}; use characters of the training text")
    if note:
        print(note, file=sys.stderr)
    model.to(args.device).eval()
    prompt = torch.tensor([prompt_ids], dtype=torch.long, device=args.device)
    generator = torch.Generator().manual_seed(args.seed)
    for i in range(args.num_samples):
        out = generate(model, prompt, args.max_new_tokens, cfg.block_size, cfg.vocab_size, args.temperature,
                       args.top_k, generator)
        print(tokenizer.decode(out[0].tolist()) + ("\n---------------" if i + 1 < args.num_samples else ""))


if __name__ == "__main__":
    sys.exit(main())
