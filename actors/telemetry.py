"""Ray metrics (``ray.util.metrics``) that workers and the coordinator publish for the Ray dashboard.

Ray exports them in Prometheus format on each node's metrics endpoint (``ray_<name>``, e.g.
``ray_llmq_worker_tokens_per_second{rank="0",run_id="20261126-031904-a1b2c3",...}``), which the dashboard's
Metrics tab (through Prometheus/Grafana) and any scraper read. Every metric carries the run's ``run_id`` tag
(``set_run_id``, called once per process by the coordinator and each worker with ``RunPlan.run_id``), so
the runs that share a cluster (and a Prometheus) are told apart. Gauges are created lazily, once per process;
outside a Ray worker process (plain unit tests) everything here is a no-op.
"""

from __future__ import annotations

import math

import os

_GAUGES: dict = {}
_RUN_ID: list = [""]  # this process's run (set_run_id); "" before it is known

WORKER_METRICS = {
    "llmq_worker_tokens_per_second": "tokens/s processed by this worker in its last train_step",
    "llmq_worker_step_seconds": "seconds this worker spent inside its last train_step (all micro-steps + update)",
    "llmq_worker_loss": "mean target loss of the last optimizer step (same on every rank)",
    "llmq_worker_memory_bytes": "device memory of this worker: peak allocated on CUDA, resident set on CPU",
}
COORDINATOR_METRICS = {
    "llmq_tokens_per_second": "tokens/s of the whole run (all workers) in the last step, by coordinator wall time",
    "llmq_step_seconds": "coordinator wall time of the last optimizer step",
    "llmq_train_loss": "mean target loss of the last optimizer step",
    "llmq_grad_norm": "global gradient L2 norm of the last optimizer step",
    "llmq_eval_loss": "mean target loss of the last evaluation",
}


def _gauge(name: str, description: str, tag_keys: tuple):
    g = _GAUGES.get(name)
    if g is None:
        from ray.util.metrics import Gauge

        g = _GAUGES[name] = Gauge(name, description=description, tag_keys=tag_keys)
    return g


def set_run_id(run_id: str) -> None:
    """The run this process works for: its ``run_id`` becomes a tag of every metric ``publish`` sets."""
    _RUN_ID[0] = run_id or ""


def publish(values: dict, tags: dict) -> None:
    """Set gauges ``name -> value`` with ``tags`` (e.g. {"rank": "0"}) and the ``run_id`` tag (``set_run_id``);
    unknown names ignored."""
    tags = {**tags, "run_id": _RUN_ID[0]}
    try:
        import ray

        if not ray.is_initialized():
            return
    except ImportError:
        return
    described = {**WORKER_METRICS, **COORDINATOR_METRICS}
    try:
        for name, value in values.items():
            if name in described and value is not None:
                _gauge(name, described[name], tuple(sorted(tags))).set(float(value), tags=tags)
    except Exception:  # noqa: BLE001 - metrics are best effort (core-only Ray builds export none)
        pass


ALLOCATOR_EVENTS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")


def allocator_events(device) -> dict[str, int]:
    """Counters of the CUDA caching allocator's expensive events so far (retries after an OOM, cudaMalloc /
    cudaFree calls, full-device syncs): a step whose count grows paid for them. {} off CUDA."""
    import torch

    if getattr(device, "type", str(device)) != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {k: int(stats.get(k, 0)) for k in ALLOCATOR_EVENTS}


def memory_bytes(device) -> int:
    """Peak allocated device memory on CUDA, else this process's resident set size."""
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        import psutil

        return int(psutil.Process(os.getpid()).memory_info().rss)
    except Exception:  # noqa: BLE001
        return 0


def merge_fp8_monitors(monitors: list[list[float]]) -> tuple[list[float], int]:
    """The ranks' FP8 monitors ([L] floats each) -> (per layer the largest over ranks, the index of the largest
    layer). NaN wins everywhere (an overflow must not hide behind another rank's finite value, as Python's max
    would let it depending on the order)."""
    per_layer = [math.nan if any(math.isnan(v) for v in vs) else max(vs) for vs in zip(*monitors)]
    nan_layers = [i for i, v in enumerate(per_layer) if math.isnan(v)]
    top = nan_layers[0] if nan_layers else max(range(len(per_layer)), key=per_layer.__getitem__)
    return per_layer, top


def merge_saturated_shares(monitors: list[dict]) -> list[float] | None:
    """The ranks' saturated shares ({"saturated_share": [L] or None, "saturated_elements": n} each) -> per layer
    the share over all ranks' elements (a rank that counted none adds nothing); None when no rank counted any
    (no pass at delayed scales: not measured, rather than zero)."""
    counted = [m for m in monitors if m["saturated_elements"]]
    if not counted:
        return None
    total = sum(m["saturated_elements"] for m in counted)
    return [sum(m["saturated_elements"] * m["saturated_share"][i] for m in counted) / total
            for i in range(len(counted[0]["saturated_share"]))]
