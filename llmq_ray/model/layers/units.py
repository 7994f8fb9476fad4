"""The units a micro-step runs, and the hooks the schedule runs around each of them.

A micro-step is a loop over units: the embedding (``EMBED``), each block (its index ``0 .. L-1``) and the LM head
(``HEAD``); the forward visits them in that order and the backward in reverse. Before and after a unit runs, the
schedule calls every policy registered with it, in registration order before the unit and in reverse after it:

    policy.begin(unit, backward)   # what the unit needs is in place (weights gathered, FP8 copies fetched,
                                   # the saved residual in place)
    ...the unit's kernels...
    policy.end(unit, backward)     # what it produced can move on (gradients reduced, weights released)

``backward`` is False in the forward; the LM head runs its forward and backward as one unit (``backward=True``
when the gradient is wanted). The model registers the policies its buffers need (the weight store, the FP8 copies,
the residual store); the engine adds its own (llmq_ray/engine/schedule.py) without touching the model.

``UnitHooks`` is the schedule without side streams: ``stream()`` returns None, so a policy does its copies on the
compute stream (synchronously on the CPU). It is what a model built on its own (tests, generation) runs with;
the engine's ``Schedule`` subclasses it and owns the CUDA streams and events.
"""

from __future__ import annotations

import torch

EMBED = "embed"
HEAD = "head"


class Policy:
    """A policy over units: override ``begin`` / ``end`` (both no-ops here)."""

    def begin(self, unit, backward: bool = False) -> None:
        pass

    def end(self, unit, backward: bool = False) -> None:
        pass


class UnitHooks:
    """Runs the registered policies around each unit; no side streams (see the module docstring)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.policies: list = []

    def add(self, policy):
        """Register ``policy`` (anything with ``begin(unit, backward)`` and ``end(unit, backward)``); returns it."""
        self.policies.append(policy)
        return policy

    def before(self, unit, backward: bool = False) -> None:
        for policy in self.policies:
            policy.begin(unit, backward)

    def after(self, unit, backward: bool = False) -> None:
        for policy in reversed(self.policies):
            policy.end(unit, backward)

    def stream(self, name: str, *, low_priority: bool = False):
        """The side stream called ``name``: None here, so its work runs on the compute stream."""
        return None

    def event(self, name: str, *, external: bool = False):
        """A CUDA event owned by the schedule: None here (no side streams to order)."""
        return None
