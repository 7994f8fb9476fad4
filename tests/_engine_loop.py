"""A single-process training loop over a TrainEngine, for the tests that drive an engine without Ray
(imported as ``from _engine_loop import train_steps``). The library's own loop is the Ray worker's
``train_step`` (actors/worker.py); this one moved here from llmq_ray/engine/ because only tests used it.

``train_steps`` runs ``opts.optim.steps`` optimizer steps of ``opts.data.grad_accumulation`` micro-batches each,
with the learning-rate schedule of ``llmq_ray.lr_schedule.learning_rate_at``, and returns the per-step history.
Batches come from any iterator of (inputs, targets) int tensors [B, T] (targets -100 = masked).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator

import torch

from llmq_ray.engine.train_engine import StepStats, TrainEngine
from llmq_ray.engine.optim import learning_rate_at


@dataclasses.dataclass
class StepRecord:
    """One optimizer step as logged: 0-based step, lr, mean target loss, global grad norm, tokens, seconds."""

    step: int
    lr: float
    loss: float
    grad_norm: float
    tokens: int
    seconds: float
    skipped: bool = False


def lr_for_step(engine: TrainEngine, step: int) -> float:
    o = engine.settings
    return learning_rate_at(step, base_lr=o.optim.learning_rate, total_steps=o.optim.steps, warmup_steps=o.optim.warmup,
                            schedule=o.optim.lr_schedule, final_lr_fraction=o.optim.final_lr_fraction,
                            cooldown_fraction=o.optim.cooldown_fraction)


def train_step(engine: TrainEngine, batches: Iterator[tuple[torch.Tensor, torch.Tensor]], step: int) -> StepRecord:
    """Optimizer step number ``step`` (0-based): grad_accumulation micro-steps, then the update."""
    start = time.perf_counter()
    for k in range(engine.settings.data.grad_accumulation):
        inputs, targets = next(batches)
        engine.micro_step(inputs, targets, last=k + 1 == engine.settings.data.grad_accumulation)
    lr = lr_for_step(engine, step)
    stats: StepStats = engine.update(lr, step + 1)
    return StepRecord(step, lr, stats.loss, stats.grad_norm, stats.tokens, time.perf_counter() - start, stats.skipped)


def train_steps(engine: TrainEngine, batches: Iterator[tuple[torch.Tensor, torch.Tensor]], *, start_step: int = 0,
                on_step: Callable[[StepRecord], None] | None = None) -> list[StepRecord]:
    """Run steps start_step .. opts.optim.steps-1; returns their records (``on_step`` sees each as it ends)."""
    history = []
    for step in range(start_step, engine.settings.optim.steps):
        record = train_step(engine, batches, step)
        history.append(record)
        if on_step is not None:
            on_step(record)
    return history
