"""The training engine of one process (one GPU, or one CPU worker): model + ZeRO shard of AdamW + collectives.

This is the piece a Ray worker actor wraps, and what a single-process run (tests, notebooks) drives
directly. It knows nothing about Ray: distribution enters only through a ``Communicator`` (identity for a
single process; torch.distributed in ``actors/collectives.py``).

A step is ``micro_step`` x grad_accumulation, then ``update``:

* gradients are *sums* over target tokens (see llmq_ray/model.py), accumulated in one flat buffer;
* at the update (ZeRO-1) the flat gradient buffer is reduce-scattered, so each rank holds the summed
  gradient of its own shard; the squared norm of that shard is all-reduced into the global norm;
* grad_scale = clip_coefficient / total_target_tokens is folded into the AdamW kernel (no extra pass);
* each rank updates its shard of the weights, then the weights are all-gathered.

ZeRO-2 (``--zero-level=2`` or ``--shard-gradients``): the full gradient buffer is reduce-scattered after
*every* micro-step and added into a shard-sized accumulator ``grad_shard`` (model dtype, [S]); the full
buffer is then zeroed for the next micro-step, and the update uses the accumulator directly. The
accumulated gradients that persist across micro-steps are thus sharded; the full buffer is still the
backward's scratch (a per-layer reduce-scatter during the backward would shrink it too; not done yet).

Everything stays on the device until ``update`` returns its small stats tensor: the one host sync per step.
"""

from __future__ import annotations

import dataclasses

import torch

from backends.base import Backend
from llmq_ray.config import ModelConfig
from llmq_ray.errors import ConfigError
from llmq_ray.model import LlamaModel
from llmq_ray.optim import ShardedAdamW, clip_coefficient, global_grad_norm_squared
from llmq_ray.options import DTYPES, TrainOptions
from llmq_ray.params import ParamLayout, init_params


class Communicator:
    """Collectives over the flat buffers of all ranks. This base class is the single-process identity."""

    rank = 0
    world_size = 1

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """In place: tensor = sum over ranks."""

    def reduce_scatter_sum(self, shard_out: torch.Tensor, full: torch.Tensor) -> None:
        """shard_out[S] = (sum over ranks of full[W*S])[rank*S:(rank+1)*S]. May alias full's own shard."""
        size = shard_out.numel()
        if shard_out.data_ptr() != full[self.rank * size:].data_ptr():
            shard_out.copy_(full[self.rank * size:(self.rank + 1) * size])

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        """full[W*S] = concatenation of every rank's shard[S] (shard may alias full's own slice)."""
        size = shard.numel()
        if shard.data_ptr() != full[self.rank * size:].data_ptr():
            full[self.rank * size:(self.rank + 1) * size].copy_(shard)


@dataclasses.dataclass
class StepStats:
    """What one update reports (all host floats)."""

    loss: float
    grad_norm: float
    tokens: int
    skipped: bool = False
    skip_reason: str | None = None   # "non-finite gradient norm", "loss spike", "grad-norm spike"


class TrainEngine:
    """Model, gradients and the local optimizer shard of one rank.

    Buffers: ``params`` and ``grads`` are flat, padded to shard_size * world_size (model dtype); rank r owns
    [r*S, (r+1)*S) of the optimizer state (clipped to the layout's length).
    """

    def __init__(self, cfg: ModelConfig, opts: TrainOptions, backend: Backend, comm: Communicator | None = None,
                 *, init_weights: bool = True):
        opts.validate()
        if opts.effective_zero_level >= 3:
            raise ConfigError("--zero-level=3 is not implemented yet in this version; use 1 or 2.")
        self.cfg, self.opts, self.backend = cfg, opts, backend
        self.comm = comm or Communicator()
        dtype = opts.torch_dtype
        world = self.comm.world_size
        layout_numel = ParamLayout(cfg).numel
        self.shard_size = -(-layout_numel // world)
        padded = self.shard_size * world  # flat buffers padded so that every rank's shard has equal size
        params = torch.zeros(padded, dtype=dtype, device=backend.device)
        grads = torch.zeros(padded, dtype=dtype, device=backend.device)
        self.model = LlamaModel(cfg, backend, batch_size=opts.batch_size, seq_len=opts.seq_len, dtype=dtype,
                                recompute=opts.recompute, lmhead_chunks=opts.lmhead_chunks,
                                params=params, grads=grads, matmul_dtype=opts.matmul_dtype,
                                gradient_dtype=opts.gradient_dtype)
        self.params, self.grads = self.model.params, self.model.grads
        self.layout = self.model.layout
        if init_weights:
            init_params(self.layout, self.params, opts.seed)
        rank = self.comm.rank
        self.shard_start = min(rank * self.shard_size, layout_numel)
        self.shard_end = min((rank + 1) * self.shard_size, layout_numel)
        self.optimizer = self._make_optimizer()
        self.micro_steps_done = 0
        # ZeRO-2: the reduced gradient of this rank's shard, accumulated over the micro-steps of a step.
        self.grad_shard = (torch.zeros(self.shard_size, dtype=dtype, device=backend.device)
                           if opts.effective_zero_level >= 2 else None)
        self._grad_shard_tmp = torch.empty_like(self.grad_shard) if self.grad_shard is not None else None
        # --use-cuda-graphs: the forward + backward of a micro-step replayed from a graph (llmq_ray/cuda_graphs.py)
        self._forward_backward = self.model.forward_backward
        if opts.use_cuda_graphs:
            from llmq_ray.cuda_graphs import MicroStepGraphs
            self._forward_backward = MicroStepGraphs(self.model).forward_backward

    def _make_optimizer(self) -> ShardedAdamW:
        o = self.opts
        return ShardedAdamW(self.backend, self.layout, self.params, self.shard_start, self.shard_end,
                            master_dtype=DTYPES[o.master_dtype], m_dtype=DTYPES[o.opt_m_dtype],
                            v_dtype=DTYPES[o.opt_v_dtype], beta1=o.beta_1, beta2=o.beta_2, eps=o.adam_eps,
                            weight_decay=o.weight_decay, seed=o.seed)

    def reset_optimizer_from_params(self) -> None:
        """Re-create the optimizer state after the weights were replaced (e.g. loaded from HF safetensors)."""
        self.optimizer = self._make_optimizer()

    # ------------------------------------------------------------------ the step
    def micro_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """Forward + backward of one micro-batch [B, T]; the first of a step zeroes the gradients."""
        if self.micro_steps_done == 0:
            self.model.zero_grads()
        elif self.grad_shard is not None:
            self.grads.zero_()  # ZeRO-2: the previous micro-step's gradients already sit in grad_shard
        self._forward_backward(inputs, targets)
        if self.grad_shard is not None:
            if self.micro_steps_done == 0:
                self.comm.reduce_scatter_sum(self.grad_shard, self.grads)
            else:
                self.comm.reduce_scatter_sum(self._grad_shard_tmp, self.grads)
                self.grad_shard += self._grad_shard_tmp
        self.micro_steps_done += 1

    def update(self, lr: float, step: int, *, max_loss: float | None = None,
               max_norm: float | None = None) -> StepStats:
        """Reduce gradients, clip by the global norm, AdamW on the local shard, gather weights.

        ``step`` is the 1-based update number (Adam bias correction, rounding seeds). Returns host stats
        (the one host sync of the step). A non-finite gradient norm skips the update: the weights and the
        optimizer state stay as they were. So does a loss above ``max_loss`` or a norm above ``max_norm``
        (the spike guard's limits, see llmq_ray/spike_guard.py); ``StepStats.skip_reason`` says why.
        """
        if self.micro_steps_done == 0:
            raise RuntimeError("update() called before any micro_step()")
        model, comm = self.model, self.comm
        totals = torch.stack([model.loss_sum.double(), model.target_count.double()])
        comm.all_reduce_sum(totals)
        if self.grad_shard is not None:  # ZeRO-2: reduced at every micro-step already
            shard = self.grad_shard
        else:  # ZeRO-1: reduce once, at the end of the step
            shard = self.grads[self.comm.rank * self.shard_size:(self.comm.rank + 1) * self.shard_size]
            comm.reduce_scatter_sum(shard, self.grads)
        local = shard[:self.shard_end - self.shard_start]
        norm_sq = global_grad_norm_squared(self.backend, local)
        comm.all_reduce_sum(norm_sq)
        count = totals[1].clamp(min=1.0).float()
        norm = norm_sq.sqrt() / count
        coef = clip_coefficient(norm, self.opts.grad_clip)
        finite = torch.isfinite(coef)
        stats = torch.stack([totals[0].float() / count, norm, count, finite.float()]).tolist()
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
        self.optimizer.step(local, lr=lr, step=step, grad_scale=coef / count)
        params_shard = self.params[self.comm.rank * self.shard_size:(self.comm.rank + 1) * self.shard_size]
        comm.all_gather(self.params, params_shard)
        return StepStats(loss=stats[0], grad_norm=stats[1], tokens=int(stats[2]))

    @torch.no_grad()
    def evaluate(self, batches) -> tuple[float, int]:
        """Summed loss and target count over an iterable of (inputs, targets) batches, reduced over ranks."""
        model = self.model
        model.loss_sum.zero_()
        model.target_count.zero_()
        for inputs, targets in batches:
            model.forward_loss(inputs, targets)
        totals = torch.stack([model.loss_sum.double(), model.target_count.double()])
        self.comm.all_reduce_sum(totals)
        loss_sum, count = totals.tolist()
        return loss_sum, int(count)
