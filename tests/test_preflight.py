"""Bad input ends before Ray starts: exit code 2, one sentence, nothing written (llmq_ray/train/preflight.py).

Each case runs the real command (``examples/train.py`` through ``llmq_ray.train.cli.main``) in a fresh Python
process, with ``RAY_TMPDIR`` pointed at an empty folder, and asserts:

* exit code 2 and exactly one line on stderr, ``error: <one sentence naming the file, flag or value>``;
* no Ray process was started: the process never imported ``ray`` (it reports ``sys.modules`` on exit) and
  Ray's session folder under ``RAY_TMPDIR`` was never created;
* nothing was written: the folder the run was pointed at holds the same files, with the same sizes and
  modification times, afterwards (no out-dir, no checkpoint folder, no probe file left behind).

The wall time of each case is printed (``pytest -s``): the target is under 3 s on the 2-core machine. It is
reported, not asserted (timing belongs in benchmarks).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from llmq_ray.data_pipeline.shards import HEADER_BYTES, write_shard

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNNER = ("import sys\n"
          "from llmq_ray.train.cli import main\n"
          "try:\n"
          "    rc = main(sys.argv[1:])\n"
          "finally:\n"
          "    print('RAY_IMPORTED=%s' % ('ray' in sys.modules))\n"
          "sys.exit(rc)\n")
TIMES: dict[str, float] = {}


def _snapshot(folder) -> dict:
    out = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            p = os.path.join(root, name)
            st = os.lstat(p)
            out[os.path.relpath(p, folder)] = (st.st_size if not os.path.isdir(p) else -1, st.st_mtime_ns)
    return out


def _run_cli(args: list[str], cwd, prefix: list[str] | None = None) -> tuple[int, str, str, float]:
    env = dict(os.environ, RAY_TMPDIR=str(cwd / "raytmp"), PYTHONPATH=REPO)
    env.pop("TRITON_INTERPRET", None)
    t0 = time.monotonic()
    p = subprocess.run((prefix or []) + [sys.executable, "-c", RUNNER, *args], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout, p.stderr, time.monotonic() - t0


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    """The files the cases point at, made once (a good shard, a checkpoint of the tiny model, ...)."""
    d = tmp_path_factory.mktemp("bad")
    rng = np.random.default_rng(0)
    good = rng.integers(0, 512, 2000).astype(np.int32)
    write_shard(str(d / "good.bin"), good, 512)
    (d / "notes.txt").write_text("To be, or not to be, that is the question.\n" * 50)
    (d / "empty.bin").write_bytes(b"")
    full = (d / "good.bin").read_bytes()
    (d / "truncated.bin").write_bytes(full[:HEADER_BYTES + 4 * 1000])
    (d / "magic.bin").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(4096))
    big = good.copy()
    big[1234] = 600  # >= the tiny model's vocabulary of 512
    write_shard(str(d / "bigid.bin"), big, 1024)
    (d / "afile").write_text("not a folder")
    from llmq_ray.model.config import PRESETS

    noweights = d / "noweights"  # an HF folder of the tiny model with its config and no weight file
    noweights.mkdir()
    (noweights / "config.json").write_text(json.dumps(PRESETS["tiny"].to_hf_dict()))
    for name in ("short1.bin", "short2.bin"):  # 10 tokens each: 20 in all, no window of 17 inside one file
        write_shard(str(d / name), good[:10], 512)
    # a checkpoint of the tiny model, and a copy with one byte flipped in its shard (same size)
    import torch

    from llmq_ray.checkpoints import resume as ck
    from llmq_ray.model.config import PRESETS
    from llmq_ray.model.params import ParamLayout

    cfg = PRESETS["tiny"]
    n = ParamLayout(cfg).numel
    state = {"master": torch.zeros(n), "m": torch.zeros(n), "v": torch.zeros(n)}
    good_ckpt = ck.save_checkpoint(str(d / "ckpt"), 3, [(0, n, state)], config=cfg, keep_n=None)
    bad_ckpt = str(d / "corrupt" / "step_00000003")
    shutil.copytree(good_ckpt, bad_ckpt)
    shard = os.path.join(bad_ckpt, "rank_00000.safetensors")
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) - 5)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    (d / "other-log.jsonl").write_text(json.dumps([{"log": "options", "model": "tiny"}]))
    return d


def _readonly_prefix(folder) -> tuple[list[str], str]:
    """A command prefix under which ``folder`` is read-only, and a description. As root (where mode bits do
    not stop writes) a read-only tmpfs is mounted over it in a private mount namespace."""
    if os.geteuid() != 0:
        os.chmod(folder, 0o555)
        return [], "chmod 555"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o ro tmpfs {folder} && exit 0"],
                           capture_output=True)
    if probe.returncode == 0:
        return ["unshare", "-m", "sh", "-c", f'mount -t tmpfs -o ro tmpfs {folder} && exec "$@"', "sh"], "ro mount"
    return None, "unavailable"


CASES = {
    # name: (extra args, substring the sentence must hold)
    "text file as shard": (["--train-file", "{d}/notes.txt"], "is a text file, not a token shard"),
    "empty file": (["--train-file", "{d}/empty.bin"], "empty.bin: truncated token shard: 0 bytes"),
    "truncated shard": (["--train-file", "{d}/truncated.bin"], "truncated): the header promises 2000 tokens"),
    "wrong magic": (["--train-file", "{d}/magic.bin"], "magic.bin: not a token shard: wrong magic"),
    "token id >= vocab": (["--train-file", "{d}/bigid.bin"], "token id 600 at token index 1234"),
    "empty glob": (["--train-file", "{d}/nothing-*.bin"], "nothing-*.bin' matched no token files"),
    "eval file bad": (["--eval-file", "{d}/magic.bin"], "magic.bin: not a token shard"),
    "eval file bad, synthetic training data": (["--synthetic-data", "--eval-file", "{d}/nothing-*.bin"],
                                               "--eval-file: '{d}/nothing-*.bin' matched no token files"),
    "eval file shorter than a window": (["--eval-file", "{d}/short1.bin"],
                                        "--eval-file {d}/short1.bin holds 10 tokens, fewer than one window of "
                                        "--seq-len + 1 = 17 tokens"),
    "train files each shorter than a window": (["--train-file", "{d}/short*.bin"],
                                               "--train-file {d}/short*.bin is 2 files of at most 10 tokens each, "
                                               "fewer than one window of --seq-len + 1 = 17 tokens"),
    "model folder without weights": (["--model", "{d}/noweights"], "{d}/noweights: no safetensors file found"),
    "synthetic data and a train file": (["--synthetic-data", "--train-file", "{d}/good.bin"],
                                        "--synthetic-data and --train-file={d}/good.bin both say what to train on"),
    "checkpoint dir is a file": (["--checkpoint-dir", "{d}/afile"], "--checkpoint-dir={d}/afile is a file"),
    "out dir is a file": (["--out-dir", "{d}/afile"], "--out-dir={d}/afile is a file"),
    "read-only checkpoint dir": (["--checkpoint-dir", "{ro}/ckpt"], "cannot be created in {ro}"),
    "--continue with nothing to continue": (["--continue"], "--continue: no valid checkpoint in"),
    "corrupt --continue target": (["--continue", "{d}/corrupt/step_00000003"], "rank_00000.safetensors"),
    "--workers above the CPUs": (["--workers", "{many}", "--device", "auto"], "this machine has"),
    "--log-file of another run": (["--log-file", "{d}/other-log.jsonl"], "is the log of another run"),
    "fresh run into another run's checkpoints": (["--checkpoint-dir", "{d}/ckpt"], "already holds checkpoints"),
    "bad flag value": (["--warmup", "30", "--steps", "10"], "--warmup must be an integer in [0, --steps)"),
    "zero collective time-out": (["--collective-timeout-s", "0"], "--collective-timeout-s=0.0 must be a number > 0 (seconds"),
    "a value for --forward-env": (["--forward-env", "HF_HOME,FOO=bar"], "--forward-env: 'FOO=bar' is not the name"),
    "a Ray address nobody answers at": (["--ray-address", "127.0.0.1:1"],
                                        "--ray-address=127.0.0.1:1: no Ray cluster answers at 127.0.0.1:1"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_ends_before_ray_in_one_sentence(case, bad_files, tmp_path):
    args, needle = CASES[case]
    ro = tmp_path / "ro"
    ro.mkdir()
    prefix: list[str] | None = []
    if case == "read-only checkpoint dir":
        prefix, how = _readonly_prefix(ro)
        if prefix is None:  # neither mode bits nor a mount can make a folder read-only here
            ro = "/proc"
            prefix = []
    fill = dict(d=str(bad_files), ro=str(ro), many=str((os.cpu_count() or 1) + 1))
    base = ["--device", "cpu", "--model", "tiny", "--seq-len", "16", "--batch-size", "2", "--no-progress",
            "--out-dir", str(tmp_path / "out")]
    if "--train-file" not in args and "--synthetic-data" not in args:
        base += ["--train-file", f"{bad_files}/good.bin"]
    argv = base + [a.format(**fill) for a in args]
    before_bad, before_tmp = _snapshot(bad_files), _snapshot(tmp_path)
    rc, out, err, seconds = _run_cli(argv, tmp_path, prefix)
    TIMES[case] = seconds
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2, (rc, out, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert needle.format(**fill) in lines[0], (needle, lines[0])
    assert "Traceback" not in err
    assert "RAY_IMPORTED=False" in out, out
    assert not (tmp_path / "raytmp").exists()  # Ray never made its session folder
    assert not (tmp_path / "out").exists()
    assert _snapshot(bad_files) == before_bad
    assert _snapshot(tmp_path) == before_tmp


def test_a_ray_address_file_of_a_gone_cluster_ends_before_ray_in_one_sentence(bad_files, tmp_path):
    """A `ray start` whose cluster is gone left its address in RAY_TMPDIR/ray/ray_current_cluster: ray.init()
    would try to join it; the run says so in one sentence instead, naming the file (llmq_ray/train/ray_target.py)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once the socket is closed
    (tmp_path / "raytmp" / "ray").mkdir(parents=True)
    (tmp_path / "raytmp" / "ray" / "ray_current_cluster").write_text(address)
    before = _snapshot(tmp_path)
    rc, out, err, seconds = _run_cli(["--device", "cpu", "--model", "tiny", "--seq-len", "16", "--batch-size", "2",
                                      "--no-progress", "--train-file", f"{bad_files}/good.bin",
                                      "--out-dir", str(tmp_path / "out")], tmp_path)
    TIMES["a Ray address file of a gone cluster"] = seconds
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1, (rc, out, err)
    assert lines[0] == (f"error: Ray's address file {tmp_path}/raytmp/ray/ray_current_cluster names a cluster at "
                        f"{address} that does not answer (its `ray start` is gone): start it again, delete the file "
                        f"(as `ray stop` does), or pass --ray-address=local for a fresh Ray instance."), lines[0]
    assert "RAY_IMPORTED=False" in out, out
    assert _snapshot(tmp_path) == before  # no Ray session folder, no out-dir


@pytest.mark.parametrize("backend", ["triton", "cupy"])
def test_a_gpu_backend_on_a_cpu_only_machine_ends_before_ray_in_under_2_s(backend, bad_files, tmp_path, monkeypatch):
    """--backend triton/cupy with the default --device=auto on a machine without a GPU (CUDA_VISIBLE_DEVICES=""
    hides any): refused in the pre-flight, in one sentence naming the flag, in under 2 s, exit code 2 (it was
    refused after Ray had started, 21-37 s in, before)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    rc, out, err, seconds = _run_cli(["--model", "tiny", "--seq-len", "16", "--batch-size", "2", "--no-progress",
                                      "--train-file", f"{bad_files}/good.bin", "--out-dir", str(tmp_path / "out"),
                                      "--backend", backend], tmp_path)
    TIMES[f"--backend {backend} on a CPU-only machine"] = seconds
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1, (rc, out, err)
    assert lines[0] == (f"error: --backend={backend} needs a GPU and this machine has none (NVML finds none); use "
                        f"--backend=torch, or --ray-address of a Ray cluster with GPUs."), lines[0]
    assert "RAY_IMPORTED=False" in out, out
    assert not (tmp_path / "raytmp").exists() and not (tmp_path / "out").exists()
    assert seconds < 2.0, seconds


def test_oversubscription_warns_and_suggests_workers(tmp_path):
    """Two CPU workers with two cores each on the 2-core machine: a warning naming --workers (not an error)."""
    from llmq_ray.train.preflight import check_local_resources

    cpus = os.cpu_count() or 1
    notes = check_local_resources("cpu", cpus, 0, 2)
    assert len(notes) == 1 and "oversubscribes" in notes[0] and "--workers" in notes[0]
    assert check_local_resources("cpu", 1, 0, 1) == []


def test_print_wall_times():
    """Not a check: the wall time of every case above, for the record (run with -s to see it)."""
    if TIMES:
        width = max(map(len, TIMES))
        print("\npre-flight wall times (2-core machine target: < 3 s)")
        for case, s in TIMES.items():
            print(f"  {case:<{width}}  {s:5.2f} s")


def test_large_files_are_sampled_within_a_budget(tmp_path, monkeypatch):
    """Above FULL_SCAN_TOKENS a shard's ids are checked in 64 evenly spaced runs (the error names the true
    token index); once SCAN_BUDGET_TOKENS ids were read, later files get their header and size checked only."""
    from llmq_ray.train import preflight
    from llmq_ray.errors import DataError

    monkeypatch.setattr(preflight, "FULL_SCAN_TOKENS", 1000)
    monkeypatch.setattr(preflight, "SAMPLE_TOKENS", 64 * 10)
    toks = np.zeros(10_000, dtype=np.int32)
    toks[9_995] = 700  # inside the last run [9990, 10000)
    write_shard(str(tmp_path / "a.bin"), toks, 1024)
    with pytest.raises(DataError, match=r"a\.bin: token id 700 at token index 9995 \(byte offset 41004\)"):
        preflight.check_token_files(str(tmp_path / "a.bin"), "--train-file", 512)
    toks[9_995], toks[5_000] = 0, 700  # between two runs: not sampled
    write_shard(str(tmp_path / "a.bin"), toks, 1024)
    assert preflight.check_token_files(str(tmp_path / "a.bin"), "--train-file", 512)[1] == 10_000
    monkeypatch.setattr(preflight, "SCAN_BUDGET_TOKENS", 900)
    write_shard(str(tmp_path / "b.bin"), np.full(800, 600, dtype=np.int32), 1024)
    write_shard(str(tmp_path / "c.bin"), np.full(800, 600, dtype=np.int32), 1024)
    with pytest.raises(DataError, match=r"b\.bin: token id 600 at token index 0"):  # scanned: within budget
        preflight.check_token_files(str(tmp_path / "[bc].bin"), "--train-file", 512)
    write_shard(str(tmp_path / "b.bin"), np.zeros(800, dtype=np.int32), 1024)
    files, total = preflight.check_token_files(str(tmp_path / "[bc].bin"), "--train-file", 512)
    assert total == 1600  # c.bin's bad ids are past the budget: left to the workers' full check


def test_local_gpu_count_honours_cuda_visible_devices(monkeypatch):
    """NVML counts every GPU of the machine; CUDA_VISIBLE_DEVICES limits what this process may use."""
    import types

    from llmq_ray.train import preflight

    fake = types.SimpleNamespace(nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 4)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert preflight.local_gpu_count() == 4
    for visible, want in (("", 0), ("1,3", 2), ("0,-1,2", 1), ("0,1,2,3,4,5", 4)):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        assert preflight.local_gpu_count() == want, visible


def test_a_flag_that_needs_an_optional_package_names_the_extra(monkeypatch, tmp_path):
    """wandb, matplotlib and nvidia-ml-py are extras: a flag that needs a missing one says which to install,
    before Ray starts; without NVML the local GPUs are counted from the driver's /proc listing."""
    import importlib.util

    from llmq_ray.train import preflight
    from llmq_ray.errors import ConfigError
    from llmq_ray.train.trainer import LLMQTrainer

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("wandb", "pynvml")
                        else real(name, *a))
    kw = dict(device="cpu", synthetic_data=True, out_dir=str(tmp_path), verbose=False)
    with pytest.raises(ConfigError, match=r"^wandb_project=p needs the wandb package: pip install 'llmq-ray\[wandb\]'"):
        LLMQTrainer(wandb_project="p", **kw)
    with pytest.raises(ConfigError, match=r"^log_gpu_util=5 needs .* pip install 'llmq-ray\[gpu\]'"):
        LLMQTrainer(log_gpu_util=5, **kw)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    listing = tmp_path / "gpus"
    listing.mkdir()
    for bus in ("0000:18:00.0", "0000:2a:00.0"):
        (listing / bus).mkdir()
    real_listdir = os.listdir
    monkeypatch.setattr(preflight.os, "listdir",
                        lambda p: real_listdir(listing) if p == "/proc/driver/nvidia/gpus" else real_listdir(p))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert preflight.local_gpu_count() == 2


def test_a_ray_job_without_a_stop_grace_is_warned(monkeypatch, tmp_path):
    """As a Ray job's entrypoint (``ray job submit`` sets RAY_JOB_CONFIG_JSON_ENV_VAR), a RAY_JOB_STOP_WAIT_TIME_S
    left at Ray's 3 s or set below a minute gets one warning naming the variable and where to set it; a minute or
    more, no checkpoint on exit, or not a job: none."""
    from llmq_ray.train.preflight import check_ray_job_stop_grace
    from llmq_ray.train.trainer import LLMQTrainer

    job = {"RAY_JOB_CONFIG_JSON_ENV_VAR": "{}"}
    assert check_ray_job_stop_grace({}) == []
    assert check_ray_job_stop_grace({"RAY_JOB_STOP_WAIT_TIME_S": "1"}) == []  # not a job: Ray never reads it
    (unset,) = check_ray_job_stop_grace(job)
    assert "RAY_JOB_STOP_WAIT_TIME_S is unset, so Ray's default of 3 s" in unset and "env_vars" in unset
    (short,) = check_ray_job_stop_grace({**job, "RAY_JOB_STOP_WAIT_TIME_S": "30"})
    assert "RAY_JOB_STOP_WAIT_TIME_S is 30 s" in short and "SIGKILL" in short
    (bad,) = check_ray_job_stop_grace({**job, "RAY_JOB_STOP_WAIT_TIME_S": "ten"})
    assert "RAY_JOB_STOP_WAIT_TIME_S='ten' is not a whole number" in bad
    assert check_ray_job_stop_grace({**job, "RAY_JOB_STOP_WAIT_TIME_S": "60"}) == []

    kw = dict(device="cpu", synthetic_data=True, out_dir=str(tmp_path), verbose=False)
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")
    monkeypatch.delenv("RAY_JOB_STOP_WAIT_TIME_S", raising=False)
    assert [n for n in LLMQTrainer(**kw).notes if "RAY_JOB_STOP_WAIT_TIME_S" in n] == [unset]
    assert not [n for n in LLMQTrainer(checkpoint_on_exit=False, **kw).notes if "RAY_JOB_STOP_WAIT_TIME_S" in n]
    monkeypatch.setenv("RAY_JOB_STOP_WAIT_TIME_S", "600")
    assert not [n for n in LLMQTrainer(**kw).notes if "RAY_JOB_STOP_WAIT_TIME_S" in n]


def test_forward_env_naming_an_unset_variable_is_warned(monkeypatch, tmp_path):
    """--forward-env names a variable the driver does not have: one warning naming it (nothing to forward)."""
    from llmq_ray.train.trainer import LLMQTrainer

    monkeypatch.delenv("LLMQ_TEST_UNSET", raising=False)
    monkeypatch.setenv("LLMQ_TEST_SET", "1")
    kw = dict(device="cpu", synthetic_data=True, out_dir=str(tmp_path), verbose=False)
    notes = LLMQTrainer(forward_env="LLMQ_TEST_SET, LLMQ_TEST_UNSET", **kw).notes
    assert [n for n in notes if "--forward-env" in n] == [
        "--forward-env names LLMQ_TEST_UNSET, which is not set here, so the workers do not get it."]


def test_an_unreachable_gcs_store_is_refused_in_bounded_time(monkeypatch, tmp_path):
    """gs:// without credentials on a machine outside Google Cloud: pyarrow's GCS client retries for 15 minutes by
    default (the run hung that long before a word); the check before the run bounds its retries (here to 2 s) and
    ends in one sentence naming the flag. A URI that sets retry_limit_seconds keeps its own."""
    from llmq_ray import storage
    from llmq_ray.errors import ConfigError
    from llmq_ray.train.trainer import LLMQTrainer

    assert storage._probe_uri("gs://b/x") == f"gs://b/x?retry_limit_seconds={storage.PROBE_RETRY_S}"
    assert storage._probe_uri("gs://b/x?scheme=http") == f"gs://b/x?scheme=http&retry_limit_seconds={storage.PROBE_RETRY_S}"
    assert storage._probe_uri("gs://b/x?retry_limit_seconds=3") == "gs://b/x?retry_limit_seconds=3"
    assert storage._probe_uri("s3://b/x") == "s3://b/x"
    for var in ("GOOGLE_APPLICATION_CREDENTIALS", "STORAGE_EMULATOR_HOST", "CLOUDSDK_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no gcloud credentials of this machine's user
    monkeypatch.setattr(storage, "PROBE_RETRY_S", 2)
    kw = dict(device="cpu", model="tiny", synthetic_data=True, out_dir=str(tmp_path / "out"), verbose=False)
    for over, flag in ((dict(out_dir="gs://no-such-bucket/run"), "out_dir"),
                       (dict(synthetic_data=False, train_file="gs://no-such-bucket/data/*.bin"), "train_file")):
        t0 = time.monotonic()
        with pytest.raises(ConfigError, match=rf"^{flag}='gs://no-such-bucket/[^']*': cannot reach it"):
            LLMQTrainer(**{**kw, **over})
        assert time.monotonic() - t0 < 60
