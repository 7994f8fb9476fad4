"""Is a checkpoint whole? Sizes, sha256, coverage of the layout -- and, from those, the folder a run resumes
from (``find_latest_valid``, ``resolve_continue``).

Two levels of checking. The cheap one (``validate_checkpoint``): the manifest parses, the ranges tile the
layout, every file exists with its recorded size -- an incomplete folder is refused without reading a byte of
it. The full one (``verify_checkpoint``) then hashes every file against the manifest's sha256: a same-size
corruption (a flipped bit, a file replaced by one of equal size) of the newest checkpoint is skipped with a
warning by ``find_latest_valid`` instead of being picked and then failing the workers' load -- which, under a
wrapper that always passes --continue, would crash-loop. Hashing streams each file in 4 MiB reads on a thread
pool, one thread per file up to the usable cores (hashlib and file reads release the GIL): a checkpoint of N
rank files hashes about min(N, cores) times as fast as one by one. Retention and the restart path keep to the
cheap checks: they run after every save or restart, on checkpoints this run has just written and hashed, and a
restart's load still verifies what it reads (``local.load_checkpoint``).

A checkpoint on an object store is checked on the store (sizes) and, for the sha256, in this node's mirror
(``remote.fetch``). Imports point one way: this module uses layout.py and remote.py; local.py and retention.py
use it. No torch import.
"""

from __future__ import annotations

import hashlib
import os
import threading
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from llmq_ray import storage
from llmq_ray.checkpoints.layout import (CheckpointWarning, check_coverage, folder_exists, list_step_dirs,
                                         read_manifest, reason_of_os_error, step_dir)
from llmq_ray.checkpoints.remote import fetch
from llmq_ray.errors import CheckpointError

HASH_CHUNK = 1 << 22  # 4 MiB per read when hashing
_HASH_THREADS_MAX = 32  # beyond this many concurrent readers a disk only seeks more


# ---------------------------------------------------------------------------------------------------- hashing
def _stream_sha256(path: str, stop: threading.Event | None = None) -> tuple[int, str] | tuple[None, None]:
    """(size, sha256 hex) of a file, read in ``HASH_CHUNK`` pieces into one reused buffer (constant memory
    whatever the file's size); (None, None) when ``stop`` was set before the end (another file of the same
    checkpoint already failed, so finishing this one is wasted reading).

    Both the reads and ``hashlib``'s update of a large buffer release the GIL, so several of these run
    truly in parallel on a thread pool. The kernel is told the access is sequential (more read-ahead)."""
    h = hashlib.sha256()
    buf = bytearray(HASH_CHUNK)
    view = memoryview(buf)
    size = 0
    with open(path, "rb", buffering=0) as f:
        if hasattr(os, "posix_fadvise"):
            try:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            except OSError:  # not supported by this filesystem: only a hint
                pass
        while True:
            if stop is not None and stop.is_set():
                return None, None
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
            size += n
    return size, h.hexdigest()


def file_sha256(path: str) -> str:
    """sha256 (hex) of a file's bytes."""
    return _stream_sha256(path)[1]


def hash_workers(n_files: int) -> int:
    """Threads that hash ``n_files`` files at once: one per file, at most the CPUs this process may run on
    (sha256 is CPU-bound at 0.5-2 GB/s a core, so more threads than cores gain nothing) and at most 32
    (concurrent readers past that only make a disk seek). Always >= 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(int(n_files), cpus, _HASH_THREADS_MAX))


# ---------------------------------------------------------------------------------------------------- files
def _checksum_error(folder: str, path: str) -> CheckpointError:
    name = os.path.basename(os.path.normpath(folder))
    return CheckpointError(f"shard file {path} fails its sha256 checksum (the bytes changed after the "
                           f"checkpoint was written); checkpoint {name} is corrupt, resume from another one.")


def _size_error(folder: str, path: str, size: int, recorded: Any) -> CheckpointError:
    name = os.path.basename(os.path.normpath(folder))
    return CheckpointError(f"shard file {path} has {size} bytes, the manifest records {recorded}: it is "
                           f"truncated or was replaced, so checkpoint {name} fails its checksum.")


def check_file(folder: str, entry: Mapping, *, verify: bool = False) -> str:
    """Existence + size (and with ``verify`` the sha256) of one shard file of a local folder; returns its path."""
    name = os.path.basename(os.path.normpath(folder))
    path = os.path.join(folder, entry["name"])
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {name} is missing its shard file {entry['name']} (in {folder}); it "
                              f"cannot be loaded, resume from another checkpoint.") from None
    if size != int(entry["size"]):
        raise _size_error(folder, path, size, entry["size"])
    if verify:
        verify_files(folder, [entry])
    return path


def verify_files(folder: str, entries: Sequence[Mapping], *, max_workers: int | None = None) -> None:
    """Hash the shard files ``entries`` of ``folder`` (whose sizes were already checked) and compare each
    with its recorded sha256, in parallel (``hash_workers``, or ``max_workers``). The first failure stops
    the others at their next chunk; the CheckpointError names the failing file (the first in the manifest's
    order when several were caught)."""
    entries = list(entries)
    if not entries:
        return
    workers = max(1, min(len(entries), max_workers or hash_workers(len(entries))))
    stop = threading.Event()

    def check(entry: Mapping) -> CheckpointError | None:
        path = os.path.join(folder, entry["name"])
        try:
            size, digest = _stream_sha256(path, stop)
        except OSError as exc:
            err = CheckpointError(f"shard file {path} could not be read ({reason_of_os_error(exc)}); checkpoint "
                                  f"{os.path.basename(os.path.normpath(folder))} cannot be verified, resume from "
                                  f"another one.")
        else:
            if size is None:  # stopped: another file already failed
                return None
            if size != int(entry["size"]):  # changed since the size check
                err = _size_error(folder, path, size, entry["size"])
            elif digest != entry.get("sha256"):
                err = _checksum_error(folder, path)
            else:
                return None
        stop.set()
        return err

    if workers == 1:
        errors = [check(e) for e in entries]
    else:
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckpt-sha256")
        try:
            errors = list(pool.map(check, entries))
        finally:
            stop.set()  # also on KeyboardInterrupt: the threads leave at their next chunk
            pool.shutdown(wait=True, cancel_futures=True)
    failed = [e for e in errors if e is not None]
    if failed:
        raise failed[0]


# ---------------------------------------------------------------------------------------------------- folders
def validate_checkpoint(folder: str, *, verify_checksums: bool = False, max_workers: int | None = None) -> dict:
    """Validity check of a checkpoint folder or URI; returns its manifest.

    Cheap part (always): the manifest parses, the ranges tile the layout and every file exists with its
    recorded size -- an incomplete or truncated checkpoint is refused here without reading any shard.
    With ``verify_checksums`` every file is then hashed against its recorded sha256 (``verify_checkpoint``;
    on an object store, in this node's mirror of it). CheckpointError (one sentence naming the folder or the
    file) otherwise."""
    if storage.is_remote(folder):
        return _validate_remote(folder, verify_checksums=verify_checksums)
    manifest = read_manifest(folder)
    name = os.path.basename(os.path.normpath(folder))
    check_coverage(manifest["files"], int(manifest["layout_numel"]), f"checkpoint {name}")
    for entry in manifest["files"]:
        check_file(folder, entry, verify=False)
    if verify_checksums:
        verify_files(folder, manifest["files"], max_workers=max_workers)
    return manifest


def _validate_remote(step_uri: str, *, verify_checksums: bool = False) -> dict:
    """``validate_checkpoint`` for a checkpoint on a store: the manifest parses, the ranges tile the layout,
    every file is there with its recorded size; with ``verify_checksums`` the files are downloaded into this
    node's mirror and hashed there. Returns the manifest."""
    manifest = read_manifest(step_uri)
    name = os.path.basename(step_uri.split("?")[0].rstrip("/"))
    check_coverage(manifest["files"], int(manifest["layout_numel"]), f"checkpoint {name}")
    for entry in manifest["files"]:
        size = storage.size_of(storage.join(step_uri, entry["name"]))
        if size is None:
            raise CheckpointError(f"checkpoint {name} is missing its shard file {entry['name']} (in {step_uri}); "
                                  f"it cannot be loaded, resume from another checkpoint.")
        if size != int(entry["size"]):
            raise CheckpointError(f"shard file {storage.join(step_uri, entry['name'])} has {size} bytes, the "
                                  f"manifest records {entry['size']}: checkpoint {name} is incomplete.")
    if verify_checksums:
        verify_checkpoint(fetch(step_uri, manifest))
    return manifest


def verify_checkpoint(folder: str, *, max_workers: int | None = None) -> dict:
    """Full integrity check of a checkpoint folder; returns its manifest.

    The cheap checks of ``validate_checkpoint`` come first, then the sha256 of EVERY shard file is
    compared with the manifest's: each file is streamed in 4 MiB reads (constant memory) and the files are
    hashed concurrently on a thread pool of ``hash_workers(number of files)`` threads (or ``max_workers``).
    The first file that fails stops the rest. Raises CheckpointError, one sentence naming the failing file
    (or, for the cheap checks, the folder or the missing file)."""
    return validate_checkpoint(folder, verify_checksums=True, max_workers=max_workers)


def find_latest_valid(ckpt_dir: str, *, verify_checksums: bool = True) -> str | None:
    """The newest ``step_*`` folder of ``ckpt_dir`` that passes ``verify_checkpoint``, or None.

    Incomplete or corrupt folders are skipped with a CheckpointWarning that names them and the failing
    file; tmp folders (``.step_*.tmp-*``, checkpoints being written or abandoned by a crash) are ignored.
    Only the candidates down to the first good one are hashed. ``verify_checksums=False`` keeps to the
    cheap checks (manifest, coverage, sizes): for messages and bookkeeping, never to pick a folder to
    resume from."""
    for _, path in list_step_dirs(ckpt_dir):
        try:
            validate_checkpoint(path, verify_checksums=verify_checksums)
            return path
        except CheckpointError as exc:
            warnings.warn(f"skipping checkpoint {path}: {exc}", CheckpointWarning, stacklevel=2)
    return None


def resolve_continue(arg: Any, ckpt_dir: str, *, verify_checksums: bool = True) -> str:
    """The folder that ``--continue [ARG]`` names, verified (``verify_checkpoint``).

    ARG None / True / "" / "latest": the newest checkpoint of ckpt_dir that passes, newer incomplete or
    corrupt ones skipped with a CheckpointWarning naming the failing file; an int (or digit string): that
    step in ckpt_dir; anything else: a checkpoint folder path. A named folder that is absent, incomplete or
    corrupt raises CheckpointError (one sentence naming the flag, the folder or the failing file). When
    this returns, every file of the folder matched its sha256, so the load that follows may skip hashing
    again (``load_checkpoint(verify_checksums=False)``, ``GPUWorker.load_checkpoint(verified=True)``).
    ``verify_checksums=False``: cheap checks only."""
    if arg is None or arg is True or (isinstance(arg, str) and arg.strip().lower() in ("", "latest")):
        found = find_latest_valid(ckpt_dir, verify_checksums=verify_checksums)
        if found is None:
            raise CheckpointError(f"--continue: no valid checkpoint in {ckpt_dir}; train without --continue or "
                                  f"point --checkpoint-dir at the run's checkpoints.")
        return found
    if isinstance(arg, bool):
        raise CheckpointError(f"--continue={arg!r} is not a step number, a folder or 'latest'.")
    if isinstance(arg, int) or (isinstance(arg, str) and arg.strip().isdigit()):
        folder = step_dir(ckpt_dir, int(arg))
        if not folder_exists(folder):
            have = [s for s, _ in list_step_dirs(ckpt_dir)]
            raise CheckpointError(f"--continue={arg}: there is no checkpoint {os.path.basename(folder)} in "
                                  f"{ckpt_dir} (steps present: {sorted(have) or 'none'}).")
    else:
        folder = os.fspath(arg)
        if not folder_exists(folder):
            raise CheckpointError(f"--continue={arg}: no such checkpoint folder.")
    validate_checkpoint(folder, verify_checksums=verify_checksums)
    return folder
