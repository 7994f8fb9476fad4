"""Shard formats: round trips, masks, and one clear DataError per kind of bad file."""

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llmq_ray.data_pipeline.shards import (HEADER_BYTES, ShardWriter, open_shard, read_header, write_llmc_shard,
                                  write_shard)
from llmq_ray.data_pipeline.sources import open_source, resolve_files
from llmq_ray.errors import DataError


def test_llmq_round_trip_without_masks(tmp_path):
    toks = np.random.default_rng(0).integers(0, 151646, size=5000)
    p = write_shard(str(tmp_path / "a.bin"), toks, vocab_size=151646)
    raw = open(p, "rb").read()
    assert raw[:8] == b"BIN.TOK\n"
    assert list(np.frombuffer(raw[8:28], "<i4")) == [2, 4, 5000, 151646, 0]
    assert len(raw) == HEADER_BYTES + 4 * 5000
    s = open_shard(p)
    assert s.info.format == "llmq" and not s.has_masks
    np.testing.assert_array_equal(np.asarray(s.tokens), toks)
    assert s.target_mask(10, 20).all()


def test_llmq_round_trip_with_masks_lsb_first(tmp_path):
    n = 1003  # not a multiple of 8: the last bitmap byte is partial
    toks = np.arange(n) % 97
    mask = np.random.default_rng(1).random(n) < 0.5
    p = str(tmp_path / "m.bin")
    with ShardWriter(p, 97, has_masks=True) as w:  # written in pieces that do not align to bytes
        w.write(toks[:5], mask[:5])
        w.write(toks[5:], mask[5:])
    raw = open(p, "rb").read()
    assert len(raw) == HEADER_BYTES + 4 * n + (n + 7) // 8
    bitmap = np.frombuffer(raw[HEADER_BYTES + 4 * n:], np.uint8)
    assert bool(bitmap[0] & 1) == mask[0] and bool(bitmap[0] >> 3 & 1) == mask[3]  # LSB first
    s = open_shard(p)
    assert s.has_masks
    np.testing.assert_array_equal(s.target_mask(0, n), mask)
    np.testing.assert_array_equal(s.target_mask(13, 500), mask[13:500])


def test_llmc_uint16_round_trip(tmp_path):
    toks = np.random.default_rng(2).integers(0, 50257, size=777)
    p = write_llmc_shard(str(tmp_path / "c.bin"), toks)
    info = read_header(p)
    assert (info.format, info.n_tokens, info.vocab_size, info.token_dtype) == ("llmc", 777, None, np.dtype("<u2"))
    np.testing.assert_array_equal(np.asarray(open_shard(p).tokens), toks)
    with pytest.raises(DataError, match=r"token id \d+ at token index \d+ \(byte offset \d+\) is >= vocab size 100"):
        open_shard(p, vocab_size=100)


def test_writer_leaves_no_partial_file_on_error(tmp_path):
    p = tmp_path / "x.bin"
    with pytest.raises(DataError, match="outside the vocabulary"):
        with ShardWriter(str(p), 10) as w:
            w.write([1, 2, 3])
            w.write([4, 11])
    assert os.listdir(tmp_path) == []


def _good(tmp_path, n=100, vocab=1000):
    return write_shard(str(tmp_path / "g.bin"), np.arange(n), vocab)


def test_wrong_magic(tmp_path):
    p = _good(tmp_path)
    with open(p, "r+b") as f:
        f.write(b"NOT.TOK\n")
    with pytest.raises(DataError, match=r"g\.bin: not a token shard: wrong magic .* at byte offset 0"):
        open_shard(p)


def test_truncated_file(tmp_path):
    p = tmp_path / "t.bin"
    p.write_bytes(b"BIN.TOK\n" + b"\0" * 100)
    with pytest.raises(DataError, match=r"t\.bin: truncated token shard: 108 bytes"):
        open_shard(str(p))


def test_header_size_mismatch(tmp_path):
    p = _good(tmp_path)
    with open(p, "r+b") as f:
        f.truncate(HEADER_BYTES + 4 * 99)
    with pytest.raises(DataError, match=r"g\.bin: header/size mismatch \(truncated\): the header promises 100 tokens"):
        open_shard(p)


def test_token_id_out_of_vocab_names_offset(tmp_path):
    p = tmp_path / "v.bin"
    raw = bytearray(open(write_shard(str(p), np.arange(100), 2000), "rb").read())
    raw[20:24] = np.int32(1000).tobytes()  # shrink the header's vocab to 1000: id 999 ok, patch one to 1000
    raw[HEADER_BYTES + 4 * 42:HEADER_BYTES + 4 * 43] = np.int32(1000).tobytes()
    p.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=rf"v\.bin: token id 1000 at token index 42 \(byte offset {HEADER_BYTES + 168}\) is >= vocab size 1000"):
        open_shard(str(p))


def test_empty_glob(tmp_path):
    with pytest.raises(DataError, match="matched no token files"):
        resolve_files(str(tmp_path / "nothing-*.bin"))


def test_parquet_without_column_and_with_lists(tmp_path):
    p = str(tmp_path / "d.parquet")
    pq.write_table(pa.table({"text": ["a", "b"]}), p)
    with pytest.raises(DataError, match=r"d\.parquet: no column 'tokens' with tokens \(columns: text\)"):
        open_source(p)
    q = str(tmp_path / "l.parquet")
    pq.write_table(pa.table({"tokens": [[1, 2, 3], [4, 5]]}), q)
    np.testing.assert_array_equal(open_source(q).tokens, [1, 2, 3, 4, 5])
