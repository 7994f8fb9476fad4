"""The coordinator's duties that keep a run's work: when a checkpoint is due and how it is written (in the
foreground, or staged and uploaded in the background to an object store, published once every rank's upload
ended), and what happens after a worker fails (naming the rank or the node that died, rebuilding the group and
resuming from the newest checkpoint that verifies, up to --max-restarts).

``CheckpointsAndRecovery`` is a base class of ``Coordinator`` (actors/coordinator.py), which runs the steps; the
actor's state stays one object. The group-wide checkpoint calls are actors/checkpointing.py's.
"""

from __future__ import annotations

import dataclasses
import os
import time

from llmq_ray.actors.checkpointing import (UploadFailed, load_group_checkpoint, poll_group_upload, publish_group_checkpoint, restart_point,
                                           save_group_checkpoint, stage_group_checkpoint, upload_failed_message)
from llmq_ray.actors.failures import (WorkerError, dead_nodes_of, find_hung_ranks, probe_activities,
                                      wait_for_dead_nodes)
from llmq_ray.actors.fault_injection import next_group_faults
from llmq_ray.actors.placement import TooFewWorkers
from llmq_ray.errors import ConfigError
from llmq_ray.observe.runlog import checkpoint_line


def _is_checkpoint(path: str) -> bool:
    """A checkpoint this run wrote is still there (a local folder, or a manifest on an object store)."""
    from llmq_ray import storage
    from llmq_ray.checkpoints.layout import has_manifest

    return has_manifest(path) if storage.is_remote(path) else os.path.isdir(path)


class CheckpointsAndRecovery:
    """The part of ``Coordinator`` the module docstring describes; its attributes are the Coordinator's."""

    def _explain_hang(self, pending: list[int], failed: int | None, error) -> WorkerError | None:
        """``gather``'s ``explain`` for train_step: the error naming the rank(s) that hung (see
        ``find_hung_ranks``), or None when the error that came back is the cause itself."""
        died: set = set()
        activities = probe_activities(self.workers, pending + ([failed] if failed is not None else []), died=died)
        hung = find_hung_ranks(activities, pending, failed)
        if not hung:
            return None

        def ranks(rs):
            return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {', '.join(map(str, rs))}"

        who, waiting = ranks(hung), [r for r in pending if r not in hung]
        gone = sorted(r for r in hung if r in died)  # their actors are dead: a lost process or node, not a hang
        lost = wait_for_dead_nodes(self.nodes, gone) if gone else dead_nodes_of(self.nodes, hung)
        if lost:  # not a hang: the machine is gone (Ray marked its node dead)
            ips = ", ".join(sorted({self.nodes[r]["ip"] for r in lost}))
            return WorkerError(f"node {ips} died during step {self.step + 1} (Ray reports it dead), taking "
                               f"{ranks(sorted(lost))} with it.")
        if gone:
            return WorkerError(f"{ranks(gone)} died during step {self.step + 1} (its process exited or was killed; "
                               f"Ray reports the actor dead, its node alive); see the Ray logs of that actor.")
        known = [activities[r] for r in hung if activities[r] is not None]
        if known:
            a = known[0]
            step = a["step"] if a["step"] is not None else self.step
            where = f"step {step + 1}, {a['what']}, with no progress for {a['seconds']:.0f} s"
        else:
            where = f"step {self.step + 1}, not even answering a status probe (a frozen process?)"
        if failed is not None:
            return WorkerError(f"{who} hung in {where}, and rank {failed} gave up waiting for it: "
                               f"{str(error).rstrip('.')}.")
        also = f" while {ranks(waiting)} waited for it" if waiting else ""
        return WorkerError(f"{who} hung in {where}{also}: the step did not finish within "
                           f"--step-timeout-s={self.plan.settings.checkpoints.step_timeout_s:g}.")

    def _name_lost_node(self, exc: WorkerError) -> WorkerError:
        """A rank that died in any call (a checkpoint save, an eval): when Ray reports its node dead (within
        failures.NODE_DEATH_WAIT_S), the error names the node instead of the process."""
        rank = getattr(exc, "died_rank", None)
        if rank is None or rank >= len(self.nodes):
            return exc
        if not wait_for_dead_nodes(self.nodes, [rank]):
            return exc
        return WorkerError(f"node {self.nodes[rank]['ip']} died during {exc.during} (Ray reports it dead), taking "
                           f"rank {rank} with it.")

    def _checkpoint_due(self) -> bool:
        """After a step: every ``ckpt_interval`` steps, or when ``ckpt_minutes`` of training passed since the last
        checkpoint (or the start of this group)."""
        n, m = self.plan.settings.checkpoints.ckpt_interval, self.plan.settings.checkpoints.ckpt_minutes
        if n > 0 and self.step % n == 0:
            return True
        return m > 0 and time.monotonic() - self._last_checkpoint_t >= 60.0 * m

    def save_checkpoint(self, background: bool = False) -> dict:
        """Checkpoint the current state (``self.step`` updates completed) into ckpt_dir/step_XXXXXXXX and
        apply retention. Returns {"path", "seconds", "deleted", "line"}. ``background`` (the step loop's
        checkpoints, on an object store): return once every rank has staged its shard, "pending" True; the
        uploads go on and ``_settle_upload`` publishes the checkpoint at a later step boundary."""
        if self.micro_pending:
            raise RuntimeError("save_checkpoint() between step() and update(): call update() first.")
        from llmq_ray import storage

        lines = self._settle_upload(wait=True, why="a checkpoint was asked for")  # one upload at a time
        extra = {"spike_guard": self.guard.state(), "restarts": self.restarts}
        staged = background and storage.is_remote(self.plan.ckpt_dir)
        try:
            if staged:
                pending = stage_group_checkpoint(self.workers, self.plan, self.cfg, self.step, extra,
                                                 self.plan.settings.checkpoints.call_timeout_s)
            else:
                info = save_group_checkpoint(self.workers, self.plan, self.cfg, self.step, extra,
                                             self.plan.settings.checkpoints.call_timeout_s)
        except UploadFailed as exc:  # the store could not be reached: the run goes on without this one
            return {"path": None, "seconds": 0.0, "deleted": [], "line": "\n".join(lines + [self._upload_failed(exc)])}
        except WorkerError:
            self.failed = True
            raise
        self._last_checkpoint_t = time.monotonic()
        if staged:
            self._upload = pending
            self.log.add("checkpoint_staged", step=self.step, path=pending.target, seconds=pending.staged_s)
            self.log.flush()
            line = checkpoint_line(self.step, pending.target, pending.staged_s) + " | staged, uploading"
            return {"path": pending.target, "seconds": pending.staged_s, "deleted": [], "pending": True,
                    "line": "\n".join(lines + [line])}
        return self._published(info, self.step, lines)

    def _published(self, info: dict, step: int, lines: list | None = None) -> dict:
        """Book a complete checkpoint of ``step`` (log record, retention's warnings); sets info["line"]."""
        self.checkpoints = [p for p in self.checkpoints if p != info["path"]] + [info["path"]]
        rec = {"step": step, "path": info["path"], "seconds": info["seconds"], "deleted": info["deleted"]}
        if "upload_seconds" in info:  # uploaded in the background: published at this later step boundary
            rec.update(upload_seconds=info["upload_seconds"], background=True, published_at_step=self.step)
        self.log.add("checkpoint", **rec)
        for m in info["warnings"]:
            self._warn(step, "checkpoint", m)
        self.log.flush()
        line = checkpoint_line(step, info["path"], info["seconds"])
        if "upload_seconds" in info:
            line += f" | uploaded in the background ({info['upload_seconds']:.1f} s), published"
        info["line"] = "\n".join((lines or []) + [line])
        return info

    def _settle_upload(self, wait: bool, why: str = "") -> list[str]:
        """The checkpoint uploading in the background: once every rank's upload is done, publish it (or warn
        that it failed). ``wait``: block until then, logged as an "upload_wait" record with the seconds
        waited and ``why``. Returns console lines. Raises WorkerError when a worker died."""
        pending = self._upload
        if pending is None:
            return []
        if not self.workers:  # the group is gone (torn down): so is the upload
            self._drop_upload()
            return []
        waited = None
        try:
            statuses = poll_group_upload(self.workers, pending, wait=False, timeout_s=self.plan.settings.checkpoints.call_timeout_s)
            if statuses is None and wait:
                t0 = time.perf_counter()
                statuses = poll_group_upload(self.workers, pending, wait=True, timeout_s=self.plan.settings.checkpoints.call_timeout_s)
                waited = time.perf_counter() - t0
        except WorkerError:
            self.failed = True
            raise
        if statuses is None:
            return []
        self._upload, lines = None, []
        if waited is not None:
            self.log.add("upload_wait", step=self.step, checkpoint_step=pending.step, path=pending.target,
                         seconds=waited, reason=why)
            lines.append(f"[C] step {self.step:5d} | waited {waited:.1f} s for the upload of checkpoint "
                         f"{pending.target} ({why})")
        try:
            info = publish_group_checkpoint(self.plan, pending, statuses)
        except UploadFailed as exc:
            return lines + [self._upload_failed(exc)]
        return lines + [self._published(info, pending.step)["line"]]

    def _defer_checkpoint(self) -> list[str]:
        """A checkpoint is due while the previous one still uploads (the store is slower than the interval): take
        it at the first step boundary after that upload is published, instead of waiting for the network. The
        first deferral of a checkpoint is a warning (record kind "checkpoint_deferred"); returns its line."""
        if self._deferred is not None:
            return []
        self._deferred = self.step
        pending = self._upload
        line = self._warn(self.step, "checkpoint_deferred",
                          f"checkpoint of step {self.step} deferred: the upload of step {pending.step} to "
                          f"{self.plan.ckpt_dir} is still running (the store takes longer than the checkpoint "
                          f"interval); it is taken once that upload is done, the steps go on meanwhile.",
                          upload_step=pending.step)
        return [line]

    def _upload_failed(self, exc: UploadFailed) -> str:
        """The warning of a checkpoint that could not be uploaded (the run goes on); returns its line."""
        from llmq_ray.checkpoints.layout import step_of

        older = [p for p in self.checkpoints + ([self.origin] if self.origin else [])
                 if (step_of(p.split("?")[0]) or -1) < exc.step]
        previous = max(older, key=lambda p: step_of(p.split("?")[0]) or -1) if older else None
        line = self._warn(exc.step, "checkpoint_upload", upload_failed_message(exc, previous), path=exc.target,
                          reason=exc.reason)
        self.log.flush()
        return line

    def _drop_upload(self) -> None:
        """The group that was uploading a checkpoint is gone: that checkpoint is never published."""
        pending, self._upload = self._upload, None
        if pending is not None:
            from llmq_ray.checkpoints.local import discard_tmp

            discard_tmp(pending.tmp)
            self._warn(pending.step, "checkpoint_upload", f"checkpoint of step {pending.step} was still uploading "
                       f"to {pending.target} when its workers were stopped; it was not published.")

    def _recover(self, exc: WorkerError) -> list[str]:
        """After a worker failure: rebuild the group and load the restart point, or re-raise ``exc`` when
        restarts are off or used up. Returns the console lines of what happened."""
        failed_step = self.step
        exc = self._name_lost_node(exc)
        self.log.add("failure", step=failed_step, error=str(exc), restarts=self.restarts)
        self._teardown()
        limit = self.plan.settings.checkpoints.max_restarts
        if not self.plan.checkpoints_on or limit <= 0:
            self.log.flush()
            raise exc
        if self.restarts >= limit:
            final = WorkerError(f"{str(exc).rstrip('.')}; gave up after {self.restarts} automatic restart(s) "
                                f"(--max-restarts={limit}).")
            self.log.end("restarts_exhausted", step=self.step, error=str(final), restarts=self.restarts)
            raise final from None
        self.restarts += 1
        if self.plan.fault:  # the test hook: what fires in the next group (actors/fault_injection.py)
            self.plan = dataclasses.replace(self.plan, fault=next_group_faults(self.plan.fault))
        folder, skipped = restart_point(self.checkpoints + ([self.origin] if self.origin else []), failed_step)
        lines = [self._warn(failed_step, "failure", f"{exc} -- restart {self.restarts}/{limit} from "
                            f"{folder or 'scratch (no checkpoint yet)'}")]
        lines += [self._warn(None, "checkpoint", m) for m in skipped]
        self.log.add("restart", attempt=self.restarts, failed_step=failed_step, checkpoint=folder)
        self.log.flush()
        t0 = time.perf_counter()
        hint = ("raise --restart-wait-s to wait longer" if self.plan.settings.checkpoints.elastic else
                "pass --elastic to go on with the workers that can be placed, or raise --restart-wait-s")
        elastic = self.plan.settings.checkpoints.elastic
        try:
            while True:
                try:
                    self._launch(wait_s=self.plan.settings.checkpoints.restart_wait_s, why=hint, elastic=elastic, restart=True)
                    break
                except TooFewWorkers as few:  # --elastic: a node is gone for good; go on with fewer workers
                    shrunk = self._shrink(few.room)
                    if shrunk is None:  # not even one worker fits: wait for room like a run without --elastic
                        elastic = False
                    else:
                        lines.append(shrunk)
        except ConfigError as err:
            final = WorkerError(f"{str(exc).rstrip('.')}; restart {self.restarts}/{limit} gave up: {err}")
            self.log.end("failed", step=self.step, error=str(final), restarts=self.restarts)
            raise final from None
        if folder:
            lines.append(self._resume(folder, f"restart {self.restarts}"))
        elif self.origin is None:
            self.step, self.micro_pending, self.history = 0, 0, []
            self.guard.load_state(None)
        else:
            raise exc  # unreachable: the run's origin checkpoint was valid when it started (kept by retention)
        self.log.add("restarted", attempt=self.restarts, step=self.step, pids=list(self.pids),
                     seconds=time.perf_counter() - t0)
        return lines

    def _has_checkpoint_of(self, step: int) -> str | None:
        """The checkpoint of ``step`` this run wrote or started from, if it is still there."""
        existing = [p for p in self.checkpoints + ([self.origin] if self.origin else [])
                    if os.path.basename(p.split("?")[0]) == f"step_{step:08d}" and _is_checkpoint(p)]
        return existing[-1] if existing else None

    def _shrink(self, room: int) -> str | None:
        """--elastic after a lost node: go on with the most workers (at most ``room``) that divide the global
        batch, raising --grad-accumulation so the global batch stays; the checkpoint is resharded when loaded.
        Returns the warning line, or None when no smaller group fits (room 0)."""
        plan, o = self.plan, self.settings
        t = plan.settings.parallel.tensor_parallel  # whole tensor-parallel groups only: a group computes one micro-batch
        total = plan.data_parallel_size * o.data.grad_accumulation  # micro-batches per optimizer step
        fits = [n for n in range(t, min(room, plan.world_size - 1) + 1, t) if total % (n // t) == 0]
        if not fits:
            return None
        n = fits[-1]
        ga = total // (n // t)
        self.log.add("elastic", step=self.step, from_world_size=plan.world_size, world_size=n,
                     from_grad_accumulation=o.data.grad_accumulation, grad_accumulation=ga)
        line = self._warn(self.step, "elastic", f"--elastic: the cluster can place {room} of {plan.world_size} "
                          f"worker(s); going on with {n}, --grad-accumulation {o.data.grad_accumulation} -> {ga} (the global "
                          f"batch stays {total} x {o.data.batch_size} sequences).")
        self.settings = dataclasses.replace(o, data=dataclasses.replace(o.data, grad_accumulation=ga))
        self.plan = dataclasses.replace(plan, world_size=n, settings=self.settings)
        return line

    def _resume(self, folder: str, reason: str) -> str:
        """Load checkpoint ``folder`` into the current group and go on from its step; returns the [C] line."""
        t0 = time.perf_counter()
        try:
            # --continue's folder was hashed whole before Ray started (resolve_continue): not again per rank
            manifest = load_group_checkpoint(self.workers, folder, self.plan.settings.checkpoints.call_timeout_s,
                                             verified=reason == "continue")
        except BaseException:
            self.failed = True
            raise
        self.step, self.micro_pending = int(manifest["step"]), 0
        self.history = [r for r in self.history if r["step"] <= self.step]
        self.guard.load_state(manifest.get("spike_guard"))
        self.origin = folder
        seconds = time.perf_counter() - t0
        self.log.add("resume", step=self.step, path=folder, reason=reason, saved_world_size=manifest["world_size"],
                     world_size=self.plan.world_size, seconds=seconds)
        self.log.flush()
        return checkpoint_line(self.step, folder, seconds) + (
            f" | resumed ({reason}), saved on {manifest['world_size']} worker(s), now {self.plan.world_size}")
