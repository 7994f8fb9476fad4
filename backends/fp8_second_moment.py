"""An 8-bit Adam second moment: sqrt(v) in e4m3 with one power-of-two scale per block of 256.

Why. At Qwen2.5-7B on one 80 GB GPU, with the first moment already in e4m3 (fp8_moment.py), the bf16 second
moment is 14.2 GiB of the 76.8 GiB a B=6 micro-batch peaks at; in 8 bits it takes 7.2 GiB, room for a larger
micro-batch or for keeping the FP8 weight copies of the step.

Format. The same blocks and grid as the first moment (fp8_moment.py: ``BLOCK`` consecutive elements counted
from the call's first element, ``q`` in torch.float8_e4m3fn, an fp32 power-of-two ``scale`` per block), but
what is stored is u = sqrt(v), not v, and element i means v[i] = (q[i] * scale[i // BLOCK])^2:

* range: v spans twice the binary orders of magnitude that u does, so a block's smallest nonzero v can lie
  2^-34 below its largest (u: e4m3's 2^-9 subnormal step under a maximum in (224, 448]) instead of 2^-17;
* the update reads sqrt(v) anyway, and what it divides by should never be rounded to zero: a nonzero u that the
  rounding would send to 0 is stored as the smallest subnormal instead (a *floor*), so an element with a tiny
  but nonzero v never turns m / (sqrt(v) + eps) into m / eps. Those elements are rounded up, by design; above
  the floor the rounding is fp8_moment's unbiased stochastic rounding, applied to u;
* exactness: u = q * 2^k has at most 4 significant bits, so u^2 has at most 8 and is exact in fp32 and in bf16.
  A checkpoint stores v as those bf16 values in the usual flat layout; loading takes their fp32 square roots,
  which are exact (the square root of an exact square is exact under IEEE rounding), and re-quantizes them to
  the very same q and scale (``requantize``): a resumed run is bit-identical. The scale exponent is clamped at
  ``K_MIN`` = -54 so that the smallest stored u, 2^-9 * 2^-54 = 2^-63, squares to 2^-126, fp32's smallest
  normal (no flush to zero on the GPU, exact in bf16).

The update itself uses the step's fp32 v (the EMA of the decoded v and g^2) for its denominator; only the stored
copy is rounded, as for the other 8-bit and bf16 states. Rounding u stochastically is unbiased in u; E[u_q^2]
exceeds u^2 by the rounding's variance, at most (1/16)^2 / 4 of it relative (0.4%, an e4m3 step being at most
1/8 of the value): v is, if anything, slightly large, which makes steps slightly smaller.

The cost, measured against fp32 v (tests/test_fp8_second_moment.py: beta2 0.95, 30 steps of noise gradients):
the stored v is 15% off on average. Each step re-rounds the whole stored value (~3% of u, ~6% of v, on average),
and the EMA carries those errors on, adding up to about 1 / sqrt(1 - beta2^2) times one step's: 3.2x at beta2
0.95, but 22x at 0.999, where this format would be mostly noise. bf16 v has the same effect at about 1/32 of the
size (its relative step in v is 2^-8..2^-7; e4m3's in u is 2^-4..2^-3, so 2^-3..2^-2 in v).

State: the format and the torch reference's AdamW with it (torch_ref_optim.adamw_update's ``v_scale``). Not yet
selectable (no --opt-v-dtype e4m3: no Triton or CuPy kernel, no optimizer wiring). A CPU screen of its effect
on the loss (benchmarks/opt_state_loss_cpu.py: a 4-layer model on tiny-shakespeare's bytes, 3 seeds) found it
the mildest of the 8-bit choices, +0.3% to +6.3% against bf16 v, and e4m3 m with e4m3 v the worst (+3.5% to
+21.6%): before kernels, a format with less rounding noise (or a loss check at 0.5B on the GPU) is wanted.
"""

from __future__ import annotations

import torch

from llmq_ray.backends import fp8_moment
from llmq_ray.backends.fp8_moment import BLOCK, DTYPE, num_blocks  # noqa: F401  (re-exported: one format family)

K_MIN = -54  # the smallest scale exponent: the smallest stored u, 2^-63, squares to 2^-126 (fp32's smallest normal)
FLOOR = 2.0 ** -9  # e4m3's smallest subnormal: what a nonzero u that would round to 0 is stored as


def block_scales(absmax_u: torch.Tensor) -> torch.Tensor:
    """[B] fp32 block maxima of u = sqrt(v) (>= 0, finite) -> [B] fp32 scales 2^k (fp8_moment.block_scales with
    k >= ``K_MIN``)."""
    return fp8_moment.block_scales(absmax_u, k_min=K_MIN)


def round_u(y: torch.Tensor, r16: torch.Tensor | None) -> torch.Tensor:
    """fp32 y = u / scale (0 <= y <= 448) -> fp32 values on the e4m3 grid: stochastically rounded with r16
    (int32 in [0, 2^16), same shape) or to nearest (None), then every nonzero y that came out 0 set to
    ``FLOOR``. The result casts to e4m3 exactly."""
    out = fp8_moment.sr_e4m3(y.contiguous(), r16.to(torch.int32)) if r16 is not None else y.to(DTYPE).float()
    return torch.where((y > 0) & (out == 0), torch.full_like(out, FLOOR), out)


def quantize(v32: torch.Tensor, r16: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 v [n] (>= 0, finite) -> (q [n] e4m3 holding sqrt(v) / scale, scale [num_blocks(n)] fp32). ``r16``
    ([n] int32 in [0, 2^16)) gives stochastic rounding; None rounds to nearest (``requantize``)."""
    u = v32.float().reshape(-1).sqrt()  # IEEE square root, correctly rounded (a kernel must match: tl.sqrt_rn)
    n = u.numel()
    pad = num_blocks(n) * BLOCK - n
    blocks = (torch.nn.functional.pad(u, (0, pad)) if pad else u).view(-1, BLOCK)
    scale = block_scales(blocks.amax(dim=1))
    y = (blocks / scale[:, None]).reshape(-1)[:n]  # exact: the scale is a power of two
    return round_u(y, r16).to(DTYPE), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(q [n] e4m3, scale [num_blocks(n)] fp32) -> fp32 v [n] = (q * scale)^2 (exact)."""
    n = q.numel()
    u = q.float().reshape(-1) * scale.repeat_interleave(BLOCK)[:n]
    return u * u


def requantize(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """A checkpoint's v (bf16/fp32 values [n], >= 0) -> (q, scale, exact). Values written by ``dequantize`` with
    the same blocks come back as the very same numbers (exact=True); with other blocks (another world size's
    shards) a value may fall between its new block's grid points and is rounded to nearest (exact=False)."""
    flat = values.float().reshape(-1)
    q, scale = quantize(flat, None)
    return q, scale, bool(torch.equal(dequantize(q, scale), flat))
