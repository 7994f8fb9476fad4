"""The coordinator's side of checkpoints: save a running group's state, load it into a fresh group, and
pick the checkpoint an automatic restart goes back to.

Save (after the update of the step whose number of completed updates is ``step``)::

    tmp = begin_checkpoint(ckpt_dir, step)                       # here
    (record, data_state) = worker.save_shard(tmp, step)           # every worker, concurrently (record None:
                                                                  # a node's copy of the shards, --zero-scope node)
    build_manifest + finalize_checkpoint (manifest last, rename)  # here, once all returned
    apply_retention(keep_n, major_every)

On an object store (``--checkpoint-dir s3://...``) the step loop's checkpoints upload in the background
(llmq_ray/checkpoints/remote.py has the protocol)::

    pending = stage_group_checkpoint(...)       # clear the step's prefix; every worker writes + hashes its shard
                                                # and starts uploading it on its own thread; the step loop goes on
    statuses = poll_group_upload(..., wait=False)   # at every step boundary: None while a rank still uploads
    publish_group_checkpoint(plan, pending, statuses)   # all done: the manifest last, then retention

The coordinator (actors/coordinator.py, ``_settle_upload``) waits (``wait=True``) only when the next
checkpoint is due while this one still uploads, and at the end of the run. A failed upload raises
``UploadFailed``: the staged copy and the step's prefix are removed and the coordinator logs one warning
(``upload_failed_message``); the previous checkpoint stays the newest valid one and the run goes on.
Other saves (local folders, and any save outside the step loop) go through ``save_group_checkpoint``,
which returns only when the checkpoint is complete.

A worker that cannot write (full disk) raises its CheckpointError sentence: ``abort_checkpoint`` removes
the tmp folder and re-raises it (the previous checkpoint stays valid) -- that ends the run, since a restart
would not free the disk. A worker that dies or hangs while writing raises WorkerError: the tmp folder is
removed and the error goes on to the coordinator's restart logic. Either way nothing named ``step_*``
appears unless the whole checkpoint is complete.

Load: every worker calls ``load_checkpoint(folder)`` together (restoring the weights is a collective);
the saved world size may differ from the group's (resharding is done by llmq_ray/checkpoints/local.py). Each
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

import dataclasses
import os
import time
import warnings

from llmq_ray import storage
from llmq_ray.actors.failures import gather
from llmq_ray.checkpoints.layout import CheckpointWarning, build_manifest, read_manifest, step_dir, step_of
from llmq_ray.checkpoints.local import abort_checkpoint, begin_checkpoint, discard_tmp, finalize_checkpoint
from llmq_ray.checkpoints.remote import clear_step, publish, reason_of
from llmq_ray.checkpoints.retention import apply_retention
from llmq_ray.checkpoints.verify import validate_checkpoint
from llmq_ray.actors.plan import RunPlan
from llmq_ray.settings.overrides import flat
from llmq_ray.model.config import ModelConfig
from llmq_ray.errors import CheckpointError


class UploadFailed(CheckpointError):
    """The checkpoint of ``step`` could not be uploaded to ``target``; the run goes on without it."""

    def __init__(self, step: int, target: str, reason: str):
        super().__init__(f"checkpoint of step {step} could not be uploaded to {target}: {reason}.")
        self.step, self.target, self.reason = step, target, reason


def upload_failed_message(exc: UploadFailed, previous: str | None) -> str:
    """The one-sentence warning of a failed background upload; ``previous``: the newest valid checkpoint."""
    tail = (f"the previous checkpoint {os.path.basename(previous.split('?')[0].rstrip('/'))} stays the newest "
            f"valid one" if previous else "there is no earlier valid checkpoint")
    return f"checkpoint of step {exc.step} could not be uploaded to {exc.target}: {exc.reason}; {tail}."


@dataclasses.dataclass
class PendingUpload:
    """A checkpoint staged on every rank whose shards are uploading in the background."""
    step: int
    tmp: str            # the coordinator's staging folder (removed when published or failed)
    target: str         # the step's prefix on the store
    manifest: dict      # built at staging time: the state of ``step``
    records: list       # every rank's write record (name, range, size, sha256)
    started: float      # time.perf_counter() when staging began
    staged_s: float     # how long the step loop waited (staging)


def _write_shards(workers: list, tmp: str, step: int, target: str | None, timeout_s: float,
                  background: bool = False) -> list:
    """Every worker writes its shard into ``tmp`` (and uploads it to ``target`` on a store); [(record, data
    state, FP8 scale state)] by rank. A failed write removes ``tmp`` and raises (see the module docstring)."""
    try:
        return gather([w.save_shard.remote(tmp, step, target, background) for w in workers], timeout_s,
                      f"checkpoint save (step {step})")
    except CheckpointError as exc:
        abort_checkpoint(tmp, step, exc)  # removes tmp, re-raises the worker's sentence
        raise  # not reached: abort_checkpoint always raises
    except BaseException:
        discard_tmp(tmp)
        raise


def _manifest_of(out: list, plan: RunPlan, cfg: ModelConfig, step: int, extra: dict) -> tuple[dict, list]:
    """(manifest, shard records) of the checkpoint of ``step`` from the workers' [(record, data state[, FP8
    scale state])]. Its world size is the number of shard files: under --zero-scope node only the first node's
    ranks write one (the other nodes hold copies, record None), while every worker's data state is kept. Under
    --tensor-parallel only rank 0 of each group writes (a shard of the whole model's layout) and gives the
    group's data state (the others return (None, None, ...)): the checkpoint looks like one of W / T workers.
    The delayed FP8 scales of every worker are kept, in rank order (they differ on every rank)."""
    records = [o[0] for o in out if o[0] is not None]
    states = [o[1] for o in out if not (o[0] is None and o[1] is None)]
    scales = [o[2] if len(o) > 2 else None for o in out]
    # the seed only: the coordinator draws no random numbers, so its torch generator state would say nothing
    # (and importing torch here would cost the coordinator ~3 s on a small machine)
    manifest = build_manifest(step, config=cfg, world_size=len(records), options=flat(plan.settings),
                              data_state=states, rng={"seed": int(plan.settings.optim.seed)}, extra=extra,
                              fp8_scale_state=scales, tensor_parallel=plan.settings.parallel.tensor_parallel)
    return manifest, records


def _retain(plan: RunPlan, final: str) -> tuple[list, list]:
    """Apply retention after ``final`` was published; (deleted paths, warning messages)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CheckpointWarning)
        try:
            deleted = apply_retention(plan.ckpt_dir, keep_n=plan.settings.checkpoints.ckpt_keep_n, major_every=plan.settings.checkpoints.ckpt_major,
                                      protect=[final])
        except OSError as exc:  # a store that went away after the manifest: nothing deleted, say so
            deleted = []
            warnings.warn(f"retention after checkpoint {os.path.basename(final.split('?')[0])} could not list or "
                          f"delete older checkpoints ({reason_of(exc)}); they are kept.", CheckpointWarning)
    return deleted, [str(w.message) for w in caught]


def save_group_checkpoint(workers: list, plan: RunPlan, cfg: ModelConfig, step: int, extra: dict,
                          timeout_s: float) -> dict:
    """Write the checkpoint of ``step`` from ``workers`` (rank order) and apply retention; on a store the
    uploads are done when this returns.

    Returns {"path", "seconds", "deleted" (paths retention removed), "warnings" (messages)}. Raises the
    CheckpointError of a failed write, or the WorkerError of a worker that died or hung."""
    t0 = time.perf_counter()
    ckpt_dir = plan.ckpt_dir
    remote = storage.is_remote(ckpt_dir)  # an object store: llmq_ray/checkpoints/remote.py
    target = step_dir(ckpt_dir, step) if remote else None
    if remote:
        clear_step(target)
    tmp = begin_checkpoint(ckpt_dir, step)  # on a store: the staging folder in this node's mirror
    out = _write_shards(workers, tmp, step, target, timeout_s)
    manifest, records = _manifest_of(out, plan, cfg, step, extra)
    final = publish(tmp, target, manifest, records) if remote else \
        finalize_checkpoint(tmp, step_dir(ckpt_dir, step), manifest, records=records)
    deleted, messages = _retain(plan, final)
    return {"path": final, "seconds": time.perf_counter() - t0, "deleted": deleted, "warnings": messages}


def stage_group_checkpoint(workers: list, plan: RunPlan, cfg: ModelConfig, step: int, extra: dict,
                           timeout_s: float) -> PendingUpload:
    """A checkpoint of ``step`` on the store ``plan.ckpt_dir``, staged: every worker has written and hashed
    its shard and uploads it in the background; the manifest is built (not uploaded). Raises UploadFailed
    when the store cannot be reached to clear the step's prefix, the CheckpointError of a failed local write,
    or the WorkerError of a worker that died or hung."""
    t0 = time.perf_counter()
    target = step_dir(plan.ckpt_dir, step)
    try:
        clear_step(target)
    except OSError as exc:
        raise UploadFailed(step, target, reason_of(exc)) from None
    tmp = begin_checkpoint(plan.ckpt_dir, step)  # the staging folder in this node's mirror
    out = _write_shards(workers, tmp, step, target, timeout_s, background=True)
    manifest, records = _manifest_of(out, plan, cfg, step, extra)
    return PendingUpload(step, tmp, target, manifest, records, t0, time.perf_counter() - t0)


def poll_group_upload(workers: list, pending: PendingUpload, *, wait: bool, timeout_s: float) -> list | None:
    """Every rank's upload status of ``pending`` (see ``GPUWorker.upload_status``), or None while one still
    runs. ``wait``: block until all are done; an upload still running after about ``timeout_s`` counts as
    failed. Raises WorkerError when a worker died."""
    wait_s = max(1.0, timeout_s - 30.0)
    statuses = gather([w.upload_status.remote(pending.step, wait, wait_s if wait else None) for w in workers],
                      timeout_s, f"checkpoint upload (step {pending.step})")
    if all(s["done"] for s in statuses):
        return statuses
    if not wait:
        return None
    return [s if s["done"] else {"done": True, "error": f"the upload did not finish within {wait_s:.0f} s",
                                 "seconds": wait_s} for s in statuses]


def publish_group_checkpoint(plan: RunPlan, pending: PendingUpload, statuses: list) -> dict:
    """Every rank's upload of ``pending`` is done: upload the manifest and apply retention. Returns {"path",
    "seconds" (staging: what the step loop waited), "upload_seconds", "deleted", "warnings"}. Raises
    UploadFailed when a rank's upload or the manifest's failed (the staged copy and the step's prefix are
    removed)."""
    failed = [(r, s["error"]) for r, s in enumerate(statuses) if s.get("error")]
    reason = None
    if any(rec.get("pending") for rec in pending.records):  # written on the upload threads: their records now
        by_rank = {int(s["record"]["rank"]): s["record"] for s in statuses if s.get("record")}
        pending.records = [by_rank.get(int(rec["rank"]), rec) if rec.get("pending") else rec
                           for rec in pending.records]
    if failed:
        rank, why = failed[0]
        reason = f"{why} (rank {rank}" + (f" and {len(failed) - 1} more" if len(failed) > 1 else "") + ")"
        discard_tmp(pending.tmp)
    else:
        try:
            final = publish(pending.tmp, pending.target, pending.manifest, pending.records)
        except CheckpointError as exc:
            reason = getattr(exc, "reason", None) or str(exc).rstrip(".")
    if reason is not None:
        try:  # the objects some ranks did upload: no reader takes them for a checkpoint, but they are clutter
            clear_step(pending.target)
        except OSError:
            pass
        raise UploadFailed(pending.step, pending.target, reason)
    deleted, messages = _retain(plan, final)
    return {"path": final, "seconds": pending.staged_s,
            "upload_seconds": time.perf_counter() - pending.started - pending.staged_s, "deleted": deleted,
            "warnings": messages}


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
