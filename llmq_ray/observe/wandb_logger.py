"""Weights & Biases logging of a run, fed with the records of our JSON log (``llmq_ray/observe/runlog.py``).

The same mapping serves live logging (the coordinator passes every record it adds to the JSON log) and
replaying a finished log (``examples/export_wandb.py``), so the W&B charts are exactly the JSON log.

    logger = WandbLogger(project="llmq", run_name="qwen-0.5b-fp8", config=options_dict, dir="out")
    logger.log_record({"log": "step", "step": 1, "loss": 6.1, "norm": 1.2, "lr": 3e-4, ...})
    logger.finish()

Record -> W&B (``record_to_wandb``), with the W&B step = the record's "step": optimizer steps done (the
1-based number the ``[T]`` line shows):

    step       train/loss, train/grad_norm (JSON "norm"), train/lr, train/tokens_per_s,
               train/step_seconds (JSON "seconds"), train/sol, train/skipped, train/tokens,
               train/worker_seconds, train/ray_overhead_seconds, train/data_seconds,
               train/memory_bytes_max (max over ranks of JSON "memory")
    eval       eval/loss (a "full" eval: eval/final_loss too), eval/seconds
    gpu_util   gpu{rank}/<key> for every numeric key of ``llmq_ray.observe.gpu_stats`` (clocks, power, temperature,
               utilization, memory), at its "step"
    fp8_monitor  fp8/swiglu_absmax/layerNN per layer and fp8/swiglu_absmax/max, fp8/saturated_share/layerNN and
               fp8/saturated_share/max (where the record has them), at the step record's W&B step
    options, sol, dataset, gpu, allocator   merged into the run config (under "sol/", "dataset/", "gpu{rank}/",
               "memory/")
    summary    the run summary (``run.summary``)

Other kinds (checkpoint, resume, warning, failure, restart) are not sent; they stay in the JSON log.

``WANDB_MODE`` is honoured as W&B itself reads it: ``offline`` writes the run under ``dir/wandb`` without any
network (upload later with ``wandb sync``), ``disabled`` makes every call a no-op.
"""

from __future__ import annotations

import math
import os
from typing import Any, Optional

# JSON "step" record field -> W&B key
STEP_KEYS = {"loss": "train/loss", "norm": "train/grad_norm", "grad_norm": "train/grad_norm", "lr": "train/lr",
             "tokens_per_s": "train/tokens_per_s", "seconds": "train/step_seconds", "sol": "train/sol",
             "tokens": "train/tokens", "worker_seconds": "train/worker_seconds",
             "ray_overhead_seconds": "train/ray_overhead_seconds", "data_seconds": "train/data_seconds"}
CONFIG_KINDS = {"sol": "sol", "dataset": "dataset", "allocator": "memory"}


def _number(v: Any) -> Optional[float]:
    """A finite-or-not float from a JSON value (numbers, bools, "nan"/"inf" strings); None otherwise."""
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)  # the JSON log writes non-finite floats as strings
        except ValueError:
            return None
    return None


def record_to_wandb(record: dict) -> Optional[tuple[str, dict, Optional[int]]]:
    """Map one JSON-log record to (what, payload, step): what is "log" (payload for ``wandb.log`` at ``step``),
    "config" (payload for ``run.config.update``) or "summary"; None for records with nothing to send."""
    kind = record.get("log")
    if kind == "step":
        data = {}
        for field, key in STEP_KEYS.items():
            v = _number(record.get(field))
            if v is not None:
                data[key] = v
        if "skipped" in record:
            data["train/skipped"] = int(bool(record["skipped"]))
        mem = record.get("memory")
        if isinstance(mem, list) and mem:
            data["train/memory_bytes_max"] = float(max(mem))
        return "log", data, int(record["step"])  # 1-based, as the console
    if kind == "eval":
        loss = _number(record.get("loss"))
        data = {"eval/loss": loss, "eval/seconds": _number(record.get("seconds"))}
        if record.get("full"):
            data["eval/final_loss"] = loss
        return "log", {k: v for k, v in data.items() if v is not None}, int(record["step"])
    if kind == "gpu_util":
        rank = record.get("rank", 0)
        data = {f"gpu{rank}/{k}": _number(v) for k, v in record.items()
                if k not in ("log", "step", "rank", "index") and _number(v) is not None}
        return "log", data, int(record["step"])
    if kind == "fp8_monitor":  # at the step record's W&B step
        data = {f"fp8/swiglu_absmax/layer{i:02d}": _number(v) for i, v in enumerate(record.get("swiglu_absmax", []))}
        data["fp8/swiglu_absmax/max"] = _number(record.get("max"))
        data.update({f"fp8/saturated_share/layer{i:02d}": _number(v)
                     for i, v in enumerate(record.get("saturated_share") or [])})
        data["fp8/saturated_share/max"] = _number(record.get("saturated_share_max"))
        return "log", {k: v for k, v in data.items() if v is not None}, int(record["step"])
    if kind == "options":
        return "config", {k: v for k, v in record.items() if k != "log"}, None
    if kind == "gpu":
        rank = record.get("rank", 0)
        return "config", {f"gpu{rank}/{k}": v for k, v in record.items() if k not in ("log", "rank")}, None
    if kind in CONFIG_KINDS:
        prefix = CONFIG_KINDS[kind] + ("" if kind != "allocator" else f"/rank{record.get('rank', 0)}")
        return "config", {f"{prefix}/{k}": v for k, v in record.items() if k not in ("log", "rank")}, None
    if kind == "summary":
        return "summary", {k: v for k, v in record.items() if k != "log"}, None
    return None


class WandbLogger:
    """One W&B run. ``project``/``run_name``/``config`` go to ``wandb.init``; ``dir`` is where W&B writes its
    files (created if missing). ``mode`` (online/offline/disabled) defaults to ``WANDB_MODE`` or W&B's default.

    W&B steps must not go backwards within a run: a record whose step lies behind the last one logged (the
    steps repeated after a restart from a checkpoint) is not sent, and counted in ``dropped``."""

    def __init__(self, project: str, run_name: Optional[str] = None, config: Optional[dict] = None,
                 dir: Optional[str] = None, mode: Optional[str] = None, **init_kwargs):
        try:
            import wandb
        except ImportError:
            from llmq_ray.errors import ConfigError

            raise ConfigError("W&B logging needs the wandb package: pip install 'llmq-ray[wandb]'.") from None

        self._wandb = wandb
        if dir:
            os.makedirs(dir, exist_ok=True)
        mode = mode or os.environ.get("WANDB_MODE") or None
        self.run = wandb.init(project=project, name=run_name, config=_clean(config or {}), dir=dir, mode=mode,
                              **init_kwargs)
        self.last_step = 0
        self.dropped = 0  # records whose step lay behind one already logged
        self.finished = False

    def log_record(self, record: dict) -> None:
        """Send one JSON-log record (see the module docstring for the mapping)."""
        mapped = record_to_wandb(record)
        if mapped is None:
            return
        what, payload, step = mapped
        if what == "log":
            if step < self.last_step:
                # after a restart from a checkpoint the steps since it are run again (the JSON log has both);
                # W&B keeps the first (a resumed run reproduces them) and would drop a step going backwards
                self.dropped += 1
            elif payload:
                self.run.log(payload, step=step)
                self.last_step = step
        elif what == "config":
            self.run.config.update(_clean(payload), allow_val_change=True)
        else:
            for k, v in _clean(payload).items():
                self.run.summary[k] = v

    def log_records(self, records: list[dict]) -> None:
        for r in records:
            self.log_record(r)

    def finish(self, exit_code: int = 0) -> None:
        """Close the run (flushes; in offline mode the files are complete after this). Idempotent."""
        if not self.finished:
            self.run.finish(exit_code=exit_code)
            self.finished = True


def _clean(d: dict) -> dict:
    """JSON-ish values W&B accepts: nested dicts/lists kept, non-finite floats as strings."""
    def fix(v):
        if isinstance(v, float) and not math.isfinite(v):
            return str(v)
        if isinstance(v, dict):
            return {str(k): fix(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [fix(x) for x in v]
        return v
    return {str(k): fix(v) for k, v in d.items()}
