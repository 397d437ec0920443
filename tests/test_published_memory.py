"""The memory plan (training/memory_plan.py) against Megatron-LM's theoretical memory formula
(megatron/training/theoretical_memory_usage.py; Korthikanti et al. 2022), for the same settings: GPT-3 175B's shape,
16-bit activations, no recomputation, with and without Megatron's sequence parallelism. The activations a layer keeps
are Megatron's to the byte; the model states per parameter differ by what DeepSpeed keeps that Megatron does not, and
each difference is named here."""
import pytest

from model.config import ModelConfig
from training.memory_plan import layer_activation_bytes, plan

# GPT-3 175B (Brown et al. 2020): 96 layers of 12,288, 96 heads, context 2,048; dropout, as Megatron's count has
GPT3 = ModelConfig(arch="gpt", n_layer=96, n_head=96, n_embd=12288, block_size=2048, vocab_size=50257, dropout=0.1)


def megatron_activations(s: int, b: int, h: int, tp: int, sequence_parallel: bool) -> float:
    """A layer's activation bytes without recomputation, flash attention (no s^2 term): s b h (10 + 24 / tp), and
    with Megatron's sequence parallelism s b h 34 / tp."""
    return s * b * h * (34 / tp if sequence_parallel else 10 + 24 / tp)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["", "sequence_parallel"])
@pytest.mark.parametrize("tp", [1, 2, 8])
def test_a_layers_activations_are_megatrons(tp, sequence_parallel):
    micro = 4
    ours = layer_activation_bytes(GPT3, tp, sequence_split=sequence_parallel) * micro * GPT3.block_size
    assert ours == megatron_activations(GPT3.block_size, micro, GPT3.n_embd, tp, sequence_parallel)


BF16 = {"bf16": {"enabled": True}}
FP32_ACCUMULATION = {**BF16, "data_types": {"grad_accum_dtype": "fp32"}}
# (ZeRO stage, the ds_config's precision, dp, Megatron's bytes a parameter, what DeepSpeed keeps otherwise)
STATES = [
    # Megatron without its distributed optimizer: 18 (16-bit weight 2, fp32 gradient 4, fp32 master 4, Adam 8).
    # DeepSpeed's FP16_Optimizer keeps the 16-bit gradient too, until the step has made its fp32 copy.
    (0, BF16, 8, 18, 2),
    # Megatron's distributed optimizer: 6 + 12 / dp (the fp32 gradient whole; master and Adam sharded). ZeRO-1 in
    # bf16 with fp32 accumulation is DeepSpeed's BF16_Optimizer, the same layout; it keeps each 16-bit gradient too
    # until the backward pass has added it to the fp32 one.
    (1, FP32_ACCUMULATION, 8, 6 + 12 / 8, 2),
    # ZeRO-1 otherwise (fp16): the 16-bit gradient whole, the fp32 one sharded with master and Adam.
    (1, {"fp16": {"enabled": True}}, 8, 6 + 12 / 8, 2 - 4 + 4 / 8),
]


@pytest.mark.parametrize("zero,precision,dp,megatron,deepspeed_otherwise", STATES,
                         ids=["zero0", "zero1_bf16_dp8", "zero1_fp16_dp8"])
def test_model_states_are_megatrons_and_what_deepspeed_keeps_otherwise(zero, precision, dp, megatron,
                                                                       deepspeed_otherwise):
    p = plan(GPT3, {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": zero}, **precision}, dp)
    assert p["states"] + p["gradients"] == pytest.approx((megatron + deepspeed_otherwise) * p["params_per_gpu"])
