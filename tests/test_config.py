"""Configuration: shipped files load through DeepSpeed's own parser; bad input fails early and clearly."""
import glob
import json
import os

import pytest
import torch

from common.checks import ConfigError
from conftest import REPO, launch, train_py
from training.config import DEFAULT_CONFIG, load_ds_config, load_run_config, split_overrides
from training.startup import effective_ds_config
from training.topology import resolve_layout

CPU = torch.device("cpu")

DS_CONFIGS = sorted(glob.glob(os.path.join(REPO, "ds_configs", "*.json")))
PRESETS = sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml")))


@pytest.mark.parametrize("path", DS_CONFIGS, ids=os.path.basename)
def test_shipped_ds_configs_pass_deepspeeds_parser(path):
    ds = load_ds_config(path, [])
    assert ds["train_micro_batch_size_per_gpu"] >= 1


@pytest.mark.parametrize("path", DS_CONFIGS, ids=os.path.basename)
def test_shipped_ds_configs_switch_off_deepspeeds_throughput_timer(path):
    # On by default, it synchronizes the device in every forward and every step(); train.py has its own meter.
    from deepspeed.runtime.config import DeepSpeedConfig
    ds = load_ds_config(path, [])
    if ds.get("bf16", {}).get("enabled") == "auto":  # resolved on the device by train.py
        ds["bf16"]["enabled"] = True
    assert DeepSpeedConfig(ds).timers_config.enabled is False


def test_the_default_ds_config_is_zero1_on_a_gpu_and_zero0_on_a_cpu():
    """On a GPU bf16 ZeRO-0 would step through DeepSpeed's unfused optimizer (a host sync per gradient)."""
    from training.config import DEFAULT_DS_CONFIG, default_ds_config
    assert os.path.basename(default_ds_config(cuda=True)) == "zero1.json"
    assert os.path.basename(default_ds_config(cuda=False)) == "zero0.json" == os.path.basename(DEFAULT_DS_CONFIG)
    assert load_ds_config(default_ds_config(cuda=True), [])["data_types"]["grad_accum_dtype"] == "fp32"


def test_all_advertised_ds_configs_are_shipped():
    names = {os.path.basename(p) for p in DS_CONFIGS}
    assert {"zero0.json", "zero1.json", "zero2.json", "zero3.json", "zero2_offload.json", "zero2_fp16.json"} <= names


@pytest.mark.parametrize("path", PRESETS, ids=os.path.basename)
def test_presets_load(path):
    cfg = load_run_config(path, [])
    assert cfg.model.n_embd % cfg.model.n_head == 0
    # None: the dataset's own (the character presets); a preset that names one is defined by it
    assert cfg.data.tokenizer in (None, "gpt2", "tokenizer.json") or cfg.data.tokenizer.startswith("bpe:")


def test_overrides_reach_both_files():
    run_overrides, ds_overrides = split_overrides(["train.max_steps=7", "ds.zero_optimization.stage=3",
                                                   "model.n_layer=3", "ds.bf16.enabled=false"])
    cfg = load_run_config(os.path.join(REPO, "configs", "quickstart.yaml"), run_overrides)
    ds = load_ds_config(os.path.join(REPO, "ds_configs", "zero1.json"), ds_overrides)
    assert (cfg.train.max_steps, cfg.model.n_layer, cfg.model.n_embd) == (7, 3, 128)
    assert ds["zero_optimization"]["stage"] == 3 and ds["bf16"]["enabled"] is False


def test_malformed_json_names_file_and_line(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{\n  "train_micro_batch_size_per_gpu": 4,\n  "bf16": {"enabled": true,}\n}\n')
    with pytest.raises(ConfigError, match=r"bad.json, line 3, column 28: malformed JSON: Expecting property name"):
        load_ds_config(str(path), [])


def test_ds_key_deepspeed_would_ignore_is_rejected(tmp_path):
    path = tmp_path / "typo.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_clippin": 1.0}))
    with pytest.raises(ConfigError, match=r"does not know the key\(s\) 'gradient_clippin' "
                                          r"\(did you mean 'gradient_clipping'\?\)"):
        load_ds_config(str(path), [])


def test_nested_ds_typo_is_rejected_by_deepspeed():
    with pytest.raises(ConfigError, match=r"rejected by DeepSpeed's config parser \(DeepSpeedZeroConfig\): "
                                          r"stag: Extra inputs are not permitted"):
        load_ds_config(os.path.join(REPO, "ds_configs", "zero2.json"), ["zero_optimization.stag=1"])


def test_optimizer_in_ds_config_is_refused_as_a_second_home(tmp_path):
    path = tmp_path / "opt.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW"}}))
    with pytest.raises(ConfigError, match=r"'optimizer' section is a run setting here: set optim\.\*"):
        load_ds_config(str(path), [])


def test_unknown_run_key_suggests_the_right_one():
    with pytest.raises(ConfigError, match=r"unknown setting 'train.max_step' in the command line; "
                                          r"did you mean 'train.max_steps'\?"):
        load_run_config(os.path.join(REPO, "configs", "quickstart.yaml"), ["train.max_step=5"])


def test_unknown_key_in_yaml_names_the_file(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("model:\n  n_layers: 3\n")
    with pytest.raises(ConfigError, match=rf"unknown setting 'model.n_layers' in {path}; did you mean 'model.n_layer'"):
        load_run_config(str(path), [])


def test_badly_typed_value_is_rejected():
    with pytest.raises(ConfigError, match=r"bad setting 'train.max_steps' in the command line"):
        load_run_config(os.path.join(REPO, "configs", "quickstart.yaml"), ["train.max_steps=many"])


def test_missing_files_name_where_to_look():
    with pytest.raises(ConfigError, match=r"ds_config nope.json does not exist; fix: pass a DeepSpeed config JSON; "
                                          r"shipped ones: .*zero2.json"):
        load_ds_config("nope.json", [])
    with pytest.raises(ConfigError, match=r"run config nope.yaml does not exist; fix: pass a YAML preset, e.g. one of "
                                          r".*configs"):
        load_run_config("nope.yaml", [])


@pytest.mark.parametrize("given,world,pp,expected", [
    ({"train_micro_batch_size_per_gpu": 4}, 2, 1, (4, 1, 8)),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 4, 2, (4, 2, 16)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 8, 1, (2, 2, 32)),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2}, 4, 1, (2, 4, 32)),
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}, 8, 2, (2, 2, 16)),
])
def test_batch_triple_is_derived(given, world, pp, expected):
    ds = {**given, "pipeline": {"stages": pp}}
    engine = effective_ds_config(ds, load_run_config(DEFAULT_CONFIG, []), world, CPU)
    layout = engine.layout
    assert (layout.micro_batch, layout.grad_accum, layout.global_batch) == expected
    assert (engine.ds["train_micro_batch_size_per_gpu"], engine.ds["gradient_accumulation_steps"],
            engine.ds["train_batch_size"]) == expected
    assert layout.dp == world // pp
    assert ds == {**given, "pipeline": {"stages": pp}}  # the loaded ds_config is left as it is


def test_the_effective_ds_config_is_assembled_in_one_place():
    """The loaded ds_config, untouched, and what DeepSpeed gets: the triple, bf16 "auto" resolved, the run's
    optimizer and schedule, universal loading for a universal checkpoint."""
    cfg = load_run_config(DEFAULT_CONFIG, ["optim.lr=1e-3"])
    ds = load_ds_config(os.path.join(REPO, "ds_configs", "zero1.json"), [])
    loaded = json.loads(json.dumps(ds))
    engine = effective_ds_config(ds, cfg, 2, CPU, load_universal=True)
    assert ds == loaded
    assert engine.ds["bf16"]["enabled"] is (engine.dtype == torch.bfloat16)
    assert engine.ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * engine.layout.grad_accum * 2
    assert engine.ds["optimizer"]["params"]["lr"] == 1e-3 and engine.ds["scheduler"]["type"] == "WarmupCosineLR"
    assert engine.ds["checkpoint"] == {"load_universal": True}
    assert engine.layout_record() == {"world": 2, "dp": 2, "pp": 1, "tp": 1, "zero_stage": 1}
    assert "checkpoint" not in effective_ds_config(ds, cfg, 2, CPU).ds


def test_impossible_batch_triple_names_all_four_numbers():
    ds = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
    with pytest.raises(ConfigError, match=r"train_batch_size \(32\) != train_micro_batch_size_per_gpu \(4\) x "
                                          r"gradient_accumulation_steps \(2\) x dp \(2, = world 4 / pp 2\) = 16"):
        resolve_layout(ds, world_size=4, pipeline_stages=2)


def test_stages_must_divide_world():
    with pytest.raises(ConfigError, match=r"3 pipeline stages do not divide the world size 4"):
        resolve_layout({"train_micro_batch_size_per_gpu": 1}, 4, 3)


def cli(*args, ds_config="zero0.json"):
    return train_py(["--ds_config", os.path.join(REPO, "ds_configs", ds_config), *args],
               check=False, timeout=120)


def assert_fails_before_training(proc, message):
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr
    assert "step 0" not in proc.stdout and "Traceback" not in proc.stderr


def test_cli_fp16_on_cpu_is_refused(char_data, tmp_path):
    proc = cli(f"data.dir={char_data}", f"train.out_dir={tmp_path}", ds_config="zero2_fp16.json")
    assert_fails_before_training(proc, "error: fp16 is not supported on cpu: use a bf16 ds_config")


def test_cli_missing_data_says_how_to_prepare(tmp_path):
    proc = cli(f"data.dir={tmp_path}/none", f"train.out_dir={tmp_path}")
    assert_fails_before_training(proc, f"no prepared dataset in {tmp_path}/none (meta.json missing); prepare it "
                                       f"with: python -m data.prepare --input PATH/TO/text.txt --out_dir "
                                       f"{tmp_path}/none")


def test_cli_compile_with_pipeline_stages_is_refused(char_data, tmp_path):
    proc = cli(f"data.dir={char_data}", f"train.out_dir={tmp_path}", "train.compile=true", ds_config="pipe2.json")
    assert_fails_before_training(proc, "train.compile=true works on the plain module only: use a ds_config without "
                                       "pipeline stages or set train.compile=false")


def test_cli_malformed_override(char_data, tmp_path):
    proc = cli(f"data.dir={char_data}", "train.max_steps")
    assert_fails_before_training(proc, "override 'train.max_steps' is not key=value")


def test_launcher_run_with_impossible_triple_fails_on_every_rank_before_training(char_data, tmp_path):
    proc = launch(2, "zero1.json", tmp_path, char_data, ["ds.train_batch_size=12"], check=False, timeout=120)
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert ("train_batch_size (12) != train_micro_batch_size_per_gpu (12) x gradient_accumulation_steps (1) "
            "x dp (2, = world 2 / pp 1) = 24") in output
    assert "step 0" not in output
    assert not os.path.exists(tmp_path / "metrics.jsonl")
