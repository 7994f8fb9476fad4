"""How many earlier runs' outputs a fresh run keeps beside its own in one local ``--out-dir``.

A fresh run (no ``--continue``) never overwrites an earlier run's outputs: the earlier default checkpoint folder
is moved aside as ``ckpt.before-<UTC time>`` as the run starts, the earlier export as ``export.before-<UTC time>``
when the run exports, the earlier log as ``log.before-<UTC time>.jsonl`` (``observe/runlog.py``). Without a limit
every rerun of a demo added its checkpoints and export (three runs of the CPU demo left 962 MB), so as the run
starts ``prune_earlier_outputs`` keeps ``KEEP_EARLIER`` (1) earlier copy of each beside the current ones and
removes the older ones, in one line each:

* ``export.before-*``: the newest ``KEEP_EARLIER`` earlier exports stay, counting the export still at
  ``out-dir/export`` (this run sets it aside when it exports); older ones are removed.
* ``ckpt.before-*``: the newest ``KEEP_EARLIER`` stay. An older one is removed only when its run had finished
  (its newest checkpoint holds the run's last step, ``step == --steps`` of that run) or it holds no checkpoint
  with a manifest: a run that stopped or failed before its last step can still be continued from it
  (``--continue out/ckpt.before-.../step_...``), so it is never removed, and a line says it was kept and why
  (also when its manifest does not say the run's ``--steps``: nothing is removed on a guess).
* ``log.before-*.jsonl`` are all kept (a few kB each: the record of what ran).

Only the default locations of a local out-dir are touched (a ``--checkpoint-dir`` the user named is never moved
or removed; a fresh run into one that holds checkpoints is refused), and only on a fresh run: ``--continue``
removes nothing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Optional

KEEP_EARLIER = 1  # earlier copies of the checkpoints and of the export kept beside the current ones
_SET_ASIDE = re.compile(r"^(ckpt|export)\.before-(\d{8}T\d{6}Z)(?:-(\d+))?$")
_STEP = re.compile(r"^step_(\d{8})$")


def _size(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def _mb(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def set_aside_copies(out_dir: str, kind: str) -> list[str]:
    """The ``<kind>.before-*`` folders of ``out_dir`` ("ckpt" or "export"), oldest first."""
    try:
        names = os.listdir(out_dir)
    except OSError:
        return []
    found = []
    for name in names:
        m = _SET_ASIDE.match(name)
        if m and m.group(1) == kind and os.path.isdir(os.path.join(out_dir, name)):
            found.append(((m.group(2), int(m.group(3) or 1)), os.path.join(out_dir, name)))
    return [path for _, path in sorted(found)]


def _run_steps(options) -> Optional[int]:
    """The run's --steps in a manifest's "train_options" (flat, or one settings section deep), else None."""
    if not isinstance(options, dict):
        return None
    for where in [options] + [v for v in options.values() if isinstance(v, dict)]:
        steps = where.get("steps")
        if isinstance(steps, int) and not isinstance(steps, bool):
            return steps
    return None


def unfinished_checkpoint(folder: str) -> Optional[tuple[str, int, Optional[int]]]:
    """(newest checkpoint folder, its step, the run's --steps or None when the manifest does not say) when the
    checkpoints in ``folder`` are of a run that had not reached its last step and can still be continued;
    None when the run finished, or when ``folder`` holds no checkpoint with a readable manifest (nothing that
    ``--continue`` would take)."""
    try:
        steps = sorted(((int(m.group(1)), name) for name in os.listdir(folder) if (m := _STEP.match(name))),
                       reverse=True)
    except OSError:
        return None
    for _, name in steps:  # the newest checkpoint with a manifest (an incomplete newer one is skipped, as --continue)
        path = os.path.join(folder, name)
        try:
            with open(os.path.join(path, "manifest.json")) as f:
                manifest = json.load(f)
            done = int(manifest["step"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        total = _run_steps(manifest.get("train_options"))
        return None if total is not None and done >= total else (path, done, total)
    return None


def prune_earlier_outputs(out_dir: str, keep: int = KEEP_EARLIER) -> list[str]:
    """Remove the earlier runs' checkpoints and exports of ``out_dir`` beyond the newest ``keep`` of each (see the
    module docstring). Returns the lines to print: one for what was removed, one per folder kept against the
    count (a run that can still be continued)."""
    lines, removed, freed = [], [], 0
    exports = set_aside_copies(out_dir, "export")
    live = 1 if os.path.isdir(os.path.join(out_dir, "export")) else 0  # set aside when this run exports
    for path in exports[:max(len(exports) - max(keep - live, 0), 0)]:
        freed += _size(path)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(os.path.basename(path))
    ckpts = set_aside_copies(out_dir, "ckpt")
    for path in ckpts[:max(len(ckpts) - keep, 0)]:
        open_run = unfinished_checkpoint(path)
        if open_run is not None:
            newest, step, total = open_run
            of = f" of {total}" if total else ""
            lines.append(f"earlier outputs: kept {path}: its run stopped at step {step}{of} and can still be "
                         f"continued (--continue {newest}); delete it when it is no longer needed")
            continue
        freed += _size(path)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(os.path.basename(path) + " (a finished run's checkpoints)")
    if removed:
        kept = "the previous run's" if keep == 1 else f"the {keep} previous runs'"
        lines.insert(0, f"earlier outputs: removed {', '.join(removed)} from {out_dir} ({_mb(freed)}); a fresh run "
                        f"keeps {kept} checkpoints and export beside its own")
    return lines
