"""Progress bars for training steps and evaluation batches, drawn by tqdm.

    with Progress(total=1000, desc="train", unit="step") as bar:
        for step in range(1000):
            ...
            bar.update(1, loss=f"{loss:.3f}")
            if step % 50 == 0:
                bar.write(step_line(...))   # a log line above the bar; the bar is redrawn under it

One line, redrawn in place with ``\\r`` at most every ``min_interval`` seconds (and always at the end)::

    train [##########--------------------]  340/1000  34.0% | 2.91 step/s | ETA 03:47, loss=3.412

``Progress`` is a thin layer over ``tqdm.tqdm``: it fixes the bar's look (the format above, the same for every
bar of a run), decides when a bar is drawn at all, and keeps the log lines and the bar apart. ``EvalBar``
follows an evaluation that runs inside the workers: fed the coordinator's reports (batches done on rank 0,
polled by the trainer while it waits), it draws ``eval`` (or ``final eval``) over the eval batches in place of
the training bar, and erases itself when the eval is over (its ``[V]`` line follows).

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

from tqdm import tqdm


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


def format_duration(seconds: Optional[float]) -> str:
    """H:MM:SS above an hour, else M:SS; '?' when unknown."""
    if seconds is None or seconds != seconds or seconds < 0 or seconds == float("inf"):
        return "?"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """A one-line progress bar on ``stream`` (default stderr) for ``total`` units (None: unknown total,
    count and rate only), ``width`` characters of bar. ``clock`` (seconds) is injectable for tests: it becomes
    the bar's time source. See the module docstring for when it is off."""

    def __init__(self, total: Optional[int], desc: str = "", unit: str = "it", *, stream: Optional[TextIO] = None,
                 enabled: bool = True, width: int = 30, min_interval: float = 0.1, initial: int = 0,
                 clock: Callable[[], float] = time.monotonic):
        self.total = total if total is None else max(int(total), 0)
        self.desc, self.unit, self.width = desc, unit, width
        self.stream = sys.stderr if stream is None else stream
        self.enabled = progress_enabled(self.stream, enabled)
        self.closed = False
        self._postfix = ""
        self._bar = None
        if self.enabled:
            # smoothing=0: the rate (and ETA) is the average since the start, steady across evals and saves
            self._bar = tqdm(total=self.total, desc=desc, unit=f" {unit}", initial=int(initial), file=self.stream,
                             mininterval=min_interval, miniters=1, ascii="-#", dynamic_ncols=False, smoothing=0,
                             position=0,  # one line: an eval bar takes the training bar's place, not a new row
                             bar_format=self._format())
            self._bar._time = clock  # tqdm reads time through this attribute (its own tests swap it the same way)
            self._bar.start_t = self._bar.last_print_t = clock()
        self.n = int(initial)
        self.start_n = int(initial)
        self.clock = clock
        self.start = clock()

    def _format(self) -> str:
        head = "{desc} " if self.desc else ""
        if self.total:
            digits = len(str(self.total))
            return (head + "[{bar:%d}] {n_fmt:>%d}/{total_fmt} {percentage:5.1f}%% | {rate_noinv_fmt} | "
                    "ETA {remaining}{postfix}") % (self.width, digits)
        return head + "{n_fmt}{unit} | {rate_noinv_fmt} | elapsed {elapsed}{postfix}"

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
        """The bar line as it would be drawn now (without ``\\r``; "" when the bar is off)."""
        return "" if self._bar is None else str(self._bar)

    # ------------------------------------------------------------------ drawing
    def clear(self) -> None:
        """Erase the drawn line (the bar stays open: the next update or write draws it again)."""
        if self._bar is not None and not self.closed:
            self._bar.clear()

    def update(self, n: int = 1, **postfix) -> None:
        """Advance by ``n`` units; keyword arguments are shown after the bar (``loss=3.41``)."""
        self.n += n
        if postfix:
            self.set_postfix(**postfix)
        if self._bar is not None and not self.closed:
            self._bar.update(n)

    def set_postfix(self, **postfix) -> None:
        """Replace the text after the bar (key=value pairs)."""
        self._postfix = " ".join(f"{k}={v}" for k, v in postfix.items())
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix, refresh=False)

    def write(self, line: str) -> None:
        """Print ``line`` (a log line) above the bar; with the bar off, just print it to the stream."""
        if self._bar is not None and not self.closed:
            self._bar.clear()
            self.stream.write(line + "\n")
            self._bar.refresh()
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self, leave: bool = True) -> None:
        """Draw the final state and end the line; ``leave=False``: erase the bar instead (idempotent)."""
        if self.closed:
            return
        if self._bar is not None:
            self._bar.leave = leave
            self._bar.close()
            self.stream.flush()
        self.closed = True

    def __enter__(self) -> "Progress":
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
                                stream=self.stream, clock=self.clock, min_interval=0.0)
        self.bar.update(report["done"] - self.bar.n)

    def end(self) -> None:
        """The eval is over: erase its bar (idempotent)."""
        if self.bar is not None:
            self.bar.close(leave=False)
            self.bar = None
