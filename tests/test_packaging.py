"""The built wheel installs one import package, ``llmq_ray``, and works without the source checkout.

The repository keeps ``backends/``, ``actors/`` and ``data_pipeline/`` at its top level, but ``pyproject.toml``
installs them as ``llmq_ray.backends``, ``llmq_ray.actors`` and ``llmq_ray.data_pipeline``, so a user's
environment gains no generic top-level names. This test builds the wheel (no dependencies, no build isolation:
about a second), unpacks it into a folder of its own and runs Python from a folder outside the repository with
only that folder put in front of the path: ``import backends`` / ``actors`` / ``data_pipeline`` fail there, and
the console entry point (``llmq-train --help``) and ``python -m llmq_ray.data_pipeline.tokenize --help`` work.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_wheel_has_one_top_level_package_and_runs_from_itself(tmp_path):
    out, src = tmp_path / "wheel", tmp_path / "src"
    # build from a copy: setuptools writes build/ and *.egg-info/ next to the sources
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", "build", "runs", ".whl", "out", "*.egg-info",
                                                              "__pycache__", ".pytest_cache"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = list(out.glob("llmq_ray-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        info = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
        assert z.read(info).decode().split() == ["llmq_ray"]
        assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"llmq_ray"}
        for needed in ("llmq_ray/backends/cupy/kernels/adamw.cu", "llmq_ray/data_pipeline/corpora/tinyshakespeare.txt.gz",
                       "llmq_ray/actors/worker.py", "llmq_ray/backends/triton/__init__.py", "llmq_ray/settings/tree.py",
                       "llmq_ray/engine/schedule.py", "llmq_ray/model/layers/units.py", "llmq_ray/parallel/data.py",
                       "llmq_ray/train/cli.py",
                       "llmq_ray/observe/runlog.py", "llmq_ray/checkpoints/verify.py", "llmq_ray/backends/gemm.py"):
            assert needed in names, needed
        entry = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
        assert "llmq-train = llmq_ray.train.cli:main" in entry
        z.extractall(tmp_path / "site")
    # a Python that sees the unpacked wheel first and the repository not at all (cwd elsewhere, no PYTHONPATH to it)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(tmp_path / "site")
    run = dict(cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    check = ("import sys, importlib.util, llmq_ray\n"
             "assert llmq_ray.__file__.startswith(sys.argv[1]), llmq_ray.__file__\n"
             "for name in ('backends', 'actors', 'data_pipeline'):\n"
             "    assert importlib.util.find_spec(name) is None, name\n"
             "import llmq_ray.backends, llmq_ray.actors.plan, llmq_ray.data_pipeline.shards\n"
             "assert llmq_ray.backends.__file__.startswith(sys.argv[1])\n")
    p = subprocess.run([sys.executable, "-c", check, str(tmp_path / "site")], **run)
    assert p.returncode == 0, p.stderr
    p = subprocess.run([sys.executable, "-c", "import sys; from llmq_ray.train.cli import main; sys.argv[0] = 'llmq-train'; "
                        "main(['--help'])"], **run)
    assert p.returncode == 0 and "--checkpoint-dir" in p.stdout, p.stderr
    p = subprocess.run([sys.executable, "-m", "llmq_ray.data_pipeline.tokenize", "--help"], **run)
    assert p.returncode == 0 and "--input" in p.stdout, p.stderr
