"""Placing one ``GPUWorker`` per GPU: a placement group of {GPU: 1, CPU: k} bundles, then the actors.

Strategy: ``STRICT_PACK`` when the whole run fits on one node (all workers on one node, so NCCL uses
NVLink/shared memory), else ``PACK`` (as few nodes as possible). CPU runs use {CPU: k} bundles.

Before asking Ray for anything we compare the request with the cluster's resources, so ``--gpus 8`` on a
one-GPU machine ends in one sentence instead of a placement group that waits forever; the placement group
itself is awaited with a timeout for the same reason (resources held by other jobs).

A CPU run's workers are ``CPUWorker`` actors: the same class under the name that Ray's log prefix
(``(CPUWorker pid=...)``) and its dashboard show, so that a CPU run does not say GPU.
"""

from __future__ import annotations

import os

from llmq_ray.actors.actor_env import actor_options
from llmq_ray.actors.failures import WorkerError, gather
from llmq_ray.actors.plan import RunPlan
from llmq_ray.actors.worker import PROBE_GROUP, GPUWorker, worker_env
from llmq_ray.errors import ConfigError
from llmq_ray.settings.rules import forward_env_names

PLACEMENT_TIMEOUT_S = 120.0


class CPUWorker(GPUWorker):
    """``GPUWorker`` on a few CPU cores (``--device=cpu``): the same actor, named for what it runs on."""


def check_tensor_parallel_placement(node_of_rank: list[str], tp: int) -> None:
    """One ConfigError sentence unless every tensor-parallel group (``tp`` consecutive ranks) was placed on one
    node, and ``tp`` divides the worker count. ``node_of_rank``: each rank's node id, in rank order."""
    world = len(node_of_rank)
    if tp < 1 or world % tp:
        raise ConfigError(f"--tensor-parallel={tp} must divide the number of workers ({world}).")
    split = [g for g in range(world // tp) if len(set(node_of_rank[g * tp:(g + 1) * tp])) > 1]
    if split:
        g = split[0]
        raise ConfigError(f"--tensor-parallel={tp}: the workers {g * tp}-{(g + 1) * tp - 1} of one tensor-parallel "
                          f"group were placed on {len(set(node_of_rank[g * tp:(g + 1) * tp]))} nodes; a group "
                          f"exchanges activations every layer and must stay on one node: use a --tensor-parallel "
                          f"that divides every node's GPU count.")


def check_resources(plan: RunPlan) -> None:
    """Raise ConfigError when the cluster cannot hold ``plan.world_size`` workers at all, or holds them only by
    giving them every CPU while the train batches are read by Ray Data tasks (which need one more)."""
    import ray

    total = ray.cluster_resources()
    n = plan.world_size
    if plan.settings.parallel.device == "cuda":
        gpus = int(total.get("GPU", 0))
        if gpus == 0:
            raise ConfigError("--device=cuda but the Ray cluster has no GPUs; use --device=cpu (CPU workers over gloo).")
        if n > gpus:
            raise ConfigError(f"--gpus={n} asks for more GPUs than the Ray cluster has ({gpus}); use --gpus={gpus} or fewer.")
    cpus = float(total.get("CPU", 0))
    need = n * plan.settings.parallel.cpus_per_worker
    flag = "--gpus" if plan.settings.parallel.device == "cuda" else "--workers"
    if need > cpus:
        raise ConfigError(f"{flag}={n} with {plan.settings.parallel.cpus_per_worker} CPU(s) per worker needs {need} CPUs but the Ray "
                          f"cluster has {cpus:g}; use fewer workers or --cpus-per-worker.")
    if plan.reads_with_ray_data and need >= cpus:
        # the Ray Data read tasks are scheduled outside the workers' bundles: with every CPU reserved they would
        # wait forever and the run would hang at its first batch
        raise ConfigError(f"{flag}={n} with --cpus-per-worker={plan.settings.parallel.cpus_per_worker} takes all {cpus:g} CPUs of the "
                          f"Ray cluster and leaves none for the Ray Data tasks that read the train file; use "
                          f"fewer workers, fewer CPUs per worker or --no-ray-data.")


def data_cpu_warning(plan: RunPlan, settle_s: float = 1.5) -> str | None:
    """A warning sentence when the run's workers would take every CPU that is free on the cluster now (other
    jobs hold the rest) while Ray Data reads the train file: its read tasks would then wait for another job to
    free a CPU, and the run with them. Not an error: the CPUs may free up (placement waits for room the same
    way). Ray's view of free resources lags a removed placement group by up to about a second, so a shortfall
    is looked at again for ``settle_s`` before it is reported."""
    import time

    import ray

    if not plan.reads_with_ray_data:
        return None
    need = plan.world_size * plan.settings.parallel.cpus_per_worker
    deadline = time.monotonic() + settle_s
    while True:
        free = float(ray.available_resources().get("CPU", 0))
        if need < free or time.monotonic() >= deadline:
            break
        time.sleep(0.25)
    if need < free:
        return None
    total = float(ray.cluster_resources().get("CPU", 0))
    return (f"warning: the workers take {need} CPU(s) and {free:g} of the cluster's {total:g} are free now (other "
            f"jobs hold the rest), which leaves none for the Ray Data tasks that read the train file; the run "
            f"waits until one frees up (--cpus-per-worker lower, or --no-ray-data to read in the workers).")


def _max_gpus_per_node() -> int:
    import ray

    return max((int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n.get("Alive")), default=0)


def bundle_of(plan: RunPlan) -> dict:
    """One worker's resources: {GPU: 1, CPU: k} on CUDA, {CPU: k} on CPU."""
    k = plan.settings.parallel.cpus_per_worker
    return {"GPU": 1, "CPU": k} if plan.settings.parallel.device == "cuda" else {"CPU": k}


def placeable_workers(plan: RunPlan, nodes: list | None = None) -> int:
    """How many workers of ``plan``'s bundle the cluster's alive nodes can hold (by their total resources: what
    other jobs hold right now is not counted). After a node is lost this says how far an elastic run shrinks.
    Under --tensor-parallel T only whole groups on one node count (a node with 3 GPUs holds one group of 2).
    ``nodes``: ``ray.nodes()``'s list (default: asked here)."""
    if nodes is None:
        import ray

        nodes = ray.nodes()
    bundle, t = bundle_of(plan), plan.settings.parallel.tensor_parallel
    room = 0
    for n in nodes:
        if not n.get("Alive"):
            continue
        have = n.get("Resources", {})
        room += min(int(have.get(r, 0) // need) for r, need in bundle.items()) // t * t
    return room


def describe_bundle(bundle: dict) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in bundle.items()) + "}"


def bundles_by_node(pg, n: int) -> list[int]:
    """The ``n`` bundle indices of placement group ``pg`` ordered so that bundles on the same node follow each
    other (nodes in the order of their first bundle): PACK may spread bundles 0, 1, 2, 3 as nodes A, B, A, B,
    and ``--zero-scope node`` needs each node's ranks consecutive."""
    import ray

    try:
        where = ray.util.placement_group_table(pg).get("bundles_to_node_id") or {}
    except Exception:  # noqa: BLE001 - no table: keep Ray's order
        return list(range(n))
    order = list(dict.fromkeys(where.get(i) for i in range(n)))
    return sorted(range(n), key=lambda i: order.index(where.get(i)))


class TooFewWorkers(ConfigError):
    """Raised by ``create_workers(..., elastic=True)``: the alive nodes cannot hold the group any more; ``room``
    says how many workers they can."""

    def __init__(self, message: str, room: int):
        super().__init__(message)
        self.room = room


def create_workers(plan: RunPlan, wait_s: float = PLACEMENT_TIMEOUT_S, on_wait=None, why: str = "",
                   elastic: bool = False, restart: bool = False):
    """Reserve the bundles and start the workers; returns (placement_group, [actor handles by rank], nodes).

    ``nodes[r]`` is rank r's {"node_id", "ip", "pid", "gpu_ids", "local_rank"}. The placement group is awaited
    up to ``wait_s`` seconds; when it is not ready within 5 s, ``on_wait(message)`` is called once with a
    sentence saying what the run waits for (a restart after a lost node waits for capacity to come back).
    ``why``: the flag to raise to wait longer, named in the error when the time is up. ``elastic``: instead of
    waiting, raise ``TooFewWorkers`` as soon as the alive nodes cannot hold the group (checked every 2 s: Ray
    marks a lost node dead some seconds after its workers' peers have noticed). ``restart``: the group is placed
    again after a failure: a cluster that is too small now is waited for (it may grow back), not refused.
    """
    import time

    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    n = plan.world_size
    room = placeable_workers(plan) if elastic else n
    if room < n:
        raise TooFewWorkers(f"the cluster's alive nodes can hold {room} of {n} worker(s)", room)
    if not restart:  # a restart after a lost node waits for the cluster to grow back instead
        check_resources(plan)
    bundle = bundle_of(plan)
    strategy = "STRICT_PACK" if plan.settings.parallel.device == "cuda" and n <= _max_gpus_per_node() else "PACK"
    # each group a name of its own (a rebuilt group is made while Ray may still be removing the last one)
    name = f"{plan.placement_name}-{os.urandom(3).hex()}" if plan.placement_name else ""
    pg = placement_group([dict(bundle) for _ in range(n)], strategy=strategy, name=name)
    t0 = time.monotonic()
    told = False
    while not ray.wait([pg.ready()], timeout=max(min(2.0, t0 + wait_s - time.monotonic()), 0.0))[0]:
        room = placeable_workers(plan)
        if elastic and room < n:
            remove_placement_group(pg)
            raise TooFewWorkers(f"the cluster's alive nodes can hold {room} of {n} worker(s)", room)
        if time.monotonic() - t0 >= wait_s:
            remove_placement_group(pg)
            cause = (f"the cluster's alive nodes can hold only {room}" if room < n else
                     f"the cluster has room for {room} but other jobs hold it")
            raise ConfigError(f"Ray could not place {n} worker(s) of {describe_bundle(bundle)} within "
                              f"{wait_s:.0f} s: {cause}" + (f"; {why}" if why else "") + ".")
        if not told and time.monotonic() - t0 >= 5.0 and on_wait is not None:
            told = True
            on_wait(f"waiting up to {wait_s:.0f} s for room for {n} worker(s) of {describe_bundle(bundle)}: the "
                    f"cluster's alive nodes can hold {room}" + (" (the rest is held by other jobs)"
                                                                 if room >= n else "") + ".")
    bundles = bundles_by_node(pg, n)  # rank r runs in bundle bundles[r]: a node's ranks are consecutive
    k = plan.settings.parallel.cpus_per_worker
    gpu = plan.settings.parallel.device == "cuda"
    env = worker_env(k)
    start_opts = actor_options(env, gpu=gpu, forward_env=forward_env_names(plan.settings.parallel.forward_env))
    remote_cls = ray.remote(concurrency_groups={PROBE_GROUP: 1})(GPUWorker if gpu else CPUWorker)
    workers = []
    for rank in range(n):
        opts = dict(num_cpus=k, num_gpus=1 if gpu else 0, max_restarts=0, **start_opts,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundles[rank]))
        workers.append(remote_cls.options(**opts).remote(rank, plan, env))
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


def release_coordinator(coordinator, placement_name: str) -> None:
    """Kill ``coordinator`` (an actor handle; it may be dead already) and remove the run's placement groups
    (named ``placement_name-...`` by ``create_workers``) that are still there. A placement group that an actor
    created belongs to the job, not to that actor: a coordinator that was killed (or whose process died) leaves its
    workers' group behind, holding their CPUs and GPUs until the driver exits, so a coordinator started again could
    not place its workers."""
    import ray
    from ray.util.placement_group import get_placement_group, placement_group_table, remove_placement_group

    try:
        ray.kill(coordinator)
    except Exception:  # noqa: BLE001 - already gone
        pass
    if not placement_name:
        return
    for entry in placement_group_table().values():
        if entry.get("name", "").startswith(placement_name + "-") and entry.get("state") != "REMOVED":
            try:
                remove_placement_group(get_placement_group(entry["name"]))
            except Exception:  # noqa: BLE001 - removed meanwhile
                pass
