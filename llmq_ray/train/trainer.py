"""``LLMQTrainer``: a whole training run on Ray in one call, or step by step for custom loops (its pre-flight is
llmq_ray/train/configure.py, its early stops llmq_ray/train/stopping.py, both base classes; ``Result`` is
llmq_ray/train/result.py's).

    from llmq_ray.train.trainer import LLMQTrainer
    result = LLMQTrainer(model="tiny-qwen", train_file="data/ts/train-*.bin", eval_file="data/ts/eval.bin",
                         steps=200, batch_size=8, seq_len=256, device="cpu", workers=2).fit()
    result.metrics["eval_loss"], result.export_path, result.history[-1]["loss"]

Step-level (each call spans all workers; the unit of work is never smaller than a micro-step)::

    with LLMQTrainer(...) as t:
        for step in range(n):
            t.step()                     # one forward+backward on every worker (its own next batch)
            stats = t.update(lr=my_lr)   # {"loss", "norm", ...}: the optimizer step
        t.validate()                     # eval loss
        t.export("out/my-export")        # HF folder

``train_step()`` runs grad_accumulation micro-steps and the update in one Ray call per worker (what
``fit()`` uses, and the fast path: ``step()`` + ``update()`` cost one Ray round trip per micro-step).

Ray: if Ray is already initialized (the caller's program, a Ray task or actor) the trainer joins that
cluster; otherwise it calls ``ray.init`` on the cluster that ``ray_address``, ``$RAY_ADDRESS`` or a ``ray start``
on this machine names, else on a fresh local instance (``llmq_ray/train/ray_target.py``). It only
ever shuts down a Ray it initialized itself. Workers are placed by ``actors/placement.py``; the
coordinator actor runs on the caller's node, so logs and exports land on the caller's machine.

Checkpoints and fault tolerance: ``ckpt_interval=N`` writes ``checkpoint_dir/step_XXXXXXXX`` (default
``out_dir/ckpt``) every N steps, keeping the newest ``ckpt_keep_n`` (2) plus every multiple of
``ckpt_major``; ``resume=True`` / "latest" / a step number / a folder continues from a checkpoint (checked
before Ray starts: incomplete folders are skipped with a warning, another model is refused in one
sentence), on any number of workers. With checkpoints on, a worker that dies or hangs makes the coordinator
rebuild the group and continue from the last checkpoint, up to ``max_restarts`` (3) times; a step that
takes longer than ``step_timeout_s`` (1800 s, like Ray Train's process-group timeout) counts as a hang.
``skip_update_on_spike`` skips the update of a step whose loss or grad norm is ``spike_threshold``
standard deviations above the mean of the last ``spike_window`` steps (such steps are always logged as
warnings; a non-finite gradient norm always skips the update).

``LLMQTrainer(settings=None, **overrides)``: a ``RunSettings`` tree (llmq_ray/settings/) and/or single settings as
keywords, each routed onto its field by name (the CLI flags' names with underscores: ``grad_accumulation=4``); an
unknown keyword is refused in one sentence naming the closest setting.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import json
import os
import sys
import threading
import warnings
from typing import Optional

from llmq_ray.actors.actor_env import PACKAGE_PARENT, actor_options
from llmq_ray.actors.failures import CoordinatorLost, WorkerError, wrap_error
from llmq_ray.actors.fault_injection import ENV as FAULT_ENV
from llmq_ray.actors.plan import RunPlan
from llmq_ray import storage
from llmq_ray.errors import ConfigError, LLMQError
from llmq_ray.settings import AUTO, RunSettings
from llmq_ray.settings.rules import forward_env_names, parallel_rules, port_range
from llmq_ray.train.configure import RunConfiguration, _absolute, fastest_backend, new_run_id
from llmq_ray.train.configure import forwarded_env  # noqa: F401 - part of this module's interface (tests, programs)
from llmq_ray.train.result import Result, tune_metrics, tune_reporter
from llmq_ray.train.ray_target import resolve_ray_target, start_ray
from llmq_ray.train.stopping import RunStopping
from llmq_ray.train.run_lock import RunLock, lock_beside, lock_inside

__all__ = ["LLMQTrainer", "Result", "WorkerError"]


class LLMQTrainer(RunConfiguration, RunStopping):
    """A training run over one Ray worker actor per GPU (or per CPU worker); see the module docstring."""

    def __init__(self, settings: Optional[RunSettings] = None, *, verbose: bool = True, handle_signals: bool = True,
                 cli: bool = False, **overrides):
        self.cli = cli  # error sentences name CLI flags (--warmup) instead of keyword arguments (warmup)
        self.notes: list[str] = []       # warnings found before start (skipped checkpoints), printed there
        self.lines: list[str] = []       # information found before start (the data used, a batch adjustment)
        self.verbose = verbose
        try:
            self._configure(settings, overrides)
        except LLMQError as exc:
            raise self._named(exc) from None
        finally:
            if self.verbose:
                for note in self.notes:
                    print(f"warning: {note}", file=sys.stderr, flush=True)
        self.handle_signals = handle_signals
        self.plan: Optional[RunPlan] = None
        self.coordinator = None
        self.info: Optional[dict] = None
        self._started_ray = False
        self._stop_signal: Optional[int] = None  # the signal that asked to stop (None: request_stop())
        self._stop_requested = threading.Event()
        self._signals = None                     # the SignalStop of a running fit()
        self._ended = False                      # the log's "end" record is written
        self._fit_began = False                  # a fit() got its workers: a second one would train anew
        self._run_lock = RunLock()               # the out-dir's and checkpoint folder's, while the run may write
        self._steps_done = 0                     # optimizer steps completed (as far as the driver knows)
        self._stopped: Optional[dict] = None     # what stop() returned
        self._stop_reason: Optional[str] = None  # why the run stops when no signal says it (a drain notice)
        self._coordinator_restarts = 0           # coordinators started again after the previous one died
        self._seen: list = []                    # every step record fit() received (kept across coordinators)

    # ------------------------------------------------------------------ Ray and the actors
    def _init_ray(self):
        import ray

        if not ray.is_initialized():
            target = self._ray_target or resolve_ray_target(self.settings.parallel.ray_address)  # the caller's Ray has gone since
            kwargs = {"address": target.address, "log_to_driver": True}
            if not target.joins:
                # a fresh local instance: declare more CPUs than the workers take (Ray Data needs spare ones)
                workers = self.settings.parallel.workers or self.settings.parallel.gpus or 1
                kwargs["num_cpus"] = max(os.cpu_count() or 1, workers * (self.settings.parallel.cpus_per_worker or 1) + 2)
                if self.settings.parallel.dashboard:
                    kwargs["dashboard_host"] = "127.0.0.1"
                else:
                    kwargs["include_dashboard"] = False
            start_ray(kwargs, fresh=not target.joins)  # a start that timed out on a busy machine is tried again
            self._started_ray = True
            if self._signals is not None:
                self._signals.install()  # ray.init replaced SIGTERM's handler with one that exits mid-call
        return ray

    def _build_plan(self, ray) -> RunPlan:
        """What the cluster decides: the device, backend, worker count and CPUs per worker (written into the
        plan's copy of the settings, which then holds no "auto" the workers would have to resolve), the run id.
        The trainer's own settings stay as the pre-flight resolved them (a retried start plans afresh)."""
        s = copy.deepcopy(self.settings)
        p, ob = s.parallel, s.observe
        gpus_in_cluster = int(ray.cluster_resources().get("GPU", 0))
        device = p.device if p.device != AUTO else ("cuda" if gpus_in_cluster > 0 else "cpu")
        if device == "cuda":
            world = p.gpus or p.workers or gpus_in_cluster or 1
            if p.gpus and p.workers and p.gpus != p.workers:
                raise ConfigError(f"--gpus={p.gpus} and --workers={p.workers} disagree; on CUDA there is one worker "
                                  f"per GPU, give only one of them.")
        else:
            world = p.workers or 1
        t = p.tensor_parallel
        if world % t:
            raise ConfigError(f"--tensor-parallel={t} must divide the number of workers ({world}: "
                              f"{'--gpus or the GPUs of the cluster' if device == 'cuda' else '--workers'}).")
        # resuming on another data-parallel size keeps the checkpoint's global batch (a no-op when done before)
        self._keep_global_batch(world // t)
        self._print(self.lines)
        self.lines = []
        cpw = p.cpus_per_worker
        if cpw is None:
            if device == "cuda":
                # from the CPUs free now, not the cluster's total: another run on the same cluster holds its
                # workers' CPUs, and this run's Ray Data read tasks need CPUs besides its own workers' (two runs
                # that each took 8 of 16 CPUs left none for them, and both hung at their first batch)
                free = int(ray.available_resources().get("CPU", 0))
                cpw = max(1, min(8, free // max(world, 1) - 1))
            else:
                cpw = 1
        backend = fastest_backend(device) if p.backend == AUTO else p.backend
        p.device, p.backend, p.cpus_per_worker = device, backend, cpw
        parallel_rules(s)  # the device the cluster chose against the backend and CUDA graphs asked for
        ob.out_dir = _absolute(ob.out_dir)
        ob.log_file = _absolute(ob.log_file) if ob.log_file else None
        if ob.run_id is None:
            ob.run_id = new_run_id()
        fault = os.environ.get(FAULT_ENV)  # the test hook (actors/fault_injection.py): tests only
        return RunPlan(settings=s, world_size=world, resume_from=self.resume_from,
                       rendezvous_ports=port_range(p.rendezvous_port_range),
                       fault=json.loads(fault) if fault else None, placement_name=f"llmq-{ob.run_id}-{os.urandom(4).hex()}")

    def start(self) -> dict:
        """Join/start Ray, place the workers and build their engines (done lazily by every other call). Refused
        once this trainer's run has ended after starting (fit() returned, or stop() / close() after the workers
        started): starting again would train a new run from scratch whose export and log replace this run's. A
        start that failed before the workers were up (no room, another run holding the out-dir) may be retried."""
        if self.coordinator is not None:
            return self.info
        if self._ended and self.info is not None:
            raise ConfigError(f"this LLMQTrainer's run has ended (by fit(), stop() or close(); its outputs are in "
                              f"out_dir={self.settings.observe.out_dir}), and another call would start a new run from "
                              f"scratch: make a new LLMQTrainer, with resume=True to go on from its last checkpoint.")
        try:
            self._lock_outputs()
            return self._start()
        except BaseException as exc:
            if self.coordinator is None:  # not started: give the folders back (a started run keeps them to close())
                self._run_lock.release()
            if isinstance(exc, LLMQError):
                raise self._named(exc) from None
            raise

    def _lock_outputs(self) -> None:
        """Take the run locks of the local out-dir and checkpoint folder (the default out-dir/ckpt too: another
        run may name it as its --checkpoint-dir) before Ray starts (llmq_ray/train/run_lock.py: a second run
        into either is refused). Held until ``close()``."""
        if self._run_lock.held:
            return
        entries = []
        if not storage.is_remote(self.settings.observe.out_dir):
            entries.append((lock_inside(self.settings.observe.out_dir), self.settings.observe.out_dir, "--out-dir"))
        if not storage.is_remote(self.checkpoint_dir):
            entries.append((lock_beside(self.checkpoint_dir), self.checkpoint_dir, "--checkpoint-dir"))
        self._run_lock.acquire(entries)

    def _keep_earlier_outputs(self) -> None:
        """Just before the coordinator starts (not at construction: ``--print-config`` or a trainer that never
        starts, or whose workers cannot be placed, moves nothing), keep what an earlier run left where this one
        will write: checkpoints newer than the one resumed from (a new branch), or a fresh run's default
        checkpoint folder, moved beside it. The run lock is held (no other run is writing them)."""
        lines = []
        if self.resume_from and not storage.is_remote(self.resume_from) and \
                os.path.dirname(self.resume_from) == self.checkpoint_dir:
            from llmq_ray.checkpoints.layout import step_of
            from llmq_ray.checkpoints.retention import set_aside_newer

            moved_to, names = set_aside_newer(self.checkpoint_dir, step_of(self.resume_from) or 0)
            if moved_to:
                lines.append(f"continuing from {os.path.basename(self.resume_from)}: the newer checkpoints "
                             f"{', '.join(names)} were moved to {moved_to} (kept, no longer resumed from)")
        if self._set_aside_ckpt:
            from llmq_ray.observe.runlog import set_aside_name

            kept = set_aside_name(self._set_aside_ckpt, default_ext="")
            os.replace(self._set_aside_ckpt, kept)
            lines.append(f"checkpoints: an earlier run's checkpoints at {self._set_aside_ckpt} were kept as "
                         f"{kept} (pass --continue to resume a run instead)")
            self._set_aside_ckpt = None
        if self.resume in (False, None) and not storage.is_remote(self.settings.observe.out_dir):
            from llmq_ray.train.earlier_outputs import prune_earlier_outputs

            lines += prune_earlier_outputs(_absolute(self.settings.observe.out_dir))  # the previous run's set stays
        self._print(lines)

    def _start(self) -> dict:
        ray = self._init_ray()
        self.plan = self._build_plan(ray)
        from llmq_ray.actors.placement import check_resources, data_cpu_warning

        check_resources(self.plan)  # --gpus above what exists: one sentence, before any actor starts
        warning = data_cpu_warning(self.plan)
        if warning:
            self._say(warning, sys.stderr)
        env = {"PYTHONPATH": os.pathsep.join(p for p in (PACKAGE_PARENT, os.environ.get("PYTHONPATH")) if p)}
        env.update(forwarded_env(self.settings.parallel.forward_env))  # credentials, endpoints, NCCL/GLOO, W&B...
        self._coordinator_env = env
        self._keep_earlier_outputs()
        self.coordinator = self._new_coordinator(self.plan)
        try:
            self.info = self._get(self.coordinator.start.remote(self.notes), "start-up")
        except BaseException as exc:
            self._end_failed(str(exc) if isinstance(exc, LLMQError) else f"{type(exc).__name__}: {exc}")
            self.close()
            raise
        threading.Thread(target=self._notify_coordinator_on_stop, daemon=True, name="llmq-stop-notifier").start()
        if self.verbose:
            self._print_setup()
        self._print(self.info["lines"])
        return self.info

    def _new_coordinator(self, plan: RunPlan):
        """The coordinator actor of ``spec``, on the driver's node when it can be (the log is local to the user)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from llmq_ray.actors.coordinator import Coordinator
        from llmq_ray.actors.worker import PROBE_GROUP

        here = ray.get_runtime_context().get_node_id()
        # the probe group runs Coordinator.progress beside a running call (the eval bar polls it)
        return ray.remote(concurrency_groups={PROBE_GROUP: 1})(Coordinator).options(
            num_cpus=0, max_restarts=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=True),
            **actor_options(self._coordinator_env, gpu=False, forward_env=forward_env_names(
                self.settings.parallel.forward_env))).remote(plan, self._coordinator_env)

    def _replace_coordinator(self, lost: CoordinatorLost) -> int:
        """The coordinator died (its process was killed, or its node lost while the driver lives on): start a
        new one that resumes from the newest valid checkpoint (or from the start when there is none yet), up to
        --max-restarts times. Its workers died with it (Ray's fate sharing); their placement group, which Ray ties
        to the job, is removed here. Returns the step the new coordinator goes on from; re-raises ``lost`` when
        restarts are off or used up."""
        from llmq_ray.actors.placement import release_coordinator
        from llmq_ray.checkpoints.layout import CheckpointWarning
        from llmq_ray.checkpoints.verify import find_latest_valid

        self._coordinator_restarts += 1
        limit = self.settings.checkpoints.max_restarts
        if not self.plan.checkpoints_on or self._coordinator_restarts > limit:
            raise lost
        release_coordinator(self.coordinator, self.plan.placement_name)  # and the workers' placement group
        self.coordinator = None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", CheckpointWarning)
            folder = find_latest_valid(self.checkpoint_dir) or self.plan.resume_from
        notes = [str(w.message) for w in caught]
        self._say(f"warning: {str(lost).rstrip('.')}; restarting the coordinator from "
                  f"{folder or 'scratch (no checkpoint yet)'} (restart {self._coordinator_restarts}/{limit}).",
                  sys.stderr)
        self.plan = dataclasses.replace(self.plan, resume_from=folder, append_log=True, fault=None)
        self.coordinator = self._new_coordinator(self.plan)
        self.info = self._get(self.coordinator.start.remote(notes), "start-up after the coordinator was lost")
        self._print(self.info["lines"])
        return int(self.info["step"])

    def _print_setup(self) -> None:
        s, i = self.plan, self.info
        print(f"llmq-ray: {self.settings.model.model} on {s.world_size} x {i['gpu'] or 'cpu'} worker(s) "
              f"(backend {self.plan.settings.parallel.backend}, ZeRO-{self.settings.parallel.zero_level}), set-up {i['seconds']:.1f} s; "
              f"log {i['log_file']}", flush=True)
        from llmq_ray.observe.memory_table import format_memory_table

        mems = i.get("memories", [i["memory"]])
        print(format_memory_table(list(mems[0].items()), title="memory (rank 0)"), flush=True)
        for r, m in enumerate(mems[1:], 1):
            if m != mems[0]:
                print(format_memory_table(list(m.items()), title=f"memory (rank {r})"), flush=True)

    def _get(self, ref, what: str, timeout: Optional[float] = None, bar=None):
        """ray.get on a coordinator call; its errors become one LLMQError sentence. ``bar``: an ``EvalBar``
        fed with the coordinator's eval progress while the call runs (polled every 0.25 s)."""
        import time

        import ray
        import ray.exceptions as rex

        limit = timeout or (self.settings.checkpoints.call_timeout_s + 120.0 if self.plan else 3600.0)
        deadline = time.monotonic() + limit
        try:
            if bar is not None and bar.enabled:
                while not ray.wait([ref], timeout=max(min(0.25, deadline - time.monotonic()), 0.0))[0]:
                    if time.monotonic() >= deadline:
                        break
                    bar.show(self._eval_progress())
                bar.end()
            return ray.get(ref, timeout=max(deadline - time.monotonic(), 0.0))
        except rex.GetTimeoutError:
            raise WorkerError(f"the run did not finish {what} within {limit:.0f} s; it was stopped.") from None
        except rex.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, LLMQError):
                raise cause from None
            raise wrap_error(exc, None, what) from None
        except rex.RayActorError as exc:
            raise CoordinatorLost(str(wrap_error(exc, None, what))) from None

    def _eval_progress(self) -> Optional[dict]:
        """The coordinator's report on the eval running now (see ``Coordinator.progress``); None if none,
        or if it does not answer within 2 s."""
        import ray

        from llmq_ray.actors.worker import PROBE_GROUP

        try:
            return ray.get(self.coordinator.progress.options(concurrency_group=PROBE_GROUP).remote(), timeout=2.0)
        except Exception:  # noqa: BLE001 - a bar is never worth an error
            return None

    def _eval_bar(self, under=None):
        """An ``EvalBar`` on stdout (off with --no-progress, verbose=False, or when stdout is no terminal)."""
        from llmq_ray.observe.progress import EvalBar

        return EvalBar(sys.stdout, enabled=self.verbose and self.settings.observe.progress, under=under)

    # ------------------------------------------------------------------ whole run
    def fit(self) -> Result:
        """Train ``steps`` optimizer steps (evals as configured), final eval, export; returns a Result.

        In the main thread (and with ``handle_signals``), SIGTERM / SIGINT / SIGHUP stop the run cleanly
        (``llmq_ray/train/stop_signals.py``): the step under way finishes, a checkpoint of it is written and
        ``Result.stopped`` says so; ``request_stop()`` from another thread does the same. The workers are
        released at the end (also on error), and the log's last record says why the run ended. One fit() per
        trainer: a second one is refused (it would train the run again over its own outputs)."""
        from llmq_ray.train.stop_signals import StopForced

        if self._fit_began:  # its log, export and checkpoints are this run's: training again would replace them
            raise ConfigError(f"fit() already ran on this LLMQTrainer (into out_dir={self.settings.observe.out_dir}); make a "
                              f"new LLMQTrainer for another run, with resume=True to go on from its checkpoints.")
        with self._stop_signals(self.handle_signals):
            try:
                self.start()
                self._fit_began = True
                if not self._stop_requested.is_set():
                    self._train_loop()
                if self._stop_requested.is_set():
                    info = self.stop()
                    return Result(metrics={}, history=[], evals=[], export_path=None,
                                  checkpoint_paths=[info["checkpoint"]] if info["checkpoint"] else [],
                                  log_file=self._log_path(), stopped=info)
                fin = self._get(self.coordinator.finish.remote(), "final eval and export", bar=self._eval_bar())
                self._ended = True
                self._print(fin["lines"])
                hist = self._get(self.coordinator.get_history.remote(), "history")
                if self._coordinator_restarts:  # the steps before the new coordinator's resume point: from the log
                    hist["steps"] = self._earlier_steps(hist["steps"]) + hist["steps"]
                summary = fin["summary"]
                if self.verbose:
                    self._print_summary(summary)
                return Result(metrics={k: summary[k] for k in ("steps", "train_loss", "eval_loss", "tokens_per_s",
                                                                "step_seconds", "worker_seconds", "restarts",
                                                                "skipped_steps", "warnings")},
                              history=hist["steps"], evals=hist["evals"], export_path=summary["export_path"],
                              checkpoint_paths=summary["checkpoints"], log_file=summary["log_file"])
            except KeyboardInterrupt as exc:  # ray.get turns our StopForced into a plain KeyboardInterrupt
                forced = self._signals.forced if self._signals is not None else None
                if forced is None and not isinstance(exc, StopForced):
                    self._end_failed("interrupted (KeyboardInterrupt)")
                    raise
                return Result(metrics={}, history=[], evals=[], export_path=None, checkpoint_paths=[],
                              log_file=self._log_path(), stopped=self._abandon(forced or exc.signum))
            except LLMQError as exc:
                self._end_failed(str(exc))
                raise self._named(exc) from None
            except BaseException as exc:
                self._end_failed(f"{type(exc).__name__}: {exc}".rstrip(": "))
                raise
            finally:
                self.close()

    def _earlier_steps(self, steps: list) -> list:
        """After the coordinator was replaced: the records of the steps before the first of ``steps`` (the new
        coordinator's), from the run's log (one record per step, the latest), else as this driver saw them."""
        from llmq_ray.observe.runlog import read_log, steps_as_one_run

        first = steps[0]["step"] if steps else self.settings.optim.steps + 1
        try:
            logged = [{k: v for k, v in r.items() if k != "log"} for r in steps_as_one_run(read_log(self._log_path()))]
        except (OSError, ValueError):  # no readable log: what fit() received
            logged = self._seen
        return [r for r in logged if r["step"] < first]

    def _train_loop(self) -> None:
        """The steps of ``fit``, one queued behind the running one, until done or a stop is requested."""
        done = self._get(self.coordinator.summary.remote(), "summary")["steps"]
        self._steps_done = done
        in_flight: collections.deque = collections.deque()
        submitted = done
        from llmq_ray.observe.progress import Progress

        bar = Progress(self.settings.optim.steps, "train", unit="step", stream=sys.stdout,
                       enabled=self.verbose and self.settings.observe.progress, initial=done)
        evals = self._eval_bar(under=bar)  # periodic evals run inside train_step
        report = tune_reporter()  # inside a Ray Tune trial: every step's metrics go to Tune
        while in_flight or (submitted < self.settings.optim.steps and not self._stop_requested.is_set()):
            # keep one step queued behind the running one: the coordinator never waits for us
            while len(in_flight) < 2 and submitted < self.settings.optim.steps and not self._stop_requested.is_set():
                in_flight.append(self.coordinator.train_step.remote())
                submitted += 1
            try:
                out = self._get(in_flight.popleft(), f"step {done + 1}", self._step_timeout(), bar=evals)
            except CoordinatorLost as lost:
                in_flight.clear()  # the queued step died with it
                done = submitted = self._replace_coordinator(lost)
                bar.n = done
                continue
            if out.get("stopped"):
                continue  # queued behind the stop request: nothing was trained
            if out.get("drain") and not self._stop_requested.is_set():
                self._stop_reason = out["drain"]  # Ray's preemption notice: stop as on SIGTERM
                self.request_stop()
            done += 1
            self._steps_done = done
            if out.get("record"):
                self._seen.append(out["record"])
            if self.verbose:
                for line in out["lines"]:
                    try:
                        bar.write(line)
                    except OSError:  # the terminal closed (SIGHUP): keep training, and stopping, without it
                        pass
            bar.update(1, loss=f"{out['record']['loss']:.4f}" if out.get("record") else "")
            if report is not None and out.get("record"):
                report(tune_metrics(out["record"], out.get("eval")))
        bar.close()

    # ------------------------------------------------------------------ stopping
    def _step_timeout(self) -> float:
        """How long one train_step call on the coordinator may take: a step, a checkpoint, and room for the
        automatic restarts (set-up, loading, the lost steps trained again). A backstop only: the
        coordinator bounds every worker call itself."""
        c = self.settings.checkpoints
        return (c.step_timeout_s + c.call_timeout_s + 120.0) * (2 + 2 * c.max_restarts)

    def _print(self, lines) -> None:
        for line in lines:
            self._say(line, sys.stdout)

    def _say(self, line: str, stream) -> None:
        """Print a line (verbose only). A console that went away (a closed terminal: EIO) never stops a run."""
        if self.verbose:
            try:
                print(line, file=stream, flush=True)
            except OSError:
                pass

    def _print_summary(self, s: dict) -> None:
        tps = f"{s['tokens_per_s']:,.0f}" if s["tokens_per_s"] else "-"
        loss = f"{s['train_loss']:.4f}" if s["train_loss"] is not None else "- (no step trained)"
        print(f"done: {s['steps']} steps, {tps} tokens/s, last train loss {loss}"
              + (f", eval loss {s['eval_loss']:.4f}" if s["eval_loss"] is not None else ""), flush=True)

    # ------------------------------------------------------------------ step-level API
    def step(self) -> None:
        """One forward+backward over all workers (each on its own next batch); gradients accumulate."""
        self.start()
        self._get(self.coordinator.micro_step.remote(), "step")

    def update(self, lr: Optional[float] = None) -> dict:
        """The optimizer update after step() calls: {"loss", "norm", "lr", "tokens", "seconds", ...}."""
        self.start()
        rec = self._get(self.coordinator.update.remote(lr), "update")
        self._steps_done = rec["step"]  # its number: updates done
        return rec

    def train_step(self) -> Optional[dict]:
        """grad_accumulation micro-steps + update in one Ray call per worker; prints the [T] line. Returns the
        step record, or None once a stop was requested (then call ``stop()``)."""
        if self._stop_requested.is_set():
            return None
        self.start()
        out = self._get(self.coordinator.train_step.remote(), "train_step", bar=self._eval_bar())
        if out.get("stopped"):
            return None
        self._steps_done = out["record"]["step"]
        self._print(out["lines"])
        return out["record"]

    def validate(self, full: bool = False) -> Optional[float]:
        """Eval loss over eval_num_steps batches (``full``: the whole eval file); None without eval file."""
        self.start()
        rec = self._get(self.coordinator.validate.remote(full), "validate", bar=self._eval_bar())
        if rec is None:
            return None
        self._print([rec["line"]])
        return rec["loss"]

    def export(self, path: Optional[str] = None) -> str:
        """Write the current weights as an HF folder (default out_dir/export); returns its path."""
        self.start()
        return self._get(self.coordinator.export.remote(_absolute(path) if path else None), "export")

    def save_checkpoint(self) -> str:
        """Checkpoint the current state into checkpoint_dir/step_XXXXXXXX (after an update); returns its path."""
        self.start()
        info = self._get(self.coordinator.save_checkpoint.remote(), "checkpoint")
        self._print([info["line"]])
        return info["path"]

    def weights(self):
        """A CPU fp32 copy of the current flat weights [layout.numel] (from rank 0)."""
        self.start()
        return self._get(self.coordinator.flat_params.remote(), "weights")

    def close(self) -> None:
        """Release the workers, the placement group and the coordinator; shut Ray down only if we started it;
        give back the run lock of the output folders (whatever fails before)."""
        try:
            self._close_runtime()
        finally:
            self._run_lock.release()

    def _close_runtime(self) -> None:
        import ray

        if self.coordinator is not None:
            if not self._ended:  # a step-level loop that ends by closing: the run finished as its caller chose
                try:
                    ray.get(self.coordinator.end.remote("finished", note="closed by the caller"), timeout=30)
                except Exception:  # noqa: BLE001 - best effort: the coordinator may be what failed
                    pass
                self._ended = True
            try:
                ray.get(self.coordinator.shutdown.remote(), timeout=60)
            except Exception:  # noqa: BLE001 - best effort: it may be the thing that failed
                pass
            from llmq_ray.actors.placement import release_coordinator

            release_coordinator(self.coordinator, self.plan.placement_name)  # a lost one's group too
            self.coordinator = None
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
            self._started_ray = False

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is not None and not self._ended:  # a step-level loop that raised: the log says it failed
            self._end_failed(str(exc) if isinstance(exc, LLMQError) else f"{type(exc).__name__}: {exc}")
        self.close()


def _main_guard() -> None:  # pragma: no cover - for `python -m llmq_ray.train.trainer` by mistake
    print("use `python examples/train.py` or `llmq-train` to train from the command line", file=sys.stderr)


if __name__ == "__main__":  # pragma: no cover
    _main_guard()
