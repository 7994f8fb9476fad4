"""Overlap the optimizer update (and, on several workers, the weight gather) with the next step's forward (ZeRO-1).

Why: with the Adam state in host memory (7B on one GPU) an update streams ~60 GB over PCIe (~0.65 s on an
H100), time in which the GPU's compute units idle. The update of a chunk of the flat parameter buffer needs
only that chunk's gradients; the next forward needs a layer's weights only when it reaches that layer. So
the update runs on a side stream, chunk by chunk in the order the forward needs them, and the compute stream
waits, at each unit's ``begin`` (``ResidentWeights``), only for the chunks that hold that unit's weights.

Units and what they wait for (``unit_ranges``): ``"embed"`` -- the embedding (GPT-2: and its position table) and
every norm weight and bias (the "plain" parameters: a few hundred thousand elements, read one unit early by the
fused residual+norm kernels); layer ``l`` -- its four block matrices; ``"head"`` -- the untied LM head. Chunks are updated in
that order (``chunk_order``); a chunk that straddles two units goes with the earlier one.

The gradients the update reads are the ones the next micro-step would zero and overwrite: ``zero_grads`` is
deferred to each unit's first ``begin`` of the next micro-step, after its wait. Everything else that reads or
writes weights, gradients or optimizer state (eval, checkpoints, the next update) first ``join``s the update.

The results are the same bits as an update on the compute stream: the same kernels on the same chunks with the
same seeds, only queued in another order. On the CPU there are no streams: the update runs at once (the
order and the deferred zeroing still run, so CPU tests cover them).
With CUDA graphs (llmq_ray/engine/cuda_graphs.py) the first micro-step of a step is replayed from a graph captured
with these waits and deferred zeroings in it (and, with FP8, each layer's weight quantization after its wait).
Several workers (ZeRO-1, opt-in with ``--overlap-comm``; see llmq_ray/engine/grad_reduce.py for why it is not the
default): each rank updates only its shard, and a unit's weights are current on every rank only
once their owners have broadcast them. So instead of one all-gather after the whole update, each unit's pieces
are broadcast from their owners (``comm.broadcast``, one async collective per piece, in place in ``params``) as
soon as this rank's chunks of that unit are updated: issued on the update stream (the collective starts after
those chunks), waited for on the ``weight-gather`` stream, whose per-unit event is what the next forward waits
for. Every rank issues the units' broadcasts in the same (forward) order, whatever its own chunks are, so the
collectives match up; a rank issues a unit once its own chunks of it and of every earlier unit are queued. The
next forward thus waits, unit by unit, for the update and the gather of that unit only.

Limits: ZeRO-1 (ZeRO-2's accumulator is written by the next micro-step's reduction; ZeRO-3 gathers its own
weights).
"""

from __future__ import annotations

from collections import defaultdict

import torch

from llmq_ray.model.buffers import ResidentWeights
from llmq_ray.engine.optim import ShardedAdamW
from llmq_ray.engine.schedule import Schedule
from llmq_ray.model.params import ParamLayout
from llmq_ray.parallel.data import shard_pieces


def unit_ranges(layout: ParamLayout) -> dict:
    """{unit: [(lo, hi)]} of the flat buffer, units in the order the forward pass begins them."""
    cfg = layout.cfg
    slots = layout.slots
    units: dict = {"embed": [(slots["embed"].offset, slots["embed"].end), (layout.decay_end, layout.numel)]}
    if "pos_embed" in slots:  # GPT-2's position table is read with the embedding
        units["embed"].append((slots["pos_embed"].offset, slots["pos_embed"].end))
    for layer in range(cfg.num_layers):
        p = f"layers.{layer}."
        units[layer] = [(slots[p + "qkv_w"].offset, slots[p + "down_w"].end)]
    if not cfg.tie_word_embeddings:
        units["head"] = [(slots["lm_head"].offset, slots["lm_head"].end)]
    return units


def units_of_chunks(chunks: list[tuple[int, int, bool]], units: dict) -> list[list]:
    """For each chunk (lo, hi, _), the units (in ``units``' order) whose ranges it overlaps."""
    return [[u for u, ranges in units.items() if any(a < hi and lo < b for a, b in ranges)] for lo, hi, _ in chunks]


def chunk_order(chunks: list[tuple[int, int, bool]], units: dict) -> tuple[list[int], dict[int, list]]:
    """(order, ready_after): the chunk indices sorted by the first unit each overlaps (stable), and
    {chunk index: [units whose last overlapping chunk, in that order, it is]}."""
    rank = {u: r for r, u in enumerate(units)}
    touches = units_of_chunks(chunks, units)
    order = sorted(range(len(chunks)), key=lambda j: (min((rank[u] for u in touches[j]), default=len(rank)), j))
    last: dict = {}
    for j in order:
        for u in touches[j]:
            last[u] = j
    ready_after: dict[int, list] = defaultdict(list)
    for u, j in last.items():
        ready_after[j].append(u)
    return order, dict(ready_after)


class UpdateOverlap:
    """Queues ``optimizer.step`` on a side stream and hands per-unit readiness events to ``store``.

    ``store``: the model's ResidentWeights over ``grads`` (flat, model dtype). ``schedule``: gives the ``update``
    stream and the per-unit events (none on the CPU)."""

    def __init__(self, layout: ParamLayout, optimizer: ShardedAdamW, store: ResidentWeights, schedule: Schedule,
                 comm=None, shard_size: int = 0):
        self.optimizer, self.store = optimizer, store
        units = unit_ranges(layout)
        self.units = units
        self.order, self.ready_after = chunk_order(optimizer.chunks, units)
        store.unit_grads = {u: [store.grads[lo:hi] for lo, hi in ranges] for u, ranges in units.items()}
        self.stream = schedule.stream("update")
        # several ranks: each unit's pieces are broadcast from their owners after their update (module docstring)
        self.comm = comm if comm is not None and comm.world_size > 1 else None
        self.shard_size = shard_size
        self.gather_stream = schedule.stream("weight-gather") if self.comm is not None else None
        self.chunk_units = units_of_chunks(optimizer.chunks, units)  # chunk j -> the units it overlaps
        self._keep: list = []  # tensors made on the compute stream and read by the update: alive until join
        # One event per unit, re-recorded by every update. ``external``: a CUDA graph captured while waiting on
        # it gets an event-wait node on this very event (llmq_ray/engine/cuda_graphs.py), so each replay waits for
        # whichever update recorded it last. Re-recording is safe: it happens after TrainEngine.update's host
        # sync, when no replay that waits on these events is still running. Recorded once here: a wait on a
        # never-recorded event is a no-op in torch, and would leave the node out of a graph.
        self.events: dict = {}
        if self.stream is not None:
            for u in units:
                self.events[u] = schedule.event(f"update-done-{u}", external=True)
                self.events[u].record(self.stream)

    def step(self, grads_shard: torch.Tensor, *, lr: float, step: int, grad_scale) -> None:
        """``optimizer.step`` on the side stream; returns once it is queued."""
        self.join()  # a previous update (if any) is ordered before this one, and its tensors may be freed
        self._keep = [grads_shard, grad_scale]
        ready = self.store.ready
        if self.comm is not None:
            self._step_and_gather(grads_shard, lr=lr, step=step, grad_scale=grad_scale)
            return

        def after_chunk(j: int) -> None:
            for u in self.ready_after.get(j, ()):
                event = self.events.get(u)
                if event is not None:
                    event.record(self.stream)
                ready[u] = event

        self.optimizer.step(grads_shard, lr=lr, step=step, grad_scale=grad_scale, order=self.order,
                            after_chunk=after_chunk, stream=self.stream)

    def _step_and_gather(self, grads_shard: torch.Tensor, **hyper) -> None:
        """Several ranks: the update of this rank's chunks, each unit broadcast from its owners as soon as this
        rank's chunks of it (and of every earlier unit) are queued; the unit's event follows its broadcasts."""
        units = list(self.units)
        waiting: dict = {u: set() for u in units}  # unit -> this rank's chunks of it not queued yet
        for j, touched in enumerate(self.chunk_units):
            for u in touched:
                waiting[u].add(j)
        issued = 0

        def issue_ready() -> None:
            nonlocal issued
            while issued < len(units) and not waiting[units[issued]]:
                self._broadcast_unit(units[issued])
                issued += 1

        def after_chunk(j: int) -> None:
            for u in self.chunk_units[j]:
                waiting[u].discard(j)
            issue_ready()

        if self.stream is None:
            issue_ready()
            self.optimizer.step(grads_shard, order=self.order, after_chunk=after_chunk, **hyper)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
            with torch.cuda.stream(self.stream):  # collectives issued here start after the queued chunks
                issue_ready()
                self.optimizer.step(grads_shard, order=self.order, after_chunk=after_chunk, stream=self.stream,
                                    **hyper)
        assert issued == len(units), "every unit's chunks were updated"

    def _broadcast_unit(self, unit) -> None:
        """Start broadcasting ``unit``'s pieces from their owners into ``params``; its event (CUDA) is recorded
        on the gather stream once they have arrived. On the CPU the broadcasts complete here."""
        handles = [self.comm.broadcast(self.store.params[lo:hi], src=r)
                   for a, b in self.units[unit] for r, lo, hi in shard_pieces(a, b, self.shard_size)]
        event = self.events.get(unit)
        if self.gather_stream is None:
            for h in handles:
                h.wait()
        else:
            with torch.cuda.stream(self.gather_stream):
                for h in handles:
                    h.wait()
                event.record(self.gather_stream)
        self.store.ready[unit] = event

    def join(self) -> None:
        """The compute stream waits for the whole update (before anything else touches the weights, the
        gradients or the optimizer state); units not begun yet no longer need to wait."""
        self.optimizer.join()
        if self.gather_stream is not None:
            torch.cuda.current_stream(self.gather_stream.device).wait_stream(self.gather_stream)
        self.store.ready.clear()
        self._keep = []
