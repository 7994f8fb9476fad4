"""One run at a time per output folder: OS file locks the driver holds while its run may write there.

Why: two runs started into the same ``--out-dir`` or checkpoint folder (a command typed twice, a scheduler's retry
while the first run still goes, a second run naming the first one's out-dir/ckpt as its ``--checkpoint-dir``) set
each other's log, export and checkpoints aside, then write, prune and resume from one checkpoint folder: the runs'
work mixes or is pruned away. The driver of a run takes a lock for each local output folder when the run starts
(``LLMQTrainer.start()``, before Ray and before it moves anything) and gives them back when the run ends
(``close()``); a second run finds one held and is refused in one sentence before it touches anything.

Where the lock files live: ``<out-dir>/.llmq-run.lock`` inside the out-dir (never moved), and
``<parent>/.<name>.llmq-run.lock`` beside the checkpoint folder ``<parent>/<name>``, because a fresh run moves an
earlier run's default checkpoint folder aside as a whole and a lock file inside would move with it.

The locks are ``filelock``'s (``fcntl.flock`` on Linux, no fallback to a lock file's mere existence): the operating
system drops them when the process ends, so a crashed or killed run leaves no stale lock (only an empty file,
which means nothing; a run that ends normally removes its files). Two trainers of one process are refused as well
(each lock is an open file description of its own). Local folders only, on file systems with OS locks: an object
store has none, and runs there are not guarded (docs/stopping-and-resuming.md).
"""

from __future__ import annotations

import os

from llmq_ray.errors import ConfigError

LOCK_NAME = ".llmq-run.lock"


def lock_inside(folder: str) -> str:
    """The lock file of an out-dir: ``<folder>/.llmq-run.lock``."""
    return os.path.join(os.path.abspath(folder), LOCK_NAME)


def lock_beside(folder: str) -> str:
    """The lock file of a checkpoint folder, which may be moved as a whole: ``<parent>/.<name>.llmq-run.lock``."""
    parent, name = os.path.split(os.path.abspath(folder).rstrip(os.sep) or os.sep)
    return os.path.join(parent, f".{name}{LOCK_NAME}")


def _os_lock(file_lock, path: str):
    """A filelock lock on ``path``: an OS lock only (filelock 4 could fall back to a lock file's mere existence,
    which a crash would leave behind), released from whichever thread closes the run. An older filelock (3.x,
    e.g. a GPU machine's torch environment) lacks these keywords and takes OS locks only anyway."""
    try:
        return file_lock(path, is_singleton=False, thread_local=False, fallback_to_soft=False)
    except TypeError:
        return file_lock(path)


class RunLock:
    """The locks of one run's local output folders, taken together (all or none) and released together."""

    def __init__(self) -> None:
        self._held = []  # (filelock.FileLock acquired, (st_dev, st_ino) of its file)

    @property
    def held(self) -> bool:
        return bool(self._held)

    def acquire(self, entries: list[tuple[str, str, str]]) -> None:
        """Take each (lock file, folder, flag) without waiting (the lock file's folder is made if missing).
        Raises ConfigError naming the flag and folder if another run holds one; then none is held."""
        from filelock import FileLock, Timeout

        try:
            for path, folder, flag in entries:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                lock = _os_lock(FileLock, path)
                try:
                    lock.acquire(timeout=0)
                except Timeout:
                    raise ConfigError(f"{flag}={folder} is in use by another llmq-ray run (it holds {path}); "
                                      f"wait for that run to end, or pass another {flag}.") from None
                except (OSError, NotImplementedError):
                    continue  # a file system without OS locks: this folder is not guarded
                st = os.stat(path)
                self._held.append((lock, (st.st_dev, st.st_ino)))
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Give the locks back, removing each lock file while still holding it -- if the path is still the file
        locked (a folder removed and made again meanwhile holds another run's) -- so that a run starting meanwhile
        either fails on the held lock or makes a new file."""
        for lock, ident in reversed(self._held):
            try:
                st = os.stat(lock.lock_file)
                if (st.st_dev, st.st_ino) == ident:
                    os.unlink(lock.lock_file)
            except OSError:
                pass
            lock.release(force=True)
        self._held = []
