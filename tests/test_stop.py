"""Stopping without losing work, and one log across resumes (CPU workers over gloo).

* SIGTERM to the driver of ``examples/train.py`` (its own local Ray, 2 workers, --ckpt-interval 0): it exits
  with 143 within 30 s, without a C++ stack dump, after writing a checkpoint of the last completed step and a
  "stopped" end record; ``--continue`` then finishes with per-step losses bit-identical to an uninterrupted
  run, and the one log holds every step once.
* A run stopped twice through the step-level API (``request_stop()`` + ``stop()``) and resumed twice has one
  log: all steps in order, two "resume" records, an "end" record per session; resuming from an older
  checkpoint marks the steps trained again as ``retrained`` and the plot script draws one run.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from _helpers import faulty_trainer, trainer_from_cli

from llmq_ray.checkpoints.verify import validate_checkpoint
from llmq_ray.errors import CheckpointError
from llmq_ray.observe.runlog import read_log, steps_as_one_run
from llmq_ray.train.trainer import LLMQTrainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = dict(collective_timeout_s=15.0, call_timeout_s=60.0, use_ray_data=False, verbose=False)


def _argv(shards, out, steps: int) -> list[str]:
    return ["--device", "cpu", "--model", "tiny", "--workers", "2", "--batch-size", "2", "--seq-len", "16",
            "--steps", str(steps), "--lr", "3e-3", "--train-file", shards.train, "--no-export", "--no-ray-data",
            "--no-progress", "--sample-tokens", "0", "--out-dir", str(out)]


def _trainer_from_cli(argv: list[str]) -> LLMQTrainer:
    """The trainer ``examples/train.py argv`` builds, run in this process (on the test session's Ray)."""
    return trainer_from_cli(argv, **FAST)


@contextlib.contextmanager
def _driver(args: list[str], cwd, training_line: str, env: dict | None = None):
    """A driver process (``python ARGS``, its own local Ray in a short temporary folder: Ray's socket paths must
    stay under 107 bytes), yielded once its stdout shows ``training_line``; killed and cleaned up at the end."""
    ray_tmp = tempfile.mkdtemp(prefix="rs")  # the system temp folder: a short path
    env = dict(os.environ, PYTHONPATH=REPO, RAY_TMPDIR=ray_tmp, **(env or {}))
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=cwd)
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if line.startswith(training_line):
                break
        assert proc.poll() is None, "".join(seen) + proc.stderr.read()
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_sigterm_checkpoints_the_last_step_and_continue_is_bit_exact(ray_cluster, shards, tmp_path):
    steps = 50  # the stop comes at step 10 or a little later, while 0.1 s steps leave seconds to go
    ref = _trainer_from_cli(_argv(shards, tmp_path / "ref", steps)).fit()
    out = tmp_path / "run"
    # --no-dashboard: this driver starts a Ray of its own, and the dashboard's processes are not what is tested
    train = [os.path.join(REPO, "examples", "train.py"), *_argv(shards, out, steps), "--no-dashboard"]
    # rank 0 sleeps 0.1 s a step (the test hook; the losses do not change): the run is still going at step 10
    slow = {"LLMQ_RAY_TEST_FAULT": json.dumps({"rank": 0, "step": 0, "kind": "slow_step", "seconds": 0.1,
                                               "every_group": True})}
    with _driver(train, tmp_path, "[T] step    10 ", slow) as proc:
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rest, err = proc.communicate(timeout=60)
        seconds = time.monotonic() - t0
    assert proc.returncode == 143, (proc.returncode, err)
    assert seconds < 30, seconds
    assert "SIGTERM received" not in err and "logging.cc" not in err and "Traceback" not in err, err
    records = read_log(str(out / "log.jsonl"))
    end = records[-1]
    assert end["log"] == "end" and end["reason"] == "stopped" and end["signal"] == "SIGTERM", end
    done = end["step"]
    assert 10 <= done < steps
    assert f"stopped by SIGTERM after step {done}; checkpoint step_{done:08d} written" in err, err
    assert end["checkpoint"] == str(out / "ckpt" / f"step_{done:08d}") and end["checkpoint_written"]
    validate_checkpoint(end["checkpoint"], verify_checksums=True)
    logged = [r["step"] for r in records if r["log"] == "step"]
    assert logged == list(range(1, done + 1)), "every completed step is in the log, once (1-based, as the console)"

    resumed = _trainer_from_cli(_argv(shards, out, steps) + ["--continue"]).fit()
    assert resumed.stopped is None and resumed.history[0]["step"] == done + 1
    records = read_log(str(out / "log.jsonl"))
    assert [r["log"] for r in records].count("resume") == 1 and records[-1]["reason"] == "finished"
    steps_logged = [r for r in records if r["log"] == "step"]
    assert [r["step"] for r in steps_logged] == list(range(1, steps + 1))
    assert [r["loss"] for r in steps_logged] == [r["loss"] for r in ref.history]  # bit for bit


def _api_run(shards, out, **kw) -> LLMQTrainer:
    args = dict(model="tiny", train_file=shards.train, device="cpu", workers=1, batch_size=2, seq_len=16, steps=12,
                learning_rate=3e-3, warmup=2, out_dir=str(out), export=False, final_eval=False, ckpt_minutes=0, **FAST)
    return faulty_trainer(**{**args, **kw})


@pytest.fixture(scope="module")
def uninterrupted(ray_cluster, shards, tmp_path_factory) -> list[float]:
    """The per-step losses of the uninterrupted ``_api_run`` (12 steps, one worker), which the runs that were
    stopped, resumed or restarted must reproduce: run once for the module."""
    return [r["loss"] for r in _api_run(shards, tmp_path_factory.mktemp("uninterrupted")).fit().history]


def test_stopped_and_resumed_twice_is_one_run_in_one_log(uninterrupted, shards, tmp_path):
    out = tmp_path / "run"
    for session, resume in enumerate((False, True)):
        with _api_run(shards, out, resume=resume) as t:
            for _ in range(4):
                assert t.train_step() is not None
            t.request_stop()
            assert t.stop_requested and t.train_step() is None
            info = t.stop()
        assert info["step"] == 4 * (session + 1) and info["written"] and info["exit_code"] == 0
        assert info["checkpoint"].endswith(f"step_{4 * (session + 1):08d}")
    result = _api_run(shards, out, resume=True).fit()
    assert result.stopped is None
    records = read_log(str(out / "log.jsonl"))
    assert [r["step"] for r in records if r["log"] == "step"] == list(range(1, 13))
    assert [r["log"] for r in records].count("resume") == 2
    ends = [r for r in records if r["log"] == "end"]
    assert [e["reason"] for e in ends] == ["stopped", "stopped", "finished"] and records[-1] is not None
    assert records[-1]["log"] == "end"
    assert not any(r.get("retrained") for r in records if r["log"] == "step")
    assert [r["loss"] for r in steps_as_one_run(records)] == uninterrupted

    # go back to step 4 (older than the newest checkpoint, 8): steps 5-8 are trained again and marked, and the
    # abandoned branch's checkpoint of step 8 is moved aside (kept, but no longer what --continue picks)
    again = _api_run(shards, out, resume=4).fit()
    superseded = [n for n in os.listdir(out / "ckpt") if n.startswith("superseded-")]
    assert len(superseded) == 1 and os.listdir(out / "ckpt" / superseded[0]) == ["step_00000008"]
    assert sorted(n for n in os.listdir(out / "ckpt") if n.startswith("step_")) == ["step_00000004"]
    assert again.history[0]["step"] == 5
    records = read_log(str(out / "log.jsonl"))
    steps = [r for r in records if r["log"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 13)) + list(range(5, 13))
    assert [r["step"] for r in steps if r.get("retrained")] == list(range(5, 13))
    one = steps_as_one_run(records)
    assert [r["step"] for r in one] == list(range(1, 13)) and all(r.get("retrained") for r in one[4:])

    sys.path.insert(0, os.path.join(REPO, "examples"))
    try:
        import plot_training_run
    finally:
        sys.path.pop(0)
    s = plot_training_run.series(records)
    assert s["step"] == list(range(1, 13))
    png = tmp_path / "plot.png"
    subprocess.run([sys.executable, os.path.join(REPO, "examples", "plot_training_run.py"), str(out / "log.jsonl"),
                    "--out", str(png)], check=True, capture_output=True, timeout=120)
    assert png.stat().st_size > 1000


def test_a_fresh_run_keeps_an_earlier_log_and_export(ray_cluster, shards, tmp_path):
    """The default log and export of --out-dir are never overwritten by a fresh run: the earlier ones are kept
    beside them (log.before-<time>.jsonl, export.before-<time>)."""
    out = tmp_path / "run"
    (out / "export").mkdir(parents=True)
    (out / "export" / "config.json").write_text('{"earlier": true}')
    (out / "log.jsonl").write_text(json.dumps([{"log": "options", "model": "earlier"}]))
    t = _api_run(shards, out, steps=2, warmup=0, checkpoint_on_exit=False, export=True)
    result = t.fit()
    kept = [n for n in os.listdir(out) if n.startswith("log.before-")]
    assert len(kept) == 1 and json.loads((out / kept[0]).read_text())[0]["model"] == "earlier"
    assert read_log(str(out / "log.jsonl"))[-1]["reason"] == "finished"
    kept = [n for n in os.listdir(out) if n.startswith("export.before-")]
    assert len(kept) == 1 and json.loads((out / kept[0] / "config.json").read_text()) == {"earlier": True}
    assert result.export_path == str(out / "export") and (out / "export" / "model.safetensors").is_file()


def test_a_failed_run_says_why_in_its_last_record(ray_cluster, shards, tmp_path):
    from llmq_ray.actors.failures import WorkerError

    out = tmp_path / "run"
    with pytest.raises(WorkerError, match="injected fault"):
        _api_run(shards, out, steps=5, warmup=0, fault={"rank": 0, "step": 2}, max_restarts=0).fit()
    end = read_log(str(out / "log.jsonl"))[-1]
    assert end["log"] == "end" and end["reason"] == "failed" and "injected fault at step 2" in end["error"]


def test_checkpoints_are_on_by_default_every_few_minutes_and_at_the_end(ray_cluster, shards, tmp_path, capsys):
    """Without --ckpt-interval: a checkpoint whenever --ckpt-minutes have passed since the last one and after the
    last step, so a failure restarts from there (or from scratch before the first one) instead of ending the run;
    a second fresh run into the same --out-dir keeps the first run's checkpoints beside its own."""
    out = tmp_path / "run"
    # 1e-5 minutes: due after every step; the fault at step 2 is survived by a restart from step 2's checkpoint
    res = _api_run(shards, out, steps=4, ckpt_minutes=1e-5, fault={"rank": 0, "step": 2}).fit()
    assert res.metrics["restarts"] == 1 and [r["step"] for r in res.history] == [1, 2, 3, 4]
    records = read_log(res.log_file)
    assert [r["checkpoint"] for r in records if r["log"] == "restart"] == [str(out / "ckpt" / "step_00000002")]
    assert [os.path.basename(p) for p in res.checkpoint_paths] == ["step_00000003", "step_00000004"]  # keep 2
    # the default 30 minutes: only the checkpoint after the last step
    again = _api_run(shards, out, steps=3, ckpt_minutes=30.0, verbose=True, progress=False)
    assert not [n for n in os.listdir(out) if n.startswith("ckpt.before-")]  # moved as the run starts, not before
    res = again.fit()
    kept = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("checkpoints: an earlier run's")]
    assert len(kept) == 1 and "were kept as" in kept[0]
    assert [os.path.basename(p) for p in res.checkpoint_paths] == ["step_00000003"]
    assert sorted(n for n in os.listdir(out) if n.startswith("ckpt.before-")) != []
    with pytest.raises(CheckpointError, match="already holds checkpoints"):  # a folder the user named is never moved
        _api_run(shards, tmp_path / "other", steps=3, checkpoint_dir=str(out / "ckpt"))


def test_resuming_on_fewer_workers_keeps_the_global_batch(ray_cluster, shards, tmp_path, capsys):
    """A 2-worker checkpoint (2 rows x 1 micro-step x 2 workers) resumed on 1 worker with the same flags:
    --grad-accumulation becomes 2, one line says so, and the losses follow the 2-worker run within 1e-5."""
    two = _api_run(shards, tmp_path / "two", workers=2, ckpt_interval=6).fit()
    ckpt = os.path.join(tmp_path / "two", "ckpt", "step_00000006")
    t = _api_run(shards, tmp_path / "one", workers=1, resume=ckpt, verbose=True, progress=False)
    assert t.settings.data.grad_accumulation == 2
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("resuming step_00000006")]
    assert len(line) == 1 and "--grad-accumulation 2 instead of 1 keeps its global batch of 4 rows" in line[0]
    one = t.fit()
    assert [r["step"] for r in one.history] == list(range(7, 13))
    assert one.history[0]["tokens"] == two.history[6]["tokens"]
    for a, b in zip(one.history, two.history[6:]):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a["step"], a["loss"], b["loss"])

    kept = _api_run(shards, tmp_path / "one-b", workers=1, resume=ckpt, allow_batch_change=True)
    assert kept.settings.data.grad_accumulation == 1  # opted out: the batch is halved, as asked
    with pytest.raises(Exception, match=r"global batch of 4 rows .* cannot keep with a whole grad_accumulation"):
        _api_run(shards, tmp_path / "one-c", workers=1, batch_size=3, resume=ckpt)


def test_api_with_no_data_arguments_trains_on_the_default_corpus(ray_cluster, tmp_path, monkeypatch):
    """LLMQTrainer() without train_file uses the tiny-shakespeare that ships with llmq-ray, as the CLI does."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("LLMQ_DATA_DIR", raising=False)
    t = LLMQTrainer(steps=2, batch_size=2, seq_len=32, out_dir=str(tmp_path / "out"), export=False,
                    final_eval=False, **FAST)
    assert t.settings.model.model == "tiny-qwen" and t.settings.parallel.device == "auto"
    assert t.settings.data.train_file.startswith(str(tmp_path / "cache")) and t.settings.data.eval_file.endswith("eval.bin")
    result = t.fit()
    assert [r["step"] for r in result.history] == [1, 2] and all(r["loss"] > 0 for r in result.history)
    dataset = next(r for r in read_log(result.log_file) if r["log"] == "dataset")
    assert "tiny-shakespeare" in json.dumps(dataset)


SECOND_SIGNAL_SCRIPT = """
import json, os, sys
from llmq_ray.train.trainer import LLMQTrainer
os.environ["LLMQ_RAY_TEST_FAULT"] = json.dumps({"rank": 1, "step": int(sys.argv[4]), "kind": sys.argv[3],
                                                "seconds": 600})
t = LLMQTrainer(model="tiny", train_file=sys.argv[1], device="cpu", workers=2, batch_size=2, seq_len=16, steps=50,
                ckpt_interval=5, out_dir=sys.argv[2], export=False, progress=False, use_ray_data=False,
                collective_timeout_s=600.0, dashboard=False)
r = t.fit()
sys.exit(r.stopped["exit_code"] if r.stopped else 0)
"""


@pytest.mark.parametrize("during", ["a hung step", "the save"])
def test_a_second_signal_abandons_the_stop(shards, tmp_path, during):
    """The first SIGTERM waits for the step under way and then writes a checkpoint. Here either the step never
    ends (rank 1 hangs at step 8) or the checkpoint's write never ends (rank 1 sleeps after writing its file
    of any checkpoint after step 5, before the manifest exists). The second SIGTERM kills the actors at once:
    exit 143, the log's last record says so, nothing named step_* appears for the abandoned checkpoint (its
    temporary folder stays hidden), and the checkpoint of step 5 (--ckpt-interval 5) is the newest valid one."""
    out = tmp_path / "run"
    kind, step = ("hang", 7) if during == "a hung step" else ("save_slow", 6)

    def tmp_folders():
        return [n for n in os.listdir(out / "ckpt") if ".tmp-" in n] if (out / "ckpt").is_dir() else []

    script = ["-c", SECOND_SIGNAL_SCRIPT, shards.train, str(out), kind, str(step)]
    with _driver(script, tmp_path, "[T] step     7 ") as proc:
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while during == "the save" and not tmp_folders() and time.monotonic() < deadline:
            time.sleep(0.2)  # the stop's checkpoint is being written (and will not finish)
        time.sleep(2.0)
        assert proc.poll() is None  # still stopping
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        seconds = time.monotonic() - t0
    assert proc.returncode == 143 and seconds < 30, (proc.returncode, seconds, err)
    assert "a second SIGTERM abandoned the stop" in err and "logging.cc" not in err, err
    end = read_log(str(out / "log.jsonl"))[-1]
    assert end["log"] == "end" and end["reason"] == "stopped" and end["checkpoint"] is None
    assert "the newest valid checkpoint is step_00000005" in end["note"]
    assert sorted(n for n in os.listdir(out / "ckpt") if n.startswith("step_")) == ["step_00000005"]
    assert bool(tmp_folders()) == (during == "the save")
    validate_checkpoint(str(out / "ckpt" / "step_00000005"), verify_checksums=True)


def test_signal_handlers_leave_ignored_signals_alone(monkeypatch):
    """Under nohup SIGHUP is ignored: a closed terminal must not stop the run. The others become stop requests,
    the second one raises StopForced (a KeyboardInterrupt, which ray.get lets through), and restore() puts
    the previous handlers back."""
    from llmq_ray.train.stop_signals import SignalStop, StopForced

    previous = {s: signal.getsignal(s) for s in (signal.SIGHUP, signal.SIGTERM)}
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    got = []
    stop = SignalStop(got.append)
    try:
        assert stop.install()
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGHUP)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        assert got == [signal.SIGTERM]
        with pytest.raises(KeyboardInterrupt) as info:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)
        assert isinstance(info.value, StopForced) and stop.forced == signal.SIGTERM
    finally:
        stop.restore()
        for s, h in previous.items():
            signal.signal(s, h)
    assert signal.getsignal(signal.SIGTERM) is previous[signal.SIGTERM]


def test_a_coordinator_that_dies_is_started_again_from_the_last_checkpoint(uninterrupted, shards, tmp_path):
    """The coordinator actor is killed mid-run (as when its process is OOM-killed): the driver starts a new one
    from the newest valid checkpoint, which finishes the run with the uninterrupted run's losses in one log."""
    import threading

    import ray

    out = tmp_path / "run"
    slow = {"rank": 0, "step": 0, "kind": "slow_step", "seconds": 0.2, "every_group": True}
    trainer = _api_run(shards, out, ckpt_interval=2, fault=slow)
    killed = {}

    def kill_after_step_4():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            log = str(out / "log.jsonl")
            if os.path.exists(log) and any(r["log"] == "checkpoint" and r["step"] >= 4 for r in read_log(log)):
                killed["coordinator"] = trainer.coordinator
                ray.kill(trainer.coordinator)
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=kill_after_step_4, daemon=True)
    watcher.start()
    result = trainer.fit()
    watcher.join(5)
    assert killed and trainer.coordinator is None  # closed at the end; the killed one was replaced
    assert [r["step"] for r in result.history] == list(range(1, 13))
    records = read_log(result.log_file)
    resumes = [r for r in records if r["log"] == "resume"]
    assert len(resumes) == 1 and resumes[0]["step"] >= 4 and resumes[0]["path"].startswith(str(out / "ckpt"))
    assert [r["reason"] for r in records if r["log"] == "end"] == ["finished"]
    # the killed coordinator's placement group (Ray ties it to the job, not to the actor that made it) is gone:
    # left behind, it would hold its workers' CPUs until this process exits
    from ray.util.placement_group import placement_group_table

    name = trainer.plan.placement_name + "-"
    assert [e["state"] for e in placement_group_table().values() if e["name"].startswith(name)] == \
        ["REMOVED", "REMOVED"]
    assert [r["loss"] for r in steps_as_one_run(records)] == uninterrupted
