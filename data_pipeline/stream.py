"""Training and eval batches from a glob of token files, deterministic and resumable.

    stream = TokenStream("data/train-*.bin", seq_len=1024, batch_size=8, rank=r, world_size=W, seed=0)
    inputs, targets = stream.next_batch()   # torch.int64 [B, T] each; targets -100 where masked
    ckpt["data"] = stream.state()           # {"seed", "epoch", "cursor", "world_size", "total_windows"}
    stream.restore(ckpt["data"])            # the next batch is exactly the one after the saved state

    for inputs, targets in EvalStream("data/eval.bin", 1024, 8, rank=r, world_size=W): ...

The window order is ``order.rank_order`` (a pure function of files, T, seed, epoch, rank, W); the cursor
counts windows this rank has *handed out* (prefetched-but-unconsumed batches don't count), and epochs
roll over inside a batch when needed, so every batch is full. ``use_ray=True`` (default, for the workers)
reads through Ray Data (ray_reader.py); ``use_ray=False`` reads the memmaps directly in this process;
both share ``windows.read_windows`` and give identical batches. Batches are prepared ``prefetch`` ahead
in a background thread, in pinned memory when CUDA is available.
"""

from __future__ import annotations

import queue
import threading
from typing import Iterator, Optional, Sequence, Union

import numpy as np

from llmq_ray.errors import DataError

from .order import rescale_cursor
from .sources import open_source, resolve_files
from .windows import IGNORE_INDEX, DatasetSpec, cached_rank_order, read_windows, to_batch

_STATE_KEYS = ("seed", "epoch", "cursor")


def build_spec(pattern: Union[str, Sequence[str]], seq_len: int, token_column: str = "tokens",
               vocab_size: Optional[int] = None, check_ids: bool = True) -> DatasetSpec:
    """Resolve the glob and validate every file once (header, size, token ids < vocab)."""
    if seq_len < 1:
        raise DataError(f"seq_len must be at least 1, got {seq_len}.")
    files = resolve_files(pattern)
    n_tokens = tuple(open_source(p, token_column, check_ids, vocab_size).n_tokens for p in files)
    return DatasetSpec(tuple(files), n_tokens, int(seq_len), token_column, vocab_size)


def _pin(x):
    import torch

    t = torch.from_numpy(x)
    return t.pin_memory() if _cuda_available() else t


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


class _Prefetcher:
    """Runs a batch generator in a daemon thread, ``depth`` items ahead; exceptions re-raise in get()."""

    _DONE = object()

    def __init__(self, gen: Iterator, depth: int):
        self._q: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._gen = gen
        self._t = threading.Thread(target=self._run, name="TokenStreamPrefetch", daemon=True)
        self._t.start()

    def _run(self):
        try:
            for item in self._gen:
                if not self._put(item):
                    return
        except BaseException as e:  # handed to the consumer
            self._put(e)
            return
        self._put(self._DONE)

    def _put(self, item) -> bool:
        """Queue ``item``, waiting while the queue is full; False (item dropped) once close() was called."""
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def get(self):
        item = self._q.get()
        if item is self._DONE:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self):
        self._stop.set()
        self._t.join(timeout=10)
        close = getattr(self._gen, "close", None)
        if close is not None and not self._t.is_alive():
            close()


class TokenStream:
    """Endless, shuffled, sharded training batches; ``state()``/``restore()`` for exact resumption.

    Args:
      pattern: glob (or comma-separated globs, or a list) of .bin / .parquet / .arrow token files.
      seq_len: T; windows are T+1 tokens at stride T.
      batch_size: B windows per batch.
      rank, world_size: this consumer's share: windows[rank::world_size] of each epoch's order.
      seed: the order of epoch e is a pure function of (seed, e).
      use_ray: read through Ray Data (default, for the workers) or directly in this process.
      token_column: the token column of Arrow/Parquet files.
      vocab_size: overrides the header's vocab for the id check (required for llm.c files to be checked).
      check_ids: scan all token ids at construction (once; ~0.1 s per 100M tokens).
      prefetch: batches prepared ahead in a background thread (0: synchronous).
    """

    def __init__(self, pattern, seq_len: int, batch_size: int, rank: int = 0, world_size: int = 1, seed: int = 0,
                 *, use_ray: bool = True, token_column: str = "tokens", vocab_size: Optional[int] = None,
                 check_ids: bool = True, prefetch: int = 2, spec: Optional[DatasetSpec] = None):
        if batch_size < 1:
            raise DataError(f"batch_size must be at least 1, got {batch_size}.")
        if not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is outside [0, world_size={world_size}).")
        self.spec = spec or build_spec(pattern, seq_len, token_column, vocab_size, check_ids)
        self.seq_len, self.batch_size = int(seq_len), int(batch_size)
        self.rank, self.world_size = int(rank), int(world_size)
        self.use_ray, self.prefetch = bool(use_ray), int(prefetch)
        self.total_windows = int(self.spec.counts.sum())
        self.windows_per_epoch = self.total_windows // self.world_size
        if self.windows_per_epoch == 0:
            raise DataError(
                f"{pattern!r} holds {sum(self.spec.n_tokens)} tokens = {self.total_windows} windows of "
                f"{self.seq_len + 1} tokens, fewer than world_size={self.world_size}; use more data or a shorter seq_len."
            )
        self._seed, self._epoch, self._cursor = int(seed), 0, 0
        self._source: Optional[_Prefetcher] = None
        self._sync_gen: Optional[Iterator] = None

    # ---- state -------------------------------------------------------------------------------
    def state(self) -> dict:
        """JSON-serializable position: the next batch starts at window ``cursor`` of ``epoch`` for this rank."""
        return {"seed": self._seed, "epoch": self._epoch, "cursor": self._cursor,
                "world_size": self.world_size, "total_windows": self.total_windows}

    def restore(self, state: dict) -> None:
        """Continue exactly after ``state`` (a different world size resumes at the nearest earlier point)."""
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise DataError(f"data state {state!r} lacks {', '.join(missing)}; it is not a TokenStream state.")
        if "total_windows" in state and int(state["total_windows"]) != self.total_windows:
            raise DataError(
                f"data state was saved for {state['total_windows']} windows per epoch but these files hold "
                f"{self.total_windows} (different files or seq_len); resuming would not continue the same order."
            )
        cursor = int(state["cursor"])
        old_w = int(state.get("world_size", self.world_size))
        if old_w != self.world_size:
            cursor = rescale_cursor(cursor, old_w, self.world_size)
        epoch = int(state["epoch"])
        if cursor >= self.windows_per_epoch:  # only reachable after a world-size change
            epoch, cursor = epoch + 1, 0
        self.close()
        self._seed, self._epoch, self._cursor = int(state["seed"]), epoch, cursor

    # ---- batches -----------------------------------------------------------------------------
    def _epoch_chunks(self, epoch: int, cursor: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        n = self.windows_per_epoch
        if self.use_ray:
            from .ray_reader import ray_epoch_chunks

            yield from ray_epoch_chunks(self.spec, self._seed, epoch, self.rank, self.world_size, cursor, n,
                                        chunk_windows=self.batch_size, prefetch_batches=max(1, self.prefetch))
            return
        files, wins = cached_rank_order(self.spec, self._seed, epoch, self.rank, self.world_size, True, True)
        for lo in range(cursor, n, self.batch_size):
            hi = min(lo + self.batch_size, n)
            yield read_windows(self.spec, files[lo:hi], wins[lo:hi])

    def _batches(self, epoch: int, cursor: int):
        """Endless (inputs, targets, epoch_after, cursor_after); a batch may span an epoch boundary."""
        B, n = self.batch_size, self.windows_per_epoch
        pend_t: list = []
        pend_k: list = []
        have = 0
        while True:
            for tokens, keep in self._epoch_chunks(epoch, cursor):
                i = 0
                while i < len(tokens):
                    take = min(B - have, len(tokens) - i)
                    pend_t.append(tokens[i:i + take])
                    pend_k.append(keep[i:i + take])
                    have += take
                    i += take
                    cursor += take
                    if cursor == n:
                        epoch, cursor = epoch + 1, 0
                    if have == B:
                        t = pend_t[0] if len(pend_t) == 1 else np.concatenate(pend_t)
                        k = pend_k[0] if len(pend_k) == 1 else np.concatenate(pend_k)
                        inputs, targets = to_batch(t, k)
                        yield _pin(inputs), _pin(targets), epoch, cursor
                        pend_t, pend_k, have = [], [], 0
            if cursor != 0:  # the epoch's chunks ended early: the reader is broken, never loop silently
                raise DataError(f"reader stopped at window {cursor} of {n} in epoch {epoch}.")

    def next_batch(self):
        """(inputs torch.int64 [B, T], targets torch.int64 [B, T]); targets are -100 where masked."""
        if self.prefetch > 0:
            if self._source is None:
                self._source = _Prefetcher(self._batches(self._epoch, self._cursor), self.prefetch)
            inputs, targets, self._epoch, self._cursor = self._source.get()
        else:
            if self._sync_gen is None:
                self._sync_gen = self._batches(self._epoch, self._cursor)
            inputs, targets, self._epoch, self._cursor = next(self._sync_gen)
        return inputs, targets

    def __iter__(self):
        return self

    def __next__(self):
        return self.next_batch()

    def close(self) -> None:
        """Stop reading ahead (state is kept; the next next_batch() starts a fresh reader)."""
        if self._source is not None:
            self._source.close()
            self._source = None
        if self._sync_gen is not None:
            self._sync_gen.close()
            self._sync_gen = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class EvalStream:
    """Sequential, unshuffled eval batches; every rank yields the same number of full-shape batches.

    Windows are taken in file order (files sorted), rank r gets positions r, r+W, ...; nothing is dropped.
    The last batches are padded with rows whose targets are all -100 (inputs 0), so they add nothing to a
    loss averaged over unmasked targets, and collectives across ranks stay in step. Reads memmaps directly:
    an eval pass is short and sequential, Ray Data adds nothing there. Re-iterable; each pass starts over.
    """

    def __init__(self, pattern, seq_len: int, batch_size: int, rank: int = 0, world_size: int = 1, *,
                 token_column: str = "tokens", vocab_size: Optional[int] = None, check_ids: bool = True,
                 max_batches: Optional[int] = None, spec: Optional[DatasetSpec] = None):
        if not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is outside [0, world_size={world_size}).")
        self.spec = spec or build_spec(pattern, seq_len, token_column, vocab_size, check_ids)
        self.seq_len, self.batch_size, self.rank, self.world_size = int(seq_len), int(batch_size), int(rank), int(world_size)
        total = int(self.spec.counts.sum())
        if total == 0:
            raise DataError(f"{pattern!r} holds no window of {self.seq_len + 1} tokens; use a shorter seq_len.")
        per_rank_max = -(-total // self.world_size)
        self.num_batches = -(-per_rank_max // self.batch_size)
        if max_batches is not None:
            self.num_batches = min(self.num_batches, int(max_batches))

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self):
        files, wins = cached_rank_order(self.spec, 0, 0, self.rank, self.world_size, False, False)
        B, T = self.batch_size, self.seq_len
        for b in range(self.num_batches):
            f, w = files[b * B:(b + 1) * B], wins[b * B:(b + 1) * B]
            inputs = np.zeros((B, T), dtype=np.int64)
            targets = np.full((B, T), IGNORE_INDEX, dtype=np.int64)
            if len(f):
                i, t = to_batch(*read_windows(self.spec, f, w))
                inputs[: len(f)], targets[: len(f)] = i, t
            yield _pin(inputs), _pin(targets)
