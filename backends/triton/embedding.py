"""Embedding forward (row gather) and a deterministic, atomic-free embedding backward.

Forward: out[n] = table[tokens[n]], a [BLOCK_R, BLOCK_C] gather-copy per program (bits copied as they are).

Backward: dtable[v] += sum over {n : tokens[n] = v} of dout[n]. Float atomics would make the sum order (hence
the bits) vary run to run, so instead: sort the tokens once (stable ``torch.sort`` on the device, no host
sync), cut the sorted positions into chunks of CHUNK, and

1. ``_chunk_head_kernel``: every chunk sums, in registers, the rows of its *first* run (the positions
   holding the chunk's first token) -> head[chunk, C] fp32;
2. ``_segment_kernel``: every chunk loads its [CHUNK, BLOCK_C] tile of dout rows once (gathered through the
   sort permutation, all loads independent, so they overlap), sums the rows of each of its tokens at once
   (a 0/1 "same token" [CHUNK, CHUNK] matrix times the tile, one small fp32 dot), adds to the chunk's last
   run the heads of the following chunks while they continue with the same token, and adds each token's
   total into dtable[token] from the chunk holding its first occurrence (one read-modify-write per distinct
   token, by exactly one program; no loop over positions).

The order of every sum is fixed by the sorted order (ties broken by position, the sort is stable), so the
result is bit-identical from run to run; a token repeated k times costs k/CHUNK serial steps, not k.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmq_ray.backends.triton._common import INTERPRET, cast_to, next_pow2, num_warps_for, tile_rows

CHUNK = 32


@triton.jit
def _embed_fwd_kernel(out_ptr, tokens_ptr, table_ptr, N, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    rmask = rows < N
    mask = rmask[:, None] & (cols < C)[None, :]
    tok = tl.load(tokens_ptr + rows, mask=rmask, other=0).to(tl.int64)
    vals = tl.load(table_ptr + tok[:, None] * C + cols[None, :], mask=mask)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], vals, mask=mask)


@triton.jit
def _load_tile(sorted_ptr, perm_ptr, dout_ptr, chunk, N, C, cols, CHUNK: tl.constexpr):
    """Sorted tokens [CHUNK] (-1 past N) and the fp32 dout rows they came from [CHUNK, BLOCK_C]."""
    pos = chunk * CHUNK + tl.arange(0, CHUNK)
    pmask = pos < N
    toks = tl.load(sorted_ptr + pos, mask=pmask, other=-1)
    src = tl.load(perm_ptr + pos, mask=pmask, other=0)
    mask = pmask[:, None] & (cols < C)[None, :]
    tile = tl.load(dout_ptr + src[:, None] * C + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return toks, tile


@triton.jit
def _chunk_head_kernel(head_ptr, sorted_ptr, perm_ptr, dout_ptr, N, C, CHUNK: tl.constexpr,
                       BLOCK_C: tl.constexpr):
    chunk = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    toks, tile = _load_tile(sorted_ptr, perm_ptr, dout_ptr, chunk, N, C, cols, CHUNK)
    first = tl.load(sorted_ptr + chunk * CHUNK)
    head = tl.sum(tl.where((toks == first)[:, None], tile, 0.0), axis=0)
    tl.store(head_ptr + chunk.to(tl.int64) * C + cols, head, mask=cols < C)


@triton.jit
def _segment_kernel(dtable_ptr, head_ptr, sorted_ptr, perm_ptr, dout_ptr, N, C, num_chunks,
                    CHUNK: tl.constexpr, BLOCK_C: tl.constexpr):
    chunk = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    toks, tile = _load_tile(sorted_ptr, perm_ptr, dout_ptr, chunk, N, C, cols, CHUNK)
    pos = chunk * CHUNK + tl.arange(0, CHUNK)
    prev = tl.load(sorted_ptr + pos - 1, mask=(pos > 0) & (pos < N), other=-1)
    start = (toks >= 0) & (toks != prev)  # first occurrence of the token: this program owns its dtable row
    # row k of sums = the sum of the chunk's rows holding toks[k]: a 0/1 [CHUNK, CHUNK] matrix times the tile
    # (exact fp32 products, fixed summation order; "ieee" keeps the tensor cores out of TF32)
    same = (toks[:, None] == toks[None, :]).to(tl.float32)
    sums = tl.dot(same, tile, input_precision="ieee")
    # the chunk's last run may continue into the next chunks: add their head sums, in order, if we own it
    last = tl.load(sorted_ptr + tl.minimum(chunk * CHUNK + CHUNK, N) - 1)
    owns_last = tl.sum((start & (toks == last)).to(tl.int32), axis=0) > 0
    cont = tl.zeros([BLOCK_C], tl.float32)
    nxt_chunk = chunk + 1
    nxt = tl.load(sorted_ptr + nxt_chunk * CHUNK, mask=owns_last & (nxt_chunk < num_chunks), other=-1)
    while nxt == last:
        cont += tl.load(head_ptr + nxt_chunk.to(tl.int64) * C + cols, mask=cmask, other=0.0)
        nxt_chunk += 1
        nxt = tl.load(sorted_ptr + nxt_chunk * CHUNK, mask=nxt_chunk < num_chunks, other=-1)
    sums += tl.where((toks == last)[:, None], cont[None, :], 0.0)
    mask = start[:, None] & cmask[None, :]
    rows = dtable_ptr + tl.maximum(toks, 0).to(tl.int64)[:, None] * C + cols[None, :]
    total = tl.load(rows, mask=mask, other=0.0).to(tl.float32) + sums
    tl.store(rows, cast_to(total, dtable_ptr.dtype.element_ty), mask=mask)


def embedding_forward(out, tokens, table) -> None:
    """out[N, C] = table[tokens[N]] (tokens int32/int64, table [V, C])."""
    n = tokens.numel()
    c = table.shape[1]
    block_c = min(next_pow2(c), 4096 if INTERPRET else 1024)
    block_r = tile_rows(block_c, gpu_elems=2048)
    grid = (triton.cdiv(n, block_r), triton.cdiv(c, block_c))
    _embed_fwd_kernel[grid](out, tokens, table, n, c, BLOCK_R=block_r, BLOCK_C=block_c,
                            num_warps=num_warps_for(block_r * block_c))


def embedding_backward(dtable, tokens, dout) -> None:
    """dtable[V, C] += deterministic scatter-add of dout[N, C] into rows tokens[N]."""
    n = tokens.numel()
    if n == 0:
        return
    c = dtable.shape[1]
    sorted_tok, perm = torch.sort(tokens.reshape(-1).long(), stable=True)
    num_chunks = triton.cdiv(n, CHUNK)
    block_c = min(next_pow2(c), 4096 if INTERPRET else 128)
    grid = (num_chunks, triton.cdiv(c, block_c))
    head = torch.empty(num_chunks, c, dtype=torch.float32, device=dout.device)
    warps = num_warps_for(CHUNK * block_c)
    _chunk_head_kernel[grid](head, sorted_tok, perm, dout, n, c, CHUNK=CHUNK, BLOCK_C=block_c, num_warps=warps)
    _segment_kernel[grid](dtable, head, sorted_tok, perm, dout, n, c, num_chunks, CHUNK=CHUNK, BLOCK_C=block_c,
                          num_warps=warps)
