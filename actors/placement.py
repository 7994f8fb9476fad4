"""Placing one ``GPUWorker`` per GPU: a placement group of {GPU: 1, CPU: k} bundles, then the actors.

Strategy: ``STRICT_PACK`` when the whole run fits on one node (all workers on one node, so NCCL uses
NVLink/shared memory), else ``PACK`` (as few nodes as possible). CPU runs use {CPU: k} bundles.

Before asking Ray for anything we compare the request with the cluster's resources, so ``--gpus 8`` on a
one-GPU machine ends in one sentence instead of a placement group that waits forever; the placement group
itself is awaited with a timeout for the same reason (resources held by other jobs).
"""

from __future__ import annotations

from llmq_ray.actors.failures import WorkerError, gather
from llmq_ray.actors.spec import RuntimeSpec
from llmq_ray.actors.worker import PROBE_GROUP, GPUWorker, worker_env
from llmq_ray.errors import ConfigError

PLACEMENT_TIMEOUT_S = 120.0


def check_resources(spec: RuntimeSpec) -> None:
    """Raise ConfigError when the cluster cannot hold ``spec.world_size`` workers at all."""
    import ray

    total = ray.cluster_resources()
    n = spec.world_size
    if spec.device == "cuda":
        gpus = int(total.get("GPU", 0))
        if gpus == 0:
            raise ConfigError("--device=cuda but the Ray cluster has no GPUs; use --device=cpu (CPU workers over gloo).")
        if n > gpus:
            raise ConfigError(f"--gpus={n} asks for more GPUs than the Ray cluster has ({gpus}); use --gpus={gpus} or fewer.")
    cpus = float(total.get("CPU", 0))
    need = n * spec.cpus_per_worker
    if need > cpus:
        flag = "--gpus" if spec.device == "cuda" else "--workers"
        raise ConfigError(f"{flag}={n} with {spec.cpus_per_worker} CPU(s) per worker needs {need} CPUs but the Ray "
                          f"cluster has {cpus:g}; use fewer workers or --cpus-per-worker.")


def _max_gpus_per_node() -> int:
    import ray

    return max((int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n.get("Alive")), default=0)


def create_workers(spec: RuntimeSpec):
    """Reserve the bundles and start the workers; returns (placement_group, [actor handles by rank], nodes).

    ``nodes[r]`` is rank r's {"node_id", "ip", "pid", "gpu_ids", "local_rank"}.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    check_resources(spec)
    n, k = spec.world_size, spec.cpus_per_worker
    if spec.device == "cuda":
        bundle = {"GPU": 1, "CPU": k}
        strategy = "STRICT_PACK" if n <= _max_gpus_per_node() else "PACK"
    else:
        bundle = {"CPU": k}
        strategy = "PACK"
    pg = placement_group([dict(bundle) for _ in range(n)], strategy=strategy, name="")
    ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        remove_placement_group(pg)
        raise ConfigError(f"Ray could not reserve {n} bundle(s) of {bundle} ({strategy}) within "
                          f"{PLACEMENT_TIMEOUT_S:.0f} s; other jobs may hold those resources.")
    remote_cls = ray.remote(concurrency_groups={PROBE_GROUP: 1})(GPUWorker)
    workers = []
    for rank in range(n):
        opts = dict(num_cpus=k, num_gpus=1 if spec.device == "cuda" else 0, max_restarts=0,
                    runtime_env={"env_vars": worker_env(k)},
                    scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank))
        workers.append(remote_cls.options(**opts).remote(rank, spec))
    try:
        nodes = gather([w.node.remote() for w in workers], PLACEMENT_TIMEOUT_S, "start-up")
    except WorkerError:
        for w in workers:
            ray.kill(w)
        remove_placement_group(pg)
        raise
    seen: dict = {}
    for info in nodes:  # local rank = order of appearance among the workers of the same node
        info["local_rank"] = seen.get(info["node_id"], 0)
        seen[info["node_id"]] = info["local_rank"] + 1
    return pg, workers, nodes
