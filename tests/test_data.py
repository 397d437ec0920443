"""Data preparation and the deterministic, rank-disjoint loader, on the real Shakespeare text."""
import json
import os
import sys

import numpy as np
import pytest
import tiktoken
import torch

from conftest import run
from data.loader import TokenData
from data.prepare import prepare
from data.tokenizers import CharTokenizer, Gpt2Tokenizer
from training.config import ConfigError
from training.topology import Layout

CPU = torch.device("cpu")


def byte_level_encoding() -> tiktoken.Encoding:
    """A real tiktoken BPE (GPT-2's split pattern, byte tokens only): the GPT-2 merge files need the
    network, which tests do not have; the preparation code path is the same."""
    gpt2_pattern = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    return tiktoken.Encoding("bytes", pat_str=gpt2_pattern, mergeable_ranks={bytes([i]): i for i in range(256)},
                             special_tokens={})


def test_char_dataset_meta_and_split(char_data, shakespeare_path):
    text = open(shakespeare_path, encoding="utf-8").read()
    meta = json.load(open(os.path.join(char_data, "meta.json")))
    assert meta["tokenizer"] == "char" and meta["vocab_size"] == 65 and meta["dtype"] == "uint16"
    assert meta["train_tokens"] == int(len(text) * 0.9) and meta["train_tokens"] + meta["val_tokens"] == len(text)
    tokenizer = CharTokenizer(meta["chars"])
    tokens = np.concatenate([np.fromfile(os.path.join(char_data, f"{s}.bin"), dtype=np.uint16) for s in ("train", "val")])
    assert tokenizer.decode(tokens.tolist()) == text
    assert meta["max_token_id"] == tokens.max() == 64


def test_prepare_twice_is_idempotent(char_data, shakespeare_path):
    before = {f: os.stat(os.path.join(char_data, f)).st_mtime_ns for f in ("train.bin", "val.bin", "meta.json")}
    proc = run([sys.executable, "-m", "data.prepare", "--input", shakespeare_path, "--out_dir", char_data])
    assert "nothing to do" in proc.stdout
    assert before == {f: os.stat(os.path.join(char_data, f)).st_mtime_ns for f in before}


def test_bpe_preparation_round_trips(tmp_path, shakespeare_path):
    text = open(shakespeare_path, encoding="utf-8").read()[:20000]
    tokenizer = Gpt2Tokenizer(byte_level_encoding())
    meta = prepare(text, str(tmp_path), tokenizer)
    assert meta["tokenizer"] == "gpt2" and meta["vocab_size"] == 256
    ids = [np.fromfile(tmp_path / f"{s}.bin", dtype=np.uint16).tolist() for s in ("train", "val")]
    assert tokenizer.decode(ids[0]) + tokenizer.decode(ids[1]) == text


def test_prepare_without_input_file_says_how(tmp_path):
    proc = run([sys.executable, "-m", "data.prepare", "--input", str(tmp_path / "missing.txt"),
                "--out_dir", str(tmp_path)], check=False)
    assert proc.returncode == 1 and "missing.txt not found; pass --input PATH to a text file" in proc.stderr


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


def test_eval_windows_are_fixed(data):
    first = list(data.eval_batches("val", 3, 0, LAYOUT_DP2, CPU))
    again = list(data.eval_batches("val", 3, 0, LAYOUT_DP2, CPU))
    other_rank = list(data.eval_batches("val", 3, 1, LAYOUT_DP2, CPU))
    assert len(first) == 3
    assert all(torch.equal(x[0], y[0]) for x, y in zip(first, again))
    assert not torch.equal(first[0][0], other_rank[0][0])


def test_missing_dataset_names_the_prepare_command(tmp_path):
    with pytest.raises(ConfigError, match=r"no prepared dataset in .* prepare it with: python -m data.prepare "
                                          r"--tokenizer gpt2 --input PATH/TO/text.txt"):
        TokenData(str(tmp_path), "gpt2", 16)


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


def test_empty_token_file(tmp_path, char_data):
    empty = copy_dataset(char_data, tmp_path / "empty")
    open(os.path.join(empty, "val.bin"), "w").close()
    with pytest.raises(ConfigError, match=r"val.bin is missing or empty; prepare the dataset with"):
        TokenData(empty, "char", 16)
