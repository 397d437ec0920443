"""Generate text from a trained model, on one process, no DeepSpeed engine needed.

    python sample.py --out_dir out/quickstart                     # the newest checkpoint of a run
    python sample.py --out_dir out/quickstart --tag step_001000 --prompt "ROMEO:" --num_samples 3
    python sample.py --export out/quickstart/export/step_002000   # an export (safetensors + config.json)
    python sample.py --export path/to/Qwen3-0.6B --chat "Who are you?"   # a Hugging Face model's folder
    python sample.py --out_dir out/sft --chat "Reverse: king crown"  # a fine-tuned model's answer
"""
import argparse
import sys
from dataclasses import replace

import torch

from common import freeze_imports
from common.checks import ConfigError, ToolParser, exit_bad_input
from data.chat import chat_prompt
from data.documents import documents_seen
from data.meta import answer_ends, drawn_vocabulary
from data.tokenizers import TokenizerError, sampling_start
from model.generate import DTYPES, Sampling, decoder_for, generate, generation_dtype
from training.checkpoints.export import add_trained_arguments, load_trained


def main(argv=None) -> None:
    parser = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_trained_arguments(parser, "sample from")
    parser.add_argument("--prompt", default="\n")
    parser.add_argument("--chat", help="a user message: the model's answer, with its chat template applied")
    parser.add_argument("--max_new_tokens", type=int, default=500)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top_k", type=int, default=200)
    parser.add_argument("--top_p", type=float, default=1.0)
    parser.add_argument("--min_p", type=float, default=0.0,
                        help="draw among tokens at least min_p times as likely as the most likely one")
    parser.add_argument("--repetition_penalty", type=float, default=1.0,
                        help="above 1, tokens of the prompt and the text so far are less likely (transformers')")
    parser.add_argument("--num_samples", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=DTYPES, default="auto", help="auto: bf16 on a GPU, fp32 on the CPU")
    args = parser.parse_args(argv)
    try:
        sampling = Sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p, min_p=args.min_p,
                            repetition_penalty=args.repetition_penalty)
    except ValueError as e:
        exit_bad_input(f"--{e}")
    try:
        cfg, model, tokenizer, meta = load_trained(args.out_dir, args.tag, args.export,
                                                   dtype=generation_dtype(args.device, args.dtype))
        stop_id = None
        if args.chat is not None:
            prompt_ids, stop_id = chat_prompt([{"role": "user", "content": args.chat}], meta, tokenizer,
                                              f"--chat {args.chat!r}", "sample it with --prompt")
    except (ConfigError, TokenizerError, ValueError) as e:
        exit_bad_input(e)
    if args.chat is None:
        try:
            prompt_ids, note = sampling_start(args.prompt, tokenizer)
        except ValueError as e:  # a prompt character outside a char tokenizer's vocabulary
            exit_bad_input(f"--prompt {args.prompt!r}: {e}; use characters of the training text")
        if note:
            print(note, file=sys.stderr)
    model.to(args.device).eval()
    # A cache as long as the sample, not the model's whole context (a Hugging Face model's can be 128K tokens).
    context = min(cfg.block_size, len(prompt_ids) + args.max_new_tokens)
    decoder = decoder_for(model, context, drawn_vocabulary(cfg.vocab_size, meta),
                          documents=documents_seen(cfg.document_masking, meta))
    if stop_id is not None:
        sampling = replace(sampling, stop_ids=answer_ends(meta, stop_id))
    generator = torch.Generator().manual_seed(args.seed)
    for i in range(args.num_samples):
        out = generate(decoder, prompt_ids, sampling, generator)
        if args.chat is None:
            out = prompt_ids + out
        elif out and out[-1] in sampling.stop_ids:  # the answer alone, without its end of turn
            out = out[:-1]
        print(tokenizer.decode(out) + ("\n---------------" if i + 1 < args.num_samples else ""))


if __name__ == "__main__":
    freeze_imports()
    sys.exit(main())
