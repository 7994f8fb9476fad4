"""The one test hook of the Ray runtime: faults injected into a worker on purpose, to test that llmq-ray survives
them. Nothing here runs in a real run: ``FaultInjector(None, rank)`` does nothing at every point.

Tests put ``{"rank": r, "step": s, "kind": k, ...}`` (or a list of such dicts) as JSON into the environment variable
``LLMQ_RAY_TEST_FAULT`` (``ENV``) of the driver, which the trainer reads when the run starts into ``RunPlan.fault``
(no public API takes it); rank r's worker then calls the injector at four points of its work:

=============  ==========================  ============================================================
point          kind                        what happens on rank r
=============  ==========================  ============================================================
before_step    ``raise`` (the default)     a RuntimeError at the start of 0-based step s
before_step    ``kill``                    SIGKILL of the worker process at step s (as from the OOM killer)
before_step    ``hang``                    blocks forever at step s, without holding the GIL (a stuck read)
before_step    ``slow_step``               sleeps ``seconds`` at the start of every step >= s (a slow run, so
                                           that a test can kill it mid-run)
before_update  ``nan``                     a NaN in its gradients at step s (must never reach the weights)
saving         ``save_full``               the checkpoint of step s (updates completed) fails as on a full disk
saving         ``save_kill``               SIGKILL halfway through writing its file of the checkpoint of step s
after_saving   ``save_slow``               sleeps ``seconds`` after writing its file of every checkpoint of a
                                           step >= s, before the manifest exists (a slow disk)
uploading      ``upload_slow``             sleeps ``seconds`` on the background upload thread before uploading
                                           its shard of every checkpoint of a step >= s (a slow network)
uploading      ``upload_fail``             the background upload of its shard of the first checkpoint of a
                                           step >= s fails as if the bucket went away (once)
eval_batch     ``slow_eval``               sleeps ``seconds`` before each eval batch (any step)
=============  ==========================  ============================================================

A fault fires in the first group of workers; ``"group": g`` makes it fire in the group started by the g-th
restart instead (one run can then fail in two ways one after the other), and ``"every_group": True`` in every
group. ``next_group_faults`` is what the coordinator keeps in the plan when it restarts the group.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from typing import Optional

KINDS = ("raise", "kill", "hang", "slow_step", "nan", "save_full", "save_kill", "save_slow", "upload_slow",
         "upload_fail", "slow_eval")
ENV = "LLMQ_RAY_TEST_FAULT"  # the fault dict as JSON, for runs started as a command (tests only)


def _as_list(spec) -> list:
    return spec if isinstance(spec, list) else [spec] if spec else []


def next_group_faults(spec):
    """The faults of ``spec`` (``RunPlan.fault``) that the group after a restart gets: those of every group, and
    those of a later group (counted from the new one). None when no fault is left."""
    specs = _as_list(spec)
    kept = [f for f in specs if f.get("every_group")]
    kept += [dict(f, group=int(f["group"]) - 1) for f in specs if not f.get("every_group") and int(f.get("group", 0)) > 0]
    return kept or None


class FaultInjector:
    """The faults of ``spec`` (``RunPlan.fault``: a dict, a list of such dicts, or None) that concern worker
    ``rank``."""

    def __init__(self, spec, rank: int):
        self.specs = [dict(f) for f in _as_list(spec) if int(f.get("rank", -1)) == rank
                      and (f.get("every_group") or int(f.get("group", 0)) == 0)]
        self.rank = rank
        self._upload_failed = False
        for f in self.specs:
            if f.get("kind", "raise") not in KINDS:
                raise ValueError(f"fault kind {f.get('kind')!r} is not one of {KINDS}")

    def _is(self, kind: str, step: Optional[int] = None, from_step: Optional[int] = None) -> Optional[dict]:
        """The fault of ``kind`` at exactly ``step`` (or, with ``from_step``, at any step >= its own), or None."""
        for f in self.specs:
            if f.get("kind", "raise") != kind:
                continue
            if step is not None and int(f.get("step", -1)) != step:
                continue
            if from_step is not None and from_step < int(f.get("step", 0)):
                continue
            return f
        return None

    def before_step(self, step: int) -> None:
        if self._is("raise", step):
            raise RuntimeError(f"injected fault at step {step} (test hook)")
        if self._is("kill", step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self._is("hang", step):
            threading.Event().wait()
        slow = self._is("slow_step", from_step=step)
        if slow:
            time.sleep(float(slow.get("seconds", 1.0)))

    def before_update(self, step: int, grads) -> None:
        """``grads``: the gradient tensor the update reads (its first element becomes NaN)."""
        if self._is("nan", step):
            grads[0] = float("nan")

    def saving(self, tmp_dir: str, step: int, file_name: str) -> None:
        """Before this rank writes ``file_name`` into the checkpoint folder ``tmp_dir``."""
        if self._is("save_full", step):
            import llmq_ray.checkpoints.local as ck

            def full_disk(*args, **kwargs):
                raise OSError(errno.ENOSPC, "No space left on device")

            ck._save_tensors = full_disk  # this process's disk is full from now on
        if self._is("save_kill", step):
            with open(os.path.join(tmp_dir, file_name), "wb") as f:
                f.write(b"\0" * 1000)
                f.flush()
                os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)

    def after_saving(self, step: int) -> None:
        slow = self._is("save_slow", from_step=step)
        if slow:
            time.sleep(float(slow.get("seconds", 60.0)))

    def uploading(self, step: int) -> None:
        """On the worker's background upload thread, before it uploads its shard of the checkpoint of ``step``."""
        slow = self._is("upload_slow", from_step=step)
        if slow:
            time.sleep(float(slow.get("seconds", 60.0)))
        if self._is("upload_fail", from_step=step) and not self._upload_failed:
            self._upload_failed = True  # once: the first checkpoint at or after step s (one may have been deferred)
            raise OSError("AWS Error NO_SUCH_BUCKET during PutObject operation: The specified bucket "
                          "does not exist (injected by the test hook)")

    def eval_batch(self) -> None:
        slow = self._is("slow_eval")
        if slow:
            time.sleep(float(slow.get("seconds", 0.0)))
