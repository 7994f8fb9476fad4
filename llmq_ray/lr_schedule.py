"""Learning-rate schedules: a pure function of the step, with no torch (the CLI checks --warmup and friends
before anything heavy is imported)."""

from __future__ import annotations

import math

from llmq_ray.errors import ConfigError

SCHEDULES = ("cosine", "linear", "wsd", "constant")


def learning_rate_at(step: int, *, base_lr: float, total_steps: int, warmup_steps: int, schedule: str,
                     final_lr_fraction: float, cooldown_fraction: float = 0.2) -> float:
    """Learning rate of update number ``step`` (0-based) of a run of ``total_steps`` updates.

    Warmup (all schedules): step s < W gets base_lr * (s + 1) / W, so the first update already moves the
    weights (llm.q starts at lr 0, which wastes an update; we don't copy that) and step W-1 reaches base_lr.

    After warmup, with final = base_lr * final_lr_fraction:

    * ``cosine``: final + (base - final) * (1 + cos(pi * p)) / 2,
    * ``linear``: base + (final - base) * p,

      where p goes linearly from 0 at the last step at base_lr (step W-1, or step 0 without warmup) to 1 at
      the last step (total_steps - 1), which therefore gets exactly ``final``;
    * ``wsd`` (warmup-stable-decay): base_lr, then a linear cooldown over the last
      K = max(1, round(cooldown_fraction * total_steps)) steps, reaching ``final`` at the last step
      (the first cooldown step gets base - (base - final) / K);
    * ``constant``: base_lr (final_lr_fraction is not used).

    Steps past the end keep the last step's value. Bad arguments raise ConfigError naming the flag.
    """
    if schedule not in SCHEDULES:
        raise ConfigError(f"--lr-schedule={schedule!r} is not one of {list(SCHEDULES)}.")
    if not isinstance(total_steps, int) or total_steps < 1:
        raise ConfigError(f"--steps must be a positive integer, got {total_steps!r}.")
    if not isinstance(warmup_steps, int) or not 0 <= warmup_steps < total_steps:
        raise ConfigError(f"--warmup must be an integer in [0, --steps) = [0, {total_steps}), got {warmup_steps!r}.")
    if not (isinstance(final_lr_fraction, (int, float)) and 0.0 <= final_lr_fraction <= 1.0):
        raise ConfigError(f"--final-lr-fraction must be in [0, 1], got {final_lr_fraction!r}.")
    if not (isinstance(base_lr, (int, float)) and math.isfinite(base_lr) and base_lr > 0):
        raise ConfigError(f"--lr must be a finite number > 0, got {base_lr!r}.")
    if not (isinstance(cooldown_fraction, (int, float)) and 0.0 < cooldown_fraction <= 1.0):
        raise ConfigError(f"--cooldown-fraction must be in (0, 1], got {cooldown_fraction!r}.")
    if step < 0:
        raise ValueError(f"learning_rate_at: step is a 0-based update index, got {step}")

    cooldown = max(1, round(cooldown_fraction * total_steps))  # wsd: steps in the final linear cooldown
    plateau_end = total_steps - 1 - cooldown  # wsd: the last step at base_lr (-1: the cooldown is every step)
    if schedule == "wsd" and plateau_end < warmup_steps - 1:
        raise ConfigError(f"--warmup ({warmup_steps} steps) runs into the wsd cooldown (the last {cooldown} of "
                          f"--steps={total_steps}); use fewer warmup steps or a smaller cooldown fraction.")

    step = min(step, total_steps - 1)
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return base_lr

    final = base_lr * final_lr_fraction
    last = total_steps - 1
    if schedule == "wsd":
        if step <= plateau_end:
            return base_lr
        return base_lr + (final - base_lr) * (step - plateau_end) / cooldown

    anchor = max(warmup_steps - 1, 0)  # the step at base_lr where the decay starts
    progress = 1.0 if last == anchor else (step - anchor) / (last - anchor)
    if schedule == "linear":
        return base_lr + (final - base_lr) * progress
    return final + (base_lr - final) * 0.5 * (1.0 + math.cos(math.pi * progress))


# ---------------------------------------------------------------------------------------------------- clipping
