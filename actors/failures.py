"""Turning what goes wrong in a worker into one clear sentence, and never waiting forever for one.

``gather(refs, timeout_s, what)`` waits on the refs of one call per rank. It returns as soon as all are done,
and raises as soon as *any* of them failed: when one rank raises, the others are typically blocked in a
collective waiting for it, so waiting for all of them would hang until the collective's own timeout.

Errors are re-raised as ``WorkerError`` (an ``LLMQError``) naming the rank and the last line of the
original error; a user error raised inside a worker (``ConfigError``, ``DataError``, ``CheckpointError``)
keeps its type, with "rank r: " in front of its message.

Hangs. When one rank hangs, its peers block in the next collective waiting for it, so "which ranks have
not answered" names them all, and the first error to come back is a peer's collective timeout. Before
giving up on a step, ``gather`` can therefore ``explain`` the failure: the coordinator asks every rank
still running, and the rank that failed, where it is inside the step (``GPUWorker.activity``, which runs
concurrently with the step), and ``find_hung_ranks`` picks the rank(s) stuck *behind* the others (or not
answering at all) -- the one that hung, not the ones waiting for it.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from llmq_ray.errors import LLMQError
from llmq_ray.net import accepts_tcp


class WorkerError(LLMQError, RuntimeError):
    """A worker actor raised, died, or did not answer in time (the message names the rank)."""


class CoordinatorLost(WorkerError):
    """The coordinator actor died (its process or its node): the driver may start a new one."""


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
        err = WorkerError(f"{where} died during {what} (its process exited or was killed: "
                          f"{_last_line(str(exc)) or 'no details'}); see the Ray logs of that actor.")
        err.died_rank, err.during = rank, what  # the coordinator names the node when Ray reports it dead
        return err
    if isinstance(cause, rex.GetTimeoutError):
        return WorkerError(f"{where} did not finish {what} in time.")
    return WorkerError(f"{where} failed in {what}: {type(cause).__name__}: {_last_line(str(cause))}")


def gather(refs: list, timeout_s: float, what: str, explain: Optional[Callable] = None) -> list:
    """ray.get of one ref per rank (index = rank), failing fast on the first error, bounded by timeout_s.

    ``explain(pending, failed, error)``, when given, is asked before raising while some ranks are still
    running: ``pending`` their ranks, ``failed`` the rank whose error came back (None on the timeout),
    ``error`` the LLMQError about to be raised; it returns a better one to raise, or None."""
    import ray

    index = {ref: rank for rank, ref in enumerate(refs)}
    results: dict = {}
    pending = list(refs)
    deadline = time.monotonic() + timeout_s

    def fail(error: LLMQError, failed: Optional[int]):
        still = sorted(index[r] for r in pending if index[r] != failed)
        better = explain(still, failed, error) if explain is not None and still else None
        return better or error

    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            ranks = sorted(index[r] for r in pending)
            raise fail(WorkerError(f"rank(s) {ranks} did not finish {what} within {timeout_s:.0f} s "
                                   f"(a hung collective or a dead node?); the run was stopped."), None)
        ready, pending = ray.wait(pending, num_returns=1, timeout=min(left, 5.0))
        for ref in ready:
            try:
                results[index[ref]] = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - everything is wrapped into one sentence
                raise fail(wrap_error(exc, index[ref], what), index[ref]) from None
    return [results[r] for r in range(len(refs))]


def probe_activities(workers: list, ranks: list[int], timeout_s: float = 10.0, died: set | None = None) -> dict:
    """{rank: its ``GPUWorker.activity()`` dict, or None when it did not answer within timeout_s}. ``died``: a set
    that receives the ranks whose actor Ray reports dead (their process or node is gone: not a hang)."""
    import ray

    from llmq_ray.actors.worker import PROBE_GROUP

    refs = {r: workers[r].activity.options(concurrency_group=PROBE_GROUP).remote() for r in ranks}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    out: dict = {}
    for r, ref in refs.items():
        try:
            out[r] = ray.get(ref, timeout=0) if ref in ready else None
        except Exception as exc:  # noqa: BLE001 - a dead rank does not answer either
            out[r] = None
            if died is not None and isinstance(exc, ray.exceptions.RayActorError):
                died.add(r)
    return out


def dead_nodes_of(nodes: list, ranks: list[int]) -> list[int]:
    """The ranks among ``ranks`` whose node Ray reports dead (``nodes[rank]["node_id"]``, as placed). A rank that
    stopped answering there did not hang: its machine is gone, and the error says so."""
    import ray

    try:
        dead = {n["NodeID"] for n in ray.nodes() if not n.get("Alive", True)}
    except Exception:  # noqa: BLE001 - no cluster state (outside Ray): nothing is known to be dead
        return []
    return [r for r in ranks if r < len(nodes) and nodes[r].get("node_id") in dead]


# how long a step's failure waits for Ray to mark the node of a rank whose actor died as dead, so the error can
# say "node X died" rather than "rank r died": Ray's health check takes 5 x 3 s by default to give up on a raylet
NODE_DEATH_WAIT_S = 20.0


def _raylet_answers(node_id: str) -> bool:
    """Whether the raylet of ``node_id`` still accepts a TCP connection (1 s): a process that died on a live node
    leaves it answering; a lost machine does not."""
    import ray

    try:
        info = next(n for n in ray.nodes() if n["NodeID"] == node_id)
        return accepts_tcp(info["NodeManagerAddress"], int(info["NodeManagerPort"]), timeout_s=1.0)
    except (StopIteration, KeyError, ValueError):
        return False


def wait_for_dead_nodes(nodes: list, ranks: list[int], wait_s: float = NODE_DEATH_WAIT_S) -> list[int]:
    """``dead_nodes_of(nodes, ranks)``; while it is empty but the raylet of one of the ranks' nodes no longer
    answers, asked again every 0.5 s for up to ``wait_s`` (the ranks' actors are known to be dead; Ray marks
    their node dead some seconds later). A rank whose raylet answers died alone: no wait."""
    lost = dead_nodes_of(nodes, ranks)
    if lost or all(_raylet_answers(nodes[r].get("node_id")) for r in ranks if r < len(nodes)):
        return lost
    deadline = time.monotonic() + wait_s
    while True:
        lost = dead_nodes_of(nodes, ranks)
        if lost or time.monotonic() >= deadline:
            return lost
        time.sleep(0.5)


def find_hung_ranks(activities: dict, pending: list[int], failed: Optional[int]) -> list[int]:
    """The ranks to blame for a step that failed or did not finish, from ``probe_activities``.

    A pending rank that did not answer the probe has hung (a frozen process). Otherwise the blame goes to
    the pending ranks furthest behind -- with ``failed`` (a peer's error came back first, typically its
    collective timeout) only those behind the failed rank; without (the step timed out) the ones behind
    the other pending ranks, or all pending ranks when they all stand at the same point (a collective
    that hangs as a whole). [] when no pending rank is behind the failed one: its own error is the cause."""
    def position(a):
        return (a["step"] if a["step"] is not None else -1, a["at"])

    silent = [r for r in pending if activities.get(r) is None]
    answered = {r: position(activities[r]) for r in pending if activities.get(r) is not None}
    if failed is not None:
        ref = activities.get(failed)
        if ref is None:
            return silent
        return sorted(silent + [r for r, p in answered.items() if p < position(ref)])
    if silent or not answered:
        return silent
    low = min(answered.values())
    return sorted(r for r, p in answered.items() if p == low)
