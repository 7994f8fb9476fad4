"""Object-store I/O of checkpoints (``--checkpoint-dir s3://bucket/run/ckpt``): the layout and manifest of
llmq_ray/checkpoints/layout.py, published without renames; the local folder protocol is local.py's.

Object stores have no rename and no folders, so the local protocol (a tmp folder renamed into place) becomes:

    s3://.../ckpt/step_00000012/rank_00000.safetensors   each rank uploads its own shard (no shared disk needed),
    s3://.../ckpt/step_00000012/rank_00001.safetensors   written first to this node's staging folder, hashed
                                                         there, then uploaded
    s3://.../ckpt/step_00000012/manifest.json            uploaded LAST by the coordinator, once every rank's
                                                         upload returned: the checkpoint exists from then on

A ``step_*`` prefix without a manifest, or whose files do not have the recorded sizes, is incomplete (a run
killed during the upload) and is skipped with a warning by every reader, exactly like a local tmp folder; a
failed upload leaves the previous checkpoint valid. Reading downloads the manifest and the shard files into this
node's mirror (``$LLMQ_RAY_CACHE/checkpoints/<hash of the URI>/step_*``, files through a temporary name and a
rename, the manifest last; one worker of a node at a time per step, under a file lock, and a current copy is left
as it is: ``fetch``) and loads from there with the local code; ``--continue`` hashes that copy against the
manifest before it picks the checkpoint (verify.py), so a worker on the same node reuses it without reading the
store again. Keep-N and major-checkpoint retention (retention.py) delete whole prefixes through ``clear_step``.
The staging folder of an upload is made by ``local.begin_checkpoint`` (in this node's mirror, ``mirror_root``).

Imports point one way: this module uses layout.py only; verify.py, local.py and retention.py use this one.

Background uploads (the step loop's checkpoints; ``BackgroundUploads``). Only the staging is synchronous: the
coordinator removes an older copy of the step's prefix (``clear_step``, two small requests), then every rank
copies its state into reused pinned host buffers (``HostSnapshot``: the state of that step, captured before the
next step changes it) and returns. Writing the shard file, its sha256 and the upload run on one background
thread of the worker while training goes on. The coordinator asks every rank at each step boundary whether its
upload finished (a call that never blocks) and, once all have, uploads the manifest (``publish``) and applies
retention: only then does the checkpoint count (for retention, ``--continue``, automatic restarts and the run's
"end" record). A checkpoint due while the previous one is still uploading is deferred to the first step boundary
after that upload is published (one "checkpoint_deferred" warning; the buffers hold one checkpoint at a time),
so the steps never wait for the network; the end of the run (finish or stop) waits for the upload in flight
(the log's "upload_wait" record says how long). A failed upload (a network error, a bucket gone) becomes one
"warning" record -- the previous checkpoint stays the newest valid one -- the staged copy and the step's prefix
are removed, and the run goes on. A rank's staged file is removed after its upload, failed or not. Checkpoints
the caller asks for outside the step loop (the end of the run, a stop,
``LLMQTrainer.save_checkpoint``) upload synchronously, as does every checkpoint in a local folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from llmq_ray import storage
from llmq_ray.checkpoints.layout import MANIFEST, check_coverage, read_manifest
from llmq_ray.errors import CheckpointError


def _bare(uri: str) -> str:
    """``uri`` without its query and trailing slash: what names a checkpoint (the query only configures access)."""
    return uri.split("?")[0].rstrip("/")


def mirror_root(ckpt_uri: str) -> str:
    """This node's local folder for the checkpoints of ``ckpt_uri``: staging of uploads, copies of downloads."""
    key = hashlib.sha256(_bare(ckpt_uri).encode()).hexdigest()[:16]
    return os.path.join(storage.cache_root(), "checkpoints", key)


def _upload_shard(tmp_dir: str, record: Mapping, step_uri: str, before: Callable[[], None] | None = None) -> None:
    """Upload the rank's shard file of ``tmp_dir`` to ``step_uri``; the local file is removed, failed or not
    (the folder is not: other ranks of this node may still be writing into it). OSError when the store
    refuses it.
    ``before`` runs first (the test hook's slow or failing uploads)."""
    local = os.path.join(tmp_dir, record["name"])
    try:
        if before is not None:
            before()
        storage.upload(local, storage.join(step_uri, record["name"]))
    finally:
        if os.path.exists(local):
            os.remove(local)


def upload_rank_shard(tmp_dir: str, record: Mapping, step_uri: str) -> None:
    """Worker: upload its shard file (written and hashed in ``tmp_dir`` by ``local.write_rank_shard``) to the
    checkpoint's prefix, then drop the local file. A failed upload raises CheckpointError naming the store."""
    try:
        _upload_shard(tmp_dir, record, step_uri)
    except OSError as exc:
        raise CheckpointError(f"checkpoint {os.path.basename(_bare(step_uri))} could not be uploaded to "
                              f"{step_uri} ({reason_of(exc)}); the previous checkpoint is still "
                              f"valid.") from None


def reason_of(exc: BaseException) -> str:
    """The first line of an upload's error (pyarrow's messages run over several lines)."""
    text = (str(exc).strip().splitlines() or [""])[0].rstrip(".")
    if isinstance(exc, OSError) or isinstance(exc, CheckpointError):
        return text or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class HostSnapshot:
    """Worker: host copies of its checkpoint state, in buffers kept from one checkpoint to the next.

    ``take({"master", "m", "v"})`` copies each (1-D, on the GPU or the CPU) into a host buffer of the same size
    and dtype -- page-locked for a GPU tensor, so the copy runs at the link's speed (a 4 GB shard: ~0.07 s
    against ~2.4 s into ordinary memory, measured on an H200) -- waits for the copies and returns the buffers.
    The optimizer may then change its state; the buffers stay as they were until the next ``take``, which the
    coordinator starts only after the previous checkpoint's upload finished (one upload at a time)."""

    def __init__(self):
        self._buffers: dict = {}

    def reserve(self, tensors: Mapping) -> None:
        """Allocate the buffers for ``tensors`` now (at set-up: page-locking gigabytes takes seconds)."""
        for name, t in tensors.items():
            self._buffer(name, t.detach().reshape(-1))

    def _buffer(self, name: str, t):
        import torch

        buf = self._buffers.get(name)
        if buf is None or buf.numel() != t.numel() or buf.dtype != t.dtype:
            buf = torch.empty(t.numel(), dtype=t.dtype, pin_memory=t.is_cuda)
            self._buffers[name] = buf
        return buf

    def take(self, tensors: Mapping) -> dict:
        import torch

        out = {}
        for name, t in tensors.items():
            t = t.detach().reshape(-1)
            buf = self._buffer(name, t)
            buf.copy_(t, non_blocking=t.is_cuda)
            out[name] = buf
        if any(t.is_cuda for t in tensors.values()):
            torch.cuda.synchronize()
        return out


class BackgroundUploads:
    """Worker: the uploads of its staged shards, on one background thread (module docstring).

    ``submit`` returns at once; ``status(step)`` says whether the upload of ``step`` finished: {"done": False}
    while it runs, else {"done": True, "error": None or its reason, "seconds"} (asked again, the same answer,
    until the next ``submit`` forgets the finished ones).
    ``before`` runs on the upload thread first (the test hook's slow or failing uploads)."""

    def __init__(self):
        self._pool: ThreadPoolExecutor | None = None
        self._jobs: dict[int, Future] = {}
        self._lock = threading.Lock()

    def submit(self, step: int, tmp_dir: str, record: Mapping | None, step_uri: str,
               before: Callable[[], None] | None = None, write: Callable[[], dict] | None = None) -> None:
        """Upload the shard file ``record`` names; or, with ``write``, first call it on the upload thread to
        write and hash the file (it returns the record, which ``status`` then reports)."""
        t0 = time.monotonic()

        def job() -> tuple[float, Mapping]:
            rec = write() if write is not None else record
            _upload_shard(tmp_dir, rec, step_uri, before)
            return time.monotonic() - t0, rec

        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-upload")
            # the coordinator has read the outcome of every earlier upload before it stages the next one
            self._jobs = {s: f for s, f in self._jobs.items() if not f.done()}
            self._jobs[int(step)] = self._pool.submit(job)

    def status(self, step: int, wait: bool = False, timeout_s: float | None = None) -> dict:
        with self._lock:
            fut = self._jobs.get(int(step))
        if fut is None:
            return {"done": True, "error": f"this worker has no upload of step {step} (it was restarted?)",
                    "seconds": 0.0}
        if not wait and not fut.done():
            return {"done": False}
        try:
            seconds, record = fut.result(timeout=timeout_s if wait else 0)
        except FutureTimeout:
            return {"done": False}
        except BaseException as exc:  # noqa: BLE001 - every failure is a failed upload, told in one sentence
            return {"done": True, "error": reason_of(exc), "seconds": 0.0}
        return {"done": True, "error": None, "seconds": seconds, "record": dict(record)}

    def close(self) -> None:
        """Stop taking uploads; one running goes on (the process usually ends next)."""
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
                self._pool = None


def publish(tmp_dir: str, step_uri: str, manifest: Mapping[str, Any], records: Sequence[Mapping]) -> str:
    """Coordinator, after every rank uploaded: check the records (one per rank, ranges tiling the layout),
    upload the manifest last, drop the staging folder. Returns ``step_uri``."""
    name = os.path.basename(_bare(step_uri))
    try:
        files = [{k: rec[k] for k in ("name", "rank", "start", "end", "size", "sha256", "dtypes") if k in rec}
                 for rec in sorted(records, key=lambda r: int(r["rank"]))]
        world = int(manifest["world_size"])
        if [f["rank"] for f in files] != list(range(world)):
            raise CheckpointError(f"checkpoint {name}: got shard files of ranks {[f['rank'] for f in files]}, "
                                  f"expected 0..{world - 1}; the checkpoint was not published.")
        check_coverage(files, int(manifest["layout_numel"]), f"checkpoint {name}")
        for f in files:  # what the store holds now, before the manifest makes it a checkpoint
            size = storage.size_of(storage.join(step_uri, f["name"]))
            if size != int(f["size"]):
                raise CheckpointError(f"checkpoint {name}: {f['name']} has {size} bytes on the store, its writer "
                                      f"uploaded {f['size']}; the checkpoint was not published.")
        full = dict(manifest)
        full["files"] = files
        storage.write_bytes(storage.join(step_uri, MANIFEST), (json.dumps(full, indent=1) + "\n").encode())
    except OSError as exc:
        err = CheckpointError(f"checkpoint {name}: its manifest could not be uploaded to {step_uri} "
                              f"({reason_of(exc)}); the previous checkpoint is still valid.")
        err.reason = f"its manifest could not be uploaded ({reason_of(exc)})"
        raise err from None
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)  # the staging folder (as local.discard_tmp does)
    return step_uri


def clear_step(step_uri: str) -> None:
    """Before a step's shards are uploaded again (a resumed run re-reaching a saved step): remove the old
    prefix, manifest first, so that no mix of old and new files is ever a checkpoint."""
    manifest = storage.join(step_uri, MANIFEST)
    if storage.size_of(manifest) is not None:
        storage.delete_tree(manifest)
    storage.delete_tree(step_uri)


def fetch(step_uri: str, manifest: Mapping | None = None) -> str:
    """A local copy of the checkpoint ``step_uri`` in this node's mirror (files whose local size already matches
    are kept; the manifest is written last). Returns the local folder, which the local loader reads.

    Several workers of one node fetch the same checkpoint at once (every rank restores from it): a file lock per
    step (``<mirror>/.locks/step_*.lock``, through ``filelock``) lets the first copy it while the others wait,
    and a copy whose manifest and file sizes already match the store's is returned untouched -- so a worker
    that is already reading it never sees its manifest removed by the next one (which an earlier version did:
    "has no manifest.json", seen with two ranks on one node under load)."""
    from filelock import FileLock

    manifest = manifest or read_manifest(step_uri)
    parent, name = _bare(step_uri).rsplit("/", 1)
    root = mirror_root(parent)
    folder = os.path.join(root, name)
    os.makedirs(os.path.join(root, ".locks"), exist_ok=True)
    local_manifest = os.path.join(folder, MANIFEST)
    try:
        with FileLock(os.path.join(root, ".locks", f"{name}.lock")):
            if _is_current_copy(folder, manifest):
                return folder
            os.makedirs(folder, exist_ok=True)
            if os.path.exists(local_manifest):  # an older copy of this step: its files may be stale
                os.remove(local_manifest)
            for entry in manifest["files"]:
                local = os.path.join(folder, entry["name"])
                if not (os.path.isfile(local) and os.path.getsize(local) == int(entry["size"])):
                    storage.download(storage.join(step_uri, entry["name"]), local)
            with open(local_manifest + ".partial", "w") as f:
                json.dump(manifest, f, indent=1)
            os.replace(local_manifest + ".partial", local_manifest)
    except OSError as exc:
        raise CheckpointError(f"checkpoint {step_uri} could not be downloaded ({str(exc).splitlines()[0]}).") from None
    return folder


def _is_current_copy(folder: str, manifest: Mapping) -> bool:
    """Whether ``folder`` holds a complete copy of the checkpoint ``manifest`` describes: the same manifest
    (compared as JSON) and every file at its recorded size. (The loader still checks sizes and hashes.)"""
    try:
        with open(os.path.join(folder, MANIFEST)) as f:
            if json.load(f) != json.loads(json.dumps(manifest)):
                return False
    except (OSError, ValueError):
        return False
    return all(os.path.isfile(p := os.path.join(folder, e["name"])) and os.path.getsize(p) == int(e["size"])
               for e in manifest["files"])
