"""Stopping a run on SIGTERM, SIGINT (Ctrl-C) or SIGHUP without losing its work.

Schedulers (Slurm, Kubernetes, ``ray job stop``, spot preemption) end a job with SIGTERM and, a grace period
later, SIGKILL. While ``SignalStop`` is active (``LLMQTrainer.fit`` holds it in the main thread) the first of
these signals only *requests* a stop: the step running on the workers finishes, the coordinator writes a
checkpoint of it and the log's "end" record, the workers are shut down, and the CLI exits with
``EXIT_CODES[signal]`` (128 + the signal number: 143 for SIGTERM, 130 for SIGINT, 129 for SIGHUP). A second
signal while that is under way raises ``StopForced`` in the main thread: the driver then kills the actors at
once, which abandons a checkpoint being written (its temporary folder is never mistaken for a checkpoint) and
leaves the previous one valid.

Why our own handlers: ``ray.init`` replaces SIGTERM's handler with one that raises SystemExit wherever the
main thread happens to be (inside ``ray.get``, it dies with a C++ stack dump and no checkpoint), so
``install()`` is called again after Ray is initialised. The handlers are restored when the block ends. A
signal that is ignored when the block starts stays ignored (SIGHUP under ``nohup``). In a thread other than
the main one Python cannot install handlers; ``request_stop()`` still works there.
"""

from __future__ import annotations

import signal
import threading
from typing import Callable, Optional

STOP_SIGNALS = tuple(s for s in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGHUP", None)) if s is not None)
EXIT_CODES = {int(s): 128 + int(s) for s in STOP_SIGNALS}
EXIT_CODE_REQUEST = 0  # a stop asked for through the API ends like a finished run


class StopForced(KeyboardInterrupt):
    """A second stop signal arrived while the run was stopping: abandon the stop at once.

    A KeyboardInterrupt, because that is the one exception ``ray.get`` lets out of a signal handler that
    runs while it waits (it re-raises it as a plain KeyboardInterrupt: ``SignalStop.forced`` tells the two
    apart)."""

    def __init__(self, signum: int):
        super().__init__(f"a second {signal.Signals(signum).name} while stopping")
        self.signum = signum


def signal_name(signum: Optional[int]) -> str:
    return signal.Signals(signum).name if signum is not None else "request_stop()"


class SignalStop:
    """While active, the first stop signal calls ``on_first(signum)``; later ones raise ``StopForced``.

    ``on_first`` must be quick and must not block (it runs in the main thread between two bytecodes, maybe
    inside ``ray.get``): the trainer's sets a flag and wakes a thread that tells the coordinator."""

    def __init__(self, on_first: Callable[[int], None]):
        self.on_first = on_first
        self.received: Optional[int] = None   # the first stop signal
        self.forced: Optional[int] = None     # a second one: the stop is abandoned
        self._previous: dict[int, object] = {}
        self.active = False

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        if self.received is None:
            self.received = signum
            self.on_first(signum)
        else:
            self.forced = signum
            raise StopForced(signum)

    def install(self) -> bool:
        """(Re-)install the handlers (again after ``ray.init`` replaced SIGTERM's); False off the main thread."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for s in STOP_SIGNALS:
            current = signal.getsignal(s)
            if current is signal.SIG_IGN:
                continue  # ignored on purpose (SIGHUP under nohup): a closed terminal must not stop the run
            if current is not self._handle:
                self._previous.setdefault(int(s), current)
                signal.signal(s, self._handle)
        self.active = True
        return True

    def restore(self) -> None:
        """Put back the handlers that were there before ``install()``."""
        if not self.active or threading.current_thread() is not threading.main_thread():
            return
        for s, handler in self._previous.items():
            try:
                signal.signal(s, handler if handler is not None else signal.SIG_DFL)
            except (TypeError, ValueError):
                signal.signal(s, signal.SIG_DFL)
        self._previous.clear()
        self.active = False
