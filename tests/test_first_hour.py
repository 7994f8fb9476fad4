"""The first hour of a new user on CPU (issue 52, Build item 6), each point as the user meets it.

* A plain CPU run (``examples/train.py`` in a process of its own, its own local Ray, Ray Data reading the train
  file, ``RAY_AUTH_MODE`` unset as on a fresh machine) prints none of Ray's routine lines: no token-auth notice
  (token authentication itself stays on: Ray writes the cluster's token), none of Ray Data's per-dataset lines,
  no ``GPUWorker`` label on CPU workers.
* Rerunning a demo into the same ``--out-dir`` keeps one earlier run's checkpoints and export beside the new ones
  and removes older ones in one line (``llmq_ray/train/earlier_outputs.py``), but never the checkpoints of a run
  that stopped before its last step (it can still be continued): those are kept, and a line says so.
* A full disk at the final checkpoint (the ``save_full`` fault, an ENOSPC in rank 0's write) still leaves the
  export, and the command exits with 1 (the run failed), not 2 (bad input), naming both in one sentence.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

from llmq_ray.train.earlier_outputs import prune_earlier_outputs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# what every run printed before (issue 52): Ray's token-auth notice, Ray Data's lines of each dataset, the
# GPU label of a CPU worker's log prefix
ROUTINE_LINES = ("Token authentication is enabled", "Starting execution of Dataset", "Execution plan of Dataset",
                 "Progress bars disabled", "execution finished", "GPUWorker")


def test_a_cpu_run_prints_none_of_rays_routine_lines(shards, tmp_path):
    home = tmp_path / "home"  # Ray writes the token it generates under ~/.ray: this test's own home
    home.mkdir()
    ray_tmp = tempfile.mkdtemp(prefix="rh")  # short: Ray's socket paths must stay under 107 bytes
    env = dict(os.environ, PYTHONPATH=REPO, RAY_TMPDIR=ray_tmp, HOME=str(home))
    env.pop("RAY_AUTH_MODE", None)  # as a user's shell: Ray's default (token authentication) applies
    argv = [sys.executable, os.path.join(REPO, "examples", "train.py"), "--device", "cpu", "--model", "tiny",
            "--workers", "1", "--batch-size", "2", "--seq-len", "16", "--steps", "2", "--train-file", shards.train,
            "--eval-file", shards.eval, "--no-export", "--no-progress", "--sample-tokens", "0",
            "--out-dir", str(tmp_path / "out")]
    try:  # (a start of Ray's that exceeds its fixed 30 s on a busy machine is tried again by the trainer itself)
        p = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=400)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    text = p.stdout + p.stderr
    assert p.returncode == 0, text
    assert "[T] step     2 " in p.stdout, text  # it trained, with Ray Data reading the batches
    seen = [needle for needle in ROUTINE_LINES if needle in text]
    assert not seen, (seen, text)
    assert (home / ".ray" / "auth_token").is_file(), "token authentication stays on (Ray made the token)"


def _checkpoints(folder, step: int, of_steps: int) -> None:
    """A fake set-aside checkpoint folder: step_<step> with a manifest of a run of ``of_steps`` steps."""
    (folder / f"step_{step:08d}").mkdir(parents=True)
    (folder / f"step_{step:08d}" / "manifest.json").write_text(
        json.dumps({"format": "llmq-ray-checkpoint", "step": step, "train_options": {"steps": of_steps}}))
    (folder / f"step_{step:08d}" / "rank_00000.safetensors").write_bytes(b"x" * 1000)


def test_earlier_runs_beyond_the_previous_one_are_removed_except_a_run_that_can_go_on(tmp_path):
    out = tmp_path / "out"
    _checkpoints(out / "ckpt.before-20261201T000000Z", 4, 4)          # finished: removed
    _checkpoints(out / "ckpt.before-20261201T000100Z", 812, 1000)     # stopped at 812 of 1000: kept
    _checkpoints(out / "ckpt.before-20261201T000200Z", 4, 4)          # the previous run's: kept
    for stamp in ("20261201T000000Z", "20261201T000100Z"):
        (out / f"export.before-{stamp}").mkdir()
        (out / f"export.before-{stamp}" / "model.safetensors").write_bytes(b"y" * 2000)
    (out / "export").mkdir()  # the previous run's export, which this run sets aside when it exports
    (out / "log.before-20261201T000000Z.jsonl").write_text("{}\n")
    lines = prune_earlier_outputs(str(out))
    assert sorted(os.listdir(out)) == ["ckpt.before-20261201T000100Z", "ckpt.before-20261201T000200Z", "export",
                                       "log.before-20261201T000000Z.jsonl"]
    assert len(lines) == 2, lines
    assert lines[0] == (f"earlier outputs: removed export.before-20261201T000000Z, export.before-20261201T000100Z, "
                        f"ckpt.before-20261201T000000Z (a finished run's checkpoints) from {out} (0 MB); a fresh run "
                        f"keeps the previous run's checkpoints and export beside its own")
    kept = out / "ckpt.before-20261201T000100Z"
    assert lines[1] == (f"earlier outputs: kept {kept}: its run stopped at step 812 of 1000 and can still be continued "
                        f"(--continue {kept}/step_00000812); delete it when it is no longer needed")
    assert prune_earlier_outputs(str(out)) == [lines[1]]  # nothing more to remove; the open run is named again
    shutil.rmtree(out / "export")  # no current export: the newest earlier one stays
    for stamp in ("20261201T000300Z", "20261201T000400Z"):
        (out / f"export.before-{stamp}").mkdir()
    prune_earlier_outputs(str(out))
    assert [n for n in sorted(os.listdir(out)) if n.startswith("export")] == ["export.before-20261201T000400Z"]


def test_a_fresh_run_into_an_used_out_dir_keeps_only_the_previous_runs_outputs(ray_cluster, shards, tmp_path, capsys):
    """Through the trainer: the older set is removed as the run starts (one line), the previous run's export is
    set aside when this run exports, and its checkpoint folder stays: one earlier set beside the new outputs."""
    from llmq_ray.train.trainer import LLMQTrainer

    out = tmp_path / "out"
    _checkpoints(out / "ckpt.before-20261201T000000Z", 2, 2)  # two runs ago, finished
    (out / "export.before-20261201T000000Z").mkdir()          # two runs ago
    _checkpoints(out / "ckpt", 2, 2)                           # the previous run's
    (out / "export").mkdir()
    (out / "export" / "config.json").write_text("{}")
    res = LLMQTrainer(model="tiny", train_file=shards.train, device="cpu", workers=1, batch_size=2, seq_len=16,
                      steps=2, warmup=0, out_dir=str(out), final_eval=False, use_ray_data=False, verbose=True,
                      progress=False, collective_timeout_s=15.0, call_timeout_s=60.0).fit()
    said = capsys.readouterr().out
    assert [ln for ln in said.splitlines() if ln.startswith("earlier outputs: ")] == [
        f"earlier outputs: removed export.before-20261201T000000Z, ckpt.before-20261201T000000Z (a finished run's "
        f"checkpoints) from {out} (0 MB); a fresh run keeps the previous run's checkpoints and export beside its own"]
    names = sorted(os.listdir(out))
    kept_ckpt = [n for n in names if n.startswith("ckpt.before-")]
    kept_export = [n for n in names if n.startswith("export.before-")]
    assert len(kept_ckpt) == 1 and kept_ckpt[0] != "ckpt.before-20261201T000000Z"
    assert os.listdir(out / kept_ckpt[0]) == ["step_00000002"]  # the previous run's checkpoints
    assert len(kept_export) == 1 and (out / kept_export[0] / "config.json").read_text() == "{}"
    assert res.export_path == str(out / "export") and os.listdir(out / "ckpt") == ["step_00000002"]


def test_a_full_disk_at_the_final_checkpoint_keeps_the_export_and_exits_1(ray_cluster, shards, tmp_path,
                                                                       monkeypatch, capsys):
    """The command line's run (``cli.main``, in this process: on the session's Ray); the fault reaches the worker
    through LLMQ_RAY_TEST_FAULT as in a CLI run of its own."""
    from llmq_ray.observe.runlog import read_log
    from llmq_ray.train import cli

    out = tmp_path / "out"
    monkeypatch.setenv("LLMQ_RAY_TEST_FAULT", json.dumps({"kind": "save_full", "rank": 0, "step": 2}))
    rc = cli.main(["--device", "cpu", "--model", "tiny", "--workers", "1", "--batch-size", "2", "--seq-len", "16",
                   "--steps", "2", "--train-file", shards.train, "--no-ray-data", "--no-progress", "--sample-tokens",
                   "0", "--no-final-eval", "--collective-timeout-s", "15", "--out-dir", str(out)])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert (f"error: rank 0: checkpoint step_00000002 could not be written to {out}/ckpt (No space left on device); "
            f"there is no earlier valid checkpoint in it; the export was written to {out}/export.") in err.splitlines(), err
    assert (out / "export" / "model.safetensors").is_file() and (out / "export" / "config.json").is_file()
    assert not (out / "ckpt" / "step_00000002").exists()
    end = read_log(str(out / "log.jsonl"))[-1]
    assert end["log"] == "end" and end["reason"] == "failed" and "No space left on device" in end["error"], end
