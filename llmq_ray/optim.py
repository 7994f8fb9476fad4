"""The optimizer: learning-rate schedules, ZeRO-sharded AdamW state, and gradient clipping.

Division of labour. The backend owns the elementwise math (``Backend.adamw_update``, one fused pass over a
flat range); this module owns *which* ranges, with which hyperparameters and seeds, and the state that lives
between steps. All parameters sit in one flat buffer (``ParamLayout``): decayed tensors first, then the
non-decayed ones, so a ZeRO shard [start, end) is at most two ``adamw_update`` calls.

No function here forces a host sync: lr and step are Python numbers known in advance, norms and clip
factors stay 0-d device tensors until the trainer's one sync per step.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable

import torch

from llmq_ray.errors import CheckpointError, ConfigError
from llmq_ray.params import ParamLayout

SCHEDULES = ("cosine", "linear", "wsd", "constant")


# ---------------------------------------------------------------------------------------------------- schedule
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
def global_grad_norm_squared(backend, grads: torch.Tensor | Iterable[torch.Tensor]) -> torch.Tensor:
    """sum(g^2) over one tensor or several, as a new fp32 0-d tensor on the grads' device (no host sync).

    Under ZeRO each rank passes its own gradient shard; the caller all-reduces (sums) the result across ranks
    and takes the square root: the true global L2 norm (DESIGN §3; never the squared norm as llm.q clips by).
    """
    tensors = [grads] if isinstance(grads, torch.Tensor) else list(grads)
    if not tensors:
        raise ValueError("global_grad_norm_squared: no gradient tensors given")
    out = torch.zeros((), dtype=torch.float32, device=tensors[0].device)
    for t in tensors:
        backend.global_norm_squared(out, t)
    return out


def clip_coefficient(norm: torch.Tensor, grad_clip: float) -> torch.Tensor:
    """The factor to multiply gradients by: fp32 0-d tensor on norm's device, computed without host sync.

    ``norm`` is the global L2 norm (not squared; 0-d). For a finite norm: grad_clip / norm when grad_clip > 0
    and norm > grad_clip (computed as an fp32 division), else exactly 1.0.

    Non-finite norm (inf or nan, any grad_clip): returns **nan**. Clipping an inf norm would give 0 and make
    the step silently a pure weight-decay step; returning nan instead means the coefficient alone tells the
    caller (``not torch.isfinite(coef)`` at its host sync) that the gradients overflowed, and folding it into
    ``grad_scale`` can never produce a finite-looking update. The caller should skip (or abort) that step.
    """
    norm32 = norm.to(torch.float32)
    one = torch.ones_like(norm32)
    if grad_clip > 0:
        clip = torch.full_like(norm32, float(grad_clip))
        coef = torch.where(norm32 > clip, clip / norm32, one)
    else:
        coef = one
    return torch.where(torch.isfinite(norm32), coef, torch.full_like(norm32, math.nan))


# ---------------------------------------------------------------------------------------------------- AdamW
def _step_seed(seed: int, step: int, run_start: int) -> int:
    """Seed of one adamw_update call: a pure function of (optimizer seed, step, global start of the run).

    Being keyed by the *global* flat offset (not the rank) keeps it reproducible on resume; it is the same on
    every rank that updates the same range."""
    digest = hashlib.blake2b(f"adamw/{int(seed)}/{int(step)}/{int(run_start)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


_DTYPES = (torch.float32, torch.bfloat16)


class ShardedAdamW:
    """AdamW state for one ZeRO shard [start, end) of the flat parameter buffer, updated through a backend.

    Buffers (all 1-D, length n = end - start, on params' device):

    * ``m`` (m_dtype), ``v`` (v_dtype): Adam moments, zero-initialized; fp32 or bf16 (bf16 written with
      stochastic rounding by the backend).
    * ``master`` (master_dtype): a separate copy of params[start:end], only when master_dtype differs from the
      params' dtype (typically fp32 master for bf16 weights); otherwise None and the params themselves are
      the storage of record.

    ``params_flat`` is the flat parameter buffer this rank holds; ``params_offset`` is the global flat index
    of its element 0 (0 for a full buffer, as under ZeRO-1/2; ``start`` when a rank holds only its own
    shard). The optimizer writes params_flat[start - params_offset : end - params_offset] in place; the
    caller all-gathers the updated shards.

    ``step`` (1-based, the bias-correction exponent) is passed in by the caller rather than counted here, so
    that resuming from a checkpoint is just "load state, keep counting".
    """

    def __init__(self, backend, layout: ParamLayout, params_flat: torch.Tensor, start: int, end: int, *,
                 master_dtype: torch.dtype, m_dtype: torch.dtype, v_dtype: torch.dtype, beta1: float = 0.9,
                 beta2: float = 0.95, eps: float = 1e-8, weight_decay: float = 0.1, seed: int = 0,
                 params_offset: int = 0):
        for flag, dt in (("--master-dtype", master_dtype), ("--opt-m-dtype", m_dtype), ("--opt-v-dtype", v_dtype)):
            if dt not in _DTYPES:
                raise ConfigError(f"{flag}: optimizer state must be fp32 or bf16, got {dt}.")
        if params_flat.dim() != 1:
            raise ValueError(f"ShardedAdamW: params_flat must be 1-D, got shape {tuple(params_flat.shape)}")
        if not (0 <= start <= end <= layout.numel):
            raise ValueError(f"ShardedAdamW: shard [{start}, {end}) is not inside the layout's [0, {layout.numel})")
        if not (params_offset <= start and end - params_offset <= params_flat.numel()):
            raise ValueError(f"ShardedAdamW: params_flat (offset {params_offset}, {params_flat.numel()} elements) "
                             f"does not hold the shard [{start}, {end})")
        if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0 and eps >= 0.0 and weight_decay >= 0.0):
            raise ConfigError(f"AdamW hyperparameters out of range: beta1={beta1}, beta2={beta2}, eps={eps}, "
                              f"weight_decay={weight_decay} (need 0 <= beta < 1, eps >= 0, weight decay >= 0).")
        self.backend = backend
        self.layout = layout
        self.start, self.end = start, end
        self.beta1, self.beta2, self.eps, self.weight_decay = beta1, beta2, eps, weight_decay
        self.seed = seed
        self.params = params_flat[start - params_offset:end - params_offset]  # view: updated in place
        n = end - start
        device = params_flat.device
        self.master = None if master_dtype == params_flat.dtype else self.params.to(master_dtype, copy=True)
        self.m = torch.zeros(n, dtype=m_dtype, device=device)
        self.v = torch.zeros(n, dtype=v_dtype, device=device)
        self.runs = layout.decay_runs(start, end)

    @property
    def numel(self) -> int:
        return self.end - self.start

    def step(self, grads_shard: torch.Tensor, *, lr: float, step: int, grad_scale: torch.Tensor | float) -> None:
        """Apply one update with the gradients of this shard.

        grads_shard: [end - start] (model or fp32 dtype), the reduced gradient of exactly this shard, not yet
        scaled. grad_scale (float or 0-d fp32 device tensor) multiplies it inside the kernel: typically
        1/num_target_tokens times the clip coefficient. step: 1-based update count. One backend call per decay
        run: weight_decay on embeddings/matrices, 0 on norms/biases. Seeds depend on (seed, step, run start)
        only, so a resumed run draws the same rounding bits as the uninterrupted one.
        """
        if grads_shard.dim() != 1 or grads_shard.numel() != self.numel:
            raise ValueError(f"ShardedAdamW.step: grads_shard has shape {tuple(grads_shard.shape)}, "
                             f"expected [{self.numel}] for shard [{self.start}, {self.end})")
        for run_start, run_end, decay in self.runs:
            lo, hi = run_start - self.start, run_end - self.start
            self.backend.adamw_update(
                self.params[lo:hi], grads_shard[lo:hi], self.m[lo:hi], self.v[lo:hi],
                master=None if self.master is None else self.master[lo:hi],
                lr=lr, beta1=self.beta1, beta2=self.beta2, eps=self.eps,
                weight_decay=self.weight_decay if decay else 0.0, step=step, grad_scale=grad_scale,
                seed=_step_seed(self.seed, step, run_start))

    # ------------------------------------------------------------------ checkpoints
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The live state of this shard, for a checkpoint: {"master", "m", "v"}, each 1-D [end - start].

        "master" is always the storage of record of the weights: the separate master copy when there is one,
        else a view of params[start:end]. These are the optimizer's own buffers (no copies): write them out
        before the next step.
        """
        return {"master": self.master if self.master is not None else self.params, "m": self.m, "v": self.v}

    def load_state_tensors(self, state: dict[str, torch.Tensor]) -> None:
        """Copy a checkpoint's {"master", "m", "v"} of this same shard range into the state (and the params).

        Tensors may come from any device; a different fp32/bf16 dtype is converted (round to nearest). With a
        separate master the params are refreshed from it, so the forward sees the restored weights.
        """
        missing = {"master", "m", "v"} - set(state)
        if missing:
            raise CheckpointError(f"optimizer state of shard [{self.start}, {self.end}) lacks {sorted(missing)}")
        for name, dest in self.state_tensors().items():
            src = state[name]
            if src.numel() != dest.numel():
                raise CheckpointError(f"optimizer state {name!r} has {src.numel()} elements, the shard "
                                      f"[{self.start}, {self.end}) needs {dest.numel()} (another model or world size?)")
            dest.copy_(src.reshape(-1))
        if self.master is not None:
            self.params.copy_(self.master)

    def memory_bytes(self) -> int:
        """Bytes of optimizer-owned state on the device: m, v and the separate master (if any)."""
        tensors = [self.m, self.v] + ([self.master] if self.master is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)
