"""Data preparation and the deterministic, rank-disjoint loader, on the real Shakespeare text."""
import json
import os
import sys
import time

import numpy as np
import pytest
import torch

from common.checks import ConfigError
from corpora import byte_level_encoding, prepare_blend_sources
from data.loader import prefetched
from data.prepare import prepare
from data.sampler import Blend
from data.token_data import IGNORE, TokenData
from data.tokenizers import CharTokenizer, TiktokenTokenizer
from harness import run
from training.topology import Layout

CPU = torch.device("cpu")


def test_char_dataset_meta_and_split(char_data, shakespeare_path):
    text = open(shakespeare_path, encoding="utf-8").read()
    meta = json.load(open(os.path.join(char_data, "meta.json")))
    assert meta["tokenizer"] == "char" and meta["vocab_size"] == 65 and meta["dtype"] == "uint16"
    assert meta["train_tokens"] == int(len(text) * 0.9) and meta["train_tokens"] + meta["val_tokens"] == len(text)
    tokenizer = CharTokenizer(meta["chars"])
    tokens = np.concatenate([np.fromfile(os.path.join(char_data, f"{s}.bin"), dtype=np.uint16)
                             for s in ("train", "val")])
    assert tokenizer.decode(tokens.tolist()) == text
    assert meta["max_token_id"] == tokens.max() == 64


def test_prepare_twice_is_idempotent(char_data, shakespeare_path):
    before = {f: os.stat(os.path.join(char_data, f)).st_mtime_ns for f in ("train.bin", "val.bin", "meta.json")}
    proc = run([sys.executable, "-m", "data.prepare", "--input", shakespeare_path, "--out_dir", char_data])
    assert "nothing to do" in proc.stdout
    assert before == {f: os.stat(os.path.join(char_data, f)).st_mtime_ns for f in before}


def test_single_text_with_a_bpe_keeps_the_90_10_split(tmp_path, shakespeare_path):
    text = open(shakespeare_path, encoding="utf-8").read()[:20000]
    (tmp_path / "text.txt").write_text(text)
    tokenizer = TiktokenTokenizer(byte_level_encoding())
    meta = prepare([str(tmp_path / "text.txt")], str(tmp_path / "out"), tokenizer)
    assert meta["tokenizer"] == "tiktoken:bytes" and meta["vocab_size"] == 257 and meta["delimiter"] is None
    ids = [np.fromfile(tmp_path / "out" / f"{s}.bin", dtype=np.uint16).tolist() for s in ("train", "val")]
    assert tokenizer.decode(ids[0]) == text[:18000] and tokenizer.decode(ids[1]) == text[18000:]


def test_a_dataset_of_format_1_is_refused_with_the_command_that_prepares_it_again(tmp_path, shakespeare_path):
    """train.bin / val.bin and the meta.json of data.prepare's first format (no "format", no document index):
    refused, not read, with one line that says how to prepare the dataset again."""
    text = open(shakespeare_path, encoding="utf-8").read()
    tokenizer = CharTokenizer.from_text(text)
    split = int(len(text) * 0.9)
    ids = {"train": tokenizer.encode(text[:split]), "val": tokenizer.encode(text[split:])}
    for name, tokens in ids.items():
        np.array(tokens, dtype=np.uint16).tofile(tmp_path / f"{name}.bin")
    meta = {"tokenizer": "char", "vocab_size": 65, "max_token_id": 64, "dtype": "uint16", "train_tokens": split,
            "val_tokens": len(text) - split, "source": "x", "source_sha256": "0" * 64, "chars": tokenizer.chars}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError) as caught:
        TokenData(str(tmp_path), "char", 16)
    assert str(caught.value) == (f"dataset meta {tmp_path}/meta.json is of format 1, this version reads format 2 only "
                                 f"(written by another version of data.prepare); fix: prepare the dataset again with: "
                                 f"python -m data.prepare --tokenizer char --input PATH/TO/text.txt --out_dir "
                                 f"{tmp_path}")


LAYOUT_DP2 = Layout(world_size=2, pipeline_stages=1, micro_batch=3, grad_accum=2)


@pytest.fixture(scope="module")
def data(char_data):
    return TokenData(char_data, "char", block_size=16)


def test_batches_are_a_pure_function_of_seed_step_and_rank(data):
    a = data.train_batch(7, step=5, micro_step=1, dp_rank=1, layout=LAYOUT_DP2, device=CPU)
    b = data.train_batch(7, step=5, micro_step=1, dp_rank=1, layout=LAYOUT_DP2, device=CPU)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert a[0].shape == (3, 16) and a[0].dtype == torch.long
    assert torch.equal(a[0][:, 1:], a[1][:, :-1])  # targets are the inputs shifted by one token
    other_step = data.train_batch(7, step=6, micro_step=1, dp_rank=1, layout=LAYOUT_DP2, device=CPU)
    other_seed = data.train_batch(8, step=5, micro_step=1, dp_rank=1, layout=LAYOUT_DP2, device=CPU)
    assert not torch.equal(a[0], other_step[0]) and not torch.equal(a[0], other_seed[0])


def test_a_steps_batches_read_at_once_are_its_micro_batches(data):
    for step, rank in ((1, 0), (5, 1)):
        batches = data.step_batches(7, step, rank, LAYOUT_DP2, CPU)
        assert len(batches) == LAYOUT_DP2.grad_accum
        for micro_step, (inputs, targets) in enumerate(batches):
            one = data.train_batch(7, step, micro_step, rank, LAYOUT_DP2, CPU)
            assert torch.equal(inputs, one[0]) and torch.equal(targets, one[1])


def test_prefetched_yields_each_steps_batches_in_order_made_one_ahead():
    made = []

    def make(step):
        made.append(step)
        return step * 10

    batches = prefetched(make, range(3, 7))
    assert next(batches) == 30
    time.sleep(0.2)
    assert made == [3, 4]  # step 4's batches were made while step 3 trained
    assert list(batches) == [40, 50, 60] and made == [3, 4, 5, 6]
    assert list(prefetched(make, range(0))) == []


def global_batch(data, layout, step=3):
    return torch.cat([data.train_batch(0, step, m, r, layout, CPU)[0]
                      for r in range(layout.dp) for m in range(layout.grad_accum)])


def test_ranks_and_micro_steps_draw_different_windows(data):
    rows = global_batch(data, LAYOUT_DP2)
    assert rows.shape == (12, 16)
    assert len({tuple(r.tolist()) for r in rows}) == 12


def test_layouts_with_the_same_global_batch_see_the_same_samples(data):
    reference = global_batch(data, LAYOUT_DP2)
    for layout in (Layout(1, 1, 12, 1), Layout(1, 1, 1, 12), Layout(4, 1, 3, 1), Layout(4, 2, 2, 3)):
        assert torch.equal(global_batch(data, layout), reference), layout


def test_validation_windows_do_not_depend_on_the_layout(data):
    """Every layout evaluates the same 50 windows: the ranks' shares, in order, with the padding rows
    (targets IGNORE) left out, are the fixed set; micro-batches have the training shape."""
    reference = torch.from_numpy(data.eval_windows("val", 50))
    for layout in (Layout(1, 1, 12, 1), Layout(2, 1, 5, 3), Layout(3, 1, 4, 1), Layout(4, 2, 7, 2), Layout(8, 1, 1, 1)):
        rows = []
        for rank in range(layout.dp):
            for inputs, targets in data.eval_batches("val", 50, rank, layout, CPU):
                assert inputs.shape == targets.shape == (layout.micro_batch, 16)
                real = (targets != IGNORE).all(1)
                assert ((targets == IGNORE).all(1) | real).all()  # a row is either real or padding
                rows.append(torch.cat([inputs[real], targets[real][:, -1:]], 1))
        assert torch.equal(torch.cat(rows), reference), layout
    assert torch.equal(reference, torch.from_numpy(data.eval_windows("val", 50)))  # fixed across calls


@pytest.mark.parametrize("weights,period", [([0.3, 0.7], 10), ([0.001, 0.999], 1000), ([1, 2, 3, 4], 10),
                                            ([5] * 12, 12)])
def test_blend_proportions_are_exact_in_every_period(weights, period):
    blend = Blend(weights)
    shares = np.array(weights) / sum(weights)
    source, index = blend.locate(np.arange(5 * period))
    assert blend.period == period
    for block in range(5):  # every period holds each source's exact share
        counts = np.bincount(source[block * period: (block + 1) * period], minlength=len(weights))
        assert np.array_equal(counts, np.round(shares * period).astype(int))
    for k in range(1, 5 * period):  # and any prefix is within one sample of it
        assert np.abs(np.bincount(source[:k], minlength=len(weights)) - shares * k).max() < 1
    for s in range(len(weights)):  # each source's samples are numbered 0, 1, 2, ... in order
        assert np.array_equal(index[source == s], np.arange((source == s).sum()))
    assert np.array_equal(blend.drawn(3 * period + 1), np.bincount(source[:3 * period + 1], minlength=len(weights)))


@pytest.fixture(scope="module")
def blend_sources(tmp_path_factory, shakespeare_path):
    return prepare_blend_sources(str(tmp_path_factory.mktemp("blend")), shakespeare_path)


def test_a_tiny_source_wraps_into_new_epochs(blend_sources):
    plays, docs = blend_sources
    data = TokenData(None, None, 16, [{"dir": plays, "weight": 0.5}, {"dir": docs, "weight": 0.5}])
    windows = data.epochs[1].windows
    layout = Layout(2, 1, 4, 2)  # 16 samples a step, 8 from each source
    steps = 3 * windows // 8 + 1
    rows = torch.cat([data.train_batch(3, step, m, r, layout, CPU)[0] for step in range(1, steps + 1)
                      for r in range(2) for m in range(2)])
    source, _ = data.blend.locate(np.arange(len(rows)))
    tiny = rows[torch.from_numpy(source == 1)]
    starts = data.epochs[1].starts(3, np.arange(len(tiny)))
    assert torch.equal(tiny, torch.from_numpy(data.datasets[1].read("train", starts)[:, :-1]))
    for epoch in range(3):  # each epoch: every window of the tiny source once, shifted and in a new order
        part = starts[epoch * windows: (epoch + 1) * windows]
        offset = part.min()
        assert 0 <= offset < 16 and np.array_equal(np.sort(part) - offset, np.arange(windows) * 16)
    first, second = starts[:windows], starts[windows: 2 * windows]
    assert not np.array_equal(first - first.min(), second - second.min())
    used = data.epochs_used(steps * 16)
    assert used["epochs_docs_data"] == pytest.approx(steps * 8 / windows, abs=1e-6) and used["epochs_docs_data"] > 3
    assert used["epochs_plays_data"] < 1


def test_bad_blends_are_refused(blend_sources, tmp_path, char_data):
    plays, docs = blend_sources
    with pytest.raises(ConfigError, match=r"data.sources\[1\] \(.*docs_data\) has weight 0: weights must be "
                                          r"positive; remove the source"):
        TokenData(None, None, 16, [{"dir": plays, "weight": 1}, {"dir": docs, "weight": 0}])
    with pytest.raises(ConfigError, match=r"data.sources\[0\] has no dir: give each source \{dir: PREPARED_DATASET"):
        TokenData(None, None, 16, [{"dir": "", "weight": 1}])
    with pytest.raises(ConfigError, match=r"no prepared dataset in .*never \(meta.json missing\); prepare it with"):
        TokenData(None, None, 16, [{"dir": plays, "weight": 1}, {"dir": str(tmp_path / "never"), "weight": 1}])
    with pytest.raises(ConfigError, match=r"prepared with different tokenizers \(.*tiktoken:bytes, 257 ids, .*char, "
                                          r"65 ids\)"):
        TokenData(None, None, 16, [{"dir": plays, "weight": 1}, {"dir": char_data, "weight": 1}])


def test_resuming_on_changed_data_is_refused(blend_sources):
    plays, docs = blend_sources
    saved = TokenData(None, None, 16, [{"dir": plays, "weight": 0.3}, {"dir": docs, "weight": 0.7}]).record()
    changed = TokenData(None, None, 16, [{"dir": plays, "weight": 0.5}, {"dir": plays, "weight": 0.5}])
    with pytest.raises(ConfigError, match=r"trained on other data: source 0 .*: the weight differs: 0.3 then, 0.5 now; "
                                          r"source 1 .*: the prepared dataset .* differs.*; source 1 .*: the weight "
                                          r"differs.* set data.allow_changed=true to continue"):
        changed.check_resume(saved, allow_changed=False)
    changed.check_resume(saved, allow_changed=True)


def test_missing_dataset_names_the_prepare_command(tmp_path):
    with pytest.raises(ConfigError, match=r"no prepared dataset in .* prepare it with: python -m data.prepare "
                                          r"--tokenizer gpt2 --input PATH/TO/text.txt"):
        TokenData(str(tmp_path), "gpt2", 16)
    with pytest.raises(ConfigError, match=r"no prepared dataset"):
        TokenData(str(tmp_path), None, 16)


def copy_dataset(src, dst, **meta_changes):
    os.makedirs(dst, exist_ok=True)
    for name in ("train.bin", "val.bin"):
        with open(os.path.join(src, name), "rb") as f, open(os.path.join(dst, name), "wb") as g:
            g.write(f.read())
    meta = {**json.load(open(os.path.join(src, "meta.json"))), **meta_changes}
    json.dump(meta, open(os.path.join(dst, "meta.json"), "w"))
    return str(dst)


def test_tokenizer_mismatch(char_data):
    with pytest.raises(ConfigError, match=r"prepared with the 'char' tokenizer but the run config asks for "
                                          r"data.tokenizer='gpt2'"):
        TokenData(char_data, "gpt2", 16)


def test_token_ids_beyond_the_model_vocab(data):
    with pytest.raises(ConfigError, match=r"token ids up to 64 but model.vocab_size=50: set model.vocab_size "
                                          r"to at least 65"):
        data.check_vocab(50)
    data.check_vocab(65)


def test_block_size_longer_than_the_split(tmp_path, char_data):
    small = copy_dataset(char_data, tmp_path / "small")
    with open(os.path.join(small, "val.bin"), "r+b") as f:
        f.truncate(2 * 100)
    meta = json.load(open(os.path.join(small, "meta.json")))
    json.dump({**meta, "val_tokens": 100}, open(os.path.join(small, "meta.json"), "w"))
    with pytest.raises(ConfigError, match=r"model.block_size=128 needs windows of 129 tokens but .*val.bin "
                                          r"holds only 100"):
        TokenData(small, "char", 128)


def test_truncated_token_file_is_reported_as_corrupt(tmp_path, char_data):
    broken = copy_dataset(char_data, tmp_path / "broken")
    with open(os.path.join(broken, "train.bin"), "r+b") as f:
        f.truncate(2 * 1000)
    with pytest.raises(ConfigError, match=r"train.bin holds 1,000 tokens but meta.json says 1,003,854: the "
                                          r"dataset is corrupt or half-written"):
        TokenData(broken, "char", 16)


# (meta.json's text, the message's words): a dataset meta that is not one of this version's, refused at start.
BAD_META = [
    ("", "dataset meta {path} is empty; fix: prepare the dataset again with: python -m data.prepare"),
    ("{not json", "dataset meta {path} is not JSON"),
    ("[1, 2]", "dataset meta {path} holds a JSON list, not an object"),
    ('{"format": 9, "tokenizer": "char", "vocab_size": 65, "chars": []}', "dataset meta {path} is of format 9, this "
                                                                         "version reads format 2 only"),
    ('{"format": 1, "tokenizer": "char", "vocab_size": 65, "chars": []}', "dataset meta {path} is of format 1, this "
                                                                         "version reads format 2 only"),
    ('{"format": 2, "tokenizer": "char", "vocab_size": 65}', "dataset meta {path} lacks chars"),
    ('{"format": 2, "tokenizer": "gpt2", "vocab_size": 50257}', "dataset meta {path} lacks dtype, train_tokens, "
                                                                "val_tokens, max_token_id"),
]


@pytest.mark.parametrize("text,message", BAD_META, ids=["empty", "not-json", "list", "format", "format-1", "chars",
                                                       "loader-keys"])
def test_a_meta_json_that_is_not_a_datasets_is_refused(tmp_path, char_data, text, message):
    broken = copy_dataset(char_data, tmp_path / "broken")
    path = os.path.join(broken, "meta.json")
    with open(path, "w") as f:
        f.write(text)
    with pytest.raises(ConfigError) as caught:
        TokenData(broken, None, 16)
    assert message.format(path=path) in str(caught.value)


def test_empty_token_file(tmp_path, char_data):
    empty = copy_dataset(char_data, tmp_path / "empty")
    open(os.path.join(empty, "val.bin"), "w").close()
    with pytest.raises(ConfigError, match=r"val.bin is missing or empty; prepare the dataset with"):
        TokenData(empty, "char", 16)
