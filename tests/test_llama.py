"""The Llama layer list: shapes, causality, RoPE, grouped-query attention, exact parameter counts, the FLOP
count, and the shapes it refuses."""
import dataclasses
import os

import pytest
import torch

from common.checks import ConfigError
from harness import train_py
from model import build_model, model_layers
from model.config import ModelConfig
from model.layers import apply_rope, rope_frequencies, rope_tables
from model.llama import LLAMA, Attention, LlamaBlock
from model_checks import SMALL_GPT, assert_causal, count_on_meta, preset
from training import memory_plan
from training.config import REPO_ROOT, load_run_config
from training.metrics import flops_per_token
from training.topology import stage_partition

SMALL = ModelConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=64, block_size=16,
                    vocab_size=65)


def test_logits_shape_and_parameter_names():
    model = build_model(SMALL)
    assert model(torch.randint(0, 65, (3, 16))).shape == (3, 16, 128)
    assert model(torch.randint(0, 65, (2, 5))).shape == (2, 5, 128)
    names = [n for n, _ in model.named_parameters()]
    assert names[:6] == ["0.weight", "1.attn_norm.weight", "1.attn.q.weight", "1.attn.k.weight", "1.attn.v.weight",
                         "1.attn.o.weight"]
    assert names[-2:] == ["3.weight", "4.weight"]  # final RMSNorm, untied head
    assert not any(n.endswith("bias") for n in names)


def test_changing_a_token_never_changes_earlier_logits():
    assert_causal(build_model(SMALL).eval())


@pytest.mark.parametrize("scale", [None, 8.0], ids=["rope", "llama3.1_scaled"])
def test_rope_scores_depend_only_on_relative_position(scale):
    cfg = dataclasses.replace(SMALL, n_embd=64, n_head=2, rope_theta=500.0, rope_scale_factor=scale,
                              rope_original_context=64)
    inv_freq = rope_frequencies(cfg)
    q, k = torch.randn(1, 1, 1, 32, dtype=torch.float64), torch.randn(1, 1, 1, 32, dtype=torch.float64)

    def score(m: int, n: int) -> torch.Tensor:
        cos_m, sin_m = (t.double() for t in rope_tables(inv_freq, torch.tensor([m])))
        cos_n, sin_n = (t.double() for t in rope_tables(inv_freq, torch.tensor([n])))
        return (apply_rope(q, cos_m, sin_m) * apply_rope(k, cos_n, sin_n)).sum()

    for m, n in ((5, 2), (9, 9), (3, 7)):
        for shift in (1, 13, 100):
            torch.testing.assert_close(score(m + shift, n + shift), score(m, n), rtol=0, atol=1e-4)
    assert abs(score(5, 2) - score(6, 2)) > 1e-3  # and they do depend on it


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_key_value_heads_shapes_and_counts(kv_heads):
    cfg = dataclasses.replace(SMALL, n_kv_head=kv_heads)
    attention = Attention(cfg)
    assert attention.k.weight.shape == attention.v.weight.shape == (kv_heads * 8, 32)
    assert attention(torch.randn(2, 10, 32)).shape == (2, 10, 32)
    d, kv = 32, kv_heads * 8
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * 64 + 2 * d  # q, o; k, v; gate, up, down; two RMSNorms
    assert count_on_meta(cfg) == 2 * per_layer + 2 * 128 * d + d  # + embedding, head, final norm


def test_grouped_query_attention_shares_each_key_value_head():
    """With the k/v heads repeated to n_head, plain multi-head attention gives the same output."""
    torch.manual_seed(0)
    gqa = Attention(SMALL)
    mha = Attention(dataclasses.replace(SMALL, n_kv_head=4))
    with torch.no_grad():
        mha.q.weight.copy_(gqa.q.weight)
        mha.o.weight.copy_(gqa.o.weight)
        for name in ("k", "v"):  # query heads 0, 1 read k/v head 0; heads 2, 3 read head 1
            mha.get_submodule(name).weight.copy_(getattr(gqa, name).weight.view(2, 8, 32).repeat_interleave(2, 0)
                                                 .reshape(32, 32))
    x = torch.randn(2, 16, 32)
    torch.testing.assert_close(gqa(x), mha(x), rtol=0, atol=1e-6)


def test_tied_head_is_the_embedding():
    cfg = dataclasses.replace(SMALL, tie_embeddings=True)
    names = [n for n, _ in build_model(cfg).named_parameters()]
    assert names[0] == "tied_modules.embed.weight" and names[-1] == "3.weight"  # no head matrix of its own
    assert count_on_meta(SMALL) - count_on_meta(cfg) == 128 * 32


def test_llama_hidden_size_rule():
    # TinyLlama (width 2048) and Llama-2 7B (4096)
    assert LLAMA.mlp_hidden(dataclasses.replace(SMALL, ffn_hidden=None, n_embd=2048)) == 5632
    assert LLAMA.mlp_hidden(dataclasses.replace(SMALL, ffn_hidden=None, n_embd=4096)) == 11008


@pytest.mark.parametrize("name,vocab,expected", [
    ("tinyllama_1.1b", None, 1_100_048_384),
    ("llama3.2_1b", None, 1_235_814_400),
    ("llama3.1_8b", None, 8_030_261_248),  # the Llama 3 paper's 8.03B, 70.6B and 405.9B
    ("llama3.1_70b", None, 70_553_706_496),
    ("llama3.1_405b", None, 405_853_388_800),
    ("llama_124m", 50_000, 179_522_304),
    ("llama_quickstart", 65, 820_352),
    ("qwen3_0.6b", None, 596_049_920),  # 440,466,432 outside the embedding: Qwen's "0.44B"
])
def test_llama_preset_parameter_counts(name, vocab, expected):
    cfg = preset(name)
    if vocab:
        cfg.vocab_size = vocab
    assert count_on_meta(cfg) == expected


@pytest.mark.parametrize("cfg", [SMALL, dataclasses.replace(SMALL, n_kv_head=1, tie_embeddings=True),
                                 dataclasses.replace(SMALL, head_dim=24, qk_norm=True, qkv_bias=True), SMALL_GPT],
                         ids=["llama_gqa", "llama_mqa_tied", "qwen_wide_heads", "gpt"])
def test_flops_per_token_counts_every_matmul_weight(cfg):
    """6 x (every 2-D weight but the token embedding, plus the head: once more when tied) + attention."""
    with torch.device("meta"):
        model = build_model(cfg)
    matmul = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n
                 and n not in ("0.weight", "1.weight"))  # Llama's embedding; the GPT's positions
    matmul += cfg.padded_vocab_size * cfg.n_embd if cfg.arch == "gpt" or cfg.tie_embeddings else 0
    heads = cfg.n_head * (cfg.head_dim or cfg.n_embd // cfg.n_head)
    assert flops_per_token(cfg) == 6 * matmul + 12 * cfg.n_layer * heads * cfg.block_size


@pytest.mark.parametrize("override,message", [
    (["model.n_kv_head=3"], r"model.n_kv_head=3: must divide model.n_head=4"),
    (["model.n_head=2", "model.n_embd=34"], r"model.n_embd=34: must give an even head size n_embd / n_head \(now "
                                            r"17\): rotary embeddings rotate pairs"),
])
def test_bad_shapes_are_refused(override, message):
    """Checked once, with the run config (model/ builds what the config allows)."""
    with pytest.raises(ConfigError, match=message):
        load_run_config(os.path.join(REPO_ROOT, "configs", "llama_quickstart.yaml"), override)


def test_train_refuses_a_bad_shape_at_start(char_data, tmp_path):
    proc = train_py(["--config", "configs/llama_quickstart.yaml", f"data.dir={char_data}",
                     f"train.out_dir={tmp_path}", "model.n_kv_head=3"], check=False, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "error: model.n_kv_head=3: must divide model.n_head=4" in proc.stderr
    assert not (tmp_path / "checkpoints").exists()


def test_compiled_swiglu_keeps_one_hidden_tensor_less_as_the_plan_counts():
    """The bytes SwiGLU saves for its backward pass, eager and under torch.compile (inductor recomputes the SiLU):
    the difference is one hidden-wide 16-bit tensor a token, as the memory plan's compiled block counts."""
    from model.layers import SwiGLU

    def saved_bytes(module, x) -> int:
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            module(x)
        return sum(storages.values())

    tokens = 48
    mlp = SwiGLU(SMALL.n_embd, SMALL.ffn_hidden).to(torch.bfloat16)
    x = torch.randn(tokens, SMALL.n_embd, dtype=torch.bfloat16, requires_grad=True)
    kept = saved_bytes(mlp, x) - saved_bytes(torch.compile(mlp), x)
    planned = memory_plan.layer_activation_bytes(SMALL) - memory_plan.layer_activation_bytes(SMALL, compiled=True)
    assert kept == tokens * planned == tokens * 2 * SMALL.ffn_hidden


def test_a_cpus_rmsnorm_keeps_what_the_plan_counts_beyond_a_gpus():
    """Each of a block's two norms on a CPU keeps its fp32 input and fp32 normalized rows for the backward pass, and
    the next matmul its 16-bit output: 10 bytes an element, where the plan counts a GPU's 16-bit input and output (4)
    plus the CPU's difference."""
    def saved_bytes(module, x) -> int:
        storages = {}

        def pack(t):
            if t.shape == x.shape:  # the rows, not the weights or the per-row scale
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            module(x)
        return sum(storages.values())

    d = SMALL.n_embd
    norm_then_matmul = torch.nn.Sequential(torch.nn.RMSNorm(d), torch.nn.Linear(d, d, bias=False)).to(torch.bfloat16)
    x = torch.randn(48, d, dtype=torch.bfloat16, requires_grad=True)
    cpu_extra = (memory_plan.layer_activation_bytes(SMALL, device_type="cpu")
                 - memory_plan.layer_activation_bytes(SMALL, device_type="cuda"))
    assert not SMALL.document_masking and saved_bytes(norm_then_matmul, x) == x.numel() * (4 + cpu_extra / (2 * d))


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_parameter_balanced_stages_hold_blocks(tie):
    specs = model_layers(dataclasses.replace(SMALL, n_layer=6, tie_embeddings=tie))
    parts = stage_partition(specs, 3, "parameters", LlamaBlock)
    assert all(any(s.typename.__name__ == "LlamaBlock" for s in specs[a:b]) for a, b in zip(parts, parts[1:]))


def test_memory_plan_counts_grouped_query_attention_and_swiglu():
    plan = memory_plan.plan(SMALL, {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 0}}, 1)
    tokens, d, kv, ffn = 2 * 16, 32, 16, 64  # k and v: 2 heads x 8
    # no dropout: no masks; logits: 16-bit and their gradient for all tokens, the fp32 copy and log-softmax for one
    # chunk
    assert SMALL.dropout == 0 and tokens < memory_plan.LOSS_CHUNK_ROWS
    assert plan["activations"] == 2 * tokens * (12 * d + 4 * kv + 8 * ffn) + (4 + 8) * tokens * 128
    assert plan["states"] + plan["gradients"] == 20 * count_on_meta(SMALL)
    # train.compile: inductor's loss reads the 16-bit logits and writes their gradient, no fp32 chunk between;
    # SwiGLU's SiLU is recomputed in the backward pass, not kept
    compiled = memory_plan.plan(SMALL, {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 0}}, 1,
                                compiled=True)
    assert plan["activations"] - compiled["activations"] == 8 * tokens * 128 + SMALL.n_layer * tokens * 2 * ffn
