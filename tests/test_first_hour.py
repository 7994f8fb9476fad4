"""The first hour of a new user on CPU (issue 52, Build item 6), each point as the user meets it.

* A plain CPU run (``examples/train.py`` in a process of its own, its own local Ray, Ray Data reading the train
  file, ``RAY_AUTH_MODE`` unset as on a fresh machine) prints none of Ray's routine lines: no token-auth notice
  (token authentication itself stays on: Ray writes the cluster's token), none of Ray Data's per-dataset lines,
  no ``GPUWorker`` label on CPU workers.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

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
    try:
        p = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=400)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    text = p.stdout + p.stderr
    assert p.returncode == 0, text
    assert "[T] step     2 " in p.stdout, text  # it trained, with Ray Data reading the batches
    seen = [needle for needle in ROUTINE_LINES if needle in text]
    assert not seen, (seen, text)
    assert (home / ".ray" / "auth_token").is_file(), "token authentication stays on (Ray made the token)"
