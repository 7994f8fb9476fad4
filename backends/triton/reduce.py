"""Deterministic device-side reductions: sum of squares (global norm) and absolute max.

Sum of squares: two launches, no atomics, no host sync: (1) ``P`` programs (P <= MAX_REDUCE_PROGRAMS, a
function of the size only) each reduce a grid-stride share of the input into a register tile and write one
fp32 partial; (2) one program adds the ``P`` partials in a fixed order into the scalar.
Every element is read exactly once, in wide coalesced loads; the fixed partition makes the result the same
bits on every run.

Absolute maxima need no second launch: each program folds its partial max into the fp32 result with an
integer atomic max on the bits (``atomic_amax``; for values >= 0 the bit patterns order as the floats do, so
the result is exact and does not depend on the order in which programs finish). The result must start at 0:
``start_amax`` zeroes it (a 4-byte memset, cheaper on the GPU than a one-program finishing kernel). The kernels
that fuse an absmax into their epilogue (rmsnorm, swiglu, the bias gradient) use the same two pieces.

Per-column sums of partial rows (the weight gradients of the norms and the bias gradient): a kernel writes one
fp32 partial row per program over a fixed partition of the rows (``partial_rows_plan``), and
``column_sum_into`` adds them per column in a fixed order into the gradient (one rounding): no atomics, the
same bits on every run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmq_ray.backends.triton._common import (INTERPRET, MAX_REDUCE_PROGRAMS, cast_to, elementwise_block, next_pow2,
                                              num_warps_for, tile_rows)

PARTIAL_ROWS_MAX = 512  # partial rows of a column sum; fixed, so the reduction order depends on the row count only


@triton.jit
def _partial_kernel(x_ptr, part_ptr, n, BLOCK: tl.constexpr):
    """part[pid] = sum(x^2) over the elements pid*BLOCK + k*P*BLOCK + [0, BLOCK)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    acc = tl.zeros([BLOCK], tl.float32)
    idx = tl.arange(0, BLOCK)
    for start in range(pid.to(tl.int64) * BLOCK, n, nprog * BLOCK):
        offs = start + idx
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        acc += x * x
    tl.store(part_ptr + pid, tl.sum(acc, axis=0))


@triton.jit
def atomic_amax(amax_ptr, value):
    """*amax_ptr = max(*amax_ptr, value) for an fp32 value >= 0 (|x| of something): an int32 atomic max on the
    bits, exact and independent of the order of the programs."""
    tl.atomic_max(amax_ptr.to(tl.pointer_type(tl.int32)), value.to(tl.int32, bitcast=True))


def start_amax(amax: torch.Tensor) -> None:
    """Zero the fp32 0-d ``amax`` before kernels fold their maxima into it with ``atomic_amax`` (which writes
    fp32 bits: another dtype would be corrupted, so it is refused)."""
    if amax.dtype != torch.float32:
        raise ValueError(f"absmax must be an fp32 tensor, got {amax.dtype}")
    amax.zero_()


@triton.jit
def _amax_kernel(x_ptr, amax_ptr, n, BLOCK: tl.constexpr):
    """*amax_ptr = max(*amax_ptr, max|x|) over the elements pid*BLOCK + k*P*BLOCK + [0, BLOCK)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    acc = tl.zeros([BLOCK], tl.float32)
    idx = tl.arange(0, BLOCK)
    for start in range(pid.to(tl.int64) * BLOCK, n, nprog * BLOCK):
        offs = start + idx
        acc = tl.maximum(acc, tl.abs(tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)))
    atomic_amax(amax_ptr, tl.max(acc, axis=0))


@triton.jit
def _finish_kernel(part_ptr, out_ptr, P, BLOCK_P: tl.constexpr):
    """out += sum(part[0:P]) with one program, in a fixed order (the same bits on every run)."""
    idx = tl.arange(0, BLOCK_P)
    acc = tl.zeros([BLOCK_P], tl.float32)
    for start in range(0, P, BLOCK_P):
        acc += tl.load(part_ptr + start + idx, mask=start + idx < P, other=0.0)
    tl.store(out_ptr, tl.load(out_ptr) + tl.sum(acc, axis=0))


def global_norm_squared(out: torch.Tensor, tensor: torch.Tensor) -> None:
    """out (fp32 0-d) += sum(tensor^2) over any-shaped fp32/bf16 ``tensor``, in fp32, deterministic."""
    flat = tensor.reshape(-1)
    n = flat.numel()
    if not n:
        return
    block = elementwise_block()
    programs = max(1, min(triton.cdiv(n, block), MAX_REDUCE_PROGRAMS))
    partials = torch.empty(programs, dtype=torch.float32, device=tensor.device)
    _partial_kernel[(programs,)](flat, partials, n, BLOCK=block, num_warps=num_warps_for(block))
    _finish_kernel[(1,)](partials, out, programs, BLOCK_P=min(next_pow2(programs), 1024), num_warps=4)


def absmax(out: torch.Tensor, inp: torch.Tensor) -> None:
    """out (fp32 0-d) = max |inp| (overwritten); inp any shape, any float dtype. One launch after a memset."""
    flat = inp.reshape(-1)
    n = flat.numel()
    block = elementwise_block()
    start_amax(out)
    if n:
        programs = max(1, min(triton.cdiv(n, block), MAX_REDUCE_PROGRAMS))
        _amax_kernel[(programs,)](flat, out, n, BLOCK=block, num_warps=num_warps_for(block))


@triton.jit
def _column_sum_kernel(out_ptr, part_ptr, P, C, stride_p, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """out[C] += sum_p part[p, C] (rows ``stride_p`` apart; fp32 sum in a fixed order, one rounding into out's
    dtype)."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    acc = tl.zeros([BLOCK_P, BLOCK_C], tl.float32)
    for start in range(0, P, BLOCK_P):
        rows = start + tl.arange(0, BLOCK_P)
        m = (rows < P)[:, None] & cmask[None, :]
        acc += tl.load(part_ptr + rows[:, None] * stride_p + cols[None, :], mask=m, other=0.0)
    total = tl.load(out_ptr + cols, mask=cmask, other=0.0).to(tl.float32) + tl.sum(acc, axis=0)
    tl.store(out_ptr + cols, cast_to(total, out_ptr.dtype.element_ty), mask=cmask)


def column_sum_into(out: torch.Tensor, part: torch.Tensor) -> None:
    """out[C] += part[P, C].sum(0): fp32 partial rows (unit column stride, any row stride) summed per column in
    a fixed order, one rounding into out. Narrow column blocks (32 on the GPU): C/32 programs keep the GPU busy
    where C/256 left it idle for ~35 us per call (1.7 ms per 0.5B step, H100 profile); the order per column does
    not depend on the block."""
    p, c = part.shape
    col_block = min(next_pow2(c), 256 if INTERPRET else 32)
    block_p = min(next_pow2(p), 64 if INTERPRET else 16)
    _column_sum_kernel[(triton.cdiv(c, col_block),)](out, part, p, c, part.stride(0), BLOCK_P=block_p,
                                                     BLOCK_C=col_block, num_warps=4)


def partial_rows_plan(rows: int, block_c: int) -> tuple[int, int, int]:
    """(rows per tile, programs, rows per program) for a kernel that walks ``rows`` rows of ``block_c``-wide
    tiles and writes one partial row per program: at most PARTIAL_ROWS_MAX programs (8 under the interpreter), a
    function of ``rows`` only, so the column sums' order is too."""
    block_r = tile_rows(block_c, interpret_elems=16384, gpu_elems=2048)
    row_blocks = triton.cdiv(rows, block_r)
    programs = max(1, min(row_blocks, PARTIAL_ROWS_MAX if not INTERPRET else 8))
    rows_per_prog = triton.cdiv(row_blocks, programs) * block_r
    return block_r, triton.cdiv(rows, rows_per_prog), rows_per_prog
