"""The reverse-the-words task (data/reverse_task.py), the README's fine-tuning example: drawn by seed, none of the
held-out prompts among the training ones, the README's prompt held out, every conversation whole in the quickstart's
context; the tool's files as typed, its refusals; the benchmark draws its tasks here."""
import json

import pytest

from data import reverse_task
from data.chat import BUILTIN_TEMPLATES
from data.chat_template import ChatTemplate
from refusals import assert_refused


def test_the_draw_is_seeded_and_no_held_out_prompt_trains():
    train, test = reverse_task.tasks(3000, 200)
    assert (train, test) == reverse_task.tasks(3000, 200) and train != reverse_task.tasks(3000, 200, seed=1)[0]
    assert test[0] == ["king", "crown", "night"]  # the README's prompt
    assert len({tuple(w) for w in train + test}) == 3200  # all different: none held out trains
    assert {len(w) for w in train} == {2, 3} and set(sum(train, [])) == set(reverse_task.WORDS)


@pytest.mark.parametrize("template", ["lines", "plain"])
def test_the_longest_conversation_fits_the_quickstart_context(template):
    """At most 65 characters (context 64, + 1 for the last target) through either built-in template, the plain one's
    end-of-text a token."""
    longest = [max(reverse_task.WORDS, key=len)] * 3
    text, _ = ChatTemplate(BUILTIN_TEMPLATES[template]).render(reverse_task.conversation(longest)["messages"])
    assert len(text.replace("<|endoftext|>", "\0")) <= 65


def test_the_tool_writes_the_training_and_held_out_conversations(tmp_path, capsys):
    argv = ["--out_dir", str(tmp_path), "--train", "50", "--test", "5"]
    reverse_task.main(argv)
    train = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    test = [json.loads(line) for line in (tmp_path / "test.jsonl").read_text().splitlines()]
    assert (len(train), len(test)) == (50, 5)
    assert test[0] == {"messages": [{"role": "user", "content": "Reverse: king crown night"},
                                    {"role": "assistant", "content": "night crown king"}]}
    reverse_task.main(argv)
    assert capsys.readouterr().out.endswith("already holds these tasks; nothing to do\n")


@pytest.mark.parametrize("argv, message", [
    (["--train", "0"], "--train 0: must be >= 1$"),
    (["--train", "20000"], "20,000 training and 2 held-out prompts of 2 to 3 of 23 words: only 12,696 different "
                           "ones exist; fix: ask for fewer$"),
    (["--seed", "1"], "--out_dir {out} already holds {out}/train.jsonl, of other options, that this would replace; "
                      "fix: pass --force to replace it, or another --out_dir$"),
    (["--out_dir", "{out}/train.jsonl"], "--out_dir {out}/train.jsonl is a file; fix: pass a folder$"),
])
def test_the_tool_refuses(tmp_path, capsys, argv, message):
    reverse_task.main(["--out_dir", str(tmp_path), "--train", "10", "--test", "2"])
    capsys.readouterr()
    paths = {"out": tmp_path}
    base = ["--out_dir", str(tmp_path), "--train", "10", "--test", "2"] if "--out_dir" not in argv else []
    assert_refused(reverse_task.main, base + [a.format(**paths) for a in argv], message, paths, capsys, [tmp_path])


def test_the_benchmark_draws_its_tasks_here():
    from benchmarks import finetune

    assert finetune.tasks is reverse_task.tasks and not hasattr(finetune, "WORDS")
