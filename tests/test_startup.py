"""What train.py checks at start, before any engine (training/startup.py): settings that do not go together,
a missing dataset, a malformed override, a prompt the dataset's tokenizer cannot encode (or encodes to
nothing) and errors from torch's own modules each end the run with one line and exit code 2."""
import os

import pytest
import torch

from common.checks import ConfigError
from data.tokenizers import CharTokenizer
from harness import REPO
from refusals import assert_refused_at_start, train_py_as_typed
from training.config import load_run_config

QUICKSTART = os.path.join(REPO, "configs", "quickstart.yaml")


def cli(*args, ds_config="zero0.json"):
    return train_py_as_typed("--ds_config", os.path.join(REPO, "ds_configs", ds_config), *args)


def test_cli_fp16_on_cpu_is_refused(char_data, tmp_path):
    proc = cli(f"data.dir={char_data}", f"train.out_dir={tmp_path}", ds_config="zero2_fp16.json")
    assert_refused_at_start(proc, "error: fp16 is not supported on cpu: use a bf16 ds_config")


def test_cli_missing_data_says_how_to_prepare(tmp_path):
    proc = cli(f"data.dir={tmp_path}/none", f"train.out_dir={tmp_path}")
    assert_refused_at_start(proc, f"no prepared dataset in {tmp_path}/none (meta.json missing); prepare it "
                                  f"with: python -m data.prepare --input PATH/TO/text.txt --out_dir "
                                  f"{tmp_path}/none")


def test_cli_malformed_override(char_data, tmp_path):
    proc = cli(f"data.dir={char_data}", "train.max_steps")
    assert_refused_at_start(proc, "override 'train.max_steps' is not key=value")


def prompted(prompt: str, tokenizer, chat: str | None = None, meta: dict | None = None) -> tuple:
    from training import startup
    from training.config import SampleConfig

    return startup.encode_prompt(SampleConfig(prompt=prompt, chat=chat), meta or {}, tokenizer)


def test_prompt_outside_the_vocabulary_is_refused_at_start():
    tokenizer = CharTokenizer(list("\n abc"))
    assert prompted("ab c", tokenizer) == ([2, 3, 1, 4], (), None)
    with pytest.raises(ConfigError, match=r"sample.prompt='abé' does not encode with the dataset's char tokenizer: "
                                          r"character 'é' is not in this dataset's vocabulary; fix: use characters"):
        prompted("abé", tokenizer)


def test_a_chat_sample_is_rendered_by_the_datasets_template_and_stops_at_its_end_of_turn():
    """sample.chat: the run's last sample answers a message as sample.py --chat does; a dataset of text has no
    template, refused at start."""
    from data.chat import BUILTIN_TEMPLATES, chat_prompt

    tokenizer = CharTokenizer(list("\n :ABUacehinrstx"))
    chat = {"template": "lines", "chat_template": BUILTIN_TEMPLATES["lines"], "context": 64,
            "end_of_turn_id": 0, "end_of_turn": "\n"}
    ids, stops, note = prompted("\n", tokenizer, chat="hi there", meta={"chat": chat})
    expected = chat_prompt([{"role": "user", "content": "hi there"}], {"chat": chat}, tokenizer, "", "")[0]
    assert (ids, stops, note) == (expected, (0,), None)
    assert tokenizer.decode(ids) == "User: hi there\nAssistant: "
    with pytest.raises(ConfigError, match=r"^sample.chat='hi' needs a model fine-tuned on conversations .* set "
                                          r"sample.prompt instead$"):
        prompted("\n", tokenizer, chat="hi")


@pytest.mark.parametrize("delimiter", ["<|endoftext|>", "<s>"])
def test_a_prompt_that_encodes_to_nothing_starts_from_the_document_delimiter(delimiter):
    """A whitespace-splitting tokenizer encodes the default prompt, a newline, to no tokens: the sample starts from
    the token that separates documents, end-of-text or (a tokenizer with only that) begin-of-text."""
    from corpora import word_level_tokenizer
    tokenizer = word_level_tokenizer(["to be or not to be"])
    if delimiter == "<s>":  # the same words behind a begin-of-text token only, as Llama-2's tokenizer has
        from tokenizers import Tokenizer, models, pre_tokenizers

        from data.tokenizers import HFTokenizer
        inner = Tokenizer(models.WordLevel({"<s>": 0, "[UNK]": 1, "to": 2, "be": 3}, unk_token="[UNK]"))
        inner.pre_tokenizer = pre_tokenizers.Whitespace()
        tokenizer = HFTokenizer(inner, "tokenizer.json")
    start = tokenizer.tokenizer.token_to_id(delimiter)
    assert prompted("\n", tokenizer) == ([start], (), f"the prompt '\\n' encodes to no tokens with the dataset's "
                                                  f"tokenizer.json tokenizer: the sample starts from its document "
                                                  f"delimiter {delimiter!r} (id {start})")
    assert prompted("to be", tokenizer)[2] is None


def test_errors_from_torchs_own_modules_become_config_errors(monkeypatch):
    """What the range checks miss still stops at start, before any process: torch's own assertion here."""
    from training import startup
    monkeypatch.setattr(startup, "build_model", lambda model_cfg: torch.nn.MultiheadAttention(33, 2))
    cfg = load_run_config(QUICKSTART, ["model.vocab_size=65"])
    with pytest.raises(ConfigError, match=r"the model.\* settings do not build a model \(AssertionError: embed_dim "
                                          r"must be divisible by num_heads\)"):
        startup.count_parameters(cfg)


def test_train_py_refuses_a_prompt_it_could_not_sample_from(char_data, tmp_path):
    proc = train_py_as_typed(f"data.dir={char_data}", f"train.out_dir={tmp_path}", "sample.prompt=naïve")
    assert_refused_at_start(proc, "error: sample.prompt='naïve' does not encode with the dataset's char tokenizer")
    assert not os.path.exists(tmp_path / "metrics.jsonl")


def test_a_run_whose_memory_plan_is_over_a_ranks_memory_is_refused_at_start(char_data, tmp_path, monkeypatch):
    """Where the plan is over what a rank has (a GPU's memory; on a CPU the machine's, shared by its ranks), the
    run stops at start in one line, where it would be killed minutes in; the quickstart's plan fits this machine."""
    from training import startup
    from training.memory_plan import GB
    argv = [f"data.dir={char_data}", f"train.out_dir={tmp_path}"]
    startup.check_run(argv)  # a few MB by the plan
    monkeypatch.setattr(startup, "memory_capacity", lambda device, ranks: (GB // 1000, "this machine's memory"))
    with pytest.raises(ConfigError, match=r"^the memory plan needs 0\.0\d+ GB a rank \(training/memory_plan.py: "
                                          r"model states 0\.0\d+, activations 0\.0\d+\), over this machine's "
                                          r"memory, 0\.001 GB: the run cannot fit; fix: a smaller "
                                          r"ds.train_micro_batch_size_per_gpu"):
        startup.check_run(argv)
    assert not os.path.exists(tmp_path / "metrics.jsonl")


def test_a_run_whose_background_saves_cannot_fit_host_memory_is_refused_at_start(char_data, tmp_path, monkeypatch):
    """A background save copies the node's share of each checkpoint into host memory beside what the run keeps
    there: the quickstart's one rank, all of it (817,920 parameters at 12 bytes, ZeRO-0 in fp32). One byte short
    of the two, the run is refused at start; without background saves it needs no copy."""
    from training import startup
    from training.checkpoints import space
    from training.memory_plan import plan
    argv = [f"data.dir={char_data}", f"train.out_dir={tmp_path}"]
    run = startup.check_run(argv)
    kept = startup.in_host_memory(plan(run.cfg.model, run.ds, 1, run.cfg.train.mlp_tiles, "cpu", run.cfg.train.compile),
                                  "cpu", run.layout)
    copy = 817_920 * 12
    for host, refused in ((kept + copy - 1, True), (kept + copy, False)):
        monkeypatch.setattr(space, "memory_capacity", lambda device, ranks: (host, "this machine's memory"))
        if not refused:
            startup.check_run(argv)
            continue
        with pytest.raises(ConfigError) as e:
            startup.check_run(argv)
        assert str(e.value) == (
            f"a background save copies this node's share of each checkpoint, 9.82 MB, into host memory beside the "
            f"{space.size(kept)} the run keeps there, over this machine's memory, {space.size(host)}; fix: set "
            f"train.background_save=false (each save then writes from the states in place while the loop waits), "
            f"or spread the run over more nodes")
        startup.check_run([*argv, "train.background_save=false"])
    assert not os.path.exists(tmp_path / "metrics.jsonl")


def test_a_cpu_ranks_memory_is_its_share_of_the_machines():
    from training.device import memory_capacity
    whole, said = memory_capacity(torch.device("cpu"), 1)
    assert said == "this machine's memory" and whole > 2**30
    assert memory_capacity(torch.device("cpu"), 4) == (whole // 4, "this machine's memory, shared by its 4 ranks")


def test_a_run_whose_checkpoints_would_fill_its_disk_is_refused_at_start(char_data, tmp_path, monkeypatch):
    """The quickstart saves at steps 1,000 and 2,000, 817,920 parameters at 12 bytes each (ZeRO-0 in fp32): 2
    checkpoints at once before the first is pruned (3 kept), 19,630,080 bytes."""
    from types import SimpleNamespace

    from training import startup
    from training.checkpoints import space
    argv = [f"data.dir={char_data}", f"train.out_dir={tmp_path / 'run'}"]
    free = 19_630_080
    monkeypatch.setattr(space.shutil, "disk_usage", lambda path: SimpleNamespace(free=free))
    startup.check_run(argv)
    free -= 1
    with pytest.raises(ConfigError, match=rf"^the checkpoints this run writes need 19\.6 MB more in "
                                          rf"{tmp_path}/run/checkpoints \(2 at once: 9\.82 MB each, 12 bytes a "
                                          rf"parameter\), where the disk has 19\.6 MB free; fix: free space there, "
                                          rf"lower train.keep_checkpoints \(now 3\), or set train.out_dir on a larger "
                                          rf"disk$"):
        startup.check_run(argv)
    startup.check_run([*argv, "train.save_interval=0"])  # one checkpoint, at the end
    assert not os.path.exists(tmp_path / "run")


def test_the_saves_counted_at_start_are_the_steps_that_save():
    from training.checkpoints.space import saves_at, saves_between
    for interval in range(0, 7):
        for start in range(0, 13):
            for last in range(start, 20):
                assert saves_between(start, last, interval) == sum(saves_at(step, last, interval)
                                                                   for step in range(start + 1, last + 1))
