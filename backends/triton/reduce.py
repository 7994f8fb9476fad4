"""Deterministic device-side reductions: sum of squares (global norm), absolute max, and their finishers.

Two launches, no atomics, no host sync: (1) ``P`` programs (P <= MAX_REDUCE_PROGRAMS, a function of the size
only) each reduce a grid-stride share of the input into a register tile and write one fp32 partial;
(2) one program reduces the ``P`` partials in a fixed order and writes (or accumulates into) the scalar.
Every element is read exactly once, in wide coalesced loads; the fixed partition makes the result the same
bits on every run. The finishers are shared with the kernels that fuse an absmax into their epilogue
(rmsnorm, swiglu): they leave one partial max per program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backends.triton._common import MAX_REDUCE_PROGRAMS, elementwise_block, next_pow2, num_warps_for


@triton.jit
def _partial_kernel(x_ptr, part_ptr, n, BLOCK: tl.constexpr, SQUARES: tl.constexpr):
    """part[pid] = sum(x^2) (SQUARES) or max|x| over the elements pid*BLOCK + k*P*BLOCK + [0, BLOCK)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    acc = tl.zeros([BLOCK], tl.float32)
    idx = tl.arange(0, BLOCK)
    for start in range(pid.to(tl.int64) * BLOCK, n, nprog * BLOCK):
        offs = start + idx
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        if SQUARES:
            acc += x * x
        else:
            acc = tl.maximum(acc, tl.abs(x))
    if SQUARES:
        tl.store(part_ptr + pid, tl.sum(acc, axis=0))
    else:
        tl.store(part_ptr + pid, tl.max(acc, axis=0))


@triton.jit
def _finish_kernel(part_ptr, out_ptr, P, BLOCK_P: tl.constexpr, SUM: tl.constexpr, ACCUMULATE: tl.constexpr):
    """out = (out +) reduce(part[0:P]) with one program; sum (SUM) or max. Fixed order -> same bits."""
    idx = tl.arange(0, BLOCK_P)
    acc = tl.zeros([BLOCK_P], tl.float32)
    for start in range(0, P, BLOCK_P):
        x = tl.load(part_ptr + start + idx, mask=start + idx < P, other=0.0)
        if SUM:
            acc += x
        else:
            acc = tl.maximum(acc, x)
    if SUM:
        r = tl.sum(acc, axis=0)
    else:
        r = tl.max(acc, axis=0)
    if ACCUMULATE:
        r = tl.load(out_ptr) + r
    tl.store(out_ptr, r)


def finish(out: torch.Tensor, partials: torch.Tensor, *, sum_: bool, accumulate: bool) -> None:
    """Reduce the fp32 ``partials`` [P] into the fp32 scalar ``out`` (sum or max; overwrite or accumulate)."""
    p = partials.numel()
    block_p = min(next_pow2(p), 1024)
    _finish_kernel[(1,)](partials, out, p, BLOCK_P=block_p, SUM=sum_, ACCUMULATE=accumulate, num_warps=4)


def _reduce(out: torch.Tensor, x: torch.Tensor, squares: bool, accumulate: bool) -> None:
    flat = x.reshape(-1)
    n = flat.numel()
    block = elementwise_block()
    programs = max(1, min(triton.cdiv(n, block), MAX_REDUCE_PROGRAMS))
    partials = torch.empty(programs, dtype=torch.float32, device=x.device)
    if n:
        _partial_kernel[(programs,)](flat, partials, n, BLOCK=block, SQUARES=squares, num_warps=num_warps_for(block))
    else:
        partials.zero_()
    finish(out, partials, sum_=squares, accumulate=accumulate)


def global_norm_squared(out: torch.Tensor, tensor: torch.Tensor) -> None:
    """out (fp32 0-d) += sum(tensor^2) over any-shaped fp32/bf16 ``tensor``, in fp32, deterministic."""
    _reduce(out, tensor, squares=True, accumulate=True)


def absmax(out: torch.Tensor, inp: torch.Tensor) -> None:
    """out (fp32 0-d) = max |inp| (overwritten); inp any shape, any float dtype."""
    _reduce(out, inp, squares=False, accumulate=False)
