"""Documents to tokenize, from tiny-shakespeare, text files/globs, jsonl (a field) or parquet (a column).

Every reader yields *pieces* ``(text, ends_document)`` in a fixed order; the tokenizer appends EOS after
a piece that ends a document. Large plain-text documents are cut into pieces of about ``chunk_chars``
characters, only where a line ends and the next starts with a letter: with a regex pre-tokenizer
(Qwen's) no token spans such a point, so pieces encode to exactly the ids of the whole text, and several
processes can share one big file. Tokenizers without that guarantee get whole documents (chunk_chars=0).
"""

from __future__ import annotations

import glob as _glob
import json
import os
import urllib.request
from typing import Iterator

from llmq_ray.errors import DataError

TINY_SHAKESPEARE_FILE = "tinyshakespeare.txt"
TINY_SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
TINY_SHAKESPEARE_BYTES = 1_115_394


def _cache_dir() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "llmq_ray")


def tiny_shakespeare_path() -> str:
    """$LLMQ_DATA_DIR/tinyshakespeare.txt, else the cache, else a one-time download into the cache."""
    candidates = []
    if os.environ.get("LLMQ_DATA_DIR"):
        candidates.append(os.path.join(os.environ["LLMQ_DATA_DIR"], TINY_SHAKESPEARE_FILE))
    cached = os.path.join(_cache_dir(), TINY_SHAKESPEARE_FILE)
    candidates.append(cached)
    for c in candidates:
        if os.path.isfile(c):
            return c
    os.makedirs(os.path.dirname(cached), exist_ok=True)
    tmp = cached + f".{os.getpid()}.tmp"
    try:
        with urllib.request.urlopen(TINY_SHAKESPEARE_URL, timeout=30) as r, open(tmp, "wb") as f:
            f.write(r.read())
        if os.path.getsize(tmp) != TINY_SHAKESPEARE_BYTES:
            raise OSError(f"got {os.path.getsize(tmp)} bytes, expected {TINY_SHAKESPEARE_BYTES}")
        os.replace(tmp, cached)
    except OSError as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise DataError(
            f"tiny-shakespeare is not in {' or '.join(candidates)} and downloading it failed ({e}); "
            f"put {TINY_SHAKESPEARE_FILE} in $LLMQ_DATA_DIR or pass the file path as --input."
        ) from None
    return cached


def expand_inputs(inputs: list[str]) -> list[str]:
    """Resolve 'tiny-shakespeare' and globs into a list of files (each glob sorted, order of arguments kept)."""
    files: list[str] = []
    for item in inputs:
        if item == "tiny-shakespeare":
            files.append(tiny_shakespeare_path())
            continue
        matched = sorted(m for m in _glob.glob(os.path.expanduser(item), recursive=True) if os.path.isfile(m))
        if not matched:
            raise DataError(f"input {item!r} matched no files; check the path or glob.")
        files.extend(matched)
    return files


def detect_format(path: str, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    if path.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl"
    if path.endswith(".parquet"):
        return "parquet"
    return "text"


def split_text(text: str, chunk_chars: int) -> list[str]:
    """Cut text into pieces of >= chunk_chars, each cut right after '\\n' and before a letter."""
    if chunk_chars <= 0 or len(text) <= chunk_chars:
        return [text]
    pieces, start = [], 0
    while len(text) - start > chunk_chars:
        cut = start + chunk_chars
        while cut < len(text) and not (text[cut - 1] == "\n" and text[cut].isalpha()):
            cut += 1
        if cut >= len(text):
            break
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def iter_pieces(files: list[str], fmt: str = "auto", field: str = "text", chunk_chars: int = 0) -> Iterator[tuple[str, bool, int]]:
    """Yield (text, ends_document, source bytes consumed) for every document of every file, in order."""
    for path in files:
        kind = detect_format(path, fmt)
        if kind == "text":
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except UnicodeDecodeError as e:
                raise DataError(f"{path}: not UTF-8 text (byte offset {e.start}).") from None
            pieces = split_text(text, chunk_chars)
            per = os.path.getsize(path) // len(pieces)
            for i, p in enumerate(pieces):
                yield p, i == len(pieces) - 1, per
        elif kind == "jsonl":
            with open(path, "rb") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        doc = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(f"{path}: line {lineno} is not valid JSON ({e.msg}).") from None
                    if not isinstance(doc, dict) or not isinstance(doc.get(field), str):
                        raise DataError(f"{path}: line {lineno} has no string field {field!r}; pass --field.")
                    yield doc[field], True, len(line)
        elif kind == "parquet":
            import pyarrow.parquet as pq

            try:
                pf = pq.ParquetFile(path)
            except Exception as e:
                raise DataError(f"{path}: cannot read as Parquet ({e}).") from None
            names = pf.schema_arrow.names
            if field not in names:
                raise DataError(f"{path}: no column {field!r} (columns: {', '.join(names)}); pass --field.")
            size = os.path.getsize(path)
            rows = max(1, pf.metadata.num_rows)
            for batch in pf.iter_batches(columns=[field], batch_size=1024):
                for doc in batch.column(0).to_pylist():
                    if doc is None:
                        continue
                    yield str(doc), True, size // rows
        else:
            raise DataError(f"unknown input format {kind!r}; use auto, text, jsonl or parquet.")
