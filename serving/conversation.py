"""A conversation with a model in the terminal (python -m scripts.chat): the messages so far, rendered whole by the
model's chat template for each answer, its earliest exchanges left out where an answer would have no room in the
context; each answer printed as it is drawn."""
import sys
from dataclasses import replace

import torch

from data.chat import chat_prompt
from model.generate import Sampling, generated
from serving.text import TextStream

WHAT, INSTEAD = "python -m scripts.chat", "sample it with python sample.py --prompt"


class Conversation:
    """One conversation at a time: the messages so far, and how an answer to the next one is drawn."""

    def __init__(self, decoder, tokenizer, meta: dict, system: list, context: int, sampling: Sampling,
                 ends: list[int], seed: int):
        self.decoder, self.tokenizer, self.meta, self.system = decoder, tokenizer, meta, system
        self.context, self.sampling, self.ends = context, sampling, ends
        self.room = min(sampling.max_new_tokens, context // 2)  # an answer's least room
        self.generator = torch.Generator().manual_seed(seed)
        self.history: list[dict] = []

    def run(self, lines, out) -> int:
        """Answers each line of `lines` (a command, or a user message) on `out` until /quit or their end."""
        interactive = lines.isatty()
        if interactive:
            print("(/reset starts a new conversation; /quit or Ctrl-D ends)", file=sys.stderr, flush=True)
        while True:
            if interactive:
                print("> ", end="", file=out, flush=True)
            line = lines.readline()
            if not line or line.strip() == "/quit":
                return 0
            message = line.rstrip("\n")
            if message.strip() == "/reset":
                self.history = []
                print("(a new conversation)", file=sys.stderr, flush=True)
            elif message.strip():
                self.answer(message, out)

    def answer(self, message: str, out) -> None:
        """Prints the answer to `message` as it is drawn, and keeps both in the conversation."""
        try:
            prompt = self.prompt({"role": "user", "content": message})
        except ValueError as e:  # a message the template refuses (its own raise_exception)
            print(f"({e})", file=sys.stderr, flush=True)
            return
        if prompt is None:
            return
        stream = TextStream(self.tokenizer, [])
        sampling = replace(self.sampling, max_new_tokens=min(self.sampling.max_new_tokens, self.context - len(prompt)),
                           stop_ids=tuple(self.ends))
        for token in generated(self.decoder, prompt, sampling, self.generator):
            if token in self.ends:
                break
            print(stream.add(token)[0], end="", file=out, flush=True)
        print(stream.rest(), file=out, flush=True)
        self.history += [{"role": "user", "content": message}, {"role": "assistant", "content": stream.text}]

    def prompt(self, turn: dict) -> list[int] | None:
        """The ids of the conversation with `turn`, its earliest exchanges left out until an answer has its room;
        None (said on stderr) where the message alone leaves none."""
        alone, _ = chat_prompt([*self.system, turn], self.meta, self.tokenizer, WHAT, INSTEAD)
        if len(alone) > self.context - self.room:  # the conversation so far kept for a shorter message
            print(f"(this message takes {len(alone):,} tokens of the context's {self.context:,}, leaving an answer "
                  f"less than {self.room}: write a shorter one, or pass a longer --max_model_len)", file=sys.stderr,
                  flush=True)
            return None
        while True:
            ids, _ = chat_prompt([*self.system, *self.history, turn], self.meta, self.tokenizer, WHAT, INSTEAD)
            if len(ids) <= self.context - self.room:
                return ids
            self.history = self.history[2:]
            print("(the conversation's earliest exchange left out: it no longer fits the context)", file=sys.stderr,
                  flush=True)
