"""Batches of a conversation dataset (data/conversations.py): whole conversations packed into windows, targets only
on the assistant's tokens, positions restarting at each conversation, every conversation once an epoch; and what
such a dataset refuses."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import sample
from chats import documents, reverse_tasks
from common.checks import ConfigError
from data.conversations import ChatData
from data.loader import open_data
from data.prepare_chat import prepare_chat
from data.token_data import IGNORE, TokenData
from data.tokenizers import CharTokenizer
from harness import run
from refusals import assert_refused
from training.topology import Layout

CPU = torch.device("cpu")
@pytest.fixture(scope="module")
def chat_data(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("reverse")
    (folder / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in reverse_tasks(200)))
    prepare_chat([str(folder / "tasks.jsonl")], str(folder / "data"), "char", context=128, val_fraction=0.2)
    return str(folder / "data")


def test_windows_hold_whole_conversations_with_targets_on_the_answers(chat_data):
    data = open_data(chat_data, None, 128, document_masking=True)
    assert isinstance(data, ChatData) and data.positions
    written = documents(Path(chat_data), "train")
    rows = data.splits["train"].rows(np.arange(data.train_windows))
    T = 128
    assert len(rows) < len(written)  # packed: several conversations a window
    expected = []
    for tokens, mask in written:
        targets = [t if m else IGNORE for t, m in zip(tokens[1:], mask[1:])]
        expected.append((tokens[:-1], targets))
    seen = []
    for row in rows:
        at, positions = 0, row[2 * T:]
        while at < T and (row[T + at:2 * T] != IGNORE).any():
            n = next((i for i in range(1, T - at) if positions[at + i] == 0), T - at)
            seen.append((row[at:at + n].tolist(), row[T + at:T + at + n].tolist()))
            assert positions[at:at + n].tolist() == list(range(n))
            at += n
    assert sorted(seen) == sorted(expected)  # every conversation once, whole, targets on its answer only


def test_an_epoch_visits_every_window_once_in_its_own_order(chat_data):
    data = ChatData(chat_data, None, 128, document_masking=True, pack=True)
    n, layout = data.train_windows, Layout(1, 1, 1, 1)
    epoch = [data.train_batch(5, step, 0, 0, layout, CPU)[0][0] for step in range(1, 2 * n + 1)]
    first, second = epoch[:n], epoch[n:]
    every = data.splits["train"].rows(np.arange(n))[:, :128]
    key = sorted(t.numpy().tobytes() for t in first)
    assert key == sorted(r.tobytes() for r in torch.from_numpy(every).numpy()) == \
        sorted(t.numpy().tobytes() for t in second)
    assert [t.numpy().tobytes() for t in first] != [t.numpy().tobytes() for t in second]
    assert data.steps_for_epochs(2.5, 4) == int(np.ceil(2.5 * n / 4))


def test_without_packing_a_window_holds_one_conversation(chat_data):
    data = ChatData(chat_data, None, 128, document_masking=False, pack=False)
    assert not data.positions
    inputs, targets = data.train_batch(0, 1, 0, 0, Layout(1, 1, 4, 1), CPU)
    assert isinstance(inputs, torch.Tensor) and inputs.shape == targets.shape == (4, 128)
    assert data.train_windows == len(documents(Path(chat_data), "train"))
    for row in targets:  # one answer, then padding to the end
        supervised = (row != IGNORE).nonzero().flatten()
        assert (row[supervised.max() + 1:] == IGNORE).all()


def test_validation_counts_the_supervised_targets(chat_data):
    data = ChatData(chat_data, None, 128, document_masking=True, pack=True)
    layout = Layout(2, 1, 2, 1)
    counted = sum(int((targets != IGNORE).sum()) for rank in range(2)
                  for _, targets in data.eval_batches("val", 1000, rank, layout, CPU))
    meta = json.loads(open(f"{chat_data}/meta.json").read())
    assert counted == data.eval_targets("val", 1000) == meta["chat"]["val_supervised_tokens"]


def test_what_a_conversation_dataset_refuses(chat_data, char_data):
    with pytest.raises(ConfigError, match="set model.document_masking=true, or data.pack=false"):
        ChatData(chat_data, None, 128, document_masking=False, pack=True)
    with pytest.raises(ConfigError, match="prepared for a context of 128 tokens but model.block_size=64"):
        ChatData(chat_data, None, 64, document_masking=True, pack=True)
    with pytest.raises(ConfigError, match="holds conversations .* which train alone"):
        TokenData(None, None, 16, [{"dir": chat_data, "weight": 1}, {"dir": char_data, "weight": 1}])


def test_sample_chat_refuses_a_model_trained_on_text(checkpointed_run):
    proc = run([sys.executable, "sample.py", "--out_dir", str(checkpointed_run), "--chat", "hi"], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert ("error: --chat 'hi' needs a model fine-tuned on conversations (data.prepare --format chat), whose chat "
            "template it applies; this one was trained on text: sample it with --prompt") in proc.stderr


def test_sample_chat_refuses_a_template_that_fails_on_the_prompt_in_one_line(monkeypatch, capsys):
    """A recorded template that rendered every conversation but fails with add_generation_prompt, which only
    sampling renders: one line naming the template's line and Jinja's message."""
    template = ("{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
                "{% if add_generation_prompt %}\n{{ assistant_prefix.strip() }}{% endif %}")
    meta = {"chat": {"chat_template": template, "template": "/models/t.jinja", "context": 64, "end_of_turn_id": 0,
                     "end_of_turn": "\n"}}
    monkeypatch.setattr(sample, "load_trained", lambda *args, **kwargs: (None, None, CharTokenizer(list("hi\n")), meta))
    assert_refused(sample.main, ["--out_dir", "run", "--chat", "hi"], "--chat 'hi': the model's chat template "
                   "(meta.json chat.chat_template, from /models/t.jinja) fails at line 2 on the messages "
                   "(UndefinedError: 'assistant_prefix' is undefined); fix: correct the template so it renders user "
                   "messages with add_generation_prompt, and prepare the conversations again with it (python -m "
                   "data.prepare --format chat --chat_template FILE)$", {}, capsys, [])
