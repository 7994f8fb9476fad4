"""Paths and URIs through llmq_ray/storage.py, against a real S3 server (moto's server mode) on 127.0.0.1:
token shards on s3:// are listed, fetched once per node into the cache and train exactly as local files do;
an unknown scheme or an unreachable endpoint ends in one sentence before training, and no URI ever becomes a
local folder; the driver's credentials and endpoints reach every worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from _helpers import faulty_trainer, trainer_from_cli

from llmq_ray import storage
from llmq_ray.errors import ConfigError, DataError

pytest.importorskip("moto.server", reason="the object-store tests need moto[server] (dev extra)")
# the ``s3`` fixture (a moto S3 server with the bucket "bucket") is in conftest.py, shared with test_s3_resume.py

from llmq_ray.actors.collectives import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _put(fs, key: str, data: bytes) -> None:
    with fs.open_output_stream(f"bucket/{key}") as f:
        f.write(data)


def test_globs_on_s3_list_sorted_and_fetch_once(s3, tmp_path):
    from llmq_ray.data_pipeline.sources import resolve_files

    blobs = {f"g/train-00{i}.bin": bytes([i]) * (100 + i) for i in (2, 0, 1)}
    blobs.update({"g/eval.bin": b"e" * 10, "g/sub/train-009.bin": b"s" * 7, "g/train-003.txt": b"no"})
    for key, data in blobs.items():
        _put(s3, key, data)
    assert storage.glob("s3://bucket/g/train-*.bin") == [f"s3://bucket/g/train-00{i}.bin" for i in (0, 1, 2)]
    assert storage.glob("s3://bucket/g/**/*.bin") == sorted(
        f"s3://bucket/{k}" for k in blobs if k.endswith(".bin"))
    assert storage.glob("s3://bucket/g/eval.bin") == ["s3://bucket/g/eval.bin"]
    assert storage.glob("s3://bucket/g/nothing-*.bin") == []
    local = resolve_files("s3://bucket/g/train-*.bin")
    assert [open(p, "rb").read() for p in local] == [blobs[f"g/train-00{i}.bin"] for i in (0, 1, 2)]
    assert all(p.startswith(os.environ["LLMQ_RAY_CACHE"]) for p in local)
    stamps = [os.stat(p).st_mtime_ns for p in local]
    assert resolve_files("s3://bucket/g/train-*.bin") == local  # the cache is reused, not downloaded again
    assert [os.stat(p).st_mtime_ns for p in local] == stamps
    _put(s3, "g/train-001.bin", b"new" * 50)  # the object changes: a new copy
    again = resolve_files("s3://bucket/g/train-*.bin")
    assert open(again[1], "rb").read() == b"new" * 50 and again[0] == local[0]
    with pytest.raises(DataError, match=r"^'s3://bucket/g/none-\*.bin' matched no token files"):
        resolve_files("s3://bucket/g/none-*.bin")
    # file:// is a local path
    (tmp_path / "a.bin").write_bytes(b"x")
    assert storage.glob(f"file://{tmp_path}/*.bin") == [str(tmp_path / "a.bin")]


def _losses(log: str) -> list[float]:
    return [json.loads(line)["loss"] for line in open(log) if '"log": "step"' in line]


def _cli(args: list[str], cwd, env=None, timeout=240) -> subprocess.CompletedProcess:
    # RAY_ADDRESS=local: a Ray of its own, never another Ray instance running on this machine
    env = {**os.environ, **(env or {}), "PYTHONPATH": REPO, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "RAY_ADDRESS": "local"}
    return subprocess.run([sys.executable, os.path.join(REPO, "examples", "train.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_a_run_on_s3_shards_trains_exactly_as_on_local_ones(s3, ray_cluster, shards, tmp_path, monkeypatch):
    """Two CPU workers read train/eval shards from s3:// and give the per-step losses of the same run on the
    local files, bit for bit (the workers get the endpoint and credentials from the driver's environment). The
    s3 run is the command (its own Ray); the local one the same arguments on the test session's Ray."""
    _put(s3, "run/train.bin", open(shards.train, "rb").read())
    _put(s3, "run/eval.bin", open(shards.eval, "rb").read())
    common = ["--device", "cpu", "--workers", "2", "--model", "tiny", "--backend", "torch", "--batch-size", "2",
              "--seq-len", "16", "--steps", "4", "--eval-every-n-steps", "0", "--no-export", "--sample-tokens", "0",
              "--no-progress"]
    p = _cli(common + ["--train-file", "s3://bucket/run/train*.bin", "--eval-file", "s3://bucket/run/eval.bin",
                       "--out-dir", str(tmp_path / "s3"), "--no-dashboard"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    monkeypatch.chdir(tmp_path)
    local = common + ["--train-file", shards.train, "--eval-file", shards.eval, "--out-dir", str(tmp_path / "local")]
    trainer_from_cli(local).fit()
    runs = {name: _losses(str(tmp_path / name / "log.jsonl")) for name in ("local", "s3")}
    assert len(runs["local"]) == 4 and runs["s3"] == runs["local"]


def test_unknown_schemes_and_unreachable_stores_end_in_one_sentence_before_training(s3, tmp_path, monkeypatch):
    from llmq_ray.train.trainer import LLMQTrainer

    monkeypatch.chdir(tmp_path)
    base = dict(device="cpu", model="tiny", synthetic_data=True, out_dir=str(tmp_path / "out"), verbose=False)
    for kw, flag in ((dict(checkpoint_dir="nosuch://x"), "checkpoint_dir"), (dict(out_dir="nosuch://x/o"), "out_dir"),
                     (dict(log_file="nosuch://x/log.jsonl"), "log_file")):
        with pytest.raises(ConfigError, match=rf"^{flag}='nosuch://.*': no filesystem handles nosuch://"):
            LLMQTrainer(**{**base, **kw})
    with pytest.raises(ConfigError, match=r"^train_file='nosuch://x/\*.bin': no filesystem handles nosuch://"):
        LLMQTrainer(**{**base, "synthetic_data": False, "train_file": "nosuch://x/*.bin"})
    LLMQTrainer(**{**base, "out_dir": "s3://bucket/out"})  # outputs on a store are fine (tests/test_store_outputs.py)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port('127.0.0.1')}")  # nothing listens there
    with pytest.raises(ConfigError, match=r"^train_file='s3://bucket/run/\*.bin': cannot reach it .*(connect|Connect)"):
        LLMQTrainer(**{**base, "synthetic_data": False, "train_file": "s3://bucket/run/*.bin"})
    assert not any(n.startswith(("nosuch", "s3:")) for n in os.listdir(tmp_path))  # no folder named after a URI
    p = _cli(["--device", "cpu", "--synthetic-data", "--checkpoint-dir", "nosuch://x"], tmp_path)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "error: --checkpoint-dir='nosuch://x': no filesystem handles nosuch:// (pyarrow knows file, s3, gs and "
        "hdfs; other schemes need fsspec and its nosuch package installed)."]
    assert not any(n.startswith(("nosuch", "s3:")) for n in os.listdir(tmp_path))


def test_the_drivers_environment_reaches_the_workers(monkeypatch):
    from llmq_ray.actors.worker import worker_env
    from llmq_ray.train.trainer import forwarded_env

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://s3.internal:9000")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth1")
    monkeypatch.setenv("MY_TOKEN", "secret")
    monkeypatch.setenv("UNRELATED", "x")
    env = forwarded_env("MY_TOKEN")
    assert env["AWS_ENDPOINT_URL"] == "http://s3.internal:9000" and env["NCCL_SOCKET_IFNAME"] == "eth1"
    assert env["MY_TOKEN"] == "secret" and "UNRELATED" not in env
    for k, v in env.items():  # the coordinator's environment ...
        monkeypatch.setenv(k, v)
    w = worker_env(2)  # ... is passed on to each worker, the user's NCCL setting included
    assert w["AWS_ENDPOINT_URL"] == "http://s3.internal:9000" and w["MY_TOKEN"] == "secret"
    assert w["NCCL_SOCKET_IFNAME"] == "eth1" and w["OMP_NUM_THREADS"] == "2" and "UNRELATED" not in w


def test_only_what_a_process_needs_at_start_goes_through_rays_runtime_env(monkeypatch, tmp_path):
    """An actor with a runtime_env starts through Ray's setup process (about 0.6 CPU-s more per actor): a CPU
    actor gets one only for the --forward-env names and for PYTHONPATH when llmq-ray is not installed from this
    checkout; everything else is a constructor argument that ``apply_env`` puts into os.environ; a GPU worker
    keeps all of it in its runtime_env (Ray reads RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES before __init__)."""
    from llmq_ray.actors import actor_env
    from llmq_ray.actors.actor_env import PACKAGE_PARENT, actor_options, apply_env, installed_from, start_env

    import site

    site_dir = tmp_path / "site-packages"  # an editable install of tmp_path/checkout, as pip writes it
    info = site_dir / "llmq_ray-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: llmq-ray\nVersion: 0.1.0\n")
    (info / "direct_url.json").write_text(json.dumps({"dir_info": {"editable": True},
                                                      "url": (tmp_path / "checkout").as_uri()}))
    monkeypatch.setattr(site, "getsitepackages", lambda: [str(site_dir)])
    monkeypatch.setattr(site, "getusersitepackages", lambda: str(tmp_path / "user-site"))
    assert installed_from(str(tmp_path / "checkout")) and not installed_from(str(tmp_path))
    assert installed_from(str(site_dir))  # a wheel: the package in site-packages itself
    (info / "direct_url.json").unlink()
    installed_from.cache_clear()
    assert not installed_from(str(tmp_path / "checkout"))
    installed_from.cache_clear()

    env = {"PYTHONPATH": PACKAGE_PARENT, "AWS_SECRET_ACCESS_KEY": "s", "OMP_NUM_THREADS": "2", "LD_LIBRARY_PATH": "/x"}
    monkeypatch.setattr(actor_env, "installed_from", lambda folder: True)  # pip install -e of this checkout
    assert actor_options(env, gpu=False) == {}  # no setup process, no secret in the actor's runtime_env
    assert start_env(env, gpu=False, forward_env=["LD_LIBRARY_PATH", "UNSET"]) == {"LD_LIBRARY_PATH": "/x"}
    assert actor_options(env, gpu=True) == {"runtime_env": {"env_vars": env}}
    monkeypatch.setattr(actor_env, "installed_from", lambda folder: False)  # a source checkout on PYTHONPATH
    assert start_env(env, gpu=False) == {"PYTHONPATH": PACKAGE_PARENT}
    monkeypatch.delenv("LLMQ_TEST_APPLIED", raising=False)
    apply_env({"LLMQ_TEST_APPLIED": "1"})
    assert os.environ.pop("LLMQ_TEST_APPLIED") == "1"
    import llmq_ray

    assert os.path.join(PACKAGE_PARENT, "llmq_ray", "__init__.py") == os.path.abspath(llmq_ray.__file__)


def test_a_nodes_own_cache_folder_wins_over_the_drivers(monkeypatch):
    from llmq_ray.train.trainer import forwarded_env

    monkeypatch.setenv("LLMQ_RAY_CACHE", "/driver/cache")
    env = forwarded_env(None)  # the driver's folder travels as a default, not as the node's own setting
    assert "LLMQ_RAY_CACHE" not in env and env[storage.DRIVER_CACHE_ENV] == "/driver/cache"
    monkeypatch.setenv(storage.DRIVER_CACHE_ENV, "/driver/cache")
    assert storage.cache_root() == "/driver/cache"  # what the driver itself (and a node with none) uses
    monkeypatch.setenv("LLMQ_RAY_CACHE", "/node/nvme/cache")
    assert storage.cache_root() == "/node/nvme/cache"  # a node whose Ray was started with its own
    monkeypatch.delenv("LLMQ_RAY_CACHE")
    monkeypatch.delenv(storage.DRIVER_CACHE_ENV)
    assert storage.cache_root() == os.path.expanduser("~/.cache/llmq_ray")


def test_checkpoints_on_s3_are_written_pruned_and_resumed(s3, ray_cluster, shards, tmp_path, monkeypatch):
    """Two workers checkpoint straight to s3:// (each rank uploads its own shard, the manifest goes last) with
    the same losses as the run checkpointing locally; keep-N and major retention prune the store; a prefix
    whose upload was cut short (no manifest) is skipped with a warning; one worker resumes from the store and
    continues within 1e-5 of the uninterrupted run (another world size: resharded)."""
    import warnings

    import numpy as np

    from llmq_ray.checkpoints.layout import CheckpointWarning
    from llmq_ray.checkpoints.verify import resolve_continue
    from llmq_ray.errors import CheckpointError
    from llmq_ray.train.trainer import LLMQTrainer

    monkeypatch.chdir(tmp_path)
    base = dict(model="tiny", steps=8, batch_size=2, seq_len=16, learning_rate=3e-3, warmup=2, device="cpu",
                final_eval=False, export=False, ckpt_interval=2, ckpt_major=4, collective_timeout_s=15.0,
                call_timeout_s=60.0, use_ray_data=False, verbose=False, train_file=shards.train)
    losses = lambda res: [r["loss"] for r in res.history]  # noqa: E731
    ref = LLMQTrainer(**base, workers=2, out_dir=str(tmp_path / "ref")).fit()
    store_uri = "s3://bucket/ckpts/run1"
    # 0.3 s steps: each background upload ends before the next checkpoint is due (none is deferred), so the
    # checkpoints are those of steps 2, 4, 6, 8 exactly
    a = faulty_trainer(**base, workers=2, out_dir=str(tmp_path / "a"), checkpoint_dir=store_uri,
                    fault={"kind": "slow_step", "rank": 0, "step": 0, "seconds": 0.3}).fit()
    assert losses(a) == losses(ref)
    # steps 2, 4, 6, 8 written; keep the newest 2 (6, 8) and every multiple of 4 (4, 8): step 2 pruned
    assert storage.list_names(store_uri) == ["step_00000004", "step_00000006", "step_00000008"]
    assert storage.list_names(f"{store_uri}/step_00000008") == ["manifest.json", "rank_00000.safetensors",
                                                                  "rank_00001.safetensors"]
    assert sorted(os.listdir(tmp_path / "a")) == ["log.jsonl"]  # nothing local under out-dir, no "s3:" folder
    assert not any(n.startswith("s3:") for n in os.listdir(tmp_path))
    with pytest.raises(CheckpointError, match=r"already holds checkpoints of a run \(newest step_00000008\)"):
        LLMQTrainer(**base, workers=2, out_dir=str(tmp_path / "c"), checkpoint_dir=store_uri)
    storage.write_bytes(f"{store_uri}/step_00000010/rank_00000.safetensors", b"cut short")  # killed mid-upload
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CheckpointWarning)
        assert resolve_continue("latest", store_uri) == f"{store_uri}/step_00000008"
    assert any("step_00000010" in str(w.message) and "no manifest.json" in str(w.message) for w in caught)
    b = LLMQTrainer(**base, workers=1, grad_accumulation=2, out_dir=str(tmp_path / "b"), checkpoint_dir=store_uri,
                    resume=f"{store_uri}/step_00000004").fit()
    assert [r["step"] for r in b.history] == [5, 6, 7, 8]
    np.testing.assert_allclose(losses(b), losses(ref)[4:], rtol=1e-5)


def test_a_tensor_parallel_run_checkpoints_to_s3_and_resumes_on_one_worker_bit_for_bit(s3, ray_cluster, shards,
                                                                                       tmp_path, monkeypatch):
    """--tensor-parallel 2 with checkpoints on s3:// (staged on the node, uploaded in the background): one shard
    file per data-parallel rank (here one, written by tensor-parallel rank 0 of the group), the manifest last;
    the step-4 checkpoint loaded on one worker gives the group's exported weights bit for bit (fp32)."""
    from safetensors.torch import load_file

    from llmq_ray.train.trainer import LLMQTrainer

    monkeypatch.chdir(tmp_path)
    base = dict(model="tiny", steps=4, batch_size=2, seq_len=16, learning_rate=3e-3, warmup=1, device="cpu",
                final_eval=False, export_dtype="fp32", ckpt_interval=2, collective_timeout_s=15.0,
                call_timeout_s=60.0, use_ray_data=False, verbose=False, train_file=shards.train, grad_accumulation=2)
    store_uri = "s3://bucket/ckpts/tp2"
    tp = faulty_trainer(**base, workers=2, tensor_parallel=2, out_dir=str(tmp_path / "tp"), checkpoint_dir=store_uri,
                     fault={"kind": "slow_step", "rank": 0, "step": 0, "seconds": 0.3}).fit()
    assert storage.list_names(store_uri) == ["step_00000002", "step_00000004"]
    assert storage.list_names(f"{store_uri}/step_00000004") == ["manifest.json", "rank_00000.safetensors"]
    one = LLMQTrainer(**base, workers=1, out_dir=str(tmp_path / "one"), resume=f"{store_uri}/step_00000004").fit()
    assert one.history == []
    a, b = (load_file(os.path.join(r.export_path, "model.safetensors")) for r in (tp, one))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
