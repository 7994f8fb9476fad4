"""The coordinator's side of checkpoints: save a running group's state, load it into a fresh group, and
pick the checkpoint an automatic restart goes back to.

Save (after the update of the step whose number of completed updates is ``step``)::

    tmp = begin_checkpoint(ckpt_dir, step)                       # here
    (record, data_state) = worker.save_shard(tmp, step)           # every worker, concurrently (record None:
                                                                  # a node's copy of the shards, --zero-scope node)
    build_manifest + finalize_checkpoint (manifest last, rename)  # here, once all returned
    apply_retention(keep_n, major_every)

A worker that cannot write (full disk) raises its CheckpointError sentence: ``abort_checkpoint`` removes
the tmp folder and re-raises it (the previous checkpoint stays valid) -- that ends the run, since a restart
would not free the disk. A worker that dies or hangs while writing raises WorkerError: the tmp folder is
removed and the error goes on to the coordinator's restart logic. Either way nothing named ``step_*``
appears unless the whole checkpoint is complete.

Load: every worker calls ``load_checkpoint(folder)`` together (restoring the weights is a collective);
the saved world size may differ from the group's (resharding is done by llmq_ray/checkpoints/store.py). Each
worker hashes the files it reads against the manifest, unless the caller passes ``verified=True``: the
folder came from ``resolve_continue`` (--continue), which has just hashed every file of it, and hashing a
7B checkpoint twice would double the time to resume.

Restart: ``restart_point`` keeps to the cheap checks (manifest, coverage, sizes). Its candidates are
checkpoints this run wrote minutes ago (their sha256 computed from the bytes read back after fsync) or
the one it started from, so a same-size corruption there is unlikely; and the load that follows
(``verified=False``) still hashes every file it reads, so one would end the run in its one sentence
rather than train on bad state. Hashing in the chooser as well would add a full read of the checkpoint
to every automatic restart.
"""

from __future__ import annotations

import os
import time
import warnings

from llmq_ray import storage
from llmq_ray.actors.failures import gather
from llmq_ray.checkpoints.remote import begin as begin_remote, clear_step, publish
from llmq_ray.actors.spec import RuntimeSpec
from llmq_ray.checkpoints.store import (CheckpointWarning, abort_checkpoint, apply_retention, begin_checkpoint,
                                 build_manifest, discard_tmp, finalize_checkpoint, read_manifest, rng_state,
                                 step_dir, step_of, validate_checkpoint)
from llmq_ray.model.config import ModelConfig
from llmq_ray.errors import CheckpointError


def save_group_checkpoint(workers: list, spec: RuntimeSpec, cfg: ModelConfig, step: int, extra: dict,
                          timeout_s: float) -> dict:
    """Write the checkpoint of ``step`` from ``workers`` (rank order) and apply retention.

    Returns {"path", "seconds", "deleted" (paths retention removed), "warnings" (messages)}. Raises the
    CheckpointError of a failed write, or the WorkerError of a worker that died or hung."""
    t0 = time.perf_counter()
    ckpt_dir = spec.ckpt_dir
    remote = storage.is_remote(ckpt_dir)  # an object store: llmq_ray/checkpoints/remote.py
    target = step_dir(ckpt_dir, step) if remote else None
    if remote:
        clear_step(target)
    tmp = begin_remote(ckpt_dir, step) if remote else begin_checkpoint(ckpt_dir, step)
    try:
        out = gather([w.save_shard.remote(tmp, step, target) for w in workers], timeout_s,
                     f"checkpoint save (step {step})")
    except CheckpointError as exc:
        abort_checkpoint(tmp, step, exc)  # removes tmp, re-raises the worker's sentence
        raise  # not reached: abort_checkpoint always raises
    except BaseException:
        discard_tmp(tmp)
        raise
    records = [rec for rec, _ in out if rec is not None]  # --zero-scope node: the first node's shards only
    manifest = build_manifest(step, config=cfg, world_size=len(records), options=spec.opts,
                              data_state=[state for _, state in out], rng=rng_state(spec.opts.seed), extra=extra)
    final = publish(tmp, target, manifest, records) if remote else \
        finalize_checkpoint(tmp, step_dir(ckpt_dir, step), manifest, records=records)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CheckpointWarning)
        deleted = apply_retention(ckpt_dir, keep_n=spec.ckpt_keep_n, major_every=spec.ckpt_major, protect=[final])
    return {"path": final, "seconds": time.perf_counter() - t0, "deleted": deleted,
            "warnings": [str(w.message) for w in caught]}


def load_group_checkpoint(workers: list, folder: str, timeout_s: float, *, verified: bool = False) -> dict:
    """Every worker loads ``folder`` (together); returns its manifest (read here, without the tensors).

    ``verified``: every file of ``folder`` was just hashed against its sha256 (``resolve_continue`` /
    ``verify_checkpoint`` returned it), so the workers skip hashing again (they still check each file's
    size). False (the default): each worker verifies the sha256 of the files it reads."""
    manifest = read_manifest(folder)
    steps = gather([w.load_checkpoint.remote(folder, verified=bool(verified)) for w in workers], timeout_s,
                   f"loading checkpoint {folder}")
    if len(set(steps)) != 1 or steps[0] != int(manifest["step"]):
        raise CheckpointError(f"checkpoint {folder}: the workers loaded steps {sorted(set(steps))}, its manifest "
                              f"says {manifest['step']}; it changed while being loaded.")
    return manifest


def restart_point(candidates: list[str], max_step: int) -> tuple[str | None, list[str]]:
    """The newest valid checkpoint among ``candidates`` (folders this run wrote or started from) whose
    step is at most ``max_step``; returns (folder or None, messages about the ones skipped). Cheap checks
    only (see the module docstring): load the folder with ``verified=False``."""
    skipped = []
    ordered = sorted({c if storage.is_remote(c) else os.path.abspath(c) for c in candidates},
                     key=lambda p: step_of(p) or -1, reverse=True)
    for folder in ordered:
        step = step_of(folder)
        if step is None or step > max_step or not (storage.is_remote(folder) or os.path.isdir(folder)):
            continue
        try:
            validate_checkpoint(folder)
            return folder, skipped
        except CheckpointError as exc:
            skipped.append(f"skipping checkpoint {folder}: {exc}")
    return None, skipped
