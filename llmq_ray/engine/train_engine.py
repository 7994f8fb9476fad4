"""The training engine of one process (one GPU, or one CPU worker): model + ZeRO shard of AdamW + collectives.

This is the piece a Ray worker actor wraps, and what a single-process run (tests, notebooks) drives
directly. It knows nothing about Ray: distribution enters only through a ``Communicator``
(llmq_ray/engine/communicator.py: identity for a single process; torch.distributed in ``actors/collectives.py``).

A step is ``micro_step`` x grad_accumulation, then ``update``:

* gradients are *sums* over target tokens (see llmq_ray/model/decoder.py), accumulated in one flat buffer;
* at the update (ZeRO-1) the flat gradient buffer is reduce-scattered, so each rank holds the summed
  gradient of its own shard; the squared norm of that shard is all-reduced into the global norm;
* grad_scale = clip_coefficient / total_target_tokens is folded into the AdamW kernel (no extra pass);
* each rank updates its shard of the weights, then the weights are all-gathered.

With ``--overlap-comm`` (several ranks, ZeRO-1; opt-in, as it measured slower, see llmq_ray/engine/grad_reduce.py)
the reduce-scatter becomes per-layer reduces during the step's last backward (``micro_step(..., last=True)``) and
the all-gather per-unit broadcasts beside the next forward (llmq_ray/engine/update_overlap.py); same bits.

ZeRO-2 (``--zero-level=2`` or ``--shard-gradients``): no full gradient buffer. The backward writes each
layer's gradients into a two-layer scratch, reduced (summed) onto the owners of their pieces while the next
layer's backward runs, and each owner adds its pieces into a shard-sized accumulator ``grad_shard`` (model
dtype, [S]) that the update uses directly (llmq_ray/parallel/data.py, ``ResidentGradShards``). The weights stay
whole on every rank, as under ZeRO-1. Gradient memory per rank: S + two layers + the embedding/LM head's
[V, C] scratch, against the full N under ZeRO-1.

ZeRO-3 (``--zero-level=3`` or ``--shard-weights``): no full buffers at all. The rank keeps its shard of the
weights; the model gathers each layer one layer ahead and its gradients are reduced onto their owners as
the backward produces them, straight into ``grad_shard`` (see llmq_ray/parallel/data.py). The optimizer shard, and
so the checkpoint format, is the same as under ZeRO-1/2.

Node scope (``--zero-scope node``): the shards are split among the workers of one node and every node holds
a copy; the ``Communicator`` hides it (its ``rank`` / ``world_size`` are the node-local shard group's, and
its collectives add the one all-reduce across nodes), so the engine only has to count the squared gradient
norm over one copy of the shards (``all_reduce_over_shards``).

Host offloading (``--offload-*``, llmq_ray/engine/offload.py): the optimizer state and ``grad_shard`` may live in
pinned host memory; the optimizer and the accumulation stream them through the device in chunks.

Tensor parallelism (``tensor_parallel=``, a ``TensorParallelRank`` of llmq_ray/parallel/tensor.py;
``--tensor-parallel``): the model is this rank's part of the block weights (``plan.local_config()``), its flat
buffers -- and the ZeRO shards of any level -- are in that local layout, and ``comm`` is the *data-parallel*
group's. The weights start as the full model's init cut by the plan (the same values as one process); the
gradients each rank holds a part of are summed over the group (``TensorParallel.reduce_grads``: at the update
under ZeRO-1, before each per-layer reduce under ZeRO-2/3), and the squared
gradient norm counts a replicated parameter once (its square divided by its number of copies, then summed over
the group), so clipping and the reported norm equal one process's.

Everything stays on the device until ``update`` returns its small stats tensor: the one host sync per step.
"""

from __future__ import annotations

import dataclasses

import torch

from llmq_ray.backends.base import Backend
from llmq_ray.model.config import ModelConfig
from llmq_ray.errors import ConfigError
from llmq_ray.model import family_of
from llmq_ray.engine.communicator import Communicator
from llmq_ray.engine.model_setup import backend_components, model_build
from llmq_ray.engine.model_setup import make_backend  # noqa: F401 - where callers have always found it
from llmq_ray.engine.offload import StagedChunks, fixed_chunks, host_zeros
from llmq_ray.engine.optim import ShardedAdamW, clip_coefficient
from llmq_ray.settings import RunSettings
from llmq_ray.settings.rules import validate
from llmq_ray.model.params import ParamLayout, init_params
from llmq_ray.engine.schedule import Schedule
from llmq_ray.engine.update_overlap import UpdateOverlap
from llmq_ray.engine.wgrad_overlap import enable_wgrad_overlap
from llmq_ray.engine.grad_reduce import LastBackwardReduce
from llmq_ray.parallel.data import ResidentGradShards, ShardedWeights


@dataclasses.dataclass
class StepStats:
    """What one update reports (all host floats)."""

    loss: float
    grad_norm: float
    tokens: int
    skipped: bool = False
    skip_reason: str | None = None   # "non-finite gradient norm", "loss spike", "grad-norm spike"


# --opt-resident-gib auto: device bytes left free for what a step allocates on the fly (cuDNN attention outputs
# and workspaces, cuBLAS workspace, allocator rounding): ~0.3 GiB was measured at 7B (peak minus set-up
# allocation, H100, 2026-11-23); the rest is headroom against fragmentation.
AUTO_RESIDENT_MARGIN = 2 << 30


def available_device_bytes(device: torch.device) -> int:
    """Bytes a new allocation could still get on ``device``: free device memory plus what torch's caching
    allocator holds unused. 0 off CUDA (there host and device memory are one: keeping state "resident" would
    only copy it)."""
    if torch.device(device).type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn}


class TrainEngine:
    """Model, gradients and the local optimizer shard of one rank.

    Buffers: ``params`` and (ZeRO-1) ``grads`` are flat, padded to shard_size * world_size (model dtype; ``grads``
    is None under ZeRO-2/3, ``params`` under ZeRO-3, see llmq_ray/parallel/data.py); rank r owns
    [r*S, (r+1)*S) of the optimizer state (clipped to the layout's length). With one worker under ZeRO-1 the
    update returns while it still runs on a side stream (``overlap``, llmq_ray/engine/update_overlap.py): read the
    weights through ``full_params()`` (or call ``join_update()`` first), not ``params`` directly.
    """

    def __init__(self, cfg: ModelConfig, settings: RunSettings, backend: Backend, comm: Communicator | None = None,
                 *, init_weights: bool = True, tensor_parallel=None):
        validate(settings)  # the rules hold (the trainer checked them; programs and tests may build engines directly)
        self.tp = tensor_parallel
        full_cfg = cfg
        if tensor_parallel is not None:
            _check_tensor_parallel(settings, tensor_parallel)
            tensor_parallel.overlap = settings.speed.overlap_tensor_parallel
            cfg = tensor_parallel.plan.local_config()
        self.cfg, self.settings, self.backend = cfg, settings, backend
        self.full_cfg = full_cfg  # the whole model's (``cfg`` is this rank's part under tensor parallelism)
        self.comm = comm or Communicator()
        if settings.memory.use_zero_copy and backend.device.type == "cuda":
            # Seen on the H100: Triton 3.6 refuses pinned host pointers at launch ("cannot be accessed from
            # Triton"), and the CuPy AdamW kernel on torch-pinned host tensors hits an illegal memory access.
            # Until the host state is allocated as mapped memory with its device alias, CUDA runs stream.
            raise ConfigError("zero-copy access to offloaded state is not supported on CUDA yet (the kernels cannot "
                              "read this pinned host memory directly); without it the state streams through the GPU.")
        made_for = backend_components(settings)
        has = dict(gemm=backend.gemm.name, attention=backend.attention.name, gemm_tuning=backend.gemm.tuning)
        if settings.speed.gemm is None:
            has.pop("gemm")
        if any(has[k] != made_for[k] for k in has):
            raise ConfigError(f"the {backend.name} backend was built with {has}, but these options need "
                              f"{ {k: made_for[k] for k in has} }: build it with make_backend(name, settings, device).")
        dtype = settings.numerics.torch_dtype
        self.device = backend.device
        world, rank = self.comm.world_size, self.comm.rank
        layout = ParamLayout(cfg)
        self.shard_size = -(-layout.numel // world)
        self.shard_start = min(rank * self.shard_size, layout.numel)
        self.shard_end = min((rank + 1) * self.shard_size, layout.numel)
        self.zero3 = settings.parallel.zero_level >= 3
        # every side stream and event of this process, and the policies around each unit (engine/schedule.py)
        self.schedule = Schedule(backend.device)
        build, policies = model_build(settings, cfg, self.schedule, tensor_parallel)
        self.tp_plan = policies.plan  # tensor parallelism: sums the gradients each rank holds a part of
        tp_sums = self.tp_plan.reduce_grads if self.tp_plan is not None else None  # ZeRO-2/3: before each reduce

        def make_model(**buffers):
            return family_of(cfg)(cfg, backend, build, schedule=self.schedule, policies=policies, **buffers)

        if self.zero3:  # only this rank's shard of the weights (llmq_ray/parallel/data.py)
            self.store = ShardedWeights(layout, self.comm, self.shard_size, dtype, backend.device,
                                        sink=self._add_grad_piece, before_reduce=tp_sums)
            self.model = make_model(weights=self.store)
            self.params = self.grads = None
            if init_weights and tensor_parallel is not None:  # the full model's init, cut by the plan, this shard
                local = _tensor_parallel_init(full_cfg, tensor_parallel, settings.optim.seed, dtype, backend.device)
                n = self.shard_end - self.shard_start
                self.store.params_shard[:n].copy_(local[self.shard_start:self.shard_end])
                self.store.after_update()
            elif init_weights:
                init_params(layout, self.store.params_shard, settings.optim.seed, start=rank * self.shard_size)
                self.store.after_update()
        else:  # the full flat weights, padded so that every rank's shard has equal size
            padded = self.shard_size * world
            params = torch.zeros(padded, dtype=dtype, device=backend.device)
            if settings.parallel.zero_level == 2:  # gradients reduced per layer into grad_shard (parallel/data.py)
                self.store, self.grads = ResidentGradShards(layout, self.comm, self.shard_size, params,
                                                            sink=self._add_grad_piece, before_reduce=tp_sums), None
                self.model = make_model(weights=self.store)
            else:  # ZeRO-1: the full flat gradient buffer too
                self.store, self.grads = None, torch.zeros(padded, dtype=dtype, device=backend.device)
                self.model = make_model(params=params, grads=self.grads)
            self.params = params
            if init_weights and tensor_parallel is not None:  # the full model's init, cut by the plan
                self.params[:layout.numel].copy_(_tensor_parallel_init(full_cfg, tensor_parallel, settings.optim.seed, dtype,
                                                                       backend.device))
            elif init_weights:
                init_params(layout, self.params, settings.optim.seed)
        self.layout = self.model.layout
        if self.store is not None:  # a layer whose FP8 copies are current needs no gather (ZeRO-3)
            self.store.layer_needed = self.model.needs_weights
        # tensor parallelism: (start, end, copies) of the local flat ranges every copy holds whole
        self._replicated = _replicated_ranges(self.layout, tensor_parallel) if tensor_parallel is not None else []
        self.optimizer = self._make_optimizer()
        self.micro_steps_done = 0
        self._monitor: torch.Tensor | None = None  # [L] fp32: this step's FP8 monitor, while one is collected
        self._monitor_saturated: torch.Tensor | None = None  # [L] int64: its FP8 inputs at the FP8 maximum
        self._monitor_elements = 0  # per layer, the elements counted into _monitor_saturated
        self.overlap = None  # the update on a side stream, overlapped with the next forward (update_overlap.py)
        if settings.speed.overlap_update and settings.parallel.zero_level == 1 and (world == 1 or settings.speed.overlap_comm):
            self.overlap = UpdateOverlap(self.layout, self.optimizer, self.model.store, self.schedule, self.comm,
                                         self.shard_size)
        # ZeRO-1 on several ranks: the last micro-step's backward reduces each layer onto its owners (grad_reduce.py)
        self.grad_reduce = None
        if world > 1 and settings.parallel.zero_level == 1 and settings.speed.overlap_comm and not settings.speed.overlap_wgrad_sms:
            self.grad_reduce = self.schedule.add(LastBackwardReduce(self.layout, self.comm, self.grads,
                                                                    self.shard_size))
        self._grads_reduced = False  # the last micro-step left each rank's shard of ``grads`` summed
        # ZeRO-2: the reduced gradient of this rank's shard, accumulated over the micro-steps of a step
        # (in host memory with --offload-gradients: each micro-step's shard is added in, streamed by chunks).
        self.grad_shard = self._grad_staging = None
        if settings.parallel.zero_level >= 2:
            if settings.memory.offload_gradients:
                self.grad_shard = host_zeros(self.shard_size, dtype, backend.device)
                self._grad_staging = StagedChunks(backend.device, {"acc": dtype},
                                                  min(settings.memory.opt_chunk_size, self.shard_size), self.schedule,
                                                  "gradients")
            else:
                self.grad_shard = torch.zeros(self.shard_size, dtype=dtype, device=backend.device)
        if settings.speed.overlap_wgrad_sms:  # before any graph is captured: the graph keeps the order it was captured in
            enable_wgrad_overlap(self.model, settings.speed.overlap_wgrad_sms)
        # --use-cuda-graphs: the forward + backward of a micro-step replayed from a graph (llmq_ray/engine/cuda_graphs.py)
        self._forward_backward = self.model.forward_backward
        if settings.speed.use_cuda_graphs:
            from llmq_ray.engine.cuda_graphs import MicroStepGraphs
            self._forward_backward = MicroStepGraphs(self.model, self.overlap, self.grad_reduce).forward_backward
        self._keep_quants()
        self._keep_opt_resident()  # last: "auto" sizes it from what set-up left free

    def _device_budget(self, gib) -> int:
        """Bytes of a --kept-quants-gib / --opt-resident-gib value: G GiB, or for "auto" what the device has free
        now less ``AUTO_RESIDENT_MARGIN`` (for what a step allocates on the fly)."""
        if gib == "auto":
            return max(0, available_device_bytes(self.device) - AUTO_RESIDENT_MARGIN)
        return int(gib * 2**30)

    def _keep_quants(self) -> None:
        """--kept-quants-gib: FP8 weight copies kept for the step beside the per-layer slots
        (BlockLinears.keep_copies). A number whose copies do not fit in what set-up left free on the GPU is refused
        in one sentence (instead of an out-of-memory error from inside the allocation)."""
        g = self.settings.memory.kept_quants_gib
        if not g:
            return
        budget = self._device_budget(g)
        if self.zero3 and self.comm.world_size > 1:
            # ZeRO-3 skips gathering a layer whose copies are all kept (BlockLinears.needs_weights): every rank of
            # the shard group must keep the same copies, or their gathers would not match up. "auto" measures
            # each rank's own free memory, so the group keeps what fits on the rank with the least.
            budgets = torch.zeros(self.comm.world_size, dtype=torch.float64, device=self.device)
            budgets[self.comm.rank] = budget
            self.comm.all_reduce_over_shards(budgets)
            budget = int(budgets.min().item())
        plan = self.model.lin.kept_copies_plan(budget)
        if g != "auto" and self.device.type == "cuda":
            planned = sum(rows * cols for _, _, (rows, cols) in plan)
            free = available_device_bytes(self.device)
            if planned > free:
                raise ConfigError(f"{g} GiB of kept FP8 weight copies ({planned / 2**30:.2f} GiB as planned) do not "
                                  f"fit in the {free / 2**30:.2f} GiB of device memory set-up left free; keep fewer, "
                                  f"or let the run choose ('auto').")
        self.model.lin.keep_copies(plan)

    def _make_optimizer(self) -> ShardedAdamW:
        o = self.settings
        offload = [k for k, on in (("master", o.memory.offload_master), ("m", o.memory.offload_opt_m), ("v", o.memory.offload_opt_v))
                   if on]
        params, offset = ((self.store.params_shard, self.shard_start) if self.zero3 else (self.params, 0))
        return ShardedAdamW(self.backend, self.layout, params, self.shard_start, self.shard_end, params_offset=offset,
                            master_dtype=_DTYPES[o.numerics.master_dtype], m_dtype=_DTYPES[o.numerics.opt_m_dtype],
                            v_dtype=_DTYPES[o.numerics.opt_v_dtype], beta1=o.optim.beta_1, beta2=o.optim.beta_2, eps=o.optim.adam_eps,
                            weight_decay=o.optim.weight_decay, seed=o.optim.seed, chunk=o.memory.opt_chunk_size, offload=offload,
                            zero_copy=o.memory.use_zero_copy, grads_on_host=o.memory.offload_gradients, schedule=self.schedule)

    @property
    def captures_collectives(self) -> bool:
        """Whether CUDA graphs hold NCCL collectives (the last micro-step's per-layer reduces): the process group
        must then not be destroyed (actors/collectives.py, ``destroy_group``)."""
        return self.grad_reduce is not None and self.settings.speed.use_cuda_graphs

    # ------------------------------------------------------------------ weights, whatever the ZeRO level
    def full_params(self) -> torch.Tensor:
        """All weights [layout.numel] (model dtype): a view of the flat device buffer under ZeRO-1/2; under
        ZeRO-3 a new CPU tensor gathered from every rank (a collective: all ranks must call it). Under tensor
        parallelism these are this rank's part, in its local layout (``tensor_parallel_gather`` joins them)."""
        if self.zero3:
            return self.store.full_params()
        self.join_update()
        return self.params[:self.layout.numel]

    def tensor_parallel_gather(self, local: torch.Tensor, *, keep: bool = True, start: int = 0,
                               end: int | None = None) -> torch.Tensor | None:
        """Tensor parallelism: [start, end) of the whole model's flat tensor (full layout; default all of it) from
        every rank's ``local`` [local layout numel] (weights or one optimizer state, device or host), as a CPU
        tensor on the ranks that ``keep`` it, None on the others. A collective over the group, joined slot by
        slot (``join_parts``: the device holds T x one slot at a time)."""
        from llmq_ray.parallel.tensor import join_parts

        return join_parts(self.tp.plan, ParamLayout(self.full_cfg), local[:self.layout.numel], self.tp.comm,
                          self.device, keep=keep, start=start, end=end)

    def load_full_params(self, flat: torch.Tensor) -> None:
        """Set the weights from a full flat tensor [layout.numel] (any device/float dtype; e.g. HF weights),
        then call ``reset_optimizer_from_params`` to rebuild the master from them. Collective under ZeRO-3.
        Under tensor parallelism ``flat`` is the whole model's (its layout's numel), cut here by the plan."""
        if self.tp is not None:
            from llmq_ray.parallel.tensor import shard_params

            full_layout = ParamLayout(self.full_cfg)
            if flat.numel() < full_layout.numel:
                raise ValueError(f"load_full_params: {flat.numel()} values for a model of {full_layout.numel}")
            flat = shard_params(self.tp.plan, full_layout, flat[:full_layout.numel], self.tp.rank)
        if self.zero3:
            self.store.params_shard[:self.shard_end - self.shard_start].copy_(flat[self.shard_start:self.shard_end])
            self.store.after_update()
        else:
            self.join_update()
            self.params[:self.layout.numel].copy_(flat[:self.layout.numel])
            self.model.lin.invalidate_weights()

    def sync_weights(self) -> None:
        """After this rank's shard of the weights changed (update, checkpoint load): make every rank's
        working copy current -- all-gather the flat buffer (ZeRO-1/2), or re-broadcast the replicated
        norms/biases and drop gathered layers (ZeRO-3). A collective."""
        if self.zero3:
            self.store.after_update()
            return
        size = self.shard_size
        self.comm.all_gather(self.params, self.params[self.comm.rank * size:(self.comm.rank + 1) * size])

    _FP8_SCALE_STATE = (("swiglu_dy_amax", "_swiglu_dy_amax_filled"), ("swiglu_out_amax", "_swiglu_out_amax_filled"))

    def fp8_scale_state(self) -> dict[str, torch.Tensor]:
        """The delayed FP8 SwiGLU scales this rank trains with (--fp8-delayed-swiglu-scale): {name: [L] fp32
        per-layer maxima of the last training forward / backward}, only those already measured ({} without the
        delayed scale, or before its first pass). Training state a checkpoint keeps (llmq_ray/checkpoints/
        resume.py): a resume without it measures afresh in its first step and is not bit-exact there."""
        return {name: getattr(self.model, name) for name, filled in self._FP8_SCALE_STATE
                if getattr(self.model, name, None) is not None and getattr(self.model, filled, False)}

    def load_fp8_scale_state(self, state: dict[str, torch.Tensor]) -> None:
        """Set the delayed FP8 scales from a ``fp8_scale_state()`` (copied in place: CUDA graphs keep their
        pointers); the next pass then uses them as if it followed the saved one. A scale the model does not keep
        (a run without the delayed scale) is ignored; one absent from ``state`` is measured afresh."""
        for name, filled in self._FP8_SCALE_STATE:
            kept = getattr(self.model, name, None)
            if kept is None:
                continue
            if name in state:
                kept.copy_(state[name].reshape(kept.shape).to(kept))
            setattr(self.model, filled, name in state)

    def weight_tensors(self) -> list[torch.Tensor]:
        """The device buffers that hold weights (memory table)."""
        return self.store.tensors()["weights"] if self.zero3 else [self.params]

    def grad_tensors(self) -> list[torch.Tensor]:
        """The device buffers that hold gradients (memory table); offloaded ones are listed by host_tensors."""
        out = self.store.tensors()["grads"] if self.store is not None else [self.grads]
        return out + ([self.grad_shard] if self.grad_shard is not None else [])

    def _add_grad_piece(self, offset: int, piece: torch.Tensor) -> None:
        """The ZeRO-2/3 sink: grad_shard[offset : offset + len] (+)= a reduced gradient piece of this rank's shard
        (copied on a step's first micro-step, added afterwards; streamed when the accumulator is on the host)."""
        first = self.micro_steps_done == 0
        if self._grad_staging is None:
            dst = self.grad_shard[offset:offset + piece.numel()]
            dst.copy_(piece) if first else dst.add_(piece)
            return
        ranges = fixed_chunks(offset, offset + piece.numel(), self._grad_staging.chunk)

        def accumulate(i: int, staged: dict[str, torch.Tensor]) -> None:
            lo, hi = ranges[i]
            src = piece[lo - offset:hi - offset]
            staged["acc"].copy_(src) if first else staged["acc"].add_(src)

        self._grad_staging.run(ranges, {} if first else {"acc": self.grad_shard}, {"acc": self.grad_shard},
                               accumulate)

    def host_tensors(self) -> list[torch.Tensor]:
        """Everything this engine keeps in host memory because of an --offload-* flag (memory table)."""
        out = self.optimizer.host_tensors() + self.model.acts.residual.host_tensors() + self.model.lin.host_tensors()
        if self.settings.memory.offload_gradients and self.grad_shard is not None:
            out.append(self.grad_shard)
        return out

    def reset_optimizer_from_params(self) -> None:
        """Re-create the optimizer state after the weights were replaced (e.g. loaded from HF safetensors)."""
        self.join_update()
        self.optimizer = self._make_optimizer()
        if self.overlap is not None:  # same layout, shard and chunk size: the same chunks, so the same order
            self.overlap.optimizer = self.optimizer
        self._keep_opt_resident()

    def _keep_opt_resident(self) -> None:
        """--opt-resident-gib: keep the offloaded optimizer state of the chunks updated first on the device
        (in the overlap's order, so the first layers of the next forward wait least). "auto": as many bytes as
        the device has free now (set-up has allocated the weights, gradients, activations and scratch of a
        step) less ``AUTO_RESIDENT_MARGIN`` for what a step allocates on the fly."""
        g = self.settings.memory.opt_resident_gib
        if not g:
            return
        budget = self._device_budget(g)
        order = self.overlap.order if self.overlap is not None else range(len(self.optimizer.chunks))
        self.optimizer.keep_resident(order, budget)

    def join_update(self) -> None:
        """Order the compute stream after an update still running on the side stream (no-op otherwise)."""
        if self.overlap is not None:
            self.overlap.join()

    # ------------------------------------------------------------------ the step
    def micro_step(self, inputs: torch.Tensor, targets: torch.Tensor, *, last: bool = False) -> None:
        """Forward + backward of one micro-batch [B, T]; the first of a step zeroes the gradients. ``last``: no
        other micro-step comes before the update, so ZeRO-1 on several ranks may reduce each layer's gradients
        during this backward (llmq_ray/engine/grad_reduce.py) instead of all of them at the update."""
        if self._grads_reduced:
            raise RuntimeError("micro_step() after the micro-step marked last=True: call update() first")
        if self.micro_steps_done == 0:
            self.model.zero_grads()
        reduce = last and self.grad_reduce is not None
        # the FP8 monitor counts saturated values only after a forward at delayed scales (read before the pass:
        # its own forward fills them, and a CUDA graph's capture re-runs the Python of the forward)
        count_saturated = self._monitor is not None and self.model.swiglu_out_delayed
        if reduce:
            self.grad_reduce.active = True
        try:
            self._forward_backward(inputs, targets)
        finally:
            if reduce:
                self.grad_reduce.active = False
        self._grads_reduced = reduce
        if self.store is not None:  # ZeRO-2/3: the layers' gradients were reduced into grad_shard during the backward
            self.store.finish_micro_step()
        if self._monitor is not None:  # the forward wrote each layer's max|SwiGLU out| (the FP8 scale's absmax)
            torch.maximum(self._monitor, self.model.swiglu_out_absmax, out=self._monitor)
            if count_saturated:
                self._monitor_elements += self.model.count_saturated_swiglu_fp8(self._monitor_saturated)
        self.micro_steps_done += 1

    def monitor_begin(self) -> None:
        """Collect the FP8 monitor over this step's micro-steps (--fp8-monitor-every): per layer, the largest
        |SwiGLU output| (the down projection's FP8 input), read from the absmax its quantization takes anyway,
        so it costs one [L] max per micro-step and nothing inside the forward (CUDA graphs unchanged). With
        current scaling that value is quantized to exactly the FP8 maximum and nothing is clipped; what the
        maxima show is the range the rest of the layer's values must share."""
        if not getattr(self.model.lin, "fp8", False):
            raise ValueError("the FP8 monitor reports the scales of FP8 block GEMMs; this model's are not FP8")
        self._monitor = torch.zeros(self.cfg.num_layers, dtype=torch.float32, device=self.model.amax.device)
        self._monitor_saturated = torch.zeros(self.cfg.num_layers, dtype=torch.int64, device=self.model.amax.device)
        self._monitor_elements = 0

    def monitor_take(self) -> dict | None:
        """The collected monitor (a device sync; call it after the update's), or None: {"swiglu_absmax": [L]
        floats, the largest |SwiGLU output| per layer over the step's micro-steps; "saturated_share": [L] floats,
        the share of those outputs' FP8 values at the FP8 maximum over the micro-steps at delayed scales
        (``LlamaModel.count_saturated_swiglu_fp8``, llmq_ray/model/llama.py), or None when none was (current scales: nothing is
        clipped); "saturated_elements", what that share is over (0 with None)}."""
        if self._monitor is None:
            return None
        n = self._monitor_elements
        share = (self._monitor_saturated.double() / n).tolist() if n else None
        out = {"swiglu_absmax": self._monitor.tolist(), "saturated_share": share, "saturated_elements": n}
        self._monitor = self._monitor_saturated = None
        return out

    def update(self, lr: float, step: int, *, max_loss: float | None = None,
               max_norm: float | None = None) -> StepStats:
        """Reduce gradients, clip by the global norm, AdamW on the local shard, gather weights.

        ``step`` is the 1-based update number (Adam bias correction, rounding seeds). Returns host stats
        (the one host sync of the step). A non-finite gradient norm skips the update: the weights and the
        optimizer state stay as they were. So does a loss above ``max_loss`` or a norm above ``max_norm``
        (the spike guard's limits, see llmq_ray/engine/spike_guard.py); ``StepStats.skip_reason`` says why.
        """
        if self.micro_steps_done == 0:
            raise RuntimeError("update() called before any micro_step()")
        self.join_update()
        model, comm = self.model, self.comm
        totals = torch.stack([model.loss_sum.double(), model.target_count.double()])
        comm.all_reduce_sum(totals)  # over the data-parallel ranks (a tensor-parallel group shares one loss)
        if self.tp is not None and self.store is None:  # ZeRO-1: the parts of the norm / QK-norm weights and
            self.tp_plan.reduce_grads()                   # replicated KV rows, summed (ZeRO-2/3: before each reduce)
        if self.grad_shard is not None:  # ZeRO-2/3: reduced during every backward already
            shard = self.grad_shard
        else:  # ZeRO-1: reduce once, at the end of the step (unless the last backward did, layer by layer)
            shard = self.grads[self.comm.rank * self.shard_size:(self.comm.rank + 1) * self.shard_size]
            if not self._grads_reduced:
                comm.reduce_scatter_sum(shard, self.grads)
            self._grads_reduced = False
        local = shard[:self.shard_end - self.shard_start]
        norm_sq = self.optimizer.grad_norm_squared(local)
        if self.tp is not None:  # a replicated parameter counts once over the group
            for lo, hi, copies in self._replicated:
                a, b = max(lo, self.shard_start), min(hi, self.shard_end)
                if a < b:
                    part = local[a - self.shard_start:b - self.shard_start].float()
                    norm_sq -= (1.0 - 1.0 / copies) * (part * part).sum()
            self.tp.all_reduce_sum(norm_sq)
        comm.all_reduce_over_shards(norm_sq)  # every shard once, also when nodes hold copies of them
        count = totals[1].clamp(min=1.0).float()
        norm = norm_sq.sqrt() / count
        coef = clip_coefficient(norm, self.settings.optim.grad_clip)
        finite = torch.isfinite(coef)
        stats = torch.stack([totals[0].float() / count, norm, totals[1].float(), finite.float()]).tolist()
        self.micro_steps_done = 0
        reason = None
        if not stats[3]:
            reason = "non-finite gradient norm"
        elif max_loss is not None and stats[0] > max_loss:
            reason = "loss spike"
        elif max_norm is not None and stats[1] > max_norm:
            reason = "grad-norm spike"
        if reason is not None:
            return StepStats(loss=stats[0], grad_norm=stats[1], tokens=int(stats[2]), skipped=True,
                             skip_reason=reason)
        if self.overlap is not None:  # the next forward waits per unit (for its update and, on several ranks, its gather)
            self.overlap.step(local, lr=lr, step=step, grad_scale=coef / count)
        else:
            self.optimizer.step(local, lr=lr, step=step, grad_scale=coef / count)
            self.sync_weights()
        return StepStats(loss=stats[0], grad_norm=stats[1], tokens=int(stats[2]))

    @torch.no_grad()
    def evaluate(self, batches) -> tuple[float, int]:
        """Summed loss and target count over an iterable of (inputs, targets) batches, reduced over ranks."""
        self.join_update()
        model = self.model
        model.loss_sum.zero_()
        model.target_count.zero_()
        for inputs, targets in batches:
            model.forward_loss(inputs, targets)
        totals = torch.stack([model.loss_sum.double(), model.target_count.double()])
        self.comm.all_reduce_sum(totals)
        loss_sum, count = totals.tolist()
        return loss_sum, int(count)


def _check_tensor_parallel(settings: RunSettings, tp) -> None:
    """What tensor parallelism does not run with yet (llmq_ray/settings/rules.py names them, one sentence each;
    this only checks that the options' tensor-parallel size is the group's)."""
    if settings.parallel.tensor_parallel not in (1, tp.plan.size):
        raise ValueError(f"the settings' tensor-parallel size is {settings.parallel.tensor_parallel} but the engine "
                         f"was given a group of {tp.plan.size}")
    validate(dataclasses.replace(settings, parallel=dataclasses.replace(settings.parallel, tensor_parallel=tp.plan.size)))


def _tensor_parallel_init(full_cfg: ModelConfig, tp, seed: int, dtype: torch.dtype, device) -> torch.Tensor:
    """This rank's local flat weights: the whole model's ``init_params`` (the values one process starts from),
    cut by the plan. Makes the whole model once, on the device (a temporary the size of the full weights)."""
    from llmq_ray.parallel.tensor import shard_params

    full_layout = ParamLayout(full_cfg)
    full = torch.empty(full_layout.numel, dtype=dtype, device=device)
    init_params(full_layout, full, seed)
    return shard_params(tp.plan, full_layout, full, tp.rank)


def _replicated_ranges(layout: ParamLayout, tp) -> list[tuple[int, int, int]]:
    """(start, end, copies) of the ranges of the local flat buffer that several ranks of the tensor-parallel group
    hold whole (after ``TensorParallel.reduce_grads`` their gradients are equal on those ranks): every norm
    weight, and the K/V rows of replicated KV heads (the embedding and LM head are split by vocabulary)."""
    out = []
    for name, slot in layout.slots.items():
        kind = name.rsplit(".", 1)[-1]
        if kind in tp.plan.REPLICATED:
            out.append((slot.offset, slot.end, tp.plan.size))
        elif kind in ("qkv_w", "qkv_b") and tp.kv_rows:
            row = slot.numel // slot.shape[0]  # elements per row (1 for the bias)
            for rows in tp.kv_rows:
                out.append((slot.offset + rows.start * row, slot.offset + rows.stop * row, tp.plan.kv_replicas))
    return out
