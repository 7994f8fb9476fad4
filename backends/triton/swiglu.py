"""SwiGLU forward (with a fused absmax for FP8) and backward over the fused up+gate GEMM output.

inp[N, 2I] = [up | gate]; out[N, I] = up * silu(gate). Element-wise over [BLOCK_R, BLOCK_I] tiles: each
input read once, each output written once (the forward never materialises silu(gate); the backward recomputes
sigmoid(gate) instead of saving it). The forward's max|out| leaves one partial per program (finished by one
tiny kernel), so quantizing ``out`` for the down-projection's FP8 GEMM needs no extra pass over memory; the
backward does the same for max|dinp|, the scale of the up+gate GEMM's FP8 gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backends.triton import reduce as _reduce
from backends.triton._common import INTERPRET, cast_to, next_pow2, num_warps_for


@triton.jit
def _swiglu_fwd_kernel(out_ptr, inp_ptr, amax_part_ptr, N, I, BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr,
                       ABSMAX: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (rows < N)[:, None] & (cols < I)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    up = tl.load(inp_ptr + r64 * (2 * I) + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(inp_ptr + r64 * (2 * I) + I + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = cast_to(up * (gate / (1.0 + tl.exp(-gate))), out_ptr.dtype.element_ty)
    tl.store(out_ptr + r64 * I + cols[None, :], y, mask=mask)
    if ABSMAX:
        part = tl.max(tl.max(tl.abs(y.to(tl.float32)), axis=1), axis=0)
        tl.store(amax_part_ptr + pid_r * tl.num_programs(1) + pid_c, part)


@triton.jit
def _swiglu_bwd_kernel(dinp_ptr, dout_ptr, inp_ptr, amax_part_ptr, N, I, BLOCK_R: tl.constexpr,
                       BLOCK_I: tl.constexpr, ABSMAX: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (rows < N)[:, None] & (cols < I)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    up_offs = r64 * (2 * I) + cols[None, :]
    up = tl.load(inp_ptr + up_offs, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(inp_ptr + up_offs + I, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(dout_ptr + r64 * I + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-gate))
    dup = g * (gate * sig)
    dgate = g * up * sig * (1.0 + gate * (1.0 - sig))
    dup = cast_to(dup, dinp_ptr.dtype.element_ty)
    dgate = cast_to(dgate, dinp_ptr.dtype.element_ty)
    tl.store(dinp_ptr + up_offs, dup, mask=mask)
    tl.store(dinp_ptr + up_offs + I, dgate, mask=mask)
    if ABSMAX:  # of the stored values: dinp is the FP8 up+gate GEMM's dy (masked lanes hold 0)
        both = tl.maximum(tl.abs(dup.to(tl.float32)), tl.abs(dgate.to(tl.float32)))
        part = tl.max(tl.max(both, axis=1), axis=0)
        tl.store(amax_part_ptr + pid_r * tl.num_programs(1) + pid_c, part)


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
    part = torch.empty(grid[0] * grid[1], dtype=torch.float32, device=out.device) if absmax is not None else out
    _swiglu_fwd_kernel[grid](out, inp, part, n, i, BLOCK_R=block_r, BLOCK_I=block_i, ABSMAX=absmax is not None,
                             num_warps=num_warps_for(block_r * block_i))
    if absmax is not None:
        _reduce.finish(absmax, part, sum_=False, accumulate=False)


def swiglu_backward(dinp, dout, inp, absmax=None) -> None:
    """dinp[N, 2I] = [dout * silu(gate) | dout * up * silu'(gate)]; absmax (fp32 0-d) = max|dinp| when given
    (the FP8 backward's dy scale, without another pass over the 2I-wide gradient)."""
    n, i = dout.shape
    block_r, block_i = _tiles(n, i)
    grid = (triton.cdiv(n, block_r), triton.cdiv(i, block_i))
    part = torch.empty(grid[0] * grid[1], dtype=torch.float32, device=dinp.device) if absmax is not None else dinp
    _swiglu_bwd_kernel[grid](dinp, dout, inp, part, n, i, BLOCK_R=block_r, BLOCK_I=block_i,
                             ABSMAX=absmax is not None, num_warps=num_warps_for(block_r * block_i))
    if absmax is not None:
        _reduce.finish(absmax, part, sum_=False, accumulate=False)
