"""Rotary position embedding, forward and backward, in place on the fused qkv buffer.

qkv[B, T, Hq + 2*Hkv, D]: one program per token rotates all its q and k heads at once (a [heads, D/2] tile
for each half), reading cos/sin[t] once for all heads and leaving v untouched: one read and one write of the
q/k part of qkv, nothing else. Half-split convention: (x1, x2) = (x[:D/2], x[D/2:]),
forward (x1 c - x2 s, x2 c + x1 s); backward applies the transpose (x1 c + x2 s, x2 c - x1 s). fp32 math.
"""

from __future__ import annotations

import triton
import triton.language as tl

from backends.triton._common import cast_to, next_pow2, num_warps_for


@triton.jit
def _rope_kernel(qkv_ptr, cos_ptr, sin_ptr, T, n_heads, stride_b, stride_t, stride_h, stride_cos,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, INVERSE: tl.constexpr):
    tok = tl.program_id(0)
    b = tok // T
    t = tok % T
    heads = tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_HALF)
    jmask = j < HALF
    mask = (heads < n_heads)[:, None] & jmask[None, :]
    base = b.to(tl.int64) * stride_b + t.to(tl.int64) * stride_t
    offs1 = base + heads[:, None] * stride_h + j[None, :]
    c = tl.load(cos_ptr + t * stride_cos + j, mask=jmask, other=0.0)[None, :]
    s = tl.load(sin_ptr + t * stride_cos + j, mask=jmask, other=0.0)[None, :]
    x1 = tl.load(qkv_ptr + offs1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(qkv_ptr + offs1 + HALF, mask=mask, other=0.0).to(tl.float32)
    if INVERSE:
        y1 = x1 * c + x2 * s
        y2 = x2 * c - x1 * s
    else:
        y1 = x1 * c - x2 * s
        y2 = x2 * c + x1 * s
    tl.store(qkv_ptr + offs1, cast_to(y1, qkv_ptr.dtype.element_ty), mask=mask)
    tl.store(qkv_ptr + offs1 + HALF, cast_to(y2, qkv_ptr.dtype.element_ty), mask=mask)


def rope(qkv, cos, sin, n_q_heads: int, n_kv_heads: int, inverse: bool) -> None:
    """Rotate (inverse=False) or un-rotate (inverse=True) q and k heads of qkv[B, T, H, D] in place;
    cos/sin [>=T, D/2] fp32 (row t for position t)."""
    b, t, h, d = qkv.shape
    if qkv.stride(3) != 1 or cos.stride(1) != 1 or sin.stride() != cos.stride():
        raise ValueError("rope: qkv's head dim and cos/sin rows must be contiguous")
    if d % 2 or h != n_q_heads + 2 * n_kv_heads:
        raise ValueError(f"rope: qkv {tuple(qkv.shape)} does not match Hq={n_q_heads}, Hkv={n_kv_heads}")
    half = d // 2
    n_heads = n_q_heads + n_kv_heads
    block_h, block_half = next_pow2(n_heads), next_pow2(half)
    _rope_kernel[(b * t,)](qkv, cos, sin, t, n_heads, qkv.stride(0), qkv.stride(1), qkv.stride(2), cos.stride(0),
                           HALF=half, BLOCK_H=block_h, BLOCK_HALF=block_half, INVERSE=inverse,
                           num_warps=num_warps_for(2 * block_h * block_half))
