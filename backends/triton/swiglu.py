"""SwiGLU forward (with a fused absmax for FP8) and backward over the fused up+gate GEMM output.

inp[N, 2I] = [up | gate]; out[N, I] = up * silu(gate). Element-wise over [BLOCK_R, BLOCK_I] tiles: each
input read once, each output written once (the forward never materialises silu(gate); the backward recomputes
sigmoid(gate) instead of saving it). The forward folds each tile's max|out| into the absmax atomically (reduce.atomic_amax), so quantizing ``out`` for the down-projection's FP8 GEMM needs no extra pass over memory; the
backward does the same for max|dinp|, the scale of the up+gate GEMM's FP8 gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmq_ray.backends.triton import reduce as _reduce
from llmq_ray.backends.triton.reduce import atomic_amax
from llmq_ray.backends.triton._common import INTERPRET, cast_to, fp8_store_view, next_pow2, num_warps_for
from llmq_ray.backends.triton.fp8 import _fp8_args, _scale_and_descale, _to_fp8, tile_config


@triton.jit
def _swiglu_out(inp_ptr, rows, cols, N, I):
    """(up * silu(gate) in fp32, mask, the rows as int64 [R, 1]) for the tile rows x cols (cols < I); masked
    lanes are 0. One function so that both forward kernels compute the same bits."""
    mask = (rows < N)[:, None] & (cols < I)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    up = tl.load(inp_ptr + r64 * (2 * I) + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(inp_ptr + r64 * (2 * I) + I + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return up * (gate / (1.0 + tl.exp(-gate))), mask, r64


@triton.jit
def _swiglu_fwd_kernel(out_ptr, inp_ptr, amax_ptr, N, I, BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr,
                       ABSMAX: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK_I + tl.arange(0, BLOCK_I)
    y32, mask, r64 = _swiglu_out(inp_ptr, rows, cols, N, I)
    y = cast_to(y32, out_ptr.dtype.element_ty)
    tl.store(out_ptr + r64 * I + cols[None, :], y, mask=mask)
    if ABSMAX:
        atomic_amax(amax_ptr, tl.max(tl.max(tl.abs(y.to(tl.float32)), axis=1), axis=0))


@triton.jit
def _swiglu_fwd_fp8_kernel(q_ptr, qt_ptr, descale_ptr, inp_ptr, scale_amax_ptr, amax_out_ptr, N, I,
                           OUT_DTYPE: tl.constexpr, FP8_MAX: tl.constexpr, FP8_DTYPE: tl.constexpr,
                           MAN: tl.constexpr, BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Delayed-scale SwiGLU forward for the down projection's FP8 input: each [BLOCK_M, BLOCK_K] tile of
    out = up * silu(gate), rounded to OUT_DTYPE (the model dtype) exactly as ``_swiglu_fwd_kernel`` rounds it,
    quantized at the scale of ``scale_amax`` (an earlier max|out|), written row-major into q[N, I] and
    transposed into qt[I, N]; its max|out| folded into ``amax_out``. The model-dtype out is not written."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    s = _scale_and_descale(scale_amax_ptr, descale_ptr, (pid_m == 0) & (pid_k == 0), FP8_MAX)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    y32, mask, r64 = _swiglu_out(inp_ptr, rows, cols, N, I)
    y = cast_to(y32, OUT_DTYPE).to(tl.float32)
    atomic_amax(amax_out_ptr, tl.max(tl.max(tl.abs(y), axis=1), axis=0))
    qy = _to_fp8(y, s, FP8_MAX, FP8_DTYPE, MAN, BIAS)
    tl.store(q_ptr + r64 * I + cols[None, :], qy, mask=mask)
    tl.store(qt_ptr + cols.to(tl.int64)[None, :] * N + rows[:, None], qy, mask=mask)


@triton.jit
def _swiglu_grads(inp_ptr, dout_ptr, rows, cols, N, I, OUT_DTYPE: tl.constexpr):
    """(d up, d gate, mask, offsets of the up tile in inp/dinp) for the tile rows x cols (cols < I): loaded and
    computed in fp32, returned in OUT_DTYPE (the model dtype); masked lanes are 0. One function so that the
    plain backward and the FP8 one compute the same bits."""
    mask = (rows < N)[:, None] & (cols < I)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    up_offs = r64 * (2 * I) + cols[None, :]
    up = tl.load(inp_ptr + up_offs, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(inp_ptr + up_offs + I, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(dout_ptr + r64 * I + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-gate))
    dup = g * (gate * sig)
    dgate = g * up * sig * (1.0 + gate * (1.0 - sig))
    return cast_to(dup, OUT_DTYPE), cast_to(dgate, OUT_DTYPE), mask, up_offs


@triton.jit
def _swiglu_bwd_kernel(dinp_ptr, dout_ptr, inp_ptr, amax_ptr, N, I, BLOCK_R: tl.constexpr,
                       BLOCK_I: tl.constexpr, ABSMAX: tl.constexpr, STORE: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """dinp tile (STORE) and/or one partial max|dinp| per program (ABSMAX); STORE=False is the FP8 path's
    first pass, which only measures the scale."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK_I + tl.arange(0, BLOCK_I)
    dup, dgate, mask, up_offs = _swiglu_grads(inp_ptr, dout_ptr, rows, cols, N, I, OUT_DTYPE)
    if STORE:
        tl.store(dinp_ptr + up_offs, dup, mask=mask)
        tl.store(dinp_ptr + up_offs + I, dgate, mask=mask)
    if ABSMAX:  # of the model-dtype values: dinp is the FP8 up+gate GEMM's dy (masked lanes hold 0)
        both = tl.maximum(tl.abs(dup.to(tl.float32)), tl.abs(dgate.to(tl.float32)))
        atomic_amax(amax_ptr, tl.max(tl.max(both, axis=1), axis=0))


@triton.jit
def _swiglu_bwd_fp8_kernel(q_ptr, qt_ptr, descale_ptr, dout_ptr, inp_ptr, scale_amax_ptr, amax_out_ptr, N, I,
                           OUT_DTYPE: tl.constexpr, FP8_MAX: tl.constexpr, FP8_DTYPE: tl.constexpr,
                           MAN: tl.constexpr, BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                           MEASURE: tl.constexpr):
    """The [BLOCK_M, BLOCK_K] tiles of d up (columns c) and d gate (columns I + c) quantized at the scale of
    ``scale_amax``, written row-major into q[N, 2I] and transposed into qt[2I, N] -- the same bytes as
    swiglu_backward followed by quantize_with_transpose at that absmax, without the model-dtype dinp.
    Current scaling: the second pass, ``scale_amax`` = the first pass's absmax. Delayed scaling (MEASURE): the
    only pass, ``scale_amax`` = an earlier absmax, and each tile's max|dinp| is folded into ``amax_out``."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    s = _scale_and_descale(scale_amax_ptr, descale_ptr, (pid_m == 0) & (pid_k == 0), FP8_MAX)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    dup, dgate, mask, up_offs = _swiglu_grads(inp_ptr, dout_ptr, rows, cols, N, I, OUT_DTYPE)
    if MEASURE:  # of the model-dtype values (masked lanes hold 0), as the first pass measures them
        both = tl.maximum(tl.abs(dup.to(tl.float32)), tl.abs(dgate.to(tl.float32)))
        atomic_amax(amax_out_ptr, tl.max(tl.max(both, axis=1), axis=0))
    qup = _to_fp8(dup.to(tl.float32), s, FP8_MAX, FP8_DTYPE, MAN, BIAS)
    qgate = _to_fp8(dgate.to(tl.float32), s, FP8_MAX, FP8_DTYPE, MAN, BIAS)
    tl.store(q_ptr + up_offs, qup, mask=mask)
    tl.store(q_ptr + up_offs + I, qgate, mask=mask)
    tl.store(qt_ptr + cols.to(tl.int64)[None, :] * N + rows[:, None], qup, mask=mask)
    tl.store(qt_ptr + (cols + I).to(tl.int64)[None, :] * N + rows[:, None], qgate, mask=mask)


def _tiles(n: int, i: int) -> tuple[int, int]:
    block_i = min(next_pow2(i), 8192 if INTERPRET else 1024)
    budget = 16384 if INTERPRET else 2048
    block_r = min(max(1, budget // block_i), next_pow2(n))
    return block_r, block_i


def swiglu_forward(out, inp, absmax=None) -> None:
    """out[N, I] = up * silu(gate), inp[N, 2I] = [up | gate]; absmax (fp32 0-d) = max|out| when given."""
    n, i = out.shape
    block_r, block_i = _tiles(n, i)
    grid = (triton.cdiv(n, block_r), triton.cdiv(i, block_i))
    if absmax is not None:
        _reduce.start_amax(absmax)
    _swiglu_fwd_kernel[grid](out, inp, absmax if absmax is not None else out, n, i, BLOCK_R=block_r,
                             BLOCK_I=block_i, ABSMAX=absmax is not None, num_warps=num_warps_for(block_r * block_i))


def swiglu_forward_fp8(q, qt, descale, inp, absmax, scale_absmax, out_dtype: torch.dtype) -> None:
    """Delayed scaling: the down projection's FP8 input straight from the SwiGLU forward, in one pass.
    q[N, I] = quantize(out) and qt[I, N] = its transpose (FP8, one dtype) at the scale of ``scale_absmax`` (fp32
    0-d, an earlier max|out|; values beyond it saturate), descale = 1/scale, absmax (fp32 0-d) = this out's
    max|out|, where out is what swiglu_forward would write in ``out_dtype``. Per element of out: 4 bytes read,
    2 written, against 4 read + 2 written + 2 read + 2 written for swiglu_forward then quantize_with_transpose."""
    if q.dtype != qt.dtype:
        raise ValueError(f"swiglu_forward_fp8: q is {q.dtype} but qt is {qt.dtype}")
    _reduce.start_amax(absmax)
    n, i = q.shape
    block_m, block_k, warps = tile_config("swiglu_fwd")
    grid = (triton.cdiv(n, block_m), triton.cdiv(i, block_k))
    _swiglu_fwd_fp8_kernel[grid](fp8_store_view(q), fp8_store_view(qt), descale, inp, scale_absmax, absmax, n, i,
                                 OUT_DTYPE=_tl_dtype(out_dtype), BLOCK_M=block_m, BLOCK_K=block_k, num_warps=warps,
                                 **_fp8_args(q.dtype))


def swiglu_backward(dinp, dout, inp, absmax=None) -> None:
    """dinp[N, 2I] = [dout * silu(gate) | dout * up * silu'(gate)]; absmax (fp32 0-d) = max|dinp| when given
    (the FP8 backward's dy scale, without another pass over the 2I-wide gradient)."""
    _backward(dinp, dout, inp, absmax, store=True, out_dtype=dinp.dtype)


def _backward(dinp, dout, inp, absmax, store: bool, out_dtype: torch.dtype) -> None:
    n, i = dout.shape
    block_r, block_i = _tiles(n, i)
    grid = (triton.cdiv(n, block_r), triton.cdiv(i, block_i))
    if absmax is not None:
        _reduce.start_amax(absmax)
    _swiglu_bwd_kernel[grid](dinp, dout, inp, absmax if absmax is not None else inp, n, i, BLOCK_R=block_r,
                             BLOCK_I=block_i, ABSMAX=absmax is not None, STORE=store, OUT_DTYPE=_tl_dtype(out_dtype),
                             num_warps=num_warps_for(block_r * block_i))


def swiglu_backward_fp8(q, qt, descale, dout, inp, absmax, out_dtype: torch.dtype, scale_absmax=None) -> None:
    """The up+gate GEMM's FP8 gradient straight from the SwiGLU backward: q[N, 2I] = quantize(dinp) and
    qt[2I, N] = its transpose (FP8, one dtype), absmax (fp32 0-d) = max|dinp| and descale = 1/scale, where dinp
    is what swiglu_backward would write in ``out_dtype`` (the model dtype).

    Current scaling (``scale_absmax`` None; the scale from max|dinp| itself): two passes over dout and inp --
    the first only measures max|dinp| -- instead of writing dinp and reading it back: per dinp element 8 bytes of
    traffic instead of 9 (bf16: 3 read, then 3 read + 2 written, against 3 read + 2 written + 2 read + 2 written).
    Delayed scaling (``scale_absmax``, fp32 0-d: an earlier max|dinp|, e.g. the same layer's in the previous
    backward): one pass, 5 bytes per element; values beyond that absmax saturate at the FP8 maximum, and
    ``absmax`` still receives this dinp's own max for the next call."""
    if q.dtype != qt.dtype:
        raise ValueError(f"swiglu_backward_fp8: q is {q.dtype} but qt is {qt.dtype}")
    if scale_absmax is None:
        _backward(inp, dout, inp, absmax, store=False, out_dtype=out_dtype)  # STORE=False never writes dinp_ptr
    else:
        _reduce.start_amax(absmax)
    n, i = dout.shape
    block_m, block_k, warps = tile_config("swiglu_bwd")
    grid = (triton.cdiv(n, block_m), triton.cdiv(i, block_k))
    _swiglu_bwd_fp8_kernel[grid](fp8_store_view(q), fp8_store_view(qt), descale, dout, inp,
                                 absmax if scale_absmax is None else scale_absmax, absmax, n, i,
                                 OUT_DTYPE=_tl_dtype(out_dtype), BLOCK_M=block_m, BLOCK_K=block_k, num_warps=warps,
                                 MEASURE=scale_absmax is not None, **_fp8_args(q.dtype))


def _tl_dtype(dtype: torch.dtype):
    """The Triton dtype of a model dtype the SwiGLU gradient is rounded to."""
    known = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
    if dtype not in known:
        raise TypeError(f"SwiGLU backward: gradients in {dtype} are not supported (fp32, bf16 or fp16)")
    return known[dtype]
