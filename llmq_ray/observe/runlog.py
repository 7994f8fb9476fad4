"""Run logs: llm.q-shaped console lines and the JSON Lines log.

Console (one line per optimizer step, one per eval)::

    [T] step    12 [ 12.0%] | time:   183 ms | norm   1.2345 | loss   6.1234 | tps   44.8k | sol  45.1%
    [V] step    50 [ 50.0%] | time:  1204 ms | eval loss   5.4321 | batches 8

JSON Lines log (``out/log.jsonl``): one record per line, each a dict with a "log" key naming its kind, in the
order they happened:
"options" (all run options), "gpu" (one per rank: device, name, memory table), "sol" (FLOPs/token,
peaks), "dataset" (files, token counts), "allocator" (memory table of rank 0), "step" (per optimizer
step), "eval", "checkpoint" (one per checkpoint written), "resume" (the checkpoint a run started from, or went
back to after a restart), "warning" (a skipped update, a loss or grad-norm spike, a skipped checkpoint;
with a "kind"), "failure" and "restart" (a worker died or hung and the group was rebuilt), "summary", and last
"end": why the run ended (``reason`` "finished", "stopped" (by a signal or ``request_stop()``; with
``signal``, ``step`` and ``checkpoint``), "failed" (with ``error``, the one-sentence message) or
"restarts_exhausted"). ``RunLog.add`` appends each record to the file as it happens (a reader such as
``tail -f``, the plot script or the W&B replay sees every step at once); ``RunLog.flush()`` also asks the
disk to keep what was written (fsync) at the points that matter: set-up, evals, checkpoints, the end. The only
thing a crash can leave is a last line cut short while it was written: ``read_log`` skips it, and a resumed run
cuts it off before appending, so the file is always whole records. (Logs of earlier versions, one JSON list,
are still read, and a resumed run rewrites such a log as lines first.)

Step numbers are the console's everywhere: 1-based, the number of optimizer updates done once the step is
over. The log's "step" record of the first step has ``"step": 1``, as its ``[T] step 1`` line; an "eval",
"checkpoint" or "end" record's ``step`` is the number of the last step trained before it, so the checkpoint
written after ``[T] step 400`` is ``step_00000400``, its record says 400, and ``--continue 400`` goes on with
``[T] step 401``. (Logs of earlier versions numbered their "step" records from 0.)

One log describes a whole run across resumes: a run started with ``--continue`` reads the existing log and
appends to it (``RunLog(path, resume=True)``): its set-up records, a "resume" record, then the new steps. A
step trained again after going back to a checkpoint (the steps between that checkpoint and a crash) carries
``"retrained": true``; ``steps_as_one_run`` keeps the newest record of every step, which is what the plot
script draws. A fresh run never overwrites another run's log: an earlier log at the same path is kept beside
it as ``<name>.before-<UTC time>.jsonl`` (the trainer refuses an explicit ``--log-file`` that exists unless
the run continues it).

A log on an object store (``--out-dir s3://bucket/run`` or ``--log-file s3://...``; any URI llmq_ray/storage.py
resolves) is written on the coordinator's node into a staging copy (``$LLMQ_RAY_CACHE/staging/log-<hash of the
URI>.jsonl``, one per log URI, reused by the next run of that URI) exactly as a local log is, and the whole file
is uploaded to the URI at every ``flush()`` (set-up, evals, checkpoints, the end). Object stores have no append,
but a put of a whole object replaces the previous one at once: a reader of the URI always gets whole records,
up to the last flush (the staging copy has every line as it happens). A resumed run downloads the log first; a
fresh run copies an earlier run's log at the URI to ``<name>.before-<UTC time>.jsonl`` beside it and removes it.
An upload that fails at a flush during the run is tried again at the next one; one that fails at the end raises.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import shutil
from typing import Optional

from llmq_ray import storage

END_REASONS = ("finished", "stopped", "failed", "restarts_exhausted")


def _num(x: Optional[float], width: int, prec: int) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return f"{'nan' if x is not None else '-':>{width}}"
    return f"{x:{width}.{prec}f}"


def _tps(x: float) -> str:
    if x >= 1e6:
        return f"{x / 1e6:6.2f}M"
    if x >= 1e3:
        return f"{x / 1e3:6.1f}k"
    return f"{x:7.0f}"


def step_line(step: int, total: int, seconds: float, norm: float, loss: float, tps: float,
              sol: Optional[float], skipped: "bool | str" = False) -> str:
    """``[T]`` line of 0-based ``step`` of ``total``; ``sol`` is a fraction or None; ``skipped``: True or the
    reason the update was skipped."""
    pct = 100.0 * (step + 1) / max(total, 1)
    sol_s = f"{100 * sol:5.1f}%" if sol is not None else "    -"
    reason = skipped if isinstance(skipped, str) else "non-finite gradient"
    tail = f" | SKIPPED ({reason})" if skipped else ""
    return (f"[T] step {step + 1:5d} [{pct:5.1f}%] | time: {1000 * seconds:6.0f} ms | norm {_num(norm, 8, 4)} | "
            f"loss {_num(loss, 8, 4)} | tps {_tps(tps)} | sol {sol_s}{tail}")


def eval_line(step: int, total: int, seconds: float, loss: float, batches: int, final: bool = False) -> str:
    pct = 100.0 * step / max(total, 1)
    what = "final eval loss" if final else "eval loss"
    return (f"[V] step {step:5d} [{pct:5.1f}%] | time: {1000 * seconds:6.0f} ms | {what} {_num(loss, 8, 4)} | "
            f"batches {batches}")


def warning_line(step: Optional[int], message: str) -> str:
    """``[!]`` line of a warning (a skipped update, a spike, a skipped checkpoint, a restart)."""
    where = f"step {step:5d}" if step is not None else "run"
    return f"[!] {where} | {message}"


def checkpoint_line(step: int, path: str, seconds: float) -> str:
    """``[C]`` line of a checkpoint written (or loaded) at ``step`` (updates completed)."""
    return f"[C] step {step:5d} | time: {1000 * seconds:6.0f} ms | checkpoint {path}"


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary sibling and os.replace (never half-written)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_json(path: str, obj) -> None:
    """Write ``obj`` as JSON to ``path`` atomically (``atomic_write_text``)."""
    atomic_write_text(path, json.dumps(obj, indent=1, default=_json_default) + "\n")


def _json_default(o):
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    return str(o)


def _dumps(record: dict) -> str:
    return json.dumps(record, default=_json_default)


def read_log(path: str) -> list[dict]:
    """The records of a run log: JSON Lines (one record per line; a last line cut short by a crash is skipped)
    or the single JSON list of earlier versions; ``path`` may be a URI (a log on an object store). ValueError
    naming the file (and line) otherwise."""
    if storage.is_remote(path):
        text = storage.read_bytes(path).decode()
    else:
        with open(path) as f:
            text = f.read()
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    else:
        records, lines = [], text.split("\n")
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                if i == len(lines) - 1:  # no newline after it: the record being written when the run died
                    break
                raise ValueError(f"{path} line {i + 1} is not valid JSON ({exc.msg})") from None
    if not isinstance(records, list) or not all(isinstance(r, dict) and "log" in r for r in records):
        raise ValueError(f"{path} is not an llmq-ray run log (expected records with a 'log' key)")
    return records


def _open_for_append(path: str, records: list[dict]):
    """``path`` opened for appending records: an earlier version's JSON list is first rewritten as lines
    (atomically), and a last line cut short by a crash is cut off, so new lines start on a line of their own."""
    with open(path, "rb") as f:
        data = f.read()
    if data.lstrip().startswith(b"["):
        atomic_write_text(path, "".join(_dumps(r) + "\n" for r in records))
    elif data and not data.endswith(b"\n"):
        with open(path, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)
    return open(path, "a")


def last_logged_step(records: list[dict]) -> int:
    """The highest step number (1-based, as on the console) of the log's step records (0 when there is none)."""
    return max((int(r["step"]) for r in records if r.get("log") == "step"), default=0)


def steps_as_one_run(records: list[dict]) -> list[dict]:
    """The step records of a log as one run: the newest record of every step, in step order (a step that
    was trained again after a restart or a resume replaces its earlier record)."""
    newest: dict[int, dict] = {}
    for r in records:
        if r.get("log") == "step":
            newest[int(r["step"])] = r
    return [newest[k] for k in sorted(newest)]


def staging_path(uri: str) -> str:
    """The local staging copy of the run log at ``uri`` (an object store) on this node: one file per log URI
    under the cache's ``staging/`` (a run of the same URI reuses it; the driver finds the coordinator's there)."""
    base = storage.split_query(uri)[0]
    key = hashlib.sha256(base.encode()).hexdigest()[:16]
    ext = os.path.splitext(base)[1] or ".jsonl"
    return os.path.join(storage.cache_root(), "staging", f"log-{key}{ext}")


def append_records(path: str, new: list[dict]) -> None:
    """Append records to the run log at ``path`` (created if missing) and fsync. For the driver, which writes
    the last record itself when the coordinator is gone. A log on an object store is downloaded, appended to
    and uploaded whole; when this node holds the coordinator's staging copy of it (``staging_path``) and the
    object at the URI is the start of that copy, the copy is used instead: it has the records written since
    the coordinator's last flush."""
    if storage.is_remote(path):
        folder = storage.staging_dir("log-append")
        try:
            local = os.path.join(folder, "log.jsonl")
            uploaded = storage.read_bytes(path) if storage.size_of(path) is not None else b""
            staged = staging_path(path)
            mine = b""
            if uploaded and os.path.isfile(staged):
                with open(staged, "rb") as f:
                    mine = f.read()
            with open(local, "wb") as f:
                f.write(mine if mine.startswith(uploaded) and uploaded else uploaded)
            append_records(local, new)
            storage.upload(local, path)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return
    if not os.path.isfile(path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    f = _open_for_append(path, read_log(path)) if os.path.isfile(path) else open(path, "a")
    with f:
        f.write("".join(_dumps(r) + "\n" for r in new))
        f.flush()
        os.fsync(f.fileno())


def set_aside_name(path: str, default_ext: str = ".jsonl") -> str:
    """Where a fresh run keeps an earlier run's file or folder found at ``path``: ``<stem>.before-<UTC time><ext>``
    (``default_ext`` when ``path`` has none; "" for a folder such as the export)."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    base, query = storage.split_query(path)  # a URI keeps its query at the end
    exists = (lambda p: storage.exists(p + query)) if storage.is_remote(path) else os.path.exists
    stem, ext = os.path.splitext(base)
    ext = ext or default_ext
    name, n = f"{stem}.before-{stamp}{ext}", 1
    while exists(name):  # two fresh runs in one second: never replace the first one's kept copy
        n += 1
        name = f"{stem}.before-{stamp}-{n}{ext}"
    return name + query


class RunLog:
    """The run log of one run: ``add(kind, **fields)`` appends a record, to the list ``records`` and as a line
    to the file; ``flush()`` makes the disk keep it (fsync; called at set-up, after each eval and checkpoint,
    and at the end). ``path`` None: records in memory only.

    ``resume=True``: the records already in the file are kept and the new ones appended (a run continued
    from a checkpoint); ``resume=False``: a file already there is renamed to ``set_aside_name(path)`` before
    the first record is written, never overwritten. ``previous_last_step``: the highest step the earlier
    records logged.

    ``path`` a URI (an object store): the lines go to a staging copy on this node (``staging_path``) and every
    ``flush()`` uploads the whole file to the URI (the module docstring says why that is safe)."""

    def __init__(self, path: Optional[str], resume: bool = False):
        self.remote = bool(path) and storage.is_remote(path)
        self.path = (path if self.remote else os.path.abspath(path)) if path else None
        self._local = staging_path(path) if self.remote else self.path  # the file the lines are written to
        self.records: list[dict] = []
        self.listeners: list = []  # callables fed every new record (e.g. the live W&B logger)
        self.set_aside: Optional[str] = None  # where an earlier run's log went (fresh runs)
        self.upload_error: Optional[str] = None  # the last failed upload of a remote log (retried at each flush)
        self._resume = resume
        self._file = None  # opened at the first record
        if self.remote and resume:
            os.makedirs(os.path.dirname(self._local), exist_ok=True)
            if storage.size_of(self.path) is not None:
                storage.download(self.path, self._local)
            elif os.path.exists(self._local):
                os.unlink(self._local)  # an earlier run's staging copy of a log that is no longer there
        if resume and self._local and os.path.isfile(self._local):
            self.records = read_log(self._local)
        self.previous_last_step = last_logged_step(self.records)
        self.ended = False  # this session's "end" record is written (an earlier session's may be in records)

    def _open(self):
        if self._file is None and self._local is not None:
            if self._resume and os.path.isfile(self._local):
                self._file = _open_for_append(self._local, self.records)
            else:
                if self.remote:
                    if storage.exists(self.path):  # an earlier run's log: kept beside it, like a local one
                        self.set_aside = set_aside_name(self.path)
                        storage.copy_file(self.path, self.set_aside)
                        storage.delete_tree(self.path)
                elif os.path.exists(self.path):
                    self.set_aside = set_aside_name(self.path)
                    os.replace(self.path, self.set_aside)
                os.makedirs(os.path.dirname(self._local), exist_ok=True)
                self._file = open(self._local, "w" if self.remote else "a")
        return self._file

    def add(self, kind: str, /, **fields) -> dict:
        rec = {"log": kind, **fields}
        f = self._open()  # before the record joins ``records``: an old-format log is rewritten from them
        self.records.append(rec)
        if f is not None:
            f.write(_dumps(rec) + "\n")
            f.flush()  # whole lines reach the file as they happen (the OS keeps them if this process dies)
        for listener in self.listeners:
            listener(rec)
        return rec

    def end(self, reason: str, **fields) -> Optional[dict]:
        """Add the run's last record, {"log": "end", "reason": ..., **fields}, and flush; a no-op when this
        session already ended the log (the first reason given is the true one)."""
        if reason not in END_REASONS:
            raise ValueError(f"end reason {reason!r} is not one of {END_REASONS}")
        if self.ended:
            return None
        self.ended = True
        rec = self.add("end", reason=reason, **fields)
        self.flush(strict=True)
        return rec

    def flush(self, strict: bool = False) -> None:
        """Ask the disk to keep every record written so far (fsync); opens the file if nothing was written. A
        remote log is then uploaded whole; a failed upload is kept in ``upload_error`` and tried again at the
        next flush, or (``strict``: the end) raised as OSError naming the URI."""
        f = self._open()
        if f is not None:
            f.flush()
            os.fsync(f.fileno())
            if self.remote:
                self._upload(strict)

    def _upload(self, strict: bool) -> None:
        try:
            storage.upload(self._local, self.path)
            self.upload_error = None
        except OSError as exc:
            self.upload_error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if strict:
                raise OSError(f"the run log could not be uploaded to {self.path} ({self.upload_error}); every "
                              f"record is in {self._local} on this node") from None

    def close(self) -> None:
        if self._file is not None:
            self.flush()
            self._file.close()
            self._file = None
