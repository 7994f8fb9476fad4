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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmq_ray.backends.triton._common import MAX_REDUCE_PROGRAMS, elementwise_block, next_pow2, num_warps_for


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
