"""Write the reverse-the-words task, the fine-tuning example: conversations "Reverse: king crown night" ->
"night crown king" to train on, and held-out ones, none of whose prompts is among the training ones, to score;
and preference pairs of the training prompts, the reversal chosen over a plausible wrong answer (the words as
given), for preference tuning after fine-tuning; and the training prompts with their answers, for online RL.

    python -m data.reverse_task --out_dir data/reverse_chats      # train.jsonl, test.jsonl, pairs.jsonl, prompts.jsonl
    python -m data.prepare --format chat --input data/reverse_chats/train.jsonl --tokenizer EXPORT --context 64 ...

Each prompt is 2 or 3 of WORDS (lower-case words of 3 to 5 letters, so any character vocabulary of English text
holds them, and a conversation through the built-in templates fits a context of 64 characters); the answer is
the words in reverse order. Records are OpenAI's messages (data/chat.py). The draw is seeded: the same options
give the same files. The README's example, "Reverse: king crown night", is always the first held-out prompt: a
model answers it without having seen it. benchmarks/finetune.py draws its tasks here too.
"""
import argparse
import json
import os
import random

from common.checks import ConfigError, ToolParser, exit_bad_input
from data.writer import write_atomic

WORDS = ("lord king sword night crown queen heart blood ghost storm grave rose moon star fool sea wind fire tears "
         "bread gold stone horse").split()
EXAMPLE = ("king", "crown", "night")
PREFIX = "Reverse: "
SEED = 0


def prompt(words) -> str:
    return PREFIX + " ".join(words)


def answer(words) -> str:
    return " ".join(reversed(words))


def conversation(words) -> dict:
    return {"messages": [{"role": "user", "content": prompt(words)}, {"role": "assistant", "content": answer(words)}]}


def wrong_answer(words) -> str | None:
    """A plausible wrong answer: the words as given, else turned by one; None where every order reads alike."""
    for candidate in (list(words), list(words[1:]) + list(words[:1])):
        if " ".join(candidate) != answer(words):
            return " ".join(candidate)
    return None


def preference_pair(words) -> dict | None:
    """The prompt with the reversal chosen and a wrong answer rejected (data/preference.py's conversational
    format), for preference tuning after fine-tuning."""
    wrong = wrong_answer(words)
    if wrong is None:
        return None
    return {"prompt": [{"role": "user", "content": prompt(words)}],
            "chosen": [{"role": "assistant", "content": answer(words)}],
            "rejected": [{"role": "assistant", "content": wrong}]}


def prompt_record(words) -> dict:
    """The prompt with its answer beside it (data/prompts.py's format), for online RL with rl.reward=exact_match."""
    return {"prompt": [{"role": "user", "content": prompt(words)}], "answer": answer(words)}


def tasks(train: int, test: int, seed: int = SEED, lengths: tuple[int, int] = (2, 3),
          words: tuple[str, ...] | list[str] = WORDS) -> tuple[list[list[str]], list[list[str]]]:
    """`train` word lists to train on and `test` held-out ones, all different; EXAMPLE is the first held-out one
    where it can be drawn (its words among `words`, its length among `lengths`)."""
    low, high = lengths
    if not 1 <= low <= high:
        raise ConfigError(f"word counts {low} to {high}: need 1 <= fewest <= most")
    possible = sum(len(words) ** n for n in range(low, high + 1))
    if train + test > possible:
        raise ConfigError(f"{train:,} training and {test:,} held-out prompts of {low} to {high} of {len(words)} words: "
                          f"only {possible:,} different ones exist; fix: ask for fewer")
    example = [list(EXAMPLE)] if test and low <= len(EXAMPLE) <= high and set(EXAMPLE) <= set(words) else []
    rng, seen, drawn = random.Random(seed), {tuple(w) for w in example}, []
    while len(drawn) < train + test - len(example):
        picked = tuple(rng.choice(words) for _ in range(rng.randint(low, high)))
        if picked not in seen:
            seen.add(picked)
            drawn.append(list(picked))
    return drawn[:train], example + drawn[train:]


def main(argv=None) -> None:
    parser = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out_dir", default="data/reverse_chats", help="where train.jsonl and test.jsonl go")
    parser.add_argument("--train", type=int, default=3000, help="conversations to train on")
    parser.add_argument("--test", type=int, default=200, help="held-out conversations")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--force", action="store_true", help="replace other tasks in --out_dir")
    args = parser.parse_args(argv)
    try:
        for name in ("train", "test"):
            if getattr(args, name) < 1:
                raise ConfigError(f"--{name} {getattr(args, name)}: must be >= 1")
        train, test = tasks(args.train, args.test, args.seed)
        files = {os.path.join(args.out_dir, f"{split}.jsonl"): "".join(json.dumps(conversation(w)) + "\n"
                                                                        for w in drawn).encode()
                 for split, drawn in (("train", train), ("test", test))}
        pairs = [pair for pair in map(preference_pair, train) if pair]
        files[os.path.join(args.out_dir, "pairs.jsonl")] = "".join(json.dumps(p) + "\n" for p in pairs).encode()
        files[os.path.join(args.out_dir, "prompts.jsonl")] = "".join(json.dumps(prompt_record(w)) + "\n"
                                                                     for w in train).encode()
        if os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
            raise ConfigError(f"--out_dir {args.out_dir} is a file; fix: pass a folder")
        if all(_holds(path, data) for path, data in files.items()):
            print(f"{args.out_dir} already holds these tasks; nothing to do")
            return
        other = [path for path in files if os.path.exists(path)]
        if other and not args.force:
            raise ConfigError(f"--out_dir {args.out_dir} already holds {other[0]}, of other options, that this would "
                              f"replace; fix: pass --force to replace it, or another --out_dir")
    except ConfigError as e:
        exit_bad_input(e)
    os.makedirs(args.out_dir, exist_ok=True)
    for path, data in files.items():
        write_atomic(path, data)
    print(f"wrote {args.out_dir}: train.jsonl ({len(train):,} conversations), test.jsonl ({len(test):,} held-out, "
          f"none of their prompts among the training ones), pairs.jsonl ({len(pairs):,} of the training prompts, "
          f"the reversal chosen over a wrong answer), prompts.jsonl (the training prompts with their answers, for "
          f"online RL)")


def _holds(path: str, data: bytes) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read() == data
    except OSError:
        return False


if __name__ == "__main__":
    main()
