"""FP8 (e4m3 / e5m2) per-tensor quantization: quantize and quantize+transpose, at the scale of a given absmax.

s = fp8_max / absmax (1 when absmax is 0), q = saturate(x * s) with round-to-nearest-even, descale = 1/s
(see the FP8 convention in backends/base.py). The scale is computed *inside* the kernel from the device-side
absmax (IEEE reciprocal, then the multiply, as torch evaluates it), so no host sync and no separate scale kernel; program 0 writes the
descale. One read of x and one write of q (a quarter/half of x's bytes): the whole quantization is one pass,
with the absmax coming fused out of the kernel that produced x (rmsnorm, swiglu) or from reduce.absmax.
quantize_transpose writes q^T through [BLOCK_M, BLOCK_K] tiles, so both the read and the write stay coalesced.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmq_ray.backends.triton._common import (INTERPRET, cast_fp8, elementwise_block, fp8_max, fp8_params, fp8_store_view,
                                     num_warps_for)


@triton.jit
def _scale(absmax_ptr, FP8_MAX: tl.constexpr):
    amax = tl.load(absmax_ptr).to(tl.float32)
    # fp8_max * (1 / amax), both IEEE-rounded: exactly how torch evaluates ``fp8_max / amax_tensor``
    # (Tensor.__rtruediv__ is reciprocal-then-multiply), so scales and descales match the reference bit for bit
    s = tl.where(amax > 0, FP8_MAX * tl.div_rn(tl.full([], 1.0, tl.float32), tl.where(amax > 0, amax, 1.0)), 1.0)
    return s


@triton.jit
def _scale_and_descale(absmax_ptr, descale_ptr, first, FP8_MAX: tl.constexpr):
    """The scale s of ``_scale``; the program for which ``first`` holds also writes descale = 1/s."""
    s = _scale(absmax_ptr, FP8_MAX)
    if first:
        tl.store(descale_ptr, tl.div_rn(tl.full([], 1.0, tl.float32), s))
    return s


@triton.jit
def _to_fp8(x, s, FP8_MAX: tl.constexpr, FP8_DTYPE: tl.constexpr, MAN: tl.constexpr, BIAS: tl.constexpr):
    """saturate(x * s) cast to FP8 (x fp32; the uint8 bit pattern under the interpreter, see cast_fp8)."""
    return cast_fp8(tl.minimum(tl.maximum(x * s, -FP8_MAX), FP8_MAX), FP8_DTYPE, MAN, BIAS)


@triton.jit
def _quantize_kernel(out_ptr, descale_ptr, x_ptr, absmax_ptr, n, FP8_MAX: tl.constexpr,
                     FP8_DTYPE: tl.constexpr, MAN: tl.constexpr, BIAS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    s = _scale_and_descale(absmax_ptr, descale_ptr, pid == 0, FP8_MAX)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, _to_fp8(x, s, FP8_MAX, FP8_DTYPE, MAN, BIAS), mask=mask)


@triton.jit
def _quantize_tiles_kernel(out_ptr, out_t_ptr, descale_ptr, x_ptr, absmax_ptr, M, K, FP8_MAX: tl.constexpr,
                           FP8_DTYPE: tl.constexpr, MAN: tl.constexpr, BIAS: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, WRITE_ROWMAJOR: tl.constexpr):
    """One read of a [BLOCK_M, BLOCK_K] tile of x; writes q^T into out_t and, with WRITE_ROWMAJOR, q into out
    as well (the dual layout a gradient needs for dgrad and wgrad)."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    s = _scale_and_descale(absmax_ptr, descale_ptr, (pid_m == 0) & (pid_k == 0), FP8_MAX)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = _to_fp8(x, s, FP8_MAX, FP8_DTYPE, MAN, BIAS)
    if WRITE_ROWMAJOR:
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], y, mask=mask)
    tl.store(out_t_ptr + cols.to(tl.int64)[None, :] * M + rows[:, None], y, mask=mask)


def _fp8_args(dtype):
    man, bias = fp8_params(dtype)
    fp8_dtype = tl.float8e4nv if man == 3 else tl.float8e5
    return dict(FP8_MAX=fp8_max(dtype), FP8_DTYPE=fp8_dtype, MAN=man, BIAS=bias)


def quantize(out, descale, inp, absmax) -> None:
    """out (FP8, shape of inp) = saturate(inp * s), s = fp8_max / absmax (1 if 0); descale (fp32 0-d) = 1/s."""
    n = inp.numel()
    block = elementwise_block()
    grid = (max(1, triton.cdiv(n, block)),)
    _quantize_kernel[grid](fp8_store_view(out).reshape(-1), descale, inp.reshape(-1), absmax, n,
                           BLOCK=block, num_warps=num_warps_for(block), **_fp8_args(out.dtype))


def quantize_transpose(out_t, descale, inp, absmax) -> None:
    """out_t[K, M] (FP8) = quantize(inp[M, K])^T; descale as in quantize."""
    _launch_tiles(None, out_t, descale, inp, absmax)


# (BLOCK_M, BLOCK_K, num_warps) of the tile kernels that write an FP8 tensor transposed (and row-major) in one
# pass: "quantize" (quantize_with_transpose, quantize_transpose), "swiglu_fwd" / "swiglu_bwd" (the SwiGLU's FP8
# kernels, backends/triton/swiglu.py). Element-wise, so the tile never changes a byte written (the
# absmax is a max); only the speed: benchmarks/fp8_tiles.py times the candidates. Picked on an H100 at the 0.5B,
# 1.5B and 7B shapes (benchmarks/LOG.md, 2026-11-28): against 64 x 64 with 4 warps, the SwiGLU backward 1.18-1.19x,
# its forward 1.07-1.09x, the quantization 1.00-1.10x. The interpreter takes larger tiles (fewer programs to step
# through on a CPU). ``transpose`` (a byte copy of an FP8 tensor, no quantization) keeps its own 64 x 64 tiles.
TILES = {"quantize": (64, 128, 8), "swiglu_fwd": (32, 128, 8), "swiglu_bwd": (32, 128, 8)}
INTERPRET_TILES = (128, 128, 4)


def tile_config(kind: str) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_K, num_warps) of tile kernel ``kind`` (a key of TILES)."""
    return INTERPRET_TILES if INTERPRET else TILES[kind]


def _launch_tiles(out, out_t, descale, inp, absmax) -> None:
    m, k = inp.shape
    block_m, block_k, warps = tile_config("quantize")
    grid = (max(1, triton.cdiv(m, block_m)), max(1, triton.cdiv(k, block_k)))
    out_t_view = fp8_store_view(out_t)
    _quantize_tiles_kernel[grid](out_t_view if out is None else fp8_store_view(out), out_t_view, descale, inp,
                                 absmax, m, k, BLOCK_M=block_m, BLOCK_K=block_k, WRITE_ROWMAJOR=out is not None,
                                 num_warps=warps, **_fp8_args(out_t.dtype))


def quantize_with_transpose(out, out_t, descale, inp, absmax) -> None:
    """out[M, K] and out_t[K, M] (same FP8 dtype) = quantize(inp[M, K]) in both layouts, one read of inp."""
    if out.dtype != out_t.dtype:
        raise ValueError(f"quantize_with_transpose: out is {out.dtype} but out_t is {out_t.dtype}")
    if inp.dtype == torch.float32:
        # Triton 3.6 on sm_90 miscompiles the dual-store tile kernel for fp32 tiles without masked lanes: the
        # transposed copy comes out as constant garbage (-384 / -inf) while the row-major one is right (found by
        # tests/kernel_checks.py on an H100; bf16 inputs, the only ones FP8 training uses, are exact). fp32
        # inputs therefore take the two single-store kernels.
        quantize(out, descale, inp, absmax)
        _launch_tiles(None, out_t, descale, inp, absmax)
        return
    _launch_tiles(out, out_t, descale, inp, absmax)


@triton.jit
def _transpose_kernel(out_t_ptr, x_ptr, M, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], mask=mask)
    tl.store(out_t_ptr + cols.to(tl.int64)[None, :] * M + rows[:, None], x, mask=mask)


def transpose(out_t, inp) -> None:
    """out_t[K, M] = inp[M, K]^T for FP8 tensors (copied as bytes; one store layout per tile, as the tile
    kernel above)."""
    m, k = inp.shape
    if out_t.dtype != inp.dtype or tuple(out_t.shape) != (k, m) or not (inp.is_contiguous() and out_t.is_contiguous()):
        raise ValueError(f"transpose: out_t {out_t.dtype} {tuple(out_t.shape)} must be the contiguous transpose of "
                         f"inp {inp.dtype} {tuple(inp.shape)}")
    block = 128 if INTERPRET else 64
    grid = (max(1, triton.cdiv(m, block)), max(1, triton.cdiv(k, block)))
    _transpose_kernel[grid](out_t.view(torch.uint8), inp.view(torch.uint8), m, k, BLOCK_M=block, BLOCK_K=block,
                            num_warps=4)
