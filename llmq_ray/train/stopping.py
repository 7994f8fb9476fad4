"""How a run stops before its last step: a request (``request_stop()``, SIGTERM / SIGINT / SIGHUP through
llmq_ray/train/stop_signals.py, a drain notice) ends it after the step under way with a checkpoint of the last
step, a second signal abandons that checkpoint, and the log's "end" record says which; the exit codes are
``EXIT_CODES``'.

``RunStopping`` is a base class of ``LLMQTrainer`` (llmq_ray/train/trainer.py); the trainer's state stays one
object.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from typing import Optional

from llmq_ray import storage
from llmq_ray.train.configure import _absolute


class RunStopping:
    """The part of ``LLMQTrainer`` the module docstring describes; its attributes are the LLMQTrainer's."""

    @property
    def stop_requested(self) -> bool:
        """True once ``request_stop()`` was called or a stop signal arrived (custom loops poll this)."""
        return self._stop_requested.is_set()

    def request_stop(self, signum: Optional[int] = None) -> None:
        """Ask the run to stop after the step under way: ``fit()`` then writes a checkpoint of it (unless
        ``checkpoint_on_exit=False``), the log's "stopped" record, and returns with ``Result.stopped``. Safe to
        call from another thread or a signal handler (it only sets a flag and tells the coordinator from a
        helper thread). In a step-level loop, ``train_step()`` returns None from then on; call ``stop()``."""
        if self._stop_signal is None:
            self._stop_signal = signum  # a signal after request_stop() still sets the exit code
        self._stop_requested.set()  # wakes the notifier thread (started with the coordinator): no work here

    def _notify_coordinator_on_stop(self) -> None:
        """Daemon thread: when a stop is requested, tell the coordinator (in its probe group, beside a running
        step) so that a queued step is not started. A thread of its own, started before any signal can come,
        because a signal handler must not start threads or call Ray."""
        from llmq_ray.actors.worker import PROBE_GROUP

        while not self._stop_requested.wait(0.5):
            if self.coordinator is None:
                return  # the run ended without a stop
        coordinator = self.coordinator
        if coordinator is not None:
            try:
                coordinator.request_stop.options(concurrency_group=PROBE_GROUP).remote()
            except Exception:  # noqa: BLE001 - the coordinator may be gone; the driver stops anyway
                pass

    def stop(self) -> dict:
        """Stop now: a checkpoint of the last completed update (unless ``checkpoint_on_exit=False`` or it
        exists already), the log's "end" record (reason "stopped"), the workers shut down. Returns
        {"signal" (name, or "request_stop()"), "step", "checkpoint" (path or None), "written", "exit_code"
        (128 + the signal number; 0 for request_stop()), "line" (also printed to stderr)}."""
        from llmq_ray.train.stop_signals import EXIT_CODE_REQUEST, EXIT_CODES, signal_name

        self._stop_requested.set()
        name = self._stop_reason or signal_name(self._stop_signal)
        info = {"step": self._steps_done, "checkpoint": None, "written": False, "note": ""}
        if self.coordinator is not None:
            info = self._get(self.coordinator.stop.remote(name, self.settings.checkpoints.checkpoint_on_exit), "stop")
            self._ended = True
        ckpt = info["checkpoint"]
        if ckpt:
            what = (f"checkpoint {os.path.basename(ckpt)} written" if info["written"]
                    else f"checkpoint {os.path.basename(ckpt)} (written before)")
            tail = f"{what} in {os.path.dirname(ckpt)}; resume with --continue"
        else:
            tail = f"no checkpoint ({info['note'] or 'none asked for'})"
        line = f"stopped by {name} after step {info['step']}; {tail}"
        code = EXIT_CODES.get(self._stop_signal, EXIT_CODE_REQUEST) if self._stop_signal else EXIT_CODE_REQUEST
        self._stopped = {"signal": name, "step": info["step"], "checkpoint": ckpt, "written": info["written"],
                         "exit_code": code, "line": line}
        self._say(line, sys.stderr)
        self.close()
        return self._stopped

    def _abandon(self, signum: int) -> dict:
        """A second stop signal: kill the actors at once (a checkpoint being written is left as a temporary
        folder, which no reader takes for a checkpoint; the previous one stays valid), write the log's "end"
        record from here, and report it."""
        import ray

        from llmq_ray.train.stop_signals import EXIT_CODES, signal_name

        first = signal_name(self._stop_signal)
        step = self._steps_done
        if self.coordinator is not None:
            try:
                ray.kill(self.coordinator)  # its workers and placement group go with it
            except Exception:  # noqa: BLE001
                pass
            self.coordinator = None
        if self._stopped is not None:  # the stop had completed (a second signal while closing): it stands
            return self._stopped
        from llmq_ray.checkpoints.layout import CheckpointWarning
        from llmq_ray.checkpoints.verify import find_latest_valid

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CheckpointWarning)
            try:
                newest = find_latest_valid(self.checkpoint_dir, verify_checksums=False)
            except Exception:  # noqa: BLE001 - a report, not a reason to fail now
                newest = None
        valid = (f"the newest valid checkpoint is {os.path.basename(newest)}" if newest
                 else "there is no valid checkpoint")
        note = (f"a second {signal_name(signum)} abandoned the stop (a checkpoint being written is left as a "
                f"temporary folder, never taken for a checkpoint); {valid}")
        self._append_end({"reason": "stopped", "signal": first, "step": step, "checkpoint": None,
                          "checkpoint_written": False, "note": note})
        line = f"stopped by {first} after step {step}; {note}" + ("; resume with --continue" if newest else "")
        self._say(line, sys.stderr)
        return {"signal": first, "step": step, "checkpoint": None, "written": False,
                "exit_code": EXIT_CODES.get(self._stop_signal or signum, 128 + signum), "line": line}

    def _log_path(self) -> str:
        return _absolute(self.settings.observe.log_file or storage.join(self.settings.observe.out_dir, "log.jsonl"))

    def _append_end(self, fields: dict) -> None:
        """Write the "end" record into the log file from the driver (the coordinator is gone)."""
        if self._ended:
            return
        self._ended = True
        path = self._log_path()
        try:
            there = storage.size_of(path) is not None if storage.is_remote(path) else os.path.isfile(path)
        except OSError:  # the store is gone too: nothing more to do
            return
        if not there or (self.info is None and not self.resume_from):
            return  # this run never wrote its log (a file there is an earlier run's): nothing to end
        from llmq_ray.observe.runlog import append_records

        try:
            append_records(path, [{"log": "end", **fields}])
        except (OSError, ValueError):
            pass

    def _end_failed(self, error: str) -> None:
        """The log's "end" record of a run that failed (through the coordinator while it lives)."""
        if self._ended:
            return
        if self.coordinator is not None:
            import ray

            try:
                ray.get(self.coordinator.end.remote("failed", error=error), timeout=30)
                self._ended = True
                return
            except Exception:  # noqa: BLE001 - the coordinator failed too: write it from here
                pass
        self._append_end({"reason": "failed", "step": self._steps_done, "error": error})

    def stop_on_signals(self):
        """Context manager for step-level loops: SIGTERM / SIGINT / SIGHUP call ``request_stop()`` while it is
        active (``fit()`` uses it too)::

            with t.stop_on_signals():
                for _ in range(n):
                    if t.train_step() is None:   # a stop was requested
                        break
                if t.stop_requested:
                    t.stop()                     # checkpoint, "stopped" record, workers shut down
        """
        return self._stop_signals(True)

    @contextlib.contextmanager
    def _stop_signals(self, enabled: bool):
        from llmq_ray.train.stop_signals import SignalStop

        if not enabled or self._signals is not None:
            yield
            return
        self._signals = SignalStop(self.request_stop)
        self._signals.install()
        try:
            yield
        finally:
            self._signals.restore()
            self._signals = None
