"""CUDA-graph capture of one micro-step's forward + backward (``--use-cuda-graphs``).

Why: a micro-step of the 0.5B model is ~1,500 kernel launches. Python issues them at 10-20 us each, so
wherever the GPU finishes kernels faster than Python launches them (the short kernels of the norms, rope,
quantization; the first layers after each step's host sync) the GPU waits. A captured graph is replayed with
one launch and no Python in between.

What is captured: ``Decoder.forward_backward`` on fixed device buffers ``inputs``/``targets`` (int64
[B, T]). Everything it does is already graph-safe by construction: fixed shapes, buffers allocated once in the
model, no host sync, gradients / ``loss_sum`` / ``target_count`` updated in place. Two things depend on host
state and are therefore kept out of (or keyed into) the graph:

* the FP8 weight copies are re-quantized once per optimizer step: that runs eagerly before the replay
  (``BlockLinears.ensure_quantized``), so the graph only reads them -- unless the update is overlapped (below);
* the first micro-step of a step *overwrites* the block weight gradients and later ones accumulate
  (``Decoder._block_grads_zero``); with ZeRO-1 on several ranks the step's last micro-step also reduces each
  layer's gradients onto their owners during its backward (llmq_ray/engine/grad_reduce.py: NCCL collectives
  captured into the graph, all joined before its end): one graph per mode, sharing one memory pool.

With the update overlapped with the next forward (one worker, ZeRO-1; llmq_ray/engine/update_overlap.py) the first
micro-step of a step must wait, per unit, for the update of that unit's weights, zero that unit's gradients
only then (the update reads them), and, with FP8, quantize each layer's weights only after its wait. The
"first micro-step" graph is therefore captured with all three inside it: an event-wait node on each unit's
external event (re-recorded by every update, so a replay waits for the latest one; after a skipped update,
or when the update was joined for eval or a checkpoint, the latest recording is of an update long finished
and the wait passes at once), the unit's zeroing, and the FP8 weight quantization at the layer's first use.
An update re-records the events only after ``TrainEngine.update``'s host sync, when every replay that waits
on them has finished, so it never matters whether a wait node reads its event at launch or at execution.
``ensure_quantized`` then runs only before the other mode's replays.

The first call in each mode runs eagerly (this also warms up Triton's compilation, cuBLAS and cuDNN plans),
then records the graph without executing it; later calls copy the batch into the static buffers and replay.
Results are the same kernels on the same data in the same order as eager mode.
"""

from __future__ import annotations

import torch

from llmq_ray.errors import ConfigError
from llmq_ray.model.decoder import Decoder
from llmq_ray.engine.grad_reduce import LastBackwardReduce
from llmq_ray.engine.update_overlap import UpdateOverlap


class MicroStepGraphs:
    """Replays ``model.forward_backward`` from CUDA graphs (one per mode: first micro-step of a step or not, and
    whether the step's last backward reduces the gradients).

    ``overlap``: the engine's UpdateOverlap when the update runs beside the next forward (None otherwise).
    ``grad_reduce``: the engine's LastBackwardReduce (ZeRO-1 on several ranks; None otherwise)."""

    def __init__(self, model: Decoder, overlap: UpdateOverlap | None = None,
                 grad_reduce: LastBackwardReduce | None = None):
        if model.device.type != "cuda":
            raise ConfigError(f"CUDA graphs need a CUDA device; this worker runs on {model.device}.")
        if not model.backend.graph_capturable:
            raise ConfigError(f"CUDA graphs do not work with the {model.backend.name} backend: its kernels sync with "
                              f"the host inside a step; the triton backend's do not.")
        self.model, self.overlap, self.grad_reduce = model, overlap, grad_reduce
        shape = (model.batch_size, model.seq_len)
        self.inputs = torch.zeros(shape, dtype=torch.int64, device=model.device)
        self.targets = torch.zeros(shape, dtype=torch.int64, device=model.device)
        self.graphs: dict[tuple[bool, bool], torch.cuda.CUDAGraph] = {}
        self._pool = None

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """Same contract as ``Decoder.forward_backward`` (int [B, T] inputs/targets, host or device)."""
        model = self.model
        model.check_batch_shape(inputs, targets)  # shape errors are raised here, before any copy
        self.inputs.copy_(inputs, non_blocking=True)
        self.targets.copy_(targets, non_blocking=True)
        mode = (model._block_grads_zero, self.grad_reduce is not None and self.grad_reduce.active)
        waits_inside = self._waits_inside(mode)
        if not waits_inside:
            model.lin.ensure_quantized()
        graph = self.graphs.get(mode)
        if graph is None:
            model.forward_backward(self.inputs, self.targets)  # eager: correct result + warm-up of every kernel
            self._capture(mode)
        else:
            if waits_inside:  # the graph waits, zeroes and quantizes per unit itself
                model.store.ready.clear()
                model.store.unzeroed.clear()
            graph.replay()
            if waits_inside:
                model.lin.mark_quantized()
        model._block_grads_zero = False

    def _waits_inside(self, mode: tuple[bool, bool]) -> bool:
        """Whether this mode's graph holds the per-unit waits for an overlapped update (the first micro-step)."""
        return mode[0] and self.overlap is not None and bool(self.overlap.events)

    def _capture(self, mode: tuple[bool, bool]) -> None:
        model, store = self.model, self.model.store
        torch.cuda.synchronize(model.device)
        graph = torch.cuda.CUDAGraph()
        model._block_grads_zero = mode[0]
        if self._waits_inside(mode):  # as if an update were running: every unit waits and zeroes at its begin
            store.ready.update(self.overlap.events)
            store.unzeroed = set(store.unit_grads)
            model.lin.invalidate_weights()
        with torch.cuda.graph(graph, pool=self._pool):
            model.forward_backward(self.inputs, self.targets)  # recorded, not executed
        if self._pool is None:
            self._pool = graph.pool()
        self.graphs[mode] = graph
