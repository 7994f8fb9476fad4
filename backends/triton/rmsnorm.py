"""RMSNorm forward (optionally fused with the residual add and an absmax) and backward.

Forward: a program owns BLOCK_R whole rows (the row, C <= a few thousand, fits in registers), so each input is
read once and each output written once: residual = inp1 + inp2 (rounded to the model dtype, and the
*rounded* value is what gets normalised, so a later ``rmsnorm_forward(residual)`` - used by recompute -
reproduces ``out`` bit for bit: same kernel, same tile, same reduction order), rstd = 1/sqrt(mean(x^2)+eps)
in fp32, out = x*rstd*w, and max|out| of the tile folded into the absmax atomically (reduce.atomic_amax),
so FP8 quantization of ``out`` needs no extra pass over memory.

Backward: again whole rows per program; dinp (+ dresidual, fused: the residual stream's gradient is added
where it is produced, dinp may alias dresidual) and, for dweight, each program accumulates sum_n dout*xhat of
its rows in fp32 registers and writes one partial row [P, C]; a second kernel sums the P partials per column
in a fixed order and adds them into dweight. No atomics: deterministic, and the [N, C] products never touch
memory. With ``absmax`` each program also keeps max|dinp| of its rows (the FP8 backward's dy scale).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmq_ray.backends.triton import reduce as _reduce
from llmq_ray.backends.triton.reduce import atomic_amax
from llmq_ray.backends.triton._common import cast_to, next_pow2, num_warps_for, tile_rows



@triton.jit
def _rmsnorm_fwd_kernel(out_ptr, rstd_ptr, x_ptr, x2_ptr, res_ptr, w_ptr, amax_ptr, N, C, eps,
                        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, RESIDUAL: tl.constexpr,
                        ABSMAX: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    rmask = rows < N
    cmask = cols < C
    mask = rmask[:, None] & cmask[None, :]
    offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if RESIDUAL:
        x2 = tl.load(x2_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        r = cast_to(x + x2, res_ptr.dtype.element_ty)
        tl.store(res_ptr + offs, r, mask=mask)
        x = r.to(tl.float32)  # normalise the stored (rounded) residual
    ms = tl.sum(x * x, axis=1) / C
    rstd = tl.div_rn(tl.full([BLOCK_R], 1.0, tl.float32), tl.sqrt_rn(ms + eps))
    tl.store(rstd_ptr + rows, rstd, mask=rmask)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    y = cast_to((x * rstd[:, None]) * w[None, :], out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs, y, mask=mask)
    if ABSMAX:
        atomic_amax(amax_ptr, tl.max(tl.max(tl.abs(y.to(tl.float32)), axis=1), axis=0))


@triton.jit
def _rmsnorm_bwd_kernel(dx_ptr, dw_part_ptr, dy_ptr, x_ptr, w_ptr, rstd_ptr, dres_ptr, amax_ptr, N, C,
                        rows_per_prog, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, DRESIDUAL: tl.constexpr,
                        ABSMAX: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_C)
    cmask = cols < C
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    amax = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    row0 = pid * rows_per_prog
    for r in range(0, rows_per_prog, BLOCK_R):
        rows = row0 + r + tl.arange(0, BLOCK_R)
        rmask = rows < N
        mask = rmask[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
        xhat = x * rstd[:, None]
        dw += g * xhat
        gw = g * w[None, :]
        dot = tl.sum(gw * xhat, axis=1) / C
        dx = rstd[:, None] * (gw - xhat * dot[:, None])
        if DRESIDUAL:
            dx += tl.load(dres_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dx = cast_to(dx, dx_ptr.dtype.element_ty)
        tl.store(dx_ptr + offs, dx, mask=mask)
        if ABSMAX:  # masked lanes hold 0
            amax = tl.maximum(amax, tl.abs(dx.to(tl.float32)))
    tl.store(dw_part_ptr + pid * C + cols, tl.sum(dw, axis=0), mask=cmask)
    if ABSMAX:
        atomic_amax(amax_ptr, tl.max(tl.max(amax, axis=1), axis=0))


def _row_blocks(c: int) -> tuple[int, int]:
    block_c = next_pow2(c)
    return tile_rows(block_c), block_c


def rmsnorm_forward(out, rstd, inp, weight, eps, absmax=None, *, inp2=None, residual=None) -> None:
    """out[N, C] = x * rstd * weight, rstd[N] fp32; x = inp, or (when inp2/residual are given)
    residual[N, C] = round(inp + inp2) and x = residual. absmax (fp32 0-d) = max|out| when given."""
    n, c = inp.shape
    block_r, block_c = _row_blocks(c)
    programs = triton.cdiv(n, block_r)
    if absmax is not None:
        _reduce.start_amax(absmax)
    fused = residual is not None
    _rmsnorm_fwd_kernel[(programs,)](
        out, rstd, inp, inp2 if fused else inp, residual if fused else out, weight,
        absmax if absmax is not None else rstd, n, c, float(eps), BLOCK_R=block_r, BLOCK_C=block_c, RESIDUAL=fused,
        ABSMAX=absmax is not None, num_warps=num_warps_for(block_r * block_c))


def rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd, dresidual=None, absmax=None) -> None:
    """dinp[N, C] = rmsnorm'(inp)^T dout (+ dresidual); dweight[C] += sum_n dout * inp * rstd; absmax (fp32
    0-d) = max|dinp| when given (each program folds its tile's max in atomically)."""
    n, c = inp.shape
    block_c = next_pow2(c)
    block_r, programs, rows_per_prog = _reduce.partial_rows_plan(n, block_c)
    part = torch.empty(programs, c, dtype=torch.float32, device=inp.device)
    if absmax is not None:
        _reduce.start_amax(absmax)
    _rmsnorm_bwd_kernel[(programs,)](
        dinp, part, dout, inp, weight, rstd, dresidual if dresidual is not None else dinp,
        absmax if absmax is not None else rstd, n, c,
        rows_per_prog, BLOCK_R=block_r, BLOCK_C=block_c, DRESIDUAL=dresidual is not None,
        ABSMAX=absmax is not None, num_warps=num_warps_for(block_r * block_c))
    _reduce.column_sum_into(dweight, part)
