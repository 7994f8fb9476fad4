"""Run logs: llm.q-shaped console lines and the JSON log.

Console (one line per optimizer step, one per eval)::

    [T] step    12 [ 12.0%] | time:   183 ms | norm   1.2345 | loss   6.1234 | tps   44.8k | sol  45.1%
    [V] step    50 [ 50.0%] | time:  1204 ms | eval loss   5.4321 | batches 8

JSON log: a list of records, each a dict with a "log" key naming its kind, in the order they happened:
"options" (all run options), "gpu" (one per rank: device, name, memory table), "sol" (FLOPs/token,
peaks), "dataset" (files, token counts), "allocator" (memory table of rank 0), "step" (per optimizer
step), "eval", "checkpoint" (one per checkpoint written), "resume" (the checkpoint a run started from, or went
back to after a restart), "warning" (a skipped update, a loss or grad-norm spike, a skipped checkpoint;
with a "kind"), "failure" and "restart" (a worker died or hung and the group was rebuilt), "summary". ``RunLog.flush()`` writes the whole list to a temporary file in the same folder and renames
it over the log, so a reader (or a crash) never sees a half-written file.
"""

from __future__ import annotations

import json
import math
import os
from typing import Optional


def _num(x: Optional[float], width: int, prec: int) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return f"{'nan' if x is not None else '-':>{width}}"
    return f"{x:{width}.{prec}f}"


def _tps(x: float) -> str:
    if x >= 1e6:
        return f"{x / 1e6:6.2f}M"
    if x >= 1e3:
        return f"{x / 1e3:6.1f}k"
    return f"{x:7.0f}"


def step_line(step: int, total: int, seconds: float, norm: float, loss: float, tps: float,
              sol: Optional[float], skipped: "bool | str" = False) -> str:
    """``[T]`` line of 0-based ``step`` of ``total``; ``sol`` is a fraction or None; ``skipped``: True or the
    reason the update was skipped."""
    pct = 100.0 * (step + 1) / max(total, 1)
    sol_s = f"{100 * sol:5.1f}%" if sol is not None else "    -"
    reason = skipped if isinstance(skipped, str) else "non-finite gradient"
    tail = f" | SKIPPED ({reason})" if skipped else ""
    return (f"[T] step {step + 1:5d} [{pct:5.1f}%] | time: {1000 * seconds:6.0f} ms | norm {_num(norm, 8, 4)} | "
            f"loss {_num(loss, 8, 4)} | tps {_tps(tps)} | sol {sol_s}{tail}")


def eval_line(step: int, total: int, seconds: float, loss: float, batches: int, final: bool = False) -> str:
    pct = 100.0 * step / max(total, 1)
    what = "final eval loss" if final else "eval loss"
    return (f"[V] step {step:5d} [{pct:5.1f}%] | time: {1000 * seconds:6.0f} ms | {what} {_num(loss, 8, 4)} | "
            f"batches {batches}")


def warning_line(step: Optional[int], message: str) -> str:
    """``[!]`` line of a warning (a skipped update, a spike, a skipped checkpoint, a restart)."""
    where = f"step {step:5d}" if step is not None else "run"
    return f"[!] {where} | {message}"


def checkpoint_line(step: int, path: str, seconds: float) -> str:
    """``[C]`` line of a checkpoint written (or loaded) at ``step`` (updates completed)."""
    return f"[C] step {step:5d} | time: {1000 * seconds:6.0f} ms | checkpoint {path}"


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary sibling and os.replace (never half-written)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_json(path: str, obj) -> None:
    """Write ``obj`` as JSON to ``path`` atomically (``atomic_write_text``)."""
    atomic_write_text(path, json.dumps(obj, indent=1, default=_json_default) + "\n")


def _json_default(o):
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    return str(o)


class RunLog:
    """The JSON log of one run: ``add(kind, **fields)`` appends a record; ``flush()`` rewrites the file
    atomically (called at set-up, after each eval, every ``flush_every`` steps and at the end)."""

    def __init__(self, path: Optional[str], flush_every: int = 50):
        self.path = os.path.abspath(path) if path else None
        self.records: list[dict] = []
        self.flush_every = flush_every
        self._since_flush = 0
        self.listeners: list = []  # callables fed every new record (e.g. the live W&B logger)

    def add(self, kind: str, /, **fields) -> dict:
        rec = {"log": kind, **fields}
        self.records.append(rec)
        for listener in self.listeners:
            listener(rec)
        self._since_flush += 1
        if kind == "step" and self._since_flush >= self.flush_every:
            self.flush()
        return rec

    def flush(self) -> None:
        if self.path is not None:
            atomic_write_json(self.path, self.records)
        self._since_flush = 0
