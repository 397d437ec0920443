"""`python -m data.prepare --format preference`: preference pairs into two documents each, chosen then rejected,
with TRL's ids and completion masks (data/prepare_preference.py); prompts cut from their start, then answers at
their end, to fit the context; the split drawn from the prompt; bad inputs refused in one line."""
import json
import shutil
import sys

import pytest
from tokenizers import Tokenizer, processors

import data.prepare
from chats import CHATML, chatml_folder, documents, write_jsonl
from data.prepare_preference import prepare_preference
from data.readers import InputError
from data.tokenizers import EOT, CharTokenizer, load_tokenizer
from harness import run
from refusals import assert_refused, command

TASKS = [("Reverse: a b", "b a", "a b"), ("Reverse: king crown", "crown king", "king crown"),
         ("Echo: hi", "hi", "hi hi")]


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


RECORDS = {
    "standard": [{"prompt": q + "\n", "chosen": c, "rejected": r} for q, c, r in TASKS],
    "conversational": [{"prompt": [user(q)], "chosen": [assistant(c)], "rejected": [assistant(r)]}
                       for q, c, r in TASKS],
    "implicit prompt": [{"chosen": [user(q), assistant(c)], "rejected": [user(q), assistant(r)]} for q, c, r in TASKS],
}


def expected_texts(kind: str, tokenizer: str) -> list[tuple[str, str, str]]:
    """(prompt, prompt + chosen, prompt + rejected) of each task as the dataset is to hold them."""
    if kind == "standard":
        return [(q + "\n", f"{q}\n{c}{EOT}", f"{q}\n{r}{EOT}") for q, c, r in TASKS]
    if tokenizer == "char":  # the built-in template plain (trim_blocks takes the newline after its endgeneration)
        return [(f"User: {q}\nAssistant: ", f"User: {q}\nAssistant: {c}{EOT}", f"User: {q}\nAssistant: {r}{EOT}")
                for q, c, r in TASKS]
    prompts = [f"<|im_start|>user\n{q}<|im_end|><|im_start|>assistant\n" for q, _, _ in TASKS]  # ChatML's, trimmed
    return [(p, f"{p}{c}<|im_end|>", f"{p}{r}<|im_end|>") for p, (_, c, r) in zip(prompts, TASKS)]


def pairs_of(out_dir, split: str) -> list:
    """((chosen tokens, mask), (rejected tokens, mask)) of each pair of a split: its documents two by two."""
    docs = documents(out_dir, split)
    assert len(docs) % 2 == 0
    return list(zip(docs[0::2], docs[1::2]))


@pytest.fixture(scope="module")
def chatml_tokenizer(tmp_path_factory, shakespeare_path):
    return chatml_folder(tmp_path_factory.mktemp("chatml"), shakespeare_path)


@pytest.fixture(scope="module")
def bos_tokenizer(tmp_path_factory, chatml_tokenizer):
    """The ChatML BPE with a post-processor that begins each text with a BOS (<|im_start|> stands in), as a Llama's
    tokenizer.json does: transformers' tokenizer(text) adds it, a rendered template does not."""
    tokenizer = Tokenizer.from_file(str(chatml_tokenizer / "tokenizer.json"))
    bos = tokenizer.token_to_id("<|im_start|>")
    tokenizer.post_processor = processors.TemplateProcessing(single="<|im_start|> $A",
                                                             special_tokens=[("<|im_start|>", bos)])
    folder = tmp_path_factory.mktemp("bos")
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    return folder


@pytest.mark.parametrize("tokenizer", ["char", "bpe"])
@pytest.mark.parametrize("kind", list(RECORDS))
def test_each_pair_is_its_chosen_then_its_rejected_document(tmp_path, chatml_tokenizer, kind, tokenizer):
    spec = "char" if tokenizer == "char" else str(chatml_tokenizer / "tokenizer.json")
    inputs = write_jsonl(tmp_path / "pairs.jsonl", RECORDS[kind] * 3)
    meta = prepare_preference([inputs], str(tmp_path / "out"), spec, val_fraction=0.4)
    tok = load_tokenizer(str(tmp_path / "out"))
    expected = expected_texts(kind, tokenizer) * 3
    seen = []
    for split in ("train", "val"):
        found = [[tok.decode(ids) for ids, _ in pair] for pair in pairs_of(tmp_path / "out", split)]
        at = [i for i, texts in enumerate(expected) if texts[1:] in [tuple(f) for f in found]]
        assert found == [list(expected[i][1:]) for i in at]  # in input order
        seen += at
        for (chosen, chosen_mask), (rejected, rejected_mask) in pairs_of(tmp_path / "out", split):
            prompt_len = chosen_mask.index(1)
            assert chosen_mask == [0] * prompt_len + [1] * (len(chosen) - prompt_len)
            assert rejected_mask == [0] * prompt_len + [1] * (len(rejected) - prompt_len)
            assert chosen[:prompt_len] == rejected[:prompt_len]
            assert tok.decode(chosen[:prompt_len]) in {texts[0] for texts in expected}
    assert sorted(seen) == list(range(len(expected)))
    assert meta["train_documents"] == 2 * meta["preference"]["train_pairs"] > 0
    assert meta["preference"]["formats"] == {inputs: kind}
    assert meta["preference"]["eos_appended"] == (kind == "standard")
    assert ("chat" in meta) == (kind != "standard")


def trl_documents(records: list[dict], tokenizer_json: str) -> list:
    """(ids, mask) of each sequence as TRL 1.16's DPOTrainer prepares the records (its own _prepare_dataset)."""
    from types import SimpleNamespace

    import datasets
    from transformers import PreTrainedTokenizerFast
    from trl.trainer.dpo_trainer import DPOTrainer

    datasets.disable_progress_bars()
    reference = PreTrainedTokenizerFast(tokenizer_file=tokenizer_json, eos_token=EOT)
    reference.chat_template = CHATML
    args = SimpleNamespace(dataset_num_proc=None, max_length=None, truncation_mode="keep_start")
    prepared = DPOTrainer._prepare_dataset(SimpleNamespace(_tokenizer=reference),
                                           datasets.Dataset.from_list(records), reference, args, "train")
    return [(row["prompt_ids"] + row[key], [0] * len(row["prompt_ids"]) + [1] * len(row[key]))
            for row in prepared for key in ("chosen_ids", "rejected_ids")]


@pytest.mark.parametrize("bos", [False, True], ids=["tokenizer", "with_bos"])
@pytest.mark.parametrize("kind", list(RECORDS))
def test_the_ids_and_masks_are_trls(tmp_path, chatml_tokenizer, bos_tokenizer, kind, bos):
    pytest.importorskip("trl")
    tokenizer_json = str((bos_tokenizer if bos else chatml_tokenizer) / "tokenizer.json")
    # An answer that does end with end-of-text gets none more; a prompt whose last token merges with the answer's
    # first ("Say: " + "b": " b" is one token) starts the completion where the two tokenizations part.
    records = RECORDS[kind] + ([{"prompt": "Say: ", "chosen": "b" + EOT, "rejected": "a b"}] if kind == "standard"
                               else [])
    inputs = write_jsonl(tmp_path / "pairs.jsonl", records)
    prepare_preference([inputs], str(tmp_path / "out"), tokenizer_json, val_fraction=0.0)
    ours = [doc for pair in pairs_of(tmp_path / "out", "train") for doc in pair]
    assert ours == trl_documents(records, tokenizer_json)


PROMPT = "0123456789"  # ten characters, ten tokens


@pytest.mark.parametrize("context, chosen, rejected", [
    (11, f"3456789ab{EOT}", f"3456789abcd{EOT}"),  # 3 prompt tokens dropped: both fit
    (5, f"9ab{EOT}", f"9abcd{EOT}"),  # the prompt down to its last token: both fit
    (3, f"9ab{EOT}", "9abc"),  # the prompt down to its last token, then the longer answer cut at its end
])
def test_the_prompt_is_cut_from_its_start_then_the_answers_at_their_end(tmp_path, context, chosen, rejected):
    inputs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": PROMPT, "chosen": "ab", "rejected": "abcd"}])
    meta = prepare_preference([inputs], str(tmp_path / "out"), "char", context=context, val_fraction=0.0)
    tok = load_tokenizer(str(tmp_path / "out"))
    [((chosen_ids, chosen_mask), (rejected_ids, rejected_mask))] = pairs_of(tmp_path / "out", "train")
    assert (tok.decode(chosen_ids), tok.decode(rejected_ids)) == (chosen, rejected)
    prompt_len = chosen.index("ab")
    assert chosen_mask[:prompt_len + 1] == rejected_mask[:prompt_len + 1] == [0] * prompt_len + [1]
    assert {k: meta["preference"][k] for k in ("truncated", "dropped_overlong", "train_pairs")} == \
        {"truncated": 1, "dropped_overlong": 0, "train_pairs": 1}


def test_overlong_drop_leaves_the_pair_out_and_counts_it(tmp_path):
    inputs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": PROMPT, "chosen": "ab", "rejected": "abcd"},
                                                    {"prompt": "0", "chosen": "a", "rejected": "b"}])
    meta = prepare_preference([inputs], str(tmp_path / "out"), "char", context=5, overlong="drop", val_fraction=0.0)
    assert {k: meta["preference"][k] for k in ("pairs", "truncated", "dropped_overlong", "train_pairs")} == \
        {"pairs": 2, "truncated": 0, "dropped_overlong": 1, "train_pairs": 1}
    assert meta["train_documents"] == 2


def test_a_pair_without_an_answer_token_is_left_out(tmp_path):
    # Characters without end-of-text (a one-document vocabulary): no end-of-text is appended, and an answer of one
    # character after an empty prompt is the first token, which no position predicts.
    chars = CharTokenizer(sorted(set(PROMPT + "abcd")))
    inputs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "", "chosen": "a", "rejected": "bc"},
                                                    {"prompt": "0", "chosen": "a", "rejected": "b"}])
    meta = prepare_preference([inputs], str(tmp_path / "out"), chars, val_fraction=0.0)
    assert meta["preference"]["dropped_unsupervised"] == 1 and meta["preference"]["eos_appended"] is False
    assert [[ids for ids, _ in pair] for pair in pairs_of(tmp_path / "out", "train")] == [[[0, 10], [0, 11]]]


@pytest.mark.parametrize("kind", ["standard", "conversational"])
def test_the_pairs_of_one_prompt_share_a_split(tmp_path, kind):
    prompts = [f"q{i}" for i in range(12)]
    if kind == "standard":
        records = [{"prompt": p, "chosen": a, "rejected": b} for p in prompts for a, b in (("x", "y"), ("z", "w"))]
    else:
        records = [{"prompt": [user(p)], "chosen": [assistant(a)], "rejected": [assistant(b)]}
                   for p in prompts for a, b in (("x", "y"), ("z", "w"))]
    meta = prepare_preference([write_jsonl(tmp_path / "p.jsonl", records)], str(tmp_path / "out"), "char",
                              val_fraction=0.5)
    tok = load_tokenizer(str(tmp_path / "out"))
    split_of = {}
    for split in ("train", "val"):
        for (chosen, mask), _ in pairs_of(tmp_path / "out", split):
            prompt = tok.decode(chosen[:mask.index(1)])
            assert split_of.setdefault(prompt, split) == split
    assert set(split_of.values()) == {"train", "val"} and len(split_of) == 12
    assert meta["preference"]["train_pairs"] + meta["preference"]["val_pairs"] == 24


def test_a_rerun_has_nothing_to_do_and_other_inputs_need_force(tmp_path, capsys):
    inputs = write_jsonl(tmp_path / "pairs.jsonl", RECORDS["standard"])
    first = prepare_preference([inputs], str(tmp_path / "out"), "char", val_fraction=0.0)
    assert prepare_preference([inputs], str(tmp_path / "out"), "char", val_fraction=0.0) == first
    assert "already holds these preference pairs; nothing to do" in capsys.readouterr().out
    with pytest.raises(InputError, match="already holds a dataset, of other inputs or options"):
        prepare_preference([inputs], str(tmp_path / "out"), "char", context=8, val_fraction=0.0)
    assert prepare_preference([inputs], str(tmp_path / "out"), "char", context=8, val_fraction=0.0,
                              force=True)["preference"]["context"] == 8


def test_a_bad_record_ends_the_command_with_its_file_and_line(tmp_path):
    inputs = write_jsonl(tmp_path / "pairs.jsonl", [RECORDS["standard"][0], {"prompt": "q", "chosen": "a"}])
    proc = run([sys.executable, "-m", "data.prepare", "--format", "preference", "--input", inputs, "--out_dir",
                str(tmp_path / "out")], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"error: {inputs}:2: no preference pair in it" in proc.stderr
    assert not (tmp_path / "out" / "meta.json").exists()


# (flags, the one error line after "error: "; "$": it ends there)
ROWS = [
    ({"--train_on": "last"}, "--train_on last applies to --format chat: a preference pair trains on every token of "
     "each answer after the prompt (TRL's completion mask); fix: leave --train_on out$"),
    ({"--input": "{inputs}/one.jsonl", "--val_fraction": "0.99"}, "none of the 1 preference pairs fell in the train "
     "split (pairs by prompt hash, val_fraction 0.99); fix: pass a smaller --val_fraction, or pairs of more "
     "prompts$"),
    ({"--input": "{inputs}/conversational.jsonl", "extra": "--input", "more": "{inputs}/standard.jsonl"},
     "{inputs}/standard.jsonl holds standard pairs, {inputs}/conversational.jsonl conversational pairs: one dataset "
     "holds text pairs or conversations, not both; fix: prepare them as two datasets$"),
    ({"--val_fraction": "1"}, "--val_fraction 1.0: must be at least 0 and below 1; fix: pass the share of the "
     "documents held out, e.g. --val_fraction 0.01$"),
    ({"--chat_template": "plain"}, "--chat_template plain: {inputs}/standard.jsonl holds standard text pairs, which "
     "are tokenized as they are, with no template; fix: leave --chat_template out$"),
    ({"--context": "2", "--overlong": "drop"}, "none of the 3 preference pairs keeps an answer token within --context "
     "2 (--overlong drop); fix: pass the model's block_size as --context, or --overlong truncate$"),
    ({"--tokenizer": "{inputs}/without_k"}, "{inputs}/standard.jsonl:2: the pair does not encode with --tokenizer "
     "{inputs}/without_k (character 'k' is not in this dataset's vocabulary); fix: leave the record out, or write it "
     "in the tokenizer's characters$"),
    ({"--input": "{inputs}/lines.jsonl", "--tokenizer": "{inputs}/without_k"}, "the built-in template lines fails "
     "at line 1 on the pair {inputs}/lines.jsonl:1 (raise_exception: an assistant turn holds a newline, where the "
     "template lines ends the turn); fix: leave the record out, or correct the template at that line$"),
]


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bad_pairs")
    for kind in ("standard", "conversational"):
        write_jsonl(folder / f"{kind}.jsonl", RECORDS[kind])
    write_jsonl(folder / "one.jsonl", RECORDS["standard"][:1])
    write_jsonl(folder / "lines.jsonl", [{"prompt": [user("q")], "chosen": [assistant("a\nb")],
                                          "rejected": [assistant("b")]}])
    chars = sorted(set("".join(r["prompt"] + r["chosen"] + r["rejected"] for r in RECORDS["standard"])) - {"k"})
    (folder / "without_k").mkdir()
    (folder / "without_k" / "meta.json").write_text(json.dumps({"format": 2, "tokenizer": "char", "chars": chars,
                                                                "vocab_size": len(chars), "eot_id": None}))
    return folder


@pytest.mark.parametrize("flags,message", ROWS, ids=[next(iter(f)) for f, _ in ROWS])
def test_prepare_preference_refuses(bad_inputs, tmp_path, capsys, flags, message):
    out = tmp_path / "out"
    prepare_preference([str(bad_inputs / "standard.jsonl")], str(out), "char", val_fraction=0.0)
    shutil.copytree(out, tmp_path / "kept")
    paths = {"inputs": bad_inputs}
    base = {"--format": "preference", "--input": "{inputs}/standard.jsonl", "--out_dir": str(out), "--force": True,
            "--val_fraction": "0.0"}
    argv = command(base, {k: v for k, v in flags.items() if k not in ("extra", "more")}, paths)
    if "extra" in flags:
        argv += ["--input", flags["more"].format(**paths)]
    assert_refused(data.prepare.main, argv, message, paths, capsys, [bad_inputs, out])
