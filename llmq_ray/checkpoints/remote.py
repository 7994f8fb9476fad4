"""Checkpoints on an object store (``--checkpoint-dir s3://bucket/run/ckpt``): the layout and manifest of
llmq_ray/checkpoints/store.py, published without renames.

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
rename, the manifest last) and loads from there with the local code; ``--continue`` hashes that copy against the
manifest before it picks the checkpoint, so a worker on the same node reuses it without reading the store again.
Keep-N and major-checkpoint retention (``store.apply_retention``) delete whole prefixes through ``clear_step``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from llmq_ray import storage
from llmq_ray.checkpoints import store
from llmq_ray.errors import CheckpointError


def _bare(uri: str) -> str:
    """``uri`` without its query and trailing slash: what names a checkpoint (the query only configures access)."""
    return uri.split("?")[0].rstrip("/")


def mirror_root(ckpt_uri: str) -> str:
    """This node's local folder for the checkpoints of ``ckpt_uri``: staging of uploads, copies of downloads."""
    key = hashlib.sha256(_bare(ckpt_uri).encode()).hexdigest()[:16]
    return os.path.join(storage.cache_root(), "checkpoints", key)


def begin(ckpt_uri: str, step: int) -> str:
    """The coordinator's local staging folder for ``step`` (what the workers write their shards into first)."""
    return store.begin_checkpoint(mirror_root(ckpt_uri), step)


def upload_rank_shard(tmp_dir: str, record: Mapping, step_uri: str) -> None:
    """Worker: upload its shard file (written and hashed in ``tmp_dir`` by ``store.write_rank_shard``) to the
    checkpoint's prefix, then drop the local file. A failed upload raises CheckpointError naming the store."""
    local = os.path.join(tmp_dir, record["name"])
    try:
        storage.upload(local, storage.join(step_uri, record["name"]))
    except OSError as exc:
        raise CheckpointError(f"checkpoint {os.path.basename(_bare(step_uri))} could not be uploaded to "
                              f"{step_uri} ({str(exc).splitlines()[0]}); the previous checkpoint is still "
                              f"valid.") from None
    finally:
        if os.path.exists(local):
            os.remove(local)


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
        store._check_coverage(files, int(manifest["layout_numel"]), f"checkpoint {name}")
        for f in files:  # what the store holds now, before the manifest makes it a checkpoint
            size = storage.size_of(storage.join(step_uri, f["name"]))
            if size != int(f["size"]):
                raise CheckpointError(f"checkpoint {name}: {f['name']} has {size} bytes on the store, its writer "
                                      f"uploaded {f['size']}; the checkpoint was not published.")
        full = dict(manifest)
        full["files"] = files
        storage.write_bytes(storage.join(step_uri, store.MANIFEST), (json.dumps(full, indent=1) + "\n").encode())
    except OSError as exc:
        raise CheckpointError(f"checkpoint {name}: its manifest could not be uploaded to {step_uri} "
                              f"({str(exc).splitlines()[0]}); the previous checkpoint is still valid.") from None
    finally:
        store.discard_tmp(tmp_dir)
    return step_uri


def clear_step(step_uri: str) -> None:
    """Before a step's shards are uploaded again (a resumed run re-reaching a saved step): remove the old
    prefix, manifest first, so that no mix of old and new files is ever a checkpoint."""
    manifest = storage.join(step_uri, store.MANIFEST)
    if storage.size_of(manifest) is not None:
        storage.delete_tree(manifest)
    storage.delete_tree(step_uri)


def validate_remote(step_uri: str, *, verify_checksums: bool = False) -> dict:
    """``store.validate_checkpoint`` for a checkpoint on a store: the manifest parses, the ranges tile the
    layout, every file is there with its recorded size; with ``verify_checksums`` the files are downloaded into
    this node's mirror and hashed there. Returns the manifest."""
    manifest = store.read_manifest(step_uri)
    name = os.path.basename(_bare(step_uri))
    store._check_coverage(manifest["files"], int(manifest["layout_numel"]), f"checkpoint {name}")
    for entry in manifest["files"]:
        size = storage.size_of(storage.join(step_uri, entry["name"]))
        if size is None:
            raise CheckpointError(f"checkpoint {name} is missing its shard file {entry['name']} (in {step_uri}); "
                                  f"it cannot be loaded, resume from another checkpoint.")
        if size != int(entry["size"]):
            raise CheckpointError(f"shard file {storage.join(step_uri, entry['name'])} has {size} bytes, the "
                                  f"manifest records {entry['size']}: checkpoint {name} is incomplete.")
    if verify_checksums:
        store.verify_checkpoint(fetch(step_uri, manifest))
    return manifest


def fetch(step_uri: str, manifest: Mapping | None = None) -> str:
    """A local copy of the checkpoint ``step_uri`` in this node's mirror (files whose local size already matches
    are kept; the manifest is written last). Returns the local folder, which the local loader reads."""
    manifest = manifest or store.read_manifest(step_uri)
    parent, name = _bare(step_uri).rsplit("/", 1)
    folder = os.path.join(mirror_root(parent), name)
    os.makedirs(folder, exist_ok=True)
    local_manifest = os.path.join(folder, store.MANIFEST)
    if os.path.exists(local_manifest):  # an older copy of this step: its files may be stale
        os.remove(local_manifest)
    try:
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
