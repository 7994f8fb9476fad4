"""Which checkpoints stay: keep the newest N valid ones plus the "major" steps (multiples of M) forever, and set
aside the newer checkpoints of a branch a resume abandons.

Retention runs after every published save (actors/checkpointing.py, ``resume.save_checkpoint``) and keeps to the
cheap checks of verify.py (manifest, coverage, sizes): the checkpoints it looks at are ones this run has just
written and hashed. On an object store a checkpoint is a prefix, deleted through ``remote.clear_step``.

The settings layer checks the user's values (and says what a keep of 1 risks); ``apply_retention`` only asserts
that it was handed sane ones. Imports point one way: this module uses layout.py, remote.py, verify.py and
local.py; nothing in ``llmq_ray.checkpoints`` but resume.py imports it.
"""

from __future__ import annotations

import datetime
import os
import shutil
import warnings
from collections.abc import Sequence

from llmq_ray import storage
from llmq_ray.checkpoints.layout import OLD_RE, TMP_RE, CheckpointWarning, list_step_dirs
from llmq_ray.checkpoints.local import fsync_dir
from llmq_ray.checkpoints.remote import clear_step
from llmq_ray.checkpoints.verify import validate_checkpoint
from llmq_ray.errors import CheckpointError


def apply_retention(ckpt_dir: str, *, keep_n: int = 2, major_every: int = 0,
                    protect: Sequence[str] = ()) -> list[str]:
    """Delete old checkpoints: keep the newest ``keep_n`` (an int >= 1) valid ones plus every step that is a
    multiple of ``major_every`` (an int >= 0; 0: none) forever, and the folders in ``protect`` (the checkpoint
    just written: never deleted by its own save, even when the folder holds higher steps). Call only after the
    newest checkpoint is complete.

    Invalid folders older than the newest valid one go too (it supersedes them); folders newer than it are
    never deleted (an invalid newer folder is left for a human to look at); stale tmp folders of steps up
    to the newest valid checkpoint are removed. Returns the deleted paths."""
    if not (isinstance(keep_n, int) and keep_n >= 1 and isinstance(major_every, int) and major_every >= 0):
        raise ValueError(f"apply_retention: keep_n={keep_n!r} must be an int >= 1 and major_every={major_every!r} "
                         f"an int >= 0 (the settings layer checks the user's values).")
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
            clear_step(path)
        else:
            shutil.rmtree(path, ignore_errors=True)
        deleted.append(path)
    if remote:  # no tmp folders on a store: an unfinished upload is a step prefix, pruned above
        return deleted
    for name in os.listdir(ckpt_dir):
        m = TMP_RE.match(name) or OLD_RE.match(name)
        if m and int(m.group(1)) <= newest_kept:
            shutil.rmtree(os.path.join(ckpt_dir, name), ignore_errors=True)
            deleted.append(os.path.join(ckpt_dir, name))
    if deleted:
        fsync_dir(ckpt_dir)
    return deleted


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
    fsync_dir(ckpt_dir)
    return dest, sorted(os.path.basename(p) for _, p in newer)
