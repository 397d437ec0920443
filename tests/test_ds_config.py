"""The ds_config, DeepSpeed's own JSON (training/config.py, training/startup.py): the shipped files load through
DeepSpeed's parser; typos, a second home for the optimizer and numbers DeepSpeed does not check are refused by
name; the batch triple is derived and the effective ds_config assembled in one place, the loaded file left as
it is."""
import glob
import json
import os

import pytest
import torch

from common.checks import ConfigError
from harness import REPO, launch
from refusals import assert_refused_at_start, train_py_as_typed
from training.config import DEFAULT_CONFIG, load_run_config
from training.ds_config import load_ds_config
from training.startup import effective_ds_config
from training.topology import resolve_layout

CPU = torch.device("cpu")

DS_CONFIGS = sorted(glob.glob(os.path.join(REPO, "ds_configs", "*.json")))


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


def test_deepspeeds_decoupled_checkpoint_writer_is_refused_with_the_repos_own():
    with pytest.raises(ConfigError, match=r"zero1.json: checkpoint.writer is DeepSpeed's decoupled writer, which this "
                                          r"repo does not use .*fix: remove it: train.background_save=true"):
        load_ds_config(os.path.join(REPO, "ds_configs", "zero1.json"),
                       ["checkpoint.writer.type=python", "checkpoint.writer.decoupled=true"])


@pytest.mark.parametrize("body,kind", [("[1, 2]", "list"), ('"zero2"', "str"), ("12", "int")])
def test_ds_config_that_is_not_an_object(tmp_path, body, kind):
    path = tmp_path / "ds.json"
    path.write_text(body)
    with pytest.raises(ConfigError, match=rf"ds.json holds a JSON {kind}, not an object"):
        load_ds_config(str(path), [])


def test_train_py_refuses_a_ds_config_that_is_not_an_object(char_data, tmp_path):
    path = tmp_path / "list.json"
    path.write_text(json.dumps([{"train_micro_batch_size_per_gpu": 4}]))
    proc = train_py_as_typed(f"data.dir={char_data}", "--ds_config", str(path), f"train.out_dir={tmp_path}/out")
    assert_refused_at_start(proc, f"error: {path} holds a JSON list, not an object")


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
    ("sequence_parallel_size=0", "sequence_parallel_size=0 in {path}: must be an integer >= 1"),
    ("sequence_parallel_size=two", "sequence_parallel_size='two' in {path}: must be an integer >= 1; fix: set "
                                   "ds.sequence_parallel_size to one"),
    ("sequence_parallel_size=1.5", "sequence_parallel_size=1.5 in {path}: must be an integer >= 1"),
    ("expert_parallel_size=0", "expert_parallel_size=0 in {path}: must be an integer >= 1"),
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
    from training.ds_config import DS_NUMBERS
    from training.moe import EP_KEY
    from training.topology import ACCUM, GLOBAL, MICRO, SP_KEY, TP_KEY
    assert {MICRO, ACCUM, GLOBAL, TP_KEY, SP_KEY, EP_KEY, "pipeline.stages",
            "pipeline.activation_checkpoint_interval"} <= set(DS_NUMBERS)
    assert {row[0].split("=")[0] for row in BAD_DS_NUMBERS} == set(DS_NUMBERS)


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
    assert engine.layout_record() == {"world": 2, "dp": 2, "pp": 1, "tp": 1, "sp": 1, "ep": 1,
                                      "zero_stage": 1}
    assert "checkpoint" not in effective_ds_config(ds, cfg, 2, CPU).ds


def test_deepspeed_counts_the_sequence_ranks_in_its_batch():
    """Under sequence parallelism the layout's triple counts the data-parallel replicas; DeepSpeed, whose data
    axis holds the sequence ranks too, is given its own count (the one ds_config, which ds_config.json saves) and
    not the key it would divide by again."""
    cfg = load_run_config(DEFAULT_CONFIG, [])
    ds = load_ds_config(os.path.join(REPO, "ds_configs", "zero1.json"), ["sequence_parallel_size=2"])
    engine = effective_ds_config(ds, cfg, 4, CPU)
    assert (engine.layout.dp, engine.layout.sp_size, engine.layout.data_axis) == (2, 2, 4)
    assert engine.layout.global_batch == ds["train_micro_batch_size_per_gpu"] * engine.layout.grad_accum * 2
    assert engine.ds["train_batch_size"] == 2 * engine.layout.global_batch
    assert "sequence_parallel_size" not in engine.ds
    assert engine.layout_record()["sp"] == 2


def test_impossible_batch_triple_names_all_four_numbers():
    ds = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
    with pytest.raises(ConfigError, match=r"train_batch_size \(32\) != train_micro_batch_size_per_gpu \(4\) x "
                                          r"gradient_accumulation_steps \(2\) x dp \(2, = world 4 / pp 2\) = 16"):
        resolve_layout(ds, world_size=4, pipeline_stages=2)


def test_stages_must_divide_world():
    with pytest.raises(ConfigError, match=r"3 pipeline stages do not divide the world size 4"):
        resolve_layout({"train_micro_batch_size_per_gpu": 1}, 4, 3)


@pytest.mark.launch
def test_launcher_run_with_impossible_triple_fails_on_every_rank_before_training(char_data, tmp_path):
    proc = launch(2, "zero1.json", tmp_path, char_data, ["ds.train_batch_size=12"], check=False, timeout=120)
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert ("train_batch_size (12) != train_micro_batch_size_per_gpu (12) x gradient_accumulation_steps (1) "
            "x dp (2, = world 2 / pp 1) = 24") in output
    assert "step 0" not in output
    assert not os.path.exists(tmp_path / "metrics.jsonl")
