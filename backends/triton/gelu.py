"""GELU with the tanh approximation (GPT-2's MLP activation, HF's "gelu_new"): forward and backward, each with a
fused absmax for FP8.

out = 0.5 x (1 + tanh(k (x + c x^3))), k = sqrt(2/pi), c = 0.044715, computed in fp32 exactly as the torch default
of backends/base.py writes it and rounded once to the model dtype; the backward recomputes the tanh from the forward
input instead of saving it: dinp = dout * (0.5 (1 + t) + 0.5 x (1 - t^2) k (1 + 3 c x^2)).

Element-wise over the flat tensors (both are contiguous [N, I]): a program handles BLOCK consecutive elements,
each input read once and each output written once, and folds max|output| of the stored values into the absmax
atomically (reduce.atomic_amax), so quantizing the output for an FP8 GEMM (the down projection's input in the
forward, the up projection's dy in the backward) needs no extra pass over memory.

tanh is built from one exp (Triton has no tanh of its own that also runs under the interpreter):
tanh(a) = (1 - e) / (1 + e) with e = exp(-2a) for a = |u| >= 0.125, where 1 - e does not cancel badly (a few fp32
ulp), and the odd Taylor polynomial to u^7 below that (truncation error < 2e-9 relative); the sign is put back
afterwards. exp(-2a) underflows to 0 for large a: tanh = 1 exactly, no inf/inf.
"""

from __future__ import annotations

import triton
import triton.language as tl

from llmq_ray.backends.triton import reduce as _reduce
from llmq_ray.backends.triton.reduce import atomic_amax
from llmq_ray.backends.triton._common import cast_to, elementwise_block, num_warps_for

GELU_K = 0.7978845608028654  # sqrt(2 / pi), as backends/base.py's _GELU_K
GELU_C = 0.044715


@triton.jit
def _tanh(u):
    """tanh(u) in fp32 (see the module docstring)."""
    a = tl.abs(u)
    e = tl.exp(-2.0 * a)
    big = (1.0 - e) / (1.0 + e)
    a2 = a * a
    small = a + a * a2 * (-0.3333333333333333 + a2 * (0.13333333333333333 + a2 * -0.05396825396825397))
    t = tl.where(a < 0.125, small, big)
    return tl.where(u < 0.0, -t, t)


@triton.jit
def _gelu_fwd_kernel(out_ptr, x_ptr, amax_ptr, n, K: tl.constexpr, CC: tl.constexpr, BLOCK: tl.constexpr,
                     ABSMAX: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    t = _tanh(K * (x + CC * x * x * x))
    y = cast_to(0.5 * x * (1.0 + t), out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs, y, mask=mask)
    if ABSMAX:  # masked lanes: x = 0, so y = 0
        atomic_amax(amax_ptr, tl.max(tl.abs(y.to(tl.float32)), axis=0))


@triton.jit
def _gelu_bwd_kernel(dx_ptr, dy_ptr, x_ptr, amax_ptr, n, K: tl.constexpr, CC: tl.constexpr, BLOCK: tl.constexpr,
                     ABSMAX: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    t = _tanh(K * (x + CC * x * x * x))
    grad = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * K * (1.0 + 3.0 * CC * x * x)
    dx = cast_to(g * grad, dx_ptr.dtype.element_ty)
    tl.store(dx_ptr + offs, dx, mask=mask)
    if ABSMAX:  # masked lanes: g = 0, so dx = 0
        atomic_amax(amax_ptr, tl.max(tl.abs(dx.to(tl.float32)), axis=0))


def _check(what: str, out, inp, other=None) -> int:
    for t in (out,) if other is None else (out, other):
        if t.shape != inp.shape:
            raise ValueError(f"{what}: shapes differ: {tuple(t.shape)} vs inp {tuple(inp.shape)}")
    return inp.numel()


def gelu_tanh_forward(out, inp, absmax=None) -> None:
    """out = gelu_tanh(inp) (any shape, contiguous), fp32 inside, one rounding; absmax (fp32 0-d) = max|out|."""
    n = _check("gelu_tanh_forward", out, inp)
    block = elementwise_block()
    if absmax is not None:
        _reduce.start_amax(absmax)
    _gelu_fwd_kernel[(triton.cdiv(n, block),)](out, inp, absmax if absmax is not None else out, n, K=GELU_K,
                                                 CC=GELU_C, BLOCK=block, ABSMAX=absmax is not None,
                                                 num_warps=num_warps_for(block))


def gelu_tanh_backward(dinp, dout, inp, absmax=None) -> None:
    """dinp = dout * gelu_tanh'(inp) (overwritten), fp32 inside, one rounding; absmax (fp32 0-d) = max|dinp|."""
    n = _check("gelu_tanh_backward", dinp, inp, dout)
    block = elementwise_block()
    if absmax is not None:
        _reduce.start_amax(absmax)
    _gelu_bwd_kernel[(triton.cdiv(n, block),)](dinp, dout, inp, absmax if absmax is not None else inp, n, K=GELU_K,
                                                 CC=GELU_C, BLOCK=block, ABSMAX=absmax is not None,
                                                 num_warps=num_warps_for(block))
