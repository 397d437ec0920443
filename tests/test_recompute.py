"""Selective recomputation (model/recompute.py, ds_config pipeline.recompute): the same losses and gradients as no
checkpointing, no matmul run twice, the bytes the memory plan counts kept, and the settings it cannot run with
refused at start. Under tensor parallelism, ZeRO-2 and 3 and in a pipeline: tests/test_tensor_parallel.py's runs."""
import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.live_tensors import LiveTensors
from common.checks import ConfigError
from model import build_model
from model.config import ModelConfig
from model.llama import LlamaBlock
from model.recompute import recompute_selectively
from model.tensor_parallel import SINGLE, TensorParallel
from training import memory_plan
from training.config import RunConfig
from training.startup import check_recompute
from training.steps import lm_loss
from training.topology import pipeline_settings

SHAPES = {"gpt": ModelConfig(n_layer=3, n_head=4, n_embd=64, block_size=32, vocab_size=65),
          "llama": ModelConfig(arch="llama", n_layer=3, n_head=4, n_kv_head=2, n_embd=64, block_size=32,
                               vocab_size=65),
          "encoder": ModelConfig(arch="encoder", n_layer=3, n_head=4, n_embd=64, block_size=32, vocab_size=65),
          # Qwen3's attention: heads wider than n_embd / n_head, per-head norms (recomputed), q/k/v biases
          "qwen": ModelConfig(arch="llama", n_layer=3, n_head=4, n_kv_head=2, n_embd=64, head_dim=32, qk_norm=True,
                              qkv_bias=True, block_size=32, vocab_size=65)}
MATMULS = (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm)
RECOMPUTE = {"none": (0, "full"), "full": (1, "full"), "selective": (1, "selective")}  # (interval, recompute)


class MatmulCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func.overloadpacket in MATMULS
        return func(*args, **(kwargs or {}))


def step(cfg: ModelConfig, mode: str, tp: TensorParallel = SINGLE) -> tuple[float, dict, int]:
    """One forward and backward pass: the loss, the gradients, and how many matmuls ran."""
    interval, recompute = RECOMPUTE[mode]
    model = build_model(cfg, seed=1, checkpoint_interval=interval, recompute=recompute, tp=tp)
    idx = torch.randint(0, 65, (2, cfg.block_size + 1), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(5)  # the dropout masks
    with MatmulCount() as count:
        loss = lm_loss(model(idx[:, :-1]), idx[:, 1:], tp=tp)
        loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}, count.calls


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_selective_recomputation_trains_the_same_bits_and_runs_no_matmul_twice(arch):
    """With dropout (the recomputed masks are the forward's), in fp32: the loss and every gradient equal to the bit
    those of no checkpointing; full recomputation runs each block's forward matmuls again, selective none."""
    cfg = dataclasses.replace(SHAPES[arch], dropout=0.1)
    (loss, grads, matmuls), (full_loss, _, full_matmuls), (selective_loss, selective_grads, selective_matmuls) = (
        step(cfg, mode) for mode in ("none", "full", "selective"))
    assert selective_loss == full_loss == loss
    assert all(torch.equal(selective_grads[name], grad) for name, grad in grads.items())
    assert selective_matmuls == matmuls < full_matmuls


def test_under_tensor_parallelism_the_row_parallel_projections_run_again():
    """The row-parallel maps' outputs are partial sums of the whole width, not kept: the attention's projection runs
    again, the MLP's too unless torch's recomputation stops before it (no backward in the block needs what it makes;
    after a ZeRO-3 engine in the same process, which swaps in its own linear function, it does not stop there); no
    other matmul (the shapes of tensor rank 0 of 2, with no group: the sums are left out)."""
    cfg, half = SHAPES["llama"], TensorParallel(2, 0, None)
    matmuls = {mode: step(cfg, mode, half)[2] for mode in RECOMPUTE}
    assert matmuls["none"] + cfg.n_layer <= matmuls["selective"] <= matmuls["none"] + 2 * cfg.n_layer
    assert matmuls["selective"] < matmuls["full"]


def kept_per_block(cfg: ModelConfig, mode: str, tp: TensorParallel = SINGLE) -> float:
    """Bytes per token that one more block keeps from the forward pass to the backward pass (its output, the next
    block's input, among them): the storages live after the forward pass, but the weights', at 3 and at 2 blocks."""
    kept = []
    for n_layer in (2, 3):
        interval, recompute = RECOMPUTE[mode]
        model = build_model(dataclasses.replace(cfg, n_layer=n_layer), seed=1, checkpoint_interval=interval,
                            recompute=recompute, tp=tp).to(torch.bfloat16)
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        with LiveTensors() as live:
            out = model(torch.zeros(2, cfg.block_size, dtype=torch.long))
            kept.append(live.current - sum(live.bytes_of(ptr) for ptr in weights) - out.untyped_storage().nbytes())
    return (kept[1] - kept[0]) / (2 * cfg.block_size)


@pytest.mark.parametrize("arch,tp_size", [("gpt", 1), ("llama", 1), ("encoder", 1), ("qwen", 1), ("gpt", 2),
                                          ("llama", 2), ("qwen", 2)])
def test_a_selectively_recomputed_block_keeps_what_the_plan_counts(arch, tp_size):
    """Beside its input, its matmuls' and attention's outputs (and the attention's log-sum-exp), at tp 2 those of
    tensor rank 0 but the row-parallel maps': in bf16 on the CPU, the plan's count to the byte; at most 3/4 of what
    the block keeps unchecked."""
    cfg, tp = SHAPES[arch], TensorParallel(tp_size, 0, None)
    selective = kept_per_block(cfg, "selective", tp) - kept_per_block(cfg, "full", tp)
    assert selective == memory_plan.selective_layer_bytes(cfg, tp_size)
    assert selective < 0.75 * memory_plan.layer_activation_bytes(cfg, tp_size)


@pytest.mark.parametrize("arch,tp_size", [("gpt", 1), ("llama", 1), ("gpt", 2), ("llama", 2)])
def test_adapters_keep_what_the_plan_counts(arch, tp_size):
    """LoRA on every map of a block, in bf16 on the CPU: under selective recomputation the adapters' matmul outputs
    but a row-split map's, to the byte; unchecked, the GPT's r-wide x A^T, to the byte (a Llama keeps less than the
    model it adapts: its frozen norms' weights want no gradient), and under lora_dropout at most the plan's bound,
    less no more than each map's input (2 bytes an element) under it; to the byte on the attention's output map,
    whose input the attention's backward keeps anyway (at tp 2 a row-split map's slice of the whole mask)."""
    plain, tp = SHAPES[arch], TensorParallel(tp_size, 0, None)
    lora, dropped = (dataclasses.replace(plain, lora_rank=4, lora_dropout=p) for p in (0.0, 0.5))
    selective = kept_per_block(lora, "selective", tp) - kept_per_block(plain, "selective", tp)
    assert selective == memory_plan.adapter_bytes(lora, tp_size, "cpu", selective=True) > 0
    if arch == "gpt":
        assert kept_per_block(lora, "none", tp) - kept_per_block(plain, "none", tp) == \
            memory_plan.adapter_bytes(lora, tp_size, "cpu") == 2 * 4 * 4
    masks = kept_per_block(dropped, "none", tp) - kept_per_block(lora, "none", tp)
    planned = memory_plan.adapter_bytes(dropped, tp_size, "cpu") - memory_plan.adapter_bytes(lora, tp_size, "cpu")
    inputs = sum(width for _, width, _ in memory_plan.adapted_maps(lora, tp_size))
    assert planned - 2 * inputs <= masks <= planned, (masks, planned, inputs)
    output_map = {"lora_targets": "attn.proj" if arch == "gpt" else "attn.o"}
    lora, dropped = (dataclasses.replace(plain, lora_rank=4, lora_dropout=p, **output_map) for p in (0.0, 0.5))
    masks = kept_per_block(dropped, "none", tp) - kept_per_block(lora, "none", tp)
    assert masks == memory_plan.adapter_bytes(dropped, tp_size, "cpu") - memory_plan.adapter_bytes(lora, tp_size, "cpu")


def test_the_plan_counts_selective_recomputation_between_none_and_full():
    """A ZeRO-1 Llama at micro-batch 2: checkpointed blocks keep their inputs (full) and their kept outputs
    (selective); the block the backward pass recomputes holds what its recomputation makes."""
    cfg, tokens = SHAPES["llama"], 2 * 32
    ds = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}}
    planned = {mode: memory_plan.plan(cfg, {**ds, "pipeline": {"activation_checkpoint_interval": interval,
                                                               "recompute": recompute}}, 1)["activations"]
               for mode, (interval, recompute) in RECOMPUTE.items()}
    layer, kept, block_input = (tokens * memory_plan.layer_activation_bytes(cfg),
                                tokens * memory_plan.selective_layer_bytes(cfg), tokens * 2 * cfg.n_embd)
    assert planned["none"] - planned["full"] == 3 * layer - (3 * block_input + layer)
    assert planned["selective"] - planned["full"] == 3 * kept - kept


@pytest.mark.parametrize("section, run, message", [
    ({"recompute": "some"}, {}, "pipeline.recompute='some': must be one of full, selective (what a checkpointed block "
                                "runs again in the backward pass); fix: set ds.pipeline.recompute to one"),
    ({"recompute": "selective"}, {}, "pipeline.recompute=selective recomputes checkpointed blocks, and none is: fix: "
                                     "set ds.pipeline.activation_checkpoint_interval=1 (every block) beside it"),
    ({"recompute": "selective", "activation_checkpoint_interval": 1}, {"mlp_tiles": 2},
     "pipeline.recompute=selective would keep the MLP's matmul outputs that train.mlp_tiles=2 exists to drop: set "
     "train.mlp_tiles=1, or ds.pipeline.recompute=full"),
    ({"recompute": "selective", "activation_checkpoint_interval": 1}, {"linear": True},
     "pipeline.recompute=selective cannot keep the outputs of ZeRO-3's memory-efficient linear, which adds the bias "
     "to them in place: leave zero_optimization.memory_efficient_linear out (selective recomputation turns it off), "
     "or set ds.pipeline.recompute=full"),
])
def test_what_selective_recomputation_cannot_run_with_is_refused(section, run, message):
    """run: train.* settings, and "linear": the ds_config's zero_optimization.memory_efficient_linear (ZeRO-3)."""
    cfg = RunConfig()
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **{k: v for k, v in run.items()
                                                                          if k != "linear"}))
    ds = {"pipeline": section, "zero_optimization": {"stage": 3, "memory_efficient_linear": run.get("linear")}}
    with pytest.raises(ConfigError) as refused:
        check_recompute(pipeline_settings(ds), cfg, ds)
    assert str(refused.value) == message


def test_a_compiled_block_recomputes_selectively_inside_its_graph():
    """train.compile with selective recomputation: the checkpoint inside the block's compiled graph (torch's own
    cannot wrap a compiled block from outside). In bf16 its output and gradients are eager's within bf16's rounding,
    and it keeps its input and what the plan counts for a compiled block recomputed selectively, to the byte, and
    the RoPE tables (a window's, whatever the batch)."""
    cfg = dataclasses.replace(SHAPES["llama"], n_layer=1)
    x = torch.randn(2, cfg.block_size, cfg.n_embd, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    x.requires_grad_(True)
    eager = LlamaBlock(cfg).to(torch.bfloat16)
    compiled = LlamaBlock(cfg).to(torch.bfloat16)
    compiled.load_state_dict(eager.state_dict())
    recompute_selectively(compiled)
    compiled.compile()
    saved = {}
    weights = {p.untyped_storage().data_ptr() for p in compiled.parameters()}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = compiled(x)
    tokens, rope = x.shape[0] * x.shape[1], 2 * cfg.block_size * cfg.head_width * 2
    planned = memory_plan.selective_layer_bytes(cfg, compiled=True)
    assert sum(saved.values()) == tokens * (2 * cfg.n_embd + planned) + rope
    assert planned == memory_plan.selective_layer_bytes(cfg) - 2 * cfg.n_embd
    expected = eager(x)
    torch.testing.assert_close(out, expected, rtol=0.02, atol=0.02)
    grads = torch.autograd.grad(out.float().square().sum(), [x, *compiled.parameters()])
    for got, want in zip(grads, torch.autograd.grad(expected.float().square().sum(), [x, *eager.parameters()])):
        torch.testing.assert_close(got, want, rtol=0.02, atol=0.02)


@pytest.mark.parametrize("routing", [{"experts_per_token": 2}, {"experts_per_token": 3},
                                     {"experts_per_token": 2, "router_bias_rate": 0.01},
                                     {"experts_per_token": 1, "n_shared_experts": 1, "capacity_factor": 1.0}],
                         ids=["top2", "top3", "biased", "shared"])
def test_a_mixture_of_experts_recomputed_selectively_trains_the_same_bits(routing):
    """DeepSpeed's gating divides its einsums' outputs in place: the routing runs again rather than keep them (under
    document masking, with dropless, capacity-limited, biased and shared-expert routing)."""
    cfg = ModelConfig(arch="llama", n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=65, n_experts=4,
                      expert_hidden=64, document_masking=True, **routing)
    idx = torch.randint(0, 65, (2, 33), generator=torch.Generator().manual_seed(0))
    positions = (torch.arange(32) % 11).repeat(2, 1)
    results = {}
    for mode in ("none", "selective"):
        interval, recompute = RECOMPUTE[mode]
        model = build_model(cfg, seed=1, checkpoint_interval=interval, recompute=recompute)
        loss = lm_loss(model((idx[:, :-1], positions)), idx[:, 1:])
        loss.backward()
        results[mode] = loss, [p.grad for p in model.parameters()]
    (loss, grads), (selective_loss, selective_grads) = results["none"], results["selective"]
    assert torch.equal(selective_loss, loss)
    assert all(torch.equal(a, b) for a, b in zip(selective_grads, grads) if b is not None)
