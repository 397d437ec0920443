"""The run config: a YAML preset, then key=value overrides on the command line (training/config.py). Every run
setting is range-checked at start: one table of bad settings and the message each gets (in-process, through
load_run_config), and a few train.py runs that show the table is what it applies; unknown keys, bad types and
files that are not run configs are refused by name."""
import glob
import os

import pytest

from common.checks import ConfigError
from harness import FP32, REPO, TINY, metrics, train_py
from refusals import assert_refused_at_start, train_py_as_typed
from training.config import load_run_config, parse_args, split_overrides
from training.ds_config import load_ds_config

QUICKSTART = os.path.join(REPO, "configs", "quickstart.yaml")
ENCODER = os.path.join(REPO, "configs", "encoder_tiny.yaml")
PRESETS = sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml")))

# (overrides, the message's start). Each row changes one thing from the quickstart preset.
BAD_SETTINGS = [
    (["model.arch=bert"], "model.arch='bert': must be one of gpt, llama, encoder; fix: set model.arch to one of them"),
    (["model.n_layer=0"], "model.n_layer=0: must be >= 1; fix: set model.n_layer to 1 or more"),
    (["train.epochs=0"], "train.epochs=0.0: must be > 0; fix: set train.epochs above 0"),
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
    (["model.head=value"], "model.head='value': must be one of lm, score; fix: set model.head to one of them"),
    (["model.activation=relu"], "model.activation='relu': must be one of gelu_tanh, gelu; fix: set model.activation "
                                "to one of them"),
    (["model.ffn_multiple_of=0"], "model.ffn_multiple_of=0: must be >= 1"),
    (["model.n_kv_head=0"], "model.n_kv_head=0: must be >= 1"),
    (["model.n_experts=1", "model.arch=llama"], "model.n_experts=1: must be 0 (dense MLPs) or at least 2 (now 1)"),
    (["model.arch=llama", "model.n_experts=4", "model.experts_per_token=5"],
     "model.experts_per_token=5: must be at most model.n_experts=4; fix: choose 1 to 4"),
    (["model.experts_per_token=0"], "model.experts_per_token=0: must be >= 1"),
    (["model.moe_every=0"], "model.moe_every=0: must be >= 1"),
    (["model.expert_hidden=0"], "model.expert_hidden=0: must be >= 1"),
    (["model.capacity_factor=0"], "model.capacity_factor=0.0: must be > 0"),
    (["model.router_aux_loss_coef=-1"], "model.router_aux_loss_coef=-1.0: must be >= 0"),
    (["model.router_z_loss_coef=-1"], "model.router_z_loss_coef=-1.0: must be >= 0"),
    (["model.router_bias_rate=-1"], "model.router_bias_rate=-1.0: must be >= 0"),
    (["model.router_bias_rate=0.001", "model.arch=llama", "model.n_experts=4", "model.experts_per_token=1"],
     "model.router_bias_rate=0.001: must be 0 with model.experts_per_token=1"),
    (["model.n_shared_experts=-1"], "model.n_shared_experts=-1: must be >= 0"),
    (["model.n_shared_experts=1", "model.arch=llama"], "model.n_shared_experts=1: must be 0 without experts "
     "(model.n_experts=0): a shared expert sits beside the routed ones; fix: set model.n_experts to 2 or more, or "
     "model.n_shared_experts=0"),
    (["model.n_kv_head=3"], "model.n_kv_head=3: must divide model.n_head=4: each key/value head serves a whole "
                            "group of query heads; fix: choose a divisor of 4"),
    (["model.arch=llama", "model.n_head=128"], "model.n_embd=128: must give an even head size n_embd / n_head "
                                               "(now 1): rotary embeddings rotate pairs of dimensions"),
    (["model.head_dim=0", "model.arch=llama"], "model.head_dim=0: must be >= 1"),
    (["model.head_dim=33", "model.arch=llama"], "model.head_dim=33: must be even: rotary embeddings rotate pairs of "
                                                "dimensions; fix: choose an even model.head_dim"),
    (["model.head_dim=64"], "model.head_dim=64: must be null for the GPT (its fused q|k|v projection is n_embd wide, "
                            "each head n_embd / n_head); fix: remove model.head_dim, or train the Llama"),
    (["model.qkv_bias=true"], "model.qkv_bias=True: must be false for the GPT (model.bias sets all of its biases)"),
    (["model.qk_norm=true", "model.arch=encoder"], "model.qk_norm=True: must be false for the encoder "
                                                   "(nn.MultiheadAttention's heads are n_embd / n_head wide"),
    (["model.lora_rank=-1"], "model.lora_rank=-1: must be >= 0 (0 trains every weight)"),
    (["model.lora_rank=4", "model.arch=encoder"], "model.lora_rank=4: must be 0 for the encoder (nn.MultiheadAttention "
                                                  "computes with its projections' weights, not through the maps)"),
    (["model.lora_alpha=0"], "model.lora_alpha=0.0: must be > 0"),
    (["model.lora_targets=''"], "model.lora_targets='': must not be empty"),
    (["model.lora_rank=4", "model.lora_dropout=1"], "model.lora_dropout=1.0: must be in [0.0, 1.0); fix: set "
                                                    "model.lora_dropout between 0.0 and 1.0"),
    (["model.lora_dropout=0.1"], "model.lora_dropout=0.1: must be 0 without adapters (model.lora_rank=0): it drops "
                                 "the adapters' input; fix: set model.lora_rank, or model.lora_dropout=0"),
    (["model.lora_rank=4", "model.lora_targets=attn.q,mlp.fc"], "model.lora_targets='attn.q,mlp.fc': must name linear "
     "maps of the GPT's blocks, not attn.q; fix: name some of attn.qkv, attn.proj, mlp.fc, mlp.proj, or set it to all"),
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
    (["optim.min_lr=0.01"], "optim.min_lr=0.01: must be <= optim.lr=0.003; fix: lower optim.min_lr or raise optim.lr"),
    (["optim.warmup_steps=-1"], "optim.warmup_steps=-1: must be >= 1"),
    (["optim.schedule=linear"], "optim.schedule='linear': must be one of cosine, wsd; fix: set optim.schedule to one "
                                "of them"),
    (["optim.decay_fraction=0"], "optim.decay_fraction=0.0: must be > 0"),
    (["optim.decay_fraction=1.5"], "optim.decay_fraction=1.5: must be in [0.0, 1.0]"),
    (["optim.decay_shape=exp"], "optim.decay_shape='exp': must be one of linear, sqrt, cosine"),
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
    (["train.stop_at_step=3000"], "train.stop_at_step=3000: must be <= train.max_steps=1400; fix: lower "
                                  "train.stop_at_step or raise train.max_steps"),
    (["train.dist_timeout_s=0"], "train.dist_timeout_s=0: must be >= 1"),
    (["train.mlp_tiles=0"], "train.mlp_tiles=0: must be >= 1"),
    (["train.sdpa_backend=fastest"], "train.sdpa_backend='fastest': must be one of auto, cudnn, flash, efficient, "
                                     "math; fix: set train.sdpa_backend to one of them"),
    (["train.on_nonfinite=ignore"], "train.on_nonfinite='ignore': must be one of stop, skip, rewind; fix: set "
                                    "train.on_nonfinite to one of them"),
    (["train.max_skipped_steps=0"], "train.max_skipped_steps=0: must be >= 1"),
    (["train.max_rewinds=0"], "train.max_rewinds=0: must be >= 1"),
    (["preference.beta=0"], "preference.beta=0.0: must be > 0"),
    (["preference.label_smoothing=0.5"], "preference.label_smoothing=0.5: must be in [0.0, 0.5); fix: set "
                                         "preference.label_smoothing between 0.0 and 0.5"),
    (["preference.gamma=-1"], "preference.gamma=-1.0: must be >= 0"),
    (["preference.sft_weight=-0.5"], "preference.sft_weight=-0.5: must be >= 0 (0 adds no supervised term)"),
    (["preference.center_rewards=-1"], "preference.center_rewards=-1.0: must be >= 0 (0 adds no centering term)"),
    (["rl.group_size=1"], "rl.group_size=1: must be >= 2 (answers of one prompt are compared with each other)"),
    (["rl.temperature=0"], "rl.temperature=0.0: must be > 0"),
    (["rl.top_p=1.5"], "rl.top_p=1.5: must be in [0, 1]"),
    (["rl.max_new_tokens=0"], "rl.max_new_tokens=0: must be >= 1"),
    (["rl.reward="], "bad setting 'rl.reward' in the command line: None is not a string"),
    (["rl.scale_rewards=batch"], "rl.scale_rewards='batch': must be one of group, none"),
    (["rl.loss_type=bnpo"], "rl.loss_type='bnpo': must be one of dapo, grpo"),
    (["rl.epsilon=1"], "rl.epsilon=1.0: must be in [0, 1)"),
    (["rl.epsilon_high=-0.1"], "rl.epsilon_high=-0.1: must be >= 0"),
    (["rl.beta=-1"], "rl.beta=-1.0: must be >= 0 (0 keeps no reference)"),
    (["rl.epochs=0"], "rl.epochs=0: must be >= 1"),
    (["train.spike_factor=0.5"], "train.spike_factor=0.5: must be above 1 (a loss that many times its recent mean "
                                 "is a spike), or 0 to watch no spikes; fix: set train.spike_factor to 3, say, or 0"),
    (["train.spike_window=0"], "train.spike_window=0: must be >= 1"),
    (["train.spike_min_rise=-1"], "train.spike_min_rise=-1.0: must be >= 0 (0: the factor alone decides)"),
    (["train.on_spike=skip"], "train.on_spike='skip': must be one of warn, stop, rewind; fix: set train.on_spike to "
                              "one of them"),
    (["train.init_from=/nonexistent"], "train.init_from='/nonexistent': must be a folder holding a Hugging Face "
                                       "checkpoint"),
    (["sample.prompt=''"], "sample.prompt='': must not be empty"),
    (["sample.chat=' '"], "sample.chat=' ': must be a user message or null; fix: write a message in sample.chat, or "
                          "leave it out"),
    (["sample.max_new_tokens=-1"], "sample.max_new_tokens=-1: must be >= 0"),
    (["sample.temperature=-0.5"], "sample.temperature=-0.5: must be >= 0 (0 takes the most likely token)"),
    (["sample.top_k=0"], "sample.top_k=0: must be >= 1"),
    (["sample.top_p=0"], "sample.top_p=0.0: must be > 0"),
    (["sample.top_p=1.5"], "sample.top_p=1.5: must be in [0, 1]"),
    (["sample.seed=-3"], "sample.seed=-3: must be >= 0"),
    (["eval.tasks=[a/x.jsonl,b/x.jsonl]"], "eval.tasks=['a/x.jsonl', 'b/x.jsonl']: must name each task once (files "
                                           "of one name report alike: x); fix: rename one of the files"),
    (["eval.limit=0"], "eval.limit=0: must be >= 1"),
    (["eval.data_dir=''"], "eval.data_dir='': must not be empty"),
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
    no_range = {"model.bias", "model.tie_embeddings", "model.document_masking", "train.compile", "train.tf32",
                "train.discard_newer", "train.background_save",
                "data.allow_changed", "data.pack", "train.print_config"}
    no_range |= {"data.sources"}  # checked where the blend is opened (tests/test_data.py)
    no_range |= {"rl.reward_model"}  # read where the objective is built (tests/test_rl.py)
    no_range |= {"train.objective"}  # checked against the registry where it is built (tests/test_pairs.py)
    tested = {row[0][0].split("=")[0] for row in BAD_SETTINGS}
    settings = {f"{section.name}.{f.name}" for section in fields(RunConfig) for f in fields(section.type)}
    assert settings - tested - no_range == set()


def test_encoder_width_must_be_even():
    with pytest.raises(ConfigError, match=r"model.n_embd=63: must be even for the encoder"):
        load_run_config(ENCODER, ["model.n_embd=63", "model.n_head=3"])


def test_the_encoder_refuses_document_masking():
    with pytest.raises(ConfigError, match=r"model.document_masking=True: must be false for the encoder"):
        load_run_config(ENCODER, ["model.document_masking=true"])


def test_every_shipped_preset_passes_the_checks():
    for path in PRESETS:  # configs/eval/ holds the harness's task files, not presets
        load_run_config(path, [])


@pytest.mark.parametrize("path", PRESETS, ids=os.path.basename)
def test_presets_load(path):
    cfg = load_run_config(path, [])
    assert cfg.model.n_embd % cfg.model.n_head == 0
    # None: the dataset's own (the character presets); a preset that names one is defined by it
    assert cfg.data.tokenizer in (None, "gpt2", "tokenizer.json") or cfg.data.tokenizer.startswith("bpe:")


def test_a_min_lr_of_zero_decays_to_zero():
    """What the range check accepts, the schedule takes: checks and schedule have one home for the ranges."""
    from training.optim import optimizer_and_schedule
    cfg = load_run_config(QUICKSTART, ["optim.min_lr=0"])
    assert optimizer_and_schedule(cfg, {})["scheduler"]["params"]["cos_min_ratio"] == 0.0


def test_zero_intervals_are_accepted():
    cfg = load_run_config(QUICKSTART, ["train.eval_interval=0", "train.save_interval=0"])
    assert (cfg.train.eval_interval, cfg.train.save_interval) == (0, 0)


def test_train_py_applies_the_table_with_config_after_the_overrides(char_data, tmp_path):
    """The issue's command: --config among the overrides; the table's row for a negative max_steps."""
    proc = train_py_as_typed("train.max_steps=-5", "--config", ENCODER, f"train.out_dir={tmp_path}",
                             f"data.dir={char_data}")
    assert_refused_at_start(proc, "error: train.max_steps=-5: must be >= 1; fix: set train.max_steps to 1 or more")


def test_eval_interval_zero_evaluates_at_start_and_end_only(char_data, tmp_path):
    train_py([f"data.dir={char_data}", f"train.out_dir={tmp_path}", *TINY, *FP32, "train.max_steps=3",
              "train.eval_interval=0", "train.save_interval=0", "ds.train_micro_batch_size_per_gpu=2"],
             env={"OMP_NUM_THREADS": "1"})
    assert [m["step"] for m in metrics(tmp_path) if "val_loss" in m] == [0, 3]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["latest", "step_000003"]


def test_unknown_run_key_suggests_the_right_one():
    with pytest.raises(ConfigError, match=r"unknown setting 'train.max_step' in the command line \(did you mean "
                                          r"'train.max_steps'\?\); fix: use one of the known keys in train: "):
        load_run_config(os.path.join(REPO, "configs", "quickstart.yaml"), ["train.max_step=5"])


def test_unknown_key_in_yaml_names_the_file(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("model:\n  n_layers: 3\n")
    with pytest.raises(ConfigError, match=rf"unknown setting 'model.n_layers' in {path} \(did you mean "
                                          rf"'model.n_layer'"):
        load_run_config(str(path), [])


# (an override of the wrong type, the whole message): the setting's type from its dataclass, and a value to give.
BAD_TYPES = [
    ("train.max_steps=many", "bad setting 'train.max_steps' in the command line: 'many' is not an integer; fix: set "
                             "it to an integer, e.g. train.max_steps=4"),
    ("train.epochs=many", "bad setting 'train.epochs' in the command line: 'many' is not a number; fix: set it to a "
                          "number, e.g. train.epochs=0.5"),
    ("data.pack=sometimes", "bad setting 'data.pack' in the command line: 'sometimes' is not true or false; fix: set "
                            "it to true or false, e.g. data.pack=true"),
    ("eval.tasks=5", "bad setting 'eval.tasks' in the command line: 5 is not a list; fix: set it to a list, e.g. "
                     "eval.tasks=[a,b]"),
    ("model.n_layer=[1]", "bad setting 'model.n_layer' in the command line: [1] is not an integer"),
    ("sample.prompt=KING:", "bad setting 'sample.prompt' in the command line: {'KING': None} is not a string: YAML "
                            "read the value as a mapping; fix: quote it inside the override, e.g. "
                            "'sample.prompt=\"text: more\"'"),
    ("model=3", "'model' in the command line is a section of settings, not a setting; fix: set one of its keys, e.g. "
                "model.arch=..."),
]


@pytest.mark.parametrize("override,message", BAD_TYPES, ids=[row[0] for row in BAD_TYPES])
def test_badly_typed_value_is_rejected_with_its_type(override, message):
    with pytest.raises(ConfigError) as refused:
        load_run_config(QUICKSTART, [override])
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)


def test_a_badly_typed_value_as_typed_is_one_line(tmp_path):
    """The error line alone: no OmegaConf internals (full_key, reference_type, object_type) after it."""
    proc = train_py_as_typed("train.epochs=many", f"train.out_dir={tmp_path}")
    assert_refused_at_start(proc, BAD_TYPES[1][1])
    assert proc.stderr.rstrip().splitlines()[-1] == "error: " + BAD_TYPES[1][1], proc.stderr


# (the run config file's text, the message after its path): a file that is not a run config.
BAD_RUN_CONFIG_FILES = [
    ("", "run config {path} is empty; fix: pass a YAML preset"),
    ("model: [\n", "{path}, line 2, column 1: malformed YAML: did not find expected node content; fix: correct the "
                   "file"),
    ("\x00binary", "{path}: malformed YAML: unacceptable character #x0000"),
    ("- 1\n- 2\n", "{path} holds a YAML list, not a mapping: a run config maps data, eval, model, optim, preference, "
                   "rl, sample, train to their settings"),
    ("model: 3\n", "{path}: 'model' holds 3, not a mapping of settings; fix: write its settings under it"),
    ("modle:\n  n_layer: 2\n", "unknown setting 'modle' in {path} (did you mean 'model'?); fix: use one of the "
                               "known keys: data, eval,"),
    ("base: gpt9\n", "{path}: base: gpt9 is neither a preset of configs/ nor a file ({dir}/gpt9); fix: name one of "
                     "baby_gpt, encoder_1b"),
    ("base: 3\n", "{path}: base: 3 is not a preset; fix: name one of configs/ (e.g. base: quickstart) or a YAML file"),
    ("base: run.yaml\n", "{path}: base: run.yaml leads back to {path}: the presets' bases go round in a circle; fix: "
                         "remove one base"),
]


@pytest.mark.parametrize("text,message", BAD_RUN_CONFIG_FILES, ids=["empty", "malformed", "binary", "list", "scalar",
                                                                    "typo", "unknown-base", "base-number",
                                                                    "base-circle"])
def test_a_file_that_is_not_a_run_config_is_refused(tmp_path, text, message):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_run_config(str(path), [])
    assert message.format(path=path, dir=tmp_path) in str(caught.value) and "\n" not in str(caught.value)


def test_a_run_yaml_starts_from_its_base_preset(tmp_path):
    """A new YAML states what differs from a preset: the rest is the preset's, not the dataclass defaults' (a
    GPT-2 124M). Bases chain: a file beside it over a preset of configs/."""
    (tmp_path / "mine.yaml").write_text("base: quickstart\ntrain:\n  out_dir: out/mine\n")
    (tmp_path / "run.yaml").write_text("base: mine.yaml\noptim:\n  lr: 2.0e-3\n")
    cfg = load_run_config(str(tmp_path / "run.yaml"), ["train.max_steps=7"])
    quickstart = load_run_config(QUICKSTART, [])
    assert cfg.model == quickstart.model and cfg.data == quickstart.data
    assert (cfg.train.out_dir, cfg.optim.lr, cfg.train.max_steps) == ("out/mine", 2e-3, 7)
    assert cfg.optim.warmup_steps == quickstart.optim.warmup_steps


def test_a_later_sample_prompt_replaces_a_presets_sample_chat(tmp_path):
    """The fine-tuning presets sample a chat message; a prompt given after them, on the command line or in a YAML
    over one, is the one sampled, unless the same layer gives a message too."""
    sft = os.path.join(REPO, "configs", "llama_quickstart_sft.yaml")
    assert load_run_config(sft, []).sample.chat
    given = load_run_config(sft, ["sample.prompt=ROMEO"]).sample
    assert (given.prompt, given.chat) == ("ROMEO", None)
    (tmp_path / "mine.yaml").write_text(f"base: {sft}\nsample:\n  prompt: ROMEO\n")
    assert load_run_config(str(tmp_path / "mine.yaml"), []).sample.chat is None
    assert load_run_config(sft, ["sample.prompt=ROMEO", "sample.chat=Hi"]).sample.chat == "Hi"
    assert load_run_config(str(tmp_path / "mine.yaml"), ["sample.chat=Hi"]).sample.chat == "Hi"


def test_missing_files_name_where_to_look():
    with pytest.raises(ConfigError, match=r"ds_config nope.json does not exist; fix: pass a DeepSpeed config JSON; "
                                          r"shipped ones: .*zero2.json"):
        load_ds_config("nope.json", [])
    with pytest.raises(ConfigError, match=r"run config nope.yaml does not exist; fix: pass a YAML preset, e.g. one of "
                                          r".*configs"):
        load_run_config("nope.yaml", [])


@pytest.mark.parametrize("loader,what", [(load_run_config, "run config"), (load_ds_config, "ds_config")])
def test_a_config_path_that_is_a_folder_or_missing_is_refused(tmp_path, loader, what):
    for path, problem in ((tmp_path, "is a folder, not a file"), (tmp_path / "nope", "does not exist")):
        with pytest.raises(ConfigError, match=f"^{what} {path} {problem}; fix: pass a "):
            loader(str(path), [])


def test_overrides_reach_both_files():
    run_overrides, ds_overrides = split_overrides(["train.max_steps=7", "ds.zero_optimization.stage=3",
                                                   "model.n_layer=3", "ds.bf16.enabled=false"])
    cfg = load_run_config(os.path.join(REPO, "configs", "quickstart.yaml"), run_overrides)
    ds = load_ds_config(os.path.join(REPO, "ds_configs", "zero1.json"), ds_overrides)
    assert (cfg.train.max_steps, cfg.model.n_layer, cfg.model.n_embd) == (7, 3, 128)
    assert ds["zero_optimization"]["stage"] == 3 and ds["bf16"]["enabled"] is False


def test_config_files_may_come_anywhere_among_the_overrides():
    args = parse_args(["train.max_steps=5", "--config", ENCODER, "train.out_dir=out/x", "--ds_config", "d.json",
                       "--local_rank=1", "model.n_layer=2"])
    assert (args.config, args.ds_config, args.local_rank) == (ENCODER, "d.json", 1)
    assert args.overrides == ["train.max_steps=5", "train.out_dir=out/x", "model.n_layer=2"]
