"""Local-folder I/O of checkpoints: writing the shards without ever leaving a half-written ``step_*`` folder
(fsync, a tmp folder renamed into place), and reading any flat range back from the saved shards.

A checkpoint is written into ``<ckpt_dir>/.step_00000012.tmp-<id>/``; every file is flushed and fsynced,
the manifest goes in last, then the folder is renamed to ``step_00000012`` and ``ckpt_dir`` is fsynced.
A crash at any point leaves either a tmp folder (ignored by every reader) or a complete checkpoint, never
a ``step_*`` folder that looks valid but is not.

Multi-rank protocol (ranks share the filesystem of one node; the coordinator runs the rest)::

    tmp = begin_checkpoint(ckpt_dir, step)                                   # coordinator
    rec = write_rank_shard(tmp, rank, tensors, start, end)                   # every worker, concurrently
    manifest = build_manifest(step, config=..., options=..., world_size=W,   # coordinator, after all
                              data_state=[...per rank...], rng=rng_state(seed))  # workers returned
    final = finalize_checkpoint(tmp, step_dir(ckpt_dir, step), manifest, records=[rec0, rec1, ...])
    apply_retention(ckpt_dir, keep_n=2, major_every=0)                       # retention.py
    # if any worker raised: abort_checkpoint(tmp, step, cause) -> raises the one-sentence CheckpointError

For ``ckpt_dir`` on an object store, ``begin_checkpoint`` makes the staging folder in this node's mirror
(``remote.mirror_root``) and ``remote.publish`` takes the place of ``finalize_checkpoint``.

``load_checkpoint`` compares the model config and assembles any flat range [start, end) from the saved
shards, so a run may resume on another world size; it verifies the sha256 of every file it reads unless its
caller says the folder was just verified (``verify_checksums=False``). Imports point one way: this module uses
layout.py, remote.py and verify.py; retention.py and resume.py use it. torch and safetensors are imported by
the functions that handle tensors, so that importing this module stays cheap.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import uuid
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from llmq_ray import storage
from llmq_ray.checkpoints.layout import (FORMAT, FORMAT_VERSION, MANIFEST, RANK_FILE_RE, STATE_NAMES,
                                         CheckpointWarning, check_config, check_coverage, rank_file_name,
                                         read_manifest, reason_of_os_error, step_name, step_of_tmp)
from llmq_ray.checkpoints.remote import mirror_root
from llmq_ray.checkpoints.verify import HASH_CHUNK, check_file, file_sha256, find_latest_valid, verify_files
from llmq_ray.errors import CheckpointError
from llmq_ray.model.config import ModelConfig
from llmq_ray.model.params import ParamLayout

if TYPE_CHECKING:  # annotations only: the functions that need torch import it when called
    import torch

# dtype names by str(torch dtype) and by safetensors' dtype names, so no torch import is needed here
_DTYPE_NAMES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16",
                "F32": "fp32", "BF16": "bf16", "F16": "fp16"}


def _dtype_name(dtype: Any) -> str:
    """The short name (fp32, bf16, fp16) of a torch dtype or of a safetensors dtype name, else its str()."""
    return _DTYPE_NAMES.get(str(dtype), str(dtype))


# ---------------------------------------------------------------------------------------------------- low-level IO
def fsync_dir(path: str) -> None:
    """fsync a directory so that the entries created/renamed in it are durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_and_hash(path: str) -> tuple[int, str]:
    """fsync a just-written file and return (size, sha256 hex) of its bytes (read back in chunks)."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        h = hashlib.sha256()
        size = 0
        for chunk in iter(lambda: f.read(HASH_CHUNK), b""):
            h.update(chunk)
            size += len(chunk)
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


def _is_write_failure(exc: BaseException) -> bool:
    """OSError (full disk, permissions, vanished folder) or safetensors' own I/O error."""
    if isinstance(exc, OSError):
        return True
    try:
        from safetensors import SafetensorError
    except ImportError:  # pragma: no cover
        return False
    return isinstance(exc, SafetensorError)


def discard_tmp(tmp_dir: str) -> None:
    """Remove a temporary checkpoint folder (best effort; never raises)."""
    shutil.rmtree(tmp_dir, ignore_errors=True)


def _write_failed(tmp_dir: str, step: int | None, exc: BaseException, *, remove: bool = True) -> CheckpointError:
    """Remove the tmp folder (unless ``remove`` is False) and build the one-sentence error about a failed write."""
    if remove:
        discard_tmp(tmp_dir)
    ckpt_dir = os.path.dirname(os.path.normpath(tmp_dir))
    name = step_name(step) if step is not None else os.path.basename(tmp_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        prev = find_latest_valid(ckpt_dir, verify_checksums=False)  # a message only: no hashing on this path
    tail = (f"the previous checkpoint {os.path.basename(prev)} is still valid" if prev
            else "there is no earlier valid checkpoint in it")
    return CheckpointError(f"checkpoint {name} could not be written to {ckpt_dir} ({reason_of_os_error(exc)}); "
                           f"{tail}.")


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
    """Create and return the temporary folder ``<ckpt_dir>/.step_XXXXXXXX.tmp-<id>`` for ``step``; for a
    ``ckpt_dir`` on an object store, the staging folder of that name in this node's mirror of it.

    The coordinator calls this once and hands the path to every worker. Raises CheckpointError when the
    folder cannot be created (e.g. ckpt_dir not writable)."""
    if storage.is_remote(ckpt_dir):
        ckpt_dir = mirror_root(ckpt_dir)
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
    ``abort_checkpoint``, which removes the tmp folder (``resume.save_checkpoint`` does both in one process).
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
    step = step_of_tmp(tmp_dir)
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
        check_coverage(files, int(manifest["layout_numel"]), f"checkpoint {name}")
        full = dict(manifest)
        full["files"] = files
        _write_json(os.path.join(tmp_dir, MANIFEST), full)
        fsync_dir(tmp_dir)
        if os.path.exists(final_dir):  # re-reaching a step already saved (resumed from an older one)
            old = os.path.join(parent, f".{name}.old-{uuid.uuid4().hex[:12]}")
            os.rename(final_dir, old)
        os.rename(tmp_dir, final_dir)
        fsync_dir(parent)
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
        m = RANK_FILE_RE.match(fname)
        if not m:
            continue
        path = os.path.join(tmp_dir, fname)
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            dtypes = {k: _dtype_name(f.get_slice(k).get_dtype()) for k in f.keys()}
        out.append({"name": fname, "rank": int(m.group(1)), "start": int(meta["start"]), "end": int(meta["end"]),
                    "size": os.path.getsize(path), "sha256": file_sha256(path), "dtypes": dtypes})
    return out


# ---------------------------------------------------------------------------------------------------- reading
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

    manifest = read_manifest(folder)
    name = os.path.basename(os.path.normpath(folder))
    check_config(manifest, expected_config, folder)
    layout = ParamLayout(expected_config)
    if int(manifest["layout_numel"]) != layout.numel:
        raise CheckpointError(f"checkpoint {name} holds {manifest['layout_numel']} parameters, this model has "
                              f"{layout.numel}.")
    check_coverage(manifest["files"], layout.numel, f"checkpoint {name}")
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
        check_file(folder, entry, verify=False)
    if verify_checksums:
        verify_files(folder, needed)
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
