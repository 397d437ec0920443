"""The GPT layer list: shapes, causality, the tie, GPT-2 init, exact parameter counts, its GELU compiled, and its
attention under bf16 matmuls."""
import dataclasses
import math
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from common.checks import ConfigError
from model import architecture, build_empty, build_model
from model.config import ModelConfig, model_config
from model.gpt import Block
from model.layers import TokenEmbedding, causal_attention, gelu_tanh, lm_head
from model_checks import SMALL_GPT, assert_causal, count_on_meta, preset
from training.checkpoints.resume import check_compatible


def test_logits_shape_covers_padded_vocab():
    model = build_model(SMALL_GPT)
    logits = model(torch.randint(0, 65, (3, 16)))
    assert SMALL_GPT.padded_vocab_size == 128
    assert logits.shape == (3, 16, 128)


def test_shorter_sequences_than_block_size():
    assert build_model(SMALL_GPT)(torch.randint(0, 65, (2, 5))).shape == (2, 5, 128)


def test_changing_a_token_never_changes_earlier_logits():
    assert_causal(build_model(SMALL_GPT).eval())


def test_head_is_the_token_embedding_tensor():
    model = build_model(SMALL_GPT)
    embeddings = [m for m in model.modules() if isinstance(m, TokenEmbedding)]
    assert len(embeddings) == 1  # one module, used twice: the head has no weight of its own
    weight = embeddings[0].weight
    head, head_fn = model._calls[-1]
    assert head is embeddings[0] and head_fn is lm_head
    with torch.no_grad():
        weight[3].fill_(0.5)
    hidden = torch.randn(1, 1, 32)
    torch.testing.assert_close(lm_head(head, hidden)[0, 0, 3], hidden.sum() * 0.5)
    # gradients from the embedding and the head land in the same tensor
    model(torch.randint(0, 65, (2, 8))).sum().backward()
    assert weight.grad is not None and weight.grad[64:].abs().sum() > 0  # padded rows only see the head


def test_parameter_names_follow_pipeline_module():
    names = [n for n, _ in build_model(SMALL_GPT).named_parameters()]
    assert names[:3] == ["tied_modules.embed.weight", "1.weight", "2.ln_1.weight"]
    assert "2.attn.qkv.weight" in names and names[-2:] == ["4.weight", "4.bias"]  # final LayerNorm


def test_gpt2_init_scales_residual_projections():
    torch.manual_seed(0)
    block = Block(n_embd=768, n_head=12, mlp_hidden=3072, n_layer=12, dropout=0.0, bias=True)
    assert block.attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.02)
    assert block.attn.proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(24), rel=0.02)
    assert block.mlp.proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(24), rel=0.02)
    assert block.attn.qkv.bias.abs().sum() == 0


def test_same_seed_same_weights_and_different_seed_differs():
    a, b, c = build_model(SMALL_GPT, seed=1), build_model(SMALL_GPT, seed=1), build_model(SMALL_GPT, seed=2)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(next(a.parameters()), next(c.parameters()))


# Unpadded counts are those of OpenAI's GPT-2 checkpoints; padding 50,257 -> 50,304 adds 47 x n_embd.
@pytest.mark.parametrize("name,unpadded,padded", [
    ("gpt2_124m", 124_439_808, 124_475_904),
    ("gpt2_350m", 354_823_168, 354_871_296),
    ("gpt2_774m", 774_030_080, 774_090_240),
    ("gpt2_1.5b", 1_557_611_200, 1_557_686_400),
])
def test_gpt2_preset_parameter_counts(name, unpadded, padded):
    cfg = preset(name)
    assert cfg.padded_vocab_size == 50_304
    assert count_on_meta(cfg) == padded
    cfg.vocab_multiple = 1
    assert count_on_meta(cfg) == unpadded


@pytest.mark.parametrize("name,expected", [("quickstart", 817_920), ("baby_gpt", 10_795_008),
                                           ("encoder_tiny", 117_376)])
def test_character_preset_parameter_counts(name, expected):
    cfg = preset(name)
    cfg.vocab_size = 65  # tinyshakespeare's characters, padded to 128
    assert count_on_meta(cfg) == expected


def test_encoder_is_causal():
    """The tutorial's encoder passed no mask; ours must never see the tokens it predicts."""
    model = build_model(ModelConfig(arch="encoder", n_layer=2, n_head=2, n_embd=32, ffn_hidden=64, block_size=16,
                                    vocab_size=65)).eval()
    idx = torch.randint(0, 65, (1, 16))
    for t in (0, 9, 15):
        changed = idx.clone()
        changed[0, t] = (idx[0, t] + 1) % 65
        before, after = model(idx), model(changed)
        torch.testing.assert_close(before[:, :t], after[:, :t], rtol=0, atol=1e-6)
        assert not torch.allclose(before[:, t], after[:, t])


def test_encoder_1b_parameter_count():
    cfg = preset("encoder_1b")
    assert (cfg.n_layer, cfg.n_embd, architecture(cfg).mlp_hidden(cfg), cfg.n_head) == (8, 4096, 4096, 16)
    count = count_on_meta(cfg)
    assert count == 1_217_774_720 and count >= 1_000_000_000
    # 8 x (4d^2 + 2 d ffn + biases and norms) + embedding + decoder over 50,304 padded rows
    d = 4096
    assert count == 8 * (4 * d * d + 4 * d + 2 * d * d + d + d + 4 * d) + 50_304 * d + 50_304 * d + 50_304


def test_encoder_layer_is_nn_transformer_encoder_layer_written_out():
    """The explicit layer (which tensor parallelism can split) has nn.TransformerEncoderLayer's parameter names
    and, for a seed, its initialization; with its weights the library layer computes the same causal outputs,
    on its slow path and on the fused no-grad fast path sampling used to take."""
    from model.encoder import CausalEncoderLayer

    torch.manual_seed(7)
    ours = CausalEncoderLayer(32, 2, 64, dropout=0.0)
    torch.manual_seed(7)
    library = torch.nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
    assert ours.state_dict().keys() == library.state_dict().keys()
    assert all(torch.equal(ours.state_dict()[k], v) for k, v in library.state_dict().items())
    x = torch.randn(2, 16, 32)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(16)
    torch.testing.assert_close(ours(x), library(x, src_mask=mask, is_causal=True), rtol=1e-5, atol=1e-5)
    fused, calls = torch._transformer_encoder_layer_fwd, []

    def counted(*args, **kwargs):
        calls.append(1)
        return fused(*args, **kwargs)

    with torch.no_grad(), mock.patch.object(torch, "_transformer_encoder_layer_fwd", counted):
        fast = library.eval()(x, src_mask=mask, is_causal=True)
    assert len(calls) == 1  # the library took its fast path
    torch.testing.assert_close(ours.eval()(x), fast, rtol=1e-5, atol=1e-5)


def test_mfu_flop_count_is_the_hand_count_for_the_gpt():
    """flops_per_token against a count of the GPT's own matmuls: 6 x (every nn.Linear weight plus the
    tied head, which multiplies by the embedding; not the position table, which is only added) for forward
    and backward, plus the attention scores and weighted values, 2 x 2 x T x d per layer and token
    forward, x 3 with backward (PaLM's 12 x layers x d x T)."""
    from training.metrics import flops_per_token

    for cfg in (SMALL_GPT, preset("quickstart")):
        cfg.vocab_size = 65
        model = build_model(cfg)
        linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        head = model.tied_modules.embed.weight.numel()
        attention = 3 * 2 * 2 * cfg.block_size * cfg.n_embd * cfg.n_layer
        assert flops_per_token(cfg) == 6 * (linear + head) + attention
    # the quickstart by hand: 4 layers x 12 x 128^2, a 128 x 128 head, context 64
    assert flops_per_token(cfg) == 6 * (4 * 12 * 128**2 + 128 * 128) + 12 * 4 * 128 * 64 == 5_210_112


def test_the_compiled_gelu_is_the_tanh_approximation():
    """Compiled, gelu_tanh is written through the sigmoid (inductor's tanh is slow on a CPU): the same function
    and gradient as aten's tanh GELU, to fp32's rounding, over the range where GELU bends and its tails."""
    x = torch.linspace(-12, 12, 4001, dtype=torch.float64).float()
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(0))

    def value_and_grad(fn):
        leaf = x.clone().requires_grad_()
        y = fn(leaf)
        y.backward(upstream)
        return y.detach(), leaf.grad

    compiled = torch.compile(gelu_tanh, backend="inductor", fullgraph=True)
    (y, dy), (ref_y, ref_dy) = value_and_grad(compiled), value_and_grad(lambda t: F.gelu(t, approximate="tanh"))
    torch.testing.assert_close(y, ref_y, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(dy, ref_dy, atol=2e-6, rtol=2e-6)
    assert torch.equal(gelu_tanh(x), F.gelu(x, approximate="tanh"))  # eager: aten's own kernel


@pytest.mark.parametrize("activation,gelu", [("gelu_tanh", lambda h: F.gelu(h, approximate="tanh")),
                                             ("gelu", F.gelu)])
def test_the_gpts_mlp_computes_model_activations_gelu(activation, gelu):
    """model.activation picks the GPT's GELU: GPT-2's tanh approximation by default, the exact one when asked."""
    cfg = ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=65, activation=activation)
    mlp = getattr(build_model(cfg, seed=0), "2").mlp  # the first block
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0))
    assert torch.equal(mlp(x), mlp.proj(gelu(mlp.fc(x))))


def test_a_record_from_before_model_activation_holds_gpt2s_gelu():
    """A checkpoint or export written before model.activation existed has no such setting: its GPT computed GPT-2's
    tanh GELU, so it reads as that, and resuming it under the exact GELU is refused, naming the setting."""
    settings = {k: v for k, v in dataclasses.asdict(ModelConfig(vocab_size=65)).items() if k != "activation"}
    assert model_config(settings, "an old record").activation == "gelu_tanh"
    now = dataclasses.asdict(ModelConfig(vocab_size=65, activation="gelu"))
    with pytest.raises(ConfigError, match="model.activation: gelu_tanh in the checkpoint, gelu now"):
        check_compatible({"config": {"model": settings}, "layout": {}}, now, {})


def test_a_setting_an_architecture_never_reads_is_no_change_of_model():
    """model.activation is the GPT's GELU: a Llama resumes under another, a GPT does not; the GPT reads no rotary
    settings."""
    layout = {"zero_stage": 0, "pp": 1, "tp": 1, "dp": 1, "sp": 1}
    llama = dataclasses.asdict(ModelConfig(arch="llama", vocab_size=65))
    check_compatible({"config": {"model": llama}, "layout": layout}, {**llama, "activation": "gelu", "bias": False},
                     layout)
    gpt = dataclasses.asdict(ModelConfig(vocab_size=65))
    check_compatible({"config": {"model": gpt}, "layout": layout}, {**gpt, "rope_theta": 5e5}, layout)
    with pytest.raises(ConfigError, match="model.rope_theta: 10000.0 in the checkpoint, 500000.0 now"):
        check_compatible({"config": {"model": llama}, "layout": layout}, {**llama, "rope_theta": 5e5}, layout)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_attention_stays_full_fp32_when_the_cpus_matmuls_run_in_bf16(kv_heads):
    """Under float32 matmul precision "medium" (bf16 matmuls on a CPU, what bf16 "auto" gives a narrow model on
    AMX), causal attention computes as at "highest", forward and backward: bit for bit, and to fp32's rounding under
    grouped-query attention; it leaves the precision as it found it."""
    generator = torch.Generator().manual_seed(0)
    # the quickstart's context and head width: at these sizes the flash kernel's own matmuls would go to bf16
    q, k, v = (torch.randn(2, heads, 64, 32, generator=generator, requires_grad=True)
               for heads in (4, kv_heads, kv_heads))
    upstream = torch.randn(2, 4, 64, 32, generator=generator)

    def attention_and_grads(precision: str):
        torch.set_float32_matmul_precision(precision)
        try:
            out = causal_attention(q, k, v, 0.0)
            grads = torch.autograd.grad(out, (q, k, v), upstream)
            assert torch.get_float32_matmul_precision() == precision
        finally:
            torch.set_float32_matmul_precision("highest")
        return out, *grads

    full, medium = attention_and_grads("highest"), attention_and_grads("medium")
    if kv_heads == 4:
        assert all(torch.equal(a, b) for a, b in zip(full, medium))
    else:  # the flash kernel over repeated keys and values, where "highest" takes the math path: fp32's rounding
        for a, b in zip(full, medium):  # (the flash kernel's matmuls in bf16 are 1e-3 off)
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_eager_sets_compiled_graphs_aside():
    from model import eager

    graphs = []

    def backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    plus_one = torch.compile(lambda x: x + 1, backend=backend)
    assert eager(plus_one)(torch.ones(2)).tolist() == [2.0, 2.0] and graphs == []
    assert plus_one(torch.ones(2)).tolist() == [2.0, 2.0] and len(graphs) == 1


@pytest.mark.parametrize("cfg", [SMALL_GPT, dataclasses.replace(preset("encoder_tiny"), vocab_size=65),
                                 dataclasses.replace(preset("llama_quickstart"), vocab_size=65, block_size=64,
                                                     rope_scale_factor=8.0, rope_original_context=16),
                                 dataclasses.replace(preset("llama_quickstart_moe"), vocab_size=65,
                                                     router_bias_rate=0.01)],
                         ids=["gpt", "encoder", "llama3.1_rope", "moe_biased"])
def test_an_empty_build_holds_the_buffers_and_shapes_of_a_built_model(cfg):
    """What a checkpoint's weights are copied into (build_empty): the parameters of build_model's model, at the
    dtype asked, and its buffers, which no checkpoint holds (rotary tables, sinusoidal positions) or a Hub folder
    lacks (the router's choice bias)."""
    built, empty = build_model(cfg), build_empty(cfg, torch.bfloat16)
    assert {n: (p.shape, p.requires_grad) for n, p in empty.named_parameters()} == \
        {n: (p.shape, p.requires_grad) for n, p in built.named_parameters()}
    assert {p.dtype for p in empty.parameters()} == {torch.bfloat16}
    buffers = dict(built.named_buffers())
    assert buffers.keys() == dict(empty.named_buffers()).keys()
    for name, buffer in empty.named_buffers():
        assert buffer.dtype == buffers[name].dtype and torch.equal(buffer, buffers[name]), name
