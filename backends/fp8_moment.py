"""The 8-bit Adam first moment (--opt-m-dtype e4m3): e4m3 values with one power-of-two scale per block.

Format. A flat state of n elements, updated by one ``adamw_update`` call, is cut into blocks of ``BLOCK`` (256)
consecutive elements counted from the call's first element (the last block may be shorter). Block b holds
``q[i]`` (torch.float8_e4m3fn, 1 byte per element) and ``scale[b]`` (fp32, 4 bytes per 256 elements: 1.6%), and
element i means ``q[i] * scale[i // BLOCK]``. So m takes 1.02 bytes per parameter instead of 2 (bf16) or 4.

Why a power of two. The scale of a block is 2^k with the smallest k such that absmax / 2^k <= 448 (e4m3's
largest finite value), i.e. the block's largest |m| lands in (224, 448]. A power of two costs at most one bit of
range against absmax / 448, and buys exactness: q * 2^k is exact in fp32 and in bf16 (e4m3 has 4 significant bits),
so a checkpoint stores m as bf16 values in the usual flat layout (any world size can load it) and loading
re-quantizes those values to the very same numbers (``requantize``): a resumed run is bit-identical.

Rounding. Each step writes m through **stochastic rounding** to the e4m3 grid at the block's new scale, like the
bf16 states: m moves by (1 - beta1) (g - m) per step, often far less than half an e4m3 step (1/16 of the value),
which round-to-nearest would lose every time. The random bits are 16 per element (``r16`` in [0, 2^16)), placed
at the top of the bits the rounding drops:

* |y| >= 2^-6 (e4m3 normals; y = m / scale): add ``r16 << 4`` to the fp32 magnitude bits and clear the low 20
  (e4m3 keeps 3 of fp32's 23 mantissa bits); a carry lands on the next e4m3 value. |y| <= 448 never carries
  past 448 (448's dropped bits are zero).
* |y| < 2^-6 (e4m3 subnormals, a fixed step of 2^-9): ``floor(|y| * 2^9 + r16 / 2^16) / 2^9``.

The probability of rounding up is the dropped fraction to 16 bits, so the rounding is unbiased up to 2^-16 of a
step. Every backend computes the same fp32 operations (only the source of the random bits differs: a
torch.Generator here, Philox in the kernels), so outputs are always one of the two neighbouring e4m3 values of
the exact update, which is what the tests check, bit for bit, besides the mean.

Non-finite m cannot arise: a step whose gradients are not finite is skipped before the update (optim.py).
"""

from __future__ import annotations

import torch

BLOCK = 256  # elements per scale
E4M3_MAX = 448.0
DTYPE = torch.float8_e4m3fn
_MANT_175 = 0x600000  # fp32 mantissa bits of 1.75 (448 = 1.75 * 2^8)
K_MIN = -117  # the smallest scale exponent (block_scales): 2^-9 * 2^-117 = 2^-126, fp32's smallest normal


def num_blocks(n: int) -> int:
    """Scales for a flat range of n elements."""
    return -(-n // BLOCK)


def block_scales(absmax: torch.Tensor, k_min: int = K_MIN) -> torch.Tensor:
    """[B] fp32 block maxima (>= 0, finite) -> [B] fp32 scales 2^k, k the smallest with absmax / 2^k <= 448.

    Exact integer arithmetic on the fp32 bits: absmax = f * 2^E with f in [1, 2); k = E - 8 when f <= 1.75, else
    E - 7, so absmax / 2^k is in (224, 448]. k is clamped at ``k_min`` (default ``K_MIN`` = -117), so that the
    smallest nonzero stored value, e4m3's smallest subnormal 2^-9 times the scale, is 2^-126: a normal fp32,
    exact in bf16 (a checkpoint holds m as bf16) and never flushed to zero by a GPU's flush-to-zero mode. A block
    whose maximum is below ~2^-109 (e.g. the embedding rows of tokens not seen for ~700 steps) gets that scale,
    and its values round to multiples of 2^-126 or to 0. (The second moment's format, fp8_second_moment.py,
    stores square roots and passes its own, higher ``k_min``.)"""
    bits = absmax.contiguous().view(torch.int32)
    exp = ((bits >> 23) & 0xFF) - 127
    k = torch.where((bits & 0x7FFFFF) <= _MANT_175, exp - 8, exp - 7).clamp_(min=k_min)
    return ((k + 127) << 23).view(torch.float32)


def sr_e4m3(y: torch.Tensor, r16: torch.Tensor) -> torch.Tensor:
    """fp32 y (|y| <= 448) -> fp32 values on the e4m3 grid, stochastically rounded with r16 (int32 in
    [0, 2^16), same shape); see the module docstring. The result casts to e4m3 exactly."""
    bits = y.view(torch.int32)
    mag = bits & 0x7FFFFFFF
    sign = bits & ~0x7FFFFFFF
    normal = ((mag + (r16 << 4)) & ~0xFFFFF).view(torch.float32)
    a = mag.view(torch.float32) * 512.0
    sub = torch.floor(a + r16.to(torch.float32) * (1.0 / 65536.0)) * (1.0 / 512.0)
    out = torch.where(mag >= 0x3C800000, normal, sub)  # 0x3C800000: 2^-6, e4m3's smallest normal
    return (out.view(torch.int32) | sign).view(torch.float32)


def _blocks(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x [n] -> ([B, BLOCK] zero-padded view or copy, n)."""
    n = x.numel()
    pad = num_blocks(n) * BLOCK - n
    return (torch.nn.functional.pad(x, (0, pad)) if pad else x).view(-1, BLOCK), n


def quantize(m32: torch.Tensor, r16: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 m [n] -> (q [n] e4m3, scale [num_blocks(n)] fp32). ``r16`` ([n] int32 in [0, 2^16)) gives stochastic
    rounding; None rounds to nearest (``requantize``: values from a checkpoint)."""
    blocks, n = _blocks(m32.float())
    scale = block_scales(blocks.abs().amax(dim=1))
    y = (blocks / scale[:, None]).reshape(-1)[:n]
    if r16 is not None:
        y = sr_e4m3(y.contiguous(), r16.to(torch.int32))
    return y.to(DTYPE), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(q [n] e4m3, scale [num_blocks(n)] fp32) -> fp32 m [n] (exact)."""
    n = q.numel()
    return (q.float().reshape(-1) * scale.repeat_interleave(BLOCK)[:n]).reshape(-1)


def requantize(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """A checkpoint's m (bf16/fp32 values [n]) -> (q, scale, exact). Values written by ``dequantize`` with the
    same blocks come back as the very same numbers (exact=True: a resume is bit-identical). With other blocks
    (the checkpoint of another world size, whose shards cut the blocks elsewhere) a value may lie between the
    grid points of its new block; it is rounded to nearest (exact=False), a change far below m's own noise."""
    flat = values.float().reshape(-1)
    q, scale = quantize(flat, None)
    return q, scale, bool(torch.equal(dequantize(q, scale), flat))
