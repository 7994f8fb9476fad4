"""Token shard files: llm.q's ``.bin`` (read and written) and llm.c's uint16 ``.bin`` (read).

llm.q format (little-endian), what we write:

    bytes 0..1023   header, int32[256]: bytes 0-7 = b"BIN.TOK\\n", then int32 fields
                    [2] version (2), [3] bytes per token (4), [4] token count n,
                    [5] vocab size, [6] has-masks (0/1); the rest zero
    1024 ..         int32 tokens[n]
    then            if has-masks: uint8 bitmap[ceil(n/8)], LSB first: bit (i % 8) of byte i // 8
                    is 1 when token i is trained on *as a target* (0 = masked, loss ignores it)

llm.c format: int32[256] header with [0] magic 20240520, [1] version 1, [2] token count, then uint16 tokens.

Everything is read through ``numpy.memmap`` so a shard of any size costs no memory until a window is
sliced out of it. Every check that fails raises :class:`llmq_ray.errors.DataError` with one sentence
naming the file (and the byte offset where one applies).

Mask semantics differ from llm.q on purpose: here bit i refers to token i *as a target* (the label that
position i-1 predicts); llm.q applies the mask one position off.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Optional

import numpy as np

from llmq_ray.errors import DataError

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
LLMQ_MAGIC = b"BIN.TOK\n"
LLMQ_VERSION = 2
LLMC_MAGIC = 20240520
LLMC_VERSION = 1
MAX_TOKENS_PER_FILE = 2**31 - 1  # the token count is an int32 field
_ID_CHECK_CHUNK = 1 << 24  # tokens scanned per step when validating ids (64 MiB of int32)


@dataclass(frozen=True)
class ShardInfo:
    """What a shard's header says, after it was checked against the file size.

    format: "llmq" (int32 tokens, optional masks) or "llmc" (uint16 tokens, no masks, no vocab field).
    vocab_size: from the header (llmq) or None (llmc: the format has no such field).
    """

    path: str
    format: str
    version: int
    n_tokens: int
    vocab_size: Optional[int]
    has_masks: bool
    token_dtype: np.dtype


def mask_nbytes(n_tokens: int) -> int:
    """Bytes of the LSB-first loss-mask bitmap for n tokens."""
    return (n_tokens + 7) // 8


def read_header(path: str) -> ShardInfo:
    """Read and check a shard header; the file size must match what the header promises exactly."""
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise DataError(f"{path}: cannot open token shard ({e.strerror}).") from None
    if size < HEADER_BYTES:
        raise DataError(
            f"{path}: truncated token shard: {size} bytes, shorter than the {HEADER_BYTES}-byte header."
        )
    with open(path, "rb") as f:
        raw = f.read(HEADER_BYTES)
    ints = np.frombuffer(raw, dtype="<i4")
    if raw[:8] == LLMQ_MAGIC:
        version, bpt, n, vocab, has_masks = (int(x) for x in ints[2:7])
        if version not in (1, LLMQ_VERSION):
            raise DataError(f"{path}: unsupported llm.q shard version {version} at byte offset 8 (expected 2).")
        if bpt != 4:
            raise DataError(f"{path}: {bpt} bytes per token at byte offset 12; only int32 (4) tokens are supported.")
        if n < 0 or vocab <= 0 or has_masks not in (0, 1):
            raise DataError(
                f"{path}: corrupt llm.q header (token count {n}, vocab size {vocab}, has-masks {has_masks} "
                f"at byte offsets 16-27)."
            )
        expected = HEADER_BYTES + 4 * n + (mask_nbytes(n) if has_masks else 0)
        info = ShardInfo(path, "llmq", version, n, vocab, bool(has_masks), np.dtype("<i4"))
    elif int(ints[0]) == LLMC_MAGIC:
        version, n = int(ints[1]), int(ints[2])
        if version != LLMC_VERSION:
            raise DataError(f"{path}: unsupported llm.c shard version {version} at byte offset 4 (expected 1).")
        if n < 0:
            raise DataError(f"{path}: corrupt llm.c header: negative token count {n} at byte offset 8.")
        expected = HEADER_BYTES + 2 * n
        info = ShardInfo(path, "llmc", version, n, None, False, np.dtype("<u2"))
    else:
        raise DataError(
            f"{path}: not a token shard: wrong magic {raw[:8]!r} at byte offset 0 "
            f"(expected b'BIN.TOK\\n' for llm.q or int32 {LLMC_MAGIC} for llm.c)."
        )
    if size != expected:
        what = "truncated" if size < expected else "has trailing bytes"
        raise DataError(
            f"{path}: header/size mismatch ({what}): the header promises {info.n_tokens} tokens"
            f"{' and a mask bitmap' if info.has_masks else ''} = {expected} bytes, but the file is {size} bytes."
        )
    return info


class Shard:
    """An opened, validated shard: ``tokens`` is a read-only memmap of shape [n] (int32 or uint16).

    ``target_mask(start, stop)`` returns bool[stop-start], True where token i in [start, stop) counts as a
    target (always True for shards without masks).
    """

    def __init__(self, info: ShardInfo):
        self.info = info
        self.path = info.path
        n = info.n_tokens
        if n:
            self.tokens = np.memmap(info.path, dtype=info.token_dtype, mode="r", offset=HEADER_BYTES, shape=(n,))
        else:
            self.tokens = np.zeros(0, dtype=info.token_dtype)
        self.mask_bits = None
        if info.has_masks and n:
            off = HEADER_BYTES + info.token_dtype.itemsize * n
            self.mask_bits = np.memmap(info.path, dtype=np.uint8, mode="r", offset=off, shape=(mask_nbytes(n),))

    def __len__(self) -> int:
        return self.info.n_tokens

    @property
    def has_masks(self) -> bool:
        return self.mask_bits is not None

    def target_mask(self, start: int, stop: int) -> np.ndarray:
        """bool[stop-start]: bit i of the LSB-first bitmap for i in [start, stop)."""
        if self.mask_bits is None:
            return np.ones(stop - start, dtype=bool)
        b0, b1 = start >> 3, (stop + 7) >> 3
        bits = np.unpackbits(np.asarray(self.mask_bits[b0:b1]), bitorder="little")
        lo = start - (b0 << 3)
        return bits[lo : lo + (stop - start)].astype(bool)

    def check_ids(self, vocab_size: Optional[int] = None) -> None:
        """Raise DataError at the first token id outside [0, vocab); vocab from the header unless given."""
        vocab = vocab_size if vocab_size is not None else self.info.vocab_size
        check_token_ids(self.tokens, vocab, self.path, HEADER_BYTES, self.info.token_dtype.itemsize)


def check_token_ids(tokens: np.ndarray, vocab: Optional[int], path: str, byte_base: int = 0, itemsize: int = 4,
                    first_index: int = 0):
    """Scan tokens in chunks; raise DataError naming the first bad id, its token index and byte offset.
    ``first_index``: the file's token index of ``tokens[0]`` (when ``tokens`` is a slice of the file)."""
    n = len(tokens)
    for lo in range(0, n, _ID_CHECK_CHUNK):
        chunk = np.asarray(tokens[lo : lo + _ID_CHECK_CHUNK])
        bad = chunk < 0
        if vocab is not None:
            bad |= chunk >= vocab
        if bad.any():
            i = lo + int(np.argmax(bad))
            tok = int(tokens[i])
            limit = f">= vocab size {vocab}" if vocab is not None and tok >= vocab else "negative"
            i += first_index
            raise DataError(
                f"{path}: token id {tok} at token index {i} (byte offset {byte_base + itemsize * i}) is {limit}."
            )


def open_shard(path: str, check_ids: bool = True, vocab_size: Optional[int] = None) -> Shard:
    """Open and validate a shard (header, size and, unless check_ids=False, every token id < vocab).

    vocab_size overrides the header's value for the id check (needed for llm.c files, which carry none,
    and for llm.q files whose tokenizer script recorded the base vocabulary without the special tokens).
    """
    shard = Shard(read_header(path))
    if check_ids:
        shard.check_ids(vocab_size)
    return shard


def _publish(tmp: str, path: str) -> None:
    """Give the temporary file normal permissions (mkstemp makes it 0600) and rename it into place."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    os.replace(tmp, path)


def _atomic_target(path: str):
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=d)
    return os.fdopen(fd, "wb"), tmp


class ShardWriter:
    """Stream tokens (and optional per-token target masks) into an llm.q shard, written atomically.

    Tokens go to a temporary file next to ``path``; ``close()`` appends the mask bitmap, writes the
    header and renames the file into place, so a crash never leaves a shard that looks complete.
    Use as a context manager: on an exception the temporary file is removed.
    """

    def __init__(self, path: str, vocab_size: int, has_masks: bool = False):
        if vocab_size <= 0:
            raise DataError(f"{path}: vocab size must be positive, got {vocab_size}.")
        self.path, self.vocab_size, self.has_masks = path, int(vocab_size), bool(has_masks)
        self.n_tokens = 0
        self._mask_bytes: list[bytes] = []  # the bitmap, packed 8 tokens a byte as they come (n/8 bytes held)
        self._mask_tail = np.zeros(0, dtype=bool)  # the last n % 8 mask bits, not yet a whole byte
        self._f, self._tmp = _atomic_target(path)
        self._f.write(b"\0" * HEADER_BYTES)

    def write(self, tokens, mask=None) -> None:
        """Append int tokens [k] (and, for a masked shard, bool mask [k]: True = trained on as a target)."""
        tokens = np.asarray(tokens)
        if tokens.ndim != 1:
            raise DataError(f"{self.path}: tokens must be 1-D, got shape {tokens.shape}.")
        if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size):
            bad = int(np.argmax((tokens < 0) | (tokens >= self.vocab_size)))
            raise DataError(
                f"{self.path}: token id {int(tokens[bad])} at token index {self.n_tokens + bad} "
                f"is outside the vocabulary [0, {self.vocab_size})."
            )
        if (mask is not None) != self.has_masks:
            raise DataError(f"{self.path}: a mask must be given for every write exactly when has_masks=True.")
        if self.n_tokens + tokens.size > MAX_TOKENS_PER_FILE:
            raise DataError(f"{self.path}: more than {MAX_TOKENS_PER_FILE} tokens do not fit one shard.")
        self._f.write(tokens.astype("<i4", copy=False).tobytes())
        if mask is not None:
            mask = np.asarray(mask, dtype=bool)
            if mask.shape != tokens.shape:
                raise DataError(f"{self.path}: mask shape {mask.shape} differs from tokens shape {tokens.shape}.")
            bits = np.concatenate([self._mask_tail, mask])
            whole = len(bits) & ~7
            self._mask_bytes.append(np.packbits(bits[:whole], bitorder="little").tobytes())
            self._mask_tail = bits[whole:]
        self.n_tokens += tokens.size

    def close(self) -> str:
        """Finish the file (bitmap, header) and move it into place; returns the final path."""
        if self._f is None:
            return self.path
        if self.has_masks:
            self._f.write(b"".join(self._mask_bytes))
            self._f.write(np.packbits(self._mask_tail, bitorder="little").tobytes())  # zero-padded last byte
        header = np.zeros(HEADER_INTS, dtype="<i4")
        header[2:7] = [LLMQ_VERSION, 4, self.n_tokens, self.vocab_size, int(self.has_masks)]
        raw = bytearray(header.tobytes())
        raw[:8] = LLMQ_MAGIC
        self._f.seek(0)
        self._f.write(bytes(raw))
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        self._f = None
        _publish(self._tmp, self.path)
        return self.path

    def abort(self) -> None:
        """Drop the temporary file; the final path is never created."""
        if self._f is not None:
            self._f.close()
            self._f = None
            try:
                os.unlink(self._tmp)
            except FileNotFoundError:
                pass

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_shard(path: str, tokens, vocab_size: int, mask=None) -> str:
    """Write a whole llm.q shard at once (int tokens [n], optional bool mask [n]); atomic."""
    with ShardWriter(path, vocab_size, has_masks=mask is not None) as w:
        w.write(tokens, mask)
    return path


def write_llmc_shard(path: str, tokens) -> str:
    """Write an llm.c uint16 shard (for interoperability and tests); atomic."""
    tokens = np.asarray(tokens)
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) > 0xFFFF):
        raise DataError(f"{path}: llm.c shards hold uint16 tokens; got ids outside [0, 65535].")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = [LLMC_MAGIC, LLMC_VERSION, tokens.size]
    f, tmp = _atomic_target(path)
    try:
        with f:
            f.write(header.tobytes())
            f.write(tokens.astype("<u2").tobytes())
        _publish(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path
