"""LayerNorm with weight and bias (GPT-2's ln_1, ln_2, ln_f): forward, optionally fused with the residual add and
an absmax, and backward with deterministic weight and bias gradients.

Forward: a program owns BLOCK_R whole rows (C <= a few thousand: the row is one register tile), so each input is
read once and each output written once. With the residual fused in, residual = inp1 + inp2 is rounded to the
model dtype first and the *rounded* value is what gets normalised, so a later ``layernorm_forward(residual)``
(recompute) gives the same bits: same kernel, same tile, same reduction order. Statistics in fp32: mean = sum(x)/C,
then the biased variance from the centred values (two passes over registers, not E[x^2] - E[x]^2, which cancels),
rstd = 1/sqrt(var + eps); out = (x - mean)*rstd*w + b rounded once. max|out| of the tile is folded into the absmax
atomically (reduce.atomic_amax), so quantizing ``out`` for the next GEMM's FP8 input needs no extra pass.

Backward: whole rows per program again. With xhat = (x - mean)*rstd and gw = dout*w,
dx = rstd*(gw - mean(gw) - xhat*mean(gw*xhat)) (+ dresidual, fused: dinp may alias dresidual). For the weight
and bias gradients a fixed number of programs (a function of N only) each walk a contiguous range of rows,
accumulate sum dout*xhat and sum dout of their rows in fp32 registers and write one partial row each into
part[2, P, C]; a second kernel sums the P partials per column in a fixed order and adds them into dweight and
dbias (one rounding each). No atomics for the gradients: the same bits on every run, and the [N, C] products never
touch memory. With ``absmax`` each program also keeps max|dinp| of the stored values (the FP8 dy scale of the
projection below).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmq_ray.backends.triton import reduce as _reduce
from llmq_ray.backends.triton.reduce import atomic_amax
from llmq_ray.backends.triton._common import cast_to, next_pow2, num_warps_for, tile_rows



@triton.jit
def _layernorm_fwd_kernel(out_ptr, mean_ptr, rstd_ptr, x_ptr, x2_ptr, res_ptr, w_ptr, b_ptr, amax_ptr, N, C, eps,
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
    mean = tl.sum(x, axis=1) / C
    xc = tl.where(mask, x - mean[:, None], 0.0)  # padded lanes stay out of the variance
    var = tl.sum(xc * xc, axis=1) / C
    rstd = tl.div_rn(tl.full([BLOCK_R], 1.0, tl.float32), tl.sqrt_rn(var + eps))
    tl.store(mean_ptr + rows, mean, mask=rmask)
    tl.store(rstd_ptr + rows, rstd, mask=rmask)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    y = cast_to((xc * rstd[:, None]) * w[None, :] + b[None, :], out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs, y, mask=mask)
    if ABSMAX:  # padded lanes hold w = b = 0, hence 0
        atomic_amax(amax_ptr, tl.max(tl.max(tl.abs(y.to(tl.float32)), axis=1), axis=0))


@triton.jit
def _layernorm_bwd_kernel(dx_ptr, part_ptr, dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dres_ptr, amax_ptr, N, C,
                          P, rows_per_prog, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, DRESIDUAL: tl.constexpr,
                          ABSMAX: tl.constexpr):
    """dx rows [pid*rows_per_prog, ...) and the partial rows part[0, pid] = sum dy*xhat, part[1, pid] = sum dy."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_C)
    cmask = cols < C
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    db = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    amax = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    row0 = pid * rows_per_prog
    for r in range(0, rows_per_prog, BLOCK_R):
        rows = row0 + r + tl.arange(0, BLOCK_R)
        rmask = rows < N
        mask = rmask[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + rows, mask=rmask, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        dw += g * xhat
        db += g
        gw = g * w[None, :]  # 0 on padded lanes
        mean_gw = tl.sum(gw, axis=1) / C
        mean_gwx = tl.sum(gw * xhat, axis=1) / C
        dx = rstd[:, None] * (gw - mean_gw[:, None] - xhat * mean_gwx[:, None])
        if DRESIDUAL:
            dx += tl.load(dres_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dx = cast_to(dx, dx_ptr.dtype.element_ty)
        tl.store(dx_ptr + offs, dx, mask=mask)
        if ABSMAX:
            amax = tl.maximum(amax, tl.where(mask, tl.abs(dx.to(tl.float32)), 0.0))
    tl.store(part_ptr + pid * C + cols, tl.sum(dw, axis=0), mask=cmask)
    tl.store(part_ptr + (P + pid) * C + cols, tl.sum(db, axis=0), mask=cmask)
    if ABSMAX:
        atomic_amax(amax_ptr, tl.max(tl.max(amax, axis=1), axis=0))


def _check(what: str, n: int, c: int, **vectors: torch.Tensor) -> None:
    for name, t in vectors.items():
        if t.numel() != (c if name in ("weight", "bias", "dweight", "dbias") else n):
            raise ValueError(f"{what}: {name} has shape {tuple(t.shape)} for inp [{n}, {c}]")
        if name in ("mean", "rstd") and t.dtype != torch.float32:
            raise ValueError(f"{what}: {name} must be fp32, got {t.dtype}")


def layernorm_forward(out, mean, rstd, inp, weight, bias, eps, absmax=None, *, inp2=None, residual=None) -> None:
    """out[N, C] = (x - mean)*rstd*weight + bias, mean[N] / rstd[N] fp32; x = inp, or (when inp2/residual are
    given) residual[N, C] = round(inp + inp2) and x = residual. absmax (fp32 0-d) = max|out| when given."""
    n, c = inp.shape
    _check("layernorm_forward", n, c, mean=mean, rstd=rstd, weight=weight, bias=bias)
    block_c = next_pow2(c)
    block_r = tile_rows(block_c)
    if absmax is not None:
        _reduce.start_amax(absmax)
    fused = residual is not None
    _layernorm_fwd_kernel[(triton.cdiv(n, block_r),)](
        out, mean, rstd, inp, inp2 if fused else inp, residual if fused else out, weight, bias,
        absmax if absmax is not None else rstd, n, c, float(eps), BLOCK_R=block_r, BLOCK_C=block_c, RESIDUAL=fused,
        ABSMAX=absmax is not None, num_warps=num_warps_for(block_r * block_c))


def layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, dresidual=None, absmax=None) -> None:
    """dinp[N, C] = layernorm'(inp)^T dout (+ dresidual); dweight[C] += sum_n dout*xhat, dbias[C] += sum_n dout
    (deterministic); absmax (fp32 0-d) = max|dinp| when given."""
    n, c = inp.shape
    _check("layernorm_backward", n, c, mean=mean, rstd=rstd, weight=weight, dweight=dweight, dbias=dbias)
    block_c = next_pow2(c)
    block_r, programs, rows_per_prog = _reduce.partial_rows_plan(n, block_c)
    part = torch.empty(2, programs, c, dtype=torch.float32, device=inp.device)
    if absmax is not None:
        _reduce.start_amax(absmax)
    _layernorm_bwd_kernel[(programs,)](
        dinp, part, dout, inp, weight, mean, rstd, dresidual if dresidual is not None else dinp,
        absmax if absmax is not None else rstd, n, c, programs, rows_per_prog, BLOCK_R=block_r, BLOCK_C=block_c,
        DRESIDUAL=dresidual is not None, ABSMAX=absmax is not None, num_warps=num_warps_for(block_r * block_c))
    _reduce.column_sum_into(dweight, part[0])
    _reduce.column_sum_into(dbias, part[1])
