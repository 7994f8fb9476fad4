"""The window order: a pure numpy function of (file token counts, T, seed, epoch, rank, world size).

A *window* is T+1 consecutive tokens of one file starting at a multiple of T (stride T), so a file of n
tokens holds floor((n-1)/T) windows and its last (n-1) mod T tokens are never a window's start (they may
be its final target). Windows never straddle two files.

Training order of one epoch (``shuffle=True``):
  1. the sorted file list is permuted with rng(seed, epoch, stream 0);
  2. the files' windows are laid end to end in that order and numbered 0..N-1;
  3. those N numbers are permuted with rng(seed, epoch, stream 1);
  4. the first N - N mod W are kept (the same tail is dropped on every rank), and rank r takes every W-th
     one starting at r: ``order[r::W]``.
So rank r's i-th window of an epoch is global position i*W + r, the ranks together cover each kept window
exactly once, and after every rank consumed c windows the union consumed is exactly positions [0, c*W).
That last property makes a resume on another world size exact up to rounding (see ``rescale_cursor``).

Eval order (``shuffle=False``): files in sorted order, windows in file order, no tail dropped
(``drop_tail=False``): rank r takes positions r, r+W, ...

The generator is numpy's PCG64 seeded by SeedSequence([seed, epoch, stream]); nothing else (time, pids,
Ray scheduling) enters, so the Ray Data path and the plain path produce identical windows.
"""

from __future__ import annotations

import numpy as np


def windows_per_file(n_tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """int64 [F]: floor((n-1)/T) windows of T+1 tokens at stride T per file (0 for files under T+1 tokens)."""
    n = np.asarray(n_tokens, dtype=np.int64)
    return np.maximum(n - 1, 0) // int(seq_len)


def _rng(seed: int, epoch: int, stream: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), int(epoch), int(stream)])))


def epoch_order(counts: np.ndarray, seed: int, epoch: int, shuffle: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """All windows of an epoch in order, as (file index int32 [N], window index within that file int64 [N])."""
    counts = np.asarray(counts, dtype=np.int64)
    files = _rng(seed, epoch, 0).permutation(len(counts)) if shuffle else np.arange(len(counts))
    laid = counts[files]
    ends = np.cumsum(laid)
    total = int(ends[-1]) if len(ends) else 0
    pos = _rng(seed, epoch, 1).permutation(total) if shuffle else np.arange(total, dtype=np.int64)
    slot = np.searchsorted(ends, pos, side="right")  # which laid-out file each position falls in
    local = pos - (ends[slot] - laid[slot])
    return files[slot].astype(np.int32), local.astype(np.int64)


def rank_order(
    counts: np.ndarray, seed: int, epoch: int, rank: int, world_size: int, shuffle: bool = True, drop_tail: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """Rank r's windows of an epoch: (file index int32 [M], window index int64 [M]), M = N // W if drop_tail."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, world_size={world_size})")
    f, w = epoch_order(counts, seed, epoch, shuffle)
    if drop_tail:
        keep = len(f) - len(f) % world_size
        f, w = f[:keep], w[:keep]
    return f[rank::world_size], w[rank::world_size]


def rescale_cursor(cursor: int, old_world_size: int, new_world_size: int) -> int:
    """Cursor for a new world size: the union consumed was positions [0, cursor*W_old); the new ranks
    restart at the largest multiple of W_new not beyond it (re-reading at most W_new-1 windows)."""
    return (int(cursor) * int(old_world_size)) // int(new_world_size)
