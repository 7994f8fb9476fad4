"""Token sources behind one small interface, and glob resolution.

A source is one file of training tokens:
  - ``.bin``: an llm.q or llm.c shard (see shards.py), memory-mapped;
  - ``.parquet`` / ``.arrow`` / ``.feather`` / ``.ipc``: a table with a token column (default "tokens")
    holding either one integer per row (a flat token stream) or a list of integers per row (documents,
    concatenated in row order exactly as stored, so put EOS tokens in the lists if you want them).
    Arrow/Parquet sources have no loss masks. They are read into memory once per process.

Every source offers ``path``, ``n_tokens``, ``tokens`` (an indexable 1-D integer array) and
``target_mask(start, stop) -> bool[stop-start]``. ``get_source`` caches opened sources per process (keyed by
path, size and mtime), which is what lets Ray Data tasks re-open files cheaply.
"""

from __future__ import annotations

import os
from typing import Iterable, Optional, Sequence, Union

import numpy as np

from llmq_ray import storage
from llmq_ray.errors import DataError, LLMQError

from .shards import Shard, check_token_ids, open_shard

ARROW_SUFFIXES = (".parquet", ".arrow", ".feather", ".ipc")


class ArrowSource:
    """A token column of a Parquet/Arrow file, flattened to int64 [n] in memory."""

    def __init__(self, path: str, column: str = "tokens", check_ids: bool = True, vocab_size: Optional[int] = None):
        import pyarrow as pa

        self.path = path
        table = _read_table(path)
        if column not in table.column_names:
            raise DataError(
                f"{path}: no column {column!r} with tokens (columns: {', '.join(table.column_names) or 'none'}); "
                f"pass the right token_column."
            )
        col = table.column(column).combine_chunks()
        if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
            col = col.flatten()
        if not pa.types.is_integer(col.type):
            raise DataError(f"{path}: column {column!r} has type {col.type}, not integers or lists of integers.")
        if col.null_count:
            raise DataError(f"{path}: column {column!r} holds {col.null_count} null tokens.")
        self.tokens = col.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
        self.n_tokens = len(self.tokens)
        meta = table.schema.metadata or {}
        if vocab_size is None and b"vocab_size" in meta:
            vocab_size = int(meta[b"vocab_size"])
        self.vocab_size = vocab_size
        if check_ids:
            check_token_ids(self.tokens, vocab_size, path, 0, 0)

    has_masks = False

    def target_mask(self, start: int, stop: int) -> np.ndarray:
        return np.ones(stop - start, dtype=bool)


def _read_table(path: str):
    import pyarrow as pa
    import pyarrow.feather as feather
    import pyarrow.parquet as pq

    try:
        if path.endswith(".parquet"):
            return pq.read_table(path)
        try:
            return feather.read_table(path)
        except pa.ArrowInvalid:
            with pa.memory_map(path) as src:
                return pa.ipc.open_stream(src).read_all()
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{path}: cannot read as {'Parquet' if path.endswith('.parquet') else 'Arrow'}: {e}.") from None


class BinSource:
    """Adapter giving a Shard the source interface (tokens stay memory-mapped)."""

    def __init__(self, path: str, check_ids: bool = True, vocab_size: Optional[int] = None):
        self.shard: Shard = open_shard(path, check_ids=check_ids, vocab_size=vocab_size)
        self.path = path
        self.tokens = self.shard.tokens
        self.n_tokens = len(self.shard)
        self.has_masks = self.shard.has_masks
        self.vocab_size = vocab_size if vocab_size is not None else self.shard.info.vocab_size

    def target_mask(self, start: int, stop: int) -> np.ndarray:
        return self.shard.target_mask(start, stop)


def open_source(path: str, token_column: str = "tokens", check_ids: bool = True, vocab_size: Optional[int] = None):
    """Open a .bin shard or an Arrow/Parquet token file by its suffix."""
    if path.endswith(ARROW_SUFFIXES):
        return ArrowSource(path, token_column, check_ids, vocab_size)
    return BinSource(path, check_ids, vocab_size)


_CACHE: dict = {}


def get_source(path: str, token_column: str = "tokens", check_ids: bool = False, vocab_size: Optional[int] = None):
    """Per-process cached ``open_source`` (re-opened when the file's size or mtime changes)."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise DataError(f"{path}: cannot open token file ({e.strerror}).") from None
    key = (path, st.st_size, st.st_mtime_ns, token_column, vocab_size)
    src = _CACHE.get(key)
    if src is None:
        if len(_CACHE) > 4096:
            _CACHE.clear()
        src = _CACHE[key] = open_source(path, token_column, check_ids, vocab_size)
    return src


def resolve_files(pattern: Union[str, Sequence[str]]) -> list[str]:
    """Expand a glob (or a comma-separated list of globs, or a list) into a sorted, de-duplicated file list.

    Sorting makes the file list, and so the whole window order, independent of directory listing order. A glob
    on an object store (``s3://bucket/data/train-*.bin``) is listed there and each file fetched once into this
    node's cache (llmq_ray/storage.py); the list holds those local copies, in the order of their URIs, so local
    and remote data give the same order.
    """
    patterns: Iterable[str] = pattern.split(",") if isinstance(pattern, str) else pattern
    files: dict[str, str] = {}  # sort key (absolute path or URI) -> local path
    for p in patterns:
        p = p.strip()
        if not p:
            continue
        try:
            matched = storage.glob(p, "")
        except LLMQError as exc:
            raise DataError(str(exc)) from None
        if not matched:
            raise DataError(f"{p!r} matched no token files; check the path or glob.")
        for m in matched:
            files[m] = storage.fetch(m, "") if storage.is_remote(m) else m
    if not files:
        raise DataError(f"{pattern!r} matched no token files; check the path or glob.")
    return [files[k] for k in sorted(files)]
