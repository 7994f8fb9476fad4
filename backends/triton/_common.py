"""Shared pieces of the Triton kernels: interpreter detection, exact dtype conversions, launch sizes.

Why a software conversion path: under ``TRITON_INTERPRET=1`` (CPU, tests) Triton's fp32 -> bf16 cast
truncates instead of rounding to nearest even, and its fp32 -> fp8 casts lose the carry into the exponent,
round ties away from zero and mishandle subnormals (seen with triton 3.9). On the GPU the native ``cvt``
instructions are right (round-to-nearest-even, saturating for fp8). So every kernel writes its model-dtype /
FP8 outputs through :func:`cast_to` / :func:`cast_fp8`: on the GPU these are the plain native casts, under the
interpreter an integer re-implementation of round-to-nearest-even. The constexpr ``SOFT_CVT`` picks one at
compile time, so the GPU code never contains the software path.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
SOFT_CVT = tl.constexpr(INTERPRET)

# Upper bound on the programs of grid-stride reductions: fixed (not the SM count) so that partial sums,
# hence the reduced bits, are the same on every GPU type and every run.
MAX_REDUCE_PROGRAMS = 1024


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def num_warps_for(elements: int) -> int:
    """Warps for a program that holds ``elements`` values in registers (GPU only; ignored by the interpreter)."""
    if elements <= 1024:
        return 4
    if elements <= 8192:
        return 8
    return 16


def tile_rows(block_c: int, interpret_elems: int = 16384, gpu_elems: int = 4096) -> int:
    """Rows per program for row-wise kernels whose whole row (block_c wide) sits in one tile."""
    budget = interpret_elems if INTERPRET else gpu_elems
    return max(1, budget // block_c)


def elementwise_block() -> int:
    """Elements per program of the flat element-wise / reduction kernels."""
    return 16384 if INTERPRET else 4096


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def fp8_params(dtype: torch.dtype) -> tuple[int, int]:
    """(mantissa bits, exponent bias) of the two FP8 formats."""
    if dtype == torch.float8_e4m3fn:
        return 3, 7
    if dtype == torch.float8_e5m2:
        return 2, 15
    raise TypeError(f"FP8 output must be float8_e4m3fn or float8_e5m2, got {dtype}")


def fp8_store_view(t: torch.Tensor) -> torch.Tensor:
    """The FP8 tensor as the kernels see it: itself on the GPU, its uint8 bytes under the interpreter
    (the software conversion produces the bit patterns)."""
    return t.view(torch.uint8) if INTERPRET else t


@triton.jit
def _soft_bf16(x):
    """fp32 -> bf16 round-to-nearest-even from the bits (interpreter only). nan -> canonical nan."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    nan = tl.full(x.shape, 0x7FC00000, tl.uint32).to(tl.float32, bitcast=True)
    y = tl.where(x != x, nan, rounded.to(tl.float32, bitcast=True))
    return y.to(tl.bfloat16)  # exact: the low 16 bits are zero (the interpreter's truncation is harmless)


@triton.jit
def cast_to(x, dtype: tl.constexpr):
    """fp32 x -> dtype (fp32 / bf16 / fp16), round to nearest even on the GPU and under the interpreter."""
    if SOFT_CVT:
        if dtype == tl.bfloat16:
            y = _soft_bf16(x)
        else:
            y = x.to(dtype)
    else:
        y = x.to(dtype)
    return y


@triton.jit
def cast_fp8(x, FP8_DTYPE: tl.constexpr, MAN: tl.constexpr, BIAS: tl.constexpr):
    """fp32 x (already clamped to +-fp8 max) -> FP8. GPU: the native saturating RNE cvt into FP8_DTYPE.
    Interpreter: the uint8 bit pattern (the caller passes the output as uint8), computed exactly:
    normals round their fp32 mantissa to MAN bits (carry may bump the exponent), subnormals round
    |x| / 2^(1-BIAS-MAN) to an integer (which *is* the code, up to the smallest normal)."""
    if SOFT_CVT:
        a = tl.abs(x)
        bits = a.to(tl.int32, bitcast=True)
        SHIFT: tl.constexpr = 23 - MAN
        rb = ((bits + ((1 << (SHIFT - 1)) - 1) + ((bits >> SHIFT) & 1)) >> SHIFT)  # exp|mantissa, MAN bits
        normal_code = rb - ((127 - BIAS) << MAN)
        min_normal = 2.0 ** (1 - BIAS)
        q = tl.minimum(a, min_normal) * (2.0 ** (BIAS + MAN - 1))  # |x| in subnormal spacings (exact)
        sub_code = ((q + 8388608.0) - 8388608.0).to(tl.int32)  # RNE to an integer in fp32 (q < 2^MAN+1)
        code = tl.where(a < min_normal, sub_code, normal_code)
        sign = tl.where(x.to(tl.int32, bitcast=True) < 0, 128, 0)
        y = (code | sign).to(tl.uint8)
    else:
        y = x.to(FP8_DTYPE)
    return y
