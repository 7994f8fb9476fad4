"""A run's outputs on an object store (moto's S3 server, the fixture of tests/test_storage.py): ``--out-dir
s3://...`` puts the JSON Lines log (staged on the coordinator's node, uploaded whole at every flush), the HF
export (staged on the exporting worker's node, uploaded with the ``_EXPORT_COMPLETE`` marker last) and the
default checkpoints (``s3://.../ckpt``) on the bucket, and nothing under a local folder named after the URI.
Also: the run's ``run_id`` is a tag of every Ray metric it publishes, and sits in the log's "options" record."""

from __future__ import annotations

import json
import os
import tempfile
import time
import urllib.request

import numpy as np
import pytest

from llmq_ray import storage
from llmq_ray.errors import CheckpointError, ConfigError

from llmq_ray.actors.collectives import free_port
from test_storage import REPO, _cli  # the ``s3`` fixture (moto) is in conftest.py

FAST = dict(collective_timeout_s=30.0, call_timeout_s=120.0, verbose=False, use_ray_data=False)


def _no_uri_folders(*folders) -> None:
    for folder in folders:
        if os.path.isdir(folder):
            bad = [n for n in os.listdir(folder) if n.startswith(("s3:", "nosuch"))]
            assert not bad, f"a local folder named after a URI in {folder}: {bad}"


def _download_log(uri: str, tmp_path) -> list[dict]:
    from llmq_ray.observe.runlog import read_log

    local = str(tmp_path / f"log-{time.monotonic_ns()}.jsonl")
    storage.download(uri, local)
    return read_log(local)


def test_a_run_with_out_dir_on_s3_leaves_its_log_export_and_checkpoint_there(s3, ray_cluster, shards, tmp_path,
                                                                            monkeypatch):
    from llmq_ray.checkpoints.layout import has_manifest
    from llmq_ray.model.config import load_hf_config
    from llmq_ray.model.hf_io import EXPORT_MARKER, load_hf_weights
    from llmq_ray.model.params import ParamLayout
    from llmq_ray.train.trainer import LLMQTrainer

    monkeypatch.chdir(tmp_path)
    out = "s3://bucket/outs/run1"
    res = LLMQTrainer(model="tiny", train_file=shards.train, eval_file=shards.eval, steps=3, batch_size=2,
                      seq_len=16, device="cpu", workers=1, out_dir=out, run_id="store-run-1", **FAST).fit()
    assert res.log_file == f"{out}/log.jsonl" and res.export_path == f"{out}/export"
    # the log: whole JSON Lines records, from the options (with the run_id) to the end
    records = _download_log(res.log_file, tmp_path)
    kinds = [r["log"] for r in records]
    (options,) = [r for r in records if r["log"] == "options"]
    assert options["run_id"] == "store-run-1" and options["out_dir"] == out
    assert kinds.count("step") == 3 and "eval" in kinds and "checkpoint" in kinds and "summary" in kinds
    assert records[-1]["log"] == "end" and records[-1]["reason"] == "finished"
    # the export: every file hf_io writes, the marker last and listing them; it loads
    files = storage.list_files(res.export_path)
    assert {"config.json", "generation_config.json", "model.safetensors", EXPORT_MARKER} <= set(files)
    marker = json.loads(storage.read_bytes(f"{res.export_path}/{EXPORT_MARKER}"))
    assert set(marker["files"]) == set(files) - {EXPORT_MARKER}
    assert all(storage.size_of(f"{res.export_path}/{f}") == n for f, n in marker["files"].items())
    local = tmp_path / "export-copy"
    local.mkdir()
    for f in marker["files"]:
        storage.download(f"{res.export_path}/{f}", str(local / f))
    cfg = load_hf_config(str(local))
    layout = ParamLayout(cfg)
    import torch

    flat = torch.full((layout.numel,), float("nan"))
    load_hf_weights(str(local), layout, flat)
    assert torch.isfinite(flat).all()
    # the default checkpoint folder is out_dir/ckpt on the store (the run's last step, --ckpt-minutes' default)
    assert storage.list_names(f"{out}/ckpt") == ["step_00000003"] and has_manifest(f"{out}/ckpt/step_00000003")
    assert res.checkpoint_paths == [f"{out}/ckpt/step_00000003"]
    assert storage.list_names(out) == ["ckpt", "export", "log.jsonl"]
    # nothing local named after the URI (the driver's, the actors' and the temp folders), no staging left over
    _no_uri_folders(tmp_path, REPO, os.getcwd(), tempfile.gettempdir(), storage.cache_root())
    assert not [n for n in os.listdir(os.path.join(storage.cache_root(), "staging")) if n.startswith("export-")]


def test_run_log_on_a_store_is_uploaded_whole_at_each_flush_continued_and_set_aside(s3, tmp_path):
    from llmq_ray.observe.runlog import RunLog, append_records, staging_path

    uri = "s3://bucket/logs/a/log.jsonl"
    log = RunLog(uri)
    log.add("options", run_id="one")
    log.add("step", step=1, loss=1.0)
    assert storage.size_of(uri) is None  # lines go to the staging copy; the store gets them at a flush
    log.flush()
    assert [r["log"] for r in _download_log(uri, tmp_path)] == ["options", "step"]
    log.add("step", step=2, loss=0.5)
    log.end("finished", step=2)
    assert [r["log"] for r in _download_log(uri, tmp_path)] == ["options", "step", "step", "end"]
    assert os.path.isfile(staging_path(uri)) and not staging_path(uri).startswith(str(tmp_path))
    # a continued run appends to it
    again = RunLog(uri, resume=True)
    assert again.previous_last_step == 2
    again.add("resume", step=2)
    again.flush()
    assert [r["log"] for r in _download_log(uri, tmp_path)][-2:] == ["end", "resume"]
    # the driver's end record after the coordinator died: from the staging copy, which has the unflushed lines
    again.add("step", step=3, loss=0.25)
    append_records(uri, [{"log": "end", "reason": "failed", "error": "boom"}])
    assert [r["log"] for r in _download_log(uri, tmp_path)][-3:] == ["resume", "step", "end"]
    # a fresh run keeps the earlier log beside it (copied), never replaces it
    fresh = RunLog(uri)
    fresh.add("options", run_id="two")
    fresh.flush()
    assert fresh.set_aside and fresh.set_aside.startswith("s3://bucket/logs/a/log.before-")
    assert fresh.set_aside.endswith(".jsonl")
    assert [r.get("run_id") for r in _download_log(uri, tmp_path)] == ["two"]
    assert len(_download_log(fresh.set_aside, tmp_path)) == 7


def test_an_export_on_a_store_is_never_seen_half_written(s3, tmp_path, monkeypatch):
    """Upload order: the old export's marker is removed first, config.json comes after the weights, the
    marker last; a fresh run's set-aside copies an export (marker last) and then removes it."""
    import llmq_ray.model.hf_io as hf_io

    def folder(tag: str):
        d = tmp_path / tag
        d.mkdir()
        for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
            (d / name).write_text(f"{tag}:{name}")
        return str(d)

    uri = "s3://bucket/exp/run/export"
    seen = []
    real_upload = storage.upload

    def watching_upload(local, dst):
        seen.append((os.path.basename(dst), hf_io.export_complete(uri)))  # complete while uploading? never
        real_upload(local, dst)

    monkeypatch.setattr(storage, "upload", watching_upload)
    hf_io.upload_export(folder("a"), uri)
    assert [n for n, _ in seen][-1] == "config.json" and not any(c for _, c in seen)
    assert hf_io.export_complete(uri)
    seen.clear()
    hf_io.upload_export(folder("b"), uri)  # replaces it: the first upload already finds no marker
    assert seen and not any(c for _, c in seen)
    assert storage.read_bytes(f"{uri}/model.safetensors") == b"b:model.safetensors"
    storage.write_bytes("s3://bucket/exp/data/table.csv", b"not a model")  # never replaced by an export
    with pytest.raises(CheckpointError, match=r"^s3://bucket/exp/data: export target holds files that are not"):
        hf_io.upload_export(folder("c"), "s3://bucket/exp/data")
    assert storage.list_files("s3://bucket/exp/data") == ["table.csv"]
    kept = "s3://bucket/exp/run/export.before-x"
    hf_io.set_aside_export(uri, kept)
    assert not storage.exists(uri) and hf_io.export_complete(kept)
    assert storage.read_bytes(f"{kept}/config.json") == b"b:config.json"


def test_out_dir_and_log_file_uris_are_checked_before_anything_starts(s3, tmp_path, monkeypatch):
    from llmq_ray.train.trainer import LLMQTrainer

    monkeypatch.chdir(tmp_path)
    base = dict(device="cpu", model="tiny", synthetic_data=True, verbose=False)
    storage.write_bytes("s3://bucket/taken/log.jsonl", b'{"log": "options"}\n')
    with pytest.raises(ConfigError, match=r"^log_file=s3://bucket/taken/log.jsonl is the log of another run"):
        LLMQTrainer(**base, out_dir=str(tmp_path / "o"), log_file="s3://bucket/taken/log.jsonl")
    t = LLMQTrainer(**base, out_dir="s3://bucket/fresh/run")  # no actor yet: nothing written anywhere
    assert t.checkpoint_dir == "s3://bucket/fresh/run/ckpt" and t._log_path() == "s3://bucket/fresh/run/log.jsonl"
    assert not storage.exists("s3://bucket/fresh")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port('127.0.0.1')}")  # nothing listens there
    for kw, flag in ((dict(out_dir="s3://bucket/o"), "out_dir"),
                     (dict(out_dir=str(tmp_path / "o"), log_file="s3://bucket/l.jsonl"), "log_file")):
        with pytest.raises(ConfigError, match=rf"^{flag}='s3://bucket/.*': cannot reach it"):
            LLMQTrainer(**base, **kw)
    p = _cli(["--device", "cpu", "--synthetic-data", "--out-dir", "nosuch://x"], tmp_path)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "error: --out-dir='nosuch://x': no filesystem handles nosuch:// (pyarrow knows file, s3, gs and hdfs; "
        "other schemes need fsspec and its nosuch package installed)."]
    _no_uri_folders(tmp_path)


def test_published_metrics_carry_the_run_id(monkeypatch):
    """telemetry.publish adds the process's run_id (set by the coordinator and each worker) to every metric."""
    import ray

    from llmq_ray.actors import telemetry

    made = {}

    class FakeGauge:
        def __init__(self, name, description="", tag_keys=()):
            self.name, self.tag_keys = name, tag_keys
            made[name] = self

        def set(self, value, tags=None):
            assert set(tags) == set(self.tag_keys)
            self.last = (value, tags)

    import ray.util.metrics

    monkeypatch.setattr(ray.util.metrics, "Gauge", FakeGauge)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(telemetry, "_GAUGES", {})
    monkeypatch.setattr(telemetry, "_RUN_ID", [""])
    telemetry.set_run_id("run-abc")
    telemetry.publish({"llmq_worker_loss": 2.0}, {"rank": "1"})
    telemetry.publish({"llmq_tokens_per_second": 10.0}, {"role": "coordinator"})
    assert made["llmq_worker_loss"].last == (2.0, {"rank": "1", "run_id": "run-abc"})
    assert made["llmq_tokens_per_second"].last == (10.0, {"role": "coordinator", "run_id": "run-abc"})


def test_the_metrics_endpoint_shows_the_run_id_of_worker_and_coordinator_metrics(ray_cluster, shards, tmp_path):
    from llmq_ray.train.trainer import LLMQTrainer

    ray = ray_cluster
    want = {"ray_llmq_worker_tokens_per_second{": None, "ray_llmq_tokens_per_second{": None}
    with LLMQTrainer(model="tiny", train_file=shards.train, steps=20, batch_size=2, seq_len=16, device="cpu",
                     workers=1, out_dir=str(tmp_path), export=False, run_id="metrics-run-7", **FAST) as t:
        deadline = time.monotonic() + 120  # Ray's metrics agent reports every second, later on a loaded machine
        while time.monotonic() < deadline and None in want.values():
            t.train_step()
            port = next(n["MetricsExportPort"] for n in ray.nodes() if n["Alive"])
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                text = r.read().decode()
            for line in text.splitlines():
                for prefix in want:
                    if line.startswith(prefix) and 'run_id="metrics-run-7"' in line:
                        want[prefix] = float(line.rsplit(" ", 1)[1])
            time.sleep(0.5)
    assert all(v is not None and np.isfinite(v) and v > 0 for v in want.values()), want
