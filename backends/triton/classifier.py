"""Fused cross-entropy over a chunk of LM-head logits: loss per row and dlogits written in place.

One program per row of logits[n, V] (V up to ~152k, streamed in BLOCK_V slices): pass 1 keeps a running max
and a running sum of exp rescaled to it (online softmax), so max and sum cost one read of the row; the
target's logit is one scalar load. loss = lse - x[target]. Pass 2 reads the row again and overwrites it with
dloss * (exp(x - lse) - onehot(target)). Two reads and one write of the row in total, nothing else in
memory: no probs buffer, no separate softmax / loss / gradient kernels. Rows with target -100 get loss 0 and
all-zero dlogits. Everything in fp32; the logits are rounded once, when written back.

``fused_classifier_fp8`` (the FP8 LM head, --lmhead-dtype e4m3): the same kernel, but pass 2 writes the
gradient straight to FP8 at the static scale of backends/base.py ``dlogits_fp8_scale`` (|d| <= dloss) into q[n, V]
(the dgrad's operand) and leaves the logits as they are; a second kernel (fp8.transpose) copies q into q^T[V, n]
(the wgrad's operand). Traffic per logit: 2 reads of 2 bytes, 1 write of 1 byte, then 1 + 1 for the transpose.

Why not write q^T from the classifier itself: a program there owns one row, and a tile kernel that stores its
register tile in both layouts is what Triton 3.6 miscompiles on the H100 (~20% of the q^T bytes wrong, always
at the same byte positions within each 4-byte word, for every tile shape tried and with ``tl.trans``); a tile
kernel that recomputed the transposed tile from its own load was exact but slower (15.2 ms at 32,768 x 151,936,
against 10.1 ms for the bf16 classifier; benchmarks/LOG.md, 2026-11-26).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmq_ray.backends.base import dlogits_fp8_scale
from llmq_ray.backends.triton._common import INTERPRET, cast_to, fp8_store_view, next_pow2, num_warps_for
from llmq_ray.backends.triton.fp8 import _fp8_args, _to_fp8, transpose


@triton.jit
def _classifier_kernel(logits_ptr, losses_ptr, targets_ptr, q_ptr, V, stride_row, dloss, s,
                       BLOCK_V: tl.constexpr, WRITE_DLOGITS: tl.constexpr, FP8_OUT: tl.constexpr,
                       FP8_MAX: tl.constexpr, FP8_DTYPE: tl.constexpr, MAN: tl.constexpr, BIAS: tl.constexpr):
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
        q_row = q_ptr + row.to(tl.int64) * V
        for start in range(0, V, BLOCK_V):
            idx = start + cols
            m = idx < V
            x = tl.load(base + idx, mask=m, other=0.0).to(tl.float32)
            p = tl.exp(x - lse)
            p = tl.where(idx == tgt, p - 1.0, p)
            if FP8_OUT:
                tl.store(q_row + idx, _to_fp8(p * scale, s, FP8_MAX, FP8_DTYPE, MAN, BIAS), mask=m)
            else:
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
    _classifier_kernel[(n,)](logits, losses, targets, logits, v, logits.stride(0), float(dloss), 1.0,
                             BLOCK_V=block_v, WRITE_DLOGITS=write_dlogits, FP8_OUT=False,
                             num_warps=num_warps_for(block_v), **_fp8_args(torch.float8_e4m3fn))


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
    block_v = min(next_pow2(v), 16384 if INTERPRET else 4096)
    _classifier_kernel[(n,)](logits, losses, targets, fp8_store_view(q), v, logits.stride(0), float(dloss), s,
                             BLOCK_V=block_v, WRITE_DLOGITS=True, FP8_OUT=True, num_warps=num_warps_for(block_v),
                             **_fp8_args(q.dtype))
    transpose(q_t, q)
