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
input of that wgrad (llmq_ray/model/llama.py lists which), and ``wait_all()`` before anything reads the gradients
(the end of the micro-step: optimizer, gradient reductions, the next micro-step's recomputation).

Modes (tests): on a CPU device there is no stream, so ``submit`` runs the wgrad at once, or with ``mode="defer"``
as late as an in-order side stream could: only when the model waits for it or for a wgrad submitted after it.
Each deferred wgrad also checks that the tensors it reads (``reads``) still hold what they held at submission,
naming the wgrad whose input was overwritten too early. On CUDA, ``mode="serial"`` runs the same GEMMs on the
compute stream (the bits the side stream must reproduce), and ``delay_cycles`` makes the side stream spin before
each wgrad, so that a missing wait shows as wrong bits rather than as a rare race. Under CUDA-graph capture the
fork and join events become graph dependencies; ``wait_all`` at the end of the micro-step joins the side stream
back before the capture ends.

The side stream has the lowest priority, so the compute stream's blocks go first when SMs free up. (torch hands
out streams from a pool of 32 per priority: after many streams in one process this one can be shared with another
side stream, e.g. the update's, which serialises their work but stays correct.)
"""

from __future__ import annotations

from typing import Callable

import torch

from llmq_ray.engine.schedule import Schedule
from llmq_ray.errors import ConfigError


MODES = ("stream", "serial", "defer")


class WgradOverlap:
    """Issues wgrad GEMMs on one side stream (see the module docstring). ``sm_count``: SMs each wgrad is sized
    for (the compute stream keeps the rest); ``mode``: "stream" (CUDA: the side stream; CPU: at once), "serial"
    (CUDA: on the compute stream) or "defer" (CPU: as late as allowed, inputs checked); ``delay_cycles`` (CUDA,
    tests): spin the side stream this long before each wgrad; ``submitted`` counts the wgrads issued."""

    def __init__(self, schedule: Schedule, sm_count: int, mode: str = "stream", delay_cycles: int = 0):
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} must be one of {MODES}")
        self.device = schedule.device
        cuda = self.device.type == "cuda"
        if mode == "defer" and cuda:
            raise ValueError("mode='defer' emulates a side stream on the CPU; on CUDA use delay_cycles")
        self.sm_count, self.mode, self.delay_cycles = sm_count, mode, delay_cycles
        self.stream = None
        if cuda and mode == "stream":
            self.stream = schedule.stream("wgrad", low_priority=True)
        # in submission order: (tag, the CUDA event recorded after the wgrad, or on the CPU its deferred call)
        self.pending: list[tuple[str, object]] = []
        self.submitted = 0

    def submit(self, tag: str, fn: Callable[[int], None], reads: tuple[torch.Tensor, ...] = ()) -> None:
        """Run ``fn(sm_count)`` (a wgrad reading ``reads``) after everything issued so far on the compute stream."""
        self.submitted += 1
        if self.stream is None:
            if self.mode == "defer":
                snapshot = tuple(t.clone() for t in reads)
                self.pending.append((tag, lambda: self._run_deferred(tag, fn, reads, snapshot)))
            else:  # CPU, or CUDA serial: in order on the compute stream
                fn(self.sm_count if self.device.type == "cuda" else 0)
            return
        self.stream.wait_event(torch.cuda.current_stream(self.device).record_event())
        with torch.cuda.stream(self.stream):
            if self.delay_cycles:
                torch.cuda._sleep(self.delay_cycles)
            fn(self.sm_count)
            done = self.stream.record_event()
        self.pending.append((tag, done))

    @staticmethod
    def _run_deferred(tag, fn, reads, snapshot) -> None:
        for i, (now, then) in enumerate(zip(reads, snapshot)):
            if not torch.equal(now, then):
                raise AssertionError(f"input {i} of the pending wgrad {tag!r} was overwritten before it ran")
        fn(0)

    def wait(self, *tags: str) -> None:
        """The compute stream waits for the last pending wgrad of each of ``tags`` (and so, the side stream being
        in order, for everything submitted before it); tags with nothing pending are skipped."""
        last = max((i for i, (tag, _) in enumerate(self.pending) if tag in tags), default=-1)
        if last < 0:
            return
        done, self.pending = self.pending[:last + 1], self.pending[last + 1:]
        if self.stream is None:  # deferred calls, in submission order
            for _, run in done:
                run()
        else:
            torch.cuda.current_stream(self.device).wait_event(done[-1][1])

    def wait_all(self) -> None:
        self.wait(*{tag for tag, _ in self.pending})


def enable_wgrad_overlap(model, sm_count: int, mode: str = "stream", delay_cycles: int = 0,
                         schedule: Schedule | None = None) -> WgradOverlap:
    """Run ``model``'s block wgrads beside its dgrads (``--overlap-wgrad-sms``), on the ``wgrad`` stream of
    ``schedule`` (default: the model's own schedule when it is the engine's, else a new one), each sized for
    ``sm_count`` SMs (1 .. this GPU's SM count); before the first micro-step."""
    if model.lin.fp8:
        raise ConfigError("the wgrad overlap runs the model-dtype GEMMs; it does not apply to FP8 block GEMMs")
    if not model.WGRAD_OVERLAP:
        raise ConfigError("the wgrad overlap is built for the Llama-family block; GPT-2 does not take it yet.")
    if model.grads is None:
        raise ConfigError("the wgrad overlap needs the full gradient buffer of ZeRO-1 (ZeRO-2/3 reduce each "
                          "layer's gradients as soon as its backward ends)")
    if schedule is None:
        schedule = model.schedule if isinstance(model.schedule, Schedule) else Schedule(model.device)
    device = schedule.device
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0
    if sm_count < 1 or (sms and sm_count > sms):
        raise ConfigError(f"a wgrad side stream of {sm_count} SMs: the count must be between 1 and this GPU's SM "
                          f"count ({sms or 'any'})")
    overlap = WgradOverlap(schedule, sm_count, mode, delay_cycles)
    model.use_wgrad_overlap(overlap)
    return overlap
