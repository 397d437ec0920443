"""Preparation of real corpora: every input format, every kind of tokenizer, parallel and resumable, and a
clear error for each bad input with nothing written that training would trust: one table of bad paths and
files, in process through data.prepare's main(argv), each one `error:` line and exit code 2 with the inputs
and the dataset it would replace as they were."""
import json
import os
import shutil
import sys

import numpy as np
import pytest
import torch
import zstandard

import data.prepare
from corpora import byte_level_encoding, speeches, write_corpus
from data.out_dir import in_val
from data.prepare import prepare
from data.readers import InputError, Piece, documents
from data.token_data import TokenData
from data.tokenizers import EOT, TiktokenTokenizer, TokenizerError, load_tokenizer, train_bpe
from data.writer import ShardWriter, read_index
from harness import run
from refusals import assert_refused, command
from training.topology import Layout

CPU = torch.device("cpu")

FILES = ("train.bin", "val.bin", "train.idx", "val.idx", "meta.json")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, shakespeare_path):
    """3,000 speeches over .jsonl, .jsonl.gz, .jsonl.zst, .parquet (row groups of 200) and .txt files."""
    directory = tmp_path_factory.mktemp("corpus")
    return str(directory), write_corpus(directory, speeches(shakespeare_path)[:3000])


def documents_of(out_dir, split):
    tokenizer = load_tokenizer(out_dir)
    meta = json.load(open(os.path.join(out_dir, "meta.json")))
    tokens = np.fromfile(os.path.join(out_dir, f"{split}.bin"), dtype=meta["dtype"])
    index = read_index(out_dir, split)
    assert index.dtype == np.int64 and index[0] == 0 and index[-1] == len(tokens)
    return [tokens[a:b] for a, b in zip(index[:-1], index[1:])], tokenizer


def expected(docs, split, val_fraction=0.1):
    return [d for d in docs if in_val(d, val_fraction) == (split == "val")]


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory, shakespeare_path):
    path = str(tmp_path_factory.mktemp("tok") / "tokenizer.json")
    train_bpe(iter(speeches(shakespeare_path)), 600).tokenizer.save(path)
    return path


@pytest.mark.parametrize("tokenizer", ["char", "bpe:500", "tiktoken", "tokenizer.json"])
def test_each_document_decodes_to_its_text(tmp_path, corpus, tokenizer, tokenizer_json):
    directory, docs = corpus
    spec = {"tiktoken": TiktokenTokenizer(byte_level_encoding()), "tokenizer.json": tokenizer_json}.get(tokenizer,
                                                                                                       tokenizer)
    meta = prepare([directory], str(tmp_path), spec, val_fraction=0.1)
    for split in ("train", "val"):
        stored, tok = documents_of(str(tmp_path), split)
        want = expected(docs, split)
        assert len(stored) == len(want) == meta[f"{split}_documents"] > 0
        assert all(ids[-1] == tok.eot_id for ids in stored)  # every document ends with end-of-text
        assert [tok.decode(ids[:-1].tolist()) for ids in stored] == want
    assert meta["dtype"] == "uint16" and meta["delimiter"] == "eot"
    assert tok.decode([tok.eot_id]) == EOT


def test_output_is_byte_identical_for_one_and_two_workers(tmp_path, corpus):
    directory, _ = corpus
    for workers in (1, 2):  # chunk_mb: the 0.6 MB .jsonl is cut into several pieces
        prepare([directory], str(tmp_path / f"w{workers}"), TiktokenTokenizer(byte_level_encoding()),
                workers=workers, chunk_mb=0.1)
    for name in FILES + ("tokenizer.tiktoken",):
        assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w2" / name).read_bytes(), name


def test_large_vocabulary_is_stored_as_uint32(tmp_path, corpus):
    directory, docs = corpus
    meta = prepare([directory], str(tmp_path), TiktokenTokenizer(byte_level_encoding(first_id=70_000)))
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70_257 and meta["max_token_id"] == 70_256
    stored, tok = documents_of(str(tmp_path), "val")
    assert stored[0].min() >= 70_000
    assert [tok.decode(ids[:-1].tolist()) for ids in stored] == expected(docs, "val", 0.01)
    inputs, _ = TokenData(str(tmp_path), "tiktoken:bytes70000", 16).train_batch(0, 1, 0, 0, Layout(1, 1, 4, 1), CPU)
    train_text = "".join(d + EOT for d in expected(docs, "train", 0.01))
    assert inputs.min() >= 70_000 and all(tok.decode(row.tolist()) in train_text for row in inputs)  # read as uint32


def test_an_id_that_does_not_fit_is_refused(tmp_path):
    writer = ShardWriter(str(tmp_path / "shard"), np.uint16)
    with pytest.raises(OverflowError, match=r"token id 65536 does not fit uint16 \(0..65535\)"):
        writer.write("train", [[1, 2, 65_536]])


def test_split_is_stable_when_the_inputs_are_reordered(tmp_path, corpus):
    _, docs = corpus
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    (tmp_path / "a" / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (tmp_path / "b" / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[::-1]))
    tok = TiktokenTokenizer(byte_level_encoding())
    vals = []
    for name in ("a", "b"):
        prepare([str(tmp_path / name)], str(tmp_path / f"out_{name}"), tok, val_fraction=0.2)
        stored, _ = documents_of(str(tmp_path / f"out_{name}"), "val")
        vals.append(sorted(tok.decode(ids[:-1].tolist()) for ids in stored))
    assert vals[0] == vals[1] and 0.15 < len(vals[0]) / len(docs) < 0.25


def test_an_interrupted_preparation_resumes_with_the_same_output(tmp_path, corpus, monkeypatch, capsys):
    directory, _ = corpus
    tok = TiktokenTokenizer(byte_level_encoding())
    prepare([directory], str(tmp_path / "straight"), tok, chunk_mb=0.1)
    calls, original = [], data.prepare._tokenize_piece

    def killed_at_the_third_piece(job, options):
        calls.append(job)
        if len(calls) == 3:
            raise KeyboardInterrupt
        original(job, options)

    monkeypatch.setattr(data.prepare, "_tokenize_piece", killed_at_the_third_piece)
    with pytest.raises(KeyboardInterrupt):
        prepare([directory], str(tmp_path / "resumed"), tok, chunk_mb=0.1)
    assert not (tmp_path / "resumed" / "meta.json").exists()  # nothing a training run would trust
    monkeypatch.setattr(data.prepare, "_tokenize_piece", original)
    prepare([directory], str(tmp_path / "resumed"), tok, chunk_mb=0.1)
    assert "resuming: 2 of " in capsys.readouterr().out
    for name in FILES:
        assert (tmp_path / "straight" / name).read_bytes() == (tmp_path / "resumed" / name).read_bytes(), name
    assert not (tmp_path / "resumed" / ".prepare").exists()


def test_a_local_dataset_through_hugging_face_datasets(tmp_path, corpus):
    directory, docs = corpus
    (tmp_path / "hf").mkdir()
    shutil.copy(os.path.join(directory, "d.parquet"), tmp_path / "hf" / "train.parquet")
    prepare([f"hf:{tmp_path / 'hf'}"], str(tmp_path / "out"), TiktokenTokenizer(byte_level_encoding()),
            val_fraction=0.1)
    stored, tok = documents_of(str(tmp_path / "out"), "train")
    assert [tok.decode(ids[:-1].tolist()) for ids in stored] == expected(docs[3 * 600: 4 * 600], "train")


def prepare_fails(tmp_path, inputs, message, tokenizer="char", **kwargs):
    """The error names the problem, and out_dir keeps the dataset it held (here: none) untouched."""
    out = tmp_path / "out"
    with pytest.raises((InputError, TokenizerError), match=message):
        prepare([str(p) for p in inputs], str(out), tokenizer, **kwargs)
    assert not (out / "meta.json").exists()


def test_jsonl_line_that_is_not_json(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "one"}\n\n{"text": "two"}\n{"text": "three"\n')
    prepare_fails(tmp_path, [tmp_path / "bad.jsonl"], r"bad.jsonl, line 4: not a JSON record .*fix or remove the line",
                  chunk_mb=0.00001)  # one byte range per line: the line number is still the file's


def test_record_without_the_text_field(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "one"}\n{"content": "two"}\n')
    prepare_fails(tmp_path, [tmp_path / "bad.jsonl"], r"bad.jsonl, line 2: no text field 'text' \(record keys: "
                                                      r"content\): name the field with --text_key")


def test_file_that_is_not_utf8(tmp_path):
    (tmp_path / "a.txt").write_text("fine")
    (tmp_path / "b.txt").write_bytes("caf\u00e9".encode("latin-1"))
    prepare_fails(tmp_path, [tmp_path], r"b.txt \(byte 3\) is not UTF-8 .*convert the file to UTF-8")
    (tmp_path / "c.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    prepare_fails(tmp_path, [tmp_path / "c.jsonl"], r"c.jsonl, line 2 is not UTF-8")


def test_empty_input(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    prepare_fails(tmp_path, [tmp_path / "empty.jsonl"], r"no documents in .*empty.jsonl: the inputs are empty")
    prepare_fails(tmp_path, [tmp_path / "nothing_here"], r"input .*nothing_here not found: pass a file, a folder")


def test_unreadable_tokenizer_file(tmp_path, corpus):
    (tmp_path / "tokenizer.json").write_text("{not json")
    prepare_fails(tmp_path, [corpus[0]], r"could not read the tokenizer file .*tokenizer.json .*pass a Hugging Face "
                                         r"tokenizer.json", tokenizer=str(tmp_path / "tokenizer.json"))


def test_a_failed_preparation_keeps_the_earlier_dataset(tmp_path, corpus):
    prepare([corpus[0]], str(tmp_path / "out"), TiktokenTokenizer(byte_level_encoding()), val_fraction=0.1)
    before = {n: (tmp_path / "out" / n).read_bytes() for n in FILES}
    (tmp_path / "bad.jsonl").write_text('{"text": "one"}\n{"oops": 1}\n')
    with pytest.raises(InputError, match="no text field"):
        prepare([str(tmp_path / "bad.jsonl")], str(tmp_path / "out"), "char", force=True)
    assert before == {n: (tmp_path / "out" / n).read_bytes() for n in FILES}


def test_command_line_errors_name_the_fix(tmp_path):
    proc = run([sys.executable, "-m", "data.prepare", "--input", str(tmp_path / "missing.txt"),
                "--out_dir", str(tmp_path)], check=False)
    assert proc.returncode == 2 and "missing.txt not found: pass a file, a folder or a glob" in proc.stderr
    (tmp_path / "text.txt").write_text("some text")
    proc = run([sys.executable, "-m", "data.prepare", "--input", str(tmp_path / "text.txt"), "--tokenizer", "bpe:12",
                "--out_dir", str(tmp_path / "out")], check=False)
    assert proc.returncode == 2 and "the BPE size must be an integer above 256" in proc.stderr


# (flags, message) of data.prepare; each row changes one thing from --input text.txt --out_dir OUT.
PREPARE_ROWS = [
    ({"--input": "{inputs}/not_gzip.jsonl.gz"}, "input {inputs}/not_gzip.jsonl.gz is not gzip data, or is cut short "
                                                "(BadGzipFile: Not a gzipped file ... fix: make it again (gzip FILE)"),
    ({"--input": "{inputs}/cut.jsonl.gz"}, "input {inputs}/cut.jsonl.gz is not gzip data, or is cut short (EOFError"),
    ({"--input": "{inputs}/not_zstd.jsonl.zst"}, "input {inputs}/not_zstd.jsonl.zst is not zstd data, or is cut "
                                                 "short (ZstdError"),
    ({"--input": "{inputs}/cut.jsonl.zst"}, "input {inputs}/cut.jsonl.zst is not zstd data, or is cut short "
                                            "(EOFError: the file ends inside a zstd frame)"),
    ({"--input": "{inputs}/not_parquet.parquet"}, "{inputs}/not_parquet.parquet is not a readable Parquet file"),
    ({"--input": "{inputs}/empty.jsonl"}, "no documents in {inputs}/empty.jsonl: the inputs are empty"),
    ({"--input": "{inputs}/missing.txt"}, "input {inputs}/missing.txt not found"),
    ({"--out_dir": "{inputs}/text.txt"}, "--out_dir {inputs}/text.txt is a file, not a folder; fix: pass a folder "
                                         "for the dataset"),
    ({"--out_dir": "{inputs}/text.txt/out"}, "--out_dir {inputs}/text.txt/out cannot be created: {inputs}/text.txt "
                                             "is a file"),
    ({"--out_dir": "{data}"}, "--out_dir {data} already holds a dataset, of other inputs or options, that this one "
                              "would replace; fix: pass --force to replace it, or another --out_dir"),
    ({"--tokenizer": "{inputs}/tokenizer_folder"}, "--tokenizer {inputs}/tokenizer_folder is a folder that holds no "
                                                   "tokenizer; fix: pass a prepared dataset's folder (meta.json)"),
    ({"--workers": "0"}, "--workers 0: must be >= 1; fix: pass the number of processes that tokenize"),
    ({"--chunk_mb": "0"}, "--chunk_mb 0.0: must be > 0"),
    ({"--chunk_mb": "-1"}, "--chunk_mb -1.0: must be > 0"),
    ({"--val_fraction": "0"}, "--val_fraction 0.0: must be above 0 and below 1; fix: pass the share"),
]


@pytest.mark.parametrize("flags,message", PREPARE_ROWS, ids=[next(iter(f)) + "=" + list(f.values())[0][-14:]
                                                             for f, _ in PREPARE_ROWS])
def test_prepare_refuses(inputs, char_data, tmp_path, capsys, flags, message):
    paths = {"inputs": inputs, "data": char_data}
    base = {"--input": "{inputs}/text.txt", "--out_dir": str(tmp_path / "out"), "--workers": "1"}
    assert_refused(data.prepare.main, command(base, flags, paths), message, paths, capsys, [inputs, char_data])


def test_prepare_force_replaces_a_dataset(inputs, tmp_path):
    out, other = str(tmp_path / "out"), tmp_path / "other.txt"
    other.write_text("another text, longer than the first one")
    data.prepare.main(["--input", str(inputs / "text.txt"), "--out_dir", out])
    data.prepare.main(["--input", str(other), "--out_dir", out, "--force"])
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["source"] == [str(other)]


def test_a_zstd_file_of_several_frames_reads_whole(tmp_path):
    lines = [json.dumps({"text": f"document {i}"}) + "\n" for i in range(3000)]
    compress = zstandard.ZstdCompressor().compress
    (tmp_path / "frames.jsonl.zst").write_bytes(b"".join(compress("".join(lines[i:i + 700]).encode())
                                                         for i in range(0, 3000, 700)))
    assert list(documents(Piece(str(tmp_path / "frames.jsonl.zst"), "jsonl.zst"))) == [f"document {i}"
                                                                                       for i in range(3000)]

