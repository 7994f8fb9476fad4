"""The process group the worker actors form, and the ``Communicator`` that the engine runs its ZeRO collectives on.

One process per GPU (a ``GPUWorker`` actor). Rank 0 reserves a free TCP port on its node and publishes
``tcp://<its ip>:<port>`` through the coordinator; every rank then calls ``init_process_group`` with it.
NCCL on CUDA, gloo on CPU (so the whole distributed path runs in CPU tests).

Timeouts: ``init_process_group`` gets an explicit ``timeout`` (gloo's default is 30 minutes); it bounds every
collective of the group: a rank whose peer died raises instead of waiting forever. On NCCL,
``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` (set in the worker's environment) makes the watchdog tear the process
down after that timeout, since a CUDA kernel stuck in a collective cannot be interrupted from the host.
The coordinator additionally bounds every ``ray.get`` and kills the actors on failure, so nothing hangs.

Collective names: torch 2.13 renames ``reduce_scatter_tensor`` / ``all_gather_into_tensor`` to
``reduce_scatter_single`` / ``all_gather_single`` (the old names warn); torch 2.11 has only the old ones.
``_pick`` chooses whichever exists, new name first.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist

from llmq_ray.engine.train_engine import Communicator

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


def destroy_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class TorchDistCommunicator(Communicator):
    """The engine's collectives over the default torch.distributed group.

    Buffers are flat 1-D tensors of the model dtype (gradients, weights) or small fp32/fp64 vectors (loss
    sums, norms); all calls are in place and asynchronous to the host on CUDA (stream-ordered).
    """

    def __init__(self, rank: int, world_size: int, backend: str, timeout_s: float):
        self.rank, self.world_size, self.backend, self.timeout_s = rank, world_size, backend, timeout_s

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)

    def reduce_scatter_sum(self, shard_out: torch.Tensor, full: torch.Tensor) -> None:
        """shard_out[S] = (sum over ranks of full[W*S]) [rank*S:(rank+1)*S]; shard_out may alias that slice."""
        if self.world_size == 1:
            return super().reduce_scatter_sum(shard_out, full)
        size = shard_out.numel()
        if full.numel() != size * self.world_size:
            raise ValueError(f"reduce_scatter_sum: full has {full.numel()} elements, expected "
                             f"{self.world_size} x {size}")
        own = full[self.rank * size:(self.rank + 1) * size]
        if shard_out.data_ptr() == own.data_ptr():
            # NCCL and gloo allow in-place only in their own sense; use a temporary to stay portable.
            tmp = torch.empty_like(shard_out)
            _reduce_scatter(tmp, full, op=dist.ReduceOp.SUM)
            shard_out.copy_(tmp)
        else:
            _reduce_scatter(shard_out, full, op=dist.ReduceOp.SUM)

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        """full[W*S] = concatenation of every rank's shard[S]; shard may alias full's own slice."""
        if self.world_size == 1:
            return super().all_gather(full, shard)
        size = shard.numel()
        own = full[self.rank * size:(self.rank + 1) * size]
        src = shard.clone() if shard.data_ptr() == own.data_ptr() and self.backend == "gloo" else shard
        _all_gather(full, src)


    def broadcast(self, tensor: torch.Tensor, src: int):
        """Async, in place: tensor = rank ``src``'s (ZeRO-3's weight gathers); returns the handle."""
        if self.world_size == 1:
            return super().broadcast(tensor, src)
        return dist.broadcast(tensor, src=src, async_op=True)

    def reduce_sum(self, tensor: torch.Tensor, dst: int):
        """Async, in place: on ``dst`` tensor = sum over ranks (ZeRO-3's gradient reduces); returns the handle."""
        if self.world_size == 1:
            return super().reduce_sum(tensor, dst)
        return dist.reduce(tensor, dst=dst, op=dist.ReduceOp.SUM, async_op=True)


def set_worker_threads(num_threads: int) -> None:
    """CPU threads of this process: OMP_NUM_THREADS for libraries started later, torch's pool right now."""
    os.environ["OMP_NUM_THREADS"] = str(num_threads)
    torch.set_num_threads(max(1, num_threads))
