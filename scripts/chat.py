"""Talk with a model fine-tuned on conversations, in the terminal: each line typed is a user message, the answer is
printed as it is drawn, and the conversation goes on, the whole of it rendered by the model's chat template for each
answer (the keys and values of what was rendered before kept, as the server's prefix cache keeps them). `/reset`
starts a new conversation; `/quit` or the end of input (Ctrl-D) ends.

    python -m scripts.chat --out_dir out/llama_quickstart_sft
    python -m scripts.chat --export path/to/Qwen3-0.6B --system "Answer in one sentence." --max_model_len 4096
    printf 'Reverse: a b c\\nReverse: d e\\n' | python -m scripts.chat --out_dir out/sft --temperature 0

An answer has room for --max_new_tokens tokens, or half the context where that is less: a conversation that would
leave it less loses its earliest exchanges (the system message stays), and says so.
"""
import argparse
import sys

import torch

from common import freeze_imports
from common.checks import ConfigError, ToolParser, exit_bad_input
from data.chat import chat_prompt
from data.documents import documents_seen
from data.meta import answer_ends, drawn_vocabulary
from data.tokenizers import TokenizerError
from model.generate import DTYPES, Sampling, decoder_for, generation_dtype
from model.prefix_cache import PrefixCache
from serving.conversation import INSTEAD, WHAT, Conversation
from serving.engine import check_cache
from training.checkpoints.export import add_trained_arguments, load_trained

PREFIX_CACHE_MB = 256  # the conversation so far: a 0.6B Qwen's keys and values of about 1,100 tokens in fp32


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        sampling = Sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p)
    except ValueError as e:
        exit_bad_input(f"--{e}")
    dtype = generation_dtype(args.device, args.dtype)
    system = [{"role": "system", "content": args.system}] if args.system else []
    try:
        if args.max_model_len is not None and args.max_model_len < 2:
            raise ConfigError(f"--max_model_len {args.max_model_len}: must be at least 2")
        cfg, model, tokenizer, meta = load_trained(args.out_dir, args.tag, args.export, context=args.max_model_len,
                                                   dtype=dtype)
        context = min(args.max_model_len or cfg.block_size, cfg.block_size)
        check_cache(cfg, model, 1, context, dtype, args.device)
        _, end = chat_prompt([*system, {"role": "user", "content": "Hello."}], meta, tokenizer, WHAT, INSTEAD)
    except (ConfigError, TokenizerError, ValueError) as e:
        exit_bad_input(e)
    model.to(args.device, dtype).eval()
    decoder = decoder_for(model, context, drawn_vocabulary(cfg.vocab_size, meta),
                          documents=documents_seen(cfg.document_masking, meta),
                          prefix_cache=PrefixCache(PREFIX_CACHE_MB * 2**20))
    conversation = Conversation(decoder, tokenizer, meta, system, context, sampling, answer_ends(meta, end),
                                args.seed)
    try:
        return conversation.run(sys.stdin, sys.stdout)
    except KeyboardInterrupt:  # Ctrl-C: the conversation ends, without a traceback
        print(file=sys.stderr)
        return 130


def parse_args(argv):
    parser = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_trained_arguments(parser, "talk with")
    parser.add_argument("--system", help="a system message, first in every conversation")
    parser.add_argument("--max_new_tokens", type=int, default=512, help="the most tokens of one answer")
    parser.add_argument("--temperature", type=float, default=0.7, help="0 takes the most likely token")
    parser.add_argument("--top_k", type=int, default=None)
    parser.add_argument("--top_p", type=float, default=0.95)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max_model_len", type=int, help="the tokens a conversation may hold (default: the "
                                                          "model's context)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=DTYPES, default="auto", help="auto: bf16 on a GPU, fp32 on the CPU")
    return parser.parse_args(argv)


if __name__ == "__main__":
    freeze_imports()
    sys.exit(main())
