"""What the conversation tests share: a ChatML template with generation marks, conversations, a tokenizer.json
with ChatML's tokens, reverse-the-words tasks, and reading a prepared conversation dataset back."""
import json
import random

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from corpora import speeches
from data.chat import BUILTIN_TEMPLATES
from data.tokenizers import EOT
from data.writer import read_index

# ChatML with generation marks around each assistant turn's content and its end-of-turn token: the built-in.
CHATML = BUILTIN_TEMPLATES["chatml"]
CONVERSATIONS = [
    [{"role": "user", "content": "Who art thou?"}, {"role": "assistant", "content": "A man, sir."}],
    [{"role": "system", "content": "Answer in verse."}, {"role": "user", "content": "Why weep'st thou?"},
     {"role": "assistant", "content": "For grief — ay, é, and more."}, {"role": "user", "content": "Speak!"},
     {"role": "assistant", "content": "Anon."}],
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": " leading and trailing spaces  "}],
]
WORDS = ["lord", "king", "sword", "night", "crown", "queen", "heart", "blood", "ghost", "storm"]


def chatml_bpe(shakespeare_path: str) -> Tokenizer:
    """A byte-level BPE of 500 ids trained on the speeches, with end-of-text and ChatML's tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(speeches(shakespeare_path)[:2000], trainers.BpeTrainer(
        vocab_size=500, special_tokens=[EOT, "<|im_start|>", "<|im_end|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tokenizer


def chatml_folder(folder, shakespeare_path: str):
    """chatml_bpe's tokenizer.json, with tokenizer_config.json holding CHATML, in `folder`."""
    chatml_bpe(shakespeare_path).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    return folder


def reverse_tasks(count: int, seed: int = 0) -> list[dict]:
    """'Reverse: w1 ... wn' -> 'wn ... w1', answers of 1 to 8 words: very different numbers of assistant tokens."""
    rng = random.Random(seed)
    tasks = []
    for _ in range(count):
        words = [rng.choice(WORDS) for _ in range(rng.randint(1, 8))]
        tasks.append({"messages": [{"role": "user", "content": "Reverse: " + " ".join(words)},
                                   {"role": "assistant", "content": " ".join(reversed(words))}]})
    return tasks


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def documents(out_dir, split: str) -> list[tuple[list[int], list[int]]]:
    """(tokens, mask) of each conversation of a prepared split."""
    meta = json.loads((out_dir / "meta.json").read_text())
    tokens = np.fromfile(out_dir / f"{split}.bin", dtype=meta["dtype"])
    masks = np.fromfile(out_dir / f"{split}.mask", dtype=np.uint8)
    index = read_index(str(out_dir), split)
    return [(tokens[a:b].tolist(), masks[a:b].tolist()) for a, b in zip(index[:-1], index[1:])]
