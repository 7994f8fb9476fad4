"""Fused cross-entropy over a chunk of LM-head logits: loss per row and dlogits written in place.

One program per row of logits[n, V] (V up to ~152k, streamed in BLOCK_V slices): pass 1 keeps a running max
and a running sum of exp rescaled to it (online softmax), so max and sum cost one read of the row; the
target's logit is one scalar load. loss = lse - x[target]. Pass 2 reads the row again and overwrites it with
dloss * (exp(x - lse) - onehot(target)). Two reads and one write of the row in total, nothing else in
memory: no probs buffer, no separate softmax / loss / gradient kernels. Rows with target -100 get loss 0 and
all-zero dlogits. Everything in fp32; the logits are rounded once, when written back.

``fused_classifier_fp8`` (the FP8 LM head, --lmhead-dtype e4m3): the same two passes, but pass 2 writes the
gradient straight to FP8 at the static scale of backends/base.py ``dlogits_fp8_scale`` (|d| <= dloss), in both
layouts the head's GEMMs need: q[n, V] (dgrad) and q^T[V, n] (wgrad). A program owns BLOCK_R rows, so the
transposed store writes BLOCK_R consecutive bytes per vocabulary entry; the logits are read twice from memory
and never written (2 reads of 2 bytes, 2 writes of 1 byte per logit, as the bf16 classifier's 2 + 2 + 2).

Why the transposed tile is computed a second time from its own load instead of storing the row-major tile
transposed: Triton 3.6 on the H100 miscompiles the FP8 (and uint8) layout conversion that a second,
transposed store of the same register tile needs -- ~20% of the q^T bytes came out wrong (always at the same
byte positions within each 4-byte word), for every tile shape tried, with ``tl.trans`` as well; one tile per
store layout is exact. At 32,768 x 151,936 on an H100 it takes 15.2 ms, against 10.1 ms for the bf16
classifier, which the FP8 GEMMs repay several times over (benchmarks/LOG.md, 2026-11-26).
"""

from __future__ import annotations

import triton
import triton.language as tl

from llmq_ray.backends.base import dlogits_fp8_scale
from llmq_ray.backends.triton._common import INTERPRET, cast_to, fp8_store_view, next_pow2, num_warps_for
from llmq_ray.backends.triton.fp8 import _fp8_args, _to_fp8


@triton.jit
def _classifier_kernel(logits_ptr, losses_ptr, targets_ptr, V, stride_row, dloss,
                       BLOCK_V: tl.constexpr, WRITE_DLOGITS: tl.constexpr):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride_row
    target = tl.load(targets_ptr + row).to(tl.int64)
    valid = target != -100
    tgt = tl.where(valid, target, 0)
    cols = tl.arange(0, BLOCK_V)
    run_max = tl.full([], float("-inf"), tl.float32)
    run_sum = tl.zeros([], tl.float32)
    for start in range(0, V, BLOCK_V):
        x = tl.load(base + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(run_max, tl.max(x, axis=0))
        run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        run_max = new_max
    lse = run_max + tl.log(run_sum)
    picked = tl.load(base + tgt).to(tl.float32)
    tl.store(losses_ptr + row, tl.where(valid, lse - picked, 0.0))
    if WRITE_DLOGITS:
        scale = tl.where(valid, dloss, 0.0)
        for start in range(0, V, BLOCK_V):
            idx = start + cols
            m = idx < V
            x = tl.load(base + idx, mask=m, other=0.0).to(tl.float32)
            p = tl.exp(x - lse)
            p = tl.where(idx == tgt, p - 1.0, p)
            tl.store(base + idx, cast_to(p * scale, logits_ptr.dtype.element_ty), mask=m)


def fused_classifier(logits, losses, targets, dloss: float = 1.0, write_dlogits: bool = True) -> None:
    """losses[n] (fp32) = logsumexp(logits[r]) - logits[r, t_r] (0 where t_r = -100); with write_dlogits,
    logits[n, V] (model dtype, row stride may exceed V) <- dloss * (softmax - onehot), zero on masked rows."""
    n, v = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("fused_classifier: logits rows must be contiguous")
    if n == 0:
        return
    block_v = min(next_pow2(v), 16384 if INTERPRET else 4096)
    _classifier_kernel[(n,)](logits, losses, targets, v, logits.stride(0), float(dloss),
                             BLOCK_V=block_v, WRITE_DLOGITS=write_dlogits, num_warps=num_warps_for(block_v))


@triton.jit
def _classifier_fp8_kernel(logits_ptr, losses_ptr, targets_ptr, q_ptr, qt_ptr, N, V, stride_row, dloss, s,
                           FP8_MAX: tl.constexpr, FP8_DTYPE: tl.constexpr, MAN: tl.constexpr, BIAS: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < N
    safe = tl.minimum(rows, N - 1).to(tl.int64)  # rows past N read the last row; nothing of theirs is stored
    base = logits_ptr + safe * stride_row
    target = tl.load(targets_ptr + safe).to(tl.int64)
    valid = target != -100
    tgt = tl.where(valid, target, 0)
    cols = tl.arange(0, BLOCK_V)
    run_max = tl.full([BLOCK_R], float("-inf"), tl.float32)
    run_sum = tl.zeros([BLOCK_R], tl.float32)
    for start in range(0, V, BLOCK_V):
        c = start + cols
        x = tl.load(base[:, None] + c[None, :], mask=(c < V)[None, :], other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(run_max, tl.max(x, axis=1))
        run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(x - new_max[:, None]), axis=1)
        run_max = new_max
    lse = run_max + tl.log(run_sum)
    picked = tl.load(base + tgt).to(tl.float32)
    tl.store(losses_ptr + rows, tl.where(valid, lse - picked, 0.0), mask=row_ok)
    scale = tl.where(valid, dloss, 0.0)
    for start in range(0, V, BLOCK_V):
        c = start + cols
        c_ok = c < V
        x = tl.load(base[:, None] + c[None, :], mask=c_ok[None, :], other=0.0).to(tl.float32)
        p = tl.exp(x - lse[:, None])
        p = tl.where(c[None, :] == tgt[:, None], p - 1.0, p)
        y = _to_fp8(p * scale[:, None], s, FP8_MAX, FP8_DTYPE, MAN, BIAS)
        tl.store(q_ptr + rows.to(tl.int64)[:, None] * V + c[None, :], y, mask=row_ok[:, None] & c_ok[None, :])
        # the transposed tile, computed again from a [BLOCK_V, BLOCK_R] load of the same logits (an L1/L2 hit):
        # each store then has the layout of its own tile (module docstring: why not store y transposed)
        xt = tl.load(base[None, :] + c[:, None], mask=c_ok[:, None], other=0.0).to(tl.float32)
        pt = tl.exp(xt - lse[None, :])
        pt = tl.where(c[:, None] == tgt[None, :], pt - 1.0, pt)
        yt = _to_fp8(pt * scale[None, :], s, FP8_MAX, FP8_DTYPE, MAN, BIAS)
        tl.store(qt_ptr + c.to(tl.int64)[:, None] * N + rows[None, :], yt, mask=c_ok[:, None] & row_ok[None, :])


def fused_classifier_fp8(logits, losses, targets, q, q_t, descale, dloss: float = 1.0) -> None:
    """losses[n] as fused_classifier; q[n, V] and q_t[V, n] (one FP8 dtype) = saturate(dloss * (softmax -
    onehot) * s) and its transpose, s = dlogits_fp8_scale(q.dtype, dloss); descale (fp32 0-d) = 1/s. logits
    (model dtype, rows contiguous, row stride may exceed V) are only read."""
    n, v = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("fused_classifier_fp8: logits rows must be contiguous")
    if q.dtype != q_t.dtype or tuple(q.shape) != (n, v) or tuple(q_t.shape) != (v, n) \
            or not (q.is_contiguous() and q_t.is_contiguous()):
        raise ValueError(f"fused_classifier_fp8: q {q.dtype} {tuple(q.shape)} and q_t {q_t.dtype} "
                         f"{tuple(q_t.shape)} must be one contiguous FP8 dtype shaped [{n}, {v}] and [{v}, {n}]")
    s = dlogits_fp8_scale(q.dtype, dloss)
    descale.fill_(1.0 / s)
    if n == 0:
        return
    block_r, block_v = (16, min(next_pow2(v), 1024)) if INTERPRET else (32, 128)
    _classifier_fp8_kernel[(triton.cdiv(n, block_r),)](
        logits, losses, targets, fp8_store_view(q), fp8_store_view(q_t), n, v, logits.stride(0), float(dloss), s,
        BLOCK_R=block_r, BLOCK_V=block_v, num_warps=8, **_fp8_args(q.dtype))
