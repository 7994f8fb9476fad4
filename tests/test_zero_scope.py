"""--zero-scope node: ZeRO shards within each node, a copy of them on every node.

* ``workers_per_node`` accepts only consecutive ranks per node with the same count on every node, and refuses
  anything else in one sentence naming the count per node;
* ``NodeScopeCommunicator`` (4 gloo processes as 2 nodes x 2): every shard collective stays inside the node
  except the one all-reduce of the reduced shard across nodes, and the two sums mean what the engine needs
  (``all_reduce_sum`` over the whole run, ``all_reduce_over_shards`` over one copy of the shards), and a
  placement of 3 + 1 workers is refused by every rank alike;
* the same 4 processes train the engine under node scope at ZeRO-1, 2 and 3, each rank on its own micro-batch:
  the same per-step losses and norms as one process taking the 4 micro-batches (grad_accumulation 4);
* a simulated 2-node Ray cluster (``ray.cluster_utils.Cluster``, 2 CPUs a node, so PACK puts 2 of the 4
  workers on each): node scope through the trainer (placement, the nodes found, the communicator built from
  them) gives the same per-step losses and norms as one worker with the same global batch; a checkpoint it
  writes (the first node's 2 shards, the 4 workers' data states) resumes on one worker and goes on as the
  one-worker run does.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
import pytest
import torch

from llmq_ray.actors.collectives import workers_per_node
from llmq_ray.errors import ConfigError


# ---------------------------------------------------------------------------------------------------- layout
def test_workers_per_node_needs_consecutive_ranks_and_equal_counts():
    assert workers_per_node(list("AABB")) == 2
    assert workers_per_node(list("AAAA")) == 4
    assert workers_per_node(list("ABC")) == 1
    names = {"A": "10.0.0.4", "B": "10.0.0.5"}
    with pytest.raises(ConfigError, match=r"^--zero-scope node needs the same number of workers on every node, but "
                                          r"the 3 workers were placed 2 on 10\.0\.0\.4, 1 on 10\.0\.0\.5; use a "
                                          r"worker count that fills every node evenly, or --zero-scope world\.$"):
        workers_per_node(list("AAB"), names)
    with pytest.raises(ConfigError, match=r"needs each node's workers to have consecutive ranks, but the 4 workers "
                                          r"were placed 2 on 10\.0\.0\.4, 2 on 10\.0\.0\.5"):
        workers_per_node(list("ABAB"), names)


# ---------------------------------------------------------------------------------------------------- collectives
def _comm_rank(rank: int, port: int, out_dir: str) -> None:
    """Global rank ``rank`` of 4 (nodes A = ranks 0, 1 and B = ranks 2, 3): run each collective of the node-scope
    Communicator on values that tell the ranks apart, and save what came out."""
    torch.set_num_threads(1)
    from llmq_ray.actors.collectives import destroy_group, init_group, node_scope

    world = init_group(f"tcp://127.0.0.1:{port}", rank, 4, torch.device("cpu"), timeout_s=60)
    try:
        c = node_scope(world, "AABB"[rank])
        g, S = rank, 3
        out = {"place": (c.rank, c.world_size, c.replica, c.replicas)}
        full = (g + 1) * torch.arange(2 * S, dtype=torch.float32)
        shard = torch.empty(S)
        c.reduce_scatter_sum(shard, full)
        out["reduce_scatter"] = shard
        full = (g + 1) * torch.arange(2 * S, dtype=torch.float32)
        own = full[c.rank * S:(c.rank + 1) * S]
        c.reduce_scatter_sum(own, full)  # aliased: in the full buffer's own slice, as ZeRO-1 does
        out["reduce_scatter_aliased"] = own.clone()
        gathered = torch.zeros(2 * S)
        c.all_gather(gathered, torch.full((S,), 100.0 * c.replica + c.rank))
        out["all_gather"] = gathered
        t = torch.full((2,), 100.0 * c.replica + c.rank)
        c.broadcast(t, src=1).wait()
        out["broadcast"] = t
        t = torch.full((2,), g + 1.0)
        c.reduce_sum(t, dst=0).wait()
        out["reduce_sum"] = t
        t = torch.tensor([g + 1.0])
        c.all_reduce_sum(t)
        out["all_reduce_sum"] = t
        t = torch.tensor([g + 1.0])
        c.all_reduce_over_shards(t)
        out["over_shards"] = t
        out["single_node_is_world"] = node_scope(world, "N") is world
        try:  # 3 + 1: every rank learns the same placement, so all refuse it alike (none waits in a collective)
            node_scope(world, "AAAB"[rank], "10.0.0.4" if rank < 3 else "10.0.0.5")
        except ConfigError as exc:
            out["refused"] = str(exc)
        for zero in ENGINE_ZERO_LEVELS:  # rank g takes micro-batch g of the one process's 4
            out[f"zero{zero}"] = _engine_steps(_engine(zero, 1, c), [g])
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        destroy_group()


ENGINE_ZERO_LEVELS = (1, 2, 3)
ENGINE_STEPS = 4  # enough updates for each ZeRO level's sharded optimizer state to shape the weights


def _engine(zero: int, accumulation: int, comm=None):
    """The tiny preset's engine in fp32 (so node scope and one process agree to float summation order)."""
    from llmq_ray.backends import get_backend
    from llmq_ray.engine.train_engine import TrainEngine
    from llmq_ray.model.config import PRESETS
    from _helpers import train_settings

    opts = train_settings(model="tiny", batch_size=2, seq_len=16, grad_accumulation=accumulation, zero_level=zero,
                          model_dtype="fp32", master_dtype="fp32", opt_m_dtype="fp32", opt_v_dtype="fp32",
                          learning_rate=3e-3, grad_clip=0.5, seed=3)
    return TrainEngine(PRESETS["tiny"], opts, get_backend("torch"), comm)


def _engine_steps(engine, micro_batches) -> list:
    """(loss, grad norm) of ENGINE_STEPS updates, each over ``micro_batches`` (indices of fixed random batches)."""
    out = []
    for step in range(ENGINE_STEPS):
        for i, micro in enumerate(micro_batches):
            x = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(micro))
            engine.micro_step(x[:, :-1], x[:, 1:], last=i + 1 == len(micro_batches))
        stats = engine.update(3e-3, step + 1)
        out.append((stats.loss, stats.grad_norm))
    return out


def test_node_scope_collectives_on_two_nodes_of_two_gloo_ranks(tmp_path):
    import multiprocessing

    from llmq_ray.actors.collectives import free_port

    ctx = multiprocessing.get_context("spawn")
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=_comm_rank, args=(r, port, str(tmp_path))) for r in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    for p in procs:
        if p.is_alive():  # mismatched collectives hang: fail instead of leaving the process behind
            p.kill()
            p.join()
    assert [p.exitcode for p in procs] == [0] * 4
    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    ar = torch.arange(6, dtype=torch.float32)
    for g, out in enumerate(res):
        node, local = divmod(g, 2)
        assert out["place"] == (local, 2, node, 2)
        # the gradient sum over all 4 ranks (1+2+3+4 = 10 times), local rank l's third of it on both nodes
        assert torch.equal(out["reduce_scatter"], 10 * ar[3 * local:3 * local + 3]), g
        assert torch.equal(out["reduce_scatter_aliased"], 10 * ar[3 * local:3 * local + 3]), g
        # weights: gathered from the node's own ranks only
        assert out["all_gather"].tolist() == [100.0 * node] * 3 + [100.0 * node + 1] * 3, g
        assert out["broadcast"].tolist() == [100.0 * node + 1] * 2, g
        if local == 0:  # the piece's owner on each node gets the sum over every rank
            assert out["reduce_sum"].tolist() == [10.0, 10.0], g
        assert out["all_reduce_sum"].tolist() == [10.0], g  # per-rank totals: the whole run
        assert out["over_shards"].tolist() == [[3.0], [7.0]][node], g  # one copy of the shards: the node
        assert out["single_node_is_world"], g
        assert out["refused"].startswith("--zero-scope node needs the same number of workers on every node, but the "
                                         "4 workers were placed 3 on 10.0.0.4, 1 on 10.0.0.5;"), g
    for zero in ENGINE_ZERO_LEVELS:  # the loss and the norm (each shard counted once, not once per node)
        want = np.array(_engine_steps(_engine(zero, 4), [0, 1, 2, 3]))
        assert want[-1, 0] < want[0, 0] - 0.1, want  # it trained
        for g, out in enumerate(res):
            np.testing.assert_allclose(np.array(out[f"zero{zero}"]), want, rtol=1e-5, err_msg=f"ZeRO-{zero} rank {g}")


# ---------------------------------------------------------------------------------------------------- 2-node Ray
FAST = dict(collective_timeout_s=60.0, call_timeout_s=120.0, use_ray_data=False, verbose=False, progress=False)
STEPS = 4


@pytest.fixture(scope="module")
def two_nodes():
    """A Ray cluster of two simulated nodes of 2 CPUs each (one worker needs 1), with this process connected.

    A session Ray (the ``ray_cluster`` fixture of conftest.py) may already be up in this process: it is shut
    down for this module and started again afterwards, so later tests find it as they expect."""
    import ray
    from ray.cluster_utils import Cluster

    import conftest

    was_up = ray.is_initialized()
    if was_up:
        ray.shutdown()
    temp_dir = os.path.join(tempfile.gettempdir(), f"rayz-{os.getpid()}")
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=2, object_store_memory=conftest.RAY_OBJECT_STORE_BYTES // 2, temp_dir=temp_dir,
        include_dashboard=False))
    try:
        cluster.add_node(num_cpus=2, object_store_memory=conftest.RAY_OBJECT_STORE_BYTES // 2)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
        if was_up:
            conftest.start_session_ray()


def _fit(shards, out, **kw):
    from llmq_ray.train.trainer import LLMQTrainer

    args = dict(model="tiny", train_file=shards.train, steps=STEPS, batch_size=2, seq_len=16, learning_rate=3e-3,
                warmup=1, device="cpu", cpus_per_worker=1, out_dir=str(out), export=False, final_eval=False,
                eval_every_n_steps=0, **FAST)
    args.update(kw)
    trainer = LLMQTrainer(**args)
    return trainer.fit(), trainer.info


def _losses(result) -> np.ndarray:
    return np.array([r["loss"] for r in result.history])


def test_node_scope_matches_one_worker_and_its_checkpoint_resumes_on_one(two_nodes, shards, tmp_path):
    """4 workers on 2 nodes x grad_accumulation 1 read the same windows per step as 1 worker x grad_accumulation
    4 (see test_runtime.py's equality test): under node scope (ZeRO-2, whose gradient shards are reduced inside
    each node, then across nodes) the per-step losses agree within 1e-5, and the gradient norms too (the norm
    counts each shard once, not once per node). The run checkpoints at step 2: two shard files (the first
    node's), four data states; one worker resumes it and trains steps 3-4 as the uninterrupted one-worker run
    did. (ZeRO-1 and ZeRO-3 under node scope: the engine test above, in the same 4 processes as the collectives.)
    Near 60 s beside the rest of the suite: its set-up starts the 2-node cluster (and the session's Ray again
    after the module)."""
    import ray

    assert len([n for n in ray.nodes() if n["Alive"]]) == 2
    ref, _ = _fit(shards, tmp_path / "ref", workers=1, grad_accumulation=4)
    assert _losses(ref)[-1] < _losses(ref)[0]  # it trains
    ckpt = tmp_path / "ckpt"
    res, info = _fit(shards, tmp_path / "z2", workers=4, grad_accumulation=1, zero_level=2, zero_scope="node",
                     checkpoint_dir=str(ckpt), ckpt_interval=2)
    assert [n["node_id"] for n in info["nodes"]].count(info["nodes"][0]["node_id"]) == 2, info["nodes"]
    assert len({n["node_id"] for n in info["nodes"]}) == 2, info["nodes"]
    np.testing.assert_allclose(_losses(res), _losses(ref), rtol=1e-5)
    np.testing.assert_allclose([r["norm"] for r in res.history], [r["norm"] for r in ref.history], rtol=1e-4)
    from llmq_ray.checkpoints.layout import read_manifest

    folder = ckpt / "step_00000002"
    manifest = read_manifest(str(folder))
    assert (manifest["world_size"], manifest["data_world_size"], len(manifest["data_state"])) == (2, 4, 4)
    assert sorted(f["name"] for f in manifest["files"]) == ["rank_00000.safetensors", "rank_00001.safetensors"]
    resumed, _ = _fit(shards, tmp_path / "resumed", workers=1, grad_accumulation=4, resume=str(folder))
    assert len(resumed.history) == STEPS - 2
    np.testing.assert_allclose(_losses(resumed), _losses(ref)[2:], rtol=1e-5)
