"""Turning what goes wrong in a worker into one clear sentence, and never waiting forever for one.

``gather(refs, timeout_s, what)`` waits on the refs of one call per rank. It returns as soon as all are done,
and raises as soon as *any* of them failed: when one rank raises, the others are typically blocked in a
collective waiting for it, so waiting for all of them would hang until the collective's own timeout.

Errors are re-raised as ``WorkerError`` (an ``LLMQError``) naming the rank and the last line of the
original error; a user error raised inside a worker (``ConfigError``, ``DataError``, ``CheckpointError``)
keeps its type, with "rank r: " in front of its message.
"""

from __future__ import annotations

import time

from llmq_ray.errors import LLMQError


class WorkerError(LLMQError, RuntimeError):
    """A worker actor raised, died, or did not answer in time (the message names the rank)."""


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def wrap_error(exc: BaseException, rank: int | None, what: str) -> LLMQError:
    """The LLMQError to raise for ``exc`` coming out of rank ``rank``'s ``what`` call."""
    import ray.exceptions as rex

    where = f"rank {rank}" if rank is not None else "the coordinator"
    cause = exc
    if isinstance(exc, rex.RayTaskError):
        cause = exc.cause if getattr(exc, "cause", None) is not None else exc
    if isinstance(cause, LLMQError):
        if isinstance(cause, WorkerError) or str(cause).startswith("rank "):
            return cause
        msg = str(cause.args[0]) if cause.args else str(cause)
        try:
            return type(cause)(f"{where}: {msg}")
        except Exception:  # noqa: BLE001 - an exotic subclass signature
            return WorkerError(f"{where}: {msg}")
    if isinstance(cause, rex.RayActorError) or isinstance(exc, rex.RayActorError):
        return WorkerError(f"{where} died during {what} (its process exited or was killed: "
                           f"{_last_line(str(exc)) or 'no details'}); see the Ray logs of that actor.")
    if isinstance(cause, rex.GetTimeoutError):
        return WorkerError(f"{where} did not finish {what} in time.")
    return WorkerError(f"{where} failed in {what}: {type(cause).__name__}: {_last_line(str(cause))}")


def gather(refs: list, timeout_s: float, what: str) -> list:
    """ray.get of one ref per rank (index = rank), failing fast on the first error, bounded by timeout_s."""
    import ray

    index = {ref: rank for rank, ref in enumerate(refs)}
    results: dict = {}
    pending = list(refs)
    deadline = time.monotonic() + timeout_s
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            ranks = sorted(index[r] for r in pending)
            raise WorkerError(f"rank(s) {ranks} did not finish {what} within {timeout_s:.0f} s "
                              f"(a hung collective or a dead node?); the run was stopped.")
        ready, pending = ray.wait(pending, num_returns=1, timeout=min(left, 5.0))
        for ref in ready:
            try:
                results[index[ref]] = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - everything is wrapped into one sentence
                raise wrap_error(exc, index[ref], what) from None
    return [results[r] for r in range(len(refs))]
