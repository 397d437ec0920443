"""The real DeepSpeed engine in this process (world of one, gloo): the learning-rate schedule step by
step, the optimizer DeepSpeed builds (AdamW groups, DeepSpeedCPUAdam under offload), the precision each ZeRO stage
computes and reduces in, and activation checkpointing that really recomputes (background saves:
test_background_save.py). Seconds, no launcher."""
import dataclasses
import os
import re
from unittest import mock

import deepspeed
import pytest
import torch
import torch.nn.functional as F

from common.checks import ConfigError
from engine_checks import engine_for, run_config, train_steps
from harness import REPO, expected_lr, one_rank_world
from model import build_model
from model.config import ModelConfig
from model.gpt import Block
from model_checks import SMALL_GPT
from training.ds_config import load_ds_config
from training.engines import training_engine
from training.optim import check_schedule, optimizer_and_schedule
from training.parallelize import parallelize
from training.startup import effective_ds_config
from training.steps import (
    adjust_engine,
    keep_fp32_grad_norm,
    lm_loss,
    no_all_reduce_over_one_rank,
    no_step_before_the_first,
)


@pytest.fixture(scope="module", autouse=True)
def process_group():
    with one_rank_world():
        yield




@pytest.mark.parametrize("warmup,max_steps", [(1, 5), (2, 6), (3, 8), (5, 5), (4, 13)])
def test_schedule_starts_at_the_first_warmup_step_and_ends_at_min_lr(warmup, max_steps):
    lr, min_lr = 1e-3, 1e-4
    cfg = run_config(optim={"lr": lr, "min_lr": min_lr, "warmup_steps": warmup}, train={"max_steps": max_steps})
    lrs = train_steps(engine_for(cfg, {"zero_optimization": {"stage": 0}}), max_steps)
    assert lrs == pytest.approx([expected_lr(k, lr, min_lr, warmup, max_steps) for k in range(1, max_steps + 1)],
                                rel=1e-12, abs=0)
    assert lrs[0] == pytest.approx(lr / warmup, rel=1e-12) and lrs[0] > 0
    assert lrs[-1] == pytest.approx(min_lr, rel=1e-12)
    assert all(value > min_lr for value in lrs[:-1] if max_steps > 1)  # min_lr is reached at the last step only


# lr 1e-3, min_lr 1e-4, 10 steps, warmup 2, decay_fraction 0.4: the last 4 steps decay, at progress 1/4 .. 1
WSD = {"linear": [5e-4, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 7.75e-4, 5.5e-4, 3.25e-4, 1e-4],
       "sqrt": [5e-4, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 5.5e-4, 1e-4 + 9e-4 * (1 - 0.5 ** 0.5),
                1e-4 + 9e-4 * (1 - 0.75 ** 0.5), 1e-4],
       "cosine": [5e-4, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 1e-4 + 9e-4 * (2 + 2 ** 0.5) / 4, 5.5e-4,
                  1e-4 + 9e-4 * (2 - 2 ** 0.5) / 4, 1e-4]}


@pytest.mark.parametrize("shape", WSD)
@pytest.mark.parametrize("stage", [0, 1])
def test_wsd_warms_up_holds_the_rate_and_decays_to_min_lr_at_the_last_step(shape, stage):
    """optim.schedule=wsd, torch's LambdaLR on the optimizer DeepSpeed builds: each step's rate, read as train.py
    logs it, under ZeRO-0 and ZeRO-1 (another optimizer wrapper)."""
    cfg = run_config(optim={"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 2, "schedule": "wsd", "decay_fraction": 0.4,
                            "decay_shape": shape}, train={"max_steps": 10})
    engine = engine_for(cfg, {"zero_optimization": {"stage": stage}})
    assert "scheduler" not in optimizer_and_schedule(cfg, {})
    assert train_steps(engine, 10) == pytest.approx(WSD[shape], rel=1e-12, abs=0)


@pytest.mark.parametrize("warmup,fraction,steps", [(5, 0.6, 10), (11, 0.1, 10)])
def test_a_wsd_warmup_and_decay_that_overlap_are_refused(warmup, fraction, steps):
    cfg = run_config(optim={"warmup_steps": warmup, "schedule": "wsd", "decay_fraction": fraction},
                     train={"max_steps": steps})
    decay = round(fraction * steps)
    with pytest.raises(ConfigError, match=re.escape(
            f"optim.warmup_steps={warmup} and the WSD decay's {decay} steps (optim.decay_fraction={fraction:g} of "
            f"train.max_steps={steps}) overlap; fix: lower optim.warmup_steps or optim.decay_fraction, or raise "
            f"train.max_steps")):
        check_schedule(cfg)
    check_schedule(run_config(optim={"warmup_steps": steps - decay, "schedule": "wsd", "decay_fraction": fraction},
                              train={"max_steps": steps}))


def named_groups(engine, model) -> dict[float, set]:
    """Weight decay -> names of the parameters DeepSpeed's optimizer steps with it. ZeRO-3 steps flat
    fp32 sub-groups, each recording the parameters it holds and the optimizer group it belongs to."""
    names = {id(p): n for n, p in model.named_parameters()}
    groups = {}
    if hasattr(engine.optimizer, "sub_group_to_group_id"):
        for sub_group, params in enumerate(engine.optimizer.fp16_groups):
            group = engine.optimizer.optimizer.param_groups[engine.optimizer.sub_group_to_group_id[sub_group]]
            groups.setdefault(group["weight_decay"], set()).update(names[id(p)] for p in params)
    else:
        for group in engine.optimizer.param_groups:
            groups.setdefault(group["weight_decay"], set()).update(names[id(p)] for p in group["params"])
    return groups


MATRICES = {"tied_modules.embed.weight", "1.weight"} | {f"{i}.{m}.weight" for i in (2, 3)
                                                       for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")}


@pytest.mark.parametrize("stage", [0, 3])
def test_weight_decay_only_on_matrices(stage):
    """By name: embeddings and linear weights decay; biases and LayerNorm gains do not. Under ZeRO-3 the
    model is built partitioned (zero.Init, as train.py does), so each parameter is a flat shard."""
    ds = {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    cfg = run_config(optim={"weight_decay": 0.1}, train={"max_steps": 3})
    if stage == 3:
        with deepspeed.zero.Init(config_dict_or_path={**ds, "train_batch_size": 2}):
            model = build_model(SMALL_GPT, seed=1)
        assert all(p.dim() == 1 for p in model.parameters())  # the shapes the split must see through
    else:
        model = build_model(SMALL_GPT, seed=1)
    everything = {n for n, _ in model.named_parameters()}
    engine = engine_for(cfg, ds, model)
    assert named_groups(engine, model) == {0.1: MATRICES, 0.0: everything - MATRICES}


@pytest.mark.parametrize("offload", [False, True])
def test_optimizer_class(offload):
    """torch's fused AdamW without offload; DeepSpeedCPUAdam (its C++ op) when ZeRO offloads the optimizer."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    zero = {"stage": 2, **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
    engine = engine_for(run_config(train={"max_steps": 2}), {"zero_optimization": zero})
    optimizer = engine.optimizer.optimizer  # inside DeepSpeed's ZeRO wrapper
    if offload:
        assert type(optimizer) is DeepSpeedCPUAdam and optimizer.ds_opt_adam is not None
    else:
        assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["fused"] is True
    assert train_steps(engine, 2)[1] > 0  # and it steps


@pytest.mark.parametrize("name", ["zero0.json", "zero1.json", "zero2.json", "zero3.json"])
def test_shipped_configs_reduce_bf16_gradients_in_fp32(name):
    """Gradients all-reduced (or reduce-scattered) in fp32 in every shipped bf16 config, as train.py hands it to
    DeepSpeed (the effective ds_config of training/startup.py, not the file); under ZeRO-1 also accumulated in
    fp32, through DeepSpeed's bf16 optimizer (flat fp32 gradients and master weights)."""
    cfg = run_config(train={"max_steps": 2})
    loaded = load_ds_config(os.path.join(REPO, "ds_configs", name),
                            ["bf16.enabled=true", "train_micro_batch_size_per_gpu=2", "gradient_accumulation_steps=1"])
    ds = effective_ds_config(loaded, cfg, 1, torch.device("cpu")).ds
    assert ds["bf16"]["enabled"] is True and ds["communication_data_type"] == "fp32"
    engine = engine_for(cfg, ds)
    assert engine.bfloat16_enabled() and engine.communication_data_type == torch.float32
    if name == "zero1.json":
        assert engine.get_data_types() == (torch.bfloat16, torch.float32)
        assert type(engine.optimizer).__name__ == "BF16_Optimizer"
    assert train_steps(engine, 2)[1] > 0


@pytest.mark.parametrize("bf16", [True, False])
def test_zero3_partitions_and_computes_in_the_configs_precision(bf16):
    """ZeRO-3 partitions each layer as it is built (training/parallelize.py, zero.Init(module=)), which keeps the
    weights' type, and DeepSpeed's engine casts no partitioned weight: under a bf16 ds_config the partitions are
    bf16, and so are the logits, which equal ZeRO-0's within bf16's rounding; under fp32 both stay fp32."""
    cfg = run_config(model=dataclasses.asdict(SMALL_GPT), train={"max_steps": 2})
    dtype = torch.bfloat16 if bf16 else torch.float32
    idx = torch.randint(0, 65, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = {}
    with mock.patch.object(F, "linear", F.linear):  # zero.Init swaps in its own for the rest of the process
        for stage in (0, 3):
            loaded = load_ds_config(os.path.join(REPO, "ds_configs", f"zero{stage}.json"),
                                    [f"bf16.enabled={str(bf16).lower()}", "train_micro_batch_size_per_gpu=2",
                                     "gradient_accumulation_steps=1"])
            settings = effective_ds_config(loaded, cfg, 1, torch.device("cpu"))
            model, _ = parallelize(cfg, settings.pipe, settings.ds)
            engine = training_engine(model, cfg, settings.ds)
            if stage == 3:
                assert {p.ds_tensor.dtype for p in model.parameters()} == {dtype}
            with torch.no_grad():
                logits[stage] = engine(idx)
            engine.destroy()
    assert logits[3].dtype == logits[0].dtype == dtype
    torch.testing.assert_close(logits[3].float(), logits[0].float(), rtol=0.02 if bf16 else 1e-5,
                               atol=0.02 if bf16 else 1e-5)


@pytest.mark.parametrize("stage, bf16", [(0, False), (0, True), (1, True)])
def test_one_rank_skips_the_all_reduce_and_trains_the_same_bits(stage, bf16):
    """adjust_engine switches off DeepSpeed's all-reduce over a lone data-parallel rank without ZeRO, or under its
    bf16 optimizer (ZeRO-1 in bf16): not called once, and the weights after three clipped steps are bit for bit
    those of the engine that reduces (with the rest of adjust_engine: fp32 clipping, the bf16 step on the device).
    ZeRO-1's reduction in fp32 (and ZeRO-2's) copies the gradients into its partition: it keeps it."""
    cfg = run_config()
    ds = {"zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16}, "gradient_clipping": 0.5,
          "communication_data_type": "fp32", **({"data_types": {"grad_accum_dtype": "fp32"}} if stage else {})}
    weights = {}
    for adjusted in (False, True):
        engine = engine_for(cfg, ds)
        if adjusted:
            adjust_engine(engine)
        else:  # the rest of adjust_engine that changes the arithmetic
            keep_fp32_grad_norm(engine)
            no_step_before_the_first(engine)
        with mock.patch.object(engine, "allreduce_gradients", wraps=engine.allreduce_gradients) as reduce:
            train_steps(engine, 3)
        assert reduce.call_count == (0 if adjusted else 3)
        weights[adjusted] = [p.detach().clone() for p in engine.module.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(weights[False], weights[True]))
    assert not all(torch.equal(a, b) for a, b in zip(weights[True], build_model(SMALL_GPT, seed=1).parameters()))
    for kept in ({**ds, "zero_optimization": {"stage": 1}, "bf16": {"enabled": False}},
                 {**ds, "zero_optimization": {"stage": 2}}):
        engine = engine_for(cfg, kept)
        no_all_reduce_over_one_rank(engine)
        assert engine.enable_backward_allreduce


def test_the_bf16_optimizers_step_on_the_device_clips_and_skips_as_deepspeeds():
    """ZeRO-1 in bf16 (DeepSpeed's BF16_Optimizer, the GPU default): adjust_engine's step never asks the host
    whether the norm is finite or whether to clip, and trains the bits of DeepSpeed's own step, norms included,
    clipping (0.05) or not (100); a NaN in one gradient skips the update on the device, weights and AdamW's
    state as they were, its flag the divergence guard's, and the next step trains."""
    from deepspeed.runtime import bf16_optimizer

    from training.divergence import skip_nonfinite_updates

    cfg = run_config()
    for clip in (0.05, 100.0):
        ds = {"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}, "gradient_clipping": clip,
              "data_types": {"grad_accum_dtype": "fp32"}}
        runs = {}
        for adjusted in (False, True):
            engine = engine_for(cfg, ds)
            if adjusted:
                adjust_engine(engine)
            with mock.patch.object(bf16_optimizer, "is_invalid_grad_norm",
                                   wraps=bf16_optimizer.is_invalid_grad_norm) as asked:
                norms = []
                for step in range(3):
                    train_steps(engine, 1)
                    norms.append(float(engine.get_global_grad_norm()))
            assert asked.call_count == (0 if adjusted else 3)
            runs[adjusted] = engine, norms, [p.detach().clone() for p in engine.module.parameters()]
        assert runs[True][1] == runs[False][1] and (min(runs[True][1]) > clip) == (clip < 1), (clip, runs[True][1])
        assert all(torch.equal(a, b) for a, b in zip(runs[False][2], runs[True][2]))

    engine, _, weights = runs[True]
    adam = engine.optimizer.optimizer
    state = [v.clone() for s in adam.state.values() for v in s.values()]
    assert skip_nonfinite_updates(engine) is engine.optimizer.found_inf
    idx = torch.randint(0, 65, (2, 17), generator=torch.Generator().manual_seed(9))
    engine.backward(lm_loss(engine(idx[:, :-1]), idx[:, 1:]))
    engine.optimizer.fp32_groups_gradients_flat[0][0] = float("nan")  # the fp32 gradients, made in backward
    engine.step()
    assert engine.optimizer.found_inf.item() == 1.0
    assert all(torch.equal(a, b) for a, b in zip(weights, engine.module.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(state, [v for s in adam.state.values() for v in s.values()]))
    train_steps(engine, 1)
    assert engine.optimizer.found_inf.item() == 0.0
    assert not all(torch.equal(a, b) for a, b in zip(weights, engine.module.parameters()))


def test_bf16_without_zero_skips_a_non_finite_step_without_the_overflow_scan():
    """adjust_engine drops the bf16 optimizer's scan of every gradient for inf and NaN: the weights after three
    steps are bit for bit the scanning engine's, and a NaN in one gradient still skips the step (the norm is not
    finite), leaving the weights as they were."""
    cfg, ds = run_config(), {"zero_optimization": {"stage": 0}, "bf16": {"enabled": True}, "gradient_clipping": 1.0}
    engines = {scan: engine_for(cfg, ds) for scan in (True, False)}
    for scan, engine in engines.items():
        if scan:
            keep_fp32_grad_norm(engine)
            no_step_before_the_first(engine)
        else:
            adjust_engine(engine)
        with mock.patch.object(engine.optimizer.overflow_checker, "has_overflow",
                               wraps=engine.optimizer.overflow_checker.has_overflow) as scanned:
            train_steps(engine, 3)
        assert scanned.call_count == (3 if scan else 0)
    weights = {scan: [p.detach().clone() for p in e.module.parameters()] for scan, e in engines.items()}
    assert all(torch.equal(a, b) for a, b in zip(weights[True], weights[False]))

    engine = engines[False]
    idx = torch.randint(0, 65, (2, 17), generator=torch.Generator().manual_seed(9))
    engine.backward(lm_loss(engine(idx[:, :-1]), idx[:, 1:]))
    next(p for p in engine.module.parameters() if p.grad is not None).grad.view(-1)[0] = float("nan")
    engine.step()
    assert engine.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(weights[False], engine.module.parameters()))


def test_bf16_without_zero_trains_zero1s_weights_from_the_first_step():
    """DeepSpeed's ZeRO-0 optimizer in bf16 steps once on zero gradients as it is built (its AdamW then decays the
    masters and counts a step); after adjust_engine it holds no state, its masters are the bf16 weights, and three
    unclipped steps train ZeRO-1's bf16 weights bit for bit (the same fp32 masters, gradients and fused AdamW)."""
    cfg = run_config(optim={"weight_decay": 0.1})
    weights = {}
    for stage in (0, 1):
        ds = {"zero_optimization": {"stage": stage}, "bf16": {"enabled": True}, "gradient_clipping": 100.0,
              **({"data_types": {"grad_accum_dtype": "fp32"}} if stage else {})}
        engine = engine_for(cfg, ds)
        adjust_engine(engine)
        if stage == 0:
            optimizer = engine.optimizer
            assert not optimizer.optimizer.state
            assert all(torch.equal(master, weight.float()) for masters, lps in
                       zip(optimizer.fp32_groups, optimizer.fp16_groups) for master, weight in zip(masters, lps))
        train_steps(engine, 3)
        weights[stage] = [p.detach().clone() for p in engine.module.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(weights[0], weights[1]))


def test_activation_checkpointing_recomputes_every_block_with_equal_gradients():
    """checkpoint_interval=1: each block runs its forward twice (once more in backward), the embeddings
    and the head once; losses and gradients equal those without checkpointing, dropout included (DeepSpeed
    replays the RNG state in the recomputation)."""
    cfg = ModelConfig(n_layer=3, n_head=2, n_embd=32, block_size=16, vocab_size=65, dropout=0.1)
    idx = torch.randint(0, 65, (2, 17), generator=torch.Generator().manual_seed(0))
    results = {}
    for interval in (0, 1):
        model = build_model(cfg, seed=1, checkpoint_interval=interval)
        calls = {"blocks": 0, "others": 0}
        for module in model.modules():
            if module is not model and module in [layer for layer, _ in model._calls]:
                kind = "blocks" if isinstance(module, Block) else "others"
                module.register_forward_hook(lambda *_, kind=kind: calls.__setitem__(kind, calls[kind] + 1))
        torch.manual_seed(5)
        loss = lm_loss(model(idx[:, :-1]), idx[:, 1:])
        forward_calls = dict(calls)
        loss.backward()
        results[interval] = loss.item(), forward_calls, dict(calls), {n: p.grad for n, p in model.named_parameters()}
    (loss0, fwd0, all0, grads0), (loss1, fwd1, all1, grads1) = results[0], results[1]
    assert fwd0 == fwd1 == {"blocks": 3, "others": 3}  # embedding, positions, final LayerNorm (the head is a fn)
    assert all0 == {"blocks": 3, "others": 3}
    assert all1 == {"blocks": 6, "others": 3}  # every block recomputed in backward, nothing else
    assert loss1 == loss0
    for name, grad in grads0.items():
        torch.testing.assert_close(grads1[name], grad, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("dtype, compiled", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
def test_the_training_loss_and_its_gradient_are_cross_entropys(dtype, compiled):
    """The training loss, its gradient made in the forward pass a chunk of rows at a time, is F.cross_entropy of
    the fp32 logits and has its gradient: -100 targets add nothing, the mean is over `divisor`, and an upstream
    gradient other than 1 (DeepSpeed's division by gradient accumulation steps) scales it. Within fp32's rounding,
    and in bf16 within one unit of the last place of each entry; so too train.compile's, inductor's kernels."""
    logits = (3 * torch.randn(4, 10, 70, generator=torch.Generator().manual_seed(0))).to(dtype)
    targets = torch.randint(0, 70, (4, 10), generator=torch.Generator().manual_seed(1))
    targets[1, 3:] = -100  # a padded row
    reference = logits.clone().requires_grad_(True)
    expected = F.cross_entropy(reference.float().view(-1, 70), targets.view(-1), reduction="sum") / 37
    (expected / 3).backward()
    for chunk_rows in (7, 40):  # 40 rows: one chunk
        x = logits.clone().requires_grad_(True)
        loss = lm_loss(x, targets, chunk_rows=chunk_rows, divisor=37, compiled=compiled)
        (loss / 3).backward()
        assert loss.dtype == torch.float32 and x.grad.dtype == dtype
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
        assert torch.equal(x.grad[1, 3:], torch.zeros_like(x.grad[1, 3:]))
        ulp = 1e-6 if dtype == torch.float32 else 2 ** -7
        torch.testing.assert_close(x.grad.float(), reference.grad.float(), rtol=ulp, atol=1e-9)


def test_the_training_loss_without_gradients_is_cross_entropy_itself():
    logits = torch.randn(40, 70, generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, 70, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(lm_loss(logits, targets), F.cross_entropy(logits, targets))


# Checkpoint files written by a thread while training goes on (training/checkpoints/background_save.py): the bytes of a
# synchronous save, the state of the step saved though the engine steps on during the write, and a checkpoint
# that counts only once its files are down.
