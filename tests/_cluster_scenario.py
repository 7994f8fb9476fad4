"""Multi-node runs on one simulated Ray cluster, in a process of its own (tests/test_cluster_survival.py runs it).

    python tests/_cluster_scenario.py ROOT     (then one scenario spec file's path per line on stdin)

``ray.cluster_utils.Cluster`` starts one raylet per "node" on this machine: a head node with no CPUs (the driver
and the coordinator, which takes none), started once; then the scenarios named on stdin run one after the
other. Each scenario gets fresh worker nodes -- ``scenario["nodes"]`` of one CPU each, so each holds exactly one CPU
worker (``scenario["cpus_per_node"]`` CPUs and workers instead, e.g. 2 for a tensor-parallel group of 2 per node)
-- and its nodes are removed when it ends, so what one scenario did to its nodes (one lost, one drained) never
reaches the next. One head for all saves a process and a Ray head per scenario (what a scenario costs is mostly
its processes: each worker about 3.5 CPU-seconds on the 2-core CI machine, each node's raylet with its dashboard
and runtime-env agents about 3). Every worker node has a disk of its own: its raylet (and so every process it
starts: the workers, Ray's agents) runs in a mount namespace of its own (``unshare --mount``) with a fresh tmpfs mounted on
``ROOT/disks``, where its cache (``LLMQ_RAY_CACHE``: fetched shards, staged checkpoints) and ``TMPDIR`` live;
no other node, the driver included, sees that tmpfs. The run reads its shards from and writes its checkpoints
and log to s3:// (the S3 server's address comes in the environment), so a file one node wrote and another read
would fail the run. Where mount namespaces are not allowed (no CAP_SYS_ADMIN), each node gets a folder of its
own on the shared disk instead and the output says ``"private_disks": false``. With ``scenario["remove_after_step"]``
a watcher thread waits until the checkpoint of that step is on the store, then removes one node that holds a
worker (``allow_graceful=False``: its raylet and workers are killed, as when a machine is lost), and with
``scenario["add_after_remove"]`` adds a fresh node after that many seconds; with ``scenario["drain_after_step"]``
it sends Ray's drain notice (reason: preemption, 60 s deadline) for such a node instead.

Writes, for each scenario, its spec's path with ``.out.json`` for ``.json``: {"history": per-step records, "log":
the run's log records, "error": the error sentence or None, "removed_at" / "drained_at": seconds into the run or
None, "stopped": ``Result.stopped``, "private_disks": bool, "disk_files": {node index: the files on that node's own
disk at the end, as its raylet sees them, for the nodes still alive}, "head_disk_files": what the driver sees under
ROOT/disks}, and prints ``done <spec file name>``; a scenario that raised writes {"crash": its traceback} and the
next one runs. A process of its own because a Cluster cannot share a process with the test session's Ray instance.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

# Ray notices a lost raylet after health_check_period_ms x failure_threshold (default 3 s x 5): 1 s x 5 here
# (shorter periods mark busy nodes dead by mistake on a loaded 2-core machine)
SYSTEM_CONFIG = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 1000,
                 "health_check_failure_threshold": 5}


# what a worker node's raylet runs first, in its new mount namespace: $1 is the disk's mount point
_OWN_DISK = ('mount -t tmpfs -o size=1g llmq-node-disk "$1" && mkdir -p "$LLMQ_RAY_CACHE" "$TMPDIR" '
             '&& shift && exec "$@"')


def _private_disks_allowed(where: str) -> bool:
    """Whether this machine lets a process mount a tmpfs in a mount namespace of its own (root or
    CAP_SYS_ADMIN, ``unshare`` installed)."""
    os.makedirs(where, exist_ok=True)
    try:
        return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                               'mount -t tmpfs none "$0" && touch "$0/x"', where],
                              capture_output=True, timeout=10).returncode == 0 and not os.listdir(where)
    except (OSError, subprocess.SubprocessError):
        return False


def _start_raylets_on_own_disks(disks: str) -> None:
    """Make ``ray.cluster_utils.Cluster`` start the raylet of every node whose environment names a
    ``LLMQ_RAY_TEST_OWN_DISK`` inside a new mount namespace with a tmpfs on ``disks`` (the raylet's pid stays
    the one Ray knows: unshare and sh exec into it, so removing the node kills it as before)."""
    from ray._private import services

    start = services.start_ray_process

    def start_ray_process(command, process_type, *args, **kwargs):
        env = kwargs.get("env_updates") or (args[1] if len(args) > 1 else None) or {}
        if process_type == "raylet" and env.get("LLMQ_RAY_TEST_OWN_DISK"):
            command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", _OWN_DISK, "own-disk",
                       disks, *command]
        return start(command, process_type, *args, **kwargs)

    services.start_ray_process = start_ray_process


def _files_under(path: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)


def _manifest_on_store(ckpt_dir: str, step: int) -> bool:
    from llmq_ray.checkpoints.layout import has_manifest, step_dir

    try:
        return has_manifest(step_dir(ckpt_dir, step))
    except Exception:  # noqa: BLE001 - not there yet
        return False


def _node_of_a_worker(cluster, trainer=None):
    """A worker node that holds a bundle of the run's placement group (the one rank 1 runs on, if possible), and
    not the driver's: on a one-machine cluster the driver may attach to any node's raylet, and the coordinator
    runs beside it (losing the driver's node is losing the job, not a worker)."""
    import ray

    keep = {ray.get_runtime_context().get_node_id()}
    if trainer is not None and trainer.info:  # and the coordinator's node (set-up says where it runs)
        keep.add(trainer.info.get("coordinator_node"))

    for pg in ray.util.placement_group_table().values():
        if pg.get("state") != "CREATED":
            continue
        where = pg.get("bundles_to_node_id") or {}
        wanted = [where[i] for i in sorted(where)]
        for node_id in reversed(wanted):
            for node in cluster.worker_nodes:
                if node.node_id == node_id and node_id not in keep:
                    return node
    return None


def run_scenario(cluster, scenario: dict, disks: str, private: bool, next_index) -> dict:
    """One run on fresh worker nodes of ``cluster`` (see the module docstring); returns its output record. The
    nodes it added are removed before it returns. ``next_index()``: a node index no earlier node had."""
    import ray

    from llmq_ray.errors import LLMQError
    from llmq_ray.observe.runlog import read_log
    from llmq_ray.train.trainer import LLMQTrainer

    nodes = {}  # node index -> the Ray node

    def add_node():
        i = next_index()
        own = os.path.join(disks, f"node{i}")  # on the node's tmpfs (or, without namespaces, a folder of its own)
        env = {"LLMQ_RAY_CACHE": os.path.join(own, "cache"), "TMPDIR": os.path.join(own, "tmp")}
        if private:
            env["LLMQ_RAY_TEST_OWN_DISK"] = "1"
        else:
            os.makedirs(env["LLMQ_RAY_CACHE"], exist_ok=True)
            os.makedirs(env["TMPDIR"], exist_ok=True)
        nodes[i] = cluster.add_node(num_cpus=scenario.get("cpus_per_node", 1), env_vars=env)
        return nodes[i]

    for _ in range(scenario["nodes"]):
        add_node()
    cluster.wait_for_nodes()
    deadline = time.monotonic() + 60  # the driver's view of the cluster's resources lags the nodes' start by a moment
    while ray.cluster_resources().get("CPU", 0) < scenario["nodes"] * scenario.get("cpus_per_node", 1) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    out = {"history": [], "log": [], "error": None, "removed_at": None, "private_disks": private}
    kwargs = dict(scenario["kwargs"])
    t0 = time.monotonic()
    trainer = None

    def remove_one():
        while not _manifest_on_store(kwargs["checkpoint_dir"], scenario["remove_after_step"]):
            if time.monotonic() - t0 > 120:
                return
            time.sleep(0.1)
        node = _node_of_a_worker(cluster, trainer)
        if node is None:
            return
        cluster.remove_node(node, allow_graceful=False)
        out["removed_at"] = time.monotonic() - t0
        if scenario.get("add_after_remove") is not None:
            time.sleep(scenario["add_after_remove"])
            add_node()

    def drain_one():  # Ray's drain notice for a node of ours, as a cloud's preemption warning gives it
        from ray.core.generated import autoscaler_pb2

        while not _manifest_on_store(kwargs["checkpoint_dir"], scenario["drain_after_step"]):
            if time.monotonic() - t0 > 120:
                return
            time.sleep(0.1)
        node = _node_of_a_worker(cluster, trainer)
        gcs = ray._raylet.GcsClient(address=cluster.address)
        accepted, why = gcs.drain_node(node.node_id, autoscaler_pb2.DrainNodeReason.Value(
            "DRAIN_NODE_REASON_PREEMPTION"), "spot instance preempted", int(time.time() * 1000) + 60_000)
        out["drained_at"] = time.monotonic() - t0 if accepted else f"refused: {why}"

    watcher = None
    if scenario.get("drain_after_step"):
        watcher = threading.Thread(target=drain_one, daemon=True)
    if scenario.get("remove_after_step"):
        watcher = threading.Thread(target=remove_one, daemon=True)
    fault = kwargs.pop("fault", None)
    if fault:  # the test hook (actors/fault_injection.py): read by the trainer when the run starts
        os.environ["LLMQ_RAY_TEST_FAULT"] = json.dumps(fault)
    else:
        os.environ.pop("LLMQ_RAY_TEST_FAULT", None)
    try:
        trainer = LLMQTrainer(**kwargs)
        if watcher is not None:
            watcher.start()
        try:
            result = trainer.fit()
            out["history"] = result.history
            out["stopped"] = result.stopped
            log = result.log_file
        except LLMQError as exc:
            out["error"] = str(exc)
            log = trainer._log_path()
        out["log"] = read_log(log)
        if watcher is not None:
            watcher.join(timeout=5)
        out["disk_files"] = {}  # each live node's own disk, seen through its raylet's /proc/PID/root
        for i, node in nodes.items():
            raylets = node.all_processes.get("raylet") or []  # none left for a removed node
            if raylets and raylets[0].process.poll() is None:
                out["disk_files"][i] = _files_under(f"/proc/{raylets[0].process.pid}/root{disks}/node{i}")
        out["head_disk_files"] = _files_under(disks)
        return out
    finally:
        os.environ.pop("LLMQ_RAY_TEST_FAULT", None)
        if watcher is not None and watcher.is_alive():
            watcher.join(timeout=30)
        for node in nodes.values():  # this scenario's nodes go (their raylets tell the GCS so as they stop) ...
            if node in cluster.worker_nodes:
                cluster.remove_node(node, allow_graceful=True)
        deadline = time.monotonic() + 60  # ... and the next one starts once the GCS counts only the head alive
        while len([n for n in ray.nodes() if n["Alive"]]) > 1 and time.monotonic() < deadline:
            time.sleep(0.2)


def main(root: str) -> None:
    """Start the head node, then run each scenario whose spec file's path comes on a line of stdin: its output goes
    to the path of the spec with ``.out.json`` for ``.json``, then ``done <spec file name>`` is printed. Ends at the
    end of stdin."""
    import itertools
    import traceback

    import ray
    from ray.cluster_utils import Cluster

    disks = os.path.join(root, "disks")
    private = _private_disks_allowed(disks)
    if private:
        _start_raylets_on_own_disks(disks)
    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=0, include_dashboard=False,
                                                                _system_config=SYSTEM_CONFIG))
    ray.init(address=cluster.address, log_to_driver=False)
    counter = itertools.count()
    print("ready", flush=True)
    try:
        for line in sys.stdin:
            spec_path = line.strip()
            try:
                out = run_scenario(cluster, json.load(open(spec_path)), disks, private, lambda: next(counter))
            except Exception:  # noqa: BLE001 - the test of this scenario fails with it; the next one runs
                out = {"crash": traceback.format_exc()}
            path = spec_path[:-len(".json")] + ".out.json"
            with open(path + ".tmp", "w") as f:
                json.dump(out, f, default=str)
            os.replace(path + ".tmp", path)
            print(f"done {os.path.basename(spec_path)}", flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
