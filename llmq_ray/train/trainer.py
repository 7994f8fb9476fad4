"""``LLMQTrainer``: a whole training run on Ray in one call, or step by step for custom loops.

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

Keyword arguments are ``TrainOptions`` fields (model math and schedule; same names as the CLI flags) plus
the runtime arguments of ``__init__`` below.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib.util
import inspect
import os
import re
import sys
import threading
import warnings
from typing import Optional

from llmq_ray.actors.failures import CoordinatorLost, WorkerError, wrap_error
from llmq_ray.actors.spec import RuntimeSpec
from llmq_ray.model.config import resolve_model
from llmq_ray import storage
from llmq_ray.errors import CheckpointError, ConfigError, LLMQError
from llmq_ray.options import TrainOptions
from llmq_ray.train.ray_target import resolve_ray_target
from llmq_ray.train.run_lock import RunLock, lock_beside, lock_inside

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
    history: one dict per optimizer step {"step" (1-based, as on the console), "lr", "loss", "norm", "tokens",
             "seconds", "tokens_per_s", "sol", "worker_seconds", "ray_overhead_seconds", ...}; evals: one dict per
             evaluation ("step": the steps done before it).
    """

    metrics: dict
    history: list
    evals: list
    export_path: Optional[str]
    checkpoint_paths: list
    log_file: Optional[str]
    stopped: Optional[dict] = None  # a run stopped early (see LLMQTrainer.stop): None when it finished


def fastest_backend(device: str) -> str:
    """triton on CUDA when that backend is present in this install, else the torch reference."""
    if device == "cuda" and importlib.util.find_spec("llmq_ray.backends.triton") is not None:
        return "triton"
    return "torch"


def tune_reporter():
    """``ray.tune.report`` when this process runs a Ray Tune trial (``LLMQTrainer(...).fit()`` inside a Tune
    trainable, e.g. a learning-rate sweep), else None: each step's metrics then reach Tune as they happen, so
    its schedulers (ASHA, PBT) can stop or compare trials while they train."""
    try:
        from ray import tune

        with warnings.catch_warnings():  # outside a trial Ray warns that it was asked; that is the answer we want
            warnings.simplefilter("ignore")
            ctx = tune.get_context()
            if ctx is None or ctx.get_trial_id() is None:
                return None
    except Exception:  # noqa: BLE001 - outside a trial (or no Tune installed): nothing to report to
        return None
    return tune.report


def tune_metrics(record: dict, evaluation: Optional[dict] = None) -> dict:
    """What one step reports to Tune: the step record's numbers (step counted from 1, loss, grad norm, lr,
    tokens/s) and, after a periodic eval, its loss."""
    out = {"step": int(record["step"]), "loss": record["loss"], "norm": record.get("norm"),
           "lr": record.get("lr"), "tokens_per_s": record.get("tokens_per_s")}
    if evaluation and evaluation.get("loss") is not None:
        out["eval_loss"] = evaluation["loss"]
    return {k: v for k, v in out.items() if v is not None}


def parse_port_range(text: Optional[str]) -> Optional[tuple]:
    """``"29500-29599"`` -> (29500, 29599); None stays None; ConfigError naming the flag otherwise."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", str(text))
    if not m or not 1024 <= int(m.group(1)) <= int(m.group(2)) <= 65535:
        raise ConfigError(f"--rendezvous-port-range={text!r} must be two ports LO-HI with 1024 <= LO <= HI <= 65535 "
                          f"(e.g. 29500-29599).")
    return int(m.group(1)), int(m.group(2))


# environment variables every worker gets from the driver's shell (Ray does not pass them on by itself): object
# store credentials and endpoints, the collectives' and torch's knobs, W&B, our own (LLMQ_*; LLMQ_RAY_CACHE as a default only)
FORWARDED_PREFIXES = ("AWS_", "GOOGLE_", "GCS_", "AZURE_", "HF_", "NCCL_", "GLOO_", "TORCH_", "WANDB_", "LLMQ_")


def _absolute(path: str) -> str:
    """A local path made absolute (the actors may run in another folder); a URI as it is (never os.path)."""
    return path if storage.is_remote(path) else os.path.abspath(path)


def new_run_id() -> str:
    """A run's default name: its start time in UTC and 6 random hex digits (``20261126-031904-a1b2c3``)."""
    import secrets
    import time

    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


def forward_env_names(names: Optional[str]) -> list[str]:
    """The variable names of --forward-env (comma-separated, blanks ignored)."""
    return [n.strip() for n in (names or "").split(",") if n.strip()]


def forwarded_env(names: Optional[str]) -> dict:
    """{name: value} of the driver's environment that the coordinator and every worker get: the variables with
    a ``FORWARDED_PREFIXES`` prefix and those named in ``names`` (--forward-env, comma-separated), except that
    the driver's ``LLMQ_RAY_CACHE`` travels as ``LLMQ_RAY_DRIVER_CACHE``, so a node whose own environment sets
    ``LLMQ_RAY_CACHE`` keeps its own cache folder. ``LLMQ_RAY_FORWARDED`` lists them all, so the coordinator
    passes the same set on to the workers."""
    wanted = set(forward_env_names(names))
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_PREFIXES) or k in wanted}
    env.pop("LLMQ_RAY_FORWARDED", None)
    if "LLMQ_RAY_CACHE" in env:  # a default only: a node's own LLMQ_RAY_CACHE wins (storage.cache_root)
        env[storage.DRIVER_CACHE_ENV] = env.pop("LLMQ_RAY_CACHE")
    env["LLMQ_RAY_FORWARDED"] = ",".join(sorted(env))
    return env


class LLMQTrainer:
    """A training run over one Ray worker actor per GPU (or per CPU worker); see the module docstring."""

    def __init__(self, options: Optional[TrainOptions] = None, *, train_file: Optional[str] = None,
                 eval_file: Optional[str] = None, synthetic_data: bool = False, device: str = "auto",
                 backend: str = "auto", gpus: int = 0, workers: Optional[int] = None,
                 cpus_per_worker: Optional[int] = None, eval_every_n_steps: "int | str" = "auto",
                 eval_num_steps: "int | str" = "auto", final_eval: bool = True, out_dir: str = "out",
                 log_file: Optional[str] = None, export: bool = True, export_dtype: Optional[str] = None,
                 checkpoint_dir: Optional[str] = None, ckpt_interval: int = 0, ckpt_keep_n: int = 2,
                 ckpt_major: int = 0, resume=False, checkpoint_on_exit: bool = True,
                 allow_batch_change: bool = False, max_restarts: int = 3, skip_update_on_spike: bool = False,
                 spike_window: int = 128, spike_threshold: float = 6.0, use_ray_data: bool = True,
                 ray_address: Optional[str] = None, verbose: bool = True, collective_timeout_s: float = 300.0,
                 call_timeout_s: float = 1800.0, step_timeout_s: float = 1800.0, fault: Optional[dict] = None,
                 wandb_project: Optional[str] = None, wandb_run_name: Optional[str] = None, log_gpu_util: int = 0,
                 progress: bool = True, handle_signals: bool = True, cli: bool = False,
                 rendezvous_port_range: Optional[str] = None, socket_ifname: Optional[str] = None,
                 forward_env: Optional[str] = None, ckpt_minutes: float = 30.0, elastic: bool = False,
                 restart_wait_s: float = 300.0, run_id: Optional[str] = None, **option_fields):
        self.cli = cli  # error sentences name CLI flags (--warmup) instead of keyword arguments (warmup)
        self.notes: list[str] = []       # warnings found before start (skipped checkpoints), printed there
        self.lines: list[str] = []       # information found before start (the data used, a batch adjustment)
        self.verbose = verbose
        try:
            self._configure(options, option_fields, dict(
                checkpoint_dir=checkpoint_dir, ckpt_interval=ckpt_interval, ckpt_keep_n=ckpt_keep_n,
                ckpt_major=ckpt_major, max_restarts=max_restarts, skip_update_on_spike=skip_update_on_spike,
                spike_window=spike_window, spike_threshold=spike_threshold, train_file=train_file,
                eval_file=eval_file, synthetic_data=synthetic_data, device=device, backend=backend, gpus=gpus,
                workers=workers, cpus_per_worker=cpus_per_worker, eval_every_n_steps=eval_every_n_steps,
                eval_num_steps=eval_num_steps, final_eval=final_eval, out_dir=out_dir, log_file=log_file,
                export=export, export_dtype=export_dtype, use_ray_data=use_ray_data,
                collective_timeout_s=collective_timeout_s, call_timeout_s=call_timeout_s,
                step_timeout_s=step_timeout_s, fault=fault, wandb_project=wandb_project,
                wandb_run_name=wandb_run_name, log_gpu_util=log_gpu_util, forward_env=forward_env,
                rendezvous_port_range=rendezvous_port_range, socket_ifname=socket_ifname,
                ckpt_minutes=ckpt_minutes, elastic=elastic, restart_wait_s=restart_wait_s, run_id=run_id),
                resume=resume, ray_address=ray_address, checkpoint_on_exit=checkpoint_on_exit,
                allow_batch_change=allow_batch_change)
        except LLMQError as exc:
            raise self._named(exc) from None
        finally:
            if self.verbose:
                for note in self.notes:
                    print(f"warning: {note}", file=sys.stderr, flush=True)
        self.progress = progress
        self.handle_signals = handle_signals
        self.spec: Optional[RuntimeSpec] = None
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

    def _configure(self, options, option_fields: dict, runtime: dict, *, resume, ray_address, checkpoint_on_exit,
                   allow_batch_change) -> None:
        """Resolve the defaults and run every check that needs no Ray (``llmq_ray/train/preflight.py``); nothing is
        written until all of them passed."""
        from llmq_ray.train.preflight import (check_backend, check_locations, check_local_resources,
                                              check_ray_job_stop_grace, local_gpu_count)
        from llmq_ray.settings import check_types, plain_path
        from llmq_ray.train.run_defaults import AUTO, AUTO_OPTION_FIELDS, DERIVED, resolve_eval, resolve_option_fields

        unknown = set(option_fields) - _OPTION_FIELDS
        if unknown:
            raise ConfigError(f"LLMQTrainer got unknown argument(s) {sorted(unknown)}; run options are "
                              f"{sorted(_OPTION_FIELDS)}.")
        option_fields = {k: plain_path(v) for k, v in option_fields.items()}
        runtime = {k: plain_path(v) for k, v in runtime.items()}
        resume = plain_path(resume)
        check_types({**option_fields, **runtime, "resume": resume, "ray_address": ray_address,
                     "checkpoint_on_exit": checkpoint_on_exit, "allow_batch_change": allow_batch_change},
                    auto=frozenset(AUTO_OPTION_FIELDS) | frozenset(DERIVED))
        r = runtime
        if r["device"] not in (AUTO, "cpu", "cuda"):
            raise ConfigError(f"--device={r['device']!r} must be auto, cuda or cpu.")
        ray_here = "ray" in sys.modules and sys.modules["ray"].is_initialized()
        # which Ray our own ray.init will use (None: the caller's); this machine is the whole cluster when it
        # starts a fresh instance (not when it joins one named by --ray-address, RAY_ADDRESS or `ray start`'s file)
        self._ray_target = None if ray_here else resolve_ray_target(ray_address)
        local = self._ray_target is not None and not self._ray_target.joins
        if self._ray_target is not None and self._ray_target.line:
            self.lines.append(self._ray_target.line)
        # the machine the defaults are for: what --device says, else whether this machine has a GPU
        machine = r["device"] if r["device"] != AUTO else ("cuda" if local_gpu_count() > 0 else "cpu")
        if options is None:
            self.opts = resolve_option_fields(option_fields, machine).validate()
        else:
            self.opts = dataclasses.replace(options, **option_fields).validate()
        # every location through llmq_ray/storage.py first: an unknown scheme is refused here, and no URI ever
        # reaches os.path (which would turn s3://bucket/x into a local folder ./s3:/bucket/x)
        resume_dir = resume if isinstance(resume, str) and resume != "latest" and not resume.isdigit() else None
        where = check_locations({"--out-dir": r["out_dir"], "--checkpoint-dir": r["checkpoint_dir"],
                                 "--log-file": r["log_file"], "--continue": resume_dir,
                                 "--train-file": r["train_file"], "--eval-file": r["eval_file"]})
        r["out_dir"], r["checkpoint_dir"], r["log_file"] = (where["--out-dir"], where["--checkpoint-dir"],
                                                             where["--log-file"])
        if resume_dir is not None:
            resume = where["--continue"]
        self._default_ckpt_dir = r["checkpoint_dir"] is None  # out_dir/ckpt: an earlier run's is set aside
        ckpt = r["checkpoint_dir"] or storage.join(r["out_dir"], "ckpt")  # an s3:// out-dir: s3://.../ckpt
        self.checkpoint_dir = _absolute(ckpt)
        r["checkpoint_dir"] = self.checkpoint_dir
        self.resume = resume
        self.ray_address = ray_address
        self.checkpoint_on_exit = checkpoint_on_exit
        self.allow_batch_change = allow_batch_change
        self.runtime = r
        self._check_inputs()
        if local:
            check_backend(r["backend"], r["device"], machine)  # triton/cupy on a CPU-only machine: before Ray starts
            self.notes += check_local_resources(machine, r["workers"] or (1 if machine == "cpu" else None),
                                                r["gpus"], r["cpus_per_worker"])
        if checkpoint_on_exit:
            self.notes += check_ray_job_stop_grace(os.environ)
        self.resume_from = None
        self._check_outputs()
        default_data = not r["synthetic_data"] and not r["train_file"]
        if default_data:  # the embedded tiny-shakespeare (tokenized once into the cache), as the CLI does
            from llmq_ray.train.default_data import default_dataset

            from llmq_ray.train.run_defaults import MACHINE_DEFAULTS

            r["train_file"], default_eval, desc = default_dataset(
                verbose=self.verbose, eval_tokens=MACHINE_DEFAULTS[machine]["eval_tokens"])
            r["eval_file"] = r["eval_file"] or default_eval
            self.lines.append(f"data: {desc}")
        r["eval_every_n_steps"], r["eval_num_steps"] = resolve_eval(
            r["eval_every_n_steps"], r["eval_num_steps"], bool(r["eval_file"]), machine)
        for flag, least, why in (("eval_every_n_steps", 0, "0: only the final eval"),
                                 ("eval_num_steps", 1, "the batches of each periodic eval; --eval-every-n-steps "
                                                       "0 alone turns periodic evals off")):
            if isinstance(r[flag], bool) or not isinstance(r[flag], int) or r[flag] < least:
                raise ConfigError(f"--{flag.replace('_', '-')}={r[flag]!r} must be an integer >= {least} ({why}).")
        self._check_data()
        self.resume_from = self._resolve_resume()  # last: it hashes the whole checkpoint (a minute at 7B, cold)
        known_world = (r["workers"] or 1) if machine == "cpu" and local else (r["gpus"] or r["workers"] or None)
        t = self.opts.tensor_parallel
        if known_world and known_world % t == 0:  # else _build_spec says why
            self._keep_global_batch(known_world // t)
        if self.verbose:
            for line in self.lines:
                print(line, flush=True)
        self.lines = []

    def resolved_settings(self) -> dict:
        """Every setting of this run after the defaults were resolved: the TrainOptions fields and the runtime
        keywords (what ``--print-config`` prints; a config file with these reproduces the run)."""
        out = dataclasses.asdict(self.opts)
        out.update({k: v for k, v in self.runtime.items() if k != "fault"})
        out.update(resume=self.resume if self.resume is not False else None, ray_address=self.ray_address,
                   checkpoint_on_exit=self.checkpoint_on_exit, allow_batch_change=self.allow_batch_change,
                   progress=self.progress)
        return out

    def _named(self, exc: LLMQError) -> LLMQError:
        """``exc`` with its flag names written as this API's keyword arguments (unless used by the CLI)."""
        if self.cli:
            return exc
        from llmq_ray.train.run_defaults import api_names

        text = api_names(str(exc), _OPTION_FIELDS | _RUNTIME_ARGS)
        if text == str(exc):
            return exc
        try:
            return type(exc)(text)
        except TypeError:  # an exception type with another constructor: keep it as it is
            return exc

    # ------------------------------------------------------------------ validation before any Ray work
    def _check_inputs(self) -> None:
        o, r = self.opts, self.runtime
        cfg, folder = resolve_model(o.model)
        self.cfg = cfg
        if folder and not o.from_scratch and self.resume in (False, None):
            # the weights the workers will load (their files' headers, no torch): one sentence here, not in rank 0
            from llmq_ray.model.weight_files import find_tensor_files

            find_tensor_files(folder)
        if o.tensor_parallel > 1:  # the model's split (heads, MLP width), before any actor starts
            from llmq_ray.engine.tensor_parallel import TensorParallelPlan

            TensorParallelPlan(cfg, o.tensor_parallel)
        from llmq_ray.lr_schedule import learning_rate_at

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
        parse_port_range(r["rendezvous_port_range"])  # one sentence now, not in rank 0 later
        if r["synthetic_data"] and r["train_file"]:  # else the files would be ignored without a word
            raise ConfigError(f"--synthetic-data and --train-file={r['train_file']} both say what to train on; pass "
                              f"one of them.")
        if not isinstance(r["gpus"], int) or isinstance(r["gpus"], bool) or r["gpus"] < 0:
            raise ConfigError(f"--gpus={r['gpus']!r} must be an integer >= 0.")
        if r["workers"] is not None and (not isinstance(r["workers"], int) or r["workers"] < 1):
            raise ConfigError(f"--workers={r['workers']!r} must be an integer >= 1.")
        for flag in ("ckpt_interval", "ckpt_major", "max_restarts"):
            if not isinstance(r[flag], int) or isinstance(r[flag], bool) or r[flag] < 0:
                raise ConfigError(f"--{flag.replace('_', '-')}={r[flag]!r} must be an integer >= 0.")
        if not isinstance(r["ckpt_keep_n"], int) or r["ckpt_keep_n"] < 1:
            raise ConfigError(f"--ckpt-keep-n={r['ckpt_keep_n']!r} must be an integer >= 1 (default 2).")
        if not isinstance(r["spike_window"], int) or r["spike_window"] < 2:
            raise ConfigError(f"--spike-window={r['spike_window']!r} must be an integer >= 2.")
        for flag, default in (("step_timeout_s", "1800: a step that takes longer counts as a hung worker"),
                              ("collective_timeout_s", "300"), ("call_timeout_s", "1800")):
            t = r[flag]
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
                raise ConfigError(f"--{flag.replace('_', '-')}={t!r} must be a number of seconds > 0 (default "
                                  f"{default}).")
        forwarded = forward_env_names(r["forward_env"])
        for name in forwarded:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise ConfigError(f"--forward-env: {name!r} is not the name of an environment variable; the flag "
                                  f"takes names, comma-separated (their values are the driver's).")
        self.notes += [f"--forward-env names {name}, which is not set here, so the workers do not get it."
                       for name in forwarded if name not in os.environ]
        for flag in ("ckpt_minutes", "restart_wait_s"):
            v = r[flag]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
                raise ConfigError(f"--{flag.replace('_', '-')}={v!r} must be a number >= 0.")
        if r["run_id"] is None:
            r["run_id"] = new_run_id()
        elif not (isinstance(r["run_id"], str) and re.fullmatch(r"[A-Za-z0-9._-]{1,64}", r["run_id"])):
            raise ConfigError(f"--run-id={r['run_id']!r} must be 1-64 letters, digits, '.', '_' or '-' (it becomes a "
                              f"metric label).")
        if not (isinstance(r["spike_threshold"], (int, float)) and r["spike_threshold"] > 0):
            raise ConfigError(f"--spike-threshold={r['spike_threshold']!r} must be a number > 0.")
        if r["ckpt_keep_n"] == 1:
            self.notes.append("--ckpt-keep-n=1 keeps a single checkpoint: a crash while the next one is written "
                              "can leave only that one, and a corrupt one leaves nothing to resume from.")
        if r["export_dtype"] not in (None, "fp32", "bf16"):
            raise ConfigError(f"--export-dtype={r['export_dtype']!r} must be fp32 or bf16.")
        if r["device"] == "cpu" and r["gpus"]:
            raise ConfigError(f"--gpus={r['gpus']} with --device=cpu: use --workers for CPU workers.")
        if r["device"] == "cpu" and r["backend"] not in ("auto", "torch"):
            raise ConfigError(f"--backend={r['backend']} needs a GPU; on --device=cpu use --backend=torch.")
        from llmq_ray.train.preflight import check_optional_packages

        check_optional_packages(r["wandb_project"], r["log_gpu_util"])

    def _check_outputs(self) -> None:
        """The output, checkpoint and log locations (``llmq_ray/train/preflight.py``); a fresh run refuses a
        checkpoint folder that holds another run's checkpoints."""
        from llmq_ray.train.preflight import check_fresh_checkpoint_dir, check_log_file, check_writable_dir

        r = self.runtime
        if not storage.is_remote(r["out_dir"]):  # a store was checked by check_locations
            check_writable_dir(r["out_dir"], "--out-dir")
        if not storage.is_remote(self.checkpoint_dir):
            check_writable_dir(self.checkpoint_dir, "--checkpoint-dir")
        explicit = r["log_file"] is not None
        log = r["log_file"] or storage.join(r["out_dir"], "log.jsonl")  # as given: the message names it
        check_log_file(log, "--log-file" if explicit else "--out-dir", self.resume not in (False, None), explicit)
        self._set_aside_ckpt = None
        if self.resume in (False, None) and (self.checkpoint_on_exit or r["ckpt_interval"] or r["ckpt_minutes"]):
            try:
                check_fresh_checkpoint_dir(self.checkpoint_dir)
            except CheckpointError:
                if not (self._default_ckpt_dir and not storage.is_remote(self.checkpoint_dir)):
                    raise  # a folder the user named: never move it, say so
                # checkpoints are on by default (--ckpt-minutes) into out_dir/ckpt: a second fresh run in the same
                # --out-dir keeps the first one's checkpoints beside it (moved once every check has passed)
                self._set_aside_ckpt = self.checkpoint_dir

    def _check_data(self) -> None:
        """Every train/eval file: header, size, token ids against the model's vocabulary; one window at least."""
        from llmq_ray.train.preflight import check_windows

        r = self.runtime
        self._resolve_document_separator()
        if not r["synthetic_data"]:
            check_windows(r["train_file"], "--train-file", self.cfg.vocab_size, self.opts.seq_len)
        if r["eval_file"]:  # with --synthetic-data too: the eval still reads its files
            check_windows(r["eval_file"], "--eval-file", self.cfg.vocab_size, self.opts.seq_len)

    def _resolve_document_separator(self) -> None:
        """--document-masking: a given --document-separator must be a token of the model that occurs in the first
        train shard (else the run would silently mask nothing); without one, the EOS the tokenizer appended to
        every document (meta.json beside the first train shard), else the model's eos_token_id (which must occur)."""
        if not self.opts.document_masking:
            return
        from llmq_ray.train.preflight import data_eos_id, separator_seen

        r = self.runtime
        vocab = self.cfg.vocab_size
        if self.opts.document_separator is not None:  # given: a token of this model that occurs in the data
            sep = self.opts.document_separator
            if sep >= vocab:
                raise ConfigError(f"--document-separator={sep} is not a token id of model {self.opts.model} (its "
                                  f"vocabulary has {vocab} tokens), so nothing would be masked.")
            if not r["synthetic_data"] and separator_seen(r["train_file"], sep) is False:
                raise ConfigError(f"--document-separator={sep} never occurs in the first tokens of --train-file "
                                  f"{r['train_file']}, so nothing would be masked; pass the token that ends its "
                                  f"documents.")
            return
        sep = None if r["synthetic_data"] else data_eos_id(r["train_file"])
        if sep is not None and not 0 <= sep < vocab:
            raise ConfigError(f"--document-masking: the end-of-document token {sep} named by the meta.json beside "
                              f"--train-file {r['train_file']} is not a token id of model {self.opts.model} (its "
                              f"vocabulary has {vocab} tokens): was the data tokenized for another model?")
        if sep is None:
            sep = self.cfg.eos_token_id
            if sep is None:
                raise ConfigError("--document-masking needs --document-separator: neither the train data's "
                                  "meta.json nor the model's config names an end-of-document token.")
            if not r["synthetic_data"] and separator_seen(r["train_file"], sep) is False:
                raise ConfigError(f"--document-masking: the model's EOS token {sep} never occurs in the first "
                                  f"tokens of --train-file {r['train_file']}, so nothing would be masked; pass "
                                  f"--document-separator with the token that ends its documents.")
        self.opts = dataclasses.replace(self.opts, document_separator=int(sep))
        self.lines.append(f"document masking: documents end at token {sep}")

    def _resolve_resume(self) -> Optional[str]:
        """The checkpoint folder ``resume`` names (None: start fresh). Checked here, before any Ray work:
        the folder is complete, its files match their sha256, and it is of this model (CheckpointError, one
        sentence). Incomplete or corrupt newer folders are skipped with a warning (in ``self.notes``)."""
        if self.resume is False or self.resume is None:
            return None
        from llmq_ray.checkpoints.layout import CheckpointWarning, check_config, read_manifest
        from llmq_ray.checkpoints.verify import resolve_continue

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", CheckpointWarning)
            folder = resolve_continue(self.resume, self.checkpoint_dir)
        self.notes += [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
        self.resume_manifest = read_manifest(folder)
        check_config(self.resume_manifest, self.cfg, folder)
        done, steps = int(self.resume_manifest["step"]), self.opts.steps
        if steps < done:  # else the run would train nothing and export the checkpoint's later weights as its own
            raise ConfigError(f"--steps={steps} but the checkpoint to continue, {folder}, already holds {done} steps; "
                              f"pass --steps above {done} to train further (or --steps={done} to run only the final "
                              f"eval and export).")
        if steps == done:
            self.lines.append(f"--steps={steps}: the checkpoint already holds every step; only the final eval and "
                              f"export run")
        return folder if storage.is_remote(folder) else os.path.abspath(folder)

    def _keep_global_batch(self, world: int) -> None:
        """Resuming on another worker count: adjust --grad-accumulation so the checkpoint's global batch stays
        (``preflight.keep_global_batch``), unless ``allow_batch_change``."""
        if not self.resume_from or self.allow_batch_change:
            return
        from llmq_ray.train.preflight import keep_global_batch

        ga, line = keep_global_batch(self.resume_manifest, self.resume_from, self.opts.batch_size,
                                     self.opts.grad_accumulation, world)
        if line:
            self.opts = dataclasses.replace(self.opts, grad_accumulation=ga)
            self.lines.append(line)

    # ------------------------------------------------------------------ Ray and the actors
    def _init_ray(self):
        import ray

        if not ray.is_initialized():
            target = self._ray_target or resolve_ray_target(self.ray_address)  # the caller's Ray has gone since
            kwargs = {"address": target.address, "log_to_driver": True}
            if not target.joins:
                # a fresh local instance: declare more CPUs than the workers take (Ray Data needs spare ones)
                r = self.runtime
                workers = r["workers"] or r["gpus"] or 1
                kwargs.update(num_cpus=max(os.cpu_count() or 1, workers * (r["cpus_per_worker"] or 1) + 2),
                              dashboard_host="127.0.0.1")
            from llmq_ray.observe.ray_console import without_token_auth_notice

            with without_token_auth_notice():  # auth as Ray decides; its notice on every start is dropped
                ray.init(**{k: v for k, v in kwargs.items() if v is not None})
            self._started_ray = True
            if self._signals is not None:
                self._signals.install()  # ray.init replaced SIGTERM's handler with one that exits mid-call
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
            world = r["workers"] or 1
        t = self.opts.tensor_parallel
        if world % t:
            raise ConfigError(f"--tensor-parallel={t} must divide the number of workers ({world}: "
                              f"{'--gpus or the GPUs of the cluster' if device == 'cuda' else '--workers'}).")
        # resuming on another data-parallel size keeps the checkpoint's global batch (a no-op when done before)
        self._keep_global_batch(world // t)
        self._print(self.lines)
        self.lines = []
        cpw = r["cpus_per_worker"]
        if cpw is None:
            if device == "cuda":
                # from the CPUs free now, not the cluster's total: another run on the same cluster holds its
                # workers' CPUs, and this run's Ray Data read tasks need CPUs besides its own workers' (two runs
                # that each took 8 of 16 CPUs left none for them, and both hung at their first batch)
                free = int(ray.available_resources().get("CPU", 0))
                cpw = max(1, min(8, free // max(world, 1) - 1))
            else:
                cpw = 1
        backend = fastest_backend(device) if r["backend"] == "auto" else r["backend"]
        if device == "cpu" and backend != "torch":
            raise ConfigError(f"--backend={backend} needs a GPU; on --device=cpu use --backend=torch.")
        if device == "cpu" and self.opts.use_cuda_graphs:
            raise ConfigError("--use-cuda-graphs needs --device=cuda (GPU workers); drop it for CPU runs.")
        return RuntimeSpec(opts=self.opts, train_file=r["train_file"], eval_file=r["eval_file"],
                           synthetic_data=r["synthetic_data"], use_ray_data=r["use_ray_data"], device=device,
                           backend=backend, world_size=world, cpus_per_worker=cpw,
                           eval_every_n_steps=r["eval_every_n_steps"], eval_num_steps=r["eval_num_steps"],
                           final_eval=r["final_eval"], out_dir=_absolute(r["out_dir"]),
                           export=r["export"], export_dtype=r["export_dtype"],
                           log_file=_absolute(r["log_file"]) if r["log_file"] else None,
                           collective_timeout_s=r["collective_timeout_s"], call_timeout_s=r["call_timeout_s"],
                           step_timeout_s=float(r["step_timeout_s"]),
                           checkpoint_dir=r["checkpoint_dir"], ckpt_interval=r["ckpt_interval"],
                           ckpt_keep_n=r["ckpt_keep_n"], ckpt_major=r["ckpt_major"], resume_from=self.resume_from,
                           max_restarts=r["max_restarts"], skip_update_on_spike=r["skip_update_on_spike"],
                           spike_window=r["spike_window"], spike_threshold=float(r["spike_threshold"]),
                           fault=r["fault"], wandb_project=r["wandb_project"],
                           wandb_run_name=r["wandb_run_name"], log_gpu_util=r["log_gpu_util"],
                           rendezvous_ports=parse_port_range(r["rendezvous_port_range"]),
                           socket_ifname=r["socket_ifname"], ckpt_minutes=float(r["ckpt_minutes"]),
                           elastic=bool(r["elastic"]), restart_wait_s=float(r["restart_wait_s"]),
                           run_id=r["run_id"])

    def start(self) -> dict:
        """Join/start Ray, place the workers and build their engines (done lazily by every other call). Refused
        once this trainer's run has ended after starting (fit() returned, or stop() / close() after the workers
        started): starting again would train a new run from scratch whose export and log replace this run's. A
        start that failed before the workers were up (no room, another run holding the out-dir) may be retried."""
        if self.coordinator is not None:
            return self.info
        if self._ended and self.info is not None:
            raise ConfigError(f"this LLMQTrainer's run has ended (by fit(), stop() or close(); its outputs are in "
                              f"out_dir={self.runtime['out_dir']}), and another call would start a new run from "
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
        if not storage.is_remote(self.runtime["out_dir"]):
            entries.append((lock_inside(self.runtime["out_dir"]), self.runtime["out_dir"], "--out-dir"))
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
        if self.resume in (False, None) and not storage.is_remote(self.runtime["out_dir"]):
            from llmq_ray.train.earlier_outputs import prune_earlier_outputs

            lines += prune_earlier_outputs(_absolute(self.runtime["out_dir"]))  # the previous run's set stays
        self._print(lines)

    def _start(self) -> dict:
        ray = self._init_ray()
        self.spec = self._build_spec(ray)
        from llmq_ray.actors.placement import check_resources, data_cpu_warning

        check_resources(self.spec)  # --gpus above what exists: one sentence, before any actor starts
        warning = data_cpu_warning(self.spec)
        if warning:
            self._say(warning, sys.stderr)
        env = {"PYTHONPATH": os.pathsep.join(p for p in (_REPO_ROOT, os.environ.get("PYTHONPATH")) if p)}
        env.update(forwarded_env(self.runtime["forward_env"]))  # credentials, endpoints, NCCL/GLOO, W&B...
        self._coordinator_env = env
        self._keep_earlier_outputs()
        self.coordinator = self._new_coordinator(self.spec)
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

    def _new_coordinator(self, spec: RuntimeSpec):
        """The coordinator actor of ``spec``, on the driver's node when it can be (the log is local to the user)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from llmq_ray.actors.coordinator import Coordinator
        from llmq_ray.actors.worker import PROBE_GROUP

        here = ray.get_runtime_context().get_node_id()
        # the probe group runs Coordinator.progress beside a running call (the eval bar polls it)
        return ray.remote(concurrency_groups={PROBE_GROUP: 1})(Coordinator).options(
            num_cpus=0, max_restarts=0, runtime_env={"env_vars": self._coordinator_env},
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=True)).remote(spec)

    def _replace_coordinator(self, lost: CoordinatorLost) -> int:
        """The coordinator died (its process was killed, or its node lost while the driver lives on): start a
        new one that resumes from the newest valid checkpoint (or from the start when there is none yet), up to
        --max-restarts times. Its workers and placement group died with it (Ray's fate sharing). Returns the
        step the new coordinator goes on from; re-raises ``lost`` when restarts are off or used up."""
        import ray

        from llmq_ray.checkpoints.layout import CheckpointWarning
        from llmq_ray.checkpoints.verify import find_latest_valid

        self._coordinator_restarts += 1
        limit = self.runtime["max_restarts"]
        if not self.spec.checkpoints_on or self._coordinator_restarts > limit:
            raise lost
        try:
            ray.kill(self.coordinator)
        except Exception:  # noqa: BLE001 - already gone
            pass
        self.coordinator = None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", CheckpointWarning)
            folder = find_latest_valid(self.checkpoint_dir) or self.spec.resume_from
        notes = [str(w.message) for w in caught]
        self._say(f"warning: {str(lost).rstrip('.')}; restarting the coordinator from "
                  f"{folder or 'scratch (no checkpoint yet)'} (restart {self._coordinator_restarts}/{limit}).",
                  sys.stderr)
        self.spec = dataclasses.replace(self.spec, resume_from=folder, append_log=True, fault=None)
        self.coordinator = self._new_coordinator(self.spec)
        self.info = self._get(self.coordinator.start.remote(notes), "start-up after the coordinator was lost")
        self._print(self.info["lines"])
        return int(self.info["step"])

    def _print_setup(self) -> None:
        s, i = self.spec, self.info
        gib = lambda b: f"{b / 2**30:.2f} GiB" if b >= 2**26 else f"{b / 2**20:.1f} MiB"  # noqa: E731
        print(f"llmq-ray: {self.opts.model} on {s.world_size} x {i['gpu'] or 'cpu'} worker(s) "
              f"(backend {s.backend}, ZeRO-{self.opts.effective_zero_level}), set-up {i['seconds']:.1f} s; "
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

        return EvalBar(sys.stdout, enabled=self.verbose and self.progress, under=under)

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
            raise ConfigError(f"fit() already ran on this LLMQTrainer (into out_dir={self.runtime['out_dir']}); make a "
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

        first = steps[0]["step"] if steps else self.opts.steps + 1
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

        bar = Progress(self.opts.steps, "train", unit="step", stream=sys.stdout,
                       enabled=self.verbose and self.progress, initial=done)
        evals = self._eval_bar(under=bar)  # periodic evals run inside train_step
        report = tune_reporter()  # inside a Ray Tune trial: every step's metrics go to Tune
        while in_flight or (submitted < self.opts.steps and not self._stop_requested.is_set()):
            # keep one step queued behind the running one: the coordinator never waits for us
            while len(in_flight) < 2 and submitted < self.opts.steps and not self._stop_requested.is_set():
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
    @property
    def stop_requested(self) -> bool:
        """True once ``request_stop()`` was called or a stop signal arrived (custom loops poll this)."""
        return self._stop_requested.is_set()

    def request_stop(self, signum: Optional[int] = None) -> None:
        """Ask the run to stop after the step under way: ``fit()`` then writes a checkpoint of it (unless
        ``checkpoint_on_exit=False``), the log's "stopped" record, and returns with ``Result.stopped``. Safe to
        call from another thread or a signal handler (it only sets a flag and tells the coordinator from a
        helper thread). In a step-level loop, ``train_step()`` returns None from then on; call ``stop()``."""
        if self._stop_signal is None:
            self._stop_signal = signum  # a signal after request_stop() still sets the exit code
        self._stop_requested.set()  # wakes the notifier thread (started with the coordinator): no work here

    def _notify_coordinator_on_stop(self) -> None:
        """Daemon thread: when a stop is requested, tell the coordinator (in its probe group, beside a running
        step) so that a queued step is not started. A thread of its own, started before any signal can come,
        because a signal handler must not start threads or call Ray."""
        from llmq_ray.actors.worker import PROBE_GROUP

        while not self._stop_requested.wait(0.5):
            if self.coordinator is None:
                return  # the run ended without a stop
        coordinator = self.coordinator
        if coordinator is not None:
            try:
                coordinator.request_stop.options(concurrency_group=PROBE_GROUP).remote()
            except Exception:  # noqa: BLE001 - the coordinator may be gone; the driver stops anyway
                pass

    def stop(self) -> dict:
        """Stop now: a checkpoint of the last completed update (unless ``checkpoint_on_exit=False`` or it
        exists already), the log's "end" record (reason "stopped"), the workers shut down. Returns
        {"signal" (name, or "request_stop()"), "step", "checkpoint" (path or None), "written", "exit_code"
        (128 + the signal number; 0 for request_stop()), "line" (also printed to stderr)}."""
        from llmq_ray.train.stop_signals import EXIT_CODE_REQUEST, EXIT_CODES, signal_name

        self._stop_requested.set()
        name = self._stop_reason or signal_name(self._stop_signal)
        info = {"step": self._steps_done, "checkpoint": None, "written": False, "note": ""}
        if self.coordinator is not None:
            info = self._get(self.coordinator.stop.remote(name, self.checkpoint_on_exit), "stop")
            self._ended = True
        ckpt = info["checkpoint"]
        if ckpt:
            what = (f"checkpoint {os.path.basename(ckpt)} written" if info["written"]
                    else f"checkpoint {os.path.basename(ckpt)} (written before)")
            tail = f"{what} in {os.path.dirname(ckpt)}; resume with --continue"
        else:
            tail = f"no checkpoint ({info['note'] or 'none asked for'})"
        line = f"stopped by {name} after step {info['step']}; {tail}"
        code = EXIT_CODES.get(self._stop_signal, EXIT_CODE_REQUEST) if self._stop_signal else EXIT_CODE_REQUEST
        self._stopped = {"signal": name, "step": info["step"], "checkpoint": ckpt, "written": info["written"],
                         "exit_code": code, "line": line}
        self._say(line, sys.stderr)
        self.close()
        return self._stopped

    def _abandon(self, signum: int) -> dict:
        """A second stop signal: kill the actors at once (a checkpoint being written is left as a temporary
        folder, which no reader takes for a checkpoint; the previous one stays valid), write the log's "end"
        record from here, and report it."""
        import ray

        from llmq_ray.train.stop_signals import EXIT_CODES, signal_name

        first = signal_name(self._stop_signal)
        step = self._steps_done
        if self.coordinator is not None:
            try:
                ray.kill(self.coordinator)  # its workers and placement group go with it
            except Exception:  # noqa: BLE001
                pass
            self.coordinator = None
        if self._stopped is not None:  # the stop had completed (a second signal while closing): it stands
            return self._stopped
        from llmq_ray.checkpoints.layout import CheckpointWarning
        from llmq_ray.checkpoints.verify import find_latest_valid

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CheckpointWarning)
            try:
                newest = find_latest_valid(self.checkpoint_dir, verify_checksums=False)
            except Exception:  # noqa: BLE001 - a report, not a reason to fail now
                newest = None
        valid = (f"the newest valid checkpoint is {os.path.basename(newest)}" if newest
                 else "there is no valid checkpoint")
        note = (f"a second {signal_name(signum)} abandoned the stop (a checkpoint being written is left as a "
                f"temporary folder, never taken for a checkpoint); {valid}")
        self._append_end({"reason": "stopped", "signal": first, "step": step, "checkpoint": None,
                          "checkpoint_written": False, "note": note})
        line = f"stopped by {first} after step {step}; {note}" + ("; resume with --continue" if newest else "")
        self._say(line, sys.stderr)
        return {"signal": first, "step": step, "checkpoint": None, "written": False,
                "exit_code": EXIT_CODES.get(self._stop_signal or signum, 128 + signum), "line": line}

    def _log_path(self) -> str:
        r = self.runtime
        return _absolute(r["log_file"] or storage.join(r["out_dir"], "log.jsonl"))

    def _append_end(self, fields: dict) -> None:
        """Write the "end" record into the log file from the driver (the coordinator is gone)."""
        if self._ended:
            return
        self._ended = True
        path = self._log_path()
        try:
            there = storage.size_of(path) is not None if storage.is_remote(path) else os.path.isfile(path)
        except OSError:  # the store is gone too: nothing more to do
            return
        if not there or (self.info is None and not self.resume_from):
            return  # this run never wrote its log (a file there is an earlier run's): nothing to end
        from llmq_ray.observe.runlog import append_records

        try:
            append_records(path, [{"log": "end", **fields}])
        except (OSError, ValueError):
            pass

    def _end_failed(self, error: str) -> None:
        """The log's "end" record of a run that failed (through the coordinator while it lives)."""
        if self._ended:
            return
        if self.coordinator is not None:
            import ray

            try:
                ray.get(self.coordinator.end.remote("failed", error=error), timeout=30)
                self._ended = True
                return
            except Exception:  # noqa: BLE001 - the coordinator failed too: write it from here
                pass
        self._append_end({"reason": "failed", "step": self._steps_done, "error": error})

    def stop_on_signals(self):
        """Context manager for step-level loops: SIGTERM / SIGINT / SIGHUP call ``request_stop()`` while it is
        active (``fit()`` uses it too)::

            with t.stop_on_signals():
                for _ in range(n):
                    if t.train_step() is None:   # a stop was requested
                        break
                if t.stop_requested:
                    t.stop()                     # checkpoint, "stopped" record, workers shut down
        """
        return self._stop_signals(True)

    @contextlib.contextmanager
    def _stop_signals(self, enabled: bool):
        from llmq_ray.train.stop_signals import SignalStop

        if not enabled or self._signals is not None:
            yield
            return
        self._signals = SignalStop(self.request_stop)
        self._signals.install()
        try:
            yield
        finally:
            self._signals.restore()
            self._signals = None

    def _step_timeout(self) -> float:
        """How long one train_step call on the coordinator may take: a step, a checkpoint, and room for the
        automatic restarts (set-up, loading, the lost steps trained again). A backstop only: the
        coordinator bounds every worker call itself."""
        s = self.spec
        return (s.step_timeout_s + s.call_timeout_s + 120.0) * (2 + 2 * s.max_restarts)

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
            ray.kill(self.coordinator)
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


_RUNTIME_ARGS = {name for name, p in inspect.signature(LLMQTrainer.__init__).parameters.items()
                 if p.kind is p.KEYWORD_ONLY}


def _main_guard() -> None:  # pragma: no cover - for `python -m llmq_ray.train.trainer` by mistake
    print("use `python examples/train.py` or `llmq-train` to train from the command line", file=sys.stderr)


if __name__ == "__main__":  # pragma: no cover
    _main_guard()
