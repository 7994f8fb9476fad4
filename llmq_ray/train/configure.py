"""The pre-flight of a run: the settings routed, resolved for the machine and checked, and every input that needs no
Ray checked against them -- the model's files and sizes, the data, the output and checkpoint folders, the
checkpoint to resume from -- before anything is written or any actor starts (one sentence for the first mistake).

``RunConfiguration`` is the part of ``LLMQTrainer`` that runs in its constructor (a base class of it, so the
trainer's state stays one object); the checks themselves that read files are functions of
llmq_ray/train/preflight.py.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from typing import Optional

from llmq_ray import storage
from llmq_ray.errors import CheckpointError, ConfigError, LLMQError
from llmq_ray.model.config import resolve_model
from llmq_ray.settings import AUTO, RunSettings
from llmq_ray.settings.rules import forward_env_names
from llmq_ray.train.ray_target import resolve_ray_target


def _absolute(path: str) -> str:
    """A local path made absolute (the actors may run in another folder); a URI as it is (never os.path)."""
    return path if storage.is_remote(path) else os.path.abspath(path)



def fastest_backend(device: str) -> str:
    """triton on CUDA when that backend is present in this install, else the torch reference."""
    if device == "cuda" and importlib.util.find_spec("llmq_ray.backends.triton") is not None:
        return "triton"
    return "torch"


# environment variables every worker gets from the driver's shell (Ray does not pass them on by itself): object
# store credentials and endpoints, the collectives' and torch's knobs, W&B, our own (LLMQ_*; LLMQ_RAY_CACHE as a default only)
FORWARDED_PREFIXES = ("AWS_", "GOOGLE_", "GCS_", "AZURE_", "HF_", "NCCL_", "GLOO_", "TORCH_", "WANDB_", "LLMQ_")


def new_run_id() -> str:
    """A run's default name: its start time in UTC and 6 random hex digits (``20261126-031904-a1b2c3``)."""
    import secrets
    import time

    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


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


class RunConfiguration:
    """What ``LLMQTrainer.__init__`` resolves and checks; the attributes it sets are the trainer's."""

    def _configure(self, settings: Optional[RunSettings], overrides: dict) -> None:
        """Route the overrides onto the tree, resolve the "auto" values for this machine, check every rule and
        every input that needs no Ray (``llmq_ray/train/preflight.py``); nothing is written until all passed."""
        from llmq_ray.model.config import PRESETS
        from llmq_ray.settings import make_settings
        from llmq_ray.settings.defaults import DEFAULT_EVAL_TOKENS, resolve
        from llmq_ray.settings.rules import validate
        from llmq_ray.train.preflight import (check_backend, check_locations, check_local_resources,
                                              check_ray_job_stop_grace, local_gpu_count)

        s = make_settings(settings, **overrides)
        self.settings = s
        p, c, ob, d = s.parallel, s.checkpoints, s.observe, s.data
        ray_here = "ray" in sys.modules and sys.modules["ray"].is_initialized()
        # which Ray our own ray.init will use (None: the caller's); this machine is the whole cluster when it
        # starts a fresh instance (not when it joins one named by --ray-address, RAY_ADDRESS or `ray start`'s file)
        self._ray_target = None if ray_here else resolve_ray_target(p.ray_address)
        local = self._ray_target is not None and not self._ray_target.joins
        if self._ray_target is not None and self._ray_target.line:
            self.lines.append(self._ray_target.line)
        # the machine the defaults are for: what --device says, else whether this machine has a GPU
        machine = p.device if p.device != AUTO else ("cuda" if local_gpu_count() > 0 else "cpu")
        if local:
            check_backend(p.backend, p.device, machine)  # triton/cupy on a CPU-only machine: before Ray starts
        s = resolve(s, machine, presets=PRESETS)
        self.settings = s
        p, c, ob, d = s.parallel, s.checkpoints, s.observe, s.data
        # every location through llmq_ray/storage.py first: an unknown scheme is refused here, and no URI ever
        # reaches os.path (which would turn s3://bucket/x into a local folder ./s3:/bucket/x)
        resume = c.resume
        resume_dir = resume if isinstance(resume, str) and resume != "latest" and not resume.isdigit() else None
        where = check_locations({"--out-dir": ob.out_dir, "--checkpoint-dir": c.checkpoint_dir,
                                 "--log-file": ob.log_file, "--continue": resume_dir,
                                 "--train-file": d.train_file, "--eval-file": d.eval_file})
        ob.out_dir, c.checkpoint_dir, ob.log_file = where["--out-dir"], where["--checkpoint-dir"], where["--log-file"]
        if resume_dir is not None:
            c.resume = where["--continue"]
        self._default_ckpt_dir = c.checkpoint_dir is None  # out_dir/ckpt: an earlier run's is set aside
        ckpt = c.checkpoint_dir or storage.join(ob.out_dir, "ckpt")  # an s3:// out-dir: s3://.../ckpt
        self.checkpoint_dir = _absolute(ckpt)
        c.checkpoint_dir = self.checkpoint_dir
        self.resume = c.resume
        default_data = not d.synthetic_data and not d.train_file
        if default_data:  # the embedded tiny-shakespeare (tokenized once into the cache), as the CLI does
            from llmq_ray.train.default_data import default_dataset

            d.train_file, default_eval, desc = default_dataset(verbose=self.verbose,
                                                               eval_tokens=DEFAULT_EVAL_TOKENS[machine])
            d.eval_file = d.eval_file or default_eval
            self.lines.append(f"data: {desc}")
        cfg, self._model_folder = resolve_model(s.model.model)
        self.cfg = cfg
        s = resolve(s, machine, has_eval_file=bool(d.eval_file), swiglu_mlp=not cfg.is_gpt2)
        self.settings = s
        validate(s)
        self._check_inputs()
        if local:
            self.notes += check_local_resources(machine, p.workers or (1 if machine == "cpu" else None), p.gpus,
                                                p.cpus_per_worker)
        if c.checkpoint_on_exit:
            self.notes += check_ray_job_stop_grace(os.environ)
        self.resume_from = None
        self._check_outputs()
        self._check_data()
        self.resume_from = self._resolve_resume()  # last: it hashes the whole checkpoint (a minute at 7B, cold)
        p = self.settings.parallel
        known_world = (p.workers or 1) if machine == "cpu" and local else (p.gpus or p.workers or None)
        t = p.tensor_parallel
        if known_world and known_world % t == 0:  # else _build_plan says why
            self._keep_global_batch(known_world // t)
        if self.verbose:
            for line in self.lines:
                print(line, flush=True)
        self.lines = []

    def resolved_settings(self) -> dict:
        """Every setting of this run after the defaults were resolved, {field name: value} (what
        ``--print-config`` prints; a config file with these reproduces the run)."""
        from llmq_ray.settings.overrides import flat

        out = flat(self.settings)
        out["resume"] = self.resume if self.resume is not False else None
        return out

    def _named(self, exc: LLMQError) -> LLMQError:
        """``exc`` with its flag names written as this API's keyword arguments (unless used by the CLI)."""
        if self.cli:
            return exc
        from llmq_ray.settings import aliases, by_name
        from llmq_ray.settings.rules import api_names

        text = api_names(str(exc), set(by_name()) | set(aliases()))
        if text == str(exc):
            return exc
        try:
            return type(exc)(text)
        except TypeError:  # an exception type with another constructor: keep it as it is
            return exc

    # ------------------------------------------------------------------ validation before any Ray work
    def _check_inputs(self) -> None:
        """What the rules cannot know: the model's own files and sizes against the settings."""
        s, cfg, folder = self.settings, self.cfg, self._model_folder
        if folder and not s.model.from_scratch and self.resume in (False, None):
            # the weights the workers will load (their files' headers, no torch): one sentence here, not in rank 0
            from llmq_ray.model.weight_files import find_tensor_files

            find_tensor_files(folder)
        if s.parallel.tensor_parallel > 1:  # the model's split (heads, MLP width), before any actor starts
            from llmq_ray.parallel.tensor import TensorParallelPlan

            try:
                TensorParallelPlan(cfg, s.parallel.tensor_parallel)
            except ConfigError as exc:  # the plan says what does not fit; the sentence names the flag
                raise ConfigError(f"--tensor-parallel={s.parallel.tensor_parallel}: {exc}") from None
        if s.data.seq_len > cfg.max_position_embeddings:
            raise ConfigError(f"--seq-len={s.data.seq_len} exceeds the model's max_position_embeddings "
                              f"({cfg.max_position_embeddings}).")
        from llmq_ray.train.model_checks import check_model_settings

        check_model_settings(cfg, s)
        forwarded = forward_env_names(s.parallel.forward_env)
        self.notes += [f"--forward-env names {name}, which is not set here, so the workers do not get it."
                       for name in forwarded if name not in os.environ]
        if s.checkpoints.ckpt_keep_n == 1:
            self.notes.append("--ckpt-keep-n=1 keeps a single checkpoint: a crash while the next one is written "
                              "can leave only that one, and a corrupt one leaves nothing to resume from.")
        from llmq_ray.train.preflight import check_optional_packages

        check_optional_packages(s.observe.wandb_project, s.observe.log_gpu_util)

    def _check_outputs(self) -> None:
        """The output, checkpoint and log locations (``llmq_ray/train/preflight.py``); a fresh run refuses a
        checkpoint folder that holds another run's checkpoints."""
        from llmq_ray.train.preflight import check_fresh_checkpoint_dir, check_log_file, check_writable_dir
        if not storage.is_remote(self.settings.observe.out_dir):  # a store was checked by check_locations
            check_writable_dir(self.settings.observe.out_dir, "--out-dir")
        if not storage.is_remote(self.checkpoint_dir):
            check_writable_dir(self.checkpoint_dir, "--checkpoint-dir")
        explicit = self.settings.observe.log_file is not None
        log = self.settings.observe.log_file or storage.join(self.settings.observe.out_dir, "log.jsonl")  # as given: the message names it
        check_log_file(log, "--log-file" if explicit else "--out-dir", self.resume not in (False, None), explicit)
        self._set_aside_ckpt = None
        if self.resume in (False, None) and (self.settings.checkpoints.checkpoint_on_exit or self.settings.checkpoints.ckpt_interval or self.settings.checkpoints.ckpt_minutes):
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
        self._resolve_document_separator()
        if not self.settings.data.synthetic_data:
            check_windows(self.settings.data.train_file, "--train-file", self.cfg.vocab_size, self.settings.data.seq_len)
        if self.settings.data.eval_file:  # with --synthetic-data too: the eval still reads its files
            check_windows(self.settings.data.eval_file, "--eval-file", self.cfg.vocab_size, self.settings.data.seq_len)

    def _resolve_document_separator(self) -> None:
        """--document-masking: a given --document-separator must be a token of the model that occurs in the first
        train shard (else the run would silently mask nothing); without one, the EOS the tokenizer appended to
        every document (meta.json beside the first train shard), else the model's eos_token_id (which must occur)."""
        if not self.settings.data.document_masking:
            return
        from llmq_ray.train.preflight import data_eos_id, separator_seen
        vocab = self.cfg.vocab_size
        if self.settings.data.document_separator is not None:  # given: a token of this model that occurs in the data
            sep = self.settings.data.document_separator
            if sep >= vocab:
                raise ConfigError(f"--document-separator={sep} is not a token id of model {self.settings.model.model} (its "
                                  f"vocabulary has {vocab} tokens), so nothing would be masked.")
            if not self.settings.data.synthetic_data and separator_seen(self.settings.data.train_file, sep) is False:
                raise ConfigError(f"--document-separator={sep} never occurs in the first tokens of --train-file "
                                  f"{self.settings.data.train_file}, so nothing would be masked; pass the token that ends its "
                                  f"documents.")
            return
        sep = None if self.settings.data.synthetic_data else data_eos_id(self.settings.data.train_file)
        if sep is not None and not 0 <= sep < vocab:
            raise ConfigError(f"--document-masking: the end-of-document token {sep} named by the meta.json beside "
                              f"--train-file {self.settings.data.train_file} is not a token id of model {self.settings.model.model} (its "
                              f"vocabulary has {vocab} tokens): was the data tokenized for another model?")
        if sep is None:
            sep = self.cfg.eos_token_id
            if sep is None:
                raise ConfigError("--document-masking needs --document-separator: neither the train data's "
                                  "meta.json nor the model's config names an end-of-document token.")
            if not self.settings.data.synthetic_data and separator_seen(self.settings.data.train_file, sep) is False:
                raise ConfigError(f"--document-masking: the model's EOS token {sep} never occurs in the first "
                                  f"tokens of --train-file {self.settings.data.train_file}, so nothing would be masked; pass "
                                  f"--document-separator with the token that ends its documents.")
        self.settings.data.document_separator = int(sep)
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
        done, steps = int(self.resume_manifest["step"]), self.settings.optim.steps
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
        if not self.resume_from or self.settings.checkpoints.allow_batch_change:
            return
        from llmq_ray.train.preflight import keep_global_batch

        ga, line = keep_global_batch(self.resume_manifest, self.resume_from, self.settings.data.batch_size,
                                     self.settings.data.grad_accumulation, world)
        if line:
            self.settings.data.grad_accumulation = ga
            self.lines.append(line)
