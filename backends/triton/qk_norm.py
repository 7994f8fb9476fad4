"""Qwen3's QK-norm: a per-head RMSNorm of the query and key heads of the fused qkv buffer, forward and backward.

qkv[B, T, Hq + 2*Hkv, D]: the Hq + Hkv query and key head vectors of each token are the rows that get
normalised (value heads are never read or written). The kernels see them as R = N*(Hq + Hkv) "head rows" of D
values: head row r is head h = r % (Hq + Hkv) of token n = r // (Hq + Hkv), at n*(Hq + 2*Hkv)*D + h*D in qkv
and at r*D in ``saved`` [N, Hq + Hkv, D] / r in ``rstd`` [N, Hq + Hkv]. The weight of a row is q_weight [D] for
h < Hq and k_weight [D] otherwise (one [D] vector each, shared by all heads), picked per row in registers.

Forward: a program owns BLOCK_R whole head rows (D <= a few hundred: the row is one tile): it reads x once,
writes it to ``saved`` unchanged (the backward's input, model dtype), rstd = 1/sqrt(mean(x^2) + eps) (fp32),
and y = (x*rstd)*w rounded once into qkv in place. One read and two writes of the q/k part, nothing else.
Recompute (``--recompute-qkv``) runs the same kernel on the same input: the same bits.

Backward (in place on dqkv's q/k heads): per head row g = dy, xhat = x*rstd, gw = g*w,
dx = rstd*(gw - xhat*mean(gw*xhat)); the weight gradients are deterministic as in rmsnorm.py: a fixed number of
programs (a function of R only) each walk a contiguous range of head rows, accumulate sum g*xhat in fp32
registers separately for query rows and key rows, and write one partial row [2, D] (q then k); a second
kernel sums the P partials per column in a fixed order and adds them into q_weight's and k_weight's gradients
(one rounding each). No atomics: the same bits on every run.

Not fused with RoPE. The rope kernel (rope.py: a program per token over all its q/k heads) would take a
normalisation step easily, but the model calls qk_norm_forward and rope_forward as two protocol ops, and in
the backward the inverse RoPE is already fused into the attention backward's output (rope_backward_from /
attention_rope_backward), so a fused pair would need a new protocol op on every backend; the QK-norm costs one
extra read and write of the q/k part of qkv per pass, a few percent of a layer's QKV traffic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmq_ray.backends.triton import reduce as _reduce
from llmq_ray.backends.triton._common import cast_to, next_pow2, num_warps_for, tile_rows

MAX_HEAD_DIM = 1024     # a head row is one register tile


@triton.jit
def _qk_norm_fwd_kernel(qkv_ptr, saved_ptr, rstd_ptr, wq_ptr, wk_ptr, R, n_heads, n_q, stride_tok, D, eps,
                        BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    rmask = rows < R
    cmask = cols < D
    mask = rmask[:, None] & cmask[None, :]
    rows64 = rows.to(tl.int64)
    head = rows % n_heads
    offs = (rows64 // n_heads * stride_tok + head * D)[:, None] + cols[None, :]
    x_raw = tl.load(qkv_ptr + offs, mask=mask, other=0.0)
    tl.store(saved_ptr + rows64[:, None] * D + cols[None, :], x_raw, mask=mask)
    x = x_raw.to(tl.float32)
    ms = tl.sum(x * x, axis=1) / D
    rstd = tl.div_rn(tl.full([BLOCK_R], 1.0, tl.float32), tl.sqrt_rn(ms + eps))
    tl.store(rstd_ptr + rows, rstd, mask=rmask)
    wq = tl.load(wq_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    wk = tl.load(wk_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    w = tl.where((head < n_q)[:, None], wq[None, :], wk[None, :])
    y = cast_to((x * rstd[:, None]) * w, qkv_ptr.dtype.element_ty)
    tl.store(qkv_ptr + offs, y, mask=mask)


@triton.jit
def _qk_norm_bwd_kernel(dqkv_ptr, part_ptr, saved_ptr, rstd_ptr, wq_ptr, wk_ptr, R, n_heads, n_q, stride_tok, D,
                        rows_per_prog, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    wq = tl.load(wq_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    wk = tl.load(wk_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    dwq = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    dwk = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    row0 = pid * rows_per_prog
    for r in range(0, rows_per_prog, BLOCK_R):
        rows = row0 + r + tl.arange(0, BLOCK_R)
        rmask = rows < R
        mask = rmask[:, None] & cmask[None, :]
        rows64 = rows.to(tl.int64)
        head = rows % n_heads
        is_q = (head < n_q)[:, None]
        offs = (rows64 // n_heads * stride_tok + head * D)[:, None] + cols[None, :]
        g = tl.load(dqkv_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(saved_ptr + rows64[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
        xhat = x * rstd[:, None]
        gx = g * xhat  # masked lanes hold 0
        dwq += tl.where(is_q, gx, 0.0)
        dwk += tl.where(is_q, 0.0, gx)
        gw = g * tl.where(is_q, wq[None, :], wk[None, :])
        dot = tl.sum(gw * xhat, axis=1) / D
        dx = rstd[:, None] * (gw - xhat * dot[:, None])
        tl.store(dqkv_ptr + offs, cast_to(dx, dqkv_ptr.dtype.element_ty), mask=mask)
    base = part_ptr + pid * 2 * D
    tl.store(base + cols, tl.sum(dwq, axis=0), mask=cmask)
    tl.store(base + D + cols, tl.sum(dwk, axis=0), mask=cmask)


def _check(name, qkv, saved, rstd, q_weight, k_weight, n_q_heads, n_kv_heads) -> tuple[int, int, int]:
    """Shape / dtype / layout checks shared by both directions; returns (N, Hq + Hkv, D)."""
    for t in (qkv, saved, rstd, q_weight, k_weight):
        if not t.is_contiguous():
            raise ValueError(f"{name}: expected contiguous tensors, got shape {tuple(t.shape)} strides {t.stride()}")
    d = qkv.shape[-1]
    h = n_q_heads + n_kv_heads
    if qkv.dim() < 2 or qkv.shape[-2] != n_q_heads + 2 * n_kv_heads:
        raise ValueError(f"{name}: qkv {tuple(qkv.shape)} is not [..., Hq + 2*Hkv = {n_q_heads + 2 * n_kv_heads}, D]")
    n = qkv.numel() // ((n_q_heads + 2 * n_kv_heads) * d)
    if tuple(saved.shape) != (n, h, d) or saved.dtype != qkv.dtype:
        raise ValueError(f"{name}: saved {tuple(saved.shape)} {saved.dtype} must be [{n}, {h}, {d}] {qkv.dtype}")
    if tuple(rstd.shape) != (n, h) or rstd.dtype != torch.float32:
        raise ValueError(f"{name}: rstd {tuple(rstd.shape)} {rstd.dtype} must be [{n}, {h}] fp32")
    if tuple(q_weight.shape) != (d,) or tuple(k_weight.shape) != (d,):
        raise ValueError(f"{name}: q/k weights {tuple(q_weight.shape)} / {tuple(k_weight.shape)} must be [{d}]")
    if d > MAX_HEAD_DIM:
        raise ValueError(f"{name}: head dim {d} is larger than the kernel's {MAX_HEAD_DIM} (one row per tile)")
    return n, h, d


def qk_norm_forward(qkv, saved, rstd, q_weight, k_weight, n_q_heads: int, n_kv_heads: int, eps: float) -> None:
    """Normalise the q and k heads of qkv[..., Hq + 2*Hkv, D] in place; saved[N, Hq+Hkv, D] = their inputs,
    rstd[N, Hq+Hkv] (fp32) = their 1/rms (backends/base.py: Backend.qk_norm_forward)."""
    n, h, d = _check("qk_norm_forward", qkv, saved, rstd, q_weight, k_weight, n_q_heads, n_kv_heads)
    rows = n * h
    if rows == 0:
        return
    block_d = next_pow2(d)
    block_r = tile_rows(block_d)
    _qk_norm_fwd_kernel[(triton.cdiv(rows, block_r),)](
        qkv, saved, rstd, q_weight, k_weight, rows, h, n_q_heads, (n_q_heads + 2 * n_kv_heads) * d, d, float(eps),
        BLOCK_R=block_r, BLOCK_D=block_d, num_warps=num_warps_for(block_r * block_d))


def qk_norm_backward(dqkv, dq_weight, dk_weight, saved, rstd, q_weight, k_weight, n_q_heads: int,
                     n_kv_heads: int) -> None:
    """dqkv's q/k heads (in place) from the normalised heads' gradient to their inputs'; dq_weight / dk_weight
    [D] += the weights' gradients (deterministic two-kernel reduction; Backend.qk_norm_backward)."""
    n, h, d = _check("qk_norm_backward", dqkv, saved, rstd, q_weight, k_weight, n_q_heads, n_kv_heads)
    for name, t in (("dq_weight", dq_weight), ("dk_weight", dk_weight)):
        if tuple(t.shape) != (d,) or not t.is_contiguous():
            raise ValueError(f"qk_norm_backward: {name} {tuple(t.shape)} must be a contiguous [{d}]")
    rows = n * h
    if rows == 0:
        return
    block_d = next_pow2(d)
    block_r, programs, rows_per_prog = _reduce.partial_rows_plan(rows, block_d)
    part = torch.empty(programs, 2 * d, dtype=torch.float32, device=dqkv.device)
    _qk_norm_bwd_kernel[(programs,)](
        dqkv, part, saved, rstd, q_weight, k_weight, rows, h, n_q_heads, (n_q_heads + 2 * n_kv_heads) * d, d,
        rows_per_prog, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=num_warps_for(block_r * block_d))
    _reduce.column_sum_into(dq_weight, part[:, :d])  # each partial row: q's sums, then k's
    _reduce.column_sum_into(dk_weight, part[:, d:])
