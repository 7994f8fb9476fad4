"""Reference optimizer kernels in plain torch ops: AdamW, the squared global norm and stochastic rounding.

These are the ground truth for ``Backend.adamw_update``, ``Backend.global_norm_squared`` and
``Backend.stochastic_round`` (see ``backends/base.py`` for the contracts); ``TorchBackend`` delegates to them
and the Triton/CuPy kernels are tested against them. They run on CPU and CUDA alike, compute in fp32 and never
synchronize with the host.

Stochastic rounding fp32 -> bf16
--------------------------------
bf16 is the upper half of an fp32 bit pattern. Write the magnitude bits of a finite fp32 ``x`` as
``H * 2^16 + L`` with ``L`` in [0, 2^16). Truncating gives ``lo`` (magnitude bits ``H * 2^16``), the bf16 next to
``x`` towards zero; ``hi`` (magnitude ``(H + 1) * 2^16``) is the next one away from zero. Add a uniformly random
16-bit integer ``r`` to the magnitude bits and truncate: a carry into ``H`` happens exactly when ``L + r >= 2^16``,
i.e. with probability ``L / 2^16``. Between ``lo`` and ``hi`` the fp32 values are evenly spaced (they share
``lo``'s exponent; when ``hi`` is the next power of two, the mantissa carry lands exactly on it), so
``x = lo + (L / 2^16) (hi - lo)`` and hence ``E[out] = lo + P(carry) (hi - lo) = x``: unbiased. Subnormals work
the same way (evenly spaced too). Values already representable (``L = 0``) never carry and stay as they are.
Working on the magnitude (sign kept aside) makes the rounding symmetric for negative numbers.

Edges: inf and nan are passed through unchanged (nan stays nan; the random add is not applied to them).
Finite values above the largest finite bf16 (``3.3895e38``, magnitude bits ``0x7F7F0000``) would round up into
inf; instead they *saturate* at +-max bf16, so a finite input never becomes inf. That one window
(|x| in (3.3895e38, 3.4028e38]) is therefore biased downwards, by design.

RNG: the 16 random bits per element come from a ``torch.Generator`` on the tensor's device seeded with
``seed``: the same seed on the same device type gives the same bits (CPU and CUDA generators produce different
streams, so bits are reproducible per device type, not across them). Large tensors are processed in chunks of
``CHUNK`` elements (bounding the fp32 temporaries to a few times 64 MiB); chunking is fixed, so it does not
change reproducibility.
"""

from __future__ import annotations

import hashlib

import torch

from llmq_ray.backends import fp8_moment, fp8_second_moment

CHUNK = 1 << 24  # elements per chunk of the elementwise passes on CUDA (fp32 temporaries of 64 MiB each)
# On CPU, 4 MiB temporaries stay under glibc's mmap threshold and are reused from the heap; 64 MiB ones are
# mmapped and page-faulted afresh on every pass (measured: most of a tiny-qwen step went to page faults).
CPU_CHUNK = 1 << 20


def _chunk(t: torch.Tensor) -> int:
    return CHUNK if t.device.type == "cuda" else CPU_CHUNK

_BF16_MAX_BITS = 0x7F7F0000  # magnitude bits of the largest finite bf16, as an fp32 pattern
_EXP_ALL_ONES = 0x7F800000  # magnitude bits >= this are inf / nan
_LOW16_CLEAR = -65536  # int32 with bits 0xFFFF0000: clears the 16 bits that bf16 drops


def derive_seed(seed: int, tag: str) -> int:
    """A 63-bit seed for one consumer (``tag``) of a parent ``seed``; distinct tags give unrelated streams."""
    digest = hashlib.blake2b(f"{int(seed)}/{tag}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _generator(device: torch.device, seed: int) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed) & ((1 << 63) - 1))
    return gen


def _round_chunk(inp: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Stochastically round one 1-D fp32 chunk; returns a new bf16 tensor of the same length."""
    bits = inp.contiguous().view(torch.int32)
    mag = bits & 0x7FFFFFFF
    sign = bits & ~0x7FFFFFFF  # 0 or the sign bit (int32 min)
    finite = mag < _EXP_ALL_ONES
    mag = torch.where(finite, mag, 0)  # inf/nan are restored below; zeroing them keeps the add in range
    r = torch.randint(0, 1 << 16, inp.shape, generator=gen, device=inp.device, dtype=torch.int32)
    # mag + r cannot overflow int32: finite mag <= 0x7F7FFFFF, so mag + r < 0x7F810000.
    rounded = ((mag + r) & _LOW16_CLEAR).clamp_(max=_BF16_MAX_BITS)  # saturate instead of becoming inf
    out32 = (sign | rounded).view(torch.float32)  # low 16 bits are zero: the bf16 cast below is exact
    return torch.where(finite, out32, inp).to(torch.bfloat16)


class _Rounder:
    """Writes fp32 values into a bf16 (stochastic rounding, one generator per tensor) or fp32 destination.

    One instance per destination tensor per update, so the random stream advances chunk by chunk."""

    def __init__(self, dest: torch.Tensor, seed: int):
        self.dest = dest
        self.gen = _generator(dest.device, seed) if dest.dtype == torch.bfloat16 else None

    def write(self, lo: int, hi: int, value32: torch.Tensor) -> None:
        if self.gen is None:
            self.dest[lo:hi].copy_(value32)
        else:
            self.dest[lo:hi].copy_(_round_chunk(value32, self.gen))


class _Fp8Rounder:
    """Writes fp32 moment values into e4m3 ``q`` and its block scales in ``fmt``'s format (backends/fp8_moment.py:
    the first moment; backends/fp8_second_moment.py: the second, as its square root), with stochastic rounding
    from one generator; chunks start at multiples of the block size."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, seed: int, fmt=fp8_moment):
        self.q, self.scale, self.gen, self.fmt = q, scale, _generator(q.device, seed), fmt

    def read(self, lo: int, hi: int) -> torch.Tensor:
        b = lo // fp8_moment.BLOCK
        return self.fmt.dequantize(self.q[lo:hi], self.scale[b:b + fp8_moment.num_blocks(hi - lo)])

    def write(self, lo: int, hi: int, value32: torch.Tensor) -> None:
        r16 = torch.randint(0, 1 << 16, value32.shape, generator=self.gen, device=value32.device, dtype=torch.int32)
        q, scale = self.fmt.quantize(value32, r16)
        b = lo // fp8_moment.BLOCK
        self.q[lo:hi].copy_(q)
        self.scale[b:b + scale.numel()].copy_(scale)


def check_m_scale(m: torch.Tensor, m_scale: torch.Tensor | None, name: str = "m") -> None:
    """An e4m3 moment (``name``: m, or v) needs its fp32 block scales [num_blocks(n)]; an fp32/bf16 one takes
    none. ValueError."""
    if m.dtype == fp8_moment.DTYPE:
        if m_scale is None or m_scale.dtype != torch.float32 or m_scale.shape != (fp8_moment.num_blocks(m.numel()),):
            got = "None" if m_scale is None else f"{m_scale.dtype} {tuple(m_scale.shape)}"
            raise ValueError(f"adamw_update: an e4m3 {name} of {m.numel()} elements needs {name}_scale, fp32 "
                             f"[{fp8_moment.num_blocks(m.numel())}], got {got}")
    elif m_scale is not None:
        raise ValueError(f"adamw_update: {name}_scale is only for an e4m3 {name}, got {name} in {m.dtype}")


def _check_state_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in (torch.float32, torch.bfloat16) and not (name in ("m", "v") and t.dtype == fp8_moment.DTYPE):
        raise TypeError(f"adamw_update: {name} must be fp32 or bf16, got {t.dtype}")


def stochastic_round(out: torch.Tensor, inp: torch.Tensor, seed: int) -> None:
    """out (bf16) = inp (fp32) stochastically rounded (unbiased; see the module docstring). Same shape.

    Deterministic for a given ``seed`` on a given device type. inf/nan pass through; finite values beyond the
    bf16 range saturate at +-max bf16.
    """
    if out.dtype != torch.bfloat16 or inp.dtype != torch.float32:
        raise TypeError(f"stochastic_round: needs fp32 -> bf16, got {inp.dtype} -> {out.dtype}")
    if out.shape != inp.shape:
        raise ValueError(f"stochastic_round: shapes differ: out {tuple(out.shape)} vs inp {tuple(inp.shape)}")
    flat_in = inp.reshape(-1)
    flat_out = out.view(-1)  # out must be contiguous (the Backend convention); view() fails loudly otherwise
    gen = _generator(out.device, seed)
    chunk = _chunk(flat_in)
    for lo in range(0, flat_in.numel(), chunk):
        hi = min(lo + chunk, flat_in.numel())
        flat_out[lo:hi].copy_(_round_chunk(flat_in[lo:hi], gen))


def global_norm_squared(out: torch.Tensor, tensor: torch.Tensor) -> None:
    """out (fp32 0-d tensor) += sum(tensor^2), squares and sum in fp32 (accumulate; no host sync).

    ``tensor`` may be any shape and fp32/bf16; bf16 is widened chunk by chunk (exact), so the sum is the same
    as over the fp32 values. The chunked partial sums are added in a fixed order (deterministic).
    """
    if out.dtype != torch.float32 or out.numel() != 1:
        raise TypeError(f"global_norm_squared: out must be an fp32 scalar tensor, got {out.dtype} {tuple(out.shape)}")
    flat = tensor.reshape(-1)
    chunk = _chunk(flat)
    for lo in range(0, flat.numel(), chunk):
        out.add_(flat[lo:lo + chunk].float().square().sum())


def adamw_update(param: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *,
                 master: torch.Tensor | None, lr: float, beta1: float, beta2: float, eps: float,
                 weight_decay: float, step: int, grad_scale: torch.Tensor | float, seed: int,
                 m_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """One AdamW step, in place, over flat 1-D shards of equal length (the ``Backend.adamw_update`` contract).

    Shapes/dtypes: param [n] fp32|bf16 (model dtype), grad [n] fp32|bf16, m [n] fp32|bf16|e4m3 (e4m3 with
    ``m_scale`` [ceil(n/256)] fp32 block scales, backends/fp8_moment.py), v [n] fp32|bf16|e4m3 (e4m3: sqrt(v),
    with ``v_scale`` [ceil(n/256)] fp32, backends/fp8_second_moment.py),
    master None or [n] fp32|bf16. ``grad_scale``: Python float or 0-d fp32 tensor (on the device or CPU; it is
    never read on the host). ``step`` is 1-based (the bias corrections use ``beta^step``).

    The math is torch.optim.AdamW's, in its operation order, all in fp32::

        g = grad * grad_scale
        p = p * (1 - lr*wd)
        m = lerp(m, g, 1 - b1)
        v = b2*v + (1 - b2) * g*g
        p = p - (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

    p is ``master`` when given, else ``param``. The update uses this step's fp32 m and v; only their stored
    copies are rounded when m/v are bf16 or e4m3 (at fresh per-block scales). Storage of record written
    in bf16 or e4m3 (m, v, master, or param without master) gets stochastic rounding with seeds derived from
    ``seed`` (one per tensor, so m, v and p draw unrelated bits); fp32 storage is written exactly. With a master, ``param`` becomes master rounded to
    nearest in param's dtype (what the forward uses; the master keeps the small updates).
    """
    n = param.numel()
    for name, t in (("grad", grad), ("m", m), ("v", v), ("master", master)):
        if t is not None and (t.dim() != 1 or t.numel() != n):
            raise ValueError(f"adamw_update: {name} has shape {tuple(t.shape)}, expected flat [{n}] like param")
    if param.dim() != 1:
        raise ValueError(f"adamw_update: param must be a flat 1-D shard, got shape {tuple(param.shape)}")
    for name, t in (("param", param), ("m", m), ("v", v)) + ((("master", master),) if master is not None else ()):
        _check_state_dtype(name, t)
    check_m_scale(m, m_scale)
    check_m_scale(v, v_scale, "v")
    if step < 1:
        raise ValueError(f"adamw_update: step is 1-based, got {step}")
    if n == 0:
        return

    # Python-float constants exactly as torch.optim.AdamW forms them (single-tensor path).
    decay_factor = 1.0 - lr * weight_decay
    bias_correction1 = 1.0 - beta1 ** step
    bias_correction2_sqrt = (1.0 - beta2 ** step) ** 0.5
    step_size = lr / bias_correction1

    record = master if master is not None else param
    if m.dtype == fp8_moment.DTYPE:
        m_out = _Fp8Rounder(m, m_scale, derive_seed(seed, "m"))
    else:
        m_out = _Rounder(m, derive_seed(seed, "m"))
    if v.dtype == fp8_moment.DTYPE:
        v_out = _Fp8Rounder(v, v_scale, derive_seed(seed, "v"), fp8_second_moment)
    else:
        v_out = _Rounder(v, derive_seed(seed, "v"))
    p_out = _Rounder(record, derive_seed(seed, "p"))
    chunk = _chunk(param)
    for lo in range(0, n, chunk):
        hi = min(lo + chunk, n)
        g = grad[lo:hi].float() * grad_scale  # fp32 * (float | 0-d fp32 tensor): fp32, no sync
        # fp32 working copies (copy=True: for fp32 storage .float() would alias it); written back below,
        # exactly for fp32 storage and with stochastic rounding for bf16.
        p32 = record[lo:hi].to(torch.float32, copy=True)
        m32 = m_out.read(lo, hi) if m_scale is not None else m[lo:hi].to(torch.float32, copy=True)
        v32 = v_out.read(lo, hi) if v_scale is not None else v[lo:hi].to(torch.float32, copy=True)

        p32.mul_(decay_factor)
        m32.lerp_(g, 1.0 - beta1)
        v32.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        denom = (v32.sqrt() / bias_correction2_sqrt).add_(eps)
        p32.addcdiv_(m32, denom, value=-step_size)

        m_out.write(lo, hi, m32)
        v_out.write(lo, hi, v32)
        p_out.write(lo, hi, p32)
        if master is not None:
            param[lo:hi].copy_(master[lo:hi])  # round to nearest (or exact widening) into the model dtype
