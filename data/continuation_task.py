"""Write the Shakespeare continuation task: a multiple-choice task in HellaSwag's format (data/tasks.py) made
from tinyshakespeare, for eval.tasks and python -m training.evaluate.

    python -m data.continuation_task --input ../shared/data/tinyshakespeare.txt --output data/eval/shakespeare.jsonl

Each example is a speech up to one of its lines (the speaker's name, then its lines: the context) and four
choices for that line: the true one and three lines drawn from other speeches. Only speeches of the text's
last tenth are used, the quickstart's validation split (data/prepare.py), which the quickstart never trains
on; lines of more than 60 characters are left out, so every choice fits the quickstart's 64-character
context. The draw is seeded: the same input gives the same file.
"""
import argparse
import json
import os
import random

from common.checks import ConfigError, ToolParser, existing_file, exit_bad_input, new_output
from data.prepare import TRAIN_FRACTION
from data.writer import write_atomic

CHOICES = 4
LONGEST_LINE = 60
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


def examples(text: str, seed: int = SEED) -> list[dict]:
    """Every line of every speech after its first, as an example whose wrong choices come from other speeches."""
    found = speeches(text)
    rng = random.Random(seed)
    out = []
    for index, (speaker, lines) in enumerate(found):
        others = [line for i, (_, their) in enumerate(found) if i != index for line in their
                  if len(line) <= LONGEST_LINE]
        for at in range(1, len(lines)):
            truth = lines[at]
            if len(truth) > LONGEST_LINE:
                continue
            wrong = rng.sample([line for line in others if line != truth], CHOICES - 1)
            label = rng.randrange(CHOICES)
            out.append({"ctx": "\n".join([speaker, *lines[:at]]), "endings": wrong[:label] + [truth] + wrong[label:],
                        "label": label})
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
