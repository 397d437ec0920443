"""Generate text from a trained model, on one process, no DeepSpeed engine needed.

    python sample.py --out_dir out/quickstart                     # the newest checkpoint of a run
    python sample.py --out_dir out/quickstart --tag step_001000 --prompt "ROMEO:" --num_samples 3
    python sample.py --export out/quickstart/export/step_002000   # an export (safetensors + config.json)
    python sample.py --out_dir out/sft --chat "Reverse: king crown"  # a fine-tuned model's answer
"""
import argparse
import sys

import torch

from common.checks import ConfigError, ToolParser, exit_bad_input
from data.chat import ChatTemplate, ChatTemplateError, check_chat_record
from data.tokenizers import TokenizerError, sampling_start
from model.generate import generate
from training.export import load_trained


def chat_prompt(message: str, meta: dict, tokenizer) -> tuple[list[int], int]:
    """The ids of a one-message conversation rendered by the model's chat template up to the assistant's turn,
    and the end-of-turn id its answer stops at."""
    if "chat" not in meta:
        raise ConfigError("--chat needs a model fine-tuned on conversations (data.prepare --format chat), whose "
                          "chat template it applies; this one was trained on text: sample it with --prompt")
    try:
        chat = check_chat_record(meta, "the model's dataset meta")
        template = ChatTemplate(chat["chat_template"])
        text, _ = template.render([{"role": "user", "content": message}], add_generation_prompt=True)
    except ChatTemplateError as e:  # a template that fails on a prompt alone, which preparation never rendered
        source = f", from {chat['template']}" if chat.get("template") else ""
        recorded = f"the model's chat template (meta.json chat.chat_template{source})"
        raise ConfigError(f"--chat {message!r}: {e.describe(recorded, 'the message')}; fix: correct the template so "
                          f"it renders a user message with add_generation_prompt, and prepare the conversations "
                          f"again with it (python -m data.prepare --format chat --chat_template FILE)") from None
    except ValueError as e:  # a stale record
        raise ConfigError(f"--chat {message!r}: {e}") from None
    try:
        return tokenizer.encode_with_offsets(text)[0], chat["end_of_turn_id"]
    except ValueError as e:  # a character outside a char tokenizer's vocabulary
        raise ConfigError(f"--chat {message!r}: {e}; fix: write the message in the characters the model was trained "
                          f"on") from None


def main(argv=None) -> None:
    parser = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--out_dir", help="a run's train.out_dir: sample from its checkpoint")
    source.add_argument("--export", help="a folder written by python -m scripts.export")
    parser.add_argument("--tag", help="with --out_dir: the checkpoint tag (default: the newest)")
    parser.add_argument("--prompt", default="\n")
    parser.add_argument("--chat", help="a user message: the model's answer, with its chat template applied")
    parser.add_argument("--max_new_tokens", type=int, default=500)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top_k", type=int, default=200)
    parser.add_argument("--num_samples", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    try:
        cfg, model, tokenizer, meta = load_trained(args.out_dir, args.tag, args.export)
        stop_id = None
        if args.chat is not None:
            prompt_ids, stop_id = chat_prompt(args.chat, meta, tokenizer)
    except (ConfigError, TokenizerError) as e:
        exit_bad_input(e)
    if args.chat is None:
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
                       args.top_k, generator, stop_id)[0].tolist()
        if args.chat is not None:  # the answer alone, without its end of turn
            out = out[len(prompt_ids):]
            out = out[:-1] if out and out[-1] == stop_id else out
        print(tokenizer.decode(out) + ("\n---------------" if i + 1 < args.num_samples else ""))


if __name__ == "__main__":
    sys.exit(main())
