"""Write the Shakespeare continuation task: a multiple-choice task in HellaSwag's format (data/tasks.py) made
from tinyshakespeare, for eval.tasks and python -m scripts.evaluate.

    python -m data.continuation_task --input ../shared/data/tinyshakespeare.txt --output data/eval/shakespeare.jsonl

Each example is a speech cut before the middle word of one of its lines: the context is the speech up to the
cut (the speaker's name, its earlier lines, the line's first words), and the four choices for the next word
are the true one and three words of the same length that end the context of other speeches' examples. The
same length makes the choice one of fit, not of length; the next word, not the next line, is what a small
character model with a 64-character context can know: with the rest of the line as the choice, the
quickstart GPT scores barely above chance (docs/evaluation.md). Only speeches of the text's last tenth are
used, the quickstart's validation split (data/prepare.py), which the quickstart never trains on. The draw is
seeded: the same input gives the same file.
"""
import argparse
import json
import os
import random

from common.checks import ConfigError, ToolParser, existing_file, exit_bad_input, new_output
from data.prepare import TRAIN_FRACTION
from data.writer import write_atomic

CHOICES = 4
SEED = 1234


def speeches(text: str) -> list[tuple[str, list[str]]]:
    """(speaker line, lines) of each speech, blocks separated by a blank line, that starts past the training
    split and has two lines or more."""
    out, offset, start = [], 0, int(len(text) * TRAIN_FRACTION)
    for block in text.split("\n\n"):
        lines = block.strip("\n").split("\n")
        if offset >= start and len(lines) >= 3 and lines[0].endswith(":"):
            out.append((lines[0], lines[1:]))
        offset += len(block) + 2
    return out


def cuts(text: str) -> list[tuple[int, str, str]]:
    """(speech index, context, next word) for every line of two words or more of every speech."""
    out = []
    for index, (speaker, lines) in enumerate(speeches(text)):
        for at, line in enumerate(lines):
            words = line.split()
            if len(words) >= 2:
                middle = len(words) // 2
                out.append((index, "\n".join([speaker, *lines[:at], " ".join(words[:middle])]), words[middle]))
    return out


def examples(text: str, seed: int = SEED) -> list[dict]:
    """Every cut whose word has three others of its length in other speeches, as an example."""
    found = cuts(text)
    by_length = {}
    for index, _, word in found:
        by_length.setdefault(len(word), []).append((index, word))
    rng = random.Random(seed)
    out = []
    for index, context, truth in found:
        others = [word for i, word in by_length[len(truth)] if i != index and word != truth]
        if len(others) < CHOICES - 1:
            continue
        wrong = rng.sample(others, CHOICES - 1)
        label = rng.randrange(CHOICES)
        out.append({"ctx": context, "endings": wrong[:label] + [truth] + wrong[label:], "label": label})
    return out


def main(argv=None) -> None:
    parser = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="tinyshakespeare.txt")
    parser.add_argument("--output", default="data/eval/shakespeare.jsonl", help="a new JSONL file")
    args = parser.parse_args(argv)
    try:
        existing_file(args.input, "--input", "pass tinyshakespeare.txt")
        new_output(args.output, "--output", "pass another --output, or remove the file", folder=False)
        with open(args.input, encoding="utf-8") as f:
            made = examples(f.read())
        if not made:
            raise ConfigError(f"--input {args.input} holds no speeches (a speaker's line, then lines, blocks "
                              f"separated by a blank line) in its last tenth; fix: pass tinyshakespeare.txt")
    except (ConfigError, UnicodeDecodeError) as e:
        exit_bad_input(e)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    write_atomic(args.output, "".join(json.dumps(e) + "\n" for e in made).encode())
    print(f"wrote {args.output}: {len(made):,} examples of {CHOICES} choices (chance: {1 / CHOICES:.0%})")


if __name__ == "__main__":
    main()
