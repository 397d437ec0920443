"""Every run setting is range-checked at start: one table of bad settings and the message each gets
(in-process, through load_run_config), and a few train.py runs that show the table is what it applies."""
import json
import os

import pytest
import torch

from common.checks import ConfigError
from conftest import REPO, train_py
from data.tokenizers import CharTokenizer
from training.config import load_ds_config, load_run_config, parse_args

QUICKSTART = os.path.join(REPO, "configs", "quickstart.yaml")
ENCODER = os.path.join(REPO, "configs", "encoder_tiny.yaml")

# (overrides, the message's start). Each row changes one thing from the quickstart preset.
BAD_SETTINGS = [
    (["model.arch=bert"], "model.arch='bert': must be one of gpt, llama, encoder; fix: set model.arch to one of them"),
    (["model.n_layer=0"], "model.n_layer=0: must be >= 1; fix: set model.n_layer to 1 or more"),
    (["model.n_head=0"], "model.n_head=0: must be >= 1"),
    (["model.n_embd=-8"], "model.n_embd=-8: must be >= 1"),
    (["model.block_size=0"], "model.block_size=0: must be >= 1"),
    (["model.vocab_size=0"], "model.vocab_size=0: must be >= 1"),
    (["model.vocab_multiple=0"], "model.vocab_multiple=0: must be >= 1"),
    (["model.ffn_hidden=0"], "model.ffn_hidden=0: must be >= 1"),
    (["model.n_embd=130"], "model.n_embd=130: must be divisible by model.n_head=4; fix: make model.n_embd a multiple "
                           "of 4"),
    (["model.dropout=1.0"], "model.dropout=1.0: must be in [0.0, 1.0); fix: set model.dropout between 0.0 and 1.0"),
    (["model.dropout=-0.1"], "model.dropout=-0.1: must be in [0.0, 1.0)"),
    (["model.ffn_multiple_of=0"], "model.ffn_multiple_of=0: must be >= 1"),
    (["model.n_kv_head=0"], "model.n_kv_head=0: must be >= 1"),
    (["model.n_kv_head=3"], "model.n_kv_head=3: must divide model.n_head=4: each key/value head serves a whole "
                            "group of query heads; fix: choose a divisor of 4"),
    (["model.arch=llama", "model.n_head=128"], "model.n_embd=128: must give an even head size n_embd / n_head "
                                               "(now 1): rotary embeddings rotate pairs of dimensions"),
    (["model.norm_eps=0"], "model.norm_eps=0.0: must be > 0"),
    (["model.rope_theta=-1"], "model.rope_theta=-1.0: must be > 0"),
    (["model.rope_scale_factor=0"], "model.rope_scale_factor=0.0: must be > 0"),
    (["model.rope_low_freq_factor=0"], "model.rope_low_freq_factor=0.0: must be > 0"),
    (["model.rope_high_freq_factor=0.5"], "model.rope_high_freq_factor=0.5: must be above model.rope_low_freq_factor"),
    (["model.rope_original_context=0"], "model.rope_original_context=0: must be >= 1"),
    (["data.dir=''"], "data.dir='': must not be empty; fix: set data.dir"),
    (["data.dir=" + os.path.join(REPO, "README.md")], "data.dir='" + os.path.join(REPO, "README.md") + "': must be "
                                                      "a directory, but it is a file; fix: point data.dir at a "
                                                      "directory"),
    (["data.tokenizer=''"], "data.tokenizer='': must not be empty"),
    (["optim.lr=-1e-3"], "optim.lr=-0.001: must be > 0"),
    (["optim.lr=0"], "optim.lr=0.0: must be > 0"),
    (["optim.min_lr=-1"], "optim.min_lr=-1.0: must be >= 0 (0 decays to zero)"),
    (["optim.min_lr=0.01"], "optim.min_lr=0.01: must be <= optim.lr=0.001; fix: lower optim.min_lr or raise optim.lr"),
    (["optim.warmup_steps=-1"], "optim.warmup_steps=-1: must be >= 1"),
    (["optim.warmup_steps=0"], "optim.warmup_steps=0: must be >= 1 (DeepSpeed's schedule warms up over one step at "
                               "least)"),
    (["optim.weight_decay=-0.1"], "optim.weight_decay=-0.1: must be >= 0"),
    (["optim.beta1=1.0"], "optim.beta1=1.0: must be in [0.0, 1.0)"),
    (["optim.beta2=-0.5"], "optim.beta2=-0.5: must be in [0.0, 1.0)"),
    (["optim.eps=0"], "optim.eps=0.0: must be > 0; fix: set optim.eps above 0"),
    (["train.max_steps=-5"], "train.max_steps=-5: must be >= 1; fix: set train.max_steps to 1 or more"),
    (["train.max_steps=0"], "train.max_steps=0: must be >= 1"),
    (["train.eval_interval=-1"], "train.eval_interval=-1: must be >= 0 (0 evaluates only at step 0 and at the end)"),
    (["train.eval_windows=0"], "train.eval_windows=0: must be >= 1"),
    (["train.log_interval=0"], "train.log_interval=0: must be >= 1"),
    (["train.out_dir=" + os.path.join(REPO, "README.md")], "must be a directory, but it is a file; fix: point "
                                                           "train.out_dir at a directory"),
    (["train.out_dir=" + os.path.join(REPO, "README.md", "run")], "train.out_dir " + os.path.join(REPO, "README.md",
                                                                                               "run") +
     " cannot be created: " + os.path.join(REPO, "README.md") + " is a file; fix: point train.out_dir at a folder you "
                                                                 "can write to"),
    (["train.seed=-1"], "train.seed=-1: must be >= 0"),
    (["train.peak_tflops=0"], "train.peak_tflops=0.0: must be > 0"),
    (["train.save_interval=-100"], "train.save_interval=-100: must be >= 0 (0 saves only at the end)"),
    (["train.keep_checkpoints=0"], "train.keep_checkpoints=0: must be >= 1"),
    (["train.resume=''"], "train.resume='': must not be empty"),
    (["train.stop_at_step=0"], "train.stop_at_step=0: must be >= 1"),
    (["train.stop_at_step=3000"], "train.stop_at_step=3000: must be <= train.max_steps=2000; fix: lower "
                                  "train.stop_at_step or raise train.max_steps"),
    (["train.dist_timeout_s=0"], "train.dist_timeout_s=0: must be >= 1"),
    (["train.init_from=/nonexistent"], "train.init_from='/nonexistent': must be a folder holding a Hugging Face "
                                       "checkpoint"),
    (["sample.prompt=''"], "sample.prompt='': must not be empty"),
    (["sample.max_new_tokens=-1"], "sample.max_new_tokens=-1: must be >= 0"),
    (["sample.temperature=-0.5"], "sample.temperature=-0.5: must be >= 0 (0 takes the most likely token)"),
    (["sample.top_k=0"], "sample.top_k=0: must be >= 1"),
    (["sample.seed=-3"], "sample.seed=-3: must be >= 0"),
]


@pytest.mark.parametrize("overrides,message", BAD_SETTINGS, ids=[row[0][0].split("=")[0] + "=" +
                                                                   row[0][0].split("=", 1)[1][-12:]
                                                                   for row in BAD_SETTINGS])
def test_bad_setting_is_refused_with_its_message(overrides, message):
    with pytest.raises(ConfigError) as caught:
        load_run_config(QUICKSTART, overrides)
    assert message in str(caught.value)


def test_the_table_covers_every_setting():
    """A new setting needs a row here (or a reason in NO_RANGE): its check is one line in its dataclass."""
    from dataclasses import fields

    from training.config import RunConfig
    # Booleans: the type is the whole check.
    no_range = {"model.bias", "model.tie_embeddings", "train.compile", "train.tf32", "data.allow_changed"}
    no_range |= {"data.sources"}  # checked where the blend is opened (tests/test_data.py)
    tested = {row[0][0].split("=")[0] for row in BAD_SETTINGS}
    settings = {f"{section.name}.{f.name}" for section in fields(RunConfig) for f in fields(section.type)}
    assert settings - tested - no_range == set()


def test_encoder_width_must_be_even():
    with pytest.raises(ConfigError, match=r"model.n_embd=63: must be even for the encoder"):
        load_run_config(ENCODER, ["model.n_embd=63", "model.n_head=3"])


def test_every_shipped_preset_passes_the_checks():
    for name in os.listdir(os.path.join(REPO, "configs")):
        load_run_config(os.path.join(REPO, "configs", name), [])


def test_a_min_lr_of_zero_decays_to_zero():
    """What the range check accepts, the schedule takes: checks and schedule have one home for the ranges."""
    from training.optim import optimizer_and_schedule
    cfg = load_run_config(QUICKSTART, ["optim.min_lr=0"])
    assert optimizer_and_schedule(cfg, {})["scheduler"]["params"]["cos_min_ratio"] == 0.0


def test_zero_intervals_are_accepted():
    cfg = load_run_config(QUICKSTART, ["train.eval_interval=0", "train.save_interval=0"])
    assert (cfg.train.eval_interval, cfg.train.save_interval) == (0, 0)


@pytest.mark.parametrize("body,kind", [("[1, 2]", "list"), ('"zero2"', "str"), ("12", "int")])
def test_ds_config_that_is_not_an_object(tmp_path, body, kind):
    path = tmp_path / "ds.json"
    path.write_text(body)
    with pytest.raises(ConfigError, match=rf"ds.json holds a JSON {kind}, not an object"):
        load_ds_config(str(path), [])


def test_config_files_may_come_anywhere_among_the_overrides():
    args = parse_args(["train.max_steps=5", "--config", ENCODER, "train.out_dir=out/x", "--ds_config", "d.json",
                       "--local_rank=1", "model.n_layer=2"])
    assert (args.config, args.ds_config, args.local_rank) == (ENCODER, "d.json", 1)
    assert args.overrides == ["train.max_steps=5", "train.out_dir=out/x", "model.n_layer=2"]


def test_prompt_outside_the_vocabulary_is_refused_at_start():
    from training import startup
    tokenizer = CharTokenizer(list("\n abc"))
    assert startup.encode_prompt("ab c", tokenizer) == ([2, 3, 1, 4], None)
    with pytest.raises(ConfigError, match=r"sample.prompt='abé' does not encode with the dataset's char tokenizer: "
                                          r"character 'é' is not in this dataset's vocabulary; fix: use characters"):
        startup.encode_prompt("abé", tokenizer)


@pytest.mark.parametrize("delimiter", ["<|endoftext|>", "<s>"])
def test_a_prompt_that_encodes_to_nothing_starts_from_the_document_delimiter(delimiter):
    """A whitespace-splitting tokenizer encodes the default prompt, a newline, to no tokens: the sample starts from
    the token that separates documents, end-of-text or (a tokenizer with only that) begin-of-text."""
    from corpora import word_level_tokenizer
    from training import startup
    tokenizer = word_level_tokenizer(["to be or not to be"])
    if delimiter == "<s>":  # the same words behind a begin-of-text token only, as Llama-2's tokenizer has
        from tokenizers import Tokenizer, models, pre_tokenizers

        from data.tokenizers import HFTokenizer
        inner = Tokenizer(models.WordLevel({"<s>": 0, "[UNK]": 1, "to": 2, "be": 3}, unk_token="[UNK]"))
        inner.pre_tokenizer = pre_tokenizers.Whitespace()
        tokenizer = HFTokenizer(inner, "tokenizer.json")
    start = tokenizer.tokenizer.token_to_id(delimiter)
    assert startup.encode_prompt("\n", tokenizer) == ([start], f"the prompt '\\n' encodes to no tokens with the "
                                                      f"dataset's tokenizer.json tokenizer: the sample starts from its "
                                                      f"document delimiter {delimiter!r} (id {start})")
    assert startup.encode_prompt("to be", tokenizer)[1] is None


def test_errors_from_torchs_own_modules_become_config_errors(monkeypatch):
    """What the range checks miss still stops at start, before any process: torch's own assertion here."""
    from training import startup
    monkeypatch.setattr(startup, "build_model", lambda model_cfg: torch.nn.MultiheadAttention(33, 2))
    cfg = load_run_config(QUICKSTART, ["model.vocab_size=65"])
    with pytest.raises(ConfigError, match=r"the model.\* settings do not build a model \(AssertionError: embed_dim "
                                          r"must be divisible by num_heads\)"):
        startup.count_parameters(cfg)


def train_py_as_typed(*args):
    return train_py([*args], check=False, timeout=120)


def assert_refused(proc, message):
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"error: {message}" in proc.stderr
    assert "Traceback" not in proc.stderr and "step 0" not in proc.stdout


def test_train_py_applies_the_table_with_config_after_the_overrides(char_data, tmp_path):
    """The issue's command: --config among the overrides; the table's row for a negative max_steps."""
    proc = train_py_as_typed("train.max_steps=-5", "--config", ENCODER, f"train.out_dir={tmp_path}",
                             f"data.dir={char_data}")
    assert_refused(proc, "train.max_steps=-5: must be >= 1; fix: set train.max_steps to 1 or more")


def test_train_py_refuses_a_prompt_it_could_not_sample_from(char_data, tmp_path):
    proc = train_py_as_typed(f"data.dir={char_data}", f"train.out_dir={tmp_path}", "sample.prompt=naïve")
    assert_refused(proc, "sample.prompt='naïve' does not encode with the dataset's char tokenizer")
    assert not os.path.exists(tmp_path / "metrics.jsonl")


def test_train_py_refuses_a_ds_config_that_is_not_an_object(char_data, tmp_path):
    path = tmp_path / "list.json"
    path.write_text(json.dumps([{"train_micro_batch_size_per_gpu": 4}]))
    proc = train_py_as_typed(f"data.dir={char_data}", "--ds_config", str(path), f"train.out_dir={tmp_path}/out")
    assert_refused(proc, f"{path} holds a JSON list, not an object")


def test_eval_interval_zero_evaluates_at_start_and_end_only(char_data, tmp_path):
    from conftest import FP32, TINY, metrics
    train_py([f"data.dir={char_data}", f"train.out_dir={tmp_path}", *TINY, *FP32,
         "train.max_steps=3", "train.eval_interval=0", "train.save_interval=0", "ds.train_micro_batch_size_per_gpu=2"],
        env={"OMP_NUM_THREADS": "1"})
    assert [m["step"] for m in metrics(tmp_path) if "val_loss" in m] == [0, 3]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["latest", "step_000003"]


# (the run config file's text, the message after its path): a file that is not a run config.
BAD_RUN_CONFIG_FILES = [
    ("", "run config {path} is empty; fix: pass a YAML preset"),
    ("model: [\n", "{path}, line 2, column 1: malformed YAML: did not find expected node content; fix: correct the "
                   "file"),
    ("\x00binary", "{path}: malformed YAML: unacceptable character #x0000"),
    ("- 1\n- 2\n", "{path} holds a YAML list, not a mapping: a run config maps data, model, optim, sample, train to "
                   "their settings"),
    ("model: 3\n", "{path}: 'model' holds 3, not a mapping of settings; fix: write its settings under it"),
    ("modle:\n  n_layer: 2\n", "unknown setting 'modle' in {path}; did you mean 'model'?"),
]


@pytest.mark.parametrize("text,message", BAD_RUN_CONFIG_FILES, ids=["empty", "malformed", "binary", "list", "scalar",
                                                                    "typo"])
def test_a_file_that_is_not_a_run_config_is_refused(tmp_path, text, message):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_run_config(str(path), [])
    assert message.format(path=path) in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("loader,what", [(load_run_config, "run config"), (load_ds_config, "ds_config")])
def test_a_config_path_that_is_a_folder_or_missing_is_refused(tmp_path, loader, what):
    for path, problem in ((tmp_path, "is a folder, not a file"), (tmp_path / "nope", "does not exist")):
        with pytest.raises(ConfigError, match=f"^{what} {path} {problem}; fix: pass a "):
            loader(str(path), [])


# (ds override, the message's start): the ds_config's numbers that DeepSpeed's typed models do not check.
BAD_DS_NUMBERS = [
    ("train_micro_batch_size_per_gpu=four", "train_micro_batch_size_per_gpu='four' in {path}: must be an integer >= 1; "
                                           "fix: set ds.train_micro_batch_size_per_gpu to one"),
    ("train_micro_batch_size_per_gpu=true", "train_micro_batch_size_per_gpu=True in {path}: must be an integer >= 1"),
    ("train_micro_batch_size_per_gpu=2.5", "train_micro_batch_size_per_gpu=2.5 in {path}: must be an integer >= 1"),
    ("train_micro_batch_size_per_gpu=0", "train_micro_batch_size_per_gpu=0 in {path}: must be an integer >= 1"),
    ("gradient_accumulation_steps=two", "gradient_accumulation_steps='two' in {path}: must be an integer >= 1"),
    ("train_batch_size=-8", "train_batch_size=-8 in {path}: must be an integer >= 1"),
    ("tensor_model_parallel_size=two", "tensor_model_parallel_size='two' in {path}: must be an integer >= 1"),
    ("steps_per_print=0", "steps_per_print=0 in {path}: must be an integer >= 1"),
    ("pipeline.stages=two", "pipeline.stages='two' in {path}: must be an integer >= 1"),
    ("pipeline.activation_checkpoint_interval=-1", "pipeline.activation_checkpoint_interval=-1 in {path}: must be an "
                                                   "integer >= 0 (0 disables it)"),
    ("gradient_clipping=-1", "gradient_clipping=-1 in {path}: must be a number >= 0 (0 disables clipping); fix: set "
                             "ds.gradient_clipping to one"),
    ("gradient_clipping=big", "gradient_clipping='big' in {path}: must be a number >= 0"),
]


@pytest.mark.parametrize("override,message", BAD_DS_NUMBERS, ids=[row[0] for row in BAD_DS_NUMBERS])
def test_bad_ds_config_number_is_refused_with_its_message(override, message):
    path = os.path.join(REPO, "ds_configs", "zero0.json")
    with pytest.raises(ConfigError) as caught:
        load_ds_config(path, [override])
    assert message.format(path=path) in str(caught.value)


def test_the_ds_number_table_covers_the_keys_the_layout_reads():
    """topology.py reads these without checking their types: their one check is DS_NUMBERS."""
    from training.config import DS_NUMBERS
    from training.topology import ACCUM, GLOBAL, MICRO, TP_KEY
    assert {MICRO, ACCUM, GLOBAL, TP_KEY, "pipeline.stages",
            "pipeline.activation_checkpoint_interval"} <= set(DS_NUMBERS)
    assert {row[0].split("=")[0] for row in BAD_DS_NUMBERS} == set(DS_NUMBERS)
