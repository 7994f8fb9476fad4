"""``Coordinator``: the Ray actor that drives a run's workers step by step, evaluates, exports and logs (its
checkpoint duties and the recovery after a failed worker are its base class, actors/coordinator_checkpoints.py).

Per optimizer step it makes one call per worker, ``GPUWorker.train_step(step, lr)``; each worker runs its
grad-accumulation micro-steps and the update (gradient reduce-scatter -- at the last micro-step under
ZeRO-1, at every micro-step under ZeRO-2 -- global-norm all-reduce, clip, AdamW on its shard, all-gather
of the weights) and reports a small dict. Nothing goes back to the coordinator between micro-steps; the
update's stats are the one host sync. The coordinator then:

* logs the step (JSON record; the console line goes back to the caller, who prints it),
* publishes Ray metrics (tokens/s, loss, norm, step time),
* runs the spike guard (llmq_ray/engine/spike_guard.py) and logs a "warning" record for every skipped update or
  loss/grad-norm spike,
* writes a checkpoint every ``ckpt_interval`` steps and every ``ckpt_minutes`` minutes of training, and after
  the last step when the minutes are on (the default; actors/checkpointing.py),
* evaluates every ``eval_every_n_steps`` steps on ``eval_num_steps`` batches, and at ``finish()`` over the
  whole eval file, then exports the weights as an HF folder (from a worker on the coordinator's node when
  there is one, so the export lands on the driver's machine).

Fault tolerance: when a worker dies, hangs (a step takes longer than ``step_timeout_s``, or a peer's
collective times out waiting for it) or fails with an unexpected exception, ``train_step`` tears the whole
group down (kills every worker, releases the placement group), places a new group, loads the newest
valid checkpoint this run wrote (or started from; from scratch when there is none yet), trains the lost
steps again and then the step it was asked for -- up to
``max_restarts`` times per run, with "failure" / "restart" / "resume" records in the log. This needs
checkpoints (``ckpt_interval`` or ``ckpt_minutes``, on by default); without them the first failure ends the run. User errors (config,
data, a checkpoint that cannot be written) are never retried. Placing the new group waits up to
``restart_wait_s`` for room (a "waiting" record and line) and then gives up in one sentence; with ``elastic`` it
goes on with the workers the alive nodes can hold (``_shrink``: the global batch kept by raising the gradient
accumulation, an "elastic" record). A rank whose actor died while its node's raylet stops answering is named by
its node once Ray reports the node dead (``_name_lost_node``). The driver starts a new coordinator if this one
dies (llmq_ray/train/trainer.py, ``_replace_coordinator``). The step-level calls (``micro_step`` /
``update``) do not restart by themselves. A hang is pinned on the rank that hung, not on the peers that
wait for it in a collective (actors/failures.py, ``find_hung_ranks``); when the restarts are used up, the
run ends with one sentence naming that rank and the timeout.

Step-level calls for custom loops (``LLMQTrainer.step`` / ``update`` / ``validate`` / ``export``) map onto
``micro_step`` / ``update`` / ``validate`` / ``export`` here.

Stopping (SIGTERM, a scheduler's preemption, ``LLMQTrainer.request_stop()``, or Ray's drain notice for a node
of ours, which ``train_step`` reports as "drain" after the step it ends with): the driver calls
``request_stop`` (in the probe concurrency group, beside a running step), so a ``train_step`` queued behind
the running one returns at once without training; then ``stop`` writes a checkpoint of the last completed
step (unless one exists or the caller says not to) and the log's "end" record. Every way a run ends leaves
such a record: "finished" (``finish``), "stopped", "restarts_exhausted" (``_recover``) or "failed" (``end``,
called by the driver with the error sentence).

The log of a run continued from a checkpoint is appended to (llmq_ray/observe/runlog.py); a step at or below the
highest step already logged is marked ``"retrained": true``.

The trainer schedules this actor on the driver's node, so ``out_dir`` and the log are local to the user.
"""

from __future__ import annotations

import math
import os
import time

from llmq_ray.actors import telemetry
from llmq_ray.actors.actor_env import apply_env
from llmq_ray.actors.telemetry import merge_fp8_monitors, merge_saturated_shares
from llmq_ray.actors.coordinator_checkpoints import CheckpointsAndRecovery, _is_checkpoint
from llmq_ray.actors.failures import WorkerError, gather, probe_activities
from llmq_ray.actors.placement import check_tensor_parallel_placement, create_workers
from llmq_ray.actors.plan import RunPlan
from llmq_ray.model.config import resolve_model
from llmq_ray.observe.metrics import sol_fraction, sol_record
from llmq_ray.lr_schedule import learning_rate_at
from llmq_ray.observe.runlog import RunLog, eval_line, step_line, warning_line
from llmq_ray.engine.spike_guard import SpikeGuard
from llmq_ray.errors import CheckpointError, ConfigError
from llmq_ray.settings.overrides import flat



class Coordinator(CheckpointsAndRecovery):
    """Owns the placement group and the workers of one run (they die with it)."""

    def __init__(self, plan: RunPlan, env: dict | None = None):
        apply_env(env)  # the driver's forwarded variables, before anything here reads one (actors/actor_env.py)
        self.plan = plan
        self.settings = plan.settings
        self.nodes: list = []  # per rank, once placed: {"node_id", "ip", ...}
        self.cfg, _ = resolve_model(plan.settings.model.model)
        from llmq_ray import storage  # out_dir may be a URI: the log is then staged here and uploaded

        telemetry.set_run_id(plan.settings.observe.run_id)  # the run_id tag of every metric the coordinator publishes
        self.log = RunLog(plan.settings.observe.log_file or storage.join(plan.settings.observe.out_dir, "log.jsonl"), resume=bool(plan.resume_from) or plan.append_log)
        self.max_step_logged = self.log.previous_last_step  # steps at or below it are trained again
        self.wandb = None
        if plan.settings.observe.wandb_project:
            from llmq_ray.observe.wandb_logger import WandbLogger

            wandb_dir = (os.path.join(storage.cache_root(), "wandb", plan.settings.observe.run_id or "run")
                         if storage.is_remote(plan.settings.observe.out_dir) else plan.settings.observe.out_dir)  # W&B writes a local folder
            self.wandb = WandbLogger(plan.settings.observe.wandb_project, plan.settings.observe.wandb_run_name, flat(plan.settings),
                                     dir=wandb_dir)
            self.log.listeners.append(self.wandb.log_record)
        self.step = 0               # optimizer steps done
        self.micro_pending = 0      # micro-steps done since the last update (step-level API)
        self.workers: list = []
        self.pg = None
        self.gpu_name: str | None = None
        self.peak = None
        self.history: list[dict] = []
        self.evals: list[dict] = []
        self.export_path: str | None = None
        self._export_rank = 0
        self.failed = False         # a worker call failed: shutdown() kills without asking them to close
        self.pids: list[int] = []
        self.guard = SpikeGuard(plan.settings.checkpoints.spike_window, plan.settings.checkpoints.spike_threshold)
        self.checkpoints: list[str] = []   # written by this run, oldest first
        self._upload = None                # a checkpoint uploading in the background, not yet published
        self.origin: str | None = None     # the checkpoint this run (or its last restart) started from
        self.restarts = 0
        self.skipped_steps = 0
        self.warnings = 0
        self.eval_count = 0                # evals started (their tag, for progress())
        self._eval_running: dict | None = None
        self.stop_requested = False        # set by request_stop(): queued train_steps return untrained
        self._exported: set[str] = set()   # export folders this run wrote (replaced on a second export)
        self._last_checkpoint_t = time.monotonic()  # --ckpt-minutes counts from here (reset by every checkpoint)
        self._drain_checked = 0.0          # when Ray's list of draining nodes was last asked for
        self._deferred: int | None = None  # the step whose checkpoint waits for the previous upload to finish

    # ------------------------------------------------------------------ set-up
    def start(self, notes: list | None = None) -> dict:
        """Place the workers, form the process group, build the engines; with ``plan.resume_from`` load that
        checkpoint. ``notes``: warnings the caller already printed (skipped checkpoints), logged here.
        Returns the set-up info, with "step" (where the run goes on) and "lines" (console lines)."""
        plan = self.plan
        t0 = time.perf_counter()
        if plan.append_log:  # started by the driver after the previous coordinator died: wait for room as a restart
            infos, nodes = self._launch(wait_s=plan.settings.checkpoints.restart_wait_s, restart=True,
                                        why="raise --restart-wait-s to wait longer")
        else:
            infos, nodes = self._launch()
        sol = sol_record(self.cfg, self.settings.data.seq_len, self.gpu_name, self.settings.numerics.matmul_dtype)
        self.peak = sol["peak_tflops"]
        self.log.add("options", **flat(self.settings), world_size=plan.world_size, resume_from=plan.resume_from,
                     append_log=plan.append_log, rendezvous_ports=plan.rendezvous_ports)
        for r, (info, node) in enumerate(zip(infos, nodes)):
            self.log.add("gpu", rank=r, device=info["device"], name=info["device_name"], node_ip=node["ip"],
                         local_rank=node["local_rank"], pid=node["pid"])
        self.log.add("sol", **sol)
        self.log.add("dataset", **infos[0]["dataset"])
        for r, info in enumerate(infos):
            self.log.add("allocator", rank=r, **info["memory"])
        self.log.add("backend", line=infos[0]["backend"])
        # the start-up line of the kernels: which ops are the backend's own and which the torch reference's
        lines = [f"kernels: {infos[0]['backend']}"]
        lines += [self._warn(None, "checkpoint", m) for m in notes or []]
        if plan.resume_from:
            lines.append(self._resume(plan.resume_from, "continue"))
        self.log.flush()
        if self.log.set_aside:
            lines.append(f"log: an earlier run's log at {self.log.path} was kept as {self.log.set_aside}")
        import ray

        return {"world_size": plan.world_size, "gpu": self.gpu_name,
                "coordinator_node": ray.get_runtime_context().get_node_id(), "device": infos[0]["device"],
                "nodes": nodes, "memory": infos[0]["memory"], "memories": [i["memory"] for i in infos],
                "dataset": infos[0]["dataset"],
                "seconds": time.perf_counter() - t0, "log_file": self.log.path, "step": self.step, "lines": lines}

    def _launch(self, wait_s: float | None = None, why: str = "", elastic: bool = False,
                restart: bool = False) -> tuple[list, list]:
        """Place a new group of workers and set them up; returns (set-up infos, nodes) by rank. ``wait_s``: how
        long the placement may wait for room (default: placement.py's), saying so in the log and on the console
        when it has to wait; ``why``: what to change to wait longer, named when the time is up; ``elastic``:
        raise placement's TooFewWorkers as soon as the alive nodes cannot hold the group; ``restart``: placed
        again after a failure (a cluster smaller than the group is waited for)."""
        import ray

        plan = self.plan
        self.failed = False
        kwargs = {} if wait_s is None else {"wait_s": wait_s}
        self.pg, self.workers, nodes = create_workers(plan, on_wait=self._waiting, why=why, elastic=elastic,
                                                      restart=restart, **kwargs)
        try:
            if plan.settings.parallel.tensor_parallel > 1:  # a group exchanges activations every layer: one node (NVLink)
                check_tensor_parallel_placement([n["node_id"] for n in nodes], plan.settings.parallel.tensor_parallel)
            address = gather([self.workers[0].rendezvous_address.remote()], 60.0, "rendezvous")[0]
            self.log.add("rendezvous", address=address)  # where the process group meets (firewalls, debugging)
            infos = gather([w.setup.remote(address, nodes[r]["local_rank"]) for r, w in enumerate(self.workers)],
                           max(plan.settings.checkpoints.collective_timeout_s, 120.0) + 60.0, "set-up")
        except BaseException:
            self.failed = True  # a rank that failed set-up leaves the others waiting in the rendezvous
            raise
        self.nodes = nodes  # per rank: node_id, ip (a dead node is named by its IP, see _explain_hang)
        here = ray.get_runtime_context().get_node_id()
        self._export_rank = next((r for r, n in enumerate(nodes) if n["node_id"] == here), 0)
        self.gpu_name = infos[0]["device_name"] if plan.settings.parallel.device == "cuda" else None
        self.pids = [n["pid"] for n in nodes]
        return infos, nodes

    def _waiting(self, message: str) -> None:
        """The placement has to wait for room: a "waiting" log record, and the line on the driver's console
        (an actor's stdout reaches the driver) while the step call is still running."""
        self.log.add("waiting", step=self.step, message=message)
        self.log.flush()
        print(f"llmq-ray: {message}", flush=True)

    # ------------------------------------------------------------------ helpers
    def lr_at(self, step: int) -> float:
        o = self.settings
        return learning_rate_at(step, base_lr=o.optim.learning_rate, total_steps=o.optim.steps, warmup_steps=o.optim.warmup,
                                schedule=o.optim.lr_schedule, final_lr_fraction=o.optim.final_lr_fraction,
                                cooldown_fraction=o.optim.cooldown_fraction)

    def _call(self, method: str, *args, what: str | None = None, timeout: float | None = None,
              explain=None) -> list:
        refs = [getattr(w, method).remote(*args) for w in self.workers]
        try:
            return gather(refs, timeout or self.plan.settings.checkpoints.call_timeout_s, what or method, explain)
        except BaseException:
            self.failed = True  # the others may be stuck in a collective: never wait on them again
            raise

    def _record_step(self, step: int, lr: float, results: list[dict], wall: float, tokens: int) -> dict:
        r0 = results[0]
        tps = tokens / max(wall, 1e-9)
        sol = sol_fraction(tps / self.plan.world_size, self.cfg.flops_per_token(self.settings.data.seq_len), self.peak)
        worker_s = max(r.get("seconds", 0.0) for r in results)
        number = step + 1  # a step's number in every record, as on the console and in step_XXXXXXXX: 1-based
        rec = {"step": number, "lr": lr, "loss": r0["loss"], "norm": r0["norm"], "targets": r0["targets"],
               "tokens": tokens, "seconds": wall, "tokens_per_s": tps, "sol": sol, "skipped": r0["skipped"],
               "worker_seconds": worker_s, "ray_overhead_seconds": max(wall - worker_s, 0.0),
               "data_seconds": max(r.get("data_seconds", 0.0) for r in results),
               "memory": [r.get("memory", 0) for r in results]}
        if number <= self.max_step_logged:  # trained before, then lost to a restart or a resume from an older step
            rec["retrained"] = True
        self.max_step_logged = max(self.max_step_logged, number)
        rec["gc_seconds"] = max(r.get("gc_seconds", 0.0) for r in results)  # the cyclic collector's pauses
        rec["gc_collections"] = max(r.get("gc_collections", 0) for r in results)
        if r0.get("allocator_events"):  # CUDA caching-allocator mallocs/frees/retries in this step (rank 0)
            rec["allocator_events"] = r0["allocator_events"]
        if r0.get("skip_reason"):
            rec["skip_reason"] = r0["skip_reason"]
        self.history.append(rec)
        self.log.add("step", **rec)
        for r, res in enumerate(results):
            if res.get("gpu_util"):
                self.log.add("gpu_util", rank=r, **res["gpu_util"])
        monitors = [res["fp8_monitor"] for res in results if res.get("fp8_monitor")]
        if monitors:  # --fp8-monitor-every: per layer, the largest |SwiGLU output| of the step on any rank
            per_layer, top = merge_fp8_monitors([m["swiglu_absmax"] for m in monitors])
            shares = merge_saturated_shares(monitors)  # None: no pass at delayed scales, nothing measured
            extra = {} if shares is None else {"saturated_share": shares, "saturated_share_max": max(shares)}
            self.log.add("fp8_monitor", step=number, swiglu_absmax=per_layer, max=per_layer[top], max_layer=top,
                         **extra)
        telemetry.publish({"llmq_tokens_per_second": tps, "llmq_step_seconds": wall, "llmq_train_loss": r0["loss"],
                           "llmq_grad_norm": r0["norm"]}, {"role": "coordinator"})
        rec["warnings"] = self._check_step(rec)
        return rec

    def _warn(self, step: int | None, kind: str, message: str, **fields) -> str:
        """Log a "warning" record (and count it); returns its console line."""
        self.warnings += 1
        self.log.add("warning", step=step, kind=kind, message=message, **fields)
        return warning_line(step, message)

    def _check_step(self, rec: dict) -> list[str]:
        """Warnings of a finished step: a skipped update, a loss or grad-norm spike. Returns their lines."""
        step, lines = rec["step"], []
        reason = rec.get("skip_reason")
        if rec["skipped"]:
            self.skipped_steps += 1
        if reason == "non-finite gradient norm" or (rec["skipped"] and not reason):
            lines.append(self._warn(step, "nonfinite", f"update skipped: the gradient norm is {rec['norm']} "
                                    f"(loss {rec['loss']}); the weights and optimizer state were left unchanged.",
                                    loss=rec["loss"], norm=rec["norm"], skipped=True))
        for name, z in self.guard.observe(rec["loss"], rec["norm"]):
            value = rec["loss"] if name == "loss" else rec["norm"]
            what = "loss" if name == "loss" else "grad-norm"
            done = rec["skipped"] and reason == f"{what} spike"
            lines.append(self._warn(step, f"{name}_spike", f"{what} spike: {value:.4g} is {z:.1f} standard "
                                    f"deviations above the mean of the last {self.guard.window} steps"
                                    + ("; update skipped." if done else "."),
                                    value=value, zscore=z if math.isfinite(z) else str(z), skipped=done))
        if lines:
            self.log.flush()
        return lines

    # ------------------------------------------------------------------ the step
    def train_step(self) -> dict:
        """One optimizer step over all workers (+ a checkpoint and a periodic eval when due).

        A worker failure rebuilds the group from the last checkpoint and trains up to this step again (see
        the module docstring). Returns {"record": step record, "lines": console lines, "eval": eval record
        or None}."""
        if self.micro_pending:
            raise RuntimeError("train_step() after step() without update(): call update() first.")
        if self.stop_requested:  # queued behind the step that was running when the stop came: not trained
            return {"record": None, "lines": [], "eval": None, "stopped": True}
        if not self.workers:  # e.g. a second queued train_step after the first one failed and tore the group down
            raise WorkerError(f"train_step (step {self.step + 1}): the worker group is gone after an earlier "
                              f"failure; see the error of the step before.")
        target, lines = self.step, []
        while True:
            try:
                while self.step < target:  # steps lost to a restart are trained again
                    lines += self._one_step()["lines"]
                out = self._one_step()
                out["lines"] = lines + out["lines"]
                return out
            except WorkerError as exc:
                lines += self._recover(exc)

    def _one_step(self) -> dict:
        step, lr = self.step, self.lr_at(self.step)
        limits = self.guard.limits() if self.plan.settings.checkpoints.skip_update_on_spike else None
        t0 = time.perf_counter()
        results = self._call("train_step", step, lr, limits, what=f"train_step (step {step + 1})",
                             timeout=self.plan.settings.checkpoints.step_timeout_s, explain=self._explain_hang)
        wall = time.perf_counter() - t0
        self.step += 1
        rec = self._record_step(step, lr, results, wall, self.plan.tokens_per_step)
        lines = [step_line(step, self.settings.optim.steps, wall, rec["norm"], rec["loss"], rec["tokens_per_s"], rec["sol"],
                           rec.get("skip_reason") or rec["skipped"])] + rec.pop("warnings")
        lines += self._settle_upload(wait=False)  # a background upload that finished is published now
        if self._checkpoint_due() or self._deferred is not None:
            if self._upload is not None:  # the previous upload still runs: the step loop does not wait for it
                lines += self._defer_checkpoint()
            else:
                self._deferred = None
                lines.append(self.save_checkpoint(background=True)["line"])
        drain = self._drain_notice()
        if drain:  # a preemption notice for a node of ours: stop at this step boundary, as on SIGTERM
            self.stop_requested = True
            lines.append(self._warn(self.step, "drain", f"{drain}: stopping after step {self.step} with a "
                                    f"checkpoint, as on SIGTERM."))
            return {"record": rec, "lines": lines, "eval": None, "drain": drain}
        ev = None
        n = self.plan.settings.observe.eval_every_n_steps
        if n > 0 and self.plan.settings.data.eval_file and self.step % n == 0 and self.step < self.settings.optim.steps:
            ev = self.validate(full=False)
            lines.append(ev["line"])
        return {"record": rec, "lines": lines, "eval": ev}

    def _drain_notice(self) -> str | None:
        """A sentence when Ray says a node holding one of our workers is being drained (a cloud preemption
        notice, ``ray drain-node``, KubeRay scaling the node away), else None. Asked at most every 2 s."""
        now = time.monotonic()
        if now - self._drain_checked < 2.0 or not self.nodes:
            return None
        self._drain_checked = now
        try:
            from ray._private.state import state  # the GCS's list of draining nodes (as Ray Train reads it)

            draining = state.get_draining_nodes() or {}
        except Exception:  # noqa: BLE001 - an older Ray or no GCS access: no notice
            return None
        ips = sorted({n["ip"] for n in self.nodes if n.get("node_id") in draining})
        if not ips:
            return None
        deadlines = [draining[n["node_id"]] for n in self.nodes if n.get("node_id") in draining]
        left = [d / 1000.0 - time.time() for d in deadlines if d]
        when = f", to be shut down in {max(min(left), 0):.0f} s" if left else ""
        return f"node {', '.join(ips)} is being drained (Ray's drain notice{when})"

    def micro_step(self) -> None:
        """One forward+backward on every worker (each on its own next batch), gradients accumulating."""
        self._call("micro_step", what=f"micro_step (step {self.step + 1})", timeout=self.plan.settings.checkpoints.step_timeout_s)
        self.micro_pending += 1

    def update(self, lr: float | None = None) -> dict:
        """The optimizer update after one or more micro_step(); ``lr`` defaults to the schedule's.
        Returns the step record (loss, norm, ...)."""
        if not self.micro_pending:
            raise ConfigError("update() before any step(): call step() (one forward+backward) at least once first.")
        step = self.step
        lr = self.lr_at(step) if lr is None else float(lr)
        t0 = time.perf_counter()
        results = self._call("update", step, lr, what=f"update (step {step + 1})", timeout=self.plan.settings.checkpoints.step_timeout_s)
        wall = time.perf_counter() - t0
        o = self.settings
        tokens = o.data.batch_size * o.data.seq_len * self.micro_pending * self.plan.data_parallel_size
        self.micro_pending = 0
        self.step += 1
        rec = self._record_step(step, lr, results, wall, tokens)
        rec.pop("warnings")
        return rec

    def validate(self, full: bool = False) -> dict | None:
        """Eval loss over eval_num_steps batches (or the whole eval file with ``full``); None without one."""
        if not self.plan.settings.data.eval_file:
            return None
        t0 = time.perf_counter()
        self.eval_count += 1
        self._eval_running = {"full": full, "tag": self.eval_count}
        try:
            results = self._call("evaluate", full, self.eval_count, what="evaluate")
        finally:
            self._eval_running = None
        wall = time.perf_counter() - t0
        loss_sum, count = results[0]["loss_sum"], results[0]["targets"]
        loss = loss_sum / max(count, 1)
        rec = {"step": self.step, "loss": loss, "targets": count, "seconds": wall, "full": full,
               "batches": results[0].get("batches", 0)}
        rec["line"] = eval_line(self.step, self.settings.optim.steps, wall, loss, rec["batches"], final=full)
        self.evals.append(rec)
        self.log.add("eval", **{k: v for k, v in rec.items() if k != "line"})
        self.log.flush()
        telemetry.publish({"llmq_eval_loss": loss}, {"role": "coordinator"})
        return rec

    def progress(self) -> dict | None:
        """The eval running now as {"done", "total", "full"} (batches done on rank 0), or None; for the
        driver's eval bar. Runs in the actor's probe concurrency group, beside train_step / validate /
        finish (which run the evals)."""
        ev, workers = self._eval_running, self.workers
        if ev is None or not workers:
            return None
        a = probe_activities(workers, [0], timeout_s=2.0).get(0)
        if not a or a.get("eval_tag") != ev["tag"]:
            return None  # rank 0 has not started this eval yet
        return {"done": a["at"], "total": a["eval_total"], "full": ev["full"]}

    # ------------------------------------------------------------------ outputs
    def export(self, path: str | None = None) -> str:
        """HF export of the current weights into ``path`` (default out_dir/export), written atomically; on an
        object store staged on the exporting worker's node and uploaded with the ``_EXPORT_COMPLETE`` marker
        last (llmq_ray/model/hf_io.py ``export_hf_to_uri``).

        A fresh run (not continued from a checkpoint) never replaces another run's export: a folder already at
        the default path that this run did not write is kept beside it as ``export.before-<UTC time>`` (on a
        store: copied there, marker last, before the new export is uploaded)."""
        from llmq_ray import storage

        default = path is None
        path = path or storage.join(self.plan.settings.observe.out_dir, "export")
        remote = storage.is_remote(path)
        path = path if remote else os.path.abspath(path)
        if default and not self.plan.resume_from and path not in self._exported and \
                (storage.exists(path) if remote else os.path.isdir(path)):
            from llmq_ray.model.hf_io import set_aside_export
            from llmq_ray.observe.runlog import set_aside_name

            kept = set_aside_name(path, default_ext="")
            if remote:
                set_aside_export(path, kept)
            else:
                os.replace(path, kept)
            self._warn(self.step, "export", f"an earlier run's export at {path} was kept as {kept}")
        self._exported.add(path)
        if self._weights_are_split:  # gathering the sharded weights needs every rank
            refs = [w.export.remote(path, self.plan.settings.observe.export_dtype, r == self._export_rank)
                    for r, w in enumerate(self.workers)]
            return gather(refs, self.plan.settings.checkpoints.call_timeout_s, "export")[self._export_rank]
        w = self.workers[self._export_rank]
        return gather([w.export.remote(path, self.plan.settings.observe.export_dtype)], self.plan.settings.checkpoints.call_timeout_s, "export")[0]

    @property
    def _weights_are_split(self) -> bool:
        """No worker holds the whole model's weights (ZeRO-3, or --tensor-parallel): reading them is a collective."""
        return self.settings.parallel.zero_level >= 3 or self.plan.settings.parallel.tensor_parallel > 1

    def finish(self) -> dict:
        """Final eval over the whole eval file, the export, the last log flush. Returns the summary. A final
        checkpoint that cannot be written (a full disk) does not cost the export: the export is written all the
        same, and then the CheckpointError says both (the run failed: its last state is in no checkpoint)."""
        # a stop requested now (SIGTERM after the last step) skips the final eval: the export is what matters
        lines = self._settle_upload(wait=True, why="at the end of the run")
        unsaved = None  # the CheckpointError of the final checkpoint
        if (self.plan.settings.checkpoints.ckpt_minutes > 0 or self._deferred is not None) and self.step > 0 and \
                not self._has_checkpoint_of(self.step):
            # the end of a run with time-interval checkpoints (the default) is kept too, as is a deferred one
            try:
                self.save_checkpoint()
            except CheckpointError as exc:  # a full disk: its files are gone again, and the (smaller) export
                unsaved = exc               # still gets its chance; the run fails after it, naming both
                self._warn(self.step, "checkpoint", str(exc))
        final = self.validate(full=True) if self.plan.settings.observe.final_eval and not self.stop_requested else None
        if self.plan.settings.observe.export:
            try:
                self.export_path = self.export()
            except Exception as exc:  # noqa: BLE001 - after a failed checkpoint: one sentence with both
                if unsaved is None:
                    raise
                why = (str(exc).strip().splitlines() or [type(exc).__name__])[-1].rstrip(".")
                raise CheckpointError(f"{str(unsaved).rstrip('.')}; the export could not be written either ({why}).") \
                    from None
        summary = self.summary(final)
        self.log.add("summary", **summary)
        if unsaved is not None:  # the run trained every step but its last state is not in a checkpoint: it failed
            kept = f"the export was written to {self.export_path}" if self.export_path else "no export was asked for"
            raise CheckpointError(f"{str(unsaved).rstrip('.')}; {kept}.")
        self.log.end("finished", step=self.step)
        if self.wandb is not None:
            self.wandb.finish()
        return {"summary": summary, "lines": lines + ([final["line"]] if final else [])}

    # ------------------------------------------------------------------ stopping and the end record
    def request_stop(self) -> None:
        """Mark the run as stopping (called in the probe group, beside a running step): a train_step that
        starts after this returns at once, untrained. The step running now finishes normally."""
        self.stop_requested = True

    def stop(self, reason: str, checkpoint: bool = True) -> dict:
        """End a stopping run: a checkpoint of the last completed step (when ``checkpoint`` and the run has
        trained or loaded something that has none yet), then the "end" record {"reason": "stopped",
        "signal": reason, "step", "checkpoint"}. Micro-steps of a step-level caller that were not followed
        by update() are discarded (the checkpoint holds the state after the last update).
        Returns {"step", "checkpoint" (path or None), "written" (bool), "note" (why none, or "")}."""
        self.stop_requested = True
        settled = self._settle_upload(wait=True, why="before stopping")  # a checkpoint counts once published
        path, written, note = None, False, ""
        if self.micro_pending:
            note = f"{self.micro_pending} micro-step(s) without update() were discarded"
            self.micro_pending = 0
        existing = self._has_checkpoint_of(self.step)
        if existing:
            path = existing
        elif not checkpoint:
            note = note or "no checkpoint on exit was asked for"
        elif self.step == 0:
            note = note or "no step was completed"
        elif not self.workers:
            note = note or "the worker group is gone"
        else:
            self.log.flush()  # the records so far are safe even if a second signal aborts the save below
            path, written = self.save_checkpoint()["path"], True
        self.log.end("stopped", signal=reason, step=self.step, checkpoint=path, checkpoint_written=written,
                     **({"note": note} if note else {}))
        return {"step": self.step, "checkpoint": path, "written": written, "note": note, "lines": settled}

    def end(self, reason: str, **fields) -> bool:
        """Write the log's "end" record (the driver calls this for "failed"); False when it was written
        already (e.g. "restarts_exhausted" by ``_recover``)."""
        return self.log.end(reason, step=self.step, **fields) is not None

    def summary(self, final: dict | None = None) -> dict:
        steady = self.history[1:] or self.history  # the first step includes warm-up (allocations, first collectives)
        wall = sum(r["seconds"] for r in steady)
        toks = sum(r["tokens"] for r in steady)
        return {"steps": self.step, "train_loss": self.history[-1]["loss"] if self.history else None,
                "eval_loss": final["loss"] if final else (self.evals[-1]["loss"] if self.evals else None),
                "tokens_per_s": toks / wall if wall > 0 else None,
                "step_seconds": wall / len(steady) if steady else None,
                "worker_seconds": (sum(r["worker_seconds"] for r in steady) / len(steady)) if steady else None,
                "export_path": self.export_path, "log_file": self.log.path, "restarts": self.restarts,
                "skipped_steps": self.skipped_steps, "warnings": self.warnings,
                "checkpoints": [p for p in self.checkpoints if _is_checkpoint(p)]}

    def get_history(self) -> dict:
        return {"steps": list(self.history), "evals": [{k: v for k, v in e.items() if k != "line"} for e in self.evals]}

    def flat_params(self, rank: int = 0):
        if self._weights_are_split:  # a collective: every rank takes part
            return gather([w.flat_params.remote() for w in self.workers], self.plan.settings.checkpoints.call_timeout_s, "flat_params")[rank]
        return gather([self.workers[rank].flat_params.remote()], self.plan.settings.checkpoints.call_timeout_s, "flat_params")[0]

    def data_state(self) -> list:
        return self._call("data_state", timeout=60.0)

    def worker_pids(self) -> list[int]:
        """The process ids of the current workers, by rank."""
        return list(self.pids)

    def _teardown(self) -> None:
        """Kill the workers (without waiting on them) and release the placement group."""
        import ray
        from ray.util.placement_group import remove_placement_group

        self._drop_upload()
        for w in self.workers:
            try:
                ray.kill(w)
            except Exception:  # noqa: BLE001 - already dead
                pass
        self.workers = []
        if self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except Exception:  # noqa: BLE001
                pass
            self.pg = None

    def shutdown(self) -> None:
        """Close the workers (leave the process group), kill them and release the placement group."""
        if self.wandb is not None:
            self.wandb.finish(exit_code=1 if self.failed else 0)  # safe after finish(): a no-op then
        if self.log.records:
            try:
                self.log.flush()
            except OSError:
                pass
        if self.workers and not self.failed:
            try:
                gather([w.close.remote() for w in self.workers], 30.0, "close")
            except Exception:  # noqa: BLE001 - best effort; they are killed next
                pass
        self._teardown()
