"""The Ray Data path: one epoch of one rank's windows, read by Ray tasks, delivered in order.

Pipeline for (epoch e, starting at cursor c, M windows for this rank in the epoch):

    ray.data.range(M - c)                          row i  ->  rank-local position c + i
      .map_batches(_read_block, batch_size=256)    position -> (file, window) through the same pure order
                                                   function as the plain path; memmap slices copied out
      .iter_batches(prefetch_batches=k)            numpy {"tokens": int32 [n, T+1], "keep": bool [n, T]}

Order is kept with ``DataContext.execution_options.preserve_order = True`` (without it Ray Data emits
blocks in completion order). Each task recomputes the (seed, epoch) order once per process and caches it
(``cached_rank_order``), so only a tiny DatasetSpec travels with the tasks, never an index array.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from .windows import DatasetSpec, cached_rank_order, read_windows


def _read_block(batch: dict, spec: DatasetSpec, seed: int, epoch: int, rank: int, world_size: int,
                shuffle: bool, drop_tail: bool, cursor: int) -> dict:
    pos = np.asarray(batch["id"], dtype=np.int64) + cursor
    files, wins = cached_rank_order(spec, seed, epoch, rank, world_size, shuffle, drop_tail)
    tokens, keep = read_windows(spec, files[pos], wins[pos])
    return {"tokens": tokens, "keep": keep}


def configure_data_context() -> None:
    """Deterministic output order, no progress bars (the stream runs inside worker actors) and a quiet console:
    Ray Data's lines of every dataset ("Starting execution of Dataset ...", "Execution plan ...", "Progress bars
    disabled ...", "Dataset ... execution finished") would reach the driver's console through every worker's log
    prefix, several per epoch. They stay in the Ray session's ``logs/ray-data/`` files; Ray Data's warnings and
    errors still reach the console."""
    import logging

    from ray.data import DataContext

    ctx = DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.print_on_execution_start = False  # "Starting execution of ..." and "Execution plan of ..."
    if ctx.enable_progress_bars:
        ctx.enable_progress_bars = False
    for handler in logging.getLogger("ray.data").handlers:  # Ray Data's own config: a "console" and a file handler
        if handler.get_name() == "console" and handler.level < logging.WARNING:
            handler.setLevel(logging.WARNING)  # "Dataset ... execution finished" and other info: the file only
    nag = logging.getLogger("ray.data._internal.progress")
    if not any(isinstance(f, _ProgressBarsOffNote) for f in nag.filters):
        nag.addFilter(_ProgressBarsOffNote())


class _ProgressBarsOffNote:
    """Drops Ray Data's warning that progress bars are disabled (we turned them off on purpose)."""

    def filter(self, record) -> bool:
        return not record.getMessage().startswith("Progress bars disabled")


def ray_epoch_chunks(spec: DatasetSpec, seed: int, epoch: int, rank: int, world_size: int, cursor: int,
                     n_windows: int, chunk_windows: int, prefetch_batches: int, shuffle: bool = True,
                     drop_tail: bool = True, block_windows: int = 256) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield (tokens int32 [k, T+1], keep bool [k, T]) for rank-local positions [cursor, n_windows) in order."""
    import ray.data

    remaining = n_windows - cursor
    if remaining <= 0:
        return
    configure_data_context()
    n_blocks = max(1, min(64, -(-remaining // block_windows)))
    ds = ray.data.range(remaining, override_num_blocks=n_blocks)
    ds = ds.map_batches(
        _read_block,
        batch_size=block_windows,
        batch_format="numpy",
        fn_kwargs=dict(spec=spec, seed=seed, epoch=epoch, rank=rank, world_size=world_size,
                       shuffle=shuffle, drop_tail=drop_tail, cursor=cursor),
    )
    for b in ds.iter_batches(batch_size=chunk_windows, batch_format="numpy", prefetch_batches=prefetch_batches,
                             drop_last=False):
        yield b["tokens"], b["keep"]
