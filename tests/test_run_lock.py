"""One run at a time per output folder (llmq_ray/train/run_lock.py), and nothing moved before a run starts.

Two runs into one --out-dir (a command typed twice, a scheduler's retry while the first still runs) set each
other's log, export and checkpoints aside and wrote, pruned and resumed from one checkpoint folder. Now the driver
holds an OS lock on the out-dir (and an explicit --checkpoint-dir) from the start of its run to its end; a second
run is refused in one sentence before Ray starts. And --print-config, which builds the trainer, no longer moves an
earlier run's checkpoints aside (a later --continue found none).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from llmq_ray.data_pipeline.shards import write_shard
from llmq_ray.errors import ConfigError
from llmq_ray.train import cli
from llmq_ray.train.run_lock import LOCK_NAME, RunLock, lock_inside
from llmq_ray.train.trainer import LLMQTrainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def train_file(tmp_path):
    path = str(tmp_path / "train-000.bin")
    write_shard(path, np.arange(2000, dtype=np.int32) % 512, 512)
    return path


def _micro_checkpoint(folder: str) -> None:
    """A step folder with a manifest: what makes a folder 'hold checkpoints' for the fresh-run check."""
    step = os.path.join(folder, "step_00000004")
    os.makedirs(step)
    with open(os.path.join(step, "manifest.json"), "w") as f:
        f.write("{}")


def test_a_second_trainer_into_the_same_folders_is_refused_until_the_first_ends(tmp_path, train_file):
    kw = dict(model="tiny", device="cpu", train_file=train_file, batch_size=2, seq_len=16, steps=2, verbose=False)
    first = LLMQTrainer(out_dir=str(tmp_path / "out"), **kw)
    first._lock_outputs()  # what start() does before Ray (the lock is all this test needs)
    assert os.path.isfile(tmp_path / "out" / LOCK_NAME)
    second = LLMQTrainer(out_dir=str(tmp_path / "out"), **kw)
    with pytest.raises(ConfigError, match=rf"^out_dir={tmp_path}/out is in use by another llmq-ray run \(it holds "
                                          rf"{tmp_path}/out/{LOCK_NAME}\); wait for that run to end, or pass "
                                          rf"another out_dir\.$"):
        second.start()
    # an explicit checkpoint folder is guarded as well, from a run with another out-dir
    shared = dict(checkpoint_dir=str(tmp_path / "ckpt"), **kw)
    a = LLMQTrainer(out_dir=str(tmp_path / "a"), **shared)
    a._lock_outputs()
    with pytest.raises(ConfigError, match=r"^checkpoint_dir=.*/ckpt is in use by another llmq-ray run"):
        LLMQTrainer(out_dir=str(tmp_path / "b"), **shared).start()
    free = RunLock()  # all or none: the refused run gave back the lock of its own out-dir
    free.acquire([(lock_inside(str(tmp_path / "b")), str(tmp_path / "b"), "--out-dir")])
    free.release()
    # the first run's default out/ckpt named as another run's --checkpoint-dir
    with pytest.raises(ConfigError, match=r"^checkpoint_dir=.*/out/ckpt is in use by another llmq-ray run \(it "
                                          r"holds .*/out/\.ckpt\.llmq-run\.lock\)"):
        LLMQTrainer(out_dir=str(tmp_path / "c"), checkpoint_dir=str(tmp_path / "out" / "ckpt"), **kw).start()
    first.close()
    a.close()
    second._lock_outputs()  # the first run ended: the folder is free
    assert second._run_lock.held
    second.close()
    assert not os.path.exists(tmp_path / "out" / LOCK_NAME)  # a run that ends removes its lock file


def test_a_run_of_another_process_holds_the_out_dir_and_the_cli_says_so_before_ray(tmp_path, train_file, capsys):
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from llmq_ray.train.run_lock import RunLock
        lock = RunLock()
        lock.acquire([({str(out / LOCK_NAME)!r}, {str(out)!r}, "--out-dir")])
        print("held", flush=True)
        sys.stdin.read()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)))
    try:
        assert holder.stdout.readline().strip() == "held"
        argv = ["--model", "tiny", "--device", "cpu", "--train-file", train_file, "--steps", "2", "--batch-size", "2",
                "--seq-len", "16", "--out-dir", str(out)]
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"error: --out-dir={out} is in use by another llmq-ray run (it holds {out}/{LOCK_NAME}); "
                       f"wait for that run to end, or pass another --out-dir."]
        assert sorted(os.listdir(out)) == [LOCK_NAME]  # nothing else written
    finally:
        holder.communicate("", timeout=30)  # the holder exits: the OS drops its lock
    lock_free = LLMQTrainer(model="tiny", device="cpu", train_file=train_file, batch_size=2, seq_len=16, steps=2,
                            out_dir=str(out), verbose=False)
    lock_free._lock_outputs()
    lock_free.close()


def test_print_config_moves_no_earlier_checkpoints(tmp_path, train_file, capsys):
    out = tmp_path / "out"
    _micro_checkpoint(str(out / "ckpt"))
    argv = ["--model", "tiny", "--device", "cpu", "--train-file", train_file, "--out-dir", str(out), "--print-config"]
    assert cli.main(argv) == 0
    assert "out_dir" in capsys.readouterr().out
    assert sorted(os.listdir(out)) == ["ckpt"] and os.listdir(out / "ckpt") == ["step_00000004"]


def test_a_run_whose_workers_cannot_be_placed_moves_no_earlier_checkpoints(ray_cluster, tmp_path, train_file,
                                                                           monkeypatch):
    """The earlier run's checkpoints in the default out-dir/ckpt are moved aside just before the coordinator
    starts: a run refused after joining Ray (here the resource check) leaves them as they were, gives its locks
    back (also on an error that is not ours), and may be tried again."""
    from llmq_ray.actors import placement

    out = tmp_path / "out"
    _micro_checkpoint(str(out / "ckpt"))

    def no_room(spec):
        raise ConfigError("no room for the workers (stand-in for the resource check)")

    monkeypatch.setattr(placement, "check_resources", no_room)
    trainer = LLMQTrainer(model="tiny", device="cpu", train_file=train_file, batch_size=2, seq_len=16, steps=2,
                          out_dir=str(out), verbose=False)
    for _ in range(2):  # a failed start is no ended run: fit() may be tried again (and fails the same way here)
        with pytest.raises(ConfigError, match="^no room for the workers"):
            trainer.fit()
    assert sorted(os.listdir(out)) == ["ckpt"] and os.listdir(out / "ckpt") == ["step_00000004"]

    def broken(spec):
        raise RuntimeError("not an LLMQError")

    monkeypatch.setattr(placement, "check_resources", broken)
    with pytest.raises(RuntimeError):
        trainer.start()  # a step-level first call, no close(): the folders are given back all the same
    other = RunLock()
    other.acquire([(lock_inside(str(out)), str(out), "--out-dir")])
    other.release()


def test_an_older_filelock_without_the_new_keywords_still_locks(tmp_path, monkeypatch):
    """filelock 3.x (a GPU machine's torch environment may have it) has no fallback_to_soft / is_singleton: the
    lock is made without them and still refuses a second holder."""
    import filelock

    real = filelock.FileLock

    def old_style(path, **kwargs):
        if kwargs:
            raise TypeError(f"unexpected keyword arguments {sorted(kwargs)}")
        return real(path)

    monkeypatch.setattr(filelock, "FileLock", old_style)
    entry = [(lock_inside(str(tmp_path)), str(tmp_path), "--out-dir")]
    first, second = RunLock(), RunLock()
    first.acquire(entry)
    with pytest.raises(ConfigError, match=r"^--out-dir=.* is in use by another llmq-ray run"):
        second.acquire(entry)
    first.release()
    second.acquire(entry)
    second.release()
