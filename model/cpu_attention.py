"""Causal attention kernels for a CPU, where torch's flash attention leaves speed behind.

- bf16, contexts up to 256 (the `megalite::causal_attention` operator): the flash kernel's forward, and a
  backward written as five batched bf16 matmuls around the fp32 softmax, which the matmul units run faster than
  the flash kernel's own backward. On an AMX Xeon, one layer's attention, forward and backward: 1.2x as fast at
  context 256, 2.3x at 128, 2.8x at 64 (benchmarks/cpu_attention.py; docs/performance.md, "Attention's backward
  on a CPU").
- fp32 with the matmuls in bf16 (`FullPrecisionCpuAttention`): the flash kernel pinned to full fp32.

Both call the private aten operators behind scaled_dot_product_attention, which return the log-sum-exp of
each row that a backward needs: the public call hides it.
"""
import contextlib

import torch

# Beyond this context the dense scores' passes cost as much as the matmul units save: at 512 the two kernels
# run even, 0.88-1.04x (one bf16 layer of 12 heads of 64, forward and backward, on an AMX Xeon).
MATMUL_BACKWARD_MAX_CONTEXT = 256
# The fp32 scores of one chunk of (batch x heads) rows stay near this size, so that a chunk's passes run in cache.
SCORES_CHUNK_BYTES = 2 * 2**20
# Below exp's underflow the vectorized exp takes a slow path (about 30 times slower); a row's scores this far
# under its log-sum-exp weigh nothing in bf16 or fp32 anyway.
LOWEST_LOG_PROBABILITY = -80.0


def has_cpu_kernel(q: torch.Tensor) -> bool:
    """Does causal attention over these queries go through one of this file's kernels: bf16 at a short context,
    or fp32 under oneDNN's bf16 mode (float32 matmul precision "medium", training/device.py onednn_matmuls), which
    FullPrecisionCpuAttention keeps out of the flash kernel's block matmuls?"""
    if q.device.type != "cpu":
        return False
    if q.dtype == torch.bfloat16:
        return q.size(-2) <= MATMUL_BACKWARD_MAX_CONTEXT
    return q.dtype == torch.float32 and torch.backends.mkldnn.matmul.fp32_precision == "bf16"


def cpu_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(batch, heads, time, head_dim) in and out, the keys and values already repeated to the query heads."""
    if q.dtype == torch.bfloat16:
        return torch.ops.megalite.causal_attention(q, k, v)[0]
    return FullPrecisionCpuAttention.apply(q, k, v)


@contextlib.contextmanager
def float32_matmul_precision(precision: str):
    # torch's older API, as train.py sets it: mixing it with torch.backends.mkldnn.matmul.fp32_precision
    # makes torch.get_float32_matmul_precision() raise
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved)


class FullPrecisionCpuAttention(torch.autograd.Function):
    """Causal CPU flash attention, forward and backward, computed in full fp32 while the rest of the model's
    matmuls run in bf16: under oneDNN's bf16 mode the flash kernel's many small block matmuls each convert their
    inputs, which made a 128-wide quickstart layer's attention 8x slower, where its matmuls gain 2.4x. (The
    public call cannot pin the mode for the backward pass, which runs after the forward has returned.)"""

    @staticmethod
    def forward(ctx, q, k, v):
        with float32_matmul_precision("highest"):
            out, logsumexp = _flash_forward(q, k, v)
        ctx.save_for_backward(q, k, v, out, logsumexp)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, logsumexp = ctx.saved_tensors
        with float32_matmul_precision("highest"):
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad.contiguous(), q, k, v, out, logsumexp, 0.0, True)


# Custom operators rather than an autograd.Function, so that a compiled block calls them as opaque kernels
# instead of breaking its graph around them.
@torch.library.custom_op("megalite::causal_attention", mutates_args=())
def causal_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The flash kernel's output and each row's log-sum-exp (fp32, (batch, heads, time))."""
    return _flash_forward(q, k, v)


def _flash_forward(q, k, v):
    out, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    return out, logsumexp


# aten's own shapes and strides for the fake tensors a compiled graph traces with
causal_attention_forward.register_fake(_flash_forward)


@torch.library.custom_op("megalite::causal_attention_backward", mutates_args=())
def causal_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              out: torch.Tensor, logsumexp: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv from the probabilities recomputed as exp(q k^T scale - logsumexp), a chunk of (batch x heads)
    rows at a time. The scores and the softmax's gradient come out of the matmuls in fp32 (the bf16 inputs
    multiplied in oneDNN's bf16 mode); the probabilities and that gradient enter the next matmuls in bf16, as the
    flash kernel's blocks do."""
    B, H, T, D = q.shape
    scale = D ** -0.5
    q, k, v, out, grad = (t.reshape(B * H, T, D) for t in (q, k, v, out, grad))
    neg_logsumexp = -logsumexp.reshape(B * H, T, 1)
    causal = torch.ones(T, T, device=q.device).tril_()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    step = max(1, SCORES_CHUNK_BYTES // (4 * T * T))
    with float32_matmul_precision("medium"):
        for rows in (slice(i, i + step) for i in range(0, B * H, step)):
            qf, kf, vf, gf = (t[rows].float() for t in (q, k, v, grad))
            # dP's rows shift by rowsum(grad x out): the softmax's Jacobian applied to the output
            neg_scaled_shift = (gf * out[rows]).sum(-1, keepdim=True).mul_(-scale)
            # a bmm, then its row term added in place: baddbmm would first copy the broadcast row term into
            # its output and run slower (about 0.2 ms against 0.14 for one chunk of the baby GPT's layer)
            probs = torch.bmm(qf, kf.transpose(1, 2))
            torch.add(neg_logsumexp[rows], probs, alpha=scale, out=probs)
            probs.clamp_min_(LOWEST_LOG_PROBABILITY).exp_().mul_(causal)
            torch.bmm(probs.to(v.dtype).transpose(1, 2), grad[rows], out=dv[rows])
            d_scores = torch.bmm(gf, vf.transpose(1, 2))
            torch.add(neg_scaled_shift, d_scores, alpha=scale, out=d_scores)
            d_scores = d_scores.mul_(probs).to(q.dtype)
            torch.bmm(d_scores, k[rows], out=dq[rows])
            torch.bmm(d_scores.transpose(1, 2), q[rows], out=dk[rows])
    dq, dk, dv = (t.view(B, H, T, D) for t in (dq, dk, dv))
    return dq, dk, dv


@causal_attention_backward.register_fake
def _(grad, q, k, v, out, logsumexp):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _save_for_backward(ctx, inputs, output):
    ctx.save_for_backward(*inputs, *output)


def _backward(ctx, grad, _grad_logsumexp):
    q, k, v, out, logsumexp = ctx.saved_tensors
    return causal_attention_backward(grad, q, k, v, out, logsumexp)


causal_attention_forward.register_autograd(_backward, setup_context=_save_for_backward)
