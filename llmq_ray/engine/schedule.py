"""The schedule: the one owner of every CUDA stream and event of a training process.

The model declares its units and runs each micro-step as a loop over them, calling ``before(unit)`` /
``after(unit)`` around every unit (llmq_ray/model/layers/units.py). The policies registered here decide what happens
there and on which stream:

=========================  ======================================  ==========================================
policy                     where                                   streams it gets from here
=========================  ======================================  ==========================================
weights (resident/ZeRO-3)  llmq_ray/model/buffers.py,              (collectives: the communicator's own)
                           llmq_ray/parallel/data.py: gather a
                           layer ahead, reduce-scatter behind
FP8 weight copies          llmq_ray/model/layers/linear.py,        ``fp8-copies`` (host-kept copies)
                           llmq_ray/engine/offload.py (host)
residual offload           llmq_ray/engine/offload.py              ``residual`` (offloaded residuals)
recompute                  llmq_ray/model/llama.py, gpt2.py        (compute stream: same kernels, same inputs)
wgrad overlap              llmq_ray/engine/wgrad_overlap.py        ``wgrad`` (lowest priority)
optimizer-update overlap   llmq_ray/engine/update_overlap.py       ``update`` and one event per unit
host offload of master /   llmq_ray/engine/offload.py (StagedChunks)  ``<name>-upload``, ``<name>-download``
moments / gradients
CUDA-graph capture         llmq_ray/engine/cuda_graphs.py          (capture stream: torch's)
=========================  ======================================  ==========================================

A stream is made once per name, on first request, so every module that needs one asks the schedule by name and
no other module creates a stream (a test greps for it). On the CPU there are no streams: ``stream()`` returns
None and the policies copy synchronously on the compute "stream", with the same slots and order, which is what
the CPU tests check.

Why streams are named, not just created where used: torch hands out streams from a pool (32 per priority), so a
process that made one per buffer could silently share a stream between two side jobs and serialise them; here the
set of streams is known, listed by ``describe()`` and bounded.
"""

from __future__ import annotations

import torch

from llmq_ray.model.layers.units import UnitHooks


class Schedule(UnitHooks):
    """Runs the unit policies of one training process and owns its CUDA streams and events."""

    def __init__(self, device: torch.device | str):
        super().__init__(device)
        self.cuda = self.device.type == "cuda"
        self._streams: dict[str, torch.cuda.Stream] = {}
        self._events: dict[str, torch.cuda.Event] = {}

    def stream(self, name: str, *, low_priority: bool = False):
        """The side stream called ``name`` (made on first request; None on the CPU). ``low_priority``: the
        lowest priority the device offers, so the compute stream's blocks go first when SMs free up."""
        if not self.cuda:
            return None
        if name not in self._streams:
            priority = torch.cuda.Stream.priority_range()[0] if low_priority else 0
            self._streams[name] = torch.cuda.Stream(self.device, priority=priority)
        return self._streams[name]

    def event(self, name: str, *, external: bool = False):
        """The CUDA event called ``name`` (made on first request; None on the CPU). ``external``: a CUDA graph
        captured while waiting on it waits on this very event at every replay."""
        if not self.cuda:
            return None
        if name not in self._events:
            self._events[name] = torch.cuda.Event(external=external)
        return self._events[name]

    def describe(self) -> str:
        """One line: the side streams made so far and the policies, in the order they run."""
        names = ", ".join(self._streams) or "none"
        policies = ", ".join(type(p).__name__ for p in self.policies) or "none"
        return f"schedule: side streams {names}; unit policies {policies}"
