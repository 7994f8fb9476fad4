"""What a run gives back: ``Result`` (what ``fit()`` returns), and the step metrics a Ray Tune trial reports as they
happen (``tune_reporter``, ``tune_metrics``).
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from typing import Optional


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


def tune_reporter():
    """``ray.tune.report`` when this process runs a Ray Tune trial (``LLMQTrainer(...).fit()`` inside a Tune
    trainable, e.g. a learning-rate sweep), else None: each step's metrics then reach Tune as they happen, so
    its schedulers (ASHA, PBT) can stop or compare trials while they train. A trial's process has imported
    ray.tune before it calls the trainable; any other process has not, and is spared the import (1-2 s)."""
    if "ray.tune" not in sys.modules:
        return None
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
