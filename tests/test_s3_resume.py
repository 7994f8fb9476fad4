"""Checkpoints on an object store (a real S3 server: moto's server mode on a random local port, the ``s3``
fixture of conftest.py), uploaded in the background (llmq_ray/checkpoints/remote.py):

* the step after a save does not wait for a slow upload (the test hook delays the upload thread); a checkpoint
  due while it runs is deferred with a warning, and no step waits for the network;
* a failed upload leaves the previous checkpoint the newest valid one, says so in one warning, removes the
  staged copy and the step's prefix, and the run goes on (the next checkpoint is published);
* acceptance: a 2-worker CLI run reading its tokens from s3:// and checkpointing to s3:// every 2 steps is
  SIGKILLed (its whole process group: driver, Ray and workers) while its second checkpoint is being uploaded
  (rank 0's shard of step 4 is in the bucket, rank 1's upload is held back by the test hook), after its first
  was published; ``--continue`` from the store on 1 worker skips the half-uploaded step 4 with a warning and
  finishes with per-step losses bit-identical to the same resume (1 worker, from step 2) of a 2-worker run
  checkpointing to local disk;
* a partly uploaded checkpoint (objects without a manifest; a manifest whose files are not all there) is
  skipped on resume with a warning, and the resume takes the step before.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from _helpers import faulty_trainer, trainer_from_cli

from llmq_ray import storage
from llmq_ray.observe.runlog import read_log

pytest.importorskip("moto.server", reason="the object-store tests need moto[server] (dev extra)")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = dict(collective_timeout_s=15.0, call_timeout_s=60.0, use_ray_data=False, verbose=False)
BASE = dict(model="tiny", batch_size=2, seq_len=16, learning_rate=3e-3, warmup=2, device="cpu", backend="torch",
            model_dtype="fp32", final_eval=False, export=False, ckpt_interval=2, **FAST)


def _records(log_file: str, kind: str) -> list[dict]:
    return [r for r in read_log(log_file) if r.get("log") == kind]


def _put(fs, key: str, data: bytes) -> None:
    with fs.open_output_stream(f"bucket/{key}") as f:
        f.write(data)


def _names(uri: str) -> list[str]:
    return [n for n in storage.list_names(uri) if n.startswith("step_")]


# ---------------------------------------------------------------------------------------------------- background
def test_the_step_after_a_save_does_not_wait_for_a_slow_upload(s3, ray_cluster, shards, tmp_path, monkeypatch):
    from llmq_ray.train.trainer import LLMQTrainer

    monkeypatch.chdir(tmp_path)
    # the upload of rank 1's shard of every checkpoint from step 2 on sleeps 6 s (a slow network): long beside the
    # steps even on a loaded machine (a step took 1.5 s there), so the order of the log's records shows what waited
    delay, store = 6.0, "s3://bucket/bg/slow"
    res = faulty_trainer(**BASE, workers=2, steps=5, train_file=shards.train, out_dir=str(tmp_path / "out"),
                      checkpoint_dir=store, fault={"kind": "upload_slow", "rank": 1, "step": 2, "seconds": delay}).fit()
    steps = {r["step"]: r for r in _records(res.log_file, "step")}
    assert sorted(steps) == [1, 2, 3, 4, 5]
    published = {r["step"]: r for r in _records(res.log_file, "checkpoint")}
    assert published[2]["background"] and published[2]["upload_seconds"] > delay * 0.8
    # the checkpoint of step 2 is staged after step 2 (a host copy, far quicker than its upload); steps 3 and 4 run
    # while rank 1 is still uploading: both are logged before that checkpoint is published (no wall-clock bound)
    staged = {r["step"]: r for r in _records(res.log_file, "checkpoint_staged")}
    assert 2 in staged and all(r["seconds"] < published[2]["upload_seconds"] / 2 for r in staged.values())
    log = read_log(res.log_file)
    order = [(r.get("log"), r.get("step")) for r in log]
    assert order.index(("checkpoint", 2)) > order.index(("step", 4))  # counted only once published
    # the checkpoint of step 4 was due while step 2's upload still ran: the steps did not wait for the network;
    # it was deferred (one warning) and taken at the first step boundary after that upload was published
    assert [r["reason"] for r in _records(res.log_file, "upload_wait")] in ([], ["at the end of the run"])
    assert steps[5]["seconds"] < published[2]["upload_seconds"] / 2
    (deferred,) = [r for r in _records(res.log_file, "warning") if r["kind"] == "checkpoint_deferred"]
    assert deferred["step"] == 4 and deferred["upload_step"] == 2
    assert deferred["message"].startswith(f"checkpoint of step 4 deferred: the upload of step 2 to {store} is "
                                          f"still running")
    assert sorted(published) in ([2, 5], [2, 4, 5])  # step 5 at the latest: the end of the run takes one
    assert storage.size_of(f"{store}/step_00000005/manifest.json") is not None
    assert res.metrics["warnings"] == 1


@pytest.fixture(scope="module")
def failed_upload(s3, ray_cluster, shards, tmp_path_factory):
    """(Result, store) of a 2-worker run of 10 steps checkpointing every 2 steps whose first upload of a
    checkpoint from step 4 on fails."""
    from llmq_ray.train.trainer import LLMQTrainer

    out, store = tmp_path_factory.mktemp("fail"), "s3://bucket/bg/fail"
    cwd = os.getcwd()
    os.chdir(out)
    try:
        res = faulty_trainer(**BASE, workers=2, steps=10, train_file=shards.train, out_dir=str(out / "out"),
                          checkpoint_dir=store,
                          # 0.2 s steps: step 2's upload is done before step 4's checkpoint is due
                          fault=[{"kind": "upload_fail", "rank": 0, "step": 4},
                                 {"kind": "slow_step", "rank": 0, "step": 0, "seconds": 0.2}]).fit()
    finally:
        os.chdir(cwd)
    return res, store


def test_a_failed_upload_leaves_the_previous_checkpoint_valid(failed_upload):
    from llmq_ray.checkpoints.remote import mirror_root
    from llmq_ray.checkpoints.verify import resolve_continue

    res, store = failed_upload
    assert [r["step"] for r in res.history] == list(range(1, 11))  # the run went on
    warns = [r for r in _records(res.log_file, "warning") if r["kind"] == "checkpoint_upload"]
    # the first checkpoint from step 4 on (4, or later when step 4's was deferred behind step 2's upload)
    assert len(warns) == 1 and 4 <= warns[0]["step"] < 10
    msg, bad = warns[0]["message"], warns[0]["step"]
    assert msg.startswith(f"checkpoint of step {bad} could not be uploaded to {store}/step_{bad:08d}: AWS Error "
                          f"NO_SUCH_BUCKET") and msg.endswith(
        "; the previous checkpoint step_00000002 stays the newest valid one."), msg
    assert msg.count(". ") == 0  # one sentence
    published = sorted(r["step"] for r in _records(res.log_file, "checkpoint"))
    assert bad not in published and 2 in published and max(published) == 10  # a later checkpoint succeeded
    assert f"step_{bad:08d}" not in _names(store)  # the ranks' uploaded objects of that step were removed
    staging = mirror_root(store)  # the staged local copies are gone (staging folders: .step_*.tmp-*)
    leftovers = [os.path.join(d, f) for d, _, fs in os.walk(staging) for f in fs if "/.step_" in d]
    assert leftovers == []
    assert resolve_continue("latest", store).endswith(f"step_{max(published):08d}")


# ---------------------------------------------------------------------------------------------------- acceptance
def _cli_in_its_own_session(args: list[str], cwd, env: dict) -> subprocess.Popen:
    """``python -m llmq_ray.train.cli ARGS`` in a session of its own: the driver, the Ray it starts
    (RAY_ADDRESS=local: never one of the other Ray instances on this machine; without its dashboard, which is not
    what is tested) and its workers form one process group, which the test kills as a whole."""
    env = {**os.environ, **env, "PYTHONPATH": REPO, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "RAY_ADDRESS": "local"}
    return subprocess.Popen([sys.executable, "-m", "llmq_ray.train.cli", *args, "--no-dashboard"], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def _session_pids(sid: int) -> list[int]:
    """Processes still alive in session ``sid`` (zombies are dead)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # fields: state, ppid, pgrp, session, ...
            out.append(int(name))
    return out


def _step_losses(log_file: str) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in _records(log_file, "step")]


COMMON = ["--device", "cpu", "--model", "tiny", "--backend", "torch", "--model-dtype", "fp32", "--batch-size", "2",
          "--seq-len", "16", "--steps", "10", "--learning-rate", "3e-3", "--warmup", "2", "--eval-every-n-steps", "0",
          "--no-final-eval", "--no-export", "--sample-tokens", "0", "--no-progress", "--ckpt-interval", "2",
          "--ckpt-keep-n", "50", "--collective-timeout-s", "30", "--no-ray-data"]


def test_a_killed_s3_run_resumes_bit_identically_to_the_same_resume_from_local_disk(s3, ray_cluster, shards, tmp_path,
                                                                                    monkeypatch):
    """The acceptance scenario of the module docstring. Over 60 s beside the rest of the suite: the killed run has
    a Ray of its own (the kill takes its whole process group) and its 0.3 s steps leave the kill time to land in
    the second checkpoint's upload; then its resume, the local reference run and that run's resume -- six worker
    processes in all, each run what the bit-for-bit comparison needs."""
    _put(s3, "acc/data/train.bin", open(shards.train, "rb").read())
    store = "s3://bucket/acc/ckpt"
    s3_data = ["--train-file", "s3://bucket/acc/data/train*.bin"]
    # 1. the s3 run, slowed (0.3 s a step, the test hook) so that it is killed mid-run, and rank 1's upload of
    # every checkpoint from step 4 on held back 120 s: it is killed while step 4 is half uploaded
    faults = [{"kind": "slow_step", "rank": 0, "step": 0, "seconds": 0.3},
              {"kind": "upload_slow", "rank": 1, "step": 4, "seconds": 120.0}]
    proc = _cli_in_its_own_session(COMMON + s3_data + ["--workers", "2", "--checkpoint-dir", store, "--out-dir",
                                                       str(tmp_path / "a")],
                                   tmp_path, {"LLMQ_RAY_TEST_FAULT": json.dumps(faults)})
    try:
        deadline = time.monotonic() + 480  # a guard against a hang: with a second suite beside it 180 s were too few
        while (storage.size_of(f"{store}/step_00000002/manifest.json") is None
               or storage.size_of(f"{store}/step_00000004/rank_00000.safetensors") is None):
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint was published and half uploaded within 480 s"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver, its Ray (GCS, raylet, ...) and the workers
        proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while _session_pids(proc.pid) and time.monotonic() < deadline:
            for pid in _session_pids(proc.pid):  # a Ray process that moved to a process group of its own
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    assert _session_pids(proc.pid) == []  # nothing of the killed run's Ray is left running
    done = [r["step"] for r in _records(str(tmp_path / "a" / "log.jsonl"), "step")]
    assert 4 <= len(done) < 10, done  # killed mid-run, during the upload of the second checkpoint
    assert storage.size_of(f"{store}/step_00000004/manifest.json") is None  # step 4: rank 0's shard, no manifest

    # 2. --continue from the store, on 1 worker (the command line's run, on the session's Ray from here on)
    monkeypatch.chdir(tmp_path)
    trainer_from_cli(COMMON + s3_data + ["--workers", "1", "--checkpoint-dir", store, "--continue", "--out-dir",
                                        str(tmp_path / "b")]).fit()
    log_b = str(tmp_path / "b" / "log.jsonl")
    (resume,) = _records(log_b, "resume")
    k = resume["step"]
    assert k == 2 and resume["saved_world_size"] == 2 and resume["path"] == f"{store}/step_00000002"
    skipped = [r["message"] for r in _records(log_b, "warning") if r["kind"] == "checkpoint"]
    assert any("step_00000004" in m and "no manifest.json" in m for m in skipped), skipped
    s3_losses = _step_losses(log_b)
    assert [s for s, _ in s3_losses] == list(range(k + 1, 11))

    # 3. the reference: the same 2-worker run on local disk, then the same resume from its step_K
    local = tmp_path / "ckpt_local"
    trainer_from_cli(COMMON + ["--train-file", shards.train, "--workers", "2", "--checkpoint-dir", str(local),
                               "--out-dir", str(tmp_path / "c")]).fit()
    trainer_from_cli(COMMON + ["--train-file", shards.train, "--workers", "1", "--checkpoint-dir",
                               str(tmp_path / "ckpt_d"), "--continue", str(local / f"step_{k:08d}"),
                               "--out-dir", str(tmp_path / "d")]).fit()
    assert _step_losses(str(tmp_path / "d" / "log.jsonl")) == s3_losses  # bit for bit


def test_a_partly_uploaded_checkpoint_is_skipped_on_resume(s3, failed_upload, shards, tmp_path, monkeypatch):
    from llmq_ray.train.trainer import LLMQTrainer

    monkeypatch.chdir(tmp_path)
    _, store = failed_upload  # its checkpoints: step 2 (kept by retention or not) and step 10, the newest
    key = store[len("s3://bucket/"):]
    assert _names(store)[-1] == "step_00000010"
    six = f"{store}/step_00000010"
    rank0 = s3.open_input_stream(f"bucket/{key}/step_00000010/rank_00000.safetensors").read()
    # killed during the upload: the ranks' objects of step 8 but no manifest
    _put(s3, f"{key}/step_00000012/rank_00000.safetensors", rank0)
    _put(s3, f"{key}/step_00000012/rank_00001.safetensors", b"cut short")
    # and a step 10 whose manifest is there but not all its files
    manifest = json.loads(s3.open_input_stream(f"bucket/{key}/step_00000010/manifest.json").read())
    _put(s3, f"{key}/step_00000014/rank_00000.safetensors", rank0)
    _put(s3, f"{key}/step_00000014/manifest.json", json.dumps({**manifest, "step": 14}).encode())
    res = LLMQTrainer(**BASE, workers=1, steps=12, train_file=shards.train, out_dir=str(tmp_path / "b"),
                      checkpoint_dir=store, resume=True).fit()
    (resume,) = _records(res.log_file, "resume")
    assert resume["step"] == 10 and resume["path"] == six
    assert [r["step"] for r in res.history] == [11, 12]
    skipped = [r["message"] for r in _records(res.log_file, "warning") if r["kind"] == "checkpoint"]
    assert any("step_00000014" in m and "rank_00001.safetensors" in m for m in skipped), skipped
    assert any("step_00000012" in m and "no manifest.json" in m for m in skipped), skipped


def test_a_host_snapshot_keeps_the_state_of_its_step_and_reuses_its_buffers():
    """The synchronous part of a background checkpoint: copies of the state that later updates do not change,
    in the same buffers every time (no allocation per checkpoint)."""
    import torch

    from llmq_ray.checkpoints.remote import HostSnapshot

    state = {"master": torch.arange(6, dtype=torch.float32), "m": torch.ones(6), "v": torch.zeros(6, dtype=torch.bfloat16)}
    snap = HostSnapshot()
    snap.reserve(state)  # at set-up
    reserved = {k: snap._buffers[k].data_ptr() for k in state}
    first = snap.take(state)
    assert {k: first[k].data_ptr() for k in state} == reserved
    state["master"].add_(100.0)  # the next update
    assert torch.equal(first["master"], torch.arange(6, dtype=torch.float32)) and first["v"].dtype == torch.bfloat16
    second = snap.take(state)
    assert all(second[k].data_ptr() == first[k].data_ptr() for k in state)
    assert torch.equal(second["master"], torch.arange(6, dtype=torch.float32) + 100.0)


def test_workers_of_one_node_fetching_the_same_checkpoint_do_not_pull_it_from_under_each_other(tmp_path,
                                                                                                monkeypatch):
    """Every rank of a node restores from the same checkpoint, each calling ``remote.fetch`` into the node's
    mirror. The first copies it; one that comes while a copy is under way waits for it (a file lock per step), and
    one that finds a current copy returns it untouched -- an earlier version removed the local manifest to
    refetch, and a rank already loading found "has no manifest.json" (seen in the elastic tensor-parallel
    cluster test under load). Without a server: the store's download is replaced by a slow local write."""
    import threading

    from llmq_ray.checkpoints import remote

    monkeypatch.setenv("LLMQ_RAY_CACHE", str(tmp_path / "cache"))
    files = [{"name": f"rank_{r:05d}.safetensors", "size": 64 + r} for r in range(2)]
    manifest = {"step": 4, "files": files}
    sizes = {f["name"]: f["size"] for f in files}  # what the store holds
    downloads = []

    def slow_download(uri, local):  # the bytes of the right size, slowly, through a temporary name
        downloads.append(uri)
        time.sleep(0.2)
        size = sizes[uri.rsplit("/", 1)[1]]
        with open(local + ".part", "wb") as f:
            f.write(b"x" * size)
        os.replace(local + ".part", local)

    monkeypatch.setattr(storage, "download", slow_download)
    uri = "s3://bucket/run/ckpt/step_00000004"
    folders, manifests_seen, errors = [], [], []

    def rank():
        try:
            folder = remote.fetch(uri, manifest)
            folders.append(folder)
            for _ in range(40):  # "loading": the manifest must stay there
                with open(os.path.join(folder, "manifest.json")) as f:
                    manifests_seen.append(json.load(f)["step"])
                time.sleep(0.01)
        except Exception as exc:  # noqa: BLE001 -- reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank) for _ in range(3)]
    for i, t in enumerate(threads):
        t.start()
        time.sleep(0.15 * i)  # the second comes during the first's copy, the third after it
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(set(folders)) == 1 and len(manifests_seen) == 3 * 40 and set(manifests_seen) == {4}
    assert len(downloads) == 2  # each file once: the later ranks found the copy current
    # a stale copy of the same step (the store's manifest changed) is fetched again
    manifest2 = {"step": 4, "files": [dict(files[0], size=80), files[1]]}
    sizes[files[0]["name"]] = 80
    assert remote.fetch(uri, manifest2) == folders[0]
    assert len(downloads) == 3 and os.path.getsize(os.path.join(folders[0], files[0]["name"])) == 80
