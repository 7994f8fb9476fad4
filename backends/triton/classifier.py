"""Fused cross-entropy over a chunk of LM-head logits: loss per row and dlogits written in place.

One program per row of logits[n, V] (V up to ~152k, streamed in BLOCK_V slices): pass 1 keeps a running max
and a running sum of exp rescaled to it (online softmax), so max and sum cost one read of the row; the
target's logit is one scalar load. loss = lse - x[target]. Pass 2 reads the row again and overwrites it with
dloss * (exp(x - lse) - onehot(target)). Two reads and one write of the row in total, nothing else in
memory: no probs buffer, no separate softmax / loss / gradient kernels. Rows with target -100 get loss 0 and
all-zero dlogits. Everything in fp32; the logits are rounded once, when written back.
"""

from __future__ import annotations

import triton
import triton.language as tl

from llmq_ray.backends.triton._common import INTERPRET, cast_to, next_pow2, num_warps_for


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
