"""One run at a time per output folder: an OS file lock the driver holds while its run may write there.

Why: two runs started into the same ``--out-dir`` or ``--checkpoint-dir`` (a command typed twice, a scheduler's
retry while the first run still goes) each set the other's log, export and checkpoints aside, then write, prune
and resume from one checkpoint folder: the runs' work mixes or is pruned away. The driver of a run takes
``<folder>/.llmq-run.lock`` for each local output folder when the run starts (``LLMQTrainer.start()``, before it
moves anything) and gives it back when the run ends (``close()``); a second run finds it held and is refused in
one sentence before it touches anything.

The lock is ``filelock``'s (``fcntl.flock`` on Linux): the operating system drops it when the process ends, so a
crashed or killed run never leaves a stale lock (only its empty lock file, which means nothing; a run that ends
normally removes it). Two trainers of
one process are refused as well (each lock is an open file description of its own). Local folders only, on file
systems with OS locks: an object store has none, and runs there are not guarded (docs/stopping-and-resuming.md).
"""

from __future__ import annotations

import os

from llmq_ray.errors import ConfigError

LOCK_NAME = ".llmq-run.lock"


class RunLock:
    """The locks of one run's local output folders, taken together (all or none) and released together."""

    def __init__(self) -> None:
        self._held = []  # filelock.FileLock objects, acquired

    @property
    def held(self) -> bool:
        return bool(self._held)

    def acquire(self, folders: list[tuple[str, str]]) -> None:
        """Take ``<folder>/.llmq-run.lock`` for each (folder, flag) without waiting (the folders are made if
        missing; the same folder twice is locked once). Raises ConfigError naming the flag if another run holds
        one; then none is held."""
        from filelock import FileLock, Timeout

        seen = set()
        try:
            for folder, flag in folders:
                folder = os.path.abspath(folder)
                if folder in seen:
                    continue
                seen.add(folder)
                os.makedirs(folder, exist_ok=True)
                path = os.path.join(folder, LOCK_NAME)
                # an OS lock only (no fallback to a lock file's mere existence, which a crash would leave behind);
                # released from whichever thread closes the run
                lock = FileLock(path, is_singleton=False, thread_local=False, fallback_to_soft=False)
                try:
                    lock.acquire(timeout=0)
                except Timeout:
                    raise ConfigError(f"{flag}={folder} is in use by another llmq-ray run (it holds {path}); "
                                      f"wait for that run to end, or pass another {flag}.") from None
                except (OSError, NotImplementedError):
                    continue  # a file system without OS locks: this folder is not guarded
                self._held.append(lock)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Give the locks back, removing each lock file while still holding it (a run that starts meanwhile
        either fails on the held lock or makes a new file; only a crash leaves the empty file behind)."""
        for lock in reversed(self._held):
            try:
                os.unlink(lock.lock_file)
            except OSError:
                pass
            lock.release(force=True)
        self._held = []
