"""Mixture of experts (model/moe.py, training/moe.py): the block is Mixtral's (softmax router, top-k renormalized,
SwiGLU experts), its experts start alike at every expert-parallel degree, its load-balancing loss is DeepSpeed's
and reaches the gradients with its coefficient; runs at ep=2, ep=1 x dp=2, pp=2 and one process with accumulation
give the same losses, gradient norms and routing figures; a run resumes exactly; the export is a Mixtral that
transformers loads with this repo's logits, and a Mixtral folder is read back exactly; what cannot be combined
is refused at start."""
import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from common.checks import ConfigError
from harness import TINY, export, launch, metrics, train_py
from hf_check import assert_export_matches_transformers, load_in_transformers, transformers_model
from model import build_model
from model.config import ModelConfig
from model.moe import BiasedGate, ExpertParallel, MoEFeedForward, moe_layers
from moe_runs import MOE
from training.metrics import flops_per_token
from training.moe import check_experts
from training.topology import Layout

SHAPE = ModelConfig(arch="llama", n_layer=2, n_head=2, n_kv_head=2, n_embd=32, ffn_hidden=64, block_size=32,
                    vocab_size=65, n_experts=4, expert_hidden=48)
CHARS = {"format": 2, "tokenizer": "char", "vocab_size": 65, "chars": [chr(32 + i) for i in range(65)]}


def moe_block(ep=ExpertParallel(), k=2, seed=0) -> MoEFeedForward:
    torch.manual_seed(seed)
    layer = MoEFeedForward(32, 48, 4, k, n_layer=2, ep=ep)
    layer.init_experts()
    return layer


def test_experts_start_alike_at_every_degree():
    whole = moe_block()
    halves = [moe_block(ExpertParallel(2, rank)) for rank in (0, 1)]
    for rank, half in enumerate(halves):
        assert torch.equal(half.router.weight, whole.router.weight)
        for local, expert in enumerate(half.experts):
            for ours, theirs in zip(expert.parameters(), whole.experts[2 * rank + local].parameters()):
                assert torch.equal(ours, theirs)
    first, second = (list(whole.experts[e].parameters())[0] for e in (0, 1))
    assert not torch.equal(first, second)  # distinct experts, not DeepSpeed's copies of one


@pytest.mark.parametrize("k", [2, 3])
def test_block_is_mixtrals(k):
    """Each token: softmax over the router's logits, the top k renormalized, the experts' outputs so weighted."""
    layer = moe_block(k=k).eval()
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        probs = F.softmax(x @ layer.router.weight.T, dim=-1)
        weights, chosen = probs.topk(k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        expected = sum(weights[..., i:i + 1] * torch.stack([torch.stack([layer.experts[int(e)](t) for t, e in
                                                                         zip(row, es)]) for row, es in
                                                            zip(x, chosen[..., i])]) for i in range(k))
        assert torch.allclose(layer(x), expected, atol=1e-6)


def test_load_balancing_loss_is_deepspeeds_and_reaches_the_gradients():
    """Top-2: E^2 x mean over experts of (mean router probability x share of first choices); its gradient joins
    the hidden states' with weight aux_loss_scale, as a loss term would."""
    layer, scale = moe_block(), 0.25
    x = torch.randn(2, 6, 32)
    probs = F.softmax(x.reshape(-1, 32) @ layer.router.weight.T, dim=-1)
    first = F.one_hot(probs.argmax(-1), 4).float()
    expected = (probs.mean(0) * first.mean(0)).mean() * 4 * 4
    layer.aux_loss_scale = scale
    layer(x).sum().backward()
    (aux, counts, dropped, _), = layer.routed
    assert aux.item() == pytest.approx(expected.item(), rel=1e-6)
    assert counts.sum().item() == 2 * 12 and dropped.item() == 0  # two experts per token, none dropped
    attached = layer.router.weight.grad.clone()
    layer.zero_grad()
    layer.aux_loss_scale = 0.0
    out, aux_loss, _ = layer.moe(x)
    (out.sum() + scale * aux_loss).backward()
    assert torch.allclose(attached, layer.router.weight.grad, atol=1e-7)
    assert not torch.allclose(attached, torch.autograd.grad(layer.moe(x)[0].sum(), layer.router.weight)[0])


def test_router_z_loss_is_st_moes_and_reaches_the_gradients():
    """The mean over tokens of logsumexp(router logits)^2, its gradient added with weight z_loss_scale beside the
    load-balancing loss's."""
    layer, x = moe_block(), torch.randn(2, 6, 32)
    layer.aux_loss_scale, layer.z_loss_scale = 0.25, 0.5
    layer(x).sum().backward()
    (aux, _, _, z), = layer.routed
    logits = x.reshape(-1, 32) @ layer.router.weight.T
    assert z.item() == pytest.approx((torch.logsumexp(logits, -1) ** 2).mean().item(), rel=1e-6)
    attached = layer.router.weight.grad.clone()
    layer.zero_grad()
    out, aux_loss, _ = layer.moe(x)
    (out.sum() + 0.25 * aux_loss + 0.5 * (torch.logsumexp(x.reshape(-1, 32) @ layer.router.weight.T, -1) ** 2)
     .mean()).backward()
    assert torch.allclose(attached, layer.router.weight.grad, atol=1e-6)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_dropped_routes_are_those_deepspeeds_gate_drops(k):
    """Under a capacity factor the count of routes past capacity equals the routes DeepSpeed's dispatch leaves
    out (its gate's dispatch mask)."""
    torch.manual_seed(0)
    layer = MoEFeedForward(32, 48, 4, k, n_layer=2, capacity_factor=0.5)
    layer.init_experts()
    x = torch.randn(4, 16, 32)
    layer(x)
    (_, counts, dropped, _), = layer.routed
    _, _, dispatch, _ = layer.moe.deepspeed_moe.gate(x.reshape(-1, 32))
    assert dropped.item() == counts.sum().item() - dispatch.sum().item() > 0


@pytest.mark.parametrize("k", [2, 3])
def test_a_biased_choice_keeps_the_probabilities_as_weights(k):
    """DeepSeek-V3's balancing: with a zero bias the layer computes what DeepSpeed's gate does; a bias large
    enough on expert 0 makes every token choose it, weighted by its renormalized probability, not by the bias."""
    plain, biased = moe_block(k=k).eval(), moe_block(k=k).eval()
    biased.moe.deepspeed_moe.gate = BiasedGate(biased.moe.deepspeed_moe.gate)
    x = torch.randn(2, 6, 32)
    with torch.no_grad():
        assert torch.allclose(biased(x), plain(x), atol=1e-6)  # the same choice and weights (rounded alike)
        biased.moe.deepspeed_moe.gate.choice_bias[0] = 10.0
        probs = F.softmax(x.reshape(-1, 32) @ biased.router.weight.T, dim=-1)
        _, _, _, indices, _, gates, counts = biased.moe.deepspeed_moe.gate(x.reshape(-1, 32), None, True)
    assert counts[0].item() == 12 and (indices == 0).any(dim=0).all()
    chosen = probs.gather(1, indices.t().long())
    assert torch.allclose(gates.t(), chosen / chosen.sum(1, keepdim=True), atol=1e-6)


def test_the_bias_moves_toward_even_load(monkeypatch):
    from model.moe_hooks import update_router_biases
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, group=None: tensor)  # one rank
    layer = MoEFeedForward(32, 48, 4, 2, n_layer=2, balancing_bias=True)
    layer.load = torch.tensor([6.0, 1.0, 3.0, 2.0])  # mean 3
    update_router_biases(layer, dataclasses.replace(SHAPE, router_bias_rate=0.01), None)
    assert layer.moe.deepspeed_moe.gate.choice_bias.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.01])
    assert layer.load.tolist() == [0, 0, 0, 0]


def test_flops_count_the_active_experts():
    dense = dataclasses.replace(SHAPE, n_experts=0, ffn_hidden=48)
    assert flops_per_token(dataclasses.replace(SHAPE, experts_per_token=1)) == \
        flops_per_token(dense) + 6 * 2 * 32 * 4  # the router's d x E per layer
    assert flops_per_token(SHAPE) - flops_per_token(dense) == 6 * 2 * (32 * 4 + 3 * 32 * 48)
    half = dataclasses.replace(SHAPE, moe_every=2)  # block 1 only
    assert flops_per_token(SHAPE) - flops_per_token(half) == 6 * (32 * 4 + 2 * 3 * 32 * 48 - 3 * 32 * 64)
    assert [type(m.mlp).__name__ for m in build_model(half).modules() if hasattr(m, "mlp_norm")] == \
        ["SwiGLU", "MoEFeedForward"]
    assert len(moe_layers(build_model(SHAPE))) == 2


def test_memory_plan_holds_a_ranks_share_of_the_experts():
    """At ep=2 a rank holds the non-expert weights and half the experts; the experts' optimizer states are
    partitioned over dp / ep ranks; a token's MLP activations are k routes' (SwiGLU, dispatched input and output)
    and the router's probabilities."""
    from training.memory_plan import layer_activation_bytes, plan
    whole = sum(p.numel() for p in build_model(SHAPE).parameters())
    experts = sum(p.numel() for n, p in build_model(SHAPE).named_parameters() if ".deepspeed_experts." in n)
    ds = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}}
    one, two = plan(SHAPE, ds, 4), plan(SHAPE, {**ds, "expert_parallel_size": 2}, 4)
    assert one["params_per_gpu"] == whole and two["params_per_gpu"] == whole - experts // 2
    assert two["states"] == 4 * (whole - experts // 2) + 16 * (whole - experts) / 4 + 16 * (experts // 2) / 2
    dense = dataclasses.replace(SHAPE, n_experts=0)
    assert layer_activation_bytes(SHAPE) - layer_activation_bytes(dense) == 2 * (8 * 48 + 4 * 32) + 4 * 4 - 8 * 64


@pytest.mark.parametrize("change, message", [
    (dict(ep=3), "expert_parallel_size=3 does not divide model.n_experts=4"),
    (dict(ep=4, dp=2), "expert_parallel_size=4 does not divide the 2 ranks of a pipeline stage"),
    (dict(zero_stage=3), "DeepSpeed's native MoE is not supported with ZeRO Stage 3 (its engine refuses it); the "
                         "nearest layout is ZeRO-2 (ds_configs/zero2.json), which shards gradients and optimizer "
                         "states, with expert_parallel_size=2 to share out the experts' weights"),
    (dict(tp=2, pp=2), "cannot be combined with tensor parallelism and pipeline stages together"),
    (dict(pp=2, moe_every=2), "cannot be combined with pipeline stages at model.moe_every=2: a stage without an "
                              "expert block would skip the expert collectives"),
    (dict(tp=2, ep=4), "cannot be combined with tensor parallelism at expert_parallel_size=4: DeepSpeed's experts go "
                       "over the tensor group; set it to 1 or 2"),
    (dict(fp16=True), "cannot be combined with fp16"),
    (dict(compile=True), "cannot be combined with train.compile"),
    (dict(tiles=2), "cannot be combined with train.mlp_tiles"),
    (dict(dense=True, ep=2), "expert_parallel_size=2 but the model has no experts"),
])
def test_refused_combinations(change, message):
    c = {"ep": 1, "dp": 4, "pp": 1, "tp": 1, "sp": 1, "zero_stage": 1, "fp16": False, "compile": False, "tiles": 1,
         "dense": False, "moe_every": 1, **change}
    layout = Layout(c["dp"] * c["pp"] * c["tp"] * c["sp"], c["pp"], 1, 1, c["tp"], c["sp"], c["ep"])
    cfg = dataclasses.replace(SHAPE, n_experts=0) if c["dense"] else dataclasses.replace(SHAPE,
                                                                                        moe_every=c["moe_every"])
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_experts(cfg, layout, c["zero_stage"], c["fp16"], c["compile"], c["tiles"])


def test_gpt_has_no_experts(char_data, tmp_path):
    proc = train_py(["--config", "configs/quickstart.yaml", f"data.dir={char_data}", f"train.out_dir={tmp_path}",
                     "model.n_experts=4"], check=False)
    assert proc.returncode == 2 and "model.n_experts=4: must be 0 for the GPT" in proc.stderr


def steps(out_dir) -> list[dict]:
    """Each logged step's record, with its evaluation's (step 0's and the last: TINY's interval) merged in."""
    records = metrics(out_dir)
    evaluations = {m["step"]: m for m in records if "val_loss" in m}
    return [{**m, **evaluations.get(m["step"], {})} for m in records if "loss" in m]


@pytest.mark.launch
@pytest.mark.parametrize("name", ["ep2", "one", "pp2", "pp2_ep2", "tp2", "tp2_ep2", "sp2", "sp2_ep2"])
def test_layouts_train_alike(moe_runs, name):
    """ep=2 (ZeRO-2), pp=2 (each stage's load-balancing losses reaching its gradients) and tp=2 (each tensor rank
    with every expert), all three resumed at step 2, sp=2 (each rank half of each window, balancing over the whole
    of it) and one process equal ep=1 x dp=2 step for step: losses, gradient norms, the load-balancing loss and
    the experts' loads (every rank's tokens counted, every stage's layers)."""
    reference, other = steps(moe_runs["dp2"]), steps(moe_runs[name])
    assert [m["step"] for m in other] == [1, 2, 3, 4]
    for key in ("loss", "grad_norm", "moe_aux_loss", "router_z_loss", "expert_load_max", "expert_load_mean"):
        # Under tensor parallelism DeepSpeed's gradient norm of the experts' groups (each rank's partition norm
        # averaged over the expert-data-parallel ranks, then reduced over the tensor group) reads 3e-4 below
        # the other layouts' while the losses agree to 1e-5: its accounting, not the gradients.
        tolerance = 5e-4 if key == "grad_norm" and name.startswith("tp") else 1e-5
        assert [m[key] for m in other] == pytest.approx([m[key] for m in reference], rel=tolerance), key
    for key in ("val_loss", "eval_moe_aux_loss", "eval_expert_load_max", "eval_router_z_loss"):  # the last step's
        assert other[-1][key] == pytest.approx(reference[-1][key], rel=1e-5), key
    assert all(m["expert_load_max"] > 1 for m in reference)  # a real imbalance measured, not a constant
    if name.startswith("tp"):  # the weights every tensor rank holds whole stayed equal (each rank's own experts apart)
        checks = [m["replicated_weights_in_sync"] for m in metrics(moe_runs[name]) if "replicated_weights_in_sync" in m]
        assert checks and all(checks)  # at the end of each part of the run


@pytest.mark.launch
@pytest.mark.parametrize("name", ["ep2", "pp2_ep2", "tp2", "tp2_ep2"])
def test_every_expert_ends_where_one_rank_takes_it(moe_runs, name):
    """After 4 steps every weight, each expert's included (gathered from the ranks that held it), equals the
    ep=1 run's: the experts' gradients were the same (DeepSpeed's own MoE test compares them so). Within 5e-6,
    0.2% of one step's update at lr 3e-3: Adam divides tiny gradients by their own size, which magnifies the
    rounding of sums taken in another order (seen: 1.4e-6; 2.4e-6 under tensor parallelism, whose clipping
    factor reads DeepSpeed's norm, 3e-4 off); a wrong gradient moves a weight by about a whole update."""
    from training.checkpoints.export import consolidated_state_dict
    theirs, ours = (consolidated_state_dict(str(moe_runs[run] / "checkpoints" / "step_000004"))
                    for run in ("dp2", name))
    assert sorted(ours) == sorted(theirs) and any(".deepspeed_experts.3." in key for key in ours)
    for key, tensor in theirs.items():
        torch.testing.assert_close(ours[key], tensor, rtol=0, atol=5e-6, msg=key)


@pytest.mark.launch
def test_a_biased_router_balances_alike_in_every_layout(moe_runs):
    """With the bias (and no auxiliary loss) ep=2, stopped at step 2 and resumed, equals one process with
    accumulation, the bias has moved, and the routing differs from the unbiased runs'."""
    biased, one = steps(moe_runs["bias_ep2"]), steps(moe_runs["bias_one"])
    for key in ("loss", "grad_norm", "expert_load_max", "expert_load_mean", "router_bias_max"):
        assert [m[key] for m in biased] == pytest.approx([m[key] for m in one], rel=1e-5), key
    assert [m["router_bias_max"] for m in biased] == pytest.approx([0.01, 0.02, 0.03, 0.04])  # one rate a step
    assert [m["expert_load_max"] for m in biased][1:] != pytest.approx([m["expert_load_max"] for m in
                                                                       steps(moe_runs["dp2"])][1:], rel=1e-3)


@pytest.mark.launch
def test_the_start_and_each_step_name_the_routing(moe_runs):
    lines = (moe_runs["dp2"] / "stdout.txt").read_text().splitlines()
    assert any("llama: 2 layers, 2 heads, width 32, context 32, vocabulary 65, 4 experts in every block, 2 per "
               "token (dropless)" in line for line in lines)
    first = steps(moe_runs["dp2"])[0]
    assert any(line.startswith(f"step 1 | loss {first['loss']:.4f} | aux {first['moe_aux_loss']:.4f}, expert load "
                               f"max {first['expert_load_max']:.2f} | lr") for line in lines)


@pytest.mark.launch
@pytest.mark.parametrize("name", ["ep2", "pp2", "tp2", "tp2_ep2"])
def test_export_is_a_mixtral_that_transformers_loads(moe_runs, name):
    """The checkpoint's weights (the module's files and each expert's, DeepSpeed's names) under Mixtral's names:
    transformers' MixtralForCausalLM gives this repo's logits, and its config the routing."""
    folder = export(moe_runs[name], "step_000004")
    assert_export_matches_transformers(folder, tokens=32)
    config = load_in_transformers(folder).config
    assert (config.num_local_experts, config.num_experts_per_tok, config.intermediate_size,
            config.router_aux_loss_coef) == (4, 2, 48, 0.1)


@pytest.mark.launch
def test_init_from_reads_a_mixtral_folder_exactly(tmp_path, char_data):
    """One step that moves no weight (lr 1e-20) from transformers' own Mixtral, at ep=2: the checkpoint exports
    transformers' tensors bit for bit."""
    transformers_model(SHAPE, tmp_path / "mixtral")
    out = tmp_path / "run"
    launch(2, "zero1.json", out, char_data, [*MOE, "ds.train_micro_batch_size_per_gpu=4",
                                             "ds.expert_parallel_size=2", f"train.init_from={tmp_path / 'mixtral'}",
                                             "train.max_steps=1", "optim.lr=1e-20", "optim.min_lr=1e-20"])
    exported = load_file(f"{export(out, 'step_000001')}/model.safetensors")
    original = load_file(tmp_path / "mixtral" / "model.safetensors")
    assert sorted(exported) == sorted(original)
    for key, tensor in original.items():
        torch.testing.assert_close(exported[key], tensor, rtol=0, atol=0, msg=key)


def test_init_from_names_a_mixtral_of_another_shape(tmp_path, char_data):
    transformers_model(SHAPE, tmp_path / "mixtral")
    common = ["--config", "configs/quickstart.yaml", f"data.dir={char_data}", f"train.out_dir={tmp_path / 'run'}",
              *TINY, *MOE, f"train.init_from={tmp_path / 'mixtral'}"]
    proc = train_py([*common, "model.n_experts=0"], check=False)
    assert proc.returncode == 2 and "holds a 'mixtral' model with 4 experts, this run's 'llama' model has 0 " \
        "(model.n_experts): set model.n_experts=4" in proc.stderr
    proc = train_py([*common, "model.experts_per_token=3"], check=False)
    assert proc.returncode == 2 and "routes each token to 2 experts (num_experts_per_tok), this run to 3" in proc.stderr


def test_mixtral_layout_holds_top_k_experts_in_every_block():
    from training.checkpoints.hf import to_hf
    for change, message in ((dict(moe_every=2), "has experts in every block"),
                            (dict(experts_per_token=1), "makes a top-1 expert's weight 1"),
                            (dict(router_bias_rate=0.01), "no per-expert bias on the router's choice")):
        cfg = dataclasses.replace(SHAPE, **change)
        with pytest.raises(ConfigError, match=message):
            to_hf(dict(build_model(cfg).named_parameters()), cfg)


@pytest.mark.parametrize("change", [{}, dict(experts_per_token=1, moe_every=2, head_dim=24)],
                         ids=["top2", "top1_every2"])
@torch.no_grad()
def test_qwen3_moe_both_ways_with_transformers_logits(tmp_path, change):
    """Per-head norms with experts: the export is a Qwen3MoeForCausalLM computing this repo's logits (its top-1
    unnormalized, dense blocks between where decoder_sparse_step says), and transformers' own Qwen3-MoE loads here
    with its logits."""
    from model_checks import decisive_model
    from training.checkpoints.export import write_export
    from training.checkpoints.hf import check_hf_folder, load_into

    cfg = dataclasses.replace(SHAPE, qk_norm=True, **change)
    model = decisive_model(cfg, seed=1, scale=0.1)
    write_export(str(tmp_path / "ours"), cfg, model.state_dict(), CHARS, step=0)
    assert_export_matches_transformers(str(tmp_path / "ours"), tokens=32, weights=model.state_dict())
    config = load_in_transformers(str(tmp_path / "ours")).config
    assert (config.model_type, config.num_experts_per_tok, config.norm_topk_prob, config.decoder_sparse_step) == \
        ("qwen3_moe", cfg.experts_per_token, cfg.experts_per_token > 1, cfg.moe_every)
    theirs = transformers_model(cfg, tmp_path / "theirs")
    check_hf_folder(str(tmp_path / "theirs"), cfg)
    ours = build_model(cfg)
    load_into(ours, str(tmp_path / "theirs"), cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    assert (ours.eval()(idx)[..., : cfg.vocab_size] - theirs(idx).logits).abs().max().item() <= 1e-5
