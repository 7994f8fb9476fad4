"""Rotary position embedding, forward and backward, in place on the fused qkv buffer.

qkv[B, T, Hq + 2*Hkv, D]: one program per token rotates all its q and k heads at once (a [heads, D/2] tile
for each half), reading cos/sin[t] once for all heads and leaving v untouched: one read and one write of the
q/k part of qkv, nothing else. Half-split convention: (x1, x2) = (x[:D/2], x[D/2:]),
forward (x1 c - x2 s, x2 c + x1 s); backward applies the transpose (x1 c + x2 s, x2 c - x1 s). fp32 math.
"""

from __future__ import annotations

import triton
import triton.language as tl

from llmq_ray.backends.triton._common import cast_to, next_pow2, num_warps_for


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


@triton.jit
def _rope_backward_from_kernel(dqkv_ptr, dq_ptr, dk_ptr, dv_ptr, cos_ptr, sin_ptr, T, n_q, n_kv,
                               s_b, s_t, s_h, q_b, q_t, q_h, k_b, k_t, k_h, v_b, v_t, v_h, stride_cos,
                               HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr,
                               BLOCK_HALF: tl.constexpr):
    tok = tl.program_id(0)
    b = (tok // T).to(tl.int64)
    t = (tok % T).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)  # q heads 0..Hq-1, then k heads Hq..Hq+Hkv-1
    j = tl.arange(0, BLOCK_HALF)
    jmask = j < HALF
    is_q = (heads < n_q)[:, None] & jmask[None, :]
    is_k = ((heads >= n_q) & (heads < n_q + n_kv))[:, None] & jmask[None, :]
    q_offs = b * q_b + t * q_t + heads[:, None] * q_h + j[None, :]
    k_offs = b * k_b + t * k_t + (heads[:, None] - n_q) * k_h + j[None, :]
    # each element comes from exactly one of dq / dk (the other load is masked to 0)
    x1 = (tl.load(dq_ptr + q_offs, mask=is_q, other=0.0).to(tl.float32)
          + tl.load(dk_ptr + k_offs, mask=is_k, other=0.0).to(tl.float32))
    x2 = (tl.load(dq_ptr + q_offs + HALF, mask=is_q, other=0.0).to(tl.float32)
          + tl.load(dk_ptr + k_offs + HALF, mask=is_k, other=0.0).to(tl.float32))
    c = tl.load(cos_ptr + t * stride_cos + j, mask=jmask, other=0.0)[None, :]
    s = tl.load(sin_ptr + t * stride_cos + j, mask=jmask, other=0.0)[None, :]
    out = dqkv_ptr + b * s_b + t * s_t + heads[:, None] * s_h + j[None, :]
    qk = is_q | is_k
    tl.store(out, cast_to(x1 * c + x2 * s, dqkv_ptr.dtype.element_ty), mask=qk)
    tl.store(out + HALF, cast_to(x2 * c - x1 * s, dqkv_ptr.dtype.element_ty), mask=qk)
    # v heads: copied as they are (both halves)
    kv = tl.arange(0, BLOCK_KV)
    d = tl.arange(0, 2 * BLOCK_HALF)
    vmask = (kv < n_kv)[:, None] & (d < 2 * HALF)[None, :]
    vals = tl.load(dv_ptr + b * v_b + t * v_t + kv[:, None] * v_h + d[None, :], mask=vmask, other=0.0)
    tl.store(dqkv_ptr + b * s_b + t * s_t + (n_q + n_kv + kv[:, None]) * s_h + d[None, :],
             vals.to(dqkv_ptr.dtype.element_ty), mask=vmask)


def rope_backward_from(dqkv, dq, dk, dv, cos, sin, n_q_heads: int, n_kv_heads: int) -> None:
    """dqkv[B, T, Hq+2Hkv, D] = [rope^-1(dq) | rope^-1(dk) | dv] in one pass: dq[B, T, Hq, D], dk/dv[B, T, Hkv, D]
    with any strides whose head dim is contiguous (cuDNN's returned gradients); cos/sin [>=T, D/2] fp32.
    One program per token reads its dq/dk/dv rows once and writes its dqkv row once (the default path
    copies dq/dk into dqkv and then rotates them in place: one more read and write of the q/k part)."""
    b, t, h, d = dqkv.shape
    if h != n_q_heads + 2 * n_kv_heads or d % 2:
        raise ValueError(f"rope_backward_from: dqkv {tuple(dqkv.shape)} does not match Hq={n_q_heads}, Hkv={n_kv_heads}")
    for name, x, heads in (("dq", dq, n_q_heads), ("dk", dk, n_kv_heads), ("dv", dv, n_kv_heads)):
        if tuple(x.shape) != (b, t, heads, d) or x.stride(3) != 1:
            raise ValueError(f"rope_backward_from: {name} {tuple(x.shape)} (strides {x.stride()}) must be "
                             f"[{b}, {t}, {heads}, {d}] with a contiguous head dim")
    if dqkv.stride(3) != 1 or cos.stride(1) != 1 or sin.stride() != cos.stride():
        raise ValueError("rope_backward_from: dqkv's head dim and cos/sin rows must be contiguous")
    half = d // 2
    block_h, block_kv, block_half = next_pow2(n_q_heads + n_kv_heads), next_pow2(n_kv_heads), next_pow2(half)
    _rope_backward_from_kernel[(b * t,)](
        dqkv, dq, dk, dv, cos, sin, t, n_q_heads, n_kv_heads, *dqkv.stride()[:3], *dq.stride()[:3],
        *dk.stride()[:3], *dv.stride()[:3], cos.stride(0), HALF=half, BLOCK_H=block_h, BLOCK_KV=block_kv,
        BLOCK_HALF=block_half, num_warps=num_warps_for(2 * block_h * block_half))
