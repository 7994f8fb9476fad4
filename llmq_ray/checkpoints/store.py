"""Training checkpoints: per-rank safetensors of the optimizer shards, a JSON manifest written last.

Layout::

    <ckpt_dir>/step_00000012/               step = optimizer updates completed (resume at 0-based step 12)
        rank_00000.safetensors              rank 0's shard: 1-D "master", "m", "v" over the flat range
        rank_00001.safetensors              [start, end) (also in the file's metadata), in their own dtypes
        manifest.json                       written LAST: step, model config, options, data state per rank,
                                            RNG, world size, layout numel, and each file's size and sha256

A checkpoint is written into ``<ckpt_dir>/.step_00000012.tmp-<id>/``; every file is flushed and fsynced,
the manifest goes in last, then the folder is renamed to ``step_00000012`` and ``ckpt_dir`` is fsynced.
A crash at any point leaves either a tmp folder (ignored by every reader) or a complete checkpoint, never
a ``step_*`` folder that looks valid but is not. Checkpoints are safetensors + JSON only: loading one never
unpickles anything.

Multi-rank protocol (ranks share the filesystem of one node; the coordinator runs the rest)::

    tmp = begin_checkpoint(ckpt_dir, step)                                   # coordinator
    rec = write_rank_shard(tmp, rank, tensors, start, end)                   # every worker, concurrently
    manifest = build_manifest(step, config=..., options=..., world_size=W,   # coordinator, after all
                              data_state=[...per rank...], rng=rng_state(seed))  # workers returned
    final = finalize_checkpoint(tmp, step_dir(ckpt_dir, step), manifest, records=[rec0, rec1, ...])
    apply_retention(ckpt_dir, keep_n=2, major_every=0)
    # if any worker raised: abort_checkpoint(tmp, step, cause) -> raises the one-sentence CheckpointError

Reading: ``find_latest_valid`` / ``resolve_continue`` pick the folder a run resumes from. They run the
cheap checks first (manifest parses, ranges tile the layout, files exist with the recorded sizes), so an
incomplete folder is refused without reading a byte of it, and then ``verify_checkpoint`` hashes every file
against the manifest's sha256: a same-size corruption (a flipped bit, a file replaced by one of equal size)
of the newest checkpoint is skipped with a warning there, instead of being picked and then failing the
workers' load -- which, under a wrapper that always passes --continue, would crash-loop. Hashing streams
each file in 4 MiB reads on a thread pool, one thread per file up to the usable cores (hashlib and file
reads release the GIL): a checkpoint of N rank files hashes about min(N, cores) times as fast as one by one.
``load_checkpoint`` compares the model config and assembles any flat range [start, end) from the saved
shards, so a run may resume on another world size; it verifies the sha256 of every file it reads unless
its caller says the folder was just verified (``verify_checksums=False``). ``apply_retention`` and the
restart path (actors/checkpointing.py) keep to the cheap checks: they run after every save or restart, on
checkpoints this run has just written and hashed, and a restart's load still verifies what it reads.

Importing this module does not import torch (``import torch`` takes about a second): the CLI resolves
--continue in a pre-flight before anything heavy is loaded. The functions that handle tensors import it
(and ``llmq_ray.model.params``) when called.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import errno
import hashlib
import json
import os
import re
import shutil
import threading
import uuid
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from llmq_ray import storage
from llmq_ray.model.config import ModelConfig
from llmq_ray.errors import CheckpointError, ConfigError

if TYPE_CHECKING:  # annotations only: the functions that need torch import it when called
    import torch

FORMAT = "llmq-ray-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
STATE_NAMES = ("master", "m", "v")
_STEP_RE = re.compile(r"^step_(\d{8})$")
_TMP_RE = re.compile(r"^\.step_(\d{8})\.tmp-[0-9a-zA-Z]+$")
_HASH_CHUNK = 1 << 22  # 4 MiB per read when hashing
_HASH_THREADS_MAX = 32  # beyond this many concurrent readers a disk only seeks more
# dtype names by str(torch dtype) and by safetensors' dtype names, so no torch import is needed here
_DTYPE_NAMES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16",
                "F32": "fp32", "BF16": "bf16", "F16": "fp16"}


def _dtype_name(dtype: Any) -> str:
    """The short name (fp32, bf16, fp16) of a torch dtype or of a safetensors dtype name, else its str()."""
    return _DTYPE_NAMES.get(str(dtype), str(dtype))


class CheckpointWarning(UserWarning):
    """A checkpoint folder was skipped (incomplete or corrupt), or a risky retention setting was chosen."""


# ---------------------------------------------------------------------------------------------------- names
def step_name(step: int) -> str:
    """``step_XXXXXXXX`` (8 digits) for a step number."""
    step = int(step)
    if not 0 <= step <= 99_999_999:
        raise CheckpointError(f"checkpoint step {step} is outside [0, 99999999]; it cannot be named step_XXXXXXXX.")
    return f"step_{step:08d}"


def step_dir(ckpt_dir: str, step: int) -> str:
    """The final folder of the checkpoint of ``step`` inside ``ckpt_dir`` (a path or a URI)."""
    return storage.join(ckpt_dir, step_name(step))


def rank_file_name(rank: int) -> str:
    """``rank_RRRRR.safetensors`` (5 digits)."""
    return f"rank_{int(rank):05d}.safetensors"


def step_of(folder: str) -> int | None:
    """The step of a ``step_XXXXXXXX`` folder path, else None."""
    m = _STEP_RE.match(os.path.basename(os.path.normpath(folder)))
    return int(m.group(1)) if m else None


def list_step_dirs(ckpt_dir: str) -> list[tuple[int, str]]:
    """All ``step_*`` folders of ``ckpt_dir`` as (step, path), newest first (tmp folders never included).
    On an object store: the ``step_*`` prefixes, complete or not (the manifest decides)."""
    if storage.is_remote(ckpt_dir):
        return sorted(((int(m.group(1)), step_dir(ckpt_dir, int(m.group(1))))
                       for m in map(_STEP_RE.match, storage.list_names(ckpt_dir)) if m), reverse=True)
    try:
        names = os.listdir(ckpt_dir)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        m = _STEP_RE.match(name)
        if m and os.path.isdir(os.path.join(ckpt_dir, name)):
            out.append((int(m.group(1)), os.path.join(ckpt_dir, name)))
    return sorted(out, reverse=True)


# ---------------------------------------------------------------------------------------------------- low-level IO
def _fsync_dir(path: str) -> None:
    """fsync a directory so that the entries created/renamed in it are durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _size_and_sha256(f) -> tuple[int, str]:
    """(size, sha256 hex) of the bytes of the open binary file ``f`` from where it stands, read in chunks."""
    h = hashlib.sha256()
    size = 0
    for chunk in iter(lambda: f.read(_HASH_CHUNK), b""):
        h.update(chunk)
        size += len(chunk)
    return size, h.hexdigest()


def _fsync_and_hash(path: str) -> tuple[int, str]:
    """fsync a just-written file and return (size, sha256 hex) of its bytes (read back in chunks)."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        return _size_and_sha256(f)


def file_sha256(path: str) -> str:
    """sha256 (hex) of a file's bytes."""
    return _stream_sha256(path)[1]


def _stream_sha256(path: str, stop: threading.Event | None = None) -> tuple[int, str] | tuple[None, None]:
    """(size, sha256 hex) of a file, read in ``_HASH_CHUNK`` pieces into one reused buffer (constant memory
    whatever the file's size); (None, None) when ``stop`` was set before the end (another file of the same
    checkpoint already failed, so finishing this one is wasted reading).

    Both the reads and ``hashlib``'s update of a large buffer release the GIL, so several of these run
    truly in parallel on a thread pool. The kernel is told the access is sequential (more read-ahead)."""
    h = hashlib.sha256()
    buf = bytearray(_HASH_CHUNK)
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


def _save_tensors(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write one safetensors file (a separate function so that tests can inject write failures)."""
    from safetensors.torch import save_file

    save_file(tensors, path, metadata=metadata)


def _write_json(path: str, obj: Any) -> None:
    """Write JSON, flushed and fsynced."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


def _is_write_failure(exc: BaseException) -> bool:
    """OSError (full disk, permissions, vanished folder) or safetensors' own I/O error."""
    if isinstance(exc, OSError):
        return True
    try:
        from safetensors import SafetensorError
    except ImportError:  # pragma: no cover
        return False
    return isinstance(exc, SafetensorError)


def _ckpt_dir_of_tmp(tmp_dir: str) -> str:
    return os.path.dirname(os.path.normpath(tmp_dir))


def _step_of_tmp(tmp_dir: str) -> int | None:
    m = _TMP_RE.match(os.path.basename(os.path.normpath(tmp_dir)))
    return int(m.group(1)) if m else None


def discard_tmp(tmp_dir: str) -> None:
    """Remove a temporary checkpoint folder (best effort; never raises)."""
    shutil.rmtree(tmp_dir, ignore_errors=True)


def _write_failed(tmp_dir: str, step: int | None, exc: BaseException, *, remove: bool = True) -> CheckpointError:
    """Remove the tmp folder (unless ``remove`` is False) and build the one-sentence error about a failed write."""
    if remove:
        discard_tmp(tmp_dir)
    ckpt_dir = _ckpt_dir_of_tmp(tmp_dir)
    name = step_name(step) if step is not None else os.path.basename(tmp_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        prev = find_latest_valid(ckpt_dir, verify_checksums=False)  # a message only: no hashing on this path
    tail = (f"the previous checkpoint {os.path.basename(prev)} is still valid" if prev
            else "there is no earlier valid checkpoint in it")
    return CheckpointError(f"checkpoint {name} could not be written to {ckpt_dir} ({_reason(exc)}); {tail}.")


def abort_checkpoint(tmp_dir: str, step: int, cause: BaseException | str) -> None:
    """Coordinator: a worker failed while writing ``tmp_dir``; remove it and raise the CheckpointError.

    ``cause`` is the worker's exception (a RayTaskError is unwrapped through its ``cause``) or a message.
    A worker's CheckpointError (e.g. its full-disk sentence) is re-raised as is. Always raises."""
    inner = getattr(cause, "cause", None)
    if not isinstance(cause, CheckpointError) and isinstance(inner, CheckpointError):
        cause = inner
    if isinstance(cause, CheckpointError):
        discard_tmp(tmp_dir)
        raise cause
    exc = cause if isinstance(cause, BaseException) else OSError(errno.EIO, str(cause))
    raise _write_failed(tmp_dir, step, exc)


# ---------------------------------------------------------------------------------------------------- writing
def begin_checkpoint(ckpt_dir: str, step: int) -> str:
    """Create and return the temporary folder ``<ckpt_dir>/.step_XXXXXXXX.tmp-<id>`` for ``step``.

    The coordinator calls this once and hands the path to every worker. Raises CheckpointError when the
    folder cannot be created (e.g. ckpt_dir not writable)."""
    name = step_name(step)
    tmp = os.path.join(ckpt_dir, f".{name}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        os.makedirs(ckpt_dir, exist_ok=True)
        os.mkdir(tmp)
    except OSError as exc:
        raise _write_failed(tmp, step, exc) from exc
    return tmp


def write_rank_shard(tmp_dir: str, rank: int, tensors: Mapping[str, torch.Tensor], start: int, end: int) -> dict:
    """Worker: write this rank's shard of the flat optimizer state into the checkpoint's tmp folder.

    ``tensors``: {"master", "m", "v"}, each 1-D with end - start elements (any device, fp32/bf16; written in
    its own dtype, copied to the host by safetensors). [start, end) is the shard's *global* flat range; it
    goes into the file's metadata and into the returned record. The file is fsynced, and its sha256 is
    computed here (in parallel across ranks) so the coordinator need not read it again.

    Returns the record the coordinator passes to ``finalize_checkpoint``:
    {"name", "rank", "start", "end", "size", "sha256", "dtypes"}. Any OSError removes this rank's partial
    file and raises CheckpointError (full disk: "checkpoint step_... could not be written to DIR (No space
    left on device); the previous checkpoint step_... is still valid."); the coordinator then calls
    ``abort_checkpoint``, which removes the tmp folder (``save_checkpoint`` does both in one process).
    """
    start, end, rank = int(start), int(end), int(rank)
    missing = [k for k in STATE_NAMES if k not in tensors]
    if missing:
        raise CheckpointError(f"write_rank_shard: rank {rank}'s state lacks {missing}; expected {list(STATE_NAMES)}.")
    if not 0 <= start <= end:
        raise CheckpointError(f"write_rank_shard: rank {rank} got an invalid range [{start}, {end}).")
    out = {}
    for k in STATE_NAMES:
        t = tensors[k]
        if t.numel() != end - start:
            raise CheckpointError(f"write_rank_shard: rank {rank}'s {k!r} has {t.numel()} elements, its range "
                                  f"[{start}, {end}) has {end - start}.")
        out[k] = t.detach().reshape(-1).contiguous()
    step = _step_of_tmp(tmp_dir)
    metadata = {"format": FORMAT, "format_version": str(FORMAT_VERSION), "rank": str(rank),
                "start": str(start), "end": str(end)}
    if step is not None:
        metadata["step"] = str(step)
    name = rank_file_name(rank)
    path = os.path.join(tmp_dir, name)
    try:
        _save_tensors(path, out, metadata)
        size, sha = _fsync_and_hash(path)
    except BaseException as exc:
        try:
            os.remove(path)  # the partial file; the folder is the coordinator's to remove (other ranks write)
        except OSError:
            pass
        if _is_write_failure(exc):
            raise _write_failed(tmp_dir, step, exc, remove=False) from exc
        raise
    return {"name": name, "rank": rank, "start": start, "end": end, "size": size, "sha256": sha,
            "dtypes": {k: _dtype_name(v.dtype) for k, v in out.items()}}


def rng_state(seed: int | None = None) -> dict:
    """The RNG state of this process, JSON-ready: {"seed", "torch_cpu" (base64 of torch.get_rng_state())}.

    The training math itself draws no random numbers from global generators (init and the stochastic
    rounding seeds are pure functions of the run's seed, the step and the flat offset), so ``seed`` is what
    reproduces a run; the torch CPU state is saved for code that does use the global generator."""
    import torch

    state = torch.get_rng_state().numpy().tobytes()
    return {"seed": None if seed is None else int(seed), "torch_cpu": base64.b64encode(state).decode("ascii")}


def restore_rng(rng: Mapping[str, Any]) -> None:
    """Set torch's CPU generator back to a ``rng_state()`` (no-op when the entry is absent)."""
    encoded = rng.get("torch_cpu") if rng else None
    if encoded:
        import torch

        raw = base64.b64decode(encoded)
        torch.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))


def _jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    return obj


def build_manifest(step: int, *, config: ModelConfig, world_size: int, options: Any = None,
                   data_state: Sequence[Mapping | None] | None = None, rng: Mapping | None = None,
                   extra: Mapping[str, Any] | None = None) -> dict:
    """The manifest of a checkpoint, minus its "files" (which ``finalize_checkpoint`` adds).

    step: optimizer updates completed (the resumed run's first 0-based step). config: the ModelConfig
    (stored with dataclasses.asdict). world_size: the number of optimizer shard files. options: TrainOptions
    (or a dict). data_state: one TokenStream.state() (or None) per worker that trained. That is one per
    shard file, except under --zero-scope node, where every node held a copy of the shards and only the first
    node's were saved: then the N x world_size workers' states are kept, and their count goes into the
    manifest as "data_world_size" (``data_world_size`` reads it). rng: ``rng_state(seed)``. extra: more JSON
    keys (e.g. the loss history, the export dtype); they must not collide with the reserved ones.
    """
    from llmq_ray.model.params import ParamLayout

    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": int(step),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "world_size": int(world_size),
        "layout_numel": ParamLayout(config).numel,
        "model_config": dataclasses.asdict(config),
        "train_options": _jsonable(options),
        "data_state": [None if s is None else dict(s) for s in (data_state or [None] * int(world_size))],
        "rng": dict(rng) if rng is not None else None,
    }
    n_data = len(manifest["data_state"])
    if n_data == 0 or n_data % int(world_size):
        raise CheckpointError(f"build_manifest: {n_data} data states for world size {world_size}.")
    if n_data != int(world_size):
        manifest["data_world_size"] = n_data
    for key, value in (extra or {}).items():
        if key in manifest or key == "files":
            raise CheckpointError(f"build_manifest: extra key {key!r} is reserved.")
        manifest[key] = value
    try:
        json.dumps(manifest)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint manifest of step {step} is not JSON-serializable ({exc}).") from exc
    return manifest


def _check_coverage(records: Sequence[Mapping], numel: int, where: str) -> None:
    """The saved ranges must tile [0, numel) exactly (in any order, empty ranges allowed)."""
    pos = 0
    for r in sorted(records, key=lambda r: (int(r["start"]), int(r["end"]))):
        s, e = int(r["start"]), int(r["end"])
        if s == e:
            continue
        if s != pos or e < s:
            raise CheckpointError(f"{where}: the shard ranges do not tile [0, {numel}) (gap or overlap at "
                                  f"{r.get('name', '?')} [{s}, {e}), expected a start of {pos}).")
        pos = e
    if pos != numel:
        raise CheckpointError(f"{where}: the shards cover [0, {pos}), the model has {numel} parameters.")


def finalize_checkpoint(tmp_dir: str, final_dir: str, manifest: Mapping[str, Any], *,
                        records: Sequence[Mapping] | None = None) -> str:
    """Coordinator, after every worker returned: check the shard files, write the manifest last, publish.

    records: the dicts ``write_rank_shard`` returned (one per rank). Their sizes are checked against the
    files and their sha256 (computed by the workers while writing) go into the manifest. Without records
    the rank files found in tmp_dir are hashed here. The ranges must tile [0, manifest["layout_numel"]) and
    there must be world_size of them. Then: manifest.json (fsynced) -> fsync tmp_dir -> rename to
    ``final_dir`` (an existing folder of that name is replaced) -> fsync ckpt_dir. Returns final_dir.
    Any OSError removes tmp_dir and raises CheckpointError; so does an inconsistency.
    """
    step = int(manifest["step"])
    name = os.path.basename(os.path.normpath(final_dir))
    parent = os.path.dirname(os.path.normpath(final_dir)) or "."
    old = None
    try:
        if records is None:
            records = _records_from_files(tmp_dir)
        files = []
        for rec in sorted(records, key=lambda r: int(r["rank"])):
            path = os.path.join(tmp_dir, rec["name"])
            size = os.path.getsize(path)
            if size != int(rec["size"]):
                raise CheckpointError(f"checkpoint {name}: {rec['name']} has {size} bytes on disk, its writer "
                                      f"reported {rec['size']}; the checkpoint was not published.")
            files.append({k: rec[k] for k in ("name", "rank", "start", "end", "size", "sha256", "dtypes") if k in rec})
        world = int(manifest["world_size"])
        if sorted(f["rank"] for f in files) != list(range(world)):
            raise CheckpointError(f"checkpoint {name}: got shard files of ranks {sorted(f['rank'] for f in files)}, "
                                  f"expected 0..{world - 1}; the checkpoint was not published.")
        _check_coverage(files, int(manifest["layout_numel"]), f"checkpoint {name}")
        full = dict(manifest)
        full["files"] = files
        _write_json(os.path.join(tmp_dir, MANIFEST), full)
        _fsync_dir(tmp_dir)
        if os.path.exists(final_dir):  # re-reaching a step already saved (resumed from an older one)
            old = os.path.join(parent, f".{name}.old-{uuid.uuid4().hex[:12]}")
            os.rename(final_dir, old)
        os.rename(tmp_dir, final_dir)
        _fsync_dir(parent)
    except CheckpointError:
        discard_tmp(tmp_dir)
        raise
    except BaseException as exc:
        if old is not None and not os.path.exists(final_dir):
            os.rename(old, final_dir)  # put the replaced checkpoint back
        if _is_write_failure(exc):
            raise _write_failed(tmp_dir, step, exc) from exc
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final_dir


def _records_from_files(tmp_dir: str) -> list[dict]:
    """Rebuild write records from the rank files of a folder (reads metadata, hashes every file)."""
    from safetensors import safe_open

    out = []
    for fname in sorted(os.listdir(tmp_dir)):
        m = re.match(r"^rank_(\d{5})\.safetensors$", fname)
        if not m:
            continue
        path = os.path.join(tmp_dir, fname)
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            dtypes = {k: _dtype_name(f.get_slice(k).get_dtype()) for k in f.keys()}
        out.append({"name": fname, "rank": int(m.group(1)), "start": int(meta["start"]), "end": int(meta["end"]),
                    "size": os.path.getsize(path), "sha256": file_sha256(path), "dtypes": dtypes})
    return out


def save_checkpoint(ckpt_dir: str, step: int, shards: Sequence[tuple[int, int, Mapping[str, torch.Tensor]]], *,
                    config: ModelConfig, options: Any = None, data_state: Sequence[Mapping | None] | None = None,
                    rng: Mapping | None = None, extra: Mapping[str, Any] | None = None,
                    keep_n: int | None = 2, major_every: int = 0) -> str:
    """Single process: write a whole checkpoint (all ``shards`` = [(start, end, {"master","m","v"})], one per
    rank) and apply retention. Returns the final folder. ``keep_n=None`` skips retention."""
    tmp = begin_checkpoint(ckpt_dir, step)
    try:
        records = [write_rank_shard(tmp, r, tensors, start, end) for r, (start, end, tensors) in enumerate(shards)]
        manifest = build_manifest(step, config=config, world_size=len(shards), options=options,
                                  data_state=data_state, rng=rng, extra=extra)
        final = finalize_checkpoint(tmp, step_dir(ckpt_dir, step), manifest, records=records)
    except BaseException:
        discard_tmp(tmp)  # a no-op when the failure path already removed it
        raise
    if keep_n is not None:
        apply_retention(ckpt_dir, keep_n=keep_n, major_every=major_every, protect=[final])
    return final


def set_aside_newer(ckpt_dir: str, step: int) -> tuple[str | None, list[str]]:
    """Move the ``step_*`` folders of ``ckpt_dir`` above ``step`` into ``ckpt_dir/superseded-<UTC time>/``.

    A run that resumes from an older checkpoint (``--continue 1000`` after a divergence at 1900) starts a new
    branch: the newer checkpoints of the abandoned branch must not be taken by a later ``--continue`` (the
    newest wins) nor deleted by retention (the newest are kept). Moved, not deleted: nothing is lost. Returns
    (the folder they went to, or None when there were none; their names)."""
    newer = [(s, p) for s, p in list_step_dirs(ckpt_dir) if s > int(step)]
    if not newer:
        return None, []
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    dest = os.path.join(ckpt_dir, f"superseded-{stamp}")
    n = 1
    while os.path.exists(dest):
        n += 1
        dest = os.path.join(ckpt_dir, f"superseded-{stamp}-{n}")
    os.mkdir(dest)
    for _, path in newer:
        os.rename(path, os.path.join(dest, os.path.basename(path)))
    _fsync_dir(ckpt_dir)
    return dest, sorted(os.path.basename(p) for _, p in newer)


# ---------------------------------------------------------------------------------------------------- retention
def check_retention(keep_n: int, major_every: int = 0) -> None:
    """Validate --ckpt-keep / --ckpt-major; keep_n == 1 is allowed (the user asked) but warns."""
    if not isinstance(keep_n, int) or keep_n < 1:
        raise ConfigError(f"--ckpt-keep={keep_n!r} must be an integer >= 1 (default 2).")
    if not isinstance(major_every, int) or major_every < 0:
        raise ConfigError(f"--ckpt-major={major_every!r} must be an integer >= 0 (0: no major checkpoints).")
    if keep_n == 1:
        warnings.warn("--ckpt-keep=1 keeps a single checkpoint: while the next one is being written a crash can "
                      "leave only that one, and a corrupt one leaves nothing to resume from.", CheckpointWarning,
                      stacklevel=3)


def apply_retention(ckpt_dir: str, *, keep_n: int = 2, major_every: int = 0,
                    protect: Sequence[str] = ()) -> list[str]:
    """Delete old checkpoints: keep the newest ``keep_n`` valid ones plus every step that is a multiple of
    ``major_every`` (when > 0) forever, and the folders in ``protect`` (the checkpoint just written: never
    deleted by its own save, even when the folder holds higher steps). Call only after the newest checkpoint
    is complete.

    Invalid folders older than the newest valid one go too (it supersedes them); folders newer than it are
    never deleted (an invalid newer folder is left for a human to look at); stale tmp folders of steps up
    to the newest valid checkpoint are removed. Returns the deleted paths."""
    check_retention(keep_n, major_every)
    remote = storage.is_remote(ckpt_dir)  # there a checkpoint is a prefix; deleting it is clear_step's job
    steps = list_step_dirs(ckpt_dir)
    kept: list[int] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        for step, path in steps:  # newest first
            if len(kept) == keep_n:
                break
            try:
                validate_checkpoint(path)
                kept.append(step)
            except CheckpointError:
                continue
    if not kept:
        return []
    newest_kept = max(kept)
    deleted = []
    same = (lambda p: p.split("?")[0].rstrip("/")) if remote else os.path.abspath
    protected = {same(p) for p in protect}
    for step, path in steps:
        if step in kept or step > newest_kept or (major_every and step % major_every == 0):
            continue
        if same(path) in protected:
            continue
        if remote:
            from llmq_ray.checkpoints.remote import clear_step

            clear_step(path)
        else:
            shutil.rmtree(path, ignore_errors=True)
        deleted.append(path)
    if remote:  # no tmp folders on a store: an unfinished upload is a step prefix, pruned above
        return deleted
    for name in os.listdir(ckpt_dir):
        m = _TMP_RE.match(name) or re.match(r"^\.step_(\d{8})\.old-[0-9a-zA-Z]+$", name)
        if m and int(m.group(1)) <= newest_kept:
            shutil.rmtree(os.path.join(ckpt_dir, name), ignore_errors=True)
            deleted.append(os.path.join(ckpt_dir, name))
    if deleted:
        _fsync_dir(ckpt_dir)
    return deleted


# ---------------------------------------------------------------------------------------------------- reading
def read_manifest(folder: str) -> dict:
    """Parse and sanity-check ``folder/manifest.json`` (a local folder or a checkpoint URI); CheckpointError
    naming the folder otherwise."""
    name = os.path.basename(os.path.normpath(folder))
    path = storage.join(folder, MANIFEST)
    try:
        if storage.is_remote(folder):
            text = storage.read_bytes(path).decode()
        else:
            with open(path) as f:
                text = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {folder} has no {MANIFEST}: it is incomplete (interrupted while "
                              f"being written?); resume from another one.") from None
    except OSError as exc:
        raise CheckpointError(f"checkpoint {folder}: cannot read {MANIFEST} ({_reason(exc)}).") from exc
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}); checkpoint {name} is "
                              f"corrupt, resume from another one.") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an llmq-ray checkpoint manifest.")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{path} has checkpoint format version {version!r}; this llmq-ray reads version "
                              f"{FORMAT_VERSION}.")
    for key in ("step", "world_size", "layout_numel", "model_config", "files"):
        if key not in manifest:
            raise CheckpointError(f"{path} lacks the entry {key!r}; checkpoint {name} is corrupt.")
    return manifest


def _checksum_error(folder: str, path: str) -> CheckpointError:
    name = os.path.basename(os.path.normpath(folder))
    return CheckpointError(f"shard file {path} fails its sha256 checksum (the bytes changed after the "
                           f"checkpoint was written); checkpoint {name} is corrupt, resume from another one.")


def _size_error(folder: str, path: str, size: int, recorded: Any) -> CheckpointError:
    name = os.path.basename(os.path.normpath(folder))
    return CheckpointError(f"shard file {path} has {size} bytes, the manifest records {recorded}: it is "
                           f"truncated or was replaced, so checkpoint {name} fails its checksum.")


def _check_file(folder: str, entry: Mapping, *, verify: bool) -> str:
    """Existence + size (and with ``verify`` the sha256) of one shard file; returns its path."""
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
        _verify_files(folder, [entry])
    return path


def hash_workers(n_files: int) -> int:
    """Threads that hash ``n_files`` files at once: one per file, at most the CPUs this process may run on
    (sha256 is CPU-bound at 0.5-2 GB/s a core, so more threads than cores gain nothing) and at most 32
    (concurrent readers past that only make a disk seek). Always >= 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(int(n_files), cpus, _HASH_THREADS_MAX))


def _verify_files(folder: str, entries: Sequence[Mapping], *, max_workers: int | None = None) -> None:
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
            err = CheckpointError(f"shard file {path} could not be read ({_reason(exc)}); checkpoint "
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


def validate_checkpoint(folder: str, *, verify_checksums: bool = False, max_workers: int | None = None) -> dict:
    """Validity check of a checkpoint folder or URI; returns its manifest (see ``_validate_local``)."""
    if storage.is_remote(folder):  # the same checks on the store (llmq_ray/checkpoints/remote.py)
        from llmq_ray.checkpoints.remote import validate_remote

        return validate_remote(folder, verify_checksums=verify_checksums)
    return _validate_local(folder, verify_checksums=verify_checksums, max_workers=max_workers)


def _validate_local(folder: str, *, verify_checksums: bool = False, max_workers: int | None = None) -> dict:
    """Validity check of a checkpoint folder; returns its manifest.

    Cheap part (always): the manifest parses, the ranges tile the layout and every file exists with its
    recorded size -- an incomplete or truncated checkpoint is refused here without reading any shard.
    With ``verify_checksums`` every file is then hashed against its recorded sha256 (``verify_checkpoint``).
    CheckpointError (one sentence naming the folder or the file) otherwise."""
    manifest = read_manifest(folder)
    name = os.path.basename(os.path.normpath(folder))
    _check_coverage(manifest["files"], int(manifest["layout_numel"]), f"checkpoint {name}")
    for entry in manifest["files"]:
        _check_file(folder, entry, verify=False)
    if verify_checksums:
        _verify_files(folder, manifest["files"], max_workers=max_workers)
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
        if not _exists(folder):
            have = [s for s, _ in list_step_dirs(ckpt_dir)]
            raise CheckpointError(f"--continue={arg}: there is no checkpoint {os.path.basename(folder)} in "
                                  f"{ckpt_dir} (steps present: {sorted(have) or 'none'}).")
    else:
        folder = os.fspath(arg)
        if not _exists(folder):
            raise CheckpointError(f"--continue={arg}: no such checkpoint folder.")
    validate_checkpoint(folder, verify_checksums=verify_checksums)
    return folder


def has_manifest(folder: str) -> bool:
    """The folder (or checkpoint URI) has its manifest: the cheapest sign of a published checkpoint."""
    path = storage.join(folder, MANIFEST)
    return storage.size_of(path) is not None if storage.is_remote(folder) else os.path.isfile(path)


def _exists(folder: str) -> bool:
    """A checkpoint folder is there: a local directory, or on a store any object under the prefix."""
    if storage.is_remote(folder):
        return bool(storage.list_names(folder))
    return os.path.isdir(folder)


def check_config(manifest: Mapping[str, Any], expected_config: ModelConfig, folder: str = "") -> None:
    """CheckpointError naming the first differing field when the checkpoint is of another model.

    The cosmetic ``name`` field is not compared (a preset and an HF folder of the same shape match)."""
    saved = manifest["model_config"]
    ours = json.loads(json.dumps(dataclasses.asdict(expected_config)))
    diffs = [k for k in ours if k != "name" and saved.get(k, "<absent>") != ours[k]]
    diffs += [k for k in saved if k not in ours]
    if diffs:
        k = diffs[0]
        name = os.path.basename(os.path.normpath(folder)) or f"step {manifest.get('step')}"
        more = f" (and {len(diffs) - 1} more fields differ)" if len(diffs) > 1 else ""
        raise CheckpointError(f"checkpoint {name} was written for {k}={saved.get(k, '<absent>')}, this run has "
                              f"{ours.get(k, '<absent>')}{more}; resume with the same model or use another "
                              f"checkpoint dir.")


def load_checkpoint(folder: str, *, expected_config: ModelConfig, world_size: int = 1, rank: int = 0,
                    shard_start: int | None = None, shard_end: int | None = None,
                    names: Sequence[str] = STATE_NAMES, verify_checksums: bool = True,
                    device: torch.device | str = "cpu") -> tuple[dict[str, torch.Tensor], dict]:
    """Read the state of the flat range [shard_start, shard_end) from a checkpoint, on any world size.

    The range defaults to ZeRO rank ``rank`` of ``world_size``'s (``ParamLayout.shard_range``). It is
    assembled from every saved rank file whose [start, end) overlaps it (resharding), reading only those
    slices. Every file read is checked for its size, and with ``verify_checksums`` (the default) hashed
    against its sha256 first (the files concurrently, as ``verify_checkpoint`` does). Pass
    ``verify_checksums=False`` only when the caller has just verified the whole folder (``resolve_continue``
    / ``verify_checkpoint``): hashing a 7B checkpoint again costs as long as reading it. Returns ({name: 1-D
    tensor of shard_end - shard_start elements in the saved dtype}, manifest). CheckpointError (one sentence
    naming the folder or file) for: another model config, a missing shard file, a size or checksum
    mismatch, a manifest that is not JSON."""
    import torch
    from safetensors import SafetensorError, safe_open

    from llmq_ray.model.params import ParamLayout

    manifest = read_manifest(folder)
    name = os.path.basename(os.path.normpath(folder))
    check_config(manifest, expected_config, folder)
    layout = ParamLayout(expected_config)
    if int(manifest["layout_numel"]) != layout.numel:
        raise CheckpointError(f"checkpoint {name} holds {manifest['layout_numel']} parameters, this model has "
                              f"{layout.numel}.")
    _check_coverage(manifest["files"], layout.numel, f"checkpoint {name}")
    if shard_start is None or shard_end is None:
        if not 0 <= rank < world_size:
            raise CheckpointError(f"load_checkpoint: rank {rank} is outside [0, world_size={world_size}).")
        shard_start, shard_end = layout.shard_range(rank, world_size)
    lo, hi = int(shard_start), int(shard_end)
    if not 0 <= lo <= hi <= layout.numel:
        raise CheckpointError(f"load_checkpoint: range [{lo}, {hi}) is not inside [0, {layout.numel}).")

    needed = [entry for entry in sorted(manifest["files"], key=lambda e: int(e["start"]))
              if max(int(entry["start"]), lo) < min(int(entry["end"]), hi)]
    for entry in needed:  # cheap checks of every file first, then hash them together
        _check_file(folder, entry, verify=False)
    if verify_checksums:
        _verify_files(folder, needed)
    pieces: dict[str, list[torch.Tensor]] = {k: [] for k in names}
    for entry in needed:
        s, e = int(entry["start"]), int(entry["end"])
        a, b = max(s, lo), min(e, hi)
        path = os.path.join(folder, entry["name"])
        try:
            with safe_open(path, framework="pt", device=str(device)) as f:
                meta = f.metadata() or {}
                if (meta.get("start"), meta.get("end")) != (str(s), str(e)):
                    raise CheckpointError(f"shard file {path} says it holds [{meta.get('start')}, {meta.get('end')}), "
                                          f"the manifest says [{s}, {e}); checkpoint {name} is inconsistent.")
                for k in names:
                    if k not in f.keys():
                        raise CheckpointError(f"shard file {path} has no tensor {k!r}; checkpoint {name} is corrupt.")
                    pieces[k].append(f.get_slice(k)[a - s:b - s])
        except SafetensorError as exc:
            raise CheckpointError(f"shard file {path} is not a readable safetensors file ({exc}); checkpoint "
                                  f"{name} is corrupt.") from None
    out: dict[str, torch.Tensor] = {}
    for k in names:
        if pieces[k]:
            out[k] = pieces[k][0] if len(pieces[k]) == 1 else torch.cat(pieces[k])
        else:  # empty range: an empty tensor of the saved dtype
            dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(
                (manifest["files"][0].get("dtypes") or {}).get(k, "fp32"), torch.float32)
            out[k] = torch.empty(0, dtype=dt, device=device)
        if out[k].numel() != hi - lo:  # cannot happen when the coverage check passed; guard anyway
            raise CheckpointError(f"checkpoint {name}: assembled {out[k].numel()} elements of {k!r} for [{lo}, {hi}).")
    return out, manifest


def data_world_size(manifest: Mapping[str, Any]) -> int:
    """The number of workers that trained the checkpoint (each read its own batches): "world_size" (the
    shard files), unless node-scoped ZeRO kept one copy of the shards for several nodes ("data_world_size")."""
    return int(manifest.get("data_world_size", manifest["world_size"]))


def data_state_for_rank(manifest: Mapping[str, Any], rank: int, world_size: int) -> dict | None:
    """The TokenStream state that rank ``rank`` of ``world_size`` (workers) restores from.

    Same number of workers as saved (``data_world_size``): the rank's own saved state. Another number: rank
    0's (ranks advance in lockstep, so every saved state holds the same epoch and cursor; TokenStream.restore
    rescales the cursor from the state's world_size, which is filled in from the manifest when the state
    lacks it)."""
    states = manifest.get("data_state") or []
    if not states:
        return None
    if data_world_size(manifest) == int(world_size) and rank < len(states):
        return states[rank]
    first = states[0]
    if first is not None and any(s is not None and (s.get("epoch"), s.get("cursor")) != (first.get("epoch"),
                                                                                          first.get("cursor"))
                                 for s in states):
        warnings.warn(f"checkpoint of step {manifest.get('step')}: the saved ranks' data positions differ; "
                      f"resuming on another world size from rank 0's.", CheckpointWarning, stacklevel=2)
    if first is None:
        return None
    # the cursor counts windows per saved rank: TokenStream.restore needs the saved world size to rescale it
    return {**first, "world_size": int(first.get("world_size", data_world_size(manifest)))}
