"""AdamW with the first moment in e4m3 (--opt-m-dtype e4m3): one launch, blocks of 256 elements per scale.

The format, its power-of-two scales and its stochastic rounding are defined in backends/fp8_moment.py (the torch
reference); this kernel computes the same fp32 operations. A program owns ``ROWS`` whole blocks as a
[ROWS, 64, 4] tile (256 elements per row: 64 Philox groups of 4, as in adamw.py), so the new block maxima are
row reductions in registers: m is read once (1 byte per element + its block's scale) and written once.

The e4m3 bytes are handled as uint8 with integer decode/encode, on the GPU and under the interpreter alike: the
values written are already on the e4m3 grid (the rounding happened in fp32), so the encode is exact bit
arithmetic and needs no conversion instruction. The random bits: word j of Philox(seed_mv, g) for element
4g+j, low 16 bits for m and high 16 for v (so v's bits are those of the bf16 kernel), a second stream for a bf16
weight of record.
"""

from __future__ import annotations

import triton
import triton.language as tl

from llmq_ray.backends.triton._common import cast_to
from llmq_ray.backends.triton.adamw import _store_state, adamw_math, load_scaled_grad, sr_bf16

ROWS = 4  # blocks of 256 per program: a 1024-element tile


@triton.jit
def _e4m3_decode(code):
    """uint8 e4m3 codes -> fp32 values (exact)."""
    c = code.to(tl.int32)
    e = (c >> 3) & 0xF
    mant = c & 7
    normal = (((e + 120) << 23) | (mant << 20)).to(tl.float32, bitcast=True)  # 2^(e-7) * (1 + mant/8)
    sub = mant.to(tl.float32) * (1.0 / 512.0)
    mag = tl.where(e > 0, normal, sub)
    return tl.where((c & 0x80) != 0, -mag, mag)


@triton.jit
def _e4m3_encode(q):
    """fp32 values already on the e4m3 grid (|q| <= 448) -> uint8 codes (exact)."""
    bits = q.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    normal = ((((mag >> 23) - 120) << 3) | ((mag >> 20) & 7))
    sub = (mag.to(tl.float32, bitcast=True) * 512.0).to(tl.int32)
    code = tl.where(mag >= 0x3C800000, normal, sub)
    return (code | tl.where(bits < 0, 0x80, 0)).to(tl.uint8)


@triton.jit
def _sr_e4m3(y, r16):
    """fp32 y (|y| <= 448) -> fp32 on the e4m3 grid, stochastically rounded (fp8_moment.sr_e4m3)."""
    bits = y.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    normal = ((mag + (r16 << 4)) & -1048576).to(tl.float32, bitcast=True)  # -1048576: bits 0xFFF00000
    a = mag.to(tl.float32, bitcast=True) * 512.0
    sub = tl.floor(a + r16.to(tl.float32) * (1.0 / 65536.0)) * (1.0 / 512.0)
    out = tl.where(mag >= 0x3C800000, normal, sub)
    return (out.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def _block_scale_exponent(absmax):
    """[R] fp32 block maxima -> [R] int32 k of the scale 2^k (fp8_moment.block_scales)."""
    bits = absmax.to(tl.int32, bitcast=True)
    exp = ((bits >> 23) & 0xFF) - 127
    k = tl.where((bits & 0x7FFFFF) <= 0x600000, exp - 8, exp - 7)
    return tl.maximum(k, -117)  # fp8_moment.K_MIN


@triton.jit(do_not_specialize=["seed_mv", "seed_p"])  # per-call seeds: no recompiles (see adamw.py)
def _adamw_fp8m_kernel(param_ptr, grad_ptr, m_ptr, m_scale_ptr, v_ptr, master_ptr, grad_scale_ptr, n, grad_scale,
                       decay, beta2, one_minus_beta1, one_minus_beta2, bias_correction2_sqrt, neg_step_size, eps,
                       seed_mv, seed_p, HAS_MASTER: tl.constexpr, SCALE_IS_TENSOR: tl.constexpr,
                       LERP_FROM_START: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [R] block indices
    groups = rows[:, None] * 64 + tl.arange(0, 64)[None, :]  # [R, 64] Philox groups of 4 elements
    offs = groups[:, :, None] * 4 + tl.arange(0, 4)[None, None, :]  # [R, 64, 4] elements
    mask = offs < n
    row_mask = rows * 256 < n
    g = load_scaled_grad(grad_ptr, offs, mask, grad_scale_ptr, grad_scale, SCALE_IS_TENSOR)
    if HAS_MASTER:
        rec_ptr = master_ptr
    else:
        rec_ptr = param_ptr
    p = tl.load(rec_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    old_scale = tl.load(m_scale_ptr + rows, mask=row_mask, other=1.0)
    m = _e4m3_decode(tl.load(m_ptr + offs, mask=mask, other=0)) * old_scale[:, None, None]
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p, m, v = adamw_math(g, p, m, v, decay, beta2, one_minus_beta1, one_minus_beta2, bias_correction2_sqrt,
                         neg_step_size, eps, LERP_FROM_START)

    r0, r1, r2, r3 = tl.randint4x(seed_mv, groups)
    j = tl.arange(0, 4)[None, None, :]
    r_mv = tl.where(j == 0, r0[:, :, None], tl.where(j == 1, r1[:, :, None],
                                                     tl.where(j == 2, r2[:, :, None], r3[:, :, None])))
    absmax = tl.max(tl.max(tl.where(mask, tl.abs(m), 0.0), axis=2), axis=1)  # [R]
    k = _block_scale_exponent(absmax)
    scale = ((k + 127) << 23).to(tl.float32, bitcast=True)
    inv_scale = ((127 - k) << 23).to(tl.float32, bitcast=True)  # 1 / 2^k, exact
    q = _sr_e4m3(m * inv_scale[:, None, None], (r_mv & 0xFFFF).to(tl.int32))
    tl.store(m_ptr + offs, _e4m3_encode(q), mask=mask)
    tl.store(m_scale_ptr + rows, scale, mask=row_mask)
    _store_state(v_ptr, offs, mask, v, (r_mv >> 16).to(tl.int32))
    if rec_ptr.dtype.element_ty == tl.bfloat16:
        s0, s1, s2, s3 = tl.randint4x(seed_p, groups)
        r_p = tl.where(j == 0, s0[:, :, None], tl.where(j == 1, s1[:, :, None],
                                                        tl.where(j == 2, s2[:, :, None], s3[:, :, None])))
        stored = sr_bf16(p, (r_p & 0xFFFF).to(tl.int32))
    else:
        stored = p
    tl.store(rec_ptr + offs, stored, mask=mask)
    if HAS_MASTER:
        tl.store(param_ptr + offs, cast_to(stored.to(tl.float32), param_ptr.dtype.element_ty), mask=mask)


def launch(param, grad, m_bytes, m_scale, v, master, n, scalars: dict, seeds: tuple[int, int], *,
           scale_is_tensor: bool, grad_scale) -> None:
    """Queue the kernel over flat [n] shards; ``m_bytes`` is m viewed as uint8 (adamw.adamw_update calls this)."""
    _adamw_fp8m_kernel[(triton.cdiv(n, ROWS * 256),)](
        param, grad, m_bytes, m_scale, v, master if master is not None else param,
        grad_scale if scale_is_tensor else grad, n, 0.0 if scale_is_tensor else float(grad_scale),
        *scalars.values(), *seeds, HAS_MASTER=master is not None, SCALE_IS_TENSOR=scale_is_tensor,
        LERP_FROM_START=scalars["one_minus_beta1"] < 0.5, ROWS=ROWS, num_warps=4)
