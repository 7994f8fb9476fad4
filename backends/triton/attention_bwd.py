"""Causal GQA attention backward in Triton, bit-reproducible (no atomics), from the forward's out and lse.

Why: cuDNN's backward (the default on CUDA, backends/_aten_attention.py) is built by PyTorch without cuDNN's
deterministic option and may accumulate dQ with atomics, so two runs of the same step need not give the same
bits (suspected from 7B runs; benchmarks/attention_determinism.py checks it). A resumed run can then not
reproduce the uninterrupted one. Here every output element is owned by one program that sums in a fixed order:

1. ``_delta_kernel``: delta[b, h, t] = sum_d dO * O (fp32), one program per (token block, b, h).
2. ``_dkdv_kernel``: one program per (key block, b, kv head) owns dK and dV of those keys; it loops over the
   query heads of its group and over the query blocks at or after its keys (causal), in a fixed order.
3. ``_dq_kernel``: one program per (query block, b, q head) owns dQ of those queries; it loops over the key
   blocks at or before them.

Math (S = scale * Q K^T, P = exp(S - lse), causal): dV = P^T dO, dP = dO V^T, dS = P * (dP - delta),
dQ = scale * dS K, dK = scale * dS^T Q. Layouts as the rest of the backend: qkv/dqkv [B, T, Hq + 2 Hkv, D],
out/dout [B, T, Hq, D], lse [B, Hq, T] fp32 (natural log, scaled scores). Tiles are loaded in the model dtype;
the products run on tensor cores with fp32 accumulation on the GPU (fp32 models: in full fp32, not TF32), and
in fp32 under the interpreter (which computes bf16 arithmetic wrongly; seen with triton 3.9 on the CPU).

Speed: the exponentials are taken in base 2 (the scale and lse pre-multiplied by log2 e); the causal and document
masks are computed only on tiles that need them (the diagonal, a key block spanning two documents, the last query
tile of a document), a whole-live tile skips the comparisons. The tile shapes, warps and pipeline stages per head
size are ``TILES`` (picked on an H100 with benchmarks/attention_tiles.py; one fixed choice per head size, so the
summation order and the bits do not depend on a tuning run).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from llmq_ray.backends.triton._common import INTERPRET, cast_to, next_pow2


@triton.jit
def _delta_kernel(out_ptr, dout_ptr, delta_ptr, T, H, s_b, s_t, s_h, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                  D: tl.constexpr):
    pid_t, b, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    mask = (t < T)[:, None] & (d < D)[None, :]
    offs = b.to(tl.int64) * s_b + t.to(tl.int64)[:, None] * s_t + h * s_h + d[None, :]
    o = tl.load(out_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(dout_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(delta_ptr + (b * H + h).to(tl.int64) * T + t, tl.sum(o * do, axis=1), mask=t < T)


@triton.jit
def _key_block(qkv_ptr, b, hk, keys, d, T, HQ, HKV, q_b, q_t, D: tl.constexpr, DOT_F32: tl.constexpr):
    """k and v [BLOCK_N, BLOCK_D] of kv head hk at the positions ``keys`` (masked lanes 0), their mask, and the
    offsets of those rows (without the head) in qkv / dqkv."""
    kmask = (keys < T)[:, None] & (d < D)[None, :]
    row_k = b.to(tl.int64) * q_b + keys.to(tl.int64)[:, None] * q_t + d[None, :]
    k = tl.load(qkv_ptr + row_k + (HQ + hk) * D, mask=kmask, other=0.0)
    v = tl.load(qkv_ptr + row_k + (HQ + HKV + hk) * D, mask=kmask, other=0.0)
    if DOT_F32:
        k, v = k.to(tl.float32), v.to(tl.float32)
    return k, v, kmask, row_k


@triton.jit
def _query_block(qkv_ptr, dout_ptr, lse_ptr, delta_ptr, b, h, rows, d, T, HQ, q_b, q_t, o_b, o_t, o_h,
                 D: tl.constexpr, DOT_F32: tl.constexpr):
    """q and dout [BLOCK_M, BLOCK_D] of query head h at the positions ``rows``, their lse (base 2) and delta [BLOCK_M]
    (masked lanes 0), the mask, and the offsets of those rows (without the head) in qkv / dqkv."""
    qmask = (rows < T)[:, None] & (d < D)[None, :]
    row_q = b.to(tl.int64) * q_b + rows.to(tl.int64)[:, None] * q_t + d[None, :]
    q = tl.load(qkv_ptr + row_q + h * D, mask=qmask, other=0.0)
    do = tl.load(dout_ptr + b.to(tl.int64) * o_b + rows.to(tl.int64)[:, None] * o_t + h * o_h + d[None, :],
                 mask=qmask, other=0.0)
    stat = (b * HQ + h).to(tl.int64) * T + rows
    lse = tl.load(lse_ptr + stat, mask=rows < T, other=0.0) * 1.4426950408889634  # base 2
    delta = tl.load(delta_ptr + stat, mask=rows < T, other=0.0)
    if DOT_F32:
        q, do = q.to(tl.float32), do.to(tl.float32)
    return q, do, lse, delta, qmask, row_q


@triton.jit
def _dkdv_kernel(qkv_ptr, dout_ptr, lse_ptr, delta_ptr, dqkv_ptr, seg_ptr, end_ptr, T, HQ, HKV, scale, scale_log2,
                 q_b, q_t, o_b, o_t, o_h, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 D: tl.constexpr, GROUP: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr,
                 DOCS: tl.constexpr):
    pid_n, b, hk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    key_lo = pid_n * BLOCK_N
    keys = key_lo + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    k, v, kmask, row_k = _key_block(qkv_ptr, b, hk, keys, d, T, HQ, HKV, q_b, q_t, D, DOT_F32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    stop_m = T
    if DOCS:  # no query after the end of the last key's document sees these keys
        seg_k = tl.load(seg_ptr + b.to(tl.int64) * T + keys, mask=keys < T, other=-1)
        key_hi = tl.minimum(key_lo + BLOCK_N, T) - 1
        stop_m = tl.load(end_ptr + b.to(tl.int64) * T + key_hi)
        one_doc = tl.load(seg_ptr + b.to(tl.int64) * T + key_lo) == tl.load(seg_ptr + b.to(tl.int64) * T + key_hi)
    for g in range(GROUP):
        h = hk * GROUP + g
        for start_m in range(key_lo // BLOCK_M * BLOCK_M, stop_m, BLOCK_M):  # query blocks seeing these keys
            rows = start_m + tl.arange(0, BLOCK_M)
            q, do, lse, delta, _, _ = _query_block(qkv_ptr, dout_ptr, lse_ptr, delta_ptr, b, h, rows, d, T, HQ,
                                                   q_b, q_t, o_b, o_t, o_h, D, DOT_F32)
            p = tl.exp2(tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2 - lse[:, None])  # [BLOCK_M, BLOCK_N]
            # whole tile live: every query at or after every key, inside T, and (documents) in the keys' document
            full = (start_m >= key_lo + BLOCK_N - 1) & (start_m + BLOCK_M <= stop_m)
            if DOCS:
                full = full & one_doc  # (then stop_m is the end of that document)
            if not full:
                live = (rows[:, None] >= keys[None, :]) & (rows < T)[:, None] & (keys < T)[None, :]
                if DOCS:
                    seg_q = tl.load(seg_ptr + b.to(tl.int64) * T + rows, mask=rows < T, other=-2)
                    live = live & (seg_q[:, None] == seg_k[None, :])
                p = tl.where(live, p, 0.0)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PREC)
            dp = tl.dot(do, tl.trans(v), input_precision=PREC)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PREC)
    dk = dk * scale
    out_k = dqkv_ptr + row_k + (HQ + hk) * D
    tl.store(out_k, cast_to(dk, dqkv_ptr.dtype.element_ty), mask=kmask)
    tl.store(out_k + HKV * D, cast_to(dv, dqkv_ptr.dtype.element_ty), mask=kmask)


@triton.jit
def _dq_kernel(qkv_ptr, dout_ptr, lse_ptr, delta_ptr, dqkv_ptr, seg_ptr, start_ptr, T, HQ, HKV, scale, scale_log2,
               q_b, q_t, o_b, o_t, o_h, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
               D: tl.constexpr, GROUP: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr,
               DOCS: tl.constexpr):
    pid_m, b, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    hk = h // GROUP
    row_lo = pid_m * BLOCK_M
    rows = row_lo + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    q, do, lse, delta, qmask, row_q = _query_block(qkv_ptr, dout_ptr, lse_ptr, delta_ptr, b, h, rows, d, T, HQ,
                                                   q_b, q_t, o_b, o_t, o_h, D, DOT_F32)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    doc_lo = 0  # the first key every query of the block sees (documents: its document's start)
    if DOCS:  # no key before the start of the first query's document is seen by these queries
        seg_q = tl.load(seg_ptr + b.to(tl.int64) * T + rows, mask=rows < T, other=-2)
        doc_lo = tl.load(start_ptr + b.to(tl.int64) * T + row_lo)
        row_hi = tl.minimum(row_lo + BLOCK_M, T) - 1
        one_doc = tl.load(seg_ptr + b.to(tl.int64) * T + row_lo) == tl.load(seg_ptr + b.to(tl.int64) * T + row_hi)
    for start_n in range(doc_lo // BLOCK_N * BLOCK_N, tl.minimum(row_lo + BLOCK_M, T), BLOCK_N):  # key blocks seen
        keys = start_n + tl.arange(0, BLOCK_N)
        k, v, _, _ = _key_block(qkv_ptr, b, hk, keys, d, T, HQ, HKV, q_b, q_t, D, DOT_F32)
        p = tl.exp2(tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2 - lse[:, None])
        # whole tile live: every key at or before every query, every query inside T and (documents) all in the
        # queries' one document
        full = (start_n + BLOCK_N - 1 <= row_lo) & (row_lo + BLOCK_M <= T)
        if DOCS:
            full = full & one_doc & (start_n >= doc_lo)
        if not full:
            live = (rows[:, None] >= keys[None, :]) & (rows < T)[:, None] & (keys < T)[None, :]
            if DOCS:
                seg_k = tl.load(seg_ptr + b.to(tl.int64) * T + keys, mask=keys < T, other=-1)
                live = live & (seg_q[:, None] == seg_k[None, :])
            p = tl.where(live, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
    tl.store(dqkv_ptr + row_q + h * D, cast_to(dq * scale, dqkv_ptr.dtype.element_ty), mask=qmask)


LOG2E = 1.4426950408889634

# (BLOCK_M, BLOCK_N, num_warps, num_stages) of the dK/dV and the dQ kernel on the GPU, by head size (D <= 64, larger).
# BLOCK_M tiles the queries and BLOCK_N the keys in both kernels.
TILES = {64: ((64, 64, 4, 3), (64, 32, 4, 3)), 128: ((64, 64, 4, 2), (128, 32, 4, 2))}
_INTERPRETER_TILES = ((16, 16, 4, 1), (16, 16, 4, 1))


def _tiles(d: int):
    """The (dK/dV, dQ) tile choices for head size ``d``: ``TILES`` on the GPU, 16 x 16 under the interpreter."""
    return _INTERPRETER_TILES if INTERPRET else TILES[64 if d <= 64 else 128]


def attention_backward(dqkv, dout, out, lse, qkv, n_q_heads: int, n_kv_heads: int, documents=None,
                       tiles=None) -> None:
    """dqkv[B, T, Hq + 2 Hkv, D] (overwritten) from dout/out[B, T, Hq, D], lse[B, Hq, T] fp32 and the post-RoPE
    qkv; the same contract as Backend.attention_backward, bit-reproducible. All tensors contiguous.

    ``documents`` (document masking; backends/attention.py's DocumentMask, or its rows): a query sees only keys of
    its own document, and whole tiles outside the document are skipped: the dK/dV program of a key block stops at
    the end of its last key's document (``documents.ends``), the dQ program of a query block starts at the start
    of its first query's document (``documents.starts``), so the work shrinks with the documents.

    ``tiles``: ((BLOCK_M, BLOCK_N, warps, stages) of the dK/dV kernel, the same of the dQ kernel) instead of
    ``TILES`` (benchmarks/attention_tiles.py and the tests try others)."""
    b, t, h, d = qkv.shape
    if h != n_q_heads + 2 * n_kv_heads or n_q_heads % n_kv_heads:
        raise ValueError(f"attention_backward: qkv {tuple(qkv.shape)} does not match Hq={n_q_heads}, Hkv={n_kv_heads}")
    if not (qkv.is_contiguous() and dqkv.is_contiguous() and dqkv.shape == qkv.shape):
        raise ValueError("attention_backward: qkv and dqkv must be contiguous and of the same shape")
    for name, x in (("out", out), ("dout", dout)):
        if tuple(x.shape) != (b, t, n_q_heads, d) or not x.is_contiguous():
            raise ValueError(f"attention_backward: {name} must be contiguous [{b}, {t}, {n_q_heads}, {d}], got "
                             f"{tuple(x.shape)} strides {x.stride()}")
    if tuple(lse.shape) != (b, n_q_heads, t) or lse.dtype != torch.float32 or not lse.is_contiguous():
        raise ValueError(f"attention_backward: lse must be contiguous fp32 [{b}, {n_q_heads}, {t}]")
    block_d = next_pow2(d)
    dkdv_tiles, dq_tiles = tiles or _tiles(d)
    delta = torch.empty(b, n_q_heads, t, dtype=torch.float32, device=qkv.device)
    _delta_kernel[(triton.cdiv(t, 64), b, n_q_heads)](out, dout, delta, t, n_q_heads, out.stride(0), out.stride(1),
                                                     out.stride(2), BLOCK_T=64, BLOCK_D=block_d, D=d)
    common = dict(BLOCK_D=block_d, D=d, GROUP=n_q_heads // n_kv_heads, DOT_F32=INTERPRET or qkv.dtype == torch.float32,
                  # fp32 tiles: true fp32 products ("ieee"); Triton's default for fp32 dots on NVIDIA is TF32
                  # (10-bit mantissa). bf16 tiles: the default (None), the same kernels as measured on the H100.
                  PREC="ieee" if qkv.dtype == torch.float32 else None)
    scale = 1.0 / math.sqrt(d)
    tail = (t, n_q_heads, n_kv_heads, scale, scale * LOG2E, qkv.stride(0), qkv.stride(1), dout.stride(0),
            dout.stride(1), dout.stride(2))
    if documents is None:
        seg = starts = ends = delta  # not read (DOCS=False)
    else:
        seg, starts, ends = documents.segments, documents.starts, documents.ends
        for name, x in (("segments", seg), ("starts", starts), ("ends", ends)):
            if tuple(x.shape) != (b, t) or x.dtype != torch.int32 or not x.is_contiguous():
                raise ValueError(f"attention_backward: documents.{name} must be contiguous int32 [{b}, {t}]")
    head = (qkv, dout, lse, delta, dqkv, seg)
    common["DOCS"] = documents is not None
    bm, bn, warps, stages = dkdv_tiles
    _dkdv_kernel[(triton.cdiv(t, bn), b, n_kv_heads)](*head, ends, *tail, **common, BLOCK_M=bm, BLOCK_N=bn,
                                                      num_warps=warps, num_stages=stages)
    bm, bn, warps, stages = dq_tiles
    _dq_kernel[(triton.cdiv(t, bm), b, n_q_heads)](*head, starts, *tail, **common, BLOCK_M=bm, BLOCK_N=bn,
                                                   num_warps=warps, num_stages=stages)
