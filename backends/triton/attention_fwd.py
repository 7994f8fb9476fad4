"""Causal GQA attention forward in Triton under document masking, skipping the tiles outside each document.

Why: cuDNN's fused forward (backends/_aten_attention.py) takes no segment ids; given the documents as an additive
score bias it computes every causal tile and reads the bias besides (1.46x its dense time at Qwen2.5-0.5B's heads,
B=32, T=1024, documents of 200-2000 tokens, measured on an H100: benchmarks/LOG.md, 2026-11-26). Here the program of
a query block starts at the first key of its first query's document, so the work shrinks with the documents, and
the mask inside a tile compares segment ids (no [B, T, T] tensor at all).

One program per (query block, b, q head): q [BLOCK_M, D] stays in registers; for each key block from
``starts[b, first query]`` (rounded down to the tile) up to the block's last query, s = scale * q k^T, masked to
causal-and-same-document (on the tiles not wholly live only), folded into a running max m, running sum l and
accumulator acc (the online softmax, in base 2); out = acc / l, lse = m + log(l) (natural log of the scaled scores, as the backward and cuDNN use). A row
whose keys so far are all masked has m = -inf; the exponentials then use 0 in its place, so no (-inf) - (-inf).

Layouts: qkv [B, T, Hq + 2 Hkv, D] (post-RoPE), out [B, T, Hq, D] model dtype, lse [B, Hq, T] fp32, documents a
DocumentMask (segments, starts [B, T] int32). Query head h reads kv head h // (Hq / Hkv).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from llmq_ray.backends.triton._common import INTERPRET, cast_to, next_pow2

LOG2E = 1.4426950408889634


@triton.jit
def _fwd_kernel(qkv_ptr, out_ptr, lse_ptr, seg_ptr, start_ptr, T, HQ, HKV, scale_log2,
                q_b, q_t, o_b, o_t, o_h, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                D: tl.constexpr, GROUP: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr):
    pid_m, b, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    hk = h // GROUP
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    qmask = (rows < T)[:, None] & (d < D)[None, :]
    base = b.to(tl.int64) * q_b
    q = tl.load(qkv_ptr + base + rows.to(tl.int64)[:, None] * q_t + h * D + d[None, :], mask=qmask, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    seg_q = tl.load(seg_ptr + b.to(tl.int64) * T + rows, mask=rows < T, other=-2)
    row_lo = pid_m * BLOCK_M
    doc_lo = tl.load(start_ptr + b.to(tl.int64) * T + row_lo)  # the start of the first query's document
    row_hi = tl.minimum(row_lo + BLOCK_M, T) - 1
    # every query of the block inside T and in one document
    one_doc = (row_lo + BLOCK_M <= T) & (tl.load(seg_ptr + b.to(tl.int64) * T + row_lo)
                                         == tl.load(seg_ptr + b.to(tl.int64) * T + row_hi))
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(doc_lo // BLOCK_N * BLOCK_N, tl.minimum(row_lo + BLOCK_M, T), BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        kmask = (keys < T)[:, None] & (d < D)[None, :]
        row_k = base + keys.to(tl.int64)[:, None] * q_t + d[None, :]
        k = tl.load(qkv_ptr + row_k + (HQ + hk) * D, mask=kmask, other=0.0)
        v = tl.load(qkv_ptr + row_k + (HQ + HKV + hk) * D, mask=kmask, other=0.0)
        if DOT_F32:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2
        # a tile wholly live (every key at or before every query, all in the queries' one document) skips the mask
        if not ((start_n + BLOCK_N - 1 <= row_lo) & (start_n >= doc_lo) & one_doc):
            seg_k = tl.load(seg_ptr + b.to(tl.int64) * T + keys, mask=keys < T, other=-1)
            live = (rows[:, None] >= keys[None, :]) & (seg_q[:, None] == seg_k[None, :])
            s = tl.where(live, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m - m_use)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m = m_new
    out = acc / l[:, None]  # every row has at least its own key: l > 0
    tl.store(out_ptr + b.to(tl.int64) * o_b + rows.to(tl.int64)[:, None] * o_t + h * o_h + d[None, :],
             cast_to(out, out_ptr.dtype.element_ty), mask=qmask)
    lse = (m + tl.log2(l)) / 1.4426950408889634
    tl.store(lse_ptr + (b * HQ + h).to(tl.int64) * T + rows, lse, mask=rows < T)


# (BLOCK_M, BLOCK_N, num_warps, num_stages) on the GPU by head size (D <= 64, larger); BLOCK_M tiles the queries.
TILES = {64: (64, 128, 4, 2), 128: (64, 64, 4, 3)}


def attention_forward(out, lse, qkv, n_q_heads: int, n_kv_heads: int, documents, tiles=None) -> None:
    """out[B, T, Hq, D] and lse[B, Hq, T] fp32 (overwritten) of causal attention within documents over the post-RoPE
    qkv[B, T, Hq + 2 Hkv, D]; the contract of Backend.attention_forward with ``documents`` given (a
    DocumentMask after its ``refresh()``). qkv, out, lse contiguous. ``tiles``: (BLOCK_M, BLOCK_N, warps, stages)
    instead of ``TILES`` (benchmarks/attention_tiles.py and the tests try others)."""
    b, t, h, d = qkv.shape
    if h != n_q_heads + 2 * n_kv_heads or n_q_heads % n_kv_heads:
        raise ValueError(f"attention_forward: qkv {tuple(qkv.shape)} does not match Hq={n_q_heads}, Hkv={n_kv_heads}")
    if not qkv.is_contiguous() or tuple(out.shape) != (b, t, n_q_heads, d) or not out.is_contiguous():
        raise ValueError(f"attention_forward: qkv and out must be contiguous, out [{b}, {t}, {n_q_heads}, {d}]")
    if tuple(lse.shape) != (b, n_q_heads, t) or lse.dtype != torch.float32 or not lse.is_contiguous():
        raise ValueError(f"attention_forward: lse must be contiguous fp32 [{b}, {n_q_heads}, {t}]")
    seg, starts = documents.segments, documents.starts
    for name, x in (("segments", seg), ("starts", starts)):
        if tuple(x.shape) != (b, t) or x.dtype != torch.int32 or not x.is_contiguous():
            raise ValueError(f"attention_forward: documents.{name} must be contiguous int32 [{b}, {t}]")
    block_d = next_pow2(d)
    block_m, block_n, warps, stages = tiles or ((16, 16, 4, 1) if INTERPRET else TILES[64 if d <= 64 else 128])
    _fwd_kernel[(triton.cdiv(t, block_m), b, n_q_heads)](
        qkv, out, lse, seg, starts, t, n_q_heads, n_kv_heads, LOG2E / math.sqrt(d), qkv.stride(0), qkv.stride(1),
        out.stride(0), out.stride(1), out.stride(2), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, D=d,
        GROUP=n_q_heads // n_kv_heads, DOT_F32=INTERPRET or qkv.dtype == torch.float32,
        PREC="ieee" if qkv.dtype == torch.float32 else None, num_warps=warps, num_stages=stages)
