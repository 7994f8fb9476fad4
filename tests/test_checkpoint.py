"""Checkpoints (llmq_ray/checkpoints/: layout, verify, local, retention, resume), single process, no Ray.

* Bit-exact resume: 12 steps of the tiny preset over a TokenStream, checkpoint after 6, a fresh engine
  restored from it continues to 12 -- losses of steps 7-12, final weights and optimizer state identical
  to the uninterrupted run (fp32; and bf16 weights + fp32 master + bf16 m/v, where the stochastic
  rounding seeds must line up).
* Resharding: a state saved as 2 rank files loads exactly for world 1, world 3 and arbitrary ranges.
* Crash safety: an exception after the first rank file, or a full disk, never leaves a checkpoint that
  looks valid; the previous one stays the newest valid one.
* Corruption and mismatches end in one CheckpointError sentence naming the file/folder/field.
* Integrity when choosing where to resume: a newest checkpoint with a flipped byte (same size) is skipped
  with a warning naming the file, and naming it explicitly is an error naming the file; every rank file
  is hashed, concurrently; incomplete folders are refused before any hashing; the module imports (and
  picks a checkpoint) without torch.
* Retention (newest keep_n + majors) and --continue resolution.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import subprocess
import sys
import threading
import warnings

import numpy as np
import pytest
import torch

from llmq_ray.backends import get_backend
from llmq_ray.data_pipeline.shards import write_shard
from llmq_ray.data_pipeline.stream import TokenStream
from llmq_ray.checkpoints import layout, local, resume, retention, verify
from llmq_ray.model.config import PRESETS, ModelConfig
from llmq_ray.engine.train_engine import TrainEngine
from llmq_ray.errors import CheckpointError
from _helpers import checked_settings, train_settings
from llmq_ray.model.params import ParamLayout
from llmq_ray.checkpoints.resume import (data_state_for_rank, engine_checkpoint_tensors, load_engine_checkpoint,
                             save_engine_checkpoint)
from _engine_loop import train_steps

# A very small model for the file-level tests (the tiny preset is used for the training ones).
MICRO = ModelConfig("qwen2", 16, 32, 1, 2, 1, 64, tie_word_embeddings=True, qkv_bias=True, name="micro")


def _flat_state(cfg: ModelConfig, seed: int = 0, m_dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    n = ParamLayout(cfg).numel
    g = torch.Generator().manual_seed(seed)
    return {"master": torch.randn(n, generator=g), "m": torch.randn(n, generator=g).to(m_dtype),
            "v": torch.rand(n, generator=g)}


def _split(state: dict[str, torch.Tensor], cfg: ModelConfig, world: int):
    layout = ParamLayout(cfg)
    shards = []
    for r in range(world):
        s, e = layout.shard_range(r, world)
        shards.append((s, e, {k: v[s:e] for k, v in state.items()}))
    return shards


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _save(ckpt_dir, step, state, world=2, cfg=MICRO, **kw):
    return resume.save_checkpoint(str(ckpt_dir), step, _split(state, cfg, world), config=cfg,
                              data_state=[{"seed": 0, "epoch": 0, "cursor": step, "world_size": world}] * world, **kw)


# ---------------------------------------------------------------------------------------------------- bit-exact resume
@pytest.fixture(scope="module")
def train_bin(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckdata") / "train.bin"
    tokens = np.random.default_rng(0).integers(0, PRESETS["tiny"].vocab_size, size=3000)
    return write_shard(str(path), tokens, vocab_size=PRESETS["tiny"].vocab_size)


def _engine(opts, init_weights=True):
    return TrainEngine(PRESETS["tiny"], opts, get_backend("torch"), init_weights=init_weights)


def _stream(path, opts):
    return TokenStream(path, opts.data.seq_len, opts.data.batch_size, seed=3, use_ray=False, prefetch=0,
                       vocab_size=PRESETS["tiny"].vocab_size)


def _batches(stream):
    while True:
        yield stream.next_batch()


@pytest.mark.parametrize("dtypes", [
    dict(model_dtype="fp32", master_dtype="fp32", opt_m_dtype="fp32", opt_v_dtype="fp32"),
    dict(model_dtype="bf16", master_dtype="fp32", opt_m_dtype="bf16", opt_v_dtype="bf16"),
    # the offloaded state, 3 of its chunks kept on the device (--opt-resident-gib): the checkpoint must hold
    # the kept chunks' current values and a resume must put them back on the device
    dict(model_dtype="bf16", master_dtype="fp32", opt_m_dtype="bf16", opt_v_dtype="bf16", offload_master=True,
         offload_opt_m=True, offload_opt_v=True, opt_chunk_size=5000, opt_resident_gib=3.5 * 5000 * 8 / 2**30),
    # the 8-bit first moment: saved as its exact bf16 values, re-quantized to the same numbers on load
    dict(model_dtype="bf16", master_dtype="fp32", opt_m_dtype="e4m3", opt_v_dtype="bf16"),
    dict(model_dtype="bf16", master_dtype="fp32", opt_m_dtype="bf16", opt_v_dtype="bf16", matmul_dtype="e4m3",
         lmhead_dtype="e4m3"),
], ids=["fp32", "bf16-sr", "offloaded-part-kept", "e4m3-m", "fp8-head"])
def test_resume_is_bit_exact(tmp_path, train_bin, dtypes):
    opts = train_settings(model="tiny", batch_size=2, seq_len=16, steps=12, learning_rate=3e-3, warmup=2,
                        lr_schedule="cosine", seed=7, **dtypes)
    ckpt_dir = tmp_path / "ckpt"

    # Uninterrupted run, checkpointing after 6 updates (the checkpoint does not disturb the run).
    engine, stream = _engine(opts), _stream(train_bin, opts)
    saved = {}

    def on_step(rec):
        if rec.step + 1 == 6:
            saved["path"] = save_engine_checkpoint(str(ckpt_dir), 6, engine, data_state=[stream.state()])

    full = train_steps(engine, _batches(stream), on_step=on_step)
    assert engine.model.head.fp8 == (dtypes.get("lmhead_dtype") == "e4m3")
    assert saved["path"].endswith("step_00000006")
    assert len(engine.optimizer.resident_at) == (3 if dtypes.get("opt_resident_gib") else 0)

    # A new process: zero weights (so that only the checkpoint can make it right), fresh stream.
    engine2, stream2 = _engine(opts, init_weights=False), _stream(train_bin, opts)
    assert not torch.equal(engine2.params, engine.params)
    folder = verify.resolve_continue(None, str(ckpt_dir))
    assert folder == saved["path"]
    manifest = load_engine_checkpoint(folder, engine2)
    assert manifest["step"] == 6 and manifest["world_size"] == 1
    assert manifest["train_options"]["model_dtype"] == dtypes["model_dtype"]
    assert manifest["rng"]["seed"] == 7
    at_load = engine2.params.clone()
    stream2.restore(data_state_for_rank(manifest, 0, 1))
    resumed = train_steps(engine2, _batches(stream2), start_step=manifest["step"])

    assert [r.step for r in resumed] == list(range(6, 12))
    assert [r.loss for r in resumed] == [r.loss for r in full[6:]]
    assert [r.grad_norm for r in resumed] == [r.grad_norm for r in full[6:]]
    assert [r.lr for r in resumed] == [r.lr for r in full[6:]]
    assert torch.equal(engine2.params, engine.params)
    for k, v in engine_checkpoint_tensors(engine).items():
        assert torch.equal(engine_checkpoint_tensors(engine2)[k], v), k
    assert not torch.equal(at_load, engine2.params)  # the resumed steps did move the weights
    stream.close()
    stream2.close()


# ---------------------------------------------------------------------------------------------------- resharding
def test_engine_resumes_on_another_world_size(tmp_path):
    """A world-1 engine checkpoint loads into the two ranks of a world-2 run (each its own ZeRO shard)."""
    from llmq_ray.engine.communicator import Communicator

    opts = train_settings(model="tiny", batch_size=1, seq_len=8, steps=2, model_dtype="bf16", opt_m_dtype="bf16")
    src = _engine(opts)
    src.optimizer.m.copy_(torch.randn(src.optimizer.m.numel()))
    folder = save_engine_checkpoint(str(tmp_path), 1, src, data_state=[{"seed": 3, "epoch": 0, "cursor": 4}])
    full = engine_checkpoint_tensors(src)
    for rank in (0, 1):
        comm = Communicator()
        comm.rank, comm.world_size = rank, 2
        dst = TrainEngine(PRESETS["tiny"], opts, get_backend("torch"), comm, init_weights=False)
        manifest = load_engine_checkpoint(folder, dst)
        s, e = dst.shard_start, dst.shard_end
        assert (s, e) == ParamLayout(PRESETS["tiny"]).shard_range(rank, 2) and e > s
        for k, v in engine_checkpoint_tensors(dst).items():
            assert torch.equal(v, full[k][s:e]), (rank, k)
        assert torch.equal(dst.params[s:e], src.params[s:e])
        assert data_state_for_rank(manifest, rank, 2) == {"seed": 3, "epoch": 0, "cursor": 4, "world_size": 1}


def test_reshard_world2_to_world1_and_world3(tmp_path):
    state = _flat_state(MICRO)
    n = ParamLayout(MICRO).numel
    folder = _save(tmp_path, 5, state, world=2)
    manifest = layout.read_manifest(folder)
    assert sorted(os.listdir(folder)) == ["manifest.json", "rank_00000.safetensors", "rank_00001.safetensors"]
    assert [(f["start"], f["end"]) for f in manifest["files"]] == [ParamLayout(MICRO).shard_range(r, 2) for r in (0, 1)]
    from safetensors import safe_open
    with safe_open(os.path.join(folder, "rank_00001.safetensors"), "pt") as f:
        assert f.metadata()["start"] == str(manifest["files"][1]["start"]) and f.metadata()["end"] == str(n)

    for world in (1, 3):
        pieces = []
        for rank in range(world):
            tensors, _ = local.load_checkpoint(folder, expected_config=MICRO, world_size=world, rank=rank)
            s, e = ParamLayout(MICRO).shard_range(rank, world)
            for k in layout.STATE_NAMES:
                assert tensors[k].dtype == state[k].dtype
                assert torch.equal(tensors[k], state[k][s:e]), (world, rank, k)
            pieces.append(tensors["master"])
        assert torch.equal(torch.cat(pieces), state["master"])
    # an arbitrary range across the saved boundary, and an empty one
    mid = ParamLayout(MICRO).shard_range(1, 2)[0]
    tensors, _ = local.load_checkpoint(folder, expected_config=MICRO, shard_start=mid - 5, shard_end=mid + 7)
    assert torch.equal(tensors["v"], state["v"][mid - 5:mid + 7])
    tensors, _ = local.load_checkpoint(folder, expected_config=MICRO, shard_start=3, shard_end=3)
    assert tensors["m"].numel() == 0 and tensors["m"].dtype == torch.bfloat16
    # the data state of another world size comes from rank 0's (lockstep), the same world size keeps its own
    assert data_state_for_rank(manifest, 2, 3) == manifest["data_state"][0]


def test_multi_rank_protocol(tmp_path):
    """What the Ray runtime does: begin -> each rank writes -> finalize with the records."""
    state = _flat_state(MICRO, seed=1)
    tmp = local.begin_checkpoint(str(tmp_path), 4)
    assert os.path.basename(tmp).startswith(".step_00000004.tmp-")
    records = [local.write_rank_shard(tmp, r, t, s, e) for r, (s, e, t) in enumerate(_split(state, MICRO, 3))]
    assert verify.find_latest_valid(str(tmp_path)) is None  # nothing published yet
    manifest = layout.build_manifest(4, config=MICRO, world_size=3, data_state=[None] * 3, rng=layout.rng_state(11),
                                 extra={"losses": [1.0, 0.5]})
    final = local.finalize_checkpoint(tmp, layout.step_dir(str(tmp_path), 4), manifest, records=records)
    assert not os.path.exists(tmp) and verify.find_latest_valid(str(tmp_path)) == final
    written = verify.validate_checkpoint(final, verify_checksums=True)
    assert [f["sha256"] for f in written["files"]] == [r["sha256"] for r in records]
    assert written["losses"] == [1.0, 0.5] and written["layout_numel"] == ParamLayout(MICRO).numel

    # a missing rank is refused, and the tmp folder goes away
    tmp = local.begin_checkpoint(str(tmp_path), 8)
    recs = [local.write_rank_shard(tmp, r, t, s, e) for r, (s, e, t) in enumerate(_split(state, MICRO, 2))]
    with pytest.raises(CheckpointError, match=r"step_00000008.*ranks \[0\], expected 0..1"):
        local.finalize_checkpoint(tmp, layout.step_dir(str(tmp_path), 8), layout.build_manifest(8, config=MICRO, world_size=2),
                               records=recs[:1])
    assert not os.path.exists(tmp) and verify.find_latest_valid(str(tmp_path)) == final

    # without records the coordinator hashes the files itself; re-saving an existing step replaces it
    tmp = local.begin_checkpoint(str(tmp_path), 4)
    for r, (s, e, t) in enumerate(_split(_flat_state(MICRO, seed=2), MICRO, 1)):
        local.write_rank_shard(tmp, r, t, s, e)
    local.finalize_checkpoint(tmp, final, layout.build_manifest(4, config=MICRO, world_size=1))
    assert verify.validate_checkpoint(final, verify_checksums=True)["world_size"] == 1
    assert os.listdir(tmp_path) == ["step_00000004"]

    # a worker that hits a full disk: its partial file goes, the coordinator removes the folder and re-raises
    tmp = local.begin_checkpoint(str(tmp_path), 12)
    (s, e, t), = _split(state, MICRO, 1)
    real = local._save_tensors

    def full_disk(path, tensors, metadata):
        real(path, tensors, metadata)  # the file exists when the error comes
        raise OSError(errno.ENOSPC, "No space left on device")

    local._save_tensors = full_disk
    try:
        with pytest.raises(CheckpointError) as info:
            local.write_rank_shard(tmp, 0, t, s, e)
    finally:
        local._save_tensors = real
    assert os.path.isdir(tmp) and os.listdir(tmp) == []

    class RayTaskErrorLike(Exception):
        cause = info.value

    with pytest.raises(CheckpointError, match=r"^checkpoint step_00000012 could not be written .*\(No space left on "
                                              r"device\); the previous checkpoint step_00000004 is still valid\.$"):
        local.abort_checkpoint(tmp, 12, RayTaskErrorLike("wrapped"))
    assert not os.path.exists(tmp)

    # a worker failure reported to the coordinator as a message
    tmp = local.begin_checkpoint(str(tmp_path), 12)
    with pytest.raises(CheckpointError, match=r"step_00000012 could not be written .*\(worker 1 died\); the "
                                              r"previous checkpoint step_00000004 is still valid"):
        local.abort_checkpoint(tmp, 12, "worker 1 died")
    assert not os.path.exists(tmp)


def test_rng_state_roundtrip():
    state = layout.rng_state(5)
    json.dumps(state)
    a = torch.rand(4)
    torch.rand(10)
    layout.restore_rng(state)
    assert torch.equal(torch.rand(4), a)


# ---------------------------------------------------------------------------------------------------- crashes
def test_crash_after_first_rank_file_leaves_previous_valid(tmp_path, monkeypatch, recwarn):
    state = _flat_state(MICRO)
    prev = _save(tmp_path, 2, state)
    real, calls = local._save_tensors, []

    def crash_on_second(path, tensors, metadata):
        calls.append(path)
        if len(calls) == 2:
            raise RuntimeError("simulated crash")
        real(path, tensors, metadata)

    monkeypatch.setattr(local, "_save_tensors", crash_on_second)
    with pytest.raises(RuntimeError, match="simulated crash"):
        _save(tmp_path, 4, _flat_state(MICRO, seed=9))
    monkeypatch.setattr(local, "_save_tensors", real)
    assert len(calls) == 2 and os.path.basename(calls[0]) == "rank_00000.safetensors"
    assert not os.path.exists(os.path.dirname(calls[0]))  # save_checkpoint cleaned its tmp folder up
    # a hard crash (no cleanup at all) leaves a tmp folder with a rank file: ignored, no warning
    hard = tmp_path / ".step_00000006.tmp-deadbeef"
    hard.mkdir()
    (hard / "rank_00000.safetensors").write_bytes(b"partial")
    assert verify.find_latest_valid(str(tmp_path)) == prev
    assert verify.resolve_continue("latest", str(tmp_path)) == prev
    assert not [w for w in recwarn if issubclass(w.category, layout.CheckpointWarning)]
    tensors, _ = local.load_checkpoint(prev, expected_config=MICRO)
    assert torch.equal(tensors["master"], state["master"])
    # the next good save cleans the stale tmp folder up
    _save(tmp_path, 8, state)
    assert sorted(os.listdir(tmp_path)) == ["step_00000002", "step_00000008"]


@pytest.mark.parametrize("where", ["shard", "manifest", "rename"])
def test_full_disk_keeps_previous_checkpoint(tmp_path, monkeypatch, where):
    state = _flat_state(MICRO)
    prev = _save(tmp_path, 2, state)

    target = {"shard": (local, "_save_tensors"), "manifest": (local, "_write_json"), "rename": (local.os, "rename")}[where]
    monkeypatch.setattr(*target, _no_space)
    with pytest.raises(CheckpointError) as info:
        _save(tmp_path, 4, _flat_state(MICRO, seed=1))
    monkeypatch.undo()
    msg = str(info.value)
    assert msg.startswith("checkpoint step_00000004 could not be written")
    assert "(No space left on device); the previous checkpoint step_00000002 is still valid." in msg
    assert os.listdir(tmp_path) == ["step_00000002"]  # no tmp folder, nothing deleted by retention
    assert verify.find_latest_valid(str(tmp_path), verify_checksums=True) == prev


def test_full_disk_without_previous_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setattr(local, "_save_tensors", _no_space)
    with pytest.raises(CheckpointError, match=r"\(No space left on device\); there is no earlier valid checkpoint"):
        _save(tmp_path, 1, _flat_state(MICRO))
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------------------------------- corruption
def test_truncated_flipped_missing_and_bad_manifest(tmp_path):
    state = _flat_state(MICRO)
    good = _save(tmp_path, 2, state)
    bad = _save(tmp_path, 4, state, keep_n=None)
    rank1 = os.path.join(bad, "rank_00001.safetensors")
    raw = bytearray(open(rank1, "rb").read())

    # flipped byte, same size: the cheap scan still accepts it (the verifying one does not, see
    # test_flipped_byte_in_newest_checkpoint_is_skipped), loading fails the checksum
    raw[-3] ^= 0x40
    open(rank1, "wb").write(bytes(raw))
    assert verify.find_latest_valid(str(tmp_path), verify_checksums=False) == bad
    with pytest.raises(CheckpointError, match=r"rank_00001\.safetensors fails its sha256 checksum.*step_00000004"):
        local.load_checkpoint(bad, expected_config=MICRO, world_size=1, rank=0)
    # loading only rank 0's range does not need (and does not read) rank 1's file
    tensors, _ = local.load_checkpoint(bad, expected_config=MICRO, world_size=2, rank=0)
    assert torch.equal(tensors["master"], state["master"][:tensors["master"].numel()])

    # truncated: the scan skips it with a warning naming the folder; loading it explicitly fails
    open(rank1, "wb").write(bytes(raw[:-100]))
    with pytest.warns(layout.CheckpointWarning, match="step_00000004"):
        assert verify.find_latest_valid(str(tmp_path)) == good
    with pytest.raises(CheckpointError, match=r"rank_00001\.safetensors has \d+ bytes.*truncated.*checksum"):
        local.load_checkpoint(bad, expected_config=MICRO)

    # missing shard file
    os.remove(rank1)
    with pytest.raises(CheckpointError, match=r"step_00000004 is missing its shard file rank_00001\.safetensors"):
        local.load_checkpoint(bad, expected_config=MICRO)

    # a manifest that is not JSON
    with open(os.path.join(bad, "manifest.json"), "w") as f:
        f.write('{"format": "llmq-ray-checkpoint", "step": ')
    with pytest.raises(CheckpointError, match=r"manifest\.json is not valid JSON.*step_00000004 is corrupt"):
        local.load_checkpoint(bad, expected_config=MICRO)
    with pytest.raises(CheckpointError, match="not valid JSON"):
        verify.resolve_continue(4, str(tmp_path))

    # a step folder without manifest (not produced by our writer, but possible by hand): skipped, named
    os.remove(os.path.join(bad, "manifest.json"))
    with pytest.warns(layout.CheckpointWarning, match=r"step_00000004 has no manifest\.json"):
        assert verify.resolve_continue(None, str(tmp_path)) == good


def _one_sentence(msg: str) -> bool:
    return "\n" not in msg and msg.endswith(".") and ". " not in msg


def _flip_byte(path: str, where: int | None = None) -> None:
    """Flip one bit of a file in place (the middle byte by default): same size, other bytes."""
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 2 if where is None else where)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    assert os.path.getsize(path) == size


def test_flipped_byte_in_newest_checkpoint_is_skipped(tmp_path):
    """The chooser hashes: a same-size corruption of the newest checkpoint's one rank file makes --continue
    take the previous one (warning naming the file); naming the corrupt one is an error naming the file."""
    state = _flat_state(MICRO)
    good = _save(tmp_path, 6, state, keep_n=None)
    bad = _save(tmp_path, 12, _flat_state(MICRO, seed=1), keep_n=None)
    rank1 = os.path.join(bad, "rank_00001.safetensors")
    _flip_byte(rank1)
    assert verify.validate_checkpoint(bad)["step"] == 12  # the cheap checks cannot see it

    with pytest.warns(layout.CheckpointWarning) as caught:
        assert verify.find_latest_valid(str(tmp_path)) == good
    msgs = [str(w.message) for w in caught if issubclass(w.category, layout.CheckpointWarning)]
    assert len(msgs) == 1 and rank1 in msgs[0] and "fails its sha256 checksum" in msgs[0], msgs
    for arg in (None, "latest"):
        with pytest.warns(layout.CheckpointWarning, match=re.escape(rank1)):
            assert verify.resolve_continue(arg, str(tmp_path)) == good

    for arg in (12, "12", bad):  # the step, and the folder
        with pytest.raises(CheckpointError) as info:
            verify.resolve_continue(arg, str(tmp_path))
        msg = str(info.value)
        assert msg == (f"shard file {rank1} fails its sha256 checksum (the bytes changed after the checkpoint was "
                       f"written); checkpoint step_00000012 is corrupt, resume from another one."), msg
        assert _one_sentence(msg), msg
    assert verify.resolve_continue(6, str(tmp_path)) == good
    # the previous checkpoint is what the run then loads, and its data is intact
    tensors, manifest = local.load_checkpoint(good, expected_config=MICRO)
    assert manifest["step"] == 6 and torch.equal(tensors["master"], state["master"])


def test_verify_checkpoint_hashes_every_rank_file_concurrently(tmp_path, monkeypatch):
    """verify_checkpoint hashes all rank files of a 4-rank checkpoint on 4 threads at once (a barrier that
    only 4 concurrent callers pass), a good one passes, a bad rank file is named in one sentence."""
    folder = _save(tmp_path, 3, _flat_state(MICRO), world=4, keep_n=None)
    manifest = layout.read_manifest(folder)
    assert len(manifest["files"]) == 4

    real, barrier, threads = verify._stream_sha256, threading.Barrier(4, timeout=20), set()

    def together(path, stop=None):
        threads.add(threading.get_ident())
        barrier.wait()  # BrokenBarrierError unless the 4 files are being hashed at the same time
        return real(path, stop)

    monkeypatch.setattr(verify, "_stream_sha256", together)
    assert verify.verify_checkpoint(folder, max_workers=4) == manifest
    assert len(threads) == 4 and threading.get_ident() not in threads
    monkeypatch.undo()
    assert verify.verify_checkpoint(folder)["step"] == 3  # default pool size (hash_workers)
    assert verify.validate_checkpoint(folder, verify_checksums=True) == manifest

    rank2 = os.path.join(folder, "rank_00002.safetensors")
    _flip_byte(rank2, where=os.path.getsize(rank2) - 7)
    for workers in (None, 1, 4):
        with pytest.raises(CheckpointError) as info:
            verify.verify_checkpoint(folder, max_workers=workers)
        msg = str(info.value)
        assert msg.startswith(f"shard file {rank2} fails its sha256 checksum") and _one_sentence(msg), msg

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    assert verify.hash_workers(4) == min(4, cpus) and verify.hash_workers(1) == 1 and verify.hash_workers(0) == 1
    assert verify.hash_workers(10_000) == min(cpus, 32)
    recorded = {f["name"]: f["sha256"] for f in manifest["files"]}
    assert verify.file_sha256(rank2) != recorded["rank_00002.safetensors"]


def test_incomplete_checkpoint_is_refused_before_hashing(tmp_path, monkeypatch):
    """Missing manifest, a missing or truncated rank file: the cheap checks refuse them, no file is hashed;
    a load of a folder the caller verified (verify_checksums=False) does not hash either, but still checks
    sizes."""
    state = _flat_state(MICRO)
    good = _save(tmp_path, 2, state, keep_n=None)
    trunc = _save(tmp_path, 4, state, keep_n=None)
    gone = _save(tmp_path, 5, state, keep_n=None)
    nomani = _save(tmp_path, 6, state, keep_n=None)
    with open(os.path.join(trunc, "rank_00000.safetensors"), "r+b") as f:
        f.truncate(100)
    os.remove(os.path.join(gone, "rank_00001.safetensors"))
    os.remove(os.path.join(nomani, "manifest.json"))

    hashed = []
    real = verify._stream_sha256

    def spy(path, stop=None):
        hashed.append(os.path.basename(os.path.dirname(path)))
        return real(path, stop)

    monkeypatch.setattr(verify, "_stream_sha256", spy)
    with pytest.warns(layout.CheckpointWarning) as caught:
        assert verify.find_latest_valid(str(tmp_path)) == good
    assert len([w for w in caught if issubclass(w.category, layout.CheckpointWarning)]) == 3
    assert hashed == ["step_00000002", "step_00000002"]  # only the one that passed the cheap checks
    for folder, pattern in ((trunc, r"rank_00000\.safetensors has 100 bytes"),
                            (gone, r"missing its shard file rank_00001\.safetensors"),
                            (nomani, r"has no manifest\.json")):
        hashed.clear()
        with pytest.raises(CheckpointError, match=pattern):
            verify.verify_checkpoint(folder)
        assert hashed == []

    hashed.clear()
    tensors, _ = local.load_checkpoint(good, expected_config=MICRO, verify_checksums=False)
    assert hashed == [] and torch.equal(tensors["v"], state["v"])
    local.load_checkpoint(good, expected_config=MICRO)
    assert hashed == ["step_00000002", "step_00000002"]  # the default load verifies what it reads
    with pytest.raises(CheckpointError, match=r"rank_00000\.safetensors has 100 bytes"):
        local.load_checkpoint(trunc, expected_config=MICRO, verify_checksums=False)


def test_choosing_a_checkpoint_does_not_import_torch(tmp_path):
    """The CLI's pre-flight resolves --continue before anything heavy: importing llmq_ray.checkpoints.verify and
    reading, verifying, choosing and config-checking a checkpoint must not import torch."""
    folder = _save(tmp_path, 6, _flat_state(MICRO), keep_n=None)
    _save(tmp_path, 8, _flat_state(MICRO), keep_n=None)
    _flip_byte(os.path.join(tmp_path, "step_00000008", "rank_00000.safetensors"))
    code = f"""
import sys, warnings
from llmq_ray.checkpoints import layout, verify
from llmq_ray.model.config import ModelConfig
assert "torch" not in sys.modules, "import"
micro = ModelConfig("qwen2", 16, 32, 1, 2, 1, 64, tie_word_embeddings=True, qkv_bias=True, name="micro")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    folder = verify.resolve_continue(None, {str(tmp_path)!r})
assert folder == {folder!r} and len(caught) == 1 and "step_00000008" in str(caught[0].message), caught
layout.check_config(layout.read_manifest(folder), micro, folder)
assert verify.verify_checkpoint(folder)["step"] == 6 and verify.validate_checkpoint(folder)["step"] == 6
assert verify.find_latest_valid({str(tmp_path)!r}, verify_checksums=False).endswith("step_00000008")
assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))
print("ok")
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_config_mismatch_names_the_field(tmp_path):
    folder = _save(tmp_path, 6, _flat_state(MICRO))
    other = dataclasses.replace(MICRO, hidden_size=96)
    with pytest.raises(CheckpointError, match=r"^checkpoint step_00000006 was written for hidden_size=16, this run "
                                              r"has 96; "):
        local.load_checkpoint(folder, expected_config=other)
    with pytest.raises(CheckpointError, match=r"rope_theta=10000.0, this run has 500000.0"):
        local.load_checkpoint(folder, expected_config=dataclasses.replace(MICRO, rope_theta=500000.0))
    # the cosmetic name is not compared
    tensors, manifest = local.load_checkpoint(folder, expected_config=dataclasses.replace(MICRO, name="other-name"))
    assert manifest["model_config"]["hidden_size"] == 16 and tensors["v"].numel() == ParamLayout(MICRO).numel


# ---------------------------------------------------------------------------------------------------- retention
def test_retention_keeps_newest_two_plus_majors(tmp_path, monkeypatch):
    state = _flat_state(MICRO)
    for step in range(1, 8):
        _save(tmp_path, step, state, world=1, keep_n=2, major_every=3)
        steps = sorted(s for s, _ in layout.list_step_dirs(str(tmp_path)))
        newest = [s for s in (step - 1, step) if s >= 1]
        assert steps == sorted(set(newest) | {s for s in range(3, step + 1, 3)}), (step, steps)
    assert sorted(os.listdir(tmp_path)) == ["step_00000003", "step_00000006", "step_00000007"]
    # a failed save deletes nothing
    monkeypatch.setattr(local, "_save_tensors", _no_space)
    with pytest.raises(CheckpointError, match="step_00000007 is still valid"):
        _save(tmp_path, 8, state, world=1, keep_n=2, major_every=3)
    assert sorted(os.listdir(tmp_path)) == ["step_00000003", "step_00000006", "step_00000007"]
    monkeypatch.undo()
    # an invalid folder does not count among the kept ones
    os.remove(os.path.join(tmp_path, "step_00000007", "manifest.json"))
    _save(tmp_path, 9, state, world=1, keep_n=2, major_every=0)
    assert sorted(s for s, _ in layout.list_step_dirs(str(tmp_path))) == [6, 9]


def test_retention_asserts_its_arguments_without_naming_flags(tmp_path):
    """The user's --ckpt-keep / --ckpt-major are checked by the settings layer; retention itself only refuses
    values it cannot apply, in a sentence that names its own arguments."""
    with pytest.raises(ValueError, match=r"^apply_retention: keep_n=0 must be an int >= 1") as info:
        retention.apply_retention(str(tmp_path), keep_n=0)
    assert "--" not in str(info.value)
    with pytest.raises(ValueError, match=r"major_every=-1 an int >= 0"):
        retention.apply_retention(str(tmp_path), keep_n=2, major_every=-1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert retention.apply_retention(str(tmp_path), keep_n=2, major_every=1000) == []


def test_keep_one(tmp_path):
    state = _flat_state(MICRO)
    for step in (1, 2, 3):
        _save(tmp_path, step, state, world=1, keep_n=1)
    assert os.listdir(tmp_path) == ["step_00000003"]


# ---------------------------------------------------------------------------------------------------- --continue
def test_resolve_continue(tmp_path):
    with pytest.raises(CheckpointError, match=r"--continue: no valid checkpoint in .*; train without --continue"):
        verify.resolve_continue(None, str(tmp_path))
    state = _flat_state(MICRO)
    for step in (5, 10, 15):
        _save(tmp_path, step, state, keep_n=None)
    newest = os.path.join(str(tmp_path), "step_00000015")
    for arg in (None, True, "", "latest", "LATEST"):
        assert verify.resolve_continue(arg, str(tmp_path)) == newest
    assert verify.resolve_continue(10, str(tmp_path)) == os.path.join(str(tmp_path), "step_00000010")
    assert verify.resolve_continue("5", str(tmp_path)) == os.path.join(str(tmp_path), "step_00000005")
    elsewhere = os.path.join(str(tmp_path), "step_00000010")
    assert verify.resolve_continue(elsewhere, "/nonexistent") == elsewhere
    with pytest.raises(CheckpointError, match=r"--continue=7: there is no checkpoint step_00000007 .*\[5, 10, 15\]"):
        verify.resolve_continue(7, str(tmp_path))
    with pytest.raises(CheckpointError, match=r"--continue=/no/such/dir: no such checkpoint folder"):
        verify.resolve_continue("/no/such/dir", str(tmp_path))
    assert layout.step_of(newest) == 15 and layout.step_of(str(tmp_path)) is None


def test_retention_never_deletes_the_checkpoint_it_just_wrote(tmp_path):
    """A run that branched from an older step writes step 3 into a folder that still holds 5 and 6 (keep 2):
    the newest two by step stay, and so does the one just written; set_aside_newer moves 5 and 6 away."""
    state = _flat_state(MICRO)
    for step in (5, 6):
        _save(tmp_path, step, state, world=1, keep_n=None)
    path = _save(tmp_path, 3, state, world=1, keep_n=2)  # save_checkpoint protects what it wrote
    assert sorted(os.listdir(tmp_path)) == ["step_00000003", "step_00000005", "step_00000006"]
    deleted = retention.apply_retention(str(tmp_path), keep_n=2, protect=[path])
    assert deleted == [] and sorted(os.listdir(tmp_path)) == ["step_00000003", "step_00000005", "step_00000006"]
    dest, names = retention.set_aside_newer(str(tmp_path), 3)
    assert names == ["step_00000005", "step_00000006"] and sorted(os.listdir(dest)) == names
    assert verify.find_latest_valid(str(tmp_path)) == path
