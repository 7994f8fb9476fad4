"""Shared pytest fixtures.

``ray_cluster`` (session scope): one local Ray instance for the whole test session, started on first use
and shut down at the end. ``ray.init`` costs 2-4 s on the 2-core CI machine, so every test that needs Ray
should take this fixture rather than calling ``ray.init`` itself.

  - num_cpus=4: more CPUs than any test's actors reserve, so Ray Data always has a CPU for its tasks
    (Ray Data hangs silently when actors hold every CPU Ray knows of);
  - object_store_memory=256 MB, a short ``_temp_dir`` (/tmp/rayt-<pid>; pytest's tmp_path exceeds the
    107-byte Unix-socket path limit), no dashboard;
  - ``metrics_report_interval_ms=1000``: ray.util.metrics reach the node's metrics endpoint (which runs
    without the dashboard) within about a second instead of Ray's default 10 s;
  - loopback only, no usage stats, token auth off: set in os.environ at import, before Ray is imported
    anywhere, so that worker processes inherit them.

``RAY_TMPDIR`` (set at import): a Ray temp root of this pytest process's own (/tmp/rayp*, removed at the end), so
that the Ray instances its tests start (a CLI run's local Ray, a simulated cluster) keep their session folders and
``ray_current_cluster`` apart from those of the other pytest-xdist process and of any Ray the user runs. Ray
names in ``<RAY_TMPDIR>/ray/ray_current_cluster`` the cluster that started last, and a plain ``ray.init()`` (as
the CLI does) connects to it: with one shared /tmp/ray, a test's run could land on the other process's simulated
cluster, which removes nodes on purpose.

Usage::

    def test_something(ray_cluster):
        import ray
        assert ray.is_initialized()

``shards`` (session scope): the small token files the runtime tests train on (see its docstring).

``pytest_cmdline_main``: without a ``-n`` of the user's, the suite runs in ``xdist_processes()`` processes (one
more than the cores, at most 4, or as many as the cores on a busy machine; pytest-xdist, ``--dist loadfile``: each
module in one process, so its shared fixtures are made once) where pytest-xdist is installed, there are 2+ cores and no CUDA; most of it is end-to-end Ray runs whose
waits a third process fills. On a CUDA machine it stays one process (the GPU tests would share one GPU); so it
does where pytest-xdist is missing (the GPU machine's image), which is why this is not in pyproject's addopts.

The suite's time budget (``SUITE_BUDGET_S``, stated in the README): at the end of a full run (no -k, no -m but
pyproject's, no path but tests/) ``pytest_terminal_summary`` prints the run's wall time against it and the five slowest
tests (set-up + call + tear-down, from the reports pytest keeps); a line to read, never an assertion.
What the suite spends its time on, measured: docs/performance.md ("The test suite's running time").

``s3`` (module scope): a real S3 server (moto's server mode) on a random local port, with the bucket
"bucket"; yields a pyarrow S3FileSystem to administer it (see its docstring). Skips without moto[server].
"""

import os
import pathlib
import shutil
import tempfile
import time
from typing import NamedTuple

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# every Ray instance the tests start (the session's, a CLI run's own, each node of a simulated cluster) would start
# one idle Python worker per CPU for its first driver; the run's actors never use them (their runtime_env sets
# thread counts, so Ray starts processes of their own), and on 2 cores each idle one costs 0.4-0.6 s of CPU
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
# the suite starts some 600 Python processes (Ray actors, gloo ranks, CLI runs); with PYTHONDONTWRITEBYTECODE set
# (some images set it) each one compiles llmq-ray's sources again, 0.1 CPU-s apiece: let them keep the bytecode
# (in __pycache__/ folders, which .gitignore lists)
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
    import sys

    sys.dont_write_bytecode = False

# Triton reads TRITON_INTERPRET when it is first imported, and any test module (or library code under test)
# may be the first to import it: on a machine without CUDA, turn the interpreter on before any of them.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# one level under the user's RAY_TMPDIR (or the system temp folder), also in the pytest-xdist worker processes,
# which inherit the controller's RAY_TMPDIR: Ray's socket paths under it must stay within 107 bytes
_RAY_TMP_BASE = os.environ.setdefault("LLMQ_TESTS_RAY_TMP_BASE", os.environ.get("RAY_TMPDIR") or tempfile.gettempdir())
RAY_TMP_ROOT = tempfile.mkdtemp(prefix="rayp", dir=_RAY_TMP_BASE)
os.makedirs(os.path.join(RAY_TMP_ROOT, "ray"))  # ray.cluster_utils.Cluster writes ray_current_cluster there
os.environ["RAY_TMPDIR"] = RAY_TMP_ROOT

import pytest  # noqa: E402

RAY_NUM_CPUS = 4


def xdist_processes() -> int:
    """pytest-xdist processes by default: one more than the cores (at most 4), as many as the cores when the
    machine is busy already (a load average above its cores + 1: another suite beside this one). The suite's
    end-to-end runs wait a fifth of their time (injected slow steps and hangs, step time-outs, Ray's start-up):
    on the idle 2-core machine 3 processes took 545 s where 2 took 650 s; two suites of 3 beside each other put a
    load of 37 on 2 cores."""
    cores = os.cpu_count() or 1
    busy = hasattr(os, "getloadavg") and os.getloadavg()[0] > cores + 1
    return min(cores if busy else cores + 1, 4)
RAY_OBJECT_STORE_BYTES = 256 * 1024 * 1024


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config) -> None:
    """xdist_processes() pytest-xdist processes by default (see the module docstring); before xdist reads its options."""
    if hasattr(config, "workerinput"):  # an xdist worker (whose -n xdist resets to None): it runs its share
        return
    if (config.pluginmanager.hasplugin("xdist") and config.option.numprocesses is None
            and (os.cpu_count() or 1) >= 2 and not torch.cuda.is_available()):
        config.option.numprocesses = xdist_processes()
        if config.option.dist == "no":
            config.option.dist = "loadfile"


def pytest_configure(config) -> None:
    """In a pytest-xdist process: torch's own compute in this process (the engine tests, the reference runs) on
    its share of the cores, cores / processes threads: two processes of two threads each on two cores cost about a
    fifth more CPU for the same work (the threads wait on each other), and the suite is CPU-bound."""
    processes = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if processes > 1 and not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // processes))


def pytest_unconfigure(config) -> None:
    shutil.rmtree(RAY_TMP_ROOT, ignore_errors=True)


# --- the suite's time budget (a line to read at the end of a full run; timing never fails a test) ---
SUITE_BUDGET_S = 600
SLOWEST_SHOWN = 5
_session_started: list[float] = []


def pytest_sessionstart(session) -> None:
    _session_started.append(time.monotonic())


def _is_full_run(config) -> bool:
    """No test selection of the user's: no -k, no -m but pyproject's "not gpu", no --lf/--sw, and no path but the
    tests folder or the root."""
    opt = config.option
    if opt.keyword or opt.markexpr not in ("", "not gpu") or getattr(opt, "lf", False) \
            or getattr(opt, "stepwise", False):
        return False
    root = pathlib.Path(str(config.rootpath)).resolve()
    here = pathlib.Path(__file__).resolve().parent
    return all(pathlib.Path(arg).resolve() in (root, here) for arg in config.args)


@pytest.hookimpl(trylast=True)  # after --durations' table: the last line above pytest's own summary
def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if hasattr(config, "workerinput") or not _session_started or not _is_full_run(config):
        return
    total = time.monotonic() - _session_started[0]
    seconds: dict[str, float] = {}  # set-up + call + tear-down per test, from the reports pytest keeps
    for reports in terminalreporter.stats.values():
        for report in reports:
            if isinstance(report, pytest.TestReport):  # not a module's CollectReport (a skip at import has no duration)
                seconds[report.nodeid] = seconds.get(report.nodeid, 0.0) + report.duration
    slowest = sorted(seconds.items(), key=lambda item: -item[1])[:SLOWEST_SHOWN]
    verdict = "within" if total <= SUITE_BUDGET_S else "OVER"
    terminalreporter.write_line(
        f"suite time: {total:.0f} s for {len(seconds)} tests run, {verdict} the {SUITE_BUDGET_S} s budget "
        f"(README, Tests); slowest: " + "; ".join(f"{nodeid} {sec:.0f} s" for nodeid, sec in slowest))


def session_ray_temp_dir() -> str:
    return os.path.join(tempfile.gettempdir(), f"rayt-{os.getpid()}")


def start_session_ray() -> None:
    """``ray.init`` of the session's local Ray instance (see the module docstring). Also called by a test module
    that shut it down to run a cluster of its own (tests/test_zero_scope.py), to leave it as it found it."""
    import ray

    # the instance's processes must not inherit a test module's LLMQ_RAY_CACHE (the s3 fixture sets one per module):
    # a node's own LLMQ_RAY_CACHE wins over the driver's, so a later module's runs would stage in the first one's
    cache = os.environ.pop("LLMQ_RAY_CACHE", None)
    try:
        ray.init(
            num_cpus=RAY_NUM_CPUS,
            object_store_memory=RAY_OBJECT_STORE_BYTES,
            _temp_dir=session_ray_temp_dir(),
            include_dashboard=False,
            _system_config={"metrics_report_interval_ms": 1000},
            log_to_driver=False,
            configure_logging=False,
        )
    finally:
        if cache is not None:
            os.environ["LLMQ_RAY_CACHE"] = cache


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray instance shared by the session; yields the ``ray`` module."""
    import ray

    started = False
    if not ray.is_initialized():
        start_session_ray()
        started = True
    try:
        yield ray
    finally:
        if started:
            ray.shutdown()
            shutil.rmtree(session_ray_temp_dir(), ignore_errors=True)


class RuntimeShards(NamedTuple):
    train: str   # path of train.bin
    eval: str    # path of eval.bin
    folder: pathlib.Path  # the folder holding both


@pytest.fixture(scope="session")
def shards(tmp_path_factory) -> RuntimeShards:
    """train.bin: 4,000 tokens (vocab 512) of a noisy periodic sequence -- learnable, so losses move; 235
    windows of 17 (seq_len 16), so short runs cross no epoch boundary. eval.bin: its first 1,200 tokens."""
    import numpy as np

    from llmq_ray.data_pipeline.shards import write_shard

    folder = tmp_path_factory.mktemp("shards")
    rng = np.random.default_rng(0)
    toks = (np.arange(4000) * 7 % 512).astype(np.int32)
    noise = rng.random(4000) < 0.1
    toks[noise] = rng.integers(0, 512, noise.sum())
    write_shard(str(folder / "train.bin"), toks, 512)
    write_shard(str(folder / "eval.bin"), toks[:1200], 512)
    return RuntimeShards(str(folder / "train.bin"), str(folder / "eval.bin"), folder)


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 server with the bucket "bucket"; the environment points every client (pyarrow, the CLI's
    subprocesses and their Ray workers) at it; LLMQ_RAY_CACHE is this module's own cache folder."""
    moto_server = pytest.importorskip("moto.server", reason="the object-store tests need moto[server] (dev extra)")
    import pyarrow.fs as pafs

    from llmq_ray.actors.collectives import free_port

    port = free_port("127.0.0.1")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = dict(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test",
               AWS_DEFAULT_REGION="us-east-1", LLMQ_RAY_CACHE=str(tmp_path_factory.mktemp("cache")))
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    admin = pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{port}", scheme="http", access_key="test",
                              secret_key="test", region="us-east-1", allow_bucket_creation=True)
    admin.create_dir("bucket")
    try:
        yield admin
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()
