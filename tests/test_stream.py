"""Window order, sharding, masks, resume, and the Ray Data path matching the plain path."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llmq_ray.data_pipeline.order import epoch_order, rank_order, windows_per_file
from llmq_ray.data_pipeline.shards import write_llmc_shard, write_shard
from llmq_ray.data_pipeline.stream import EvalStream, TokenStream
from llmq_ray.errors import DataError

T, B = 16, 4
VOCAB = 100_000


def _token_ids(file_no, n):
    """Token value = file_no*10000 + position, so a window's first input names its file and start."""
    return file_no * 10_000 + np.arange(n)


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("shards")
    sizes = [300, 161, 17, 5, 450]  # 18, 10, 1, 0 and 28 windows of T+1 at stride T
    for i, n in enumerate(sizes):
        mask = (np.arange(n) % 7 != 3) if i == 0 else None  # file 0 carries a loss mask
        write_shard(str(d / f"train-{i:03d}.bin"), _token_ids(i, n), VOCAB, mask=mask)
    return d


def _windows(stream, n_batches):
    """First input token of every window (identifies it) over n batches."""
    return np.concatenate([stream.next_batch()[0][:, 0].numpy() for _ in range(n_batches)])


def test_order_is_a_pure_function_of_seed_and_epoch():
    counts = windows_per_file(np.array([300, 161, 17, 5, 450]), T)
    assert list(counts) == [18, 10, 1, 0, 28]
    a, b = epoch_order(counts, 7, 0), epoch_order(counts, 7, 0)
    assert all((x == y).all() for x, y in zip(a, b))
    ids = lambda o: o[0].astype(np.int64) * 1000 + o[1]
    assert not (ids(epoch_order(counts, 8, 0)) == ids(a)).all()  # another seed, another order
    assert not (ids(epoch_order(counts, 7, 1)) == ids(a)).all()  # another epoch, another order
    assert sorted(ids(a)) == sorted(ids(epoch_order(counts, 0, 0, shuffle=False)))  # a permutation of all


def test_ranks_cover_each_window_once_and_drop_the_same_tail():
    counts = windows_per_file(np.array([300, 161, 17, 5, 450]), T)  # 57 windows
    full = epoch_order(counts, 3, 0)
    full_ids = full[0].astype(np.int64) * 1000 + full[1]
    for W in (1, 2, 3, 4):
        parts = [rank_order(counts, 3, 0, r, W) for r in range(W)]
        assert len({len(p[0]) for p in parts}) == 1 and len(parts[0][0]) == 57 // W
        got = np.concatenate([p[0].astype(np.int64) * 1000 + p[1] for p in parts])
        assert len(set(got)) == len(got) == 57 - 57 % W
        assert set(got) == set(full_ids[: 57 - 57 % W])  # the dropped tail is the order's last 57 % W


def test_batches_shift_targets_and_honour_masks(shard_dir):
    s = TokenStream(str(shard_dir / "*.bin"), T, B, seed=0, use_ray=False, prefetch=0)
    seen_masked = 0
    for _ in range(14):  # one whole epoch
        inputs, targets = s.next_batch()
        assert inputs.dtype == targets.dtype == __import__("torch").int64 and inputs.shape == (B, T)
        x, y = inputs.numpy(), targets.numpy()
        for row_x, row_y in zip(x, y):
            assert row_x[0] % 10_000 % T == 0  # windows start at multiples of T
            expect = row_x + 1  # the next token of the same file
            if row_x[0] // 10_000 == 0:  # file 0: target token i is masked when i % 7 == 3
                masked = (expect % 10_000) % 7 == 3
                expect = np.where(masked, -100, expect)
                seen_masked += masked.sum()
            np.testing.assert_array_equal(row_y, expect)
    assert seen_masked > 0
    assert s.state()["epoch"] == 0 and s.state()["cursor"] == 56  # 57 windows per epoch
    s.next_batch()  # rolls over inside the batch: 1 window of epoch 0, 3 of epoch 1
    assert s.state()["epoch"] == 1 and s.state()["cursor"] == 3


def test_one_epoch_delivers_every_window_once(shard_dir):
    s = TokenStream(str(shard_dir / "*.bin"), T, 3, seed=5, use_ray=False)
    got = _windows(s, 19)  # 57 windows = 19 batches of 3
    assert len(set(got)) == 57 and s.state()["epoch"] == 1 and s.state()["cursor"] == 0
    nxt = _windows(s, 19)
    assert set(nxt) == set(got) and not (nxt == got).all()  # epoch 1: same windows, new order


@pytest.mark.parametrize("world_size", [1, 2])
def test_resume_continues_with_exactly_the_next_windows(shard_dir, world_size):
    glob = str(shard_dir / "*.bin")
    for rank in range(world_size):
        ref = TokenStream(glob, T, B, rank, world_size, seed=11, use_ray=False)
        expected = [ref.next_batch() for _ in range(20)]  # crosses at least one epoch boundary
        for k in (0, 3, 9):
            s = TokenStream(glob, T, B, rank, world_size, seed=11, use_ray=False)
            for _ in range(k):
                s.next_batch()
            state = json.loads(json.dumps(s.state()))  # what a checkpoint keeps
            r = TokenStream(glob, T, B, rank, world_size, seed=999, use_ray=False)  # seed comes from the state
            r.restore(state)
            for j in range(k, 20):
                x, y = r.next_batch()
                assert (x == expected[j][0]).all() and (y == expected[j][1]).all(), (rank, k, j)


def test_restore_on_another_world_size_rereads_at_most_w_minus_1(shard_dir):
    glob = str(shard_dir / "*.bin")
    two = [TokenStream(glob, T, 1, r, 2, seed=4, use_ray=False) for r in range(2)]
    consumed = set()
    for s in two:
        consumed |= set(_windows(s, 5))
    state = two[0].state()
    three = [TokenStream(glob, T, 1, r, 3, seed=4, use_ray=False) for r in range(3)]
    for s in three:
        s.restore(state)
    rest = set()
    for s in three:
        rest |= set(_windows(s, 57 // 3 - s.state()["cursor"]))
    assert len(consumed & rest) <= 2 and len(consumed | rest) == 57


def test_state_of_other_files_is_refused(shard_dir):
    s = TokenStream(str(shard_dir / "*.bin"), T, B, use_ray=False)
    with pytest.raises(DataError, match="saved for 99 windows"):
        s.restore({"seed": 0, "epoch": 0, "cursor": 0, "total_windows": 99})


def test_eval_stream_is_sequential_and_padded_equally_on_every_rank(shard_dir):
    glob = str(shard_dir / "*.bin")
    one = EvalStream(glob, T, B)
    firsts = np.concatenate([x[:, 0].numpy() for x, _ in one])[:57]
    assert list(firsts[:18]) == [i * T for i in range(18)]  # file 0 from its start, in order
    assert list(firsts[18:20]) == [10_000, 10_000 + T]
    ranks = [list(EvalStream(glob, T, B, r, 2)) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == 8  # ceil(ceil(57/2)/4)
    last_r1 = ranks[1][-1][1].numpy()
    assert (last_r1[-1] == -100).all()  # rank 1 has 28 windows: the batch is padded with ignored rows
    got = sorted(int(x) for r in ranks for x, y in r for x, y in zip(x[:, 0], y[:, 0]) if y != -100 or x != 0)
    assert len(got) == 57


def test_ray_path_matches_plain_path_and_resumes(shard_dir, tmp_path, ray_cluster):
    # mixed sources: the masked .bin shards, an llm.c uint16 shard and a Parquet token file
    glob = f"{shard_dir}/*.bin,{tmp_path}/*"
    write_llmc_shard(str(tmp_path / "c.bin"), _token_ids(5, 200))
    pq.write_table(pa.table({"tokens": [_token_ids(6, 100).tolist(), _token_ids(6, 90).tolist()]}),
                   str(tmp_path / "p.parquet"))
    for rank in range(2):
        plain = TokenStream(glob, T, B, rank, 2, seed=21, use_ray=False)
        expected = [plain.next_batch() for _ in range(12)]  # 2 epochs of 5 batches (10 + 11 + ... windows)
        ray_s = TokenStream(glob, T, B, rank, 2, seed=21, use_ray=True)
        for j in range(5):
            x, y = ray_s.next_batch()
            assert (x == expected[j][0]).all() and (y == expected[j][1]).all(), (rank, j)
        state = ray_s.state()
        ray_s.close()
        resumed = TokenStream(glob, T, B, rank, 2, seed=0, use_ray=True)
        resumed.restore(state)
        for j in range(5, 12):
            x, y = resumed.next_batch()
            assert (x == expected[j][0]).all() and (y == expected[j][1]).all(), (rank, j)
        resumed.close()


def test_prefetcher_hands_over_items_errors_and_stops_on_close():
    """The background thread delivers items in order, then the generator's exception (or StopIteration at
    its end); close() with a full queue stops the thread instead of leaving it blocked on put()."""
    import threading

    from llmq_ray.data_pipeline.stream import _Prefetcher

    def failing():
        yield from range(3)
        raise DataError("shard went away")

    p = _Prefetcher(failing(), depth=1)
    assert [p.get() for _ in range(3)] == [0, 1, 2]
    with pytest.raises(DataError, match="shard went away"):
        p.get()
    p.close()

    p = _Prefetcher(iter(range(2)), depth=4)
    assert [p.get(), p.get()] == [0, 1]
    with pytest.raises(StopIteration):
        p.get()
    p.close()

    produced = threading.Event()

    def endless():
        for i in range(10**9):
            if i == 2:
                produced.set()  # items 0 and 1 fill the queue (depth 2): the thread now blocks putting item 2
            yield i

    p = _Prefetcher(endless(), depth=2)
    assert produced.wait(10)
    p.close()
    assert not p._t.is_alive()
