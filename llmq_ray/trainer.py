"""``LLMQTrainer``: a whole training run on Ray in one call, or step by step for custom loops.

    from llmq_ray.trainer import LLMQTrainer
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
cluster; otherwise it calls ``ray.init(address=ray_address)`` (None: start or find a local one). It only
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

Keyword arguments are ``TrainOptions`` fields (model math and schedule; same names as the CLI flags) plus
the runtime arguments of ``__init__`` below.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import os
import sys
import warnings
from typing import Optional

from actors.failures import WorkerError, wrap_error
from actors.spec import RuntimeSpec
from llmq_ray.config import resolve_model
from llmq_ray.errors import ConfigError, LLMQError
from llmq_ray.options import TrainOptions

__all__ = ["LLMQTrainer", "Result", "WorkerError"]

_OPTION_FIELDS = {f.name for f in dataclasses.fields(TrainOptions)}
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass
class Result:
    """What ``fit()`` returns.

    metrics: {"steps", "train_loss" (last step), "eval_loss" (final eval; None without eval file),
              "tokens_per_s", "step_seconds", "worker_seconds" (mean over steps after the first),
              "restarts" (automatic restarts after a worker failure), "skipped_steps" (updates skipped: a
              non-finite gradient, or a spike with skip_update_on_spike), "warnings" (warning records logged)}
    checkpoint_paths: the checkpoints this run wrote that retention kept.
    history: one dict per optimizer step {"step", "lr", "loss", "norm", "tokens", "seconds", "tokens_per_s",
             "sol", "worker_seconds", "ray_overhead_seconds", ...}; evals: one dict per evaluation.
    """

    metrics: dict
    history: list
    evals: list
    export_path: Optional[str]
    checkpoint_paths: list
    log_file: Optional[str]


def fastest_backend(device: str) -> str:
    """triton on CUDA when that backend is present in this install, else the torch reference."""
    if device == "cuda" and importlib.util.find_spec("backends.triton") is not None:
        return "triton"
    return "torch"


class LLMQTrainer:
    """A training run over one Ray worker actor per GPU (or per CPU worker); see the module docstring."""

    def __init__(self, options: Optional[TrainOptions] = None, *, train_file: Optional[str] = None,
                 eval_file: Optional[str] = None, synthetic_data: bool = False, device: str = "auto",
                 backend: str = "auto", gpus: int = 0, workers: Optional[int] = None,
                 cpus_per_worker: Optional[int] = None, eval_every_n_steps: int = 0, eval_num_steps: int = 8,
                 final_eval: bool = True, out_dir: str = "out", log_file: Optional[str] = None,
                 export: bool = True, export_dtype: Optional[str] = None, checkpoint_dir: Optional[str] = None,
                 ckpt_interval: int = 0, ckpt_keep_n: int = 2, ckpt_major: int = 0, resume=False,
                 max_restarts: int = 3, skip_update_on_spike: bool = False, spike_window: int = 128,
                 spike_threshold: float = 6.0, use_ray_data: bool = True, ray_address: Optional[str] = None,
                 verbose: bool = True, collective_timeout_s: float = 300.0, call_timeout_s: float = 1800.0,
                 step_timeout_s: float = 1800.0,
                 fault: Optional[dict] = None, wandb_project: Optional[str] = None,
                 wandb_run_name: Optional[str] = None, log_gpu_util: int = 0, progress: bool = True,
                 **option_fields):
        unknown = set(option_fields) - _OPTION_FIELDS
        if unknown:
            raise ConfigError(f"LLMQTrainer got unknown argument(s) {sorted(unknown)}; run options are "
                              f"{sorted(_OPTION_FIELDS)}.")
        self.opts = dataclasses.replace(options or TrainOptions(), **option_fields).validate()
        self.checkpoint_dir = os.path.abspath(checkpoint_dir or os.path.join(out_dir, "ckpt"))
        self.resume = resume
        self.runtime = dict(checkpoint_dir=self.checkpoint_dir, ckpt_interval=ckpt_interval, ckpt_keep_n=ckpt_keep_n,
                            ckpt_major=ckpt_major, max_restarts=max_restarts,
                            skip_update_on_spike=skip_update_on_spike, spike_window=spike_window,
                            spike_threshold=spike_threshold, train_file=train_file, eval_file=eval_file, synthetic_data=synthetic_data,
                            device=device, backend=backend, gpus=gpus, workers=workers,
                            cpus_per_worker=cpus_per_worker, eval_every_n_steps=eval_every_n_steps,
                            eval_num_steps=eval_num_steps, final_eval=final_eval, out_dir=out_dir,
                            log_file=log_file, export=export, export_dtype=export_dtype,
                            use_ray_data=use_ray_data, collective_timeout_s=collective_timeout_s,
                            call_timeout_s=call_timeout_s, step_timeout_s=step_timeout_s, fault=fault, wandb_project=wandb_project,
                            wandb_run_name=wandb_run_name, log_gpu_util=log_gpu_util)
        self.progress = progress
        self.ray_address = ray_address
        self.verbose = verbose
        self.spec: Optional[RuntimeSpec] = None
        self.coordinator = None
        self.info: Optional[dict] = None
        self._started_ray = False
        self.notes: list[str] = []       # warnings found before start (skipped checkpoints), printed there
        try:
            self._check_inputs()
            self.resume_from = self._resolve_resume()
        finally:
            if self.verbose:
                for note in self.notes:
                    print(f"warning: {note}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ validation before any Ray work
    def _check_inputs(self) -> None:
        o, r = self.opts, self.runtime
        cfg, _ = resolve_model(o.model)
        from llmq_ray.optim import learning_rate_at

        # the schedule's own checks (--warmup in [0, --steps), wsd cooldown room), before any actor starts
        learning_rate_at(0, base_lr=o.learning_rate, total_steps=o.steps, warmup_steps=o.warmup,
                         schedule=o.lr_schedule, final_lr_fraction=o.final_lr_fraction,
                         cooldown_fraction=o.cooldown_fraction)
        n = o.batch_size * o.seq_len
        if n % o.lmhead_chunks:
            raise ConfigError(f"--lmhead-chunks={o.lmhead_chunks} must divide --batch-size x --seq-len = {n}.")
        if o.seq_len > cfg.max_position_embeddings:
            raise ConfigError(f"--seq-len={o.seq_len} exceeds the model's max_position_embeddings "
                              f"({cfg.max_position_embeddings}).")
        if r["device"] not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"--device={r['device']!r} must be auto, cuda or cpu.")
        for flag in ("eval_every_n_steps", "eval_num_steps", "gpus"):
            if not isinstance(r[flag], int) or r[flag] < 0:
                raise ConfigError(f"--{flag.replace('_', '-')}={r[flag]!r} must be an integer >= 0.")
        if r["workers"] is not None and (not isinstance(r["workers"], int) or r["workers"] < 1):
            raise ConfigError(f"--workers={r['workers']!r} must be an integer >= 1.")
        for flag in ("ckpt_interval", "ckpt_major", "max_restarts"):
            if not isinstance(r[flag], int) or isinstance(r[flag], bool) or r[flag] < 0:
                raise ConfigError(f"--{flag.replace('_', '-')}={r[flag]!r} must be an integer >= 0.")
        if not isinstance(r["ckpt_keep_n"], int) or r["ckpt_keep_n"] < 1:
            raise ConfigError(f"--ckpt-keep-n={r['ckpt_keep_n']!r} must be an integer >= 1 (default 2).")
        if not isinstance(r["spike_window"], int) or r["spike_window"] < 2:
            raise ConfigError(f"--spike-window={r['spike_window']!r} must be an integer >= 2.")
        t = r["step_timeout_s"]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
            raise ConfigError(f"--step-timeout-s={t!r} must be a number of seconds > 0 (default 1800: a step "
                              f"that takes longer counts as a hung worker).")
        if not (isinstance(r["spike_threshold"], (int, float)) and r["spike_threshold"] > 0):
            raise ConfigError(f"--spike-threshold={r['spike_threshold']!r} must be a number > 0.")
        if r["ckpt_keep_n"] == 1:
            self.notes.append("--ckpt-keep-n=1 keeps a single checkpoint: a crash while the next one is written "
                              "can leave only that one, and a corrupt one leaves nothing to resume from.")
        if r["export_dtype"] not in (None, "fp32", "bf16"):
            raise ConfigError(f"--export-dtype={r['export_dtype']!r} must be fp32 or bf16.")
        if not r["synthetic_data"]:
            if not r["train_file"]:
                raise ConfigError("no --train-file given: pass a glob of token shards (see `python -m "
                                  "data_pipeline.tokenize`), or --synthetic-data for random tokens.")
            from data_pipeline.sources import resolve_files

            resolve_files(r["train_file"])  # DataError naming the glob when it matches nothing
            if r["eval_file"]:
                resolve_files(r["eval_file"])

    def _resolve_resume(self) -> Optional[str]:
        """The checkpoint folder ``resume`` names (None: start fresh). Checked here, before any Ray work:
        the folder is complete, and of this model (CheckpointError, one sentence). Incomplete or corrupt
        newer folders are skipped with a warning (in ``self.notes``)."""
        if self.resume is False or self.resume is None:
            return None
        from llmq_ray.checkpoint import CheckpointWarning, check_config, read_manifest, resolve_continue

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", CheckpointWarning)
            folder = resolve_continue(self.resume, self.checkpoint_dir)
        self.notes += [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
        cfg, _ = resolve_model(self.opts.model)
        check_config(read_manifest(folder), cfg, folder)
        return os.path.abspath(folder)

    # ------------------------------------------------------------------ Ray and the actors
    def _init_ray(self):
        import ray

        if not ray.is_initialized():
            kwargs = {"address": self.ray_address, "log_to_driver": True}
            if self.ray_address is None:
                # a fresh local instance: declare more CPUs than the workers take (Ray Data needs spare ones)
                kwargs.update(num_cpus=max(os.cpu_count() or 1, (self.runtime["workers"] or 1) + 2),
                              dashboard_host="127.0.0.1")
            ray.init(**{k: v for k, v in kwargs.items() if v is not None})
            self._started_ray = True
        return ray

    def _build_spec(self, ray) -> RuntimeSpec:
        r = self.runtime
        total = ray.cluster_resources()
        gpus_in_cluster = int(total.get("GPU", 0))
        device = r["device"]
        if device == "auto":
            device = "cuda" if gpus_in_cluster > 0 else "cpu"
        if device == "cuda":
            world = r["gpus"] or r["workers"] or gpus_in_cluster or 1
            if r["gpus"] and r["workers"] and r["gpus"] != r["workers"]:
                raise ConfigError(f"--gpus={r['gpus']} and --workers={r['workers']} disagree; on CUDA there is "
                                  f"one worker per GPU, give only one of them.")
        else:
            if r["gpus"]:
                raise ConfigError(f"--gpus={r['gpus']} with --device=cpu: use --workers for CPU workers.")
            world = r["workers"] or 1
        cpw = r["cpus_per_worker"]
        if cpw is None:
            if device == "cuda":
                cpw = max(1, min(8, int(total.get("CPU", 1)) // max(world, 1) - 1))
            else:
                cpw = 1
        backend = fastest_backend(device) if r["backend"] == "auto" else r["backend"]
        if device == "cpu" and backend != "torch":
            raise ConfigError(f"--backend={backend} needs a GPU; on --device=cpu use --backend=torch.")
        if self.opts.deterministic_attention and backend != "triton":
            raise ConfigError(f"--deterministic-attention needs --backend=triton (got --backend={backend}).")
        if device == "cpu" and self.opts.use_cuda_graphs:
            raise ConfigError("--use-cuda-graphs needs --device=cuda (GPU workers); drop it for CPU runs.")
        return RuntimeSpec(opts=self.opts, train_file=r["train_file"], eval_file=r["eval_file"],
                           synthetic_data=r["synthetic_data"], use_ray_data=r["use_ray_data"], device=device,
                           backend=backend, world_size=world, cpus_per_worker=cpw,
                           eval_every_n_steps=r["eval_every_n_steps"], eval_num_steps=r["eval_num_steps"],
                           final_eval=r["final_eval"], out_dir=os.path.abspath(r["out_dir"]),
                           export=r["export"], export_dtype=r["export_dtype"],
                           log_file=os.path.abspath(r["log_file"]) if r["log_file"] else None,
                           collective_timeout_s=r["collective_timeout_s"], call_timeout_s=r["call_timeout_s"],
                           step_timeout_s=float(r["step_timeout_s"]),
                           checkpoint_dir=r["checkpoint_dir"], ckpt_interval=r["ckpt_interval"],
                           ckpt_keep_n=r["ckpt_keep_n"], ckpt_major=r["ckpt_major"], resume_from=self.resume_from,
                           max_restarts=r["max_restarts"], skip_update_on_spike=r["skip_update_on_spike"],
                           spike_window=r["spike_window"], spike_threshold=float(r["spike_threshold"]),
                           fault=r["fault"], wandb_project=r["wandb_project"],
                           wandb_run_name=r["wandb_run_name"], log_gpu_util=r["log_gpu_util"])

    def start(self) -> dict:
        """Join/start Ray, place the workers and build their engines (done lazily by every other call)."""
        if self.coordinator is not None:
            return self.info
        ray = self._init_ray()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from actors.coordinator import Coordinator
        from actors.worker import PROBE_GROUP

        self.spec = self._build_spec(ray)
        from actors.placement import check_resources

        check_resources(self.spec)  # --gpus above what exists: one sentence, before any actor starts
        env = {"PYTHONPATH": os.pathsep.join(p for p in (_REPO_ROOT, os.environ.get("PYTHONPATH")) if p)}
        env.update({k: v for k, v in os.environ.items() if k.startswith("WANDB_")})  # WANDB_MODE etc.
        here = ray.get_runtime_context().get_node_id()
        # the probe group runs Coordinator.progress beside a running call (the eval bar polls it)
        self.coordinator = ray.remote(concurrency_groups={PROBE_GROUP: 1})(Coordinator).options(
            num_cpus=0, max_restarts=0, runtime_env={"env_vars": env},
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=True)).remote(self.spec)
        try:
            self.info = self._get(self.coordinator.start.remote(self.notes), "start-up")
        except BaseException:
            self.close()
            raise
        if self.verbose:
            self._print_setup()
        self._print(self.info["lines"])
        return self.info

    def _print_setup(self) -> None:
        s, i = self.spec, self.info
        gib = lambda b: f"{b / 2**30:.2f} GiB" if b >= 2**26 else f"{b / 2**20:.1f} MiB"  # noqa: E731
        print(f"llmq-ray: {self.opts.model} on {s.world_size} x {i['gpu'] or 'cpu'} worker(s) "
              f"(backend {s.backend}, ZeRO-{self.opts.effective_zero_level}), set-up {i['seconds']:.1f} s; "
              f"log {i['log_file']}", flush=True)
        from llmq_ray.memory_table import format_memory_table

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

        limit = timeout or (self.spec.call_timeout_s + 120.0 if self.spec else 3600.0)
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
            raise wrap_error(exc, None, what) from None

    def _eval_progress(self) -> Optional[dict]:
        """The coordinator's report on the eval running now (see ``Coordinator.progress``); None if none,
        or if it does not answer within 2 s."""
        import ray

        from actors.worker import PROBE_GROUP

        try:
            return ray.get(self.coordinator.progress.options(concurrency_group=PROBE_GROUP).remote(), timeout=2.0)
        except Exception:  # noqa: BLE001 - a bar is never worth an error
            return None

    def _eval_bar(self, under=None):
        """An ``EvalBar`` on stdout (off with --no-progress, verbose=False, or when stdout is no terminal)."""
        from llmq_ray.progress import EvalBar

        return EvalBar(sys.stdout, enabled=self.verbose and self.progress, under=under)

    # ------------------------------------------------------------------ whole run
    def fit(self) -> Result:
        """Train ``steps`` optimizer steps (evals as configured), final eval, export; returns a Result.
        The workers are released at the end (also on error)."""
        self.start()
        try:
            done = self._get(self.coordinator.summary.remote(), "summary")["steps"]
            in_flight: collections.deque = collections.deque()
            submitted = done
            from llmq_ray.progress import Progress

            bar = Progress(self.opts.steps, "train", unit="step", stream=sys.stdout,
                           enabled=self.verbose and self.progress, initial=done)
            evals = self._eval_bar(under=bar)  # periodic evals run inside train_step
            while done < self.opts.steps:
                # keep one step queued behind the running one: the coordinator never waits for us
                while len(in_flight) < 2 and submitted < self.opts.steps:
                    in_flight.append(self.coordinator.train_step.remote())
                    submitted += 1
                out = self._get(in_flight.popleft(), f"step {done + 1}", self._step_timeout(), bar=evals)
                done += 1
                if self.verbose:
                    for line in out["lines"]:
                        bar.write(line)
                bar.update(1, loss=f"{out['record']['loss']:.4f}" if out.get("record") else "")
            bar.close()
            fin = self._get(self.coordinator.finish.remote(), "final eval and export", bar=self._eval_bar())
            self._print(fin["lines"])
            hist = self._get(self.coordinator.get_history.remote(), "history")
            summary = fin["summary"]
            if self.verbose:
                self._print_summary(summary)
            return Result(metrics={k: summary[k] for k in ("steps", "train_loss", "eval_loss", "tokens_per_s",
                                                            "step_seconds", "worker_seconds", "restarts",
                                                            "skipped_steps", "warnings")},
                          history=hist["steps"], evals=hist["evals"], export_path=summary["export_path"],
                          checkpoint_paths=summary["checkpoints"], log_file=summary["log_file"])
        finally:
            self.close()

    def _step_timeout(self) -> float:
        """How long one train_step call on the coordinator may take: a step, a checkpoint, and room for the
        automatic restarts (set-up, loading, the lost steps trained again). A backstop only: the
        coordinator bounds every worker call itself."""
        s = self.spec
        return (s.step_timeout_s + s.call_timeout_s + 120.0) * (2 + 2 * s.max_restarts)

    def _print(self, lines) -> None:
        if self.verbose:
            for line in lines:
                print(line, flush=True)

    def _print_summary(self, s: dict) -> None:
        tps = f"{s['tokens_per_s']:,.0f}" if s["tokens_per_s"] else "-"
        print(f"done: {s['steps']} steps, {tps} tokens/s, last train loss {s['train_loss']:.4f}"
              + (f", eval loss {s['eval_loss']:.4f}" if s["eval_loss"] is not None else ""), flush=True)

    # ------------------------------------------------------------------ step-level API
    def step(self) -> None:
        """One forward+backward over all workers (each on its own next batch); gradients accumulate."""
        self.start()
        self._get(self.coordinator.micro_step.remote(), "step")

    def update(self, lr: Optional[float] = None) -> dict:
        """The optimizer update after step() calls: {"loss", "norm", "lr", "tokens", "seconds", ...}."""
        self.start()
        return self._get(self.coordinator.update.remote(lr), "update")

    def train_step(self) -> dict:
        """grad_accumulation micro-steps + update in one Ray call per worker; prints the [T] line."""
        self.start()
        out = self._get(self.coordinator.train_step.remote(), "train_step", bar=self._eval_bar())
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
        return self._get(self.coordinator.export.remote(os.path.abspath(path) if path else None), "export")

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
        """Release the workers, the placement group and the coordinator; shut Ray down only if we started it."""
        import ray

        if self.coordinator is not None:
            try:
                ray.get(self.coordinator.shutdown.remote(), timeout=60)
            except Exception:  # noqa: BLE001 - best effort: it may be the thing that failed
                pass
            ray.kill(self.coordinator)
            self.coordinator = None
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
            self._started_ray = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _main_guard() -> None:  # pragma: no cover - for `python -m llmq_ray.trainer` by mistake
    print("use `python examples/train.py` or `llmq-train` to train from the command line", file=sys.stderr)


if __name__ == "__main__":  # pragma: no cover
    _main_guard()
