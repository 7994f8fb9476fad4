"""The Ray runtime on CPU workers over gloo: data-parallel equivalence, nesting, metrics, failures.

All runs use the ``tiny`` preset (vocab 512) on a small synthetic shard, fp32, and the session Ray
fixture. Worker calls carry short timeouts, so a bug shows up as a failure, not a hang.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import time
import urllib.request

import numpy as np
import pytest
import torch

from llmq_ray.actors.failures import WorkerError
from llmq_ray.errors import CheckpointError, ConfigError, DataError
from llmq_ray.observe.runlog import read_log
from llmq_ray.train.trainer import LLMQTrainer, Result
from _helpers import faulty_trainer, make_plan

FAST = dict(collective_timeout_s=60.0, call_timeout_s=120.0, use_ray_data=False, verbose=False)


def _run(shards, out, **kw) -> Result:
    train, evalf, _ = shards
    args = dict(model="tiny", train_file=train, eval_file=evalf, steps=20, batch_size=2, seq_len=16,
                learning_rate=3e-3, warmup=2, device="cpu", out_dir=str(out), export_dtype="fp32", **FAST)
    args.update(kw)
    return faulty_trainer(**args).fit()


def _export_tensors(path: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


@pytest.fixture(scope="module")
def one_worker_reference(ray_cluster, shards, tmp_path_factory) -> Result:
    """The one-worker ZeRO-1 run (grad_accumulation 4) that every ZeRO level's two-worker run is compared with:
    run once for the module, not once per level."""
    return _run(shards, tmp_path_factory.mktemp("ref"), workers=1, grad_accumulation=4, zero_level=1)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_two_workers_match_one_worker(one_worker_reference, shards, tmp_path, zero):
    """2 gloo workers x grad_accumulation 2 == 1 worker x grad_accumulation 4, same B: per-step losses and
    final weights within 1e-5 relative, for ZeRO-1, ZeRO-2 and ZeRO-3 (ZeRO-3: every layer's weights are
    broadcast from their owner(s) before use and its gradients reduced onto them during the backward; the
    export gathers the shards from both workers).

    Why the data is the same: TokenStream's epoch order is one global permutation of windows; rank r of W
    takes order[r::W]. After each rank consumed c windows the ranks together consumed exactly the positions
    [0, c*W). So in optimizer step k, the two workers (2 micro-steps of B=2 each) read positions
    [8k, 8k+8) between them, and the single worker (4 micro-steps of B=2) reads the same [8k, 8k+8). The
    loss and the gradient are sums over those windows divided by the total target count, so both runs
    compute the same step up to float summation order. 20 steps x 8 windows = 160 < 124 x 2 windows per
    epoch for W=2 (and < 249 for W=1), so no run crosses an epoch boundary (where W changes the dropped tail).
    The reference always runs ZeRO-1 on one worker, so ZeRO-2's per-micro-step reduce-scatter into a
    shard accumulator is checked against the plain path.
    """
    ref = one_worker_reference
    dist = _run(shards, tmp_path / f"z{zero}", workers=2, grad_accumulation=2, zero_level=zero)
    ref_losses = np.array([r["loss"] for r in ref.history])
    dist_losses = np.array([r["loss"] for r in dist.history])
    assert len(ref_losses) == len(dist_losses) == 20
    assert ref_losses[-1] < ref_losses[0] - 0.3  # it trained
    np.testing.assert_allclose(dist_losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose([r["norm"] for r in dist.history], [r["norm"] for r in ref.history], rtol=1e-4)
    assert [r["targets"] for r in dist.history] == [r["targets"] for r in ref.history] == [8 * 16] * 20
    a, b = _export_tensors(ref.export_path), _export_tensors(dist.export_path)
    assert a.keys() == b.keys()
    flat_a = torch.cat([a[k].flatten() for k in sorted(a)])
    flat_b = torch.cat([b[k].flatten() for k in sorted(a)])
    assert (flat_a - flat_b).norm() / flat_a.norm() < 1e-5
    for name in a:
        err = float((a[name] - b[name]).norm() / a[name].norm().clamp(min=1e-12))
        # The key bias has a mathematically zero gradient (softmax is invariant to adding q.b_k to every
        # score of a query), so what it gets is float rounding noise, which Adam normalizes into lr-sized
        # steps: its values are noise-driven in *both* runs and only agree loosely.
        limit = 1e-3 if name.endswith("k_proj.bias") else 1e-5
        assert err < limit, (name, err)
    assert abs(ref.metrics["eval_loss"] - dist.metrics["eval_loss"]) < 1e-5 * ref.metrics["eval_loss"]


def test_offload_flags_through_the_runtime(ray_cluster, shards, tmp_path):
    """The offload flags reach the workers through LLMQTrainer (2 gloo workers, ZeRO-2, bf16 weights + fp32
    master + bf16 moments, a small --opt-chunk-size so the shards stream in many chunks): losses, norms and
    exported weights are bit-identical to the same run without them, and the workers' memory tables in the
    log show the state on the host."""
    kw = dict(workers=2, grad_accumulation=2, zero_level=2, steps=4, model_dtype="bf16", master_dtype="fp32",
              opt_m_dtype="bf16", opt_v_dtype="bf16", opt_chunk_size=4096, export_dtype="bf16", eval_file=None)
    ref = _run(shards, tmp_path / "ref", **kw)
    off = _run(shards, tmp_path / "off", offload_master=True, offload_opt_m=True, offload_opt_v=True,
               offload_gradients=True, offload_residual=True, attn_bwd_chunks=2, **kw)
    assert [r["loss"] for r in off.history] == [r["loss"] for r in ref.history]
    assert [r["norm"] for r in off.history] == [r["norm"] for r in ref.history]
    a, b = _export_tensors(ref.export_path), _export_tensors(off.export_path)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    mem = [rec for rec in read_log(off.log_file) if rec["log"] == "allocator"]
    assert len(mem) == 2 and all(m["host_master"] > 0 and m["master"] == 0 and m["host_grads"] > 0 for m in mem)


def test_a_second_fit_on_the_same_trainer_is_refused(ray_cluster, shards, tmp_path):
    """fit() twice on one LLMQTrainer trained the run again from scratch into the same folders (its checkpoints
    replaced, its log and export set aside): now one ConfigError, and the first run's outputs stay as they were."""
    train, _, _ = shards
    trainer = LLMQTrainer(model="tiny", train_file=train, steps=3, batch_size=2, seq_len=16, device="cpu",
                          out_dir=str(tmp_path), export_dtype="fp32", final_eval=False, **FAST)
    first = trainer.fit()
    before = sorted(os.listdir(tmp_path)), os.path.getmtime(first.log_file)
    with pytest.raises(ConfigError, match=r"^fit\(\) already ran on this LLMQTrainer \(into out_dir=.*\); make a new "
                                          r"LLMQTrainer for another run, with resume=True"):
        trainer.fit()
    for call in (trainer.export, trainer.validate, trainer.train_step):  # each started a new run from scratch
        with pytest.raises(ConfigError, match=r"^this LLMQTrainer's run has ended \(by fit\(\), stop\(\) or close\(\); "):
            call()
    assert (sorted(os.listdir(tmp_path)), os.path.getmtime(first.log_file)) == before


def test_calls_after_a_step_level_loop_stopped_are_refused(ray_cluster, shards, tmp_path):
    """export() after stop() started a new run from scratch: it exported freshly initialized weights as
    out_dir/export (the trained export and the log set aside beside it). Now one ConfigError, the outputs as they
    were; train_step() keeps returning None after a stop, as documented."""
    train, _, _ = shards
    trainer = LLMQTrainer(model="tiny", train_file=train, steps=3, batch_size=2, seq_len=16, device="cpu",
                          out_dir=str(tmp_path), export_dtype="fp32", **FAST)
    trainer.train_step()
    exported = _export_tensors(trainer.export())
    assert trainer.stop()["checkpoint"].endswith("step_00000001")
    before = sorted(os.listdir(tmp_path)), os.path.getmtime(trainer._log_path())
    assert trainer.train_step() is None
    for call in (trainer.export, trainer.validate, trainer.step, trainer.save_checkpoint, trainer.weights):
        with pytest.raises(ConfigError, match=r"^this LLMQTrainer.s run has ended .*out_dir=.*: make a new "
                                              r"LLMQTrainer, with resume=True to go on from its last checkpoint\.$"):
            call()
    assert (sorted(os.listdir(tmp_path)), os.path.getmtime(trainer._log_path())) == before
    again = _export_tensors(os.path.join(str(tmp_path), "export"))
    assert again.keys() == exported.keys() and all(torch.equal(again[k], exported[k]) for k in again)


def test_fit_inside_a_ray_task(ray_cluster, shards, tmp_path):
    """LLMQTrainer.fit() called from a task of another Ray program joins that cluster, returns a Result,
    and leaves the cluster running. (This run reads its shards through Ray Data, the default path.)"""
    ray = ray_cluster
    train, evalf, _ = shards

    @ray.remote(num_cpus=0)
    def user_program(out):
        from llmq_ray.train.trainer import LLMQTrainer

        result = LLMQTrainer(model="tiny", train_file=train, eval_file=evalf, steps=3, batch_size=2, seq_len=16,
                             device="cpu", workers=1, out_dir=out, collective_timeout_s=60.0,
                             call_timeout_s=120.0, verbose=False).fit()
        return result, ray.is_initialized()

    result, still_up = ray.get(user_program.remote(str(tmp_path / "nested")), timeout=150)
    assert isinstance(result, Result) and still_up
    assert result.metrics["steps"] == 3 and len(result.history) == 3
    assert np.isfinite(result.metrics["eval_loss"])
    assert os.path.isfile(os.path.join(result.export_path, "config.json"))
    kinds = {rec["log"] for rec in read_log(result.log_file)}
    assert {"options", "gpu", "sol", "dataset", "allocator", "step", "eval"} <= kinds
    assert ray.is_initialized() and ray.get(ray.put(7), timeout=10) == 7  # the caller's cluster is intact


def _metrics_text(ray) -> str:
    port = next(n["MetricsExportPort"] for n in ray.nodes() if n["Alive"])
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def test_worker_metrics_visible_while_running(ray_cluster, shards, tmp_path):
    """Workers publish ray.util.metrics; the node's metrics endpoint (what the dashboard scrapes) shows
    rank 1's tokens/s while the run is still in progress (between two step-level calls)."""
    ray = ray_cluster
    train, evalf, _ = shards
    with LLMQTrainer(model="tiny", train_file=train, steps=10, batch_size=2, seq_len=16, device="cpu", workers=2,
                     out_dir=str(tmp_path), export=False, **FAST) as t:
        rec = t.train_step()
        assert np.isfinite(rec["loss"]) and rec["worker_seconds"] > 0
        found = None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and found is None:
            t.train_step()
            for line in _metrics_text(ray).splitlines():
                if line.startswith("ray_llmq_worker_tokens_per_second{") and 'rank="1"' in line:
                    found = float(line.rsplit(" ", 1)[1])
            time.sleep(0.5)
        assert found is not None and found > 0, "worker metric never reached the metrics endpoint"
        # the run goes on after the metric was read: step-level calls still work; update() with no step() before
        # it is the caller's mistake, one ConfigError (it was a WorkerError around a RuntimeError)
        with pytest.raises(ConfigError, match=r"^update\(\) before any step\(\): call step\(\)"):
            t.update()
        t.step()
        stats = t.update(lr=1e-3)
        assert stats["lr"] == 1e-3 and np.isfinite(stats["norm"])
        w = t.weights()
        assert w.dtype == torch.float32 and torch.isfinite(w).all()


def test_worker_that_raises_names_its_rank(ray_cluster, shards, tmp_path):
    """Rank 1 raises at step 2 while rank 0 waits in a collective: the error names rank 1 and the cause,
    and it comes back fast (rank 0 is not waited for)."""
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 1 .*injected fault at step 2"):
        _run(shards, tmp_path, workers=2, steps=5, fault={"rank": 1, "step": 2}, max_restarts=0)
    assert time.monotonic() - t0 < 60


def test_bad_inputs_end_in_one_sentence(ray_cluster, shards, tmp_path, monkeypatch):
    train, _, folder = shards
    with pytest.raises(DataError, match="nothing-here"):
        LLMQTrainer(model="tiny", train_file=str(folder / "nothing-here-*.bin"), device="cpu", **FAST)
    with pytest.raises(ConfigError, match=r"^warmup must be an integer in \[0, steps\)"):
        LLMQTrainer(model="tiny", train_file=train, steps=2, warmup=2, **FAST)  # refused before any actor starts
    with pytest.raises(ConfigError, match="^lmhead_chunks=3 must divide"):
        LLMQTrainer(model="tiny", train_file=train, batch_size=2, seq_len=16, lmhead_chunks=3, **FAST)
    for bad in (0, -5.0, float("nan")):
        with pytest.raises(ConfigError, match=rf"^step_timeout_s={bad!r} must be a number > 0 \(seconds"):
            LLMQTrainer(model="tiny", train_file=train, step_timeout_s=bad, **FAST)
    with pytest.raises(ConfigError, match=r"^step_timeout_s='60' must be a number, not str\.$"):
        LLMQTrainer(model="tiny", train_file=train, step_timeout_s="60", **FAST)
    with pytest.raises(CheckpointError, match=r"^resume: no valid checkpoint in .*nowhere"):
        LLMQTrainer(model="tiny", train_file=train, resume=True, checkpoint_dir=str(tmp_path / "nowhere"), **FAST)
    with pytest.raises(ConfigError, match="no GPUs"):
        LLMQTrainer(model="tiny", train_file=train, device="cuda", gpus=2, **FAST).start()
    with pytest.raises(ConfigError, match="needs 64 CPUs"):
        LLMQTrainer(model="tiny", train_file=train, device="cpu", workers=64, **FAST).start()
    # more GPUs asked for than the cluster has (the cluster's resources faked)
    import ray

    from llmq_ray.actors.placement import check_resources
    from _helpers import make_plan

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"GPU": 2.0, "CPU": 32.0})
    with pytest.raises(ConfigError, match=r"--gpus=4 asks for more GPUs than the Ray cluster has \(2\)"):
        check_resources(make_plan(device="cuda", world_size=4))
    # workers that take every CPU while Ray Data reads the train file: its read tasks would never get a CPU and
    # the run would hang at its first batch -- refused; with --no-ray-data or random tokens, or one CPU spare, fine
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"GPU": 2.0, "CPU": 16.0})
    taking_all = dict(device="cuda", world_size=2, cpus_per_worker=8, train_file=train)
    with pytest.raises(ConfigError, match=r"^--gpus=2 with --cpus-per-worker=8 takes all 16 CPUs of the Ray cluster "
                                          r"and leaves none for the Ray Data tasks"):
        check_resources(make_plan(**taking_all))
    for fine in (dict(use_ray_data=False), dict(synthetic_data=True, train_file=None), dict(cpus_per_worker=7)):
        check_resources(make_plan(**{**taking_all, **fine}))
    monkeypatch.undo()
    # the same through the trainer on the test session's cluster (4 CPUs): refused before any actor starts, in
    # the keyword arguments' names
    with pytest.raises(ConfigError, match=r"^workers=2 with cpus_per_worker=2 takes all 4 CPUs of the Ray cluster "
                                          r"and leaves none for the Ray Data tasks .*use_ray_data=False\.$"):
        LLMQTrainer(model="tiny", train_file=train, device="cpu", workers=2, cpus_per_worker=2,
                    **{**FAST, "use_ray_data": True}).start()


def test_workers_taking_every_free_cpu_get_a_warning(monkeypatch):
    """Other jobs hold all but the workers' CPUs: Ray Data's read tasks would wait for one, so the run says so
    in one warning sentence (not an error: placement waits for room the same way). The cluster is faked; Ray's
    lagging view is looked at again for settle_s (0 here)."""
    import ray

    from llmq_ray.actors.placement import data_cpu_warning
    from _helpers import make_plan

    free = {"CPU": 2.0}
    monkeypatch.setattr(ray, "available_resources", lambda: dict(free))
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0})
    spec = dict(device="cpu", world_size=2, cpus_per_worker=1, train_file="x.bin")
    warning = data_cpu_warning(make_plan(**spec), settle_s=0.0)
    assert warning.startswith("warning: the workers take 2 CPU(s) and 2 of the cluster's 16 are free now") \
        and "Ray Data" in warning and warning.count(".") == 1 and warning.endswith("read in the workers).")
    assert data_cpu_warning(make_plan(**spec, use_ray_data=False), settle_s=0.0) is None
    free["CPU"] = 3.0
    assert data_cpu_warning(make_plan(**spec), settle_s=0.0) is None


def test_gpu_workers_default_cpus_count_the_free_cpus():
    """A GPU worker's default CPU reservation comes from the CPUs free when the run starts, not the cluster's
    total: a second run on a cluster whose first run holds 8 of 16 CPUs takes 7 (one left for its Ray Data
    tasks), where the total would have given it 8 and left none for either run's data tasks (both hung at
    their first batch on 2x H200 on 2026-11-27). The cluster is faked: this machine has no GPU."""
    class Cluster:
        cluster_resources = staticmethod(lambda: {"GPU": 2.0, "CPU": 16.0})
        available_resources = staticmethod(lambda: {"GPU": 1.0, "CPU": free})

    with socket.socket() as head:  # a cluster elsewhere (no local GPU needed) that answers; nothing joins it
        head.bind(("127.0.0.1", 0))
        head.listen()
        trainer = LLMQTrainer(model="tiny", device="cuda", gpus=1, backend="torch", synthetic_data=True,
                              verbose=False, ray_address=f"127.0.0.1:{head.getsockname()[1]}")
    for free, want in ((16.0, 8), (8.0, 7), (1.0, 1)):
        assert trainer._build_plan(Cluster).settings.parallel.cpus_per_worker == want, free


def test_setup_error_in_worker_names_rank(ray_cluster, shards, tmp_path, monkeypatch):
    """A user error raised inside the workers keeps its type and gets the rank in front (a shard whose ids
    exceed the model's vocabulary: tiny-llama has 512 tokens, this shard claims ids up to 999). The driver's
    pre-flight catches this shard first; with the pre-flight's data check switched off, the workers do."""
    from llmq_ray.data_pipeline.shards import write_shard

    bad = tmp_path / "big-vocab.bin"
    write_shard(str(bad), np.arange(600, dtype=np.int32) + 399, 1000)
    with pytest.raises(DataError, match=r"^/.*big-vocab\.bin: token id 512 at token index 113"):
        _run((str(bad), None, tmp_path), tmp_path / "o", workers=1, steps=2, warmup=0, eval_file=None)
    monkeypatch.setattr(LLMQTrainer, "_check_data", lambda self: None)
    with pytest.raises(DataError, match=r"^rank \d: .*big-vocab\.bin"):
        _run((str(bad), None, tmp_path), tmp_path / "o", workers=1, steps=2, warmup=0, eval_file=None)


def test_live_wandb_offline_and_memory_table_through_the_trainer(ray_cluster, shards, tmp_path, monkeypatch):
    """--wandb-project logs the run live from the coordinator (WANDB_MODE=offline: a local run folder whose
    .wandb file holds our keys), every worker's measured memory table lands in the log, and the FP8 monitor
    (--fp8-monitor-every 2, e4m3, 2 ranks) logs once, at the second step, one positive maximum per layer (the
    merge over ranks: tests/test_observability.py::test_fp8_monitors_of_the_ranks_merge_with_nan_winning)."""
    train, evalf, _ = shards
    monkeypatch.setenv("WANDB_MODE", "offline")
    from llmq_ray.train.trainer import LLMQTrainer

    out = tmp_path / "wb"
    result = LLMQTrainer(model="tiny", train_file=train, eval_file=evalf, steps=3, batch_size=2, seq_len=16,
                         device="cpu", workers=2, out_dir=str(out), export=False, collective_timeout_s=60.0,
                         call_timeout_s=120.0, verbose=False, wandb_project="llmq-test", wandb_run_name="t",
                         log_gpu_util=1, model_dtype="bf16", matmul_dtype="e4m3", swiglu_fp8_scale="current",
                         fp8_monitor_every=2).fit()
    assert result.metrics["steps"] == 3
    runs = [d for d in os.listdir(out / "wandb") if d.startswith("offline-run-")]
    assert len(runs) == 1
    folder = out / "wandb" / runs[0]
    blob = b"".join(open(folder / f, "rb").read() for f in os.listdir(folder) if f.endswith(".wandb"))
    assert b"train/loss" in blob and b"eval/final_loss" in blob and b"fp8/swiglu_absmax/max" in blob
    (monitor,) = [rec for rec in read_log(result.log_file) if rec["log"] == "fp8_monitor"]
    layers = len(monitor["swiglu_absmax"])
    assert monitor["step"] == 2 and layers > 1 and all(v > 0 for v in monitor["swiglu_absmax"])
    assert monitor["max"] == max(monitor["swiglu_absmax"]) == monitor["swiglu_absmax"][monitor["max_layer"]]
    assert "saturated_share" not in monitor  # current scales: nothing clipped, nothing counted
    allocators = [rec for rec in read_log(result.log_file) if rec["log"] == "allocator"]
    assert sorted(r["rank"] for r in allocators) == [0, 1]
    assert all(r["weights"] > 0 and r["activations"] > 0 for r in allocators)


def test_eval_progress_bar_follows_the_workers(ray_cluster, shards, tmp_path, monkeypatch):
    """On a terminal, fit() draws an eval bar over the eval batches while the workers evaluate -- the
    periodic eval inside a train step (10 batches) and the final eval (37 batches: 74 windows of 17 in
    eval.bin, B=2) -- from rank 0's progress, polled through the coordinator, and erases it afterwards.
    Rank 0 sleeps 0.1 s per eval batch (test hook) so that the polls see the evals running."""
    from _helpers import FakeTTY

    monkeypatch.delenv("LLMQ_NO_PROGRESS", raising=False)
    tty = FakeTTY()
    monkeypatch.setattr("sys.stdout", tty)
    res = _run(shards, tmp_path, workers=1, steps=3, eval_every_n_steps=2, eval_num_steps=10, export=False,
               verbose=True, fault={"kind": "slow_eval", "rank": 0, "step": -1, "seconds": 0.1})
    assert [e["batches"] for e in res.evals] == [10, 37]
    out = tty.getvalue()
    periodic = re.findall(r"\reval \[[#-]+\] +(\d+)/10 ", out)
    final = re.findall(r"\rfinal eval \[[#-]+\] +(\d+)/37 ", out)
    assert periodic and final, out
    assert [int(n) for n in final] == sorted(int(n) for n in final) and int(final[-1]) > int(final[0])
    tail = out.rsplit("final eval [", 1)[1]
    assert re.match(r"[^\r\n]*\r +\r", tail)  # erased, not left on screen
    assert "[V]" in out and "train [" in out


