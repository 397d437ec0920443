"""python -m scripts.chat, a conversation in the terminal: each answer the one transformers' generate gives to the
whole conversation so far in the model's own chat template, the earliest exchanges left out where it outgrows the
context, /reset and /quit; a model without a chat template refused at start."""
import subprocess
import sys

import pytest
import torch

from harness import REPO
from hub_folders import ENDS, IM_END, PADDING, decisive_qwen3, hub_tokenizer

SYSTEM = {"role": "system", "content": "Be brief."}
NEW = 8  # --max_new_tokens


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, shakespeare_path):
    tokenizer = hub_tokenizer(tmp_path_factory.mktemp("tokenizer"), shakespeare_path)
    return decisive_qwen3(tmp_path_factory.mktemp("Qwen3-tiny"), tokenizer, context=256)


def chat(folder, lines: list[str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scripts.chat", "--export", str(folder), "--temperature", "0",
                           "--system", SYSTEM["content"], "--max_new_tokens", str(NEW), *args],
                          input="".join(line + "\n" for line in lines), cwd=REPO, capture_output=True, text=True,
                          timeout=120)


class Transformers:
    """The answers of the folder's model in transformers: its template's prompt, greedy among the tokenizer's ids
    (scripts.chat draws among them), up to the end of turn or an end the generation config names."""

    def __init__(self, folder, model):
        from transformers import AutoTokenizer

        self.model, self.tokenizer = model, AutoTokenizer.from_pretrained(str(folder))
        self.ends = [self.tokenizer.convert_tokens_to_ids(IM_END), *ENDS]

    def prompt(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"]

    @torch.no_grad()
    def answer(self, messages: list[dict]) -> str:
        prompt = self.prompt(messages)
        ids = self.model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                                  eos_token_id=self.ends, suppress_tokens=PADDING)[0, len(prompt):].tolist()
        return self.tokenizer.decode(ids[:-1] if ids[-1] in self.ends else ids)

    def conversation(self, messages: list[str]) -> list[dict]:
        """The conversation of `messages` and transformers' answers."""
        turns = [SYSTEM]
        for message in messages:
            turns.append({"role": "user", "content": message})
            turns.append({"role": "assistant", "content": self.answer(turns)})
        return turns


def test_each_answer_is_transformers_answer_to_the_whole_conversation(qwen3):
    theirs = Transformers(*qwen3)
    turns = theirs.conversation(["Who art thou?", "Speak!", "Why?"])
    proc = chat(qwen3[0], ["Who art thou?", "", "Speak!", "Why?"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "".join(turn["content"] + "\n" for turn in turns[2::2])
    assert len({turn["content"] for turn in turns[2::2]}) == 3 and proc.stderr == ""


def test_a_conversation_past_the_context_leaves_its_earliest_exchange_out(qwen3):
    """At a context the second message's prompt passes, less an answer's room, the first exchange is left out;
    /reset starts anew; a message that alone leaves no room is said so and skipped; /quit ends."""
    theirs = Transformers(*qwen3)
    first = theirs.conversation(["Who art thou?"])
    whole = first + [{"role": "user", "content": "Speak!"}]
    context = len(theirs.prompt(whole)) + NEW - 1
    alone = theirs.answer([SYSTEM, {"role": "user", "content": "Speak!"}])
    lines = ["Who art thou?", "Speak!", "/reset", "Speak!", "word " * context, "/quit", "never answered"]
    proc = chat(qwen3[0], lines, "--max_model_len", str(context))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{first[2]['content']}\n{alone}\n{alone}\n"
    notes = proc.stderr.splitlines()
    assert notes[:2] == ["(the conversation's earliest exchange left out: it no longer fits the context)",
                         "(a new conversation)"]
    assert notes[2].startswith("(this message takes ") and notes[2].endswith(
        f"tokens of the context's {context}, leaving an answer less than {NEW}: write a shorter one, or pass a "
        f"longer --max_model_len)") and len(notes) == 3


def test_a_model_without_a_chat_template_is_refused_at_start(qwen3, tmp_path):
    import shutil

    folder = tmp_path / "base"
    shutil.copytree(qwen3[0], folder)
    (folder / "tokenizer_config.json").unlink()
    proc = chat(folder, ["Hello"])
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "error: python -m scripts.chat needs a model fine-tuned on conversations (data.prepare --format chat), whose "
        "chat template it applies; this one was trained on text: sample it with python sample.py --prompt"]
