"""Surviving a lost node on a simulated 3-node Ray cluster (``ray.cluster_utils.Cluster``, one raylet per node, each
with its own cache folder) with shards and checkpoints on an S3 server (moto) -- issue 24's survival points:

Every location is a URI (shards, checkpoints, the out-dir with the log), and each worker node has a disk of its
own (a tmpfs in a mount namespace of its own, which no other node sees; see tests/_cluster_scenario.py):
nothing is shared through a local disk.

(a) a spare node: the run restarts there from the last checkpoint and ends with the uninterrupted run's losses;
(b) no spare, ``elastic=True``: the run goes on with 1 worker (grad accumulation doubled), the log records it;
(c) no spare, no elastic: the restart says what it waits for and gives up after ``restart_wait_s``;
(d) Ray's drain notice (a preemption warning) for a node of ours: a checkpoint at the step boundary and a clean stop.

The scenarios run one after the other on one head node, each on fresh worker nodes, in one process of their own
(tests/_cluster_scenario.py, the module's ``cluster`` fixture; a Cluster cannot share a process with the session's
Ray instance): each test sends its scenario there and checks what came back.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 10
COMMON = dict(model="tiny", device="cpu", workers=2, backend="torch", batch_size=2, seq_len=16, steps=STEPS,
              warmup=0, export=False, final_eval=False, eval_every_n_steps=0, verbose=False, use_ray_data=False,
              ckpt_interval=2, ckpt_minutes=0, ckpt_keep_n=5, step_timeout_s=60.0, collective_timeout_s=20.0)
# rank 0 sleeps 0.3 s per step (in every group) so the watcher removes the node while the run is under way, and 2 s
# per step from 0-based step 4 on in the first group only (after the step-4 checkpoint the watcher waits for): on a
# loaded machine the watcher's poll of the store and Ray's removal of a raylet take seconds, and the first group's
# remaining steps must not all finish before the node is gone (seen: no elastic record, with a second suite beside)
HOLD = {"rank": 0, "step": 4, "kind": "slow_step", "seconds": 2.0}
SLOW = {"rank": 0, "step": 0, "kind": "slow_step", "seconds": 0.3, "every_group": True}


@pytest.fixture(scope="module")
def bucket(s3, shards):
    """The shards on the S3 server; returns the train file's URI."""
    with open(shards.train, "rb") as f:
        data = f.read()
    with s3.open_output_stream("bucket/survival/data/train.bin") as f:
        f.write(data)
    return "s3://bucket/survival/data/train.bin"


class _ClusterProcess:
    """tests/_cluster_scenario.py serving this module: one simulated cluster's head, in a process of its own."""

    def __init__(self, root):
        self.root = root
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
        env.pop("RAY_ADDRESS", None)
        self.stderr_path = root / "cluster.stderr"
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, os.path.join(REPO, "tests", "_cluster_scenario.py"),
                                          str(root / "nodes")], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, text=True, env=env)
        self.lines: queue.Queue = queue.Queue()  # its stdout, line by line ("" at the end)
        threading.Thread(target=self._read, daemon=True).start()
        self._wait_for("ready", 180)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")

    def _wait_for(self, word: str, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                line = None
            assert line, (f"the cluster process {'ended' if line == '' else f'said no {word!r} within {seconds:.0f} s'}: "
                          + self.stderr_path.read_text(errors="replace")[-5000:])
            if line.strip() == word:
                return

    def run(self, spec: dict) -> dict:
        """Run one scenario on fresh nodes of the cluster; returns its output."""
        path = self.root / f"{spec['name']}.json"
        path.write_text(json.dumps(spec))
        self.proc.stdin.write(f"{path}\n")
        self.proc.stdin.flush()
        self._wait_for(f"done {path.name}", 300)  # named: a scenario that outlasted an earlier test is not this one
        return json.loads((self.root / f"{spec['name']}.out.json").read_text())

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def cluster(s3, tmp_path_factory):
    """The simulated cluster the scenarios of this module run on, one after the other (started once the S3
    server's address and credentials are in the environment, which its processes inherit)."""
    served = _ClusterProcess(tmp_path_factory.mktemp("survival"))
    try:
        yield served
    finally:
        served.close()


def _scenario(cluster: _ClusterProcess, bucket: str, name: str, **scenario) -> dict:
    """Scenario ``name`` (the nodes it starts on, what happens to one of them: tests/_cluster_scenario.py) of the
    COMMON run on ``bucket``'s shards with its own prefix on the store; fails its test if the scenario raised."""
    kwargs = dict(COMMON, train_file=bucket, out_dir=f"s3://bucket/survival/{name}/out",
                  checkpoint_dir=f"s3://bucket/survival/{name}/ckpt", fault=[HOLD, SLOW], **scenario.pop("kwargs", {}))
    out = cluster.run(dict(scenario, name=name, kwargs=kwargs))
    assert "crash" not in out, out.get("crash")
    return out


@pytest.fixture(scope="module")
def reference(ray_cluster, shards, tmp_path_factory):
    """The uninterrupted 2-worker run's per-step losses (same data, seed and batch)."""
    from llmq_ray.train.trainer import LLMQTrainer

    out = tmp_path_factory.mktemp("reference")
    kw = dict(COMMON, train_file=shards.train, out_dir=str(out), checkpoint_dir=str(out / "ckpt"))
    return [r["loss"] for r in LLMQTrainer(**kw).fit().history]


def _story(out: dict) -> str:
    """What went wrong, for an assertion message: the error and the log's failure/restart records."""
    kinds = ("failure", "restart", "waiting", "elastic", "resume", "warning", "end")
    return f"{out['error']} | removed at {out['removed_at']} | " + " / ".join(
        f"{r['log']}: {r.get('error') or r.get('message') or r.get('reason') or r.get('checkpoint') or ''}"
        for r in out["log"] if r.get("log") in kinds)


def _kinds(log: list, kind: str) -> list:
    return [r for r in log if r.get("log") == kind]


def test_a_lost_node_is_replaced_by_a_spare_and_the_losses_stay_those_of_the_uninterrupted_run(
        cluster, bucket, reference):
    """Near or over 60 s beside the rest of the suite: as the module's first test it also waits for the module's
    cluster head (a process of its own) and the reference run, and its scenario starts 3 worker nodes."""
    out = _scenario(cluster, bucket, "spare", nodes=3, remove_after_step=4)
    assert out["error"] is None and out["removed_at"] is not None, _story(out)
    assert [r["step"] for r in out["history"]] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in out["history"]] == reference  # bit for bit: fp32 on CPU, same world size
    (restart,) = _kinds(out["log"], "restart")
    assert restart["checkpoint"].startswith("s3://bucket/survival/spare/ckpt/step_")
    assert not _kinds(out["log"], "elastic")
    print("own disks:", out["private_disks"], out["disk_files"], out["head_disk_files"])
    if not out["private_disks"]:
        pytest.skip("this machine allows no mount namespaces (unshare --mount needs CAP_SYS_ADMIN): each node "
                    "had a folder of its own on the shared disk, and everything above held")
    # each live worker node fetched the shard onto its own disk, which the driver's node never saw
    assert out["head_disk_files"] == []
    assert len(out["disk_files"]) == 2, out["disk_files"]
    for files in out["disk_files"].values():
        assert any(f.startswith("cache/remote/") and f.endswith("train.bin") for f in files), files


def _assert_elastic_run(out: dict, reference, worlds: tuple[int, int], saved_world: int) -> None:
    """An --elastic run that lost a node after step 4: all steps done, one elastic record shrinking ``worlds``
    (from, to) at twice the micro-steps, resumed from a checkpoint of ``saved_world`` shards, and -- the same global
    batch -- the losses of the uninterrupted run ``reference`` up to the summation order (1e-5)."""
    assert out["error"] is None, _story(out)
    assert [r["step"] for r in out["history"]] == list(range(1, STEPS + 1))
    (shrink,) = _kinds(out["log"], "elastic")
    assert (shrink["from_world_size"], shrink["world_size"]) == worlds
    assert (shrink["from_grad_accumulation"], shrink["grad_accumulation"]) == (1, 2)
    resumed = _kinds(out["log"], "resume")[-1]
    assert (resumed["saved_world_size"], resumed["world_size"]) == (saved_world, worlds[1])
    np.testing.assert_allclose([r["loss"] for r in out["history"]], reference, rtol=1e-5, atol=0)
    assert [r["tokens"] for r in out["history"]] == [2 * 2 * 16] * STEPS


def test_elastic_goes_on_with_the_workers_left_and_keeps_the_global_batch(cluster, bucket, reference):
    out = _scenario(cluster, bucket, "elastic", nodes=2, remove_after_step=4,
                    kwargs=dict(elastic=True, restart_wait_s=60.0))
    _assert_elastic_run(out, reference, worlds=(2, 1), saved_world=2)


def test_elastic_tensor_parallel_goes_on_with_the_whole_groups_left(cluster, bucket, reference):
    """--tensor-parallel 2 on 2 nodes of 2 CPU workers (one group per node, 2 data-parallel ranks): losing a node
    loses one whole group, and --elastic goes on with the group left (1 data-parallel rank, twice the micro-steps):
    the same global batch, so the losses stay those of the uninterrupted 2-worker run (T=1) within 1e-5."""
    out = _scenario(cluster, bucket, "elastic-tp", nodes=2, cpus_per_node=2, remove_after_step=4,
                    kwargs=dict(workers=4, tensor_parallel=2, elastic=True, restart_wait_s=60.0))
    # a T=2 x DP=2 checkpoint holds one shard file per data-parallel rank: it looks like a 2-worker one
    _assert_elastic_run(out, reference, worlds=(4, 2), saved_world=2)


def test_without_elastic_the_restart_says_what_it_waits_for_and_gives_up(cluster, bucket):
    out = _scenario(cluster, bucket, "waiting", nodes=2, remove_after_step=4, kwargs=dict(restart_wait_s=7.0))
    assert out["error"] is not None and out["removed_at"] is not None
    # the API's names (the CLI says --elastic and --restart-wait-s)
    assert "; restart 1/3 gave up: Ray could not place 2 worker(s) of {CPU: 1} within 7 s: the cluster's alive " \
           "nodes can hold only 1; pass elastic=True to go on with the workers that can be placed, or raise " \
           "restart_wait_s." in out["error"], out["error"]
    assert out["error"].startswith("node 127.0.0.1 died during "), out["error"]  # a step or a checkpoint save
    (waiting,) = _kinds(out["log"], "waiting")
    assert waiting["message"] == ("waiting up to 7 s for room for 2 worker(s) of {CPU: 1}: the cluster's alive "
                                  "nodes can hold 1.")
    assert _kinds(out["log"], "end")[-1]["reason"] == "failed"


def test_a_drain_notice_for_a_node_of_ours_stops_the_run_with_a_checkpoint_as_sigterm_does(cluster, bucket):
    out = _scenario(cluster, bucket, "drain", nodes=2, drain_after_step=2, kwargs=dict(steps=40))
    assert out["error"] is None and isinstance(out.get("drained_at"), float), _story(out)
    stopped = out["stopped"]
    assert stopped is not None and 2 <= stopped["step"] < 40, stopped
    assert stopped["signal"].startswith("node 127.0.0.1 is being drained (Ray's drain notice, to be shut down in ")
    assert stopped["checkpoint"] == f"s3://bucket/survival/drain/ckpt/step_{stopped['step']:08d}"
    # the stop's checkpoint, or (written False) the periodic one of that step (--ckpt-interval 2): one, complete
    (saved,) = [r for r in _kinds(out["log"], "checkpoint") if r["step"] == stopped["step"]]
    assert saved["path"] == stopped["checkpoint"] and (stopped["written"] or stopped["step"] % 2 == 0), saved
    end = _kinds(out["log"], "end")[-1]
    assert end["reason"] == "stopped" and end["checkpoint"] == stopped["checkpoint"], end
    assert end["checkpoint_written"] == stopped["written"] and end["step"] == stopped["step"], end
    (warning,) = [w for w in _kinds(out["log"], "warning") if w["kind"] == "drain"]
    assert warning["message"].endswith(f": stopping after step {stopped['step']} with a checkpoint, as on SIGTERM.")
