"""The process group the worker actors form, and the ``Communicator`` that the engine runs its ZeRO collectives on.

One process per GPU (a ``GPUWorker`` actor). Rank 0 reserves a free TCP port on its node and publishes
``tcp://<its ip>:<port>`` through the coordinator; every rank then calls ``init_process_group`` with it.
NCCL on CUDA, gloo on CPU (so the whole distributed path runs in CPU tests).

Timeouts: ``init_process_group`` gets an explicit ``timeout`` (gloo's default is 30 minutes); it bounds every
collective of the group: a rank whose peer died raises instead of waiting forever. On NCCL,
``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` (set in the worker's environment) makes the watchdog tear the process
down after that timeout, since a CUDA kernel stuck in a collective cannot be interrupted from the host.
The coordinator additionally bounds every ``ray.get`` and kills the actors on failure, so nothing hangs.

``--zero-scope node`` (``NodeScopeCommunicator``): the ZeRO shards are split among the workers of one node and
replicated on every node; each rank joins two subgroups (its node's ranks, and the ranks with its local rank
on every node) besides the world group, and ``node_scope`` builds that from the ranks' node ids.

Reduction order on gloo (CPU): ``reduce_sum`` is a gather to the root, which adds the ranks' values in rank
order, and ``reduce_scatter_sum`` is one such reduce per shard. Gloo's own reduce and reduce-scatter add in
orders of their own, which differ between the two from 3 ranks on; with one order for both, ZeRO-1 (one
reduce-scatter of the whole gradient) and ZeRO-2 (per-layer reduces onto the owners) give the same bits with
one micro-step per update (with more, the two add over ranks and micro-steps in different orders;
tests/test_zero3.py). The cost, CPU only: a root briefly holds W copies of the piece it reduces (ZeRO-1's
reduce-scatter: W copies of its shard). NCCL keeps its own (faster) algorithms: bit-identity across ZeRO levels
is a CPU property.

Collective names: torch 2.13 renames ``reduce_scatter_tensor`` / ``all_gather_into_tensor`` to
``reduce_scatter_single`` / ``all_gather_single`` (the old names warn); torch 2.11 has only the old ones.
``_pick`` chooses whichever exists, new name first.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from llmq_ray.engine.communicator import DONE, Communicator
from llmq_ray.errors import ConfigError

DEFAULT_TIMEOUT_S = 300.0


def _pick(*names: str):
    for name in names:
        fn = getattr(dist, name, None)
        if fn is not None:
            return fn
    raise RuntimeError(f"torch.distributed has none of {names}; torch {torch.__version__} is not supported.")


_reduce_scatter = _pick("reduce_scatter_single", "reduce_scatter_tensor")
_all_gather = _pick("all_gather_single", "all_gather_into_tensor")


def node_ip() -> str:
    """The IP this node is known to Ray by (127.0.0.1 on a loopback-only test cluster)."""
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray (unit tests)
        return "127.0.0.1"


def free_port(host: str = "") -> int:
    """A TCP port that is free right now on this node (the OS picks; released before returning)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_port_in(lo: int, hi: int, host: str = "") -> int:
    """The first port of [lo, hi] that is free right now on this node (--rendezvous-port-range); one
    RuntimeError sentence naming the range when none is."""
    for port in range(int(lo), int(hi) + 1):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"--rendezvous-port-range={lo}-{hi}: every port of the range is in use on {node_ip()}; "
                       f"widen it or free one.")


def interface_of(ip: str) -> str | None:
    """The name of this node's network interface that holds IPv4 address ``ip`` (None when none does).
    gloo otherwise binds to the address the host name resolves to, which on a cluster node can be an
    interface the other nodes cannot reach; the IP Ray knows the node by is one they can."""
    try:
        import fcntl
        import struct

        names = [name for _, name in socket.if_nameindex()]
    except (ImportError, OSError, AttributeError):  # not Linux: leave the choice to gloo
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            try:  # SIOCGIFADDR: the interface's IPv4 address (Linux; no extra package needed)
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on it
            if socket.inet_ntoa(raw[20:24]) == ip:
                return name
    return None


def set_socket_interface(ifname: str | None) -> dict:
    """Choose the collectives' network interface in this process before the group forms: ``ifname``
    (--socket-ifname) for gloo and NCCL alike; without one, gloo takes the interface of the node's Ray IP
    (unless GLOO_SOCKET_IFNAME is already set) and NCCL keeps its own choice. Returns what was set."""
    chosen = {}
    if ifname:
        chosen = {"GLOO_SOCKET_IFNAME": ifname, "NCCL_SOCKET_IFNAME": ifname}
    elif not os.environ.get("GLOO_SOCKET_IFNAME"):
        name = interface_of(node_ip())
        if name:
            chosen = {"GLOO_SOCKET_IFNAME": name}
    os.environ.update(chosen)
    return chosen


def init_group(init_method: str, rank: int, world_size: int, device: torch.device,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> "TorchDistCommunicator":
    """Join the group at ``init_method`` (``tcp://ip:port``) as ``rank``; NCCL for a CUDA device, else gloo.

    Returns the Communicator the engine uses. Raises RuntimeError naming the address when the rendezvous
    does not complete within ``timeout_s`` (a peer that never came up).
    """
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {}
    if backend == "nccl":
        kwargs["device_id"] = device  # binds the communicator to this GPU eagerly (faster first collective)
    try:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    except Exception as exc:  # noqa: BLE001 - rendezvous errors come in many types
        raise RuntimeError(f"rank {rank} could not join the {backend} process group at {init_method} "
                           f"({type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''})") from exc
    return TorchDistCommunicator(rank, world_size, backend, timeout_s)


def destroy_group(*, captured: bool = False) -> None:
    """Leave the process group. ``captured``: NCCL collectives were captured into CUDA graphs (ZeRO-1's reduce in
    the last micro-step's graph, llmq_ray/engine/grad_reduce.py); then ``destroy_process_group`` waits forever in
    ``ncclCommDestroy`` (seen on 2 x H100, torch 2.11, 2026-11-26; pytorch issue 115388), so the group is left
    as it is for the process's exit to release."""
    if dist.is_available() and dist.is_initialized() and not captured:
        dist.destroy_process_group()


class TorchDistCommunicator(Communicator):
    """The engine's collectives over one torch.distributed group: the default (world) group, or a subgroup.

    ``rank`` / ``world_size`` are this process's place in ``group``; ``members[i]`` is the global rank of
    group rank i (broadcast and reduce name their root by global rank). Buffers are flat 1-D tensors of the
    model dtype (gradients, weights) or small fp32/fp64 vectors (loss sums, norms); all calls are in place
    and asynchronous to the host on CUDA (stream-ordered).
    """

    def __init__(self, rank: int, world_size: int, backend: str, timeout_s: float, group=None,
                 members: list[int] | None = None):
        self.rank, self.world_size, self.backend, self.timeout_s = rank, world_size, backend, timeout_s
        self.group = group  # None: the default group (every rank of the run)
        self.members = list(members) if members is not None else list(range(world_size))

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)

    def all_reduce_start(self, tensor: torch.Tensor):
        """Async, in place: tensor = sum over the group; returns the handle (a done one for a group of 1)."""
        if self.world_size == 1:
            return DONE
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

    def reduce_scatter_sum(self, shard_out: torch.Tensor, full: torch.Tensor) -> None:
        """shard_out[S] = (sum over ranks of full[W*S]) [rank*S:(rank+1)*S]; shard_out may alias that slice."""
        if self.world_size == 1:
            return super().reduce_scatter_sum(shard_out, full)
        size = shard_out.numel()
        if full.numel() != size * self.world_size:
            raise ValueError(f"reduce_scatter_sum: full has {full.numel()} elements, expected "
                             f"{self.world_size} x {size}")
        own = full[self.rank * size:(self.rank + 1) * size]
        if self.backend == "gloo":  # rank-ordered sums (module docstring): one reduce per shard
            pending = [self.reduce_sum(full[r * size:(r + 1) * size].clone() if r == self.rank else
                                       full[r * size:(r + 1) * size], dst=r) for r in range(self.world_size)]
            for r, handle in enumerate(pending):
                handle.wait()
                if r == self.rank:
                    shard_out.copy_(handle.tensor)
            return
        if shard_out.data_ptr() == own.data_ptr():
            # NCCL allows in-place only in its own sense; use a temporary to stay portable.
            tmp = torch.empty_like(shard_out)
            _reduce_scatter(tmp, full, op=dist.ReduceOp.SUM, group=self.group)
            shard_out.copy_(tmp)
        else:
            _reduce_scatter(shard_out, full, op=dist.ReduceOp.SUM, group=self.group)

    def reduce_scatter_start(self, shard_out: torch.Tensor, full: torch.Tensor):
        """``reduce_scatter_sum`` started asynchronously, returning its handle (tensor parallelism: the input
        gradient's reduce-scatter beside the weight-gradient GEMM). NCCL: queued on NCCL's stream, ``wait()``
        orders the current stream after it; ``shard_out`` must not alias ``full``. gloo (CPU tests): done at
        once, in the rank-ordered sum of ``reduce_scatter_sum``."""
        if self.world_size == 1 or self.backend == "gloo":
            return super().reduce_scatter_start(shard_out, full)
        if full.numel() != shard_out.numel() * self.world_size:
            raise ValueError(f"reduce_scatter_start: full has {full.numel()} elements, expected "
                             f"{self.world_size} x {shard_out.numel()}")
        return _reduce_scatter(shard_out, full, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        """full[W*S] = concatenation of every rank's shard[S]; shard may alias full's own slice."""
        if self.world_size == 1:
            return super().all_gather(full, shard)
        size = shard.numel()
        own = full[self.rank * size:(self.rank + 1) * size]
        src = shard.clone() if shard.data_ptr() == own.data_ptr() and self.backend == "gloo" else shard
        _all_gather(full, src, group=self.group)

    def broadcast(self, tensor: torch.Tensor, src: int):
        """Async, in place: tensor = group rank ``src``'s (ZeRO-3's weight gathers); returns the handle."""
        if self.world_size == 1:
            return super().broadcast(tensor, src)
        return dist.broadcast(tensor, src=self.members[src], group=self.group, async_op=True)

    def reduce_sum(self, tensor: torch.Tensor, dst: int):
        """Async, in place: on group rank ``dst`` tensor = sum over the group (ZeRO-3's gradient reduces);
        returns the handle."""
        if self.world_size == 1:
            return super().reduce_sum(tensor, dst)
        if self.backend == "gloo":  # rank-ordered sum (module docstring)
            parts = [torch.empty_like(tensor) for _ in range(self.world_size)] if self.rank == dst else None
            work = dist.gather(tensor, gather_list=parts, dst=self.members[dst], group=self.group, async_op=True)
            return _RankOrderSum(work, tensor, parts)
        return dist.reduce(tensor, dst=self.members[dst], op=dist.ReduceOp.SUM, group=self.group, async_op=True)


class _RankOrderSum:
    """The handle of a gloo reduce done as a gather: ``wait`` waits for it and, on the root, writes
    ((x_0 + x_1) + x_2) + ... into ``tensor`` -- the same order for every reduce and reduce-scatter."""

    def __init__(self, work, tensor: torch.Tensor, parts: list[torch.Tensor] | None):
        self.work, self.tensor, self.parts = work, tensor, parts

    def wait(self) -> None:
        if self.work is None:
            return
        self.work.wait()
        self.work = None
        if self.parts is not None:
            self.tensor.copy_(self.parts[0])
            for part in self.parts[1:]:
                self.tensor.add_(part)
            self.parts = None


# ---------------------------------------------------------------------------------------------------- node scope
def workers_per_node(node_of_rank: list[str], names: dict | None = None) -> int:
    """--zero-scope node: the number of workers on each node, given the node (any hashable key) of each rank.

    Node scope needs the ranks of a node to be contiguous (rank = node index x L + local rank) and the same
    number L of workers on every node, since rank i of every node holds the same shard. One ConfigError
    sentence naming the counts per node (``names``: key -> what to call the node, e.g. its IP) otherwise."""
    counts: dict = {}
    for node in node_of_rank:
        counts[node] = counts.get(node, 0) + 1
    per_node = counts[node_of_rank[0]]
    nodes = list(counts)  # in order of their first rank
    contiguous = node_of_rank == [n for n in nodes for _ in range(counts[n])]
    if contiguous and len(set(counts.values())) == 1:
        return per_node
    names = names or {}
    placed = ", ".join(f"{counts[n]} on {names.get(n, n)}" for n in nodes)
    how = "the same number of workers on every node" if contiguous else "each node's workers to have consecutive ranks"
    raise ConfigError(f"--zero-scope node needs {how}, but the {len(node_of_rank)} workers were placed {placed}; "
                      f"use a worker count that fills every node evenly, or --zero-scope world.")


def tensor_parallel_rank_lists(world_size: int, tp: int, per_node: int) -> tuple[list[list[int]], list[list[int]]]:
    """The 2-D layout world = data-parallel x tensor-parallel (``--tensor-parallel`` T): the tensor-parallel
    groups are T consecutive ranks (rank = dp index x T + tp rank), so with the ranks of a node contiguous
    (``per_node`` of them, actors/placement.py) a group never leaves its node and its per-layer activation
    collectives stay on NVLink; the data-parallel groups are the ranks with the same tp rank, one per group,
    which split the ZeRO shards. Returns (tp rank lists, dp rank lists); one ConfigError sentence when T does
    not divide the worker count or the workers of a node."""
    if tp < 1 or world_size % tp:
        raise ConfigError(f"--tensor-parallel={tp} must divide the number of workers ({world_size}).")
    if per_node % tp:
        raise ConfigError(f"--tensor-parallel={tp} must divide the {per_node} workers of each node: a "
                          f"tensor-parallel group exchanges activations every layer and must stay on one node.")
    tp_lists = [list(range(g * tp, (g + 1) * tp)) for g in range(world_size // tp)]
    dp_lists = [list(range(r, world_size, tp)) for r in range(tp)]
    return tp_lists, dp_lists


def kv_replica_rank_lists(world_size: int, tp: int, kv_replicas: int) -> list[list[int]]:
    """The ranks that hold the same KV heads when a model has fewer KV heads than ``tp`` (each KV head lives on
    ``kv_replicas`` consecutive ranks of its tensor-parallel group: tp rank r holds KV head r // kv_replicas,
    ``TensorParallelPlan.kv_heads``); their partial gradients of those heads are summed over this set. Every
    tensor-parallel group of ``tensor_parallel_rank_lists`` splits into tp / kv_replicas such sets."""
    if kv_replicas < 1 or tp % kv_replicas:
        raise ValueError(f"kv_replica_rank_lists: {kv_replicas} replicas do not divide a group of {tp}")
    return [list(range(start, start + kv_replicas)) for start in range(0, world_size, kv_replicas)]


class TensorParallelGroups(NamedTuple):
    """This rank's communicators of the 2-D layout: ``tp`` over its tensor-parallel group, ``dp`` over its
    data-parallel group (the ZeRO shards), ``kv_replica`` over the ranks holding the same replicated KV heads
    (None when the KV heads are split, not replicated)."""
    tp: TorchDistCommunicator
    dp: TorchDistCommunicator
    kv_replica: Optional[TorchDistCommunicator]


def tensor_parallel_groups(world: TorchDistCommunicator, tp: int, per_node: int,
                           kv_replicas: int = 1) -> TensorParallelGroups:
    """This rank's communicators over subgroups of ``world`` (every rank calls this with the same arguments;
    the layout is ``tensor_parallel_rank_lists``'s and, with ``kv_replicas`` > 1 (``TensorParallelPlan
    .kv_replicas``), ``kv_replica_rank_lists``'s)."""
    tp_lists, dp_lists = tensor_parallel_rank_lists(world.world_size, tp, per_node)
    tp_groups = _new_groups(tp_lists, world.timeout_s)  # all ranks create every group, in this order
    dp_groups = _new_groups(dp_lists, world.timeout_s)
    g, r = divmod(world.rank, tp)
    tp_comm = TorchDistCommunicator(r, tp, world.backend, world.timeout_s, group=tp_groups[g], members=tp_lists[g])
    dp_comm = TorchDistCommunicator(g, world.world_size // tp, world.backend, world.timeout_s, group=dp_groups[r],
                                    members=dp_lists[r])
    kv_comm = None
    if kv_replicas > 1:
        kv_lists = kv_replica_rank_lists(world.world_size, tp, kv_replicas)
        kv_groups = _new_groups(kv_lists, world.timeout_s)
        k = world.rank // kv_replicas
        kv_comm = TorchDistCommunicator(world.rank % kv_replicas, kv_replicas, world.backend, world.timeout_s,
                                        group=kv_groups[k], members=kv_lists[k])
    return TensorParallelGroups(tp_comm, dp_comm, kv_comm)


def _new_groups(rank_lists: list[list[int]], timeout_s: float) -> list:
    """One torch.distributed subgroup per list of global ranks; every rank must call this with the same lists."""
    timeout = datetime.timedelta(seconds=timeout_s)
    return [dist.new_group(ranks=ranks, timeout=timeout) for ranks in rank_lists]


class NodeScopeCommunicator(Communicator):
    """--zero-scope node: ZeRO shards split among the L workers of a node, one copy of them on each of N nodes.

    Ranks are contiguous per node (global rank = node x L + local rank), so this process belongs to two
    subgroups: ``node``, the L ranks of its node (the shard group: ``rank`` = local rank, ``world_size`` = L),
    and ``across``, the N ranks with its local rank on every node (the ranks holding the same shard). The shard
    collectives run inside the node; gradients, which differ between nodes (each reads its own batches), are
    summed across nodes by one all-reduce of the reduced shard, so every copy of a shard stays identical and
    only 1/L of the gradient bytes cross the (slower) network between nodes. Totals that are per rank (loss
    sums, target counts) are summed over the whole run.
    """

    def __init__(self, world: TorchDistCommunicator, per_node: int):
        n_nodes = world.world_size // per_node
        if per_node < 1 or n_nodes * per_node != world.world_size:
            raise ValueError(f"NodeScopeCommunicator: {world.world_size} ranks do not split into nodes of {per_node}")
        node, local = divmod(world.rank, per_node)
        node_ranks = [[n * per_node + i for i in range(per_node)] for n in range(n_nodes)]
        across_ranks = [[n * per_node + i for n in range(n_nodes)] for i in range(per_node)]
        node_groups = _new_groups(node_ranks, world.timeout_s)  # all ranks create every group, in this order
        across_groups = _new_groups(across_ranks, world.timeout_s)
        self.world = world
        self.node = TorchDistCommunicator(local, per_node, world.backend, world.timeout_s, node_groups[node],
                                          node_ranks[node])
        self.across = TorchDistCommunicator(node, n_nodes, world.backend, world.timeout_s, across_groups[local],
                                            across_ranks[local])
        self.rank, self.world_size = local, per_node
        self.replica, self.replicas = node, n_nodes
        self.backend, self.timeout_s = world.backend, world.timeout_s

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """Sum over every rank of the run (per-rank totals: each rank's batches are its own)."""
        self.world.all_reduce_sum(tensor)

    def all_reduce_over_shards(self, tensor: torch.Tensor) -> None:
        """Sum within the node only: its L ranks hold one copy of every shard."""
        self.node.all_reduce_sum(tensor)

    def reduce_scatter_sum(self, shard_out: torch.Tensor, full: torch.Tensor) -> None:
        """shard_out[S] = this rank's shard of the sum over all ranks of full[L*S]: reduce-scatter within the
        node, then all-reduce the shard [S] across nodes."""
        self.node.reduce_scatter_sum(shard_out, full)
        self.across.all_reduce_sum(shard_out)

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        """full[L*S] from the node's L shards (every node holds the same ones: nothing crosses nodes)."""
        self.node.all_gather(full, shard)

    def broadcast(self, tensor: torch.Tensor, src: int):
        """Async: tensor = local rank ``src``'s, broadcast within each node (each node has the owner's copy)."""
        return self.node.broadcast(tensor, src)

    def reduce_sum(self, tensor: torch.Tensor, dst: int):
        """Async: on local rank ``dst`` of every node, tensor = sum over all ranks: a reduce within the node,
        then (on the owners only) an all-reduce of the piece across nodes. The node reduce is waited for
        before the all-reduce is queued (on CUDA that orders the streams, without a host sync)."""
        handle = self.node.reduce_sum(tensor, dst)
        if self.rank != dst:
            return handle
        handle.wait()
        return self.across.all_reduce_start(tensor)


def node_scope(world: TorchDistCommunicator, node_id: str, ip: str = "") -> Communicator:
    """The Communicator for --zero-scope node, built by every rank together from the world group: the ranks'
    (node id, IP) are all-gathered (``node_id``: this rank's, Ray's node id) to find the workers per node; on a
    single node that is the world itself. The placement (actors/placement.py) puts a node's ranks next to each
    other; a placement with unequal workers per node is refused here, by every rank alike, in the ConfigError
    sentence of ``workers_per_node`` naming the count per node."""
    found: list = [None] * world.world_size
    if world.world_size > 1:
        dist.all_gather_object(found, (node_id, ip))
    else:
        found = [(node_id, ip)]
    ips = [ip for _, ip in dict(found).items()]
    names = {n: (f"{i} (node {n[:8]})" if not i or ips.count(i) > 1 else i) for n, i in found}  # one IP, many nodes: tests
    per_node = workers_per_node([n for n, _ in found], names=names)
    if per_node == world.world_size:
        return world
    return NodeScopeCommunicator(world, per_node)


def set_worker_threads(num_threads: int) -> None:
    """CPU threads of this process: OMP_NUM_THREADS for libraries started later, torch's pool right now."""
    os.environ["OMP_NUM_THREADS"] = str(num_threads)
    torch.set_num_threads(max(1, num_threads))
