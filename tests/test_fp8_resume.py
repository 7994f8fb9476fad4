"""The delayed FP8 SwiGLU scale (--fp8-delayed-swiglu-scale) is checkpoint state: an e4m3 run resumed from a
checkpoint is bit-exact with the uninterrupted one.

The scales are per-layer maxima of each worker's last training forward and backward, different on every worker
(each reads its own micro-batches). They travel in the manifest as JSON, one entry per worker
(llmq_ray/checkpoints/layout.py ``fp8_scale_state_for_rank``, llmq_ray/checkpoints/resume.py):

* through the Ray runtime on CPU workers (e4m3 through the torch reference, as tests/test_fp8_model.py runs it):
  8 steps with a checkpoint at step 4, resumed from it on the same number of workers (1 and 2) -- per-step
  losses and norms of steps 5-8 bit-identical to the uninterrupted run's, and the manifest holds one entry of
  [L] scales per worker;
* on another number of workers, each takes the elementwise maximum over the saved workers' entries;
* a checkpoint without the entry (older ones, runs without the delayed scale) resumes as before: {} -- the
  first step measures afresh;
* an fp32 value goes through the JSON manifest unchanged, to the bit.
"""

from __future__ import annotations

import json
import os
import struct

import pytest

from llmq_ray.checkpoints.layout import FP8_SCALE_STATE, build_manifest, fp8_scale_state_for_rank
from llmq_ray.model.config import PRESETS

FAST = dict(collective_timeout_s=15.0, call_timeout_s=60.0, use_ray_data=False, verbose=False)
RUN = dict(model="tiny", steps=8, batch_size=2, seq_len=16, learning_rate=3e-3, warmup=2, device="cpu",
           export=False, final_eval=False, ckpt_interval=4, model_dtype="bf16", matmul_dtype="e4m3",
           fp8_delayed_swiglu_scale=True)
SHAPE = {1: dict(workers=1, grad_accumulation=2), 2: dict(workers=2, grad_accumulation=1)}


def _fp32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


# ---------------------------------------------------------------------------------------------------- manifest
def test_the_manifest_keeps_each_workers_scales_and_merges_them_by_maximum_on_another_world_size():
    a = [_fp32(0.1), _fp32(3.0e-7), _fp32(12.5)]  # fp32 values, as the engine hands them over
    b = [_fp32(0.2), _fp32(1.0e-7), _fp32(11.0)]
    m = build_manifest(4, config=PRESETS["tiny"], world_size=2, data_state=[{}, {}],
                       fp8_scale_state=[{"swiglu_dy_amax": a, "swiglu_out_amax": a}, {"swiglu_dy_amax": b}])
    m = json.loads(json.dumps(m))  # what a reader gets back from manifest.json
    assert m[FP8_SCALE_STATE]["tensor_parallel"] == 1 and len(m[FP8_SCALE_STATE]["workers"]) == 2
    assert fp8_scale_state_for_rank(m, 0, 2) == {"swiglu_dy_amax": a, "swiglu_out_amax": a}  # bit for bit
    assert fp8_scale_state_for_rank(m, 1, 2) == {"swiglu_dy_amax": b}
    merged = {"swiglu_dy_amax": [max(x, y) for x, y in zip(a, b)], "swiglu_out_amax": a}
    assert fp8_scale_state_for_rank(m, 0, 1) == merged
    assert fp8_scale_state_for_rank(m, 2, 3) == merged
    assert fp8_scale_state_for_rank(m, 1, 2, tensor_parallel=2) == merged  # another shape: the maximum too


def test_a_checkpoint_without_scales_resumes_as_before():
    plain = build_manifest(4, config=PRESETS["tiny"], world_size=1, fp8_scale_state=[{}])
    assert FP8_SCALE_STATE not in plain  # runs without the delayed scale write nothing
    legacy = build_manifest(4, config=PRESETS["tiny"], world_size=1)
    assert fp8_scale_state_for_rank(legacy, 0, 1) == {} and fp8_scale_state_for_rank(legacy, 0, 4) == {}


# ---------------------------------------------------------------------------------------------------- Ray
def _run(shards, out, world: int, **kw):
    from llmq_ray.train.trainer import LLMQTrainer

    return LLMQTrainer(**dict(RUN, train_file=shards.train, out_dir=str(out), **SHAPE[world], **FAST, **kw)).fit()


@pytest.mark.parametrize("world", [1, 2])
def test_an_e4m3_run_with_the_delayed_scale_resumes_bit_exactly(ray_cluster, shards, tmp_path, world):
    ref = _run(shards, tmp_path / "ref", world)
    assert [r["step"] for r in ref.history] == list(range(1, 9))
    ckpt = os.path.join(os.path.dirname(ref.log_file), "ckpt", "step_00000004")
    with open(os.path.join(ckpt, "manifest.json")) as f:
        saved = json.load(f)[FP8_SCALE_STATE]
    layers = PRESETS["tiny"].num_layers
    assert len(saved["workers"]) == world
    for entry in saved["workers"]:
        assert sorted(entry) == ["swiglu_dy_amax", "swiglu_out_amax"], entry
        assert all(len(v) == layers and all(x > 0 for x in v) for v in entry.values())

    res = _run(shards, tmp_path / "resumed", world, resume=ckpt)
    assert [r["step"] for r in res.history] == list(range(5, 9))
    assert [r["loss"] for r in res.history] == [r["loss"] for r in ref.history][4:]  # exact float equality
    assert [r["norm"] for r in res.history] == [r["norm"] for r in ref.history][4:]
