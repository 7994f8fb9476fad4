"""Reading windows out of token files, and turning windows into (inputs, targets) batches.

Shared by the plain path and the Ray Data path, so both produce bit-identical batches.

Shapes and dtypes:
  read_windows  -> tokens int32 [n, T+1], keep bool [n, T]  (keep[i, j]: token start+1+j counts as a target)
  to_batch      -> inputs int64 [n, T] = tokens[:, :T], targets int64 [n, T] = tokens[:, 1:], -100 where
                   keep is False (the ignore index of torch's cross-entropy and of our fused classifier)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from .order import rank_order, windows_per_file
from .sources import get_source

IGNORE_INDEX = -100


@dataclass(frozen=True)
class DatasetSpec:
    """What a reader needs to find windows: files (sorted), their token counts, T, and how to open them.

    Small and picklable, so it travels to Ray Data tasks, which re-open files through a per-process cache.
    """

    paths: tuple
    n_tokens: tuple
    seq_len: int
    token_column: str = "tokens"
    vocab_size: Optional[int] = None

    @property
    def counts(self) -> np.ndarray:
        """Windows per file, int64 [F]."""
        return windows_per_file(np.asarray(self.n_tokens, dtype=np.int64), self.seq_len)


def read_windows(spec: DatasetSpec, file_idx: np.ndarray, win_idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Copy windows (file_idx[i], win_idx[i]) out of the files: tokens int32 [n, T+1], keep bool [n, T]."""
    T = spec.seq_len
    n = len(file_idx)
    tokens = np.empty((n, T + 1), dtype=np.int32)
    keep = np.ones((n, T), dtype=bool)
    for i in range(n):
        src = get_source(spec.paths[file_idx[i]], spec.token_column, False, spec.vocab_size)
        s = int(win_idx[i]) * T
        tokens[i] = src.tokens[s : s + T + 1]
        if src.has_masks:
            keep[i] = src.target_mask(s + 1, s + T + 1)
    return tokens, keep


def to_batch(tokens: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(inputs int64 [n, T], targets int64 [n, T] with -100 where masked) from read_windows' output."""
    inputs = tokens[:, :-1].astype(np.int64)
    targets = tokens[:, 1:].astype(np.int64)
    targets[~keep] = IGNORE_INDEX
    return inputs, targets


_ORDER_CACHE: dict = {}


def cached_rank_order(spec: DatasetSpec, seed: int, epoch: int, rank: int, world_size: int, shuffle: bool, drop_tail: bool):
    """rank_order memoized per process (a Ray task reading one block needs the same order many times)."""
    key = (spec, seed, epoch, rank, world_size, shuffle, drop_tail)
    hit = _ORDER_CACHE.get(key)
    if hit is None:
        if len(_ORDER_CACHE) >= 4:
            _ORDER_CACHE.clear()
        hit = _ORDER_CACHE[key] = rank_order(spec.counts, seed, epoch, rank, world_size, shuffle, drop_tail)
    return hit
