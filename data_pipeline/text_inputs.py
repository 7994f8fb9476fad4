"""Documents to tokenize, from tiny-shakespeare, text files/globs, jsonl (a field) or parquet (a column).

Every reader yields *pieces* ``(text, ends_document)`` in a fixed order; the tokenizer appends EOS after
a piece that ends a document. Large plain-text documents are cut into pieces of about ``chunk_chars``
characters, only where a line ends and the next starts with a letter: with a regex pre-tokenizer
(Qwen's) no token spans such a point, so pieces encode to exactly the ids of the whole text, and several
processes can share one big file. Tokenizers without that guarantee get whole documents (chunk_chars=0).

The input name ``tiny-shakespeare`` needs no download: the corpus (Shakespeare's text, public domain, as
collected in karpathy/char-rnn; 1,115,394 bytes) ships with this package, gzip-compressed, as
``corpora/tinyshakespeare.txt.gz``; ``tiny_shakespeare_path`` says where it is read from.
"""

from __future__ import annotations

import glob as _glob
import gzip
import json
import os
import urllib.request
import uuid
import zlib
from typing import Iterator

from llmq_ray.errors import DataError

TINY_SHAKESPEARE_FILE = "tinyshakespeare.txt"
TINY_SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
TINY_SHAKESPEARE_BYTES = 1_115_394
# the copy shipped with the package (declared in pyproject.toml's [tool.setuptools.package-data])
EMBEDDED_TINY_SHAKESPEARE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpora",
                                         TINY_SHAKESPEARE_FILE + ".gz")


def _cache_dir() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "llmq_ray")


def tiny_shakespeare_path() -> str:
    """The path of tinyshakespeare.txt, looked up in this order:

    1. ``$LLMQ_DATA_DIR/tinyshakespeare.txt``, when that variable is set and the file exists;
    2. the copy embedded in this package (``corpora/tinyshakespeare.txt.gz``), decompressed once into the
       cache folder (``$XDG_CACHE_HOME/llmq_ray``, default ``~/.cache/llmq_ray``): written to a temporary
       file, its byte count checked against ``TINY_SHAKESPEARE_BYTES``, then renamed into place, so
       concurrent callers never see a partial file; later calls reuse it;
    3. only when the embedded copy is missing (a broken install): a file already in the cache, else a
       one-time download into the cache.

    Raises DataError when none of these gives the file.
    """
    if os.environ.get("LLMQ_DATA_DIR"):
        user = os.path.join(os.environ["LLMQ_DATA_DIR"], TINY_SHAKESPEARE_FILE)
        if os.path.isfile(user):
            return user
    cached = os.path.join(_cache_dir(), TINY_SHAKESPEARE_FILE)
    if os.path.isfile(EMBEDDED_TINY_SHAKESPEARE):
        if os.path.isfile(cached) and os.path.getsize(cached) == TINY_SHAKESPEARE_BYTES:
            return cached
        try:
            with gzip.open(EMBEDDED_TINY_SHAKESPEARE, "rb") as f:
                _write_atomically(cached, f.read())
        except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
            raise DataError(
                f"cannot decompress the embedded tiny-shakespeare ({EMBEDDED_TINY_SHAKESPEARE}) into {cached}: "
                f"{e}; set XDG_CACHE_HOME to a writable folder, or put {TINY_SHAKESPEARE_FILE} in $LLMQ_DATA_DIR."
            ) from None
        return cached
    if os.path.isfile(cached):
        return cached
    try:
        with urllib.request.urlopen(TINY_SHAKESPEARE_URL, timeout=30) as r:
            _write_atomically(cached, r.read())
    except OSError as e:
        looked = [EMBEDDED_TINY_SHAKESPEARE, cached]
        if os.environ.get("LLMQ_DATA_DIR"):
            looked.insert(0, os.path.join(os.environ["LLMQ_DATA_DIR"], TINY_SHAKESPEARE_FILE))
        raise DataError(
            f"tiny-shakespeare is not in {' or '.join(looked)} and downloading it failed ({e}); "
            f"put {TINY_SHAKESPEARE_FILE} in $LLMQ_DATA_DIR or pass the file path as --input."
        ) from None
    return cached


def _write_atomically(path: str, data: bytes) -> None:
    """Write tiny-shakespeare's bytes to ``path`` via a temporary file in the same folder and os.replace,
    after checking their count (OSError, and nothing left behind, when it is wrong)."""
    if len(data) != TINY_SHAKESPEARE_BYTES:
        raise OSError(f"got {len(data)} bytes, expected {TINY_SHAKESPEARE_BYTES}")
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"  # unique per caller, in the target's folder
    try:
        with open(tmp, "xb") as f:
            f.write(data)
        if os.path.getsize(tmp) != TINY_SHAKESPEARE_BYTES:
            raise OSError(f"wrote {os.path.getsize(tmp)} bytes to {tmp}, expected {TINY_SHAKESPEARE_BYTES}")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


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
