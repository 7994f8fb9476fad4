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

Usage::

    def test_something(ray_cluster):
        import ray
        assert ray.is_initialized()
"""

import os
import shutil

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

# Triton reads TRITON_INTERPRET when it is first imported, and any test module (or library code under test)
# may be the first to import it: on a machine without CUDA, turn the interpreter on before any of them.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

RAY_NUM_CPUS = 4
RAY_OBJECT_STORE_BYTES = 256 * 1024 * 1024


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray instance shared by the session; yields the ``ray`` module."""
    import ray

    temp_dir = f"/tmp/rayt-{os.getpid()}"
    started = False
    if not ray.is_initialized():
        ray.init(
            num_cpus=RAY_NUM_CPUS,
            object_store_memory=RAY_OBJECT_STORE_BYTES,
            _temp_dir=temp_dir,
            include_dashboard=False,
            _system_config={"metrics_report_interval_ms": 1000},
            log_to_driver=False,
            configure_logging=False,
        )
        started = True
    try:
        yield ray
    finally:
        if started:
            ray.shutdown()
            shutil.rmtree(temp_dir, ignore_errors=True)
