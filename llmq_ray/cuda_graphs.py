"""CUDA-graph capture of one micro-step's forward + backward (``--use-cuda-graphs``).

Why: a micro-step of the 0.5B model is ~1,500 kernel launches. Python issues them at 10-20 us each, so
wherever the GPU finishes kernels faster than Python launches them (the short kernels of the norms, rope,
quantization; the first layers after each step's host sync) the GPU waits. A captured graph is replayed with
one launch and no Python in between.

What is captured: ``LlamaModel.forward_backward`` on fixed device buffers ``inputs``/``targets`` (int64
[B, T]). Everything it does is already graph-safe by construction: fixed shapes, buffers allocated once in the
model, no host sync, gradients / ``loss_sum`` / ``target_count`` updated in place. Two things depend on host
state and are therefore kept out of (or keyed into) the graph:

* the FP8 weight copies are re-quantized once per optimizer step: that runs eagerly before the replay
  (``BlockLinears.ensure_quantized``), so the graph only reads them;
* the first micro-step of a step *overwrites* the block weight gradients and later ones accumulate
  (``LlamaModel._block_grads_zero``): two graphs, one per mode, sharing one memory pool.

The first call in each mode runs eagerly (this also warms up Triton's compilation, cuBLAS and cuDNN plans),
then records the graph without executing it; later calls copy the batch into the static buffers and replay.
Results are the same kernels on the same data in the same order as eager mode.
"""

from __future__ import annotations

import torch

from llmq_ray.errors import ConfigError
from llmq_ray.model import LlamaModel


class MicroStepGraphs:
    """Replays ``model.forward_backward`` from CUDA graphs (one per gradient mode)."""

    def __init__(self, model: LlamaModel):
        if model.device.type != "cuda":
            raise ConfigError(f"--use-cuda-graphs needs a CUDA device; this worker runs on {model.device}.")
        if not model.backend.graph_capturable:
            raise ConfigError(f"--use-cuda-graphs does not work with --backend={model.backend.name}: its kernels "
                              f"sync with the host inside a step; use --backend=triton.")
        self.model = model
        shape = (model.batch_size, model.seq_len)
        self.inputs = torch.zeros(shape, dtype=torch.int64, device=model.device)
        self.targets = torch.zeros(shape, dtype=torch.int64, device=model.device)
        self.graphs: dict[bool, torch.cuda.CUDAGraph] = {}
        self._pool = None

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """Same contract as ``LlamaModel.forward_backward`` (int [B, T] inputs/targets, host or device)."""
        model = self.model
        model.check_batch_shape(inputs, targets)  # shape errors are raised here, before any copy
        self.inputs.copy_(inputs, non_blocking=True)
        self.targets.copy_(targets, non_blocking=True)
        model.lin.ensure_quantized()
        mode = model._block_grads_zero
        graph = self.graphs.get(mode)
        if graph is None:
            model.forward_backward(self.inputs, self.targets)  # eager: correct result + warm-up of every kernel
            self._capture(mode)
        else:
            graph.replay()
        model._block_grads_zero = False

    def _capture(self, mode: bool) -> None:
        model = self.model
        torch.cuda.synchronize(model.device)
        graph = torch.cuda.CUDAGraph()
        model._block_grads_zero = mode
        with torch.cuda.graph(graph, pool=self._pool):
            model.forward_backward(self.inputs, self.targets)  # recorded, not executed
        if self._pool is None:
            self._pool = graph.pool()
        self.graphs[mode] = graph
