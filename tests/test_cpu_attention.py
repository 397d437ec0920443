"""model/cpu_attention.py: the bf16 attention whose backward runs as batched matmuls, against torch's flash kernel."""
import pytest
import torch
import torch.nn.functional as F

from model.cpu_attention import MATMUL_BACKWARD_MAX_CONTEXT, causal_attention_backward, causal_attention_forward
from model.layers import causal_attention


def attention_inputs(heads: int, kv_heads: int, context: int, layout: str, batch: int = 3, head_dim: int = 32):
    """bf16 queries, keys, values and an upstream gradient, (batch, heads, time, head_dim): contiguous, or laid out
    (batch, time, heads, head_dim) as split_heads leaves them."""
    generator = torch.Generator().manual_seed(0)

    def tensor(h):
        if layout == "contiguous":
            return torch.randn(batch, h, context, head_dim, generator=generator).bfloat16()
        return torch.randn(batch, context, h, head_dim, generator=generator).bfloat16().transpose(1, 2)

    q, k, v = (tensor(h).requires_grad_() for h in (heads, kv_heads, kv_heads))
    return q, k, v, tensor(heads)


def relative_error(a: torch.Tensor, exact: torch.Tensor) -> float:
    return ((a.double() - exact).norm() / exact.norm()).item()


@pytest.mark.parametrize("layout", ["contiguous", "time-major"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_bf16_attention_matches_the_flash_kernel_forward_bitwise_and_backward_within_its_rounding(layout, kv_heads):
    """The forward is the flash kernel's, bit for bit; the gradients, from the matmuls, sit as close to the exact
    (fp64) ones as the flash kernel's own bf16 backward does, under grouped-query attention too."""
    q, k, v, upstream = attention_inputs(4, kv_heads, 128, layout)
    out = causal_attention(q, k, v, 0.0)
    assert "megalite" in out.grad_fn.name()
    grads = torch.autograd.grad(out, (q, k, v), upstream)

    flash_out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != 4)
    flash_grads = torch.autograd.grad(flash_out, (q, k, v), upstream)
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    exact_out = F.scaled_dot_product_attention(*exact, is_causal=True, enable_gqa=kv_heads != 4)
    exact_grads = torch.autograd.grad(exact_out, exact, upstream.double())

    assert torch.equal(out, flash_out)
    for grad, flash_grad, exact_grad in zip(grads, flash_grads, exact_grads):
        assert grad.dtype == torch.bfloat16 and grad.shape == exact_grad.shape
        assert relative_error(grad, exact_grad) < max(1.2 * relative_error(flash_grad, exact_grad), 4e-3)


@pytest.mark.parametrize("layout", ["contiguous", "time-major"])
def test_the_operators_trace_as_they_run(layout):
    """torch.library's checks of both custom operators: their fake tensors (which a compiled block traces with) have
    the real ones' shapes and strides, and autograd reaches the backward."""
    q, k, v, upstream = attention_inputs(4, 4, 16, layout)
    torch.library.opcheck(causal_attention_forward, (q, k, v))
    out, logsumexp = causal_attention_forward(q.detach(), k.detach(), v.detach())
    torch.library.opcheck(causal_attention_backward, (upstream, q.detach(), k.detach(), v.detach(), out, logsumexp))


def test_long_contexts_dropout_and_fp32_keep_torchs_attention():
    """Past MATMUL_BACKWARD_MAX_CONTEXT the flash kernel's backward is the faster; dropout needs torch's call; fp32 at
    full precision has no reason to leave it."""
    def grad_fn(context, dtype=torch.bfloat16, dropout=0.0):
        q = torch.randn(1, 2, context, 16, dtype=dtype, requires_grad=True)
        return causal_attention(q, q, q, dropout).grad_fn.name()

    assert "megalite" in grad_fn(MATMUL_BACKWARD_MAX_CONTEXT)
    assert "megalite" not in grad_fn(MATMUL_BACKWARD_MAX_CONTEXT + 1)
    assert "megalite" not in grad_fn(64, dropout=0.1)
    assert "megalite" not in grad_fn(64, dtype=torch.float32)


def test_a_compiled_block_calls_the_operators_in_its_graph():
    """Compiled whole (fullgraph: no break around the custom operators), attention gives the eager forward and
    gradients bit for bit: inductor calls both operators as they are."""
    q, k, v, upstream = attention_inputs(4, 2, 32, "time-major")

    def attention_and_grads(fn):
        out = fn(q, k, v)
        return out, *torch.autograd.grad(out, (q, k, v), upstream)

    def attention(q, k, v):
        return causal_attention(q, k, v, 0.0)

    compiled = torch.compile(attention, backend="inductor", fullgraph=True)
    for eager_tensor, compiled_tensor in zip(attention_and_grads(attention), attention_and_grads(compiled)):
        assert torch.equal(eager_tensor, compiled_tensor)
