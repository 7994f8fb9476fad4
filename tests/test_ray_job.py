"""``ray job submit`` of a CPU run to a simulated cluster (tests/_cluster_serve.py), then ``ray job stop``: the
stop reaches the run as SIGTERM, which writes a checkpoint of the last completed step to the S3 store before
the job ends; a resubmitted job with ``--continue`` finishes with the per-step losses of an uninterrupted run,
bit for bit (fp32 on CPU, one worker)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from llmq_ray import storage
from llmq_ray.observe.runlog import read_log

pytestmark = pytest.mark.slow
pytest.importorskip("moto.server", reason="the object-store tests need moto[server] (dev extra)")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 24
FLAGS = ["--device", "cpu", "--model", "tiny", "--backend", "torch", "--model-dtype", "fp32", "--batch-size", "2",
         "--seq-len", "16", "--steps", str(STEPS), "--warmup", "2", "--eval-every-n-steps", "0", "--no-final-eval",
         "--no-export", "--sample-tokens", "0", "--no-progress", "--no-ray-data", "--workers", "1",
         "--ckpt-minutes", "0"]


@pytest.fixture(scope="module")
def job_cluster(tmp_path_factory):
    """The simulated cluster's {"dashboard": job server URL, "address": GCS address} (the cluster runs in a process
    of its own)."""
    folder = tmp_path_factory.mktemp("jobcluster")
    info = folder / "info.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    env.pop("RAY_ADDRESS", None)
    with open(folder / "serve.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, os.path.join(REPO, "tests", "_cluster_serve.py"), str(info)],
                                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 180
    while not info.exists():
        assert proc.poll() is None and time.monotonic() < deadline, \
            "the simulated cluster did not come up: " + (folder / "serve.log").read_text(errors="replace")[-5000:]
        time.sleep(0.5)
    time.sleep(0.2)
    try:
        yield json.loads(info.read_text())
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _ray_job(dashboard: str, *args: str, timeout: float = 240) -> str:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    deadline = time.monotonic() + 90
    while True:  # the job agent of the head node comes up a little after the dashboard
        proc = subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "job", args[0], "--address", dashboard,
                               *args[1:]],
                              capture_output=True, text=True, timeout=timeout, env=env)
        if "No available agent" not in proc.stderr or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _runtime_env(slow: bool) -> str:
    """The S3 server's address and credentials for the job (the workers get them forwarded by the driver);
    ``slow``: rank 0 sleeps 0.3 s a step (the test hook), so that the job is stopped mid-run."""
    keep = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "LLMQ_RAY_CACHE",
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_USAGE_STATS_ENABLED", "RAY_AUTH_MODE")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    # as docs/running-on-ray.md says: Ray's job supervisor gives a stopped job 3 s before SIGKILL unless told
    # otherwise, too little for the stop's checkpoint on a loaded machine
    env["RAY_JOB_STOP_WAIT_TIME_S"] = "120"
    if slow:
        env["LLMQ_RAY_TEST_FAULT"] = json.dumps({"kind": "slow_step", "rank": 0, "step": 0, "seconds": 0.3})
    return json.dumps({"env_vars": env})


def _steps(log: list) -> dict:
    """The loss of every step in the log (a step trained again after a resume replaces the earlier record)."""
    return {r["step"]: r["loss"] for r in log if r.get("log") == "step"}


def test_ray_job_stop_leaves_a_checkpoint_and_a_resubmitted_job_finishes_bit_exact(
        job_cluster, s3, ray_cluster, shards, tmp_path):
    """Near or over 60 s beside the rest of the suite: it pays for the module's simulated cluster (a head with the
    dashboard's job server, which ``ray job`` needs) and runs two jobs -- each a driver, a job supervisor and a
    ``ray job`` command of its own -- and the reference run; the job's 24 slowed steps leave the stop time to land."""
    from llmq_ray.train.trainer import LLMQTrainer

    dashboard, address = job_cluster["dashboard"], job_cluster["address"]

    with open(shards.train, "rb") as f, s3.open_output_stream("bucket/job/data/train.bin") as g:
        g.write(f.read())
    store, out = "s3://bucket/job/ckpt", tmp_path / "out"
    flags = FLAGS + ["--train-file", "s3://bucket/job/data/train.bin", "--checkpoint-dir", store,
                     "--out-dir", str(out)]
    entry = [sys.executable, "-m", "llmq_ray.train.cli"] + flags
    submitted = _ray_job(dashboard, "submit", "--no-wait", "--runtime-env-json", _runtime_env(True), "--", *entry)
    job_id = next(w for w in submitted.replace("'", " ").split() if w.startswith("raysubmit_"))
    log_file = out / "log.jsonl"
    deadline = time.monotonic() + 480  # a guard against a hang: the job's set-up took 45 s beside a second suite
    while len(_steps(read_log(str(log_file)) if log_file.exists() else [])) < 4:  # a few steps under way
        assert time.monotonic() < deadline, _ray_job(dashboard, "logs", job_id)
        time.sleep(0.3)
    _ray_job(dashboard, "stop", job_id)
    status = _ray_job(dashboard, "status", job_id)
    assert "was stopped" in status, status
    log = read_log(str(log_file))
    end = [r for r in log if r.get("log") == "end"][-1]
    assert end["reason"] == "stopped" and end["signal"] == "SIGTERM" and end["checkpoint_written"], end
    last = max(_steps(log))
    assert end["step"] == last < STEPS  # the checkpoint holds every completed step
    assert end["checkpoint"] == storage.join(store, f"step_{last:08d}")
    assert f"step_{last:08d}" in storage.list_names(store)

    again = _ray_job(dashboard, "submit", "--runtime-env-json", _runtime_env(False), "--", *entry,
                     "--continue")
    assert "succeeded" in again, again
    # the job's driver ran on the cluster it was submitted to (not another Ray instance of this machine)
    assert f"Connecting to existing Ray cluster at address: {address}" in again, again
    ours = _steps(read_log(str(log_file)))
    reference = LLMQTrainer(model="tiny", device="cpu", backend="torch", model_dtype="fp32", batch_size=2, seq_len=16,
                            steps=STEPS, warmup=2, eval_every_n_steps=0, final_eval=False, export=False, workers=1,
                            use_ray_data=False, ckpt_minutes=0, train_file=shards.train, verbose=False,
                            out_dir=str(tmp_path / "reference")).fit()
    assert [ours[s] for s in range(1, STEPS + 1)] == [r["loss"] for r in reference.history]


def test_the_command_line_joins_a_cluster_that_runs_on_this_machine(job_cluster, shards, tmp_path):
    """With no --ray-address and no RAY_ADDRESS, `python examples/train.py` joins the cluster named in
    RAY_TMPDIR/ray/ray_current_cluster (as `ray start` writes it; this simulated cluster writes it the same way),
    without the num_cpus with which Ray refuses to join (it was a ValueError traceback), and says so."""
    address = job_cluster["address"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    env.pop("RAY_ADDRESS", None)
    flags = list(FLAGS)
    flags[flags.index("--steps") + 1] = "3"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "examples", "train.py"), *flags, "--train-file",
                           shards.train, "--out-dir", str(tmp_path / "out")],
                          env=env, capture_output=True, text=True, timeout=240)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said[-5000:]
    assert f"Ray: joining the cluster at {address} that `ray start` started on this machine" in said, said[-3000:]
    assert f"Connecting to existing Ray cluster at address: {address}" in said, said[-3000:]
    assert [r["step"] for r in read_log(str(tmp_path / "out" / "log.jsonl")) if r.get("log") == "step"] == [1, 2, 3]
