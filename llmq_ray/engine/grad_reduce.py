"""ZeRO-1 on several ranks: sum each unit's gradients onto their owners during the step's last backward.

Why: ZeRO-1 keeps the full flat gradient buffer [W*S] on every rank, and each rank's optimizer needs the sum over
ranks of its own shard [r*S, (r+1)*S). Done as one reduce-scatter at the update, that collective (the whole
model's gradients: ~1 GB at Qwen2.5-0.5B in bf16) runs while every GPU waits, ~1.5 ms of a ~110 ms step on two
GPUs over NVLink. But a unit's gradients are final as soon as the step's last backward has passed it, so its
range of the buffer can be summed right then, while the backward of the units below runs.

What: a unit policy (llmq_ray/model/layers/units.py), active only while the engine runs the micro-step it marks as the
step's last. At ``end(unit, backward=True)`` it starts ``reduce_sum`` of each piece of the unit's ranges
(``unit_ranges``: a layer's four matrices; the untied LM head; the embedding with the replicated norm/bias tail,
which the backward finishes last) onto the piece's owner, in place, as ZeRO-2's store does
(llmq_ray/parallel/data.py). Every rank runs the same units in the same order, so the collectives match up. At the
end of the embedding's backward it starts the last unit's reduces and waits for all of them: the compute stream
waits (NCCL) or the host blocks (gloo), so the micro-step ends with every owner's shard summed -- also inside a
captured CUDA graph, which must join every collective it started (llmq_ray/engine/cuda_graphs.py captures this
micro-step as its own graph). The engine's update then skips its reduce-scatter.

Opt-in (``--overlap-comm``, with the per-unit weight gather of llmq_ray/engine/update_overlap.py): measured on
2 x H100 at Qwen2.5-0.5B (2026-11-26), each of the two overlaps made a step ~2% slower instead of ~1% faster --
the per-layer NCCL kernels run beside the compute kernels, take their SMs and spin while the other rank catches
up -- so the default stays one reduce-scatter at the update.

Same results as the reduce-scatter: the same elements summed over the same ranks (on gloo both are rank-ordered
sums, actors/collectives.py, so fp32 runs are bit-identical; tests/test_zero3.py). Not used with
--overlap-wgrad-sms, where a layer's weight gradients are still being written on a side stream when its ``end``
runs: the update reduce-scatters as before.
"""

from __future__ import annotations

import torch

from llmq_ray.engine.update_overlap import unit_ranges
from llmq_ray.parallel.data import shard_pieces
from llmq_ray.model.params import ParamLayout
from llmq_ray.model.layers.units import EMBED, Policy


class LastBackwardReduce(Policy):
    """Reduces ``grads`` (flat [W*S], model dtype; this rank's shard is [rank*S, (rank+1)*S)) onto the shard
    owners unit by unit while ``active``; ``end(EMBED, backward=True)`` waits for all of them."""

    def __init__(self, layout: ParamLayout, comm, grads: torch.Tensor, shard_size: int):
        self.comm, self.grads, self.shard_size = comm, grads, shard_size
        self.ranges = unit_ranges(layout)
        covered = sorted(r for ranges in self.ranges.values() for r in ranges)
        assert covered[0][0] == 0 and covered[-1][1] == layout.numel and all(
            a[1] == b[0] for a, b in zip(covered, covered[1:])), "the units cover the flat buffer once"
        self.active = False
        self.pending: list = []

    def end(self, unit, backward: bool = False) -> None:
        if not (backward and self.active):
            return
        for lo, hi in self.ranges.get(unit, ()):
            for r, plo, phi in shard_pieces(lo, hi, self.shard_size):
                self.pending.append(self.comm.reduce_sum(self.grads[plo:phi], dst=r))
        if unit == EMBED:  # the last unit of the backward: the micro-step ends with every shard summed
            for handle in self.pending:
                handle.wait()
            self.pending.clear()
