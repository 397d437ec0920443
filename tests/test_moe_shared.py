"""Shared experts (model.n_shared_experts; model/moe.py): Qwen2-MoE's block, the routed experts plus an always-on
SwiGLU behind a sigmoid gate. The export is a Qwen2-MoE whose logits in transformers are this repo's (top-1, -2,
-3, dense blocks between, a tied head; from ep 2 and tp 2 x ep 2 checkpoints too) and a Qwen2-MoE folder is read
back exactly at ep 2 and tp 2; the shared expert is dense weights, alike at every expert- and tensor-parallel
degree; ep 2 (stopped and resumed), pp 2, tp 2 x ep 2 and sp 2 x ep 2 train as one process does; FLOPs and the
memory plan count it; what the layouts cannot hold is refused in one line."""
import dataclasses
import json

import pytest
import torch
from deepspeed.moe.utils import is_moe_param
from safetensors.torch import load_file

from common.checks import ConfigError
from harness import FP32, TINY, export, launch, metrics, train_py
from hf_check import assert_export_matches_transformers, load_in_transformers, transformers_model
from model import build_model, model_layers
from model.config import ModelConfig
from model.moe import ExpertParallel, global_expert_names
from model.tensor_parallel import TensorParallel, merge_parameter, split_rule
from model_checks import decisive_model
from training.checkpoints.export import write_export
from training.checkpoints.hf import check_hf_folder, load_into, to_hf
from training.memory_plan import layer_activation_bytes, plan
from training.metrics import flops_per_token

# TINY's 2 layers x 32 wide; 4 experts of width 48, 2 per token, and a shared expert as wide as one.
SHAPE = ModelConfig(arch="llama", n_layer=2, n_head=2, n_kv_head=2, n_embd=32, ffn_hidden=64, block_size=32,
                    vocab_size=65, n_experts=4, expert_hidden=48, n_shared_experts=1)
SHARED = ["model.arch=llama", "model.n_kv_head=2", "model.ffn_hidden=64", "model.n_experts=4", "model.expert_hidden=48",
          "model.n_shared_experts=1", "train.max_steps=4", "optim.warmup_steps=2", "optim.lr=3e-3",
          "model.router_aux_loss_coef=0.1", "ds.train_micro_batch_size_per_gpu=4", "train.save_interval=2", *FP32]
CHARS = {"format": 2, "tokenizer": "char", "vocab_size": 65, "chars": [chr(32 + i) for i in range(65)]}
SHARED_NAMES = ("mlp.shared_mlp.gate.weight", "mlp.shared_mlp.up.weight", "mlp.shared_mlp.down.weight",
                "mlp.shared_gate.weight")


@pytest.mark.parametrize("change", [{}, dict(experts_per_token=1, moe_every=2, n_shared_experts=2),
                                    dict(experts_per_token=3, tie_embeddings=True), dict(qkv_bias=True)],
                         ids=["top2", "top1_every2", "top3", "qkv_bias"])
def test_the_export_is_a_qwen2_moe_with_this_repos_logits(tmp_path, change):
    """transformers' Qwen2MoeForCausalLM of the export computes this repo's logits (1e-5, fp32): its sparse block
    is ours, top-1 unnormalized as DeepSpeed's (norm_topk_prob=False), the dense blocks between where
    decoder_sparse_step says."""
    cfg = dataclasses.replace(SHAPE, **change)
    model = decisive_model(cfg, seed=1, scale=0.1)
    write_export(str(tmp_path), cfg, model.state_dict(), CHARS, step=0)
    assert_export_matches_transformers(str(tmp_path), tokens=32, weights=model.state_dict())
    config = load_in_transformers(str(tmp_path)).config
    shared = 48 * cfg.n_shared_experts
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size, config.intermediate_size,
            config.shared_expert_intermediate_size, config.norm_topk_prob, config.decoder_sparse_step,
            config.mlp_only_layers, config.qkv_bias, config.router_aux_loss_coef) == \
        (4, cfg.experts_per_token, 48, 64, shared, cfg.experts_per_token > 1, cfg.moe_every, [], cfg.qkv_bias, 0.01)


def test_the_shared_expert_is_dense_weights_alike_at_every_degree():
    """Built at ep 2, each rank holds the whole model's shared expert (and every other weight, its experts by
    their global index) bit for bit; DeepSpeed takes none of it for an expert's; at tp 2 it splits as the dense
    MLP does, its gate whole, and the slices merge into the whole weights."""
    whole = dict(build_model(SHAPE).named_parameters())
    for rank in (0, 1):
        half = build_model(SHAPE, ep=ExpertParallel(2, rank))
        names = global_expert_names(half)
        for name, p in half.named_parameters():
            assert torch.equal(p, whole[names.get(name, name)]), name
    assert not any(is_moe_param(whole[f"2.{name}"]) for name in SHARED_NAMES)
    ranks = [dict(build_model(SHAPE, tp=TensorParallel(2, r)).named_parameters()) for r in (0, 1)]
    assert [split_rule(ranks[0][f"2.{name}"]) for name in SHARED_NAMES] == ["column", "column", "row", None]
    for name, p in whole.items():
        assert torch.equal(merge_parameter([r[name].detach() for r in ranks], split_rule(ranks[0][name])), p), name


def test_flops_and_the_memory_plan_count_the_shared_expert():
    """Every token's: its three matrices and its gate's d in the FLOPs; in the memory plan its weights whole on
    every expert-parallel rank and, per token, its SwiGLU's 8 x width, its output (2 d) and the gate's sigmoid."""
    plain = dataclasses.replace(SHAPE, n_shared_experts=0)
    for shared in (1, 2):
        cfg = dataclasses.replace(SHAPE, n_shared_experts=shared)
        assert flops_per_token(cfg) - flops_per_token(plain) == 6 * 2 * (3 * 32 * 48 * shared + 32)
    assert layer_activation_bytes(SHAPE) - layer_activation_bytes(plain) == 8 * 48 + 2 * 32 + 2
    ds = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}, "expert_parallel_size": 2}
    assert plan(SHAPE, ds, 4)["params_per_gpu"] - plan(plain, ds, 4)["params_per_gpu"] == 2 * (3 * 32 * 48 + 32)


@pytest.mark.parametrize("qkv_bias", [False, True], ids=["unbiased", "qkv_bias"])
def test_a_qwen2_moe_folder_is_read_back_exactly_at_ep2_and_tp2(tmp_path, qkv_bias):
    """transformers' own Qwen2-MoE (Qwen1.5-MoE's and Qwen2-57B's with q/k/v biases), checked and loaded by
    train.init_from's path into each rank of ep 2 and of tp 2: the ranks' weights, gathered, export its tensors
    bit for bit."""
    cfg = dataclasses.replace(SHAPE, qkv_bias=qkv_bias)
    transformers_model(cfg, tmp_path)
    check_hf_folder(str(tmp_path), cfg)
    original = load_file(tmp_path / "model.safetensors")
    assert ("model.layers.0.self_attn.q_proj.bias" in original) == qkv_bias
    state = {}
    for rank in (0, 1):
        model = build_model(cfg, ep=ExpertParallel(2, rank))
        load_into(model, str(tmp_path), cfg)
        names = global_expert_names(model)
        state.update({names.get(name, name): p.detach() for name, p in model.named_parameters()})
    ranks = [build_model(cfg, tp=TensorParallel(2, rank)) for rank in (0, 1)]
    for rank, model in enumerate(ranks):
        load_into(model, str(tmp_path), cfg, tp=TensorParallel(2, rank))
    split = [dict(model.named_parameters()) for model in ranks]
    merged = {name: merge_parameter([r[name].detach() for r in split], split_rule(p)) for name, p in split[0].items()}
    for weights in (state, merged):
        exported = to_hf(weights, cfg)
        assert sorted(exported) == sorted(original)
        for key, tensor in original.items():
            torch.testing.assert_close(exported[key], tensor, rtol=0, atol=0, msg=key)


def test_what_the_layouts_cannot_hold_is_refused_in_one_line(tmp_path):
    qwen, mixtral = tmp_path / "qwen2_moe", tmp_path / "mixtral"
    transformers_model(SHAPE, qwen)
    transformers_model(dataclasses.replace(SHAPE, n_shared_experts=0), mixtral)
    refusals = [(qwen, dict(n_shared_experts=0), "holds a 'qwen2_moe' model whose shared expert is 1 experts wide "
                 "(0: none), this run's 'mixtral' model's 0 (model.n_shared_experts): set model.n_shared_experts=1"),
                (qwen, dict(n_shared_experts=2), "this run's 'qwen2_moe' model's 2 (model.n_shared_experts): set "
                 "model.n_shared_experts=1"),
                (mixtral, {}, "holds a 'mixtral' model whose shared expert is 0 experts wide (0: none), this run's "
                 "'qwen2_moe' model's 1 (model.n_shared_experts): set model.n_shared_experts=0")]
    for folder, change, message in refusals:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            check_hf_folder(str(folder), dataclasses.replace(SHAPE, **change))
    config = json.loads((qwen / "config.json").read_text())
    for key, value, fix in (("qkv_bias", True, "set model.qkv_bias=true"), ("norm_topk_prob", False,
                            "pick another folder"), ("use_sliding_window", True, "pick another folder")):
        (qwen / "config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(ConfigError, match=f"its config.json has {key}={value}, which this run's model does not "
                                              rf"compute \({key}={not value} for its model.\*\): {fix}"):
            check_hf_folder(str(qwen), SHAPE)
    biased = dataclasses.replace(SHAPE, router_bias_rate=0.01)
    with pytest.raises(ConfigError, match="Qwen2-MoE layout has no per-expert bias on the router's choice"):
        to_hf(dict(build_model(biased).named_parameters()), biased)
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size=2 does not divide the shared expert's width "
                                          r"\(model.n_shared_experts x the experts' width\) = 25"):
        model_layers(dataclasses.replace(SHAPE, expert_hidden=25), TensorParallel(2))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, char_data):
    """One process, pp=2 (ZeRO-1) and sp=2 x ep=2 with 2 accumulation steps; ep=2 (ZeRO-2, stopped at step 2 and
    resumed to 4) and tp=2 x ep=2 (4 ranks, the experts shared out over the tensor group): 8 sequences a step each.
    (At tp=2 x ep=1 DeepSpeed writes the first tensor rank's module file only, its expert-data-parallel writer.)"""
    out = {name: tmp_path_factory.mktemp(f"shared_{name}") for name in ("one", "ep2", "pp2", "tp2_ep2", "sp2_ep2")}
    train_py(["--config", "configs/quickstart.yaml", "--ds_config", "ds_configs/zero0.json", f"data.dir={char_data}",
              *TINY, *SHARED, "ds.gradient_accumulation_steps=2", f"train.out_dir={out['one']}"])
    ep2 = [*SHARED, "ds.expert_parallel_size=2"]
    launch(2, "zero2.json", out["ep2"], char_data, [*ep2, "train.stop_at_step=2"])
    launch(2, "zero2.json", out["ep2"], char_data, ep2)
    launch(2, "pipe2.json", out["pp2"], char_data, [*SHARED, "ds.gradient_accumulation_steps=2"])
    launch(2, "sp2.json", out["sp2_ep2"], char_data, [*ep2, "ds.gradient_accumulation_steps=2"])
    launch(4, "tp2.json", out["tp2_ep2"], char_data, ep2)
    return out


@pytest.mark.launch
@pytest.mark.parametrize("name", ["ep2", "pp2", "tp2_ep2", "sp2_ep2"])
def test_layouts_train_as_one_process_does(runs, name):
    """Step for step the losses, gradient norms (tp 2 x ep 2: DeepSpeed's accounting of the experts' norms, 3e-4, as in
    test_moe.py), load-balancing losses and expert loads, and the last validation loss equal one process's; after 4
    steps every weight does (5e-6: Adam's magnified rounding, as in test_moe.py), the shared expert's among them."""
    from training.checkpoints.export import consolidated_state_dict
    reference, other = ([m for m in metrics(runs[run]) if "loss" in m] for run in ("one", name))
    assert [m["step"] for m in other] == [1, 2, 3, 4]
    for key in ("loss", "grad_norm", "moe_aux_loss", "expert_load_max"):
        tolerance = 5e-4 if key == "grad_norm" and name == "tp2_ep2" else 1e-5
        assert [m[key] for m in other] == pytest.approx([m[key] for m in reference], rel=tolerance), key
    validation = ([m["val_loss"] for m in metrics(runs[run]) if "val_loss" in m][-1] for run in ("one", name))
    assert next(validation) == pytest.approx(next(validation), rel=1e-5)
    theirs, ours = (consolidated_state_dict(str(runs[run] / "checkpoints" / "step_000004")) for run in ("one", name))
    assert sorted(ours) == sorted(theirs) and f"2.{SHARED_NAMES[0]}" in ours
    for key, tensor in theirs.items():
        torch.testing.assert_close(ours[key], tensor, rtol=0, atol=5e-6, msg=key)


@pytest.mark.launch
@pytest.mark.parametrize("name", ["ep2", "tp2_ep2"])
def test_a_runs_export_is_a_qwen2_moe_that_transformers_loads(runs, name):
    """The checkpoint's weights (the shared expert in the module's files, each expert in its own; tp 2's slices
    merged) under Qwen2-MoE's names give this repo's logits in transformers."""
    assert_export_matches_transformers(export(runs[name], "step_000004"), tokens=32)
