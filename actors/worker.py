"""``GPUWorker``: the Ray actor that owns one GPU (or, with ``device="cpu"``, a few CPU cores) of a run.

It holds a ``TrainEngine`` (the full weights under ZeRO-1/2, its shard of the optimizer state and, under
ZeRO-2, of the gradients), its own data source (rank r of W; under --tensor-parallel its group's, below), and the
torch.distributed group over which
the engine's collectives run.

With ``--tensor-parallel T`` (llmq_ray/parallel/tensor.py) the W workers form W/T tensor-parallel groups
of T consecutive ranks (one node; the coordinator checks the placement): the engine holds this rank's part of
each block and its ZeRO shards over the *data-parallel* group (the ranks with the same tensor-parallel rank),
and the data source is the group's (data-parallel rank r // T of W / T): the T ranks of a group read the same
batches. Checkpoints and exports stay in the whole model's layout: the state is gathered over the
data-parallel group, then joined over the tensor-parallel group, and tensor-parallel rank 0 of each group
writes data-parallel shard r // T of it (``_full_layout_shard``). The coordinator makes **one Ray call per worker per optimizer step**
(``train_step``): all grad-accumulation micro-steps and the update run inside the actor, without a host
sync until the update's small stats tensor is read. The result is a small dict.

Placement and devices (see ``actors/placement.py``): each worker sits in a {GPU: 1, CPU: k} bundle.
A GPU worker's ``runtime_env`` sets ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1`` so that every worker on
a node sees all its GPUs (per-actor CUDA_VISIBLE_DEVICES masking is known to make NCCL slow); the worker
then picks its own GPU: the one Ray assigned to its bundle when Ray reports it, else ``cuda:<local_rank>``.
``OMP_NUM_THREADS`` = k and ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` come with the rest of ``worker_env``: as a
constructor argument that ``__init__`` applies first (a CPU worker has no runtime_env unless it must,
actors/actor_env.py says when and why).

Imports: torch, the engine and the collectives are imported inside the methods that run in the worker's own
process (``setup`` first), never at the top: the coordinator imports this module to create the actors, and
torch alone takes ~3 s to import on a small CPU machine -- time every run would wait before its workers start.

Method order: ``rendezvous_address`` (rank 0 only) -> ``setup`` (all ranks, concurrently) -> any of
``train_step`` / ``micro_step`` + ``update`` / ``evaluate`` / ``export`` -> ``close``.

``activity`` is the exception: it runs in the actor's second concurrency group (``PROBE_GROUP``, one
thread; placement.py declares it), so the coordinator can ask a worker what it is doing *while* a
``train_step`` call is still running there -- which is how a step that does not finish in time is pinned
on the rank that hung rather than on the peers waiting for it in a collective (actors/failures.py). The
other methods keep running one at a time, in order, on one thread of their own.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from llmq_ray import storage

from llmq_ray.actors import telemetry
from llmq_ray.actors.actor_env import apply_env
from llmq_ray.actors.fault_injection import FaultInjector
from llmq_ray.actors.plan import RunPlan
from llmq_ray.model.config import resolve_model
from llmq_ray.errors import ConfigError
from llmq_ray.heap import GcPauses, freeze_long_lived

if TYPE_CHECKING:  # torch and everything that imports it load in the worker's own process, when it sets up
    import torch

    from llmq_ray.engine.train_engine import TrainEngine

PROBE_GROUP = "probe"  # the concurrency group of ``GPUWorker.activity``


def worker_env(cpus_per_worker: int) -> dict:
    """A worker's environment (actors/actor_env.py: what of it goes through runtime_env): the variables the driver forwarded to the coordinator (listed in
    ``LLMQ_RAY_FORWARDED``, see llmq_ray/train/trainer.py ``forwarded_env``; they win over the defaults below,
    so a user's NCCL_* setting is kept) and the defaults a worker needs."""
    env = {
        "OMP_NUM_THREADS": str(cpus_per_worker),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
        "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0"),
    }
    if os.environ.get("PYTHONPATH"):  # the coordinator's, which the trainer points at this checkout
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    for name in filter(None, os.environ.get("LLMQ_RAY_FORWARDED", "").split(",")):
        if name in os.environ:
            env[name] = os.environ[name]
    return env


def _tensor_parallel_groups(world, cfg, size: int):
    """(the data-parallel group's communicator, the engine's ``TensorParallelRank``) of this rank in the 2-D
    layout of ``size``-rank tensor-parallel groups (actors/collectives.py ``tensor_parallel_groups``; a
    collective: every rank creates every group). The coordinator has checked that each group is on one node."""
    from llmq_ray.actors.collectives import tensor_parallel_groups
    from llmq_ray.parallel.tensor import TensorParallelPlan, TensorParallelRank

    plan = TensorParallelPlan(cfg, size)
    groups = tensor_parallel_groups(world, size, per_node=size, kv_replicas=plan.kv_replicas)
    return groups.dp, TensorParallelRank(plan, groups.tp.rank, groups.tp, groups.kv_replica)


def pick_cuda_device(local_rank: int) -> "torch.device":
    """This worker's GPU. With NOSET_CUDA_VISIBLE_DEVICES the process sees all the node's GPUs; Ray still
    records which one it assigned to the bundle (``ray.get_gpu_ids()``, physical ids). We map that id
    through any node-level CUDA_VISIBLE_DEVICES to a torch index; if Ray reports nothing, ``local_rank``."""
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        raise ConfigError("--device=cuda but this worker sees no CUDA device; use --device=cpu.")
    index = local_rank
    try:
        import ray

        ids = [str(i) for i in ray.get_gpu_ids()]
    except Exception:  # noqa: BLE001
        ids = []
    if len(ids) == 1:
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        if visible and ids[0] in visible:
            index = visible.index(ids[0])
        elif not visible and ids[0].isdigit():
            index = int(ids[0])
    if index >= count:
        index = local_rank % count
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


class GPUWorker:
    """One rank of a run (wrap with ``ray.remote`` and a placement-group strategy; see actors/placement.py)."""

    def __init__(self, rank: int, plan: RunPlan, env: dict | None = None):
        apply_env(env)  # worker_env's variables, before torch is imported below (actors/actor_env.py)
        self.rank, self.plan = rank, plan
        telemetry.set_run_id(plan.settings.observe.run_id)  # the run_id tag of every metric this worker publishes
        self.faults = FaultInjector(plan.fault, rank)  # tests only: does nothing without plan.fault
        self._uploads = None  # checkpoint uploads running in the background (llmq_ray/checkpoints/remote.py)
        self._snapshot = None  # the reused host buffers a background checkpoint is copied into (HostSnapshot)
        self.world_size = plan.world_size
        # the data-parallel rank and size: which batches this worker reads and which checkpoint shard it owns
        self.dp_rank, self.dp_size = rank // plan.settings.parallel.tensor_parallel, plan.data_parallel_size
        self.engine: TrainEngine | None = None
        self.device: torch.device | None = None
        self._train = self._eval_periodic = self._eval_full = None
        self._activity = {"step": None, "at": -2, "what": "idle", "since": time.monotonic()}
        self._heap_frozen = False
        self._gc_pauses = GcPauses()
        from llmq_ray.actors.collectives import set_worker_threads

        set_worker_threads(plan.settings.parallel.cpus_per_worker)

    # ------------------------------------------------------------------ set-up
    def node(self) -> dict:
        """Where this actor runs: {"node_id", "ip", "pid", "gpu_ids"} (the coordinator derives local ranks)."""
        import ray

        from llmq_ray.actors.collectives import node_ip

        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "ip": node_ip(), "pid": os.getpid(),
                "gpu_ids": [str(i) for i in ray.get_gpu_ids()]}

    def rendezvous_address(self) -> str:
        """Rank 0 only: reserve a free port on this node and return ``tcp://ip:port`` for init_process_group."""
        from llmq_ray.actors.collectives import free_port, free_port_in, node_ip

        ip = node_ip()
        ports = self.plan.rendezvous_ports
        return f"tcp://{ip}:{free_port_in(*ports) if ports else free_port()}"

    def setup(self, init_method: str, local_rank: int) -> dict:
        """Pick the device, join the process group, build the engine (weights: init or HF load) and the
        data sources. Returns {"device", "device_name", "memory": {...}, "dataset": {...}}."""
        import torch

        from llmq_ray.actors.collectives import init_group, node_scope, set_socket_interface
        from llmq_ray.actors.data import eval_source, train_source
        from llmq_ray.engine.train_engine import TrainEngine, make_backend

        plan, o = self.plan, self.plan.settings
        if plan.settings.parallel.device == "cuda":
            self.device = pick_cuda_device(local_rank)
        else:
            self.device = torch.device("cpu")
        set_socket_interface(plan.settings.parallel.socket_ifname)
        comm = init_group(init_method, self.rank, self.world_size, self.device, plan.settings.checkpoints.collective_timeout_s)
        if o.parallel.zero_scope == "node":  # shards within each node, a copy per node (actors/collectives.py)
            where = self.node()
            comm = node_scope(comm, where["node_id"], where["ip"])
        cfg, weights = resolve_model(o.model.model)
        tensor_parallel = None
        if plan.settings.parallel.tensor_parallel > 1:  # the engine's comm becomes the data-parallel group's
            comm, tensor_parallel = _tensor_parallel_groups(comm, cfg, plan.settings.parallel.tensor_parallel)
        backend = make_backend(plan.settings.parallel.backend, o, self.device)
        self.engine = TrainEngine(cfg, o, backend, comm, init_weights=o.model.from_scratch or weights is None,
                                  tensor_parallel=tensor_parallel)
        if not o.model.from_scratch:
            if weights is None:
                raise ConfigError(f"--model={o.model.model!r} is a preset without weights; add --from-scratch or "
                                  f"pass an HF model folder.")
            from llmq_ray.model.hf_io import load_hf_weights
            from llmq_ray.model.params import ParamLayout

            if self.engine.params is not None and tensor_parallel is None:
                load_hf_weights(weights, self.engine.layout, self.engine.params)
            else:  # ZeRO-3 or tensor parallelism: read the whole model on the host, keep this rank's part
                full_layout = ParamLayout(cfg)
                flat = torch.empty(full_layout.numel, dtype=o.numerics.torch_dtype)
                load_hf_weights(weights, full_layout, flat)
                self.engine.load_full_params(flat)
            self.engine.reset_optimizer_from_params()
        self._train = train_source(plan, cfg.vocab_size, self.dp_rank)
        if plan.checkpoints_on and storage.is_remote(plan.ckpt_dir) and tensor_parallel is None:
            # (under tensor parallelism the state is gathered into host tensors of another size at each save)
            from llmq_ray.checkpoints.remote import HostSnapshot
            from llmq_ray.checkpoints.resume import engine_checkpoint_tensors

            # the pinned buffers of background checkpoints, now rather than in the step loop (~1.5-2.4 s for a
            # 4 GB shard on an H200: page-locking is slow)
            self._snapshot = HostSnapshot()
            self._snapshot.reserve(engine_checkpoint_tensors(self.engine))
        self._gpu_util = None
        if self.device.type == "cuda" and plan.settings.observe.log_gpu_util > 0:
            from llmq_ray.observe.gpu_stats import GpuUtilLogger

            self._gpu_util = GpuUtilLogger(plan.settings.observe.log_gpu_util, device=self.device)
        if plan.settings.data.eval_file:
            self._eval_periodic = eval_source(plan, cfg.vocab_size, self.dp_rank, plan.settings.observe.eval_num_steps)
            self._eval_full = eval_source(plan, cfg.vocab_size, self.dp_rank, None)
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        return {"device": str(self.device), "device_name": name, "memory": self.memory_table(),
                "dataset": self._dataset_info(), "backend": self.engine.backend.describe()}

    def _dataset_info(self) -> dict:
        src = self._train
        info: dict = {"synthetic": self.plan.settings.data.synthetic_data}
        spec_obj = getattr(src, "spec", None)
        if spec_obj is not None:
            info.update(files=list(spec_obj.paths), tokens=int(sum(spec_obj.n_tokens)),
                        windows_per_epoch_per_rank=int(src.windows_per_epoch))
        if self._eval_full is not None:
            info.update(eval_files=list(self._eval_full.spec.paths), eval_tokens=int(sum(self._eval_full.spec.n_tokens)),
                        eval_batches_per_rank=len(self._eval_full))
        return info

    def memory_table(self) -> dict:
        """Bytes of each part of the training state on this worker, measured from the tensors themselves
        (weights, master, Adam m/v, grads, activations, FP8 copies, scratch; on CUDA also allocated/free)."""
        from llmq_ray.observe.memory_table import memory_dict, memory_table

        return memory_dict(memory_table(self.engine))

    # ------------------------------------------------------------------ steps
    def _mark(self, step: int | None, at: int, what: str, **extra) -> None:
        """Record where this rank is inside train_step: ``at`` orders the points of one step (-1 its start,
        2k / 2k+1 reading / forward+backward of micro-batch k, 2 x grad_accumulation the update). In
        ``evaluate``: ``at`` = eval batches done, with ``eval_total`` and ``eval_tag`` in ``extra``."""
        self._activity = {"step": step, "at": at, "what": what, "since": time.monotonic(), **extra}

    def activity(self) -> dict:
        """Where this rank is (see ``_mark``) and for how many seconds: {"step", "at", "what", "seconds"}.
        Runs in ``PROBE_GROUP``, concurrently with a running call."""
        a = dict(self._activity)
        a["seconds"] = time.monotonic() - a.pop("since")
        return a

    def micro_step(self, step: int | None = None, index: int = 0, last: bool = False) -> float:
        """One forward+backward on this rank's next batch; returns seconds spent waiting for data.
        ``step`` / ``index``: which step and micro-batch this is (train_step's), for ``activity``; ``last``:
        the update comes next (TrainEngine.micro_step)."""
        self._mark(step, 2 * index, f"reading micro-batch {index}")
        t0 = time.perf_counter()
        inputs, targets = self._train.next_batch()
        data_s = time.perf_counter() - t0
        self._mark(step, 2 * index + 1, f"in the forward/backward of micro-batch {index}")
        self.engine.micro_step(inputs, targets, last=last)
        return data_s

    def update(self, step: int, lr: float, limits: dict | None = None) -> dict:
        """The optimizer update number ``step + 1`` (0-based ``step``) at learning rate ``lr``; ``limits``
        ({"loss", "norm"}, from the spike guard) skip it when the step's loss or norm is above them."""
        e = self.engine
        self.faults.before_update(step, e.grad_shard if e.grad_shard is not None else e.grads)
        limits = limits or {}
        s = self.engine.update(lr, step + 1, max_loss=limits.get("loss"), max_norm=limits.get("norm"))
        return {"loss": s.loss, "norm": s.grad_norm, "targets": s.tokens, "skipped": s.skipped,
                "skip_reason": s.skip_reason}

    def train_step(self, step: int, lr: float, limits: dict | None = None) -> dict:
        """grad_accumulation micro-steps then the update: one whole optimizer step in one Ray call.

        Returns {"loss", "norm", "targets", "skipped", "skip_reason", "seconds" (inside this call),
        "data_seconds", "memory"} -- loss/norm/targets are already reduced over all ranks."""
        o = self.plan.settings
        self._mark(step, -1, "at the start of the step")
        self.faults.before_step(step)
        events_before = telemetry.allocator_events(self.device)
        self._gc_pauses.take()
        t0 = time.perf_counter()
        data_s = 0.0
        if o.numerics.fp8_monitor_every and (step + 1) % o.numerics.fp8_monitor_every == 0:
            self.engine.monitor_begin()
        for k in range(o.data.grad_accumulation):
            data_s += self.micro_step(step, k, last=k + 1 == o.data.grad_accumulation)
        self._mark(step, 2 * o.data.grad_accumulation, "in the update")
        out = self.update(step, lr, limits)  # reads the stats to the host: the step's one sync
        monitor = self.engine.monitor_take()  # after that sync: no extra wait
        if monitor is not None:
            out["fp8_monitor"] = monitor
        self._mark(step, 2 * o.data.grad_accumulation + 1, "done with the step")
        seconds = time.perf_counter() - t0
        # this worker's share of the tokens: a tensor-parallel group's T ranks compute one batch between them
        tokens = o.data.batch_size * o.data.seq_len * o.data.grad_accumulation / self.plan.settings.parallel.tensor_parallel
        mem = telemetry.memory_bytes(self.device)
        out.update(seconds=seconds, data_seconds=data_s, memory=mem)
        events = telemetry.allocator_events(self.device)
        out["allocator_events"] = {k: v - events_before[k] for k, v in events.items() if v != events_before[k]}
        out["gc_seconds"], out["gc_collections"] = self._gc_pauses.take()
        if not self._heap_frozen:  # after the first step (kernels compiled, engine built): see llmq_ray/heap.py
            self._heap_frozen = True
            freeze_long_lived()
        sample = self._gpu_util.maybe_sample(step + 1) if getattr(self, "_gpu_util", None) else None
        if sample:
            out["gpu_util"] = sample
        telemetry.publish({"llmq_worker_tokens_per_second": tokens / max(seconds, 1e-9),
                           "llmq_worker_step_seconds": seconds, "llmq_worker_loss": out["loss"],
                           "llmq_worker_memory_bytes": mem}, {"rank": str(self.rank)})
        return out

    def evaluate(self, full: bool, tag: int | None = None) -> dict:
        """Summed loss and target count over the eval file (all of it, or eval_num_steps batches), reduced
        over ranks: {"loss_sum", "targets", "seconds"}. ``activity`` counts the batches done (for the eval
        bar), under ``tag`` (the coordinator's number of this eval)."""
        stream = self._eval_full if full else self._eval_periodic
        if stream is None:
            return {"loss_sum": 0.0, "targets": 0, "seconds": 0.0}
        t0 = time.perf_counter()
        loss_sum, count = self.engine.evaluate(self._counted(stream, tag))
        return {"loss_sum": loss_sum, "targets": count, "seconds": time.perf_counter() - t0,
                "batches": len(stream)}

    def _counted(self, stream, tag: int | None):
        """``stream``'s batches, marking in ``activity`` how many were done before each."""
        n = len(stream)
        for k, batch in enumerate(stream):
            self._mark(None, k, f"in eval batch {k + 1} of {n}", eval_total=n, eval_tag=tag)
            self.faults.eval_batch()
            yield batch
        self._mark(None, n, "done with the eval batches", eval_total=n, eval_tag=tag)

    # ------------------------------------------------------------------ outputs
    def export(self, out_dir: str, dtype: str | None, write: bool = True) -> str | None:
        """Write the weights as an HF folder, atomically; returns its absolute path (or its URI: an object
        store gets it through a staging folder on this node, llmq_ray/model/hf_io.py ``export_hf_to_uri``). Under
        ZeRO-3 and tensor parallelism gathering them is a collective: every rank calls this, and only the one
        with ``write`` writes (others: None)."""
        from llmq_ray import storage
        from llmq_ray.model.hf_io import export_hf, export_hf_to_uri

        e = self.engine
        flat = self._whole_model_weights(keep=write)
        if not write:
            return None
        import torch

        torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype] if dtype else flat.dtype
        from llmq_ray.model.tokenizer_files import tokenizer_source_for_export

        _, weights = resolve_model(self.plan.settings.model.model)
        write_to = export_hf_to_uri if storage.is_remote(out_dir) else export_hf
        from llmq_ray.model.params import ParamLayout

        return write_to(out_dir, e.full_cfg, ParamLayout(e.full_cfg), flat.cpu(), dtype=torch_dtype,
                        tokenizer_source=tokenizer_source_for_export(weights, e.full_cfg.vocab_size))

    def _whole_model_weights(self, keep: bool = True) -> "torch.Tensor | None":
        """The whole model's weights [full layout numel], model dtype: a collective under ZeRO-3 (over the
        data-parallel group) and under tensor parallelism (then joined over the tensor-parallel group, slot by
        slot, into host memory on the ranks that ``keep`` it; the others get None)."""
        flat = self.engine.full_params()
        if self.engine.tp is not None:
            return self.engine.tensor_parallel_gather(flat, keep=keep)
        return flat

    def flat_params(self) -> "torch.Tensor":
        """A CPU fp32 copy of the whole model's weights [layout.numel] (tests, small models; a collective under
        ZeRO-3 and tensor parallelism)."""
        return self._whole_model_weights().detach().float().cpu().clone()

    def data_state(self) -> dict:
        return self._train.state() if self._train is not None else {}

    def pid(self) -> int:
        """This actor's process id (tests kill it)."""
        return os.getpid()

    # ------------------------------------------------------------------ checkpoints
    def save_shard(self, tmp_dir: str, step: int, upload_to: str | None = None,
                   background: bool = False) -> tuple[dict | None, dict | None, dict]:
        """Write this rank's optimizer shard into the checkpoint being written at ``tmp_dir`` (``step`` =
        updates completed). Returns (the write record for ``finalize_checkpoint``, this rank's data state, its
        delayed FP8 scales as JSON lists: ``resume.fp8_scale_state_json``, {} without them; every rank returns
        its own, whether it writes a shard or not). A full disk raises the CheckpointError sentence of
        llmq_ray/checkpoints/local.py. ``upload_to``: the
        checkpoint's URI on an object store; ``tmp_dir`` is then a staging folder on this node (made here if
        this is not the coordinator's node), and the shard is uploaded from it: before returning, or with
        ``background`` on this worker's upload thread after returning: then only a copy of the state into
        reused (pinned) host buffers happens before returning, and the file is written, hashed and uploaded on
        that thread; the record is {"rank", "pending": True} and ``upload_status`` returns the real one when
        the upload is done.

        With --zero-scope node every node holds a copy of the shards: only the first node's ranks write theirs
        (as shard files 0 .. L-1: a checkpoint of L shards); the others return None and their data state. With
        --tensor-parallel every rank takes part in gathering the state (``_full_layout_shard``); tensor-parallel
        rank 0 of each group writes data-parallel shard r // T, the others return (None, None, scales)."""
        from llmq_ray.checkpoints.layout import rank_file_name
        from llmq_ray.checkpoints.local import write_rank_shard
        from llmq_ray.checkpoints.resume import engine_checkpoint_tensors, fp8_scale_state_json

        e = self.engine
        scales = fp8_scale_state_json(e)  # now: the next step changes them
        if e.comm.replica != 0:  # a copy of the shards the first node writes
            return None, self.data_state(), scales
        rank, start, end = e.comm.rank, e.shard_start, e.shard_end
        state = None
        if e.tp is not None:  # the whole model's layout, data-parallel shard dp_rank of it (a collective)
            state, start, end = self._full_layout_shard()
            if e.tp.rank != 0:  # tensor-parallel rank 0 of the group writes it; the group reads one stream
                return None, None, scales
        if upload_to is not None:
            os.makedirs(tmp_dir, exist_ok=True)
        self.faults.saving(tmp_dir, step, rank_file_name(rank))
        if upload_to is not None and background:
            from llmq_ray.checkpoints.remote import BackgroundUploads, HostSnapshot

            # the only synchronous part: a copy of the state into (pinned) host buffers (tensor parallelism:
            # the gathered state already is a fresh host copy); the file is written, hashed and uploaded on the
            # upload thread while the next steps train
            if state is None:
                self._snapshot = self._snapshot or HostSnapshot()
                state = self._snapshot.take(engine_checkpoint_tensors(e))
            self._uploads = self._uploads or BackgroundUploads()
            self._uploads.submit(step, tmp_dir, None, upload_to, before=lambda: self.faults.uploading(step),
                                 write=lambda: write_rank_shard(tmp_dir, rank, state, start, end))
            self.faults.after_saving(step)
            return {"rank": rank, "pending": True}, self.data_state(), scales
        rec = write_rank_shard(tmp_dir, rank, state if state is not None else engine_checkpoint_tensors(e),
                               start, end)
        if upload_to is not None:
            from llmq_ray.checkpoints.remote import upload_rank_shard

            upload_rank_shard(tmp_dir, rec, upload_to)
        self.faults.after_saving(step)
        return rec, self.data_state(), scales

    def _full_layout_shard(self) -> tuple[dict | None, int, int]:
        """Tensor parallelism: ({"master", "m", "v"} over [start, end) of the whole model's flat layout, start,
        end) -- data-parallel shard ``dp_rank`` of ``dp_size`` of the state one process would hold, so the
        checkpoint resumes on any tensor- and data-parallel size. A collective over every rank: each state is
        all-gathered over the data-parallel group into this rank's whole part (on the device; none needed with
        one data-parallel rank, whose shard is that part), then joined over the tensor-parallel group slot by
        slot (``TrainEngine.tensor_parallel_gather``: T x one slot of device memory). The dict, host tensors,
        only on tensor-parallel rank 0 (None elsewhere)."""
        import torch

        from llmq_ray.checkpoints.resume import engine_checkpoint_tensors
        from llmq_ray.model.params import ParamLayout

        e = self.engine
        n_full = ParamLayout(e.full_cfg).numel
        size = -(-n_full // self.dp_size)
        start, end = min(self.dp_rank * size, n_full), min((self.dp_rank + 1) * size, n_full)
        keep = e.tp.rank == 0
        out = {}
        for name, shard in engine_checkpoint_tensors(e).items():
            if e.comm.world_size > 1:
                padded = torch.zeros(e.shard_size, dtype=shard.dtype, device=e.device)
                padded[:shard.numel()].copy_(shard)
                local = torch.empty(e.shard_size * e.comm.world_size, dtype=shard.dtype, device=e.device)
                e.comm.all_gather(local, padded)
                del padded
            else:
                local = shard  # one data-parallel rank: its shard is its whole part
            part = e.tensor_parallel_gather(local, keep=keep, start=start, end=end)
            del local
            if keep:
                out[name] = part
        return (out if keep else None), start, end

    def upload_status(self, step: int, wait: bool = False, timeout_s: float | None = None) -> dict:
        """Whether the background upload of this rank's shard of checkpoint ``step`` finished: {"done": False}
        while it runs (with ``wait``: after up to ``timeout_s`` of waiting), else {"done": True, "error": None
        or the reason it failed, "seconds"}. Never raises for a failed upload."""
        e = self.engine
        if e is not None and (e.comm.replica != 0 or (e.tp is not None and e.tp.rank != 0)):  # wrote nothing
            # (--zero-scope node: a copy of the first node's shards; tensor parallelism: rank 0 wrote the group's)
            return {"done": True, "error": None, "seconds": 0.0}
        if self._uploads is None:
            return {"done": True, "error": f"rank {self.rank} has no upload of step {step}", "seconds": 0.0}
        return self._uploads.status(step, wait, timeout_s)

    def load_checkpoint(self, folder: str, verified: bool = False) -> int:
        """Put this rank into the state of checkpoint ``folder`` (any saved world size): optimizer shard,
        weights (a collective: every rank calls this together), data position and delayed FP8 scales (its own
        when the group has the saved shape, else the maximum over the saved ranks). Returns the step.

        The files this rank reads are checked for their recorded size and, unless ``verified``, hashed
        against their sha256 first. ``verified=True`` means the caller has just hashed every file of the
        folder (``resolve_continue`` in --continue's pre-flight): hashing again would make the ranks read
        the whole checkpoint (~91 GB at 7B) a second time for nothing. Automatic restarts pass False (their
        chooser, ``restart_point``, only does the cheap checks)."""
        from llmq_ray.checkpoints.layout import data_state_for_rank
        from llmq_ray.checkpoints.local import load_checkpoint
        from llmq_ray.checkpoints.resume import restore_engine, restore_fp8_scale_state

        e = self.engine
        from llmq_ray import storage

        if storage.is_remote(folder):  # a checkpoint on an object store: this node's copy of it
            from llmq_ray.checkpoints.remote import fetch

            folder = fetch(folder)
        if e.tp is not None:  # this rank's data-parallel shard of its part, cut slot by slot from the whole model's
            tensors, manifest = self._load_tensor_parallel_shard(folder, verified)
        else:
            tensors, manifest = load_checkpoint(folder, expected_config=e.cfg, world_size=self.world_size,
                                                rank=self.rank, shard_start=e.shard_start, shard_end=e.shard_end,
                                                verify_checksums=not verified, device=e.device)
        restore_engine(e, tensors)  # also resets the gradient accumulators (ZeRO-2's grad shard included)
        restore_fp8_scale_state(e, manifest, self.rank, self.world_size, 1 if e.tp is None else e.tp.plan.size)
        state = data_state_for_rank(manifest, self.dp_rank, self.dp_size)
        if state and self._train is not None:
            self._train.restore(state)
        return int(manifest["step"])

    def _load_tensor_parallel_shard(self, folder: str, verified: bool) -> tuple[dict, dict]:
        """Tensor parallelism: ({"master", "m", "v"} over [shard_start, shard_end) of this rank's local layout,
        manifest) from a checkpoint in the whole model's layout (any T, any worker count). Reads one whole-model
        slot at a time (host memory: 3 x the largest slot, plus the shard), only the slots the shard overlaps;
        unless ``verified``, every file of the folder is hashed first (``verify_checkpoint``)."""
        import torch

        from llmq_ray.checkpoints.local import load_checkpoint
        from llmq_ray.checkpoints.verify import verify_checkpoint
        from llmq_ray.model.params import ParamLayout

        e = self.engine
        if not verified:
            verify_checkpoint(folder)
        full_layout, lo, hi = ParamLayout(e.full_cfg), e.shard_start, e.shard_end
        out: dict = {}
        manifest = None
        for name, slot in e.layout.slots.items():
            a, b = max(slot.offset, lo), min(slot.end, hi)
            if a >= b:
                continue
            src = full_layout.slots[name]
            tensors, manifest = load_checkpoint(folder, expected_config=e.full_cfg, shard_start=src.offset,
                                                shard_end=src.end, verify_checksums=False)
            for k, t in tensors.items():
                part = e.tp.plan.shard(name, t.view(src.shape), e.tp.rank).reshape(-1)
                if k not in out:
                    out[k] = torch.empty(hi - lo, dtype=t.dtype)
                out[k][a - lo:b - lo] = part[a - slot.offset:b - slot.offset]
        if manifest is None:  # an empty shard (more ranks than parameters): the manifest alone
            from llmq_ray.checkpoints.layout import read_manifest

            manifest = read_manifest(folder)
            out = {k: torch.empty(0) for k in ("master", "m", "v")}
        return out, manifest

    def close(self) -> None:
        """Stop the data reader and leave the process group (the actor is killed afterwards)."""
        self._gc_pauses.close()
        if self._train is not None:
            self._train.close()
        from llmq_ray.actors.collectives import destroy_group

        destroy_group(captured=self.engine is not None and self.engine.captures_collectives)
