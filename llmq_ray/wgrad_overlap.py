"""Weight-gradient GEMMs on a side stream, beside the backward's chain of dgrads (model dtype, CUDA; opt-in).

Why: in the backward of a block only the dgrads are on the critical path (each layer's input gradient feeds the
next); the four wgrads (dW += dy^T x) are needed only at the end of the micro-step. Between the dgrads run
memory-bound kernels (the SwiGLU and RMSNorm backwards, the attention backward's helpers) that leave the tensor
cores idle and, on a power-capped H100, leave power unused. Here each wgrad is issued on a side stream as soon
as its inputs are final, sized by cuBLASLt for ``sm_count`` SMs (``Backend.matmul_beside``), so that the
compute stream's kernels keep the other SMs and the two run at the same time.

The hazards are the buffers the model reuses: a wgrad reads dy and x, and the compute stream must not
overwrite either before that wgrad has run. ``submit(tag, fn)`` records where the inputs became final and
remembers the wgrad's completion under ``tag``; the model calls ``wait(tag)`` right before it overwrites an
input of that wgrad (llmq_ray/model.py lists which), and ``wait_all()`` before anything reads the gradients
(the end of the micro-step: optimizer, gradient reductions, the next micro-step's recomputation).

On a CPU device there is no stream. ``submit`` then runs the wgrad at once, or, with ``defer`` (tests), as late as
an in-order side stream could: only when the model waits for it or for a wgrad submitted after it. A wait the
model is missing then shows as wrong gradients on the CPU. Under CUDA-graph capture the fork and join events
become graph dependencies; ``wait_all`` at the end of the micro-step joins the side stream back before the
capture ends.
"""

from __future__ import annotations

from typing import Callable

import torch


class WgradOverlap:
    """Issues wgrad GEMMs on one side stream (see the module docstring). ``sm_count``: SMs each wgrad is sized
    for (the compute stream keeps the rest); ``defer`` (CPU only): run each wgrad as late as allowed;
    ``submitted`` counts the wgrads issued."""

    def __init__(self, device: torch.device, sm_count: int, defer: bool = False):
        self.device = torch.device(device)
        self.sm_count = sm_count
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        if defer and self.stream is not None:
            raise ValueError("defer is the CPU emulation of a side stream; on CUDA the stream itself runs late")
        self.defer = defer
        # in submission order: (tag, the CUDA event recorded after the wgrad, or on the CPU its deferred call)
        self.pending: list[tuple[str, object]] = []
        self.submitted = 0

    def submit(self, tag: str, fn: Callable[[int], None]) -> None:
        """Run ``fn(sm_count)`` (a wgrad) on the side stream after everything issued so far on the compute stream."""
        self.submitted += 1
        if self.stream is None:
            if self.defer:
                self.pending.append((tag, fn))
            else:
                fn(0)
            return
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        self.stream.wait_event(ready)
        with torch.cuda.stream(self.stream):
            fn(self.sm_count)
            done = torch.cuda.Event()
            done.record(self.stream)
        self.pending.append((tag, done))

    def wait(self, *tags: str) -> None:
        """The compute stream waits for the last pending wgrad of each of ``tags`` (and so, the side stream being
        in order, for everything submitted before it); tags with nothing pending are skipped."""
        last = max((i for i, (tag, _) in enumerate(self.pending) if tag in tags), default=-1)
        if last < 0:
            return
        done, self.pending = self.pending[:last + 1], self.pending[last + 1:]
        if self.stream is None:  # deferred calls, in submission order
            for _, fn in done:
                fn(0)
        else:
            torch.cuda.current_stream(self.device).wait_event(done[-1][1])

    def wait_all(self) -> None:
        self.wait(*{tag for tag, _ in self.pending})
