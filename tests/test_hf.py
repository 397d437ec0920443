"""Hugging Face interop in one process, checked by `transformers` itself: this repo's GPT and Llama written in
Hugging Face's layout load in GPT2LMHeadModel / LlamaForCausalLM with equal logits, and models that
transformers builds (random weights, no download) load here with equal logits; bad folders are refused."""
import dataclasses
import json
import re
import shutil

import pytest
import torch

from common.checks import ConfigError
from hf_check import assert_export_matches_transformers, transformers_model
from model import build_model
from model.config import ModelConfig
from training.checkpoints import hf
from training.checkpoints.export import write_export

GPT = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=65)
LLAMA = ModelConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=64, block_size=32,
                    vocab_size=65, rope_theta=500.0)
CASES = {"gpt": GPT, "gpt_exact_gelu": dataclasses.replace(GPT, activation="gelu"), "llama_gqa": LLAMA,
         "llama_mqa_tied": dataclasses.replace(LLAMA, n_kv_head=1, tie_embeddings=True, norm_eps=1e-6),
         "llama3.1_rope_scaling": dataclasses.replace(LLAMA, rope_scale_factor=8.0, rope_original_context=16),
         "llama_wide_heads": dataclasses.replace(LLAMA, head_dim=16),
         "qwen2": dataclasses.replace(LLAMA, qkv_bias=True, rope_theta=1e6, norm_eps=1e-6),
         "qwen3_tied": dataclasses.replace(LLAMA, qk_norm=True, head_dim=16, tie_embeddings=True, norm_eps=1e-6)}
LAYOUTS = {"gpt": "gpt2", "gpt_exact_gelu": "gpt2", "llama_gqa": "llama", "llama_mqa_tied": "llama",
           "llama3.1_rope_scaling": "llama", "llama_wide_heads": "llama", "qwen2": "qwen2", "qwen3_tied": "qwen3"}
CHAR_META = {"format": 2, "tokenizer": "char", "vocab_size": 65, "chars": [chr(32 + i) for i in range(65)]}


def randomized(cfg: ModelConfig) -> dict:
    """A model's weights, norms included, all random: a mapping that swaps two tensors cannot pass."""
    model = build_model(cfg, seed=3)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model.state_dict()


@pytest.mark.parametrize("name", CASES)
def test_export_loads_in_transformers_with_equal_logits(tmp_path, name):
    """transformers' logits of the export against this repo's forward of the weights written, not of the export
    read back: a name wrong on the way out only would be read back alike."""
    cfg = CASES[name]
    weights = randomized(cfg)
    write_export(str(tmp_path), cfg, weights, CHAR_META, step=0)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == LAYOUTS[name]
    assert_export_matches_transformers(str(tmp_path), tokens=32, weights=weights)


def test_special_token_ids_come_from_the_tokenizer():
    assert {k: v for k, v in hf.hf_config(GPT, CHAR_META).items() if k.endswith("token_id")} == \
        {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    gpt2 = hf.hf_config(LLAMA, {"tokenizer": "gpt2", "vocab_size": 50257})
    assert (gpt2["bos_token_id"], gpt2["eos_token_id"], gpt2["pad_token_id"]) == (50256, 50256, None)
    recorded = hf.hf_config(LLAMA, {"tokenizer": "tokenizer.json", "eot_id": 128001, "bos_id": 128000})
    assert (recorded["bos_token_id"], recorded["eos_token_id"]) == (128000, 128001)


@pytest.mark.parametrize("name,shards", [("gpt", None), ("gpt_exact_gelu", None), ("llama_gqa", None),
                                         ("llama_mqa_tied", None), ("llama_gqa", "30KB"), ("llama_wide_heads", None),
                                         ("qwen2", None), ("qwen3_tied", None), ("llama3.1_rope_scaling", None)],
                         ids=["gpt", "gpt_exact_gelu", "llama_gqa", "llama_mqa_tied", "sharded", "llama_wide_heads",
                              "qwen2", "qwen3_tied", "llama3.1_rope_scaling"])
@torch.no_grad()
def test_import_from_transformers_gives_its_logits(tmp_path, name, shards):
    cfg = CASES[name]
    theirs = transformers_model(cfg, tmp_path, shards)
    assert (tmp_path / "model.safetensors.index.json").exists() == bool(shards)
    hf.check_hf_folder(str(tmp_path), cfg)
    ours = build_model(cfg)
    hf.load_into(ours, str(tmp_path), cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    difference = (ours.eval()(idx)[..., : cfg.vocab_size] - theirs(idx).logits).abs().max().item()
    assert difference <= 1e-5


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf_llama")
    transformers_model(LLAMA, folder)
    return str(folder)


@pytest.mark.parametrize("change,message", [
    (dict(arch="gpt"), "holds a 'llama' model, this run builds model.arch=gpt: set model.arch=llama"),
    (dict(n_kv_head=4), "tensor model.layers.0.self_attn.k_proj.weight has shape [16, 32] there, [32, 32] in this "
                        "run's model config"),
    (dict(ffn_hidden=96), "tensor model.layers.0.mlp.gate_proj.weight has shape [64, 32] there, [96, 32]"),
    (dict(n_layer=3), "tensor model.layers.2.input_layernorm.weight is missing there"),
    (dict(rope_theta=10000.0), "rope_theta is 500.0 there, 10000.0 in this run's model config"),
    (dict(vocab_size=28), "its vocabulary holds 65 ids, this run's model 28"),  # the fix: test_finetune.py
])
def test_mismatching_folder_is_refused_naming_the_first_difference(llama_folder, change, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        hf.check_hf_folder(llama_folder, dataclasses.replace(LLAMA, **change))


@pytest.mark.parametrize("name,change,message", [
    ("qwen3_tied", dict(qk_norm=False), "holds a 'qwen3' model, this run's model has the 'llama' layout: set "
                                        "model.qk_norm=true or pick another folder"),
    ("qwen2", dict(qkv_bias=False), "holds a 'qwen2' model, this run's model has the 'llama' layout: set "
                                    "model.qkv_bias=true or pick another folder"),
    ("qwen2", dict(qk_norm=True), "holds a 'qwen2' model, this run's model has no Hugging Face layout: set "
                                  "model.qk_norm=false or pick another folder"),
    ("llama_gqa", dict(qk_norm=True), "holds a 'llama' model, this run's model has the 'qwen3' layout: set "
                                      "model.qk_norm=false or pick another folder"),
])
def test_a_folder_whose_attention_computes_otherwise_names_the_setting(tmp_path, name, change, message):
    """Qwen2's biases and Qwen3's norms are tensors a run without them would leave unread: the layouts must match."""
    transformers_model(CASES[name], tmp_path)
    with pytest.raises(ConfigError, match=re.escape(message)):
        hf.check_hf_folder(str(tmp_path), dataclasses.replace(CASES[name], **change))


SCALED = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}


@pytest.mark.parametrize("rope,change,message", [
    ({"rope_type": "default", "rope_theta": 500.0}, dict(rope_scale_factor=8.0, rope_original_context=16),
     "its RoPE is 'default' ({'rope_type': 'default', 'rope_theta': 500.0}), this run's 'llama3' ({'rope_type': "
     "'llama3', 'rope_theta': 500.0, 'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0, "
     "'original_max_position_embeddings': 16}): set model.rope_scale_factor=null"),
    (SCALED, {}, "its RoPE is 'llama3' ({'rope_type': 'llama3', 'rope_theta': 500.0, 'factor': 8.0, 'low_freq_factor': "
                 "1.0, 'high_freq_factor': 4.0, 'original_max_position_embeddings': 16}), this run's 'default' "
                 "({'rope_type': 'default', 'rope_theta': 500.0}): set model.rope_scale_factor=8.0 "
                 "model.rope_low_freq_factor=1.0 model.rope_high_freq_factor=4.0 model.rope_original_context=16"),
    (SCALED, dict(rope_scale_factor=8.0, rope_original_context=16, rope_low_freq_factor=2.0),
     "'low_freq_factor': 2.0, 'high_freq_factor': 4.0, 'original_max_position_embeddings': 16}): set "
     "model.rope_low_freq_factor=1.0"),
    ({"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0}, {},
     "its RoPE is 'yarn', which this repo does not compute (Llama 3.1's scaling, model.rope_scale_factor, or none): "
     "pick another folder"),
], ids=["unscaled_folder", "scaled_folder", "other_numbers", "yarn"])
def test_a_folder_with_other_rotary_frequencies_is_refused_naming_the_fix(llama_folder, tmp_path, rope, change,
                                                                          message):
    """Llama 3.1's scaling changes every position's low frequencies: a folder with it and a run without it, or with
    other numbers, compute other models. The yarn folder names it rope_scaling, as older config.json files do."""
    folder = tmp_path / "rope"
    shutil.copytree(llama_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    key = "rope_scaling" if rope["rope_type"] == "yarn" else "rope_parameters"
    (folder / "config.json").write_text(json.dumps({**config, "rope_parameters": None, key: rope}))
    with pytest.raises(ConfigError) as caught:
        hf.check_hf_folder(str(folder), dataclasses.replace(LLAMA, **change))
    assert message in str(caught.value)


@pytest.mark.parametrize("key,value", [("use_sliding_window", True), ("attention_bias", True)])
def test_a_qwen3_folder_with_what_the_llama_does_not_compute_is_refused(tmp_path, key, value):
    transformers_model(CASES["qwen3_tied"], tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(ConfigError, match=f"its config.json has {key}={value}, which this run's model does not "
                                          f"compute"):
        hf.check_hf_folder(str(tmp_path), CASES["qwen3_tied"])


@pytest.mark.parametrize("window", [0, 32, 4096])  # none, the context's length, past it (Mistral 7B v0.1's)
@torch.no_grad()
def test_a_mistral_without_a_window_shorter_than_the_context_imports_with_its_logits(tmp_path, window):
    theirs = transformers_model(LLAMA, tmp_path, sliding_window=window)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "mistral"
    hf.check_hf_folder(str(tmp_path), LLAMA)
    ours = build_model(LLAMA)
    hf.load_into(ours, str(tmp_path), LLAMA)
    idx = torch.randint(0, LLAMA.vocab_size, (2, LLAMA.block_size))
    assert (ours.eval()(idx)[..., :LLAMA.vocab_size] - theirs(idx).logits).abs().max().item() <= 1e-5
    write_export(str(tmp_path / "export"), LLAMA, ours.state_dict(), CHAR_META, step=0)
    assert json.loads((tmp_path / "export" / "config.json").read_text())["model_type"] == "llama"  # the same model


def test_a_mistral_whose_window_is_shorter_than_the_context_is_refused(tmp_path):
    transformers_model(LLAMA, tmp_path, sliding_window=16)
    with pytest.raises(ConfigError, match=r"its config.json has sliding_window=16, attention over the last 16 tokens "
                                          r"only, which this run's model does not compute at model.block_size=32: "
                                          r"set model.block_size=16 or less"):
        hf.check_hf_folder(str(tmp_path), LLAMA)
    hf.check_hf_folder(str(tmp_path), dataclasses.replace(LLAMA, block_size=16))


def test_a_model_no_layout_holds_exports_in_this_repos_names(tmp_path):
    """q/k/v biases and per-head norms together are no Hugging Face class's: the export keeps this repo's names."""
    cfg = dataclasses.replace(CASES["qwen3_tied"], qkv_bias=True)
    with pytest.raises(ConfigError, match=r"no Hugging Face layout holds this model.arch='llama' model \(those of "
                                          r"the Llama: llama, qwen2, qwen3, mistral, mixtral, qwen3_moe, qwen2_moe"):
        hf.tensor_pairs(cfg)
    write_export(str(tmp_path), cfg, randomized(cfg), CHAR_META, step=0)
    assert "model_type" not in json.loads((tmp_path / "config.json").read_text())


@pytest.mark.parametrize("theirs,ours,fix", [("gelu_new", "gelu", "set model.activation=gelu_tanh"),
                                             ("gelu", "gelu_tanh", "set model.activation=gelu"),
                                             ("relu", "gelu_tanh", "pick a GPT-2 whose activation_function is one of")])
def test_a_gpt2_with_another_gelu_is_refused(tmp_path, theirs, ours, fix):
    """A GELU that differs by 1e-4 would still load every tensor: the folder's activation_function is checked."""
    transformers_model(GPT, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "activation_function": theirs}))
    with pytest.raises(ConfigError, match=f"its activation_function is {theirs}, this run's model.activation is "
                                          f"{ours} .*; fix: {fix}"):
        hf.check_hf_folder(str(tmp_path), dataclasses.replace(GPT, activation=ours))


def test_tied_run_from_untied_folder_names_the_head(llama_folder, tmp_path):
    folder = tmp_path / "tied"
    transformers_model(dataclasses.replace(LLAMA, tie_embeddings=True), folder)
    with pytest.raises(ConfigError, match=r"tensor lm_head\.weight is missing there"):
        hf.check_hf_folder(str(folder), LLAMA)
    assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is True


@pytest.mark.parametrize("damage,message", [
    (("config.json", b"{not json"), "train.init_from's config {folder}/config.json is not JSON"),
    (("config.json", b"[]"), "train.init_from's config {folder}/config.json holds a JSON list, not an object"),
    (("model.safetensors", b""), "train.init_from's weights {folder}/model.safetensors is empty"),
    (("model.safetensors", b"PK\x03\x04 a zip, say"), "train.init_from's weights {folder}/model.safetensors are not a "
                                                     "safetensors file"),
    (("model.safetensors.index.json", b'{"metadata": {}}'), "train.init_from's index "
                                                           "{folder}/model.safetensors.index.json lacks weight_map"),
])
def test_a_damaged_folder_is_refused_in_one_line(llama_folder, tmp_path, damage, message):
    """The files of train.init_from are read at start: one that is not what its name says ends the run there."""
    folder = tmp_path / "damaged"
    shutil.copytree(llama_folder, folder)
    name, body = damage
    (folder / name).write_bytes(body)
    with pytest.raises(ConfigError) as caught:
        hf.check_hf_folder(str(folder), LLAMA)
    assert message.format(folder=folder) in str(caught.value) and "fix: point train.init_from at" in str(caught.value)
