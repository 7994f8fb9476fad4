"""A tiny progress bar with rate and ETA, for training steps, evaluation batches and tokenization.

    with Progress(total=1000, desc="train", unit="step") as bar:
        for step in range(1000):
            ...
            bar.update(1, loss=f"{loss:.3f}")
            if step % 50 == 0:
                bar.write(step_line(...))   # a log line above the bar; the bar is redrawn under it

One line, redrawn in place with ``\\r`` at most every ``min_interval`` seconds (and always at the end)::

    train [##########--------------------]  340/1000  34.0% | 2.91 step/s | ETA 3:47 | loss=3.412

``EvalBar`` follows an evaluation that runs inside the workers: fed the coordinator's reports (batches
done on rank 0, polled by the trainer while it waits), it draws ``eval`` (or ``final eval``) over the eval
batches in place of the training bar, and erases itself when the eval is over (its ``[V]`` line follows).

The bar is *off* -- every call is a no-op, except ``write`` which just prints the line -- when disabled
(``enabled=False``, e.g. from ``--no-progress``), when the environment sets ``LLMQ_NO_PROGRESS`` to a
non-empty value other than "0", or when the stream is not a terminal (``stream.isatty()`` false: logs
redirected to a file, CI, Ray worker stdout), so files and captured logs never get ``\\r`` clutter.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable, Optional, TextIO


def progress_enabled(stream: Optional[TextIO], enabled: bool = True) -> bool:
    """Whether a bar on ``stream`` would be drawn: ``enabled``, no ``LLMQ_NO_PROGRESS`` and a TTY stream."""
    if not enabled or stream is None:
        return False
    env = os.environ.get("LLMQ_NO_PROGRESS", "")
    if env and env != "0":
        return False
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def format_duration(seconds: float) -> str:
    """H:MM:SS above an hour, else M:SS; '?' when unknown."""
    if seconds is None or seconds != seconds or seconds < 0 or seconds == float("inf"):
        return "?"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """A one-line progress bar on ``stream`` (default stderr) for ``total`` units (None: unknown total,
    count and rate only). ``clock`` is injectable for tests. See the module docstring for when it is off."""

    def __init__(self, total: Optional[int], desc: str = "", unit: str = "it", *, stream: Optional[TextIO] = None,
                 enabled: bool = True, width: int = 30, min_interval: float = 0.1, initial: int = 0,
                 clock: Callable[[], float] = time.monotonic):
        self.total = total if total is None else max(int(total), 0)
        self.desc, self.unit, self.width = desc, unit, width
        self.stream = sys.stderr if stream is None else stream
        self.enabled = progress_enabled(self.stream, enabled)
        self.min_interval = min_interval
        self.clock = clock
        self.n = self.start_n = int(initial)
        self.start = clock()
        self._last_draw: Optional[float] = None
        self._postfix = ""
        self._drawn_len = 0
        self.closed = False

    # ------------------------------------------------------------------ numbers
    def rate(self) -> Optional[float]:
        """Units per second since the start (None before any progress)."""
        done, dt = self.n - self.start_n, self.clock() - self.start
        return done / dt if done > 0 and dt > 0 else None

    def eta(self) -> Optional[float]:
        """Seconds left at the average rate so far (None when unknown)."""
        r = self.rate()
        if r is None or self.total is None:
            return None
        return max(self.total - self.n, 0) / r

    def render(self) -> str:
        """The bar line as it would be drawn now (without ``\\r``)."""
        head = f"{self.desc} " if self.desc else ""
        r = self.rate()
        rate = f"{r:.2f} {self.unit}/s" if r is not None else f"- {self.unit}/s"
        if self.total:
            frac = min(self.n / self.total, 1.0)
            filled = int(frac * self.width)  # floor: full only at the end
            digits = len(str(self.total))
            text = (f"{head}[{'#' * filled}{'-' * (self.width - filled)}] {self.n:>{digits}}/{self.total} "
                    f"{100 * frac:5.1f}% | {rate} | ETA {format_duration(self.eta()) if self.n < self.total else '0:00'}")
        else:
            text = f"{head}{self.n} {self.unit} | {rate} | elapsed {format_duration(self.clock() - self.start)}"
        return text + (f" | {self._postfix}" if self._postfix else "")

    # ------------------------------------------------------------------ drawing
    def _draw(self, force: bool = False) -> None:
        if not self.enabled or self.closed:
            return
        now = self.clock()
        if not force and self._last_draw is not None and now - self._last_draw < self.min_interval:
            return
        text = self.render()
        pad = max(self._drawn_len - len(text), 0)  # blank out the rest of a longer previous line
        self.stream.write("\r" + text + " " * pad)
        self.stream.flush()
        self._drawn_len = len(text)
        self._last_draw = now

    def clear(self) -> None:
        """Erase the drawn line (the bar stays open: the next update or write draws it again)."""
        if self._drawn_len:
            self.stream.write("\r" + " " * self._drawn_len + "\r")
            self._drawn_len = 0

    def update(self, n: int = 1, **postfix) -> None:
        """Advance by ``n`` units; keyword arguments are shown after the bar (``loss=3.41``)."""
        self.n += n
        if postfix:
            self.set_postfix(**postfix)
        done = self.total is not None and self.n >= self.total
        self._draw(force=done)

    def set_postfix(self, **postfix) -> None:
        """Replace the text after the bar (key=value pairs)."""
        self._postfix = " ".join(f"{k}={v}" for k, v in postfix.items())

    def write(self, line: str) -> None:
        """Print ``line`` (a log line) above the bar; with the bar off, just print it to the stream."""
        if self.enabled and not self.closed:
            self.clear()
            self.stream.write(line + "\n")
            self._draw(force=True)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self, leave: bool = True) -> None:
        """Draw the final state and end the line; ``leave=False``: erase the bar instead (idempotent)."""
        if self.closed:
            return
        if self.enabled:
            if leave:
                self._draw(force=True)
                self.stream.write("\n")
            else:
                self.clear()
            self.stream.flush()
        self.closed = True

    def __enter__(self) -> "Progress":
        self._draw(force=True)
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class EvalBar:
    """The bar of an evaluation running in the workers, fed by ``show(report)`` each time the trainer polls
    the coordinator: ``report`` is {"done", "total", "full"} (eval batches done on rank 0, of ``total``;
    ``full``: the final eval over the whole file) while an eval runs, None otherwise. While an eval runs
    it hides ``under`` (the training bar, drawn again by its next write) and draws its own line; when the
    eval is over it erases that line. Off exactly when a ``Progress`` on ``stream`` would be."""

    def __init__(self, stream: Optional[TextIO] = None, enabled: bool = True, under: Optional[Progress] = None,
                 clock: Callable[[], float] = time.monotonic):
        self.stream = sys.stderr if stream is None else stream
        self.enabled = progress_enabled(self.stream, enabled)
        self.under, self.clock = under, clock
        self.bar: Optional[Progress] = None

    def show(self, report: Optional[dict]) -> None:
        if not self.enabled:
            return
        if report is None:
            self.end()
            return
        if self.bar is not None and (self.bar.total != report["total"] or report["done"] < self.bar.n):
            self.end()  # another eval began between two polls
        if self.bar is None:
            if self.under is not None:
                self.under.clear()
            self.bar = Progress(report["total"], "final eval" if report.get("full") else "eval", unit="batch",
                                stream=self.stream, clock=self.clock)
        self.bar.update(report["done"] - self.bar.n)

    def end(self) -> None:
        """The eval is over: erase its bar (idempotent)."""
        if self.bar is not None:
            self.bar.close(leave=False)
            self.bar = None
