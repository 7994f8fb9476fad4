"""Checkpoints, resume and fault tolerance through the Ray runtime (LLMQTrainer, CPU workers over gloo).

Two uninterrupted reference runs (module fixture) train 12 steps of the tiny preset with the same global
batch: 1 worker x grad_accumulation 2, and 2 workers x grad_accumulation 1 (which compute the same steps
up to float summation order, see test_runtime.py), each writing checkpoints at steps 6 and 12. Then:

* a run resumed from step 6 on the same world size reproduces steps 7-12 and the final weights bit for bit;
* a run resumed on the other world size (1 -> 2 here, 2 -> 1 in the crash test) continues within 1e-5;
* a worker SIGKILLed after the first checkpoint, then (in the group that replaced it) one that hangs past
  --step-timeout-s: the coordinator rebuilds the group by itself each time and the final losses equal the
  uninterrupted run's; a worker that keeps hanging ends the run in one sentence naming its rank and the timeout;
* a worker killed halfway through writing a checkpoint: no step_* folder for it, and --continue takes the
  previous one (skipping a newer incomplete folder with a warning), here on another world size;
* a newest checkpoint with one flipped byte (same size): --continue skips it with a warning naming the
  file and resumes bit-exactly from the one before;
* a NaN gradient is skipped and logged; the spike guard's skips agree across ranks;
* a checksum mismatch and a full disk end in one CheckpointError sentence.

Every trainer call runs with short timeouts, so a bug fails instead of hanging.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil

import numpy as np
import pytest
import torch

from llmq_ray.actors.failures import WorkerError
from llmq_ray.errors import CheckpointError
from llmq_ray.observe.runlog import read_log
from llmq_ray.train.trainer import LLMQTrainer, Result
from _helpers import faulty_trainer, train_settings

FAST = dict(collective_timeout_s=15.0, call_timeout_s=60.0, use_ray_data=False, verbose=False)
BASE = dict(model="tiny", steps=12, batch_size=2, seq_len=16, learning_rate=3e-3, warmup=2, device="cpu",
            export_dtype="fp32", final_eval=False, ckpt_interval=6)
SHAPE = {1: dict(workers=1, grad_accumulation=2), 2: dict(workers=2, grad_accumulation=1)}


def _run(shards, out, world: int, **kw) -> Result:
    args = dict(BASE, train_file=shards.train, out_dir=str(out), **SHAPE[world], **FAST)
    args.update(kw)
    return faulty_trainer(**args).fit()


@pytest.fixture(scope="module")
def reference(ray_cluster, shards, tmp_path_factory):
    """{world size: Result} of the uninterrupted runs (checkpoints in out_dir/ckpt at steps 6 and 12)."""
    root = tmp_path_factory.mktemp("ref")
    return {w: _run(shards, root / f"w{w}", w) for w in (1, 2)}


def _ckpt(result: Result, step: int) -> str:
    path = os.path.join(os.path.dirname(result.log_file), "ckpt", f"step_{step:08d}")
    assert os.path.isfile(os.path.join(path, "manifest.json")), path
    return path


def _losses(result: Result) -> list[float]:
    return [r["loss"] for r in result.history]


def _weights(result: Result) -> torch.Tensor:
    from safetensors.torch import load_file

    t = load_file(os.path.join(result.export_path, "model.safetensors"))
    return torch.cat([t[k].flatten() for k in sorted(t)])


def _log(result: Result) -> list[dict]:
    return read_log(result.log_file)


@pytest.mark.parametrize("world", [1, 2])
def test_resume_is_bit_exact(reference, shards, tmp_path, world):
    """Continue the reference run from its step-6 checkpoint on the same world size: steps 7-12 and the
    final weights are bit-identical to the uninterrupted run."""
    ref = reference[world]
    assert [r["step"] for r in ref.history] == list(range(1, 13))
    assert ref.checkpoint_paths == [_ckpt(ref, 6), _ckpt(ref, 12)]
    with open(os.path.join(_ckpt(ref, 6), "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["step"] == 6 and manifest["world_size"] == world and len(manifest["files"]) == world

    res = _run(shards, tmp_path, world, resume=_ckpt(ref, 6))
    assert [r["step"] for r in res.history] == list(range(7, 13))
    assert _losses(res) == _losses(ref)[6:]  # exact float equality
    assert [r["norm"] for r in res.history] == [r["norm"] for r in ref.history][6:]
    assert torch.equal(_weights(res), _weights(ref))
    resumed = [r for r in _log(res) if r["log"] == "resume"]
    assert len(resumed) == 1 and resumed[0]["step"] == 6 and resumed[0]["path"] == _ckpt(ref, 6)


@pytest.mark.parametrize("saved,now", [(1, 2)])
def test_resume_on_another_world_size(reference, shards, tmp_path, saved, now):
    """A checkpoint of 1 worker resumed on 2: the flat master/m/v shards are resharded, the data position
    rescaled, and the losses continue within 1e-5 of the uninterrupted run. (2 -> 1 is the second half of
    test_crash_while_saving_then_continue.)"""
    ref_losses = np.array(_losses(reference[now]))
    np.testing.assert_allclose(_losses(reference[saved]), ref_losses, rtol=1e-5)  # same global batch
    res = _run(shards, tmp_path, now, resume=_ckpt(reference[saved], 6))
    assert [r["step"] for r in res.history] == list(range(7, 13))
    np.testing.assert_allclose(_losses(res), ref_losses[6:], rtol=1e-5)
    w, w_ref = _weights(res), _weights(reference[now])
    assert float((w - w_ref).norm() / w_ref.norm()) < 1e-5
    resumed = [r for r in _log(res) if r["log"] == "resume"][0]
    assert (resumed["saved_world_size"], resumed["world_size"]) == (saved, now)


def test_tensor_parallel_runs_train_as_one_worker_and_their_checkpoints_resume_on_one(reference, shards, tmp_path):
    """--tensor-parallel through Ray (tiny: 4 query heads, 2 KV heads, QKV bias, tied embedding; fp32 on gloo):

    * T=2 on 2 workers x grad_accumulation 2 (ZeRO-1) and T=2 x DP=2 on 4 workers x 1 (ZeRO-3) train the
      reference's steps: per-step losses and norms within 1e-5 of 1 worker (the same global batch: a
      tensor-parallel group reads one data-parallel rank's batches);
    * their checkpoints are in the whole model's layout, one file per data-parallel rank, and look like a
      1- or 2-worker run's (world_size, data states);
    * the T=2 run's step-12 checkpoint loaded on 1 worker gives the T=2 run's exported weights bit for bit
      (fp32) and the same final eval (targets, loss within 1e-5), and its step-6 checkpoint resumed on 1 worker
      continues within 1e-5 of the uninterrupted run; the T=2 x DP=2 run resumed from its own step-6 checkpoint
      is bit for bit the uninterrupted one (losses and final weights)."""
    ref = reference[1]
    ev = dict(eval_file=shards.eval, final_eval=True)
    tp2 = _run(shards, tmp_path / "tp2", 1, workers=2, tensor_parallel=2, **ev)
    tp2dp2 = _run(shards, tmp_path / "tp2dp2", 2, workers=4, tensor_parallel=2, zero_level=3)
    for res in (tp2, tp2dp2):
        assert [r["step"] for r in res.history] == list(range(1, 13))
        np.testing.assert_allclose(_losses(res), _losses(ref), rtol=1e-5)
        np.testing.assert_allclose([r["norm"] for r in res.history], [r["norm"] for r in ref.history], rtol=1e-4)
        assert [r["tokens"] for r in res.history] == [r["tokens"] for r in ref.history]
        w, w_ref = _weights(res), _weights(ref)
        assert float((w - w_ref).norm() / w_ref.norm()) < 1e-5
    for res, dp in ((tp2, 1), (tp2dp2, 2)):
        with open(os.path.join(_ckpt(res, 6), "manifest.json")) as f:
            manifest = json.load(f)
        assert manifest["world_size"] == dp and len(manifest["files"]) == dp
        assert len(manifest["data_state"]) == dp and manifest["train_options"]["tensor_parallel"] == 2

    loaded = _run(shards, tmp_path / "loaded", 1, resume=_ckpt(tp2, 12), **ev)
    assert loaded.history == [] and torch.equal(_weights(loaded), _weights(tp2))
    # the final eval of the group (its two ranks read the same batches) is one worker's on the same weights
    (e_tp,), (e_one,) = [[e for e in r.evals if e["full"]] for r in (tp2, loaded)]
    assert e_tp["targets"] == e_one["targets"] > 0 and abs(e_tp["loss"] - e_one["loss"]) <= 1e-5 * e_one["loss"]
    resumed = _run(shards, tmp_path / "resumed", 1, resume=_ckpt(tp2, 6))
    assert [r["step"] for r in resumed.history] == list(range(7, 13))
    np.testing.assert_allclose(_losses(resumed), _losses(tp2)[6:], rtol=1e-5)
    # the same layout resumed from its own step-6 checkpoint (each rank cuts its part and data-parallel shard out
    # of the whole model's state): bit for bit the uninterrupted run
    again = _run(shards, tmp_path / "again", 2, workers=4, tensor_parallel=2, zero_level=3, resume=_ckpt(tp2dp2, 6))
    assert _losses(again) == _losses(tp2dp2)[6:] and torch.equal(_weights(again), _weights(tp2dp2))


def test_tensor_parallel_sizes_that_do_not_fit_are_one_sentence_before_any_actor_starts(ray_cluster, shards, tmp_path):
    """Refused before any actor starts, naming the flag and the value: a T that does not divide the workers, one
    that does not divide the model's heads, and an option tensor parallelism does not run with yet."""
    from llmq_ray.errors import ConfigError

    cases = [(dict(workers=3, tensor_parallel=2), "tensor_parallel=2 must divide the number of workers (3"),
             (dict(workers=8, tensor_parallel=8), "tensor_parallel=8: a tensor-parallel group of 8 must divide the model's 4 attention heads"),
             (dict(workers=2, tensor_parallel=2, overlap_comm=True),
              "tensor_parallel=2 does not run with overlap_comm")]  # the API's names (api_names)
    for kw, words in cases:
        with pytest.raises(ConfigError, match=re.escape(words)):
            LLMQTrainer(**dict(BASE, train_file=shards.train, out_dir=str(tmp_path), **FAST, **kw)).start()


def test_a_killed_and_then_a_hung_worker_are_each_replaced_and_the_run_finishes(reference, shards, tmp_path):
    """Two failures of one run, each survived by a restart from the step-6 checkpoint:

    * rank 1's process is SIGKILLed at step 9 (as from the OOM killer) while rank 0 waits in a collective: the
      coordinator notices, tears the group down, starts a new one and loads step 6;
    * in that second group rank 1 blocks forever at the start of step 9 (alive, not dead) while rank 0 waits for
      it in the update's collective: the step outlasts --step-timeout-s, the coordinator pins the hang on rank 1
      (rank 0 is only waiting), kills the group and rebuilds it from step 6 again.

    The third group trains 7-12: the losses equal the uninterrupted run's, the log tells both stories, each
    group's processes are new, and neither the killed nor the hung process is left behind. The step time-out
    is 8 s: with a second test suite beside this one on 2 cores, a healthy first step took over 3 s and was
    taken for the hang."""
    ref = reference[2]
    res = _run(shards, tmp_path, 2, step_timeout_s=8.0,
               fault=[{"kind": "kill", "rank": 1, "step": 8}, {"kind": "hang", "rank": 1, "step": 8, "group": 1}])
    assert res.metrics["restarts"] == 2
    assert [r["step"] for r in res.history] == list(range(1, 13))
    assert res.metrics["train_loss"] == ref.metrics["train_loss"]
    assert _losses(res) == _losses(ref)
    log = _log(res)
    failures = [r for r in log if r["log"] == "failure"]
    assert [f["step"] for f in failures] == [8, 8]
    assert "rank" in failures[0]["error"] and "hung" not in failures[0]["error"], failures[0]["error"]
    assert re.fullmatch(r"rank 1 hung in step 9, at the start of the step, with no progress for \d+ s while rank 0 "
                        r"waited for it: the step did not finish within --step-timeout-s=8\.", failures[1]["error"])
    restarts = [r for r in log if r["log"] == "restart"]
    assert [r["attempt"] for r in restarts] == [1, 2]
    assert all(r["checkpoint"].endswith("step_00000006") for r in restarts)
    assert [r["reason"] for r in log if r["log"] == "resume"] == ["restart 1", "restart 2"]
    first = [r["pid"] for r in log if r["log"] == "gpu"]
    second, third = [r["pids"] for r in log if r["log"] == "restarted"]
    assert len(first) == len(second) == len(third) == 2
    assert not set(first) & set(second) and not set(second) & set(third)  # each group was rebuilt whole
    for gone in (first[1], second[1]):  # the killed worker, and the hung one (killed, not left behind)
        with pytest.raises(ProcessLookupError):
            os.kill(gone, 0)


def test_worker_that_keeps_hanging_ends_the_run_in_one_sentence(ray_cluster, shards, tmp_path):
    """A rank that hangs again after the restart: the run ends (no third group) with one sentence naming
    the rank, the step, the timeout and the restarts used."""
    with pytest.raises(WorkerError) as info:
        _run(shards, tmp_path, 2, steps=4, ckpt_interval=2, max_restarts=1, step_timeout_s=3.0, export=False,
             fault={"kind": "hang", "rank": 1, "step": 2, "every_group": True})
    assert re.fullmatch(r"rank 1 hung in step 3, at the start of the step, with no progress for \d+ s while rank 0 "
                        r"waited for it: the step did not finish within step_timeout_s=3; gave up after 1 "
                        r"automatic restart\(s\) \(max_restarts=1\)\.", str(info.value))  # API: keyword names
    end = read_log(str(tmp_path / "log.jsonl"))[-1]  # the log says why the run ended
    assert end["log"] == "end" and end["reason"] == "restarts_exhausted" and "rank 1 hung" in end["error"]


def test_crash_while_saving_then_continue(reference, shards, tmp_path):
    """Rank 1 of 2 dies halfway through writing checkpoint 9 (no automatic restart): the run fails in one
    sentence naming rank 1, and no step_00000009 appears. --continue then resumes from step 6 -- skipping a
    newer incomplete folder with a warning -- on *one* worker: the 2-rank shards (ZeRO-2, whose gradient
    shard accumulator the load resets) are resharded and the losses continue within 1e-5 of the
    uninterrupted runs."""
    ckpt = tmp_path / "ckpt"
    with pytest.raises(WorkerError, match=r"^rank 1 died during checkpoint save \(step 9\)") as info:
        _run(shards, tmp_path / "a", 2, ckpt_interval=3, checkpoint_dir=str(ckpt), max_restarts=0, zero_level=2,
             fault={"kind": "save_kill", "rank": 1, "step": 9})
    assert "\n" not in str(info.value)
    assert sorted(os.listdir(ckpt)) == ["step_00000003", "step_00000006"]  # no tmp left, nothing half-published
    with open(ckpt / "step_00000006" / "manifest.json") as f:
        assert json.load(f)["world_size"] == 2
    os.makedirs(ckpt / "step_00000010")  # e.g. a copy cut short: no manifest
    res = _run(shards, tmp_path / "b", 1, ckpt_interval=3, checkpoint_dir=str(ckpt), resume=True)
    assert [r["step"] for r in res.history] == list(range(7, 13))
    np.testing.assert_allclose(_losses(res), _losses(reference[1])[6:], rtol=1e-5)
    w, w_ref = _weights(res), _weights(reference[1])
    assert float((w - w_ref).norm() / w_ref.norm()) < 1e-5
    log = _log(res)
    resumed = [r for r in log if r["log"] == "resume"]
    assert len(resumed) == 1 and resumed[0]["path"].endswith("step_00000006") and resumed[0]["saved_world_size"] == 2
    warned = [r for r in log if r["log"] == "warning" and r["kind"] == "checkpoint"]
    assert len(warned) == 1 and "step_00000010" in warned[0]["message"] and "no manifest.json" in warned[0]["message"]


def test_nan_gradient_is_skipped_and_spike_guard_agrees_across_ranks(ray_cluster, shards, tmp_path):
    """A NaN put into rank 1's gradients at step 4 makes every rank skip that update; the run goes on with
    finite weights and a warning record. With a tiny spike window and threshold, the spike guard skips
    some updates too: both ranks take the same decisions (else their collectives would desynchronize), and
    every skip is logged."""
    res = _run(shards, tmp_path, 2, steps=14, ckpt_interval=0, skip_update_on_spike=True, spike_window=3,
               spike_threshold=1.0, fault={"kind": "nan", "rank": 1, "step": 3})
    hist = res.history
    assert len(hist) == 14 and math.isnan(hist[3]["norm"]) and hist[3]["skip_reason"] == "non-finite gradient norm"
    assert all(math.isfinite(r["norm"]) for i, r in enumerate(hist) if i != 3)
    assert torch.isfinite(_weights(res)).all()
    warnings = [r for r in _log(res) if r["log"] == "warning"]
    nonfinite = [w for w in warnings if w["kind"] == "nonfinite"]
    assert len(nonfinite) == 1 and nonfinite[0]["step"] == 4 and "update skipped" in nonfinite[0]["message"]
    spikes_skipped = {w["step"] for w in warnings if w["kind"] in ("loss_spike", "norm_spike") and w["skipped"]}
    skipped = {r["step"] for r in hist if r["skipped"]}
    assert spikes_skipped, "the spike guard never skipped an update (threshold 1.0 over 3 steps)"
    assert skipped == spikes_skipped | {4}  # the 4th step (the fault's 0-based step index 3)
    assert res.metrics["skipped_steps"] == len(skipped) and res.metrics["warnings"] >= len(skipped)


def test_continuing_a_finished_run_only_exports_and_fewer_steps_are_refused(reference, shards, tmp_path, capsys):
    """--continue from the last checkpoint of a finished run with the same --steps trains nothing, exports the
    same weights and prints its summary (a TypeError on the missing train loss before); --steps below the
    checkpoint's step is refused in one sentence before Ray work (it would have exported the later weights)."""
    from llmq_ray.errors import ConfigError

    ref = reference[1]
    with pytest.raises(ConfigError, match=r"^steps=6 but the checkpoint to continue, .*step_00000012, already "
                                          r"holds 12 steps; pass steps above 12"):
        LLMQTrainer(**dict(BASE, train_file=shards.train, out_dir=str(tmp_path / "fewer"), **SHAPE[1], **FAST,
                           steps=6, resume=_ckpt(ref, 12)))
    res = _run(shards, tmp_path / "again", 1, resume=_ckpt(ref, 12), verbose=True)
    assert res.history == [] and res.metrics["train_loss"] is None
    assert torch.equal(_weights(res), _weights(ref))
    out = capsys.readouterr().out
    assert "--steps=12: the checkpoint already holds every step" in out
    assert "last train loss - (no step trained)" in out, out


def test_continue_skips_a_newest_checkpoint_with_a_flipped_byte(reference, shards, tmp_path):
    """A copy of the 2-worker reference's checkpoints whose newest (step 12) has one byte of rank 1's shard
    flipped (same size, so only its sha256 tells): --continue hashes the candidates before Ray starts, skips
    step 12 with a warning naming the file, and resumes from step 6 -- steps 7-12 and the final weights are
    bit-identical to the uninterrupted run (as in test_resume_is_bit_exact)."""
    ref = reference[2]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(os.path.dirname(_ckpt(ref, 12)), ckpt)
    assert sorted(os.listdir(ckpt)) == ["step_00000006", "step_00000012"]
    bad = ckpt / "step_00000012" / "rank_00001.safetensors"
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0x01
    bad.write_bytes(bytes(data))
    assert bad.stat().st_size == len(data)

    trainer = LLMQTrainer(**dict(BASE, train_file=shards.train, out_dir=str(tmp_path / "run"), **SHAPE[2], **FAST,
                                 checkpoint_dir=str(ckpt), resume=True))
    res = trainer.fit()
    assert len(trainer.notes) == 1 and str(bad) in trainer.notes[0] and "sha256" in trainer.notes[0], trainer.notes
    log = _log(res)
    warned = [r for r in log if r["log"] == "warning" and r["kind"] == "checkpoint"]
    assert len(warned) == 1 and str(bad) in warned[0]["message"], warned
    resumed = [r for r in log if r["log"] == "resume"]
    assert len(resumed) == 1 and resumed[0]["step"] == 6 and resumed[0]["path"] == str(ckpt / "step_00000006")
    assert [r["step"] for r in res.history] == list(range(7, 13))
    assert _losses(res) == _losses(ref)[6:]  # exact float equality
    assert torch.equal(_weights(res), _weights(ref))


def test_checksum_mismatch_and_full_disk_are_one_sentence(reference, shards, tmp_path):
    """A shard whose bytes changed (same size), named by --continue, is refused before Ray work starts
    (resolving --continue hashes every file); a disk that fills up while a worker writes its shard ends the
    run, and the previous checkpoint stays valid."""
    bad = tmp_path / "copy" / "step_00000006"
    shutil.copytree(_ckpt(reference[1], 6), bad)
    path = bad / "rank_00000.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"rank_00000\.safetensors fails its sha256 checksum") as info:
        _run(shards, tmp_path / "a", 1, resume=str(bad), export=False)
    assert "\n" not in str(info.value)

    ckpt = tmp_path / "ckpt"
    with pytest.raises(CheckpointError, match=r"checkpoint step_00000006 could not be written to .*\(No space left "
                                              r"on device\); the previous checkpoint step_00000003 is still valid\.$"):
        _run(shards, tmp_path / "b", 1, steps=8, ckpt_interval=3, checkpoint_dir=str(ckpt), export=False,
             fault={"kind": "save_full", "rank": 0, "step": 6})
    assert sorted(os.listdir(ckpt)) == ["step_00000003"]


# ---------------------------------------------------------------------------------------------------- no Ray
def test_hang_is_pinned_on_the_rank_behind_the_others():
    """find_hung_ranks: where each rank stands inside the step (``GPUWorker.activity``) decides who hung."""
    from llmq_ray.actors.failures import find_hung_ranks

    def at(step, where):
        return {"step": step, "at": where, "what": "...", "seconds": 9.0}

    # the step timed out: rank 1 never got past the start while ranks 0 and 2 wait in the update
    acts = {0: at(8, 2), 1: at(8, -1), 2: at(8, 2)}
    assert find_hung_ranks(acts, [0, 1, 2], None) == [1]
    # all at the same point (a collective hanging as a whole): every pending rank is named
    assert find_hung_ranks({0: at(8, 2), 1: at(8, 2)}, [0, 1], None) == [0, 1]
    # a rank that does not even answer the probe (frozen process) is the one
    assert find_hung_ranks({0: at(8, -1), 1: None}, [0, 1], None) == [1]
    # rank 0's collective timed out first, waiting in the update for rank 1, still reading micro-batch 0
    assert find_hung_ranks({0: at(8, 2), 1: at(8, 0)}, [1], 0) == [1]
    # rank 0 failed by itself early in the step while rank 1 waits further on: rank 0's own error stands
    assert find_hung_ranks({0: at(8, 1), 1: at(8, 2)}, [1], 0) == []
    # the failed rank is gone (killed): only a silent pending rank would be blamed
    assert find_hung_ranks({0: None, 1: at(8, 2)}, [1], 0) == []


def test_a_fault_hook_fires_in_the_group_it_names():
    """The test hook's faults fire in the first group of workers, in the group of a later restart ("group": g),
    or in every group; a restart keeps what is left for the next groups."""
    from llmq_ray.actors.fault_injection import FaultInjector, next_group_faults

    kill, hang, slow = ({"kind": "kill", "rank": 1, "step": 8}, {"kind": "hang", "rank": 1, "step": 8, "group": 1},
                        {"kind": "slow_step", "rank": 1, "step": 0, "every_group": True})
    spec = [kill, hang, slow]
    assert [f["kind"] for f in FaultInjector(spec, 1).specs] == ["kill", "slow_step"] and not FaultInjector(spec, 0).specs
    second = next_group_faults(spec)
    assert second == [slow, dict(hang, group=0)]
    assert [f["kind"] for f in FaultInjector(second, 1).specs] == ["slow_step", "hang"]
    assert next_group_faults(second) == [slow] and next_group_faults(kill) is None


def test_spike_guard_zscores_limits_and_state():
    """z-scores over a full window only; limits = mean + threshold * std; NaN never enters a window; the
    state round-trips (what the checkpoint manifest carries)."""
    from llmq_ray.engine.spike_guard import SpikeGuard

    g = SpikeGuard(window=4, threshold=3.0)
    for x in (1.0, 2.0, 1.0, 2.0):
        assert g.limits() == {"loss": None, "norm": None}
        assert g.observe(x, 10 * x) == []  # window not full yet: never a spike
    lim = g.limits()  # mean 1.5, std 0.5
    assert lim["loss"] == pytest.approx(3.0) and lim["norm"] == pytest.approx(30.0)
    assert g.observe(float("nan"), float("inf")) == []  # not finite: no z-score, not added
    assert list(g.loss.values) == [1.0, 2.0, 1.0, 2.0]
    spikes = g.observe(3.5, 15.0)  # loss z = (3.5 - 1.5) / 0.5 = 4 > 3; norm z = 0
    assert [name for name, _ in spikes] == ["loss"] and spikes[0][1] == pytest.approx(4.0)
    assert list(g.loss.values) == [2.0, 1.0, 2.0, 3.5]  # spikes join the window (llm.c does the same)
    h = SpikeGuard(window=4, threshold=3.0)
    h.load_state(json.loads(json.dumps(g.state())))
    assert h.limits() == g.limits() and h.observe(9.0, 1.0) == g.observe(9.0, 1.0)
    with pytest.raises(ValueError, match="a spike window of 1 steps"):
        SpikeGuard(window=1)


def test_engine_skips_an_update_above_the_limits():
    """engine.update(max_loss=..., max_norm=...): a step above either limit leaves weights and optimizer
    state untouched and says why; below them the update happens."""
    from llmq_ray.backends import get_backend
    from llmq_ray.model.config import PRESETS
    from llmq_ray.engine.train_engine import TrainEngine

    opts = train_settings(model="tiny", batch_size=2, seq_len=16, steps=4, learning_rate=1e-2, model_dtype="fp32")
    engine = TrainEngine(PRESETS["tiny"], opts, get_backend("torch"))
    g = torch.Generator().manual_seed(0)
    batch = lambda: (torch.randint(0, 512, (2, 16), generator=g), torch.randint(0, 512, (2, 16), generator=g))  # noqa: E731
    before = engine.params.clone()
    for kw, reason in ((dict(max_loss=1.0), "loss spike"), (dict(max_norm=1e-3), "grad-norm spike")):
        engine.micro_step(*batch())
        s = engine.update(1e-2, 1, **kw)
        assert s.skipped and s.skip_reason == reason and math.isfinite(s.loss)
        assert torch.equal(engine.params, before) and engine.micro_steps_done == 0
    engine.micro_step(*batch())
    s = engine.update(1e-2, 1, max_loss=1e6, max_norm=1e6)
    assert not s.skipped and s.skip_reason is None and not torch.equal(engine.params, before)
