"""The loss and grad-norm spike guard: a z-score of each step's value over a window of the previous ones.

As in llm.c's outlier detector: keep the last ``window`` finite values of the loss and of the gradient
norm; a new value's z-score is ``(x - mean) / std`` over that window (population std), defined once the
window is full. A z-score above ``threshold`` is a spike. Every finite value enters its window, spikes
included (a lasting change of level stops being a spike after a while instead of blocking every update).

The coordinator owns one ``SpikeGuard``:

* before a step, ``limits()`` gives {"loss": L, "norm": N}, the values above which the step is a spike
  (``mean + threshold * std``; None while a window fills). With ``--skip-update-on-spike`` the workers get
  these limits and the engine skips the update of a step above them (every rank sees the same all-reduced
  loss and norm, so they all decide alike).
* after a step, ``observe(loss, norm)`` returns the spikes it saw ([("loss", z), ...]) and adds the values.

Its state (the two windows) is JSON and travels in the checkpoint manifest, so a resumed run makes the
same decisions as the uninterrupted one.
"""

from __future__ import annotations

import collections
import math
from typing import Optional


class ZScoreWindow:
    """The last ``size`` finite values and the z-score of a new one against them."""

    def __init__(self, size: int, values=()):
        self.values: collections.deque = collections.deque((float(v) for v in values), maxlen=int(size))

    @property
    def full(self) -> bool:
        return len(self.values) == self.values.maxlen

    def stats(self) -> Optional[tuple[float, float]]:
        """(mean, std) of the window, or None until it is full."""
        if not self.full:
            return None
        n = len(self.values)
        mean = math.fsum(self.values) / n
        var = math.fsum((v - mean) ** 2 for v in self.values) / n
        return mean, math.sqrt(var)

    def zscore(self, x: float) -> Optional[float]:
        """z-score of ``x`` against the window (None until full or when x is not finite)."""
        s = self.stats()
        if s is None or not math.isfinite(x):
            return None
        mean, std = s
        if std == 0.0:
            return 0.0 if x == mean else math.copysign(math.inf, x - mean)
        return (x - mean) / std

    def add(self, x: float) -> None:
        if math.isfinite(x):
            self.values.append(float(x))


class SpikeGuard:
    """Windows over the loss and the grad norm; see the module docstring."""

    def __init__(self, window: int = 128, threshold: float = 6.0):
        if not isinstance(window, int) or window < 2:
            raise ValueError(f"a spike window of {window!r} steps: must be an integer >= 2")
        if not threshold > 0:
            raise ValueError(f"a spike threshold of {threshold!r}: must be > 0")
        self.window, self.threshold = window, float(threshold)
        self.loss = ZScoreWindow(window)
        self.norm = ZScoreWindow(window)

    def limits(self) -> dict:
        """{"loss": max loss or None, "norm": max grad norm or None}: above them a step is a spike."""
        out = {}
        for name, w in (("loss", self.loss), ("norm", self.norm)):
            s = w.stats()
            out[name] = None if s is None else s[0] + self.threshold * s[1]
        return out

    def observe(self, loss: float, norm: float) -> list[tuple[str, float]]:
        """The spikes of this step [("loss" | "norm", z-score)], then the values join their windows."""
        spikes = []
        for name, w, x in (("loss", self.loss, loss), ("norm", self.norm, norm)):
            z = w.zscore(x)
            if z is not None and z > self.threshold:
                spikes.append((name, z))
        self.loss.add(loss)
        self.norm.add(norm)
        return spikes

    def state(self) -> dict:
        """JSON state (for the checkpoint manifest)."""
        return {"window": self.window, "threshold": self.threshold, "loss": list(self.loss.values),
                "norm": list(self.norm.values)}

    def load_state(self, state: Optional[dict]) -> None:
        """Put the windows back from ``state()`` (None or another window size: start empty / keep the tail)."""
        self.loss = ZScoreWindow(self.window, (state or {}).get("loss", ()))
        self.norm = ZScoreWindow(self.window, (state or {}).get("norm", ()))
