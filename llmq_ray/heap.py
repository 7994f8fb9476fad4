"""Keep Python's cyclic garbage collector from pausing the training loop.

Why: a full (generation-2) collection walks every tracked object of the process. A training worker holds
hundreds of thousands of them once torch, Ray, Triton and the compiled kernels are loaded, so a full
collection can stall the host for a large part of a second. The GPU queue holds only about one micro-step
of work (each micro-step's batch copy waits for the queue), so such a stall is GPU idle time. Python starts a
full collection when the objects that survived the younger generations reach a quarter of the long-lived ones.
``freeze_long_lived`` collects once and then moves everything alive into the permanent generation, which
later collections skip: the objects of the set-up and the first step (modules, kernels, the engine) are never
walked again, and the collector only sees what the steps themselves create.

It was first suspected for one 7B update ~0.6 s slower than its neighbours (always the 4th). ``GcPauses``,
the collector's pauses per step (in every step record), showed 0-0.3 ms there: the cause was a Triton
recompile of the AdamW kernel (see backends/triton/adamw.py). The freeze stays as cheap insurance.
"""

from __future__ import annotations

import gc
import time


class GcPauses:
    """Seconds the cyclic garbage collector spent since the last ``take()`` (gc.callbacks; any thread)."""

    def __init__(self):
        self.seconds = 0.0
        self.collections = 0
        self._t0 = None
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.seconds += time.perf_counter() - self._t0
            self.collections += 1
            self._t0 = None

    def take(self) -> tuple[float, int]:
        """(seconds, collections) since the last call, and restart counting."""
        out = (self.seconds, self.collections)
        self.seconds, self.collections = 0.0, 0
        return out

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)


def freeze_long_lived() -> int:
    """Collect now, then exempt every object alive from future collections. Returns how many are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
