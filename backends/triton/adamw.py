"""AdamW over flat shards in one launch, and stochastic rounding fp32 -> bf16.

AdamW: every element is independent, so one element-wise kernel reads grad, m, v and the weight of record
(master or param) once, does torch.optim.AdamW's math in fp32 in its operation order (the same fused
multiply-adds torch's CPU kernels use for lerp and addcmul), and writes m, v, the record and, with a master,
the model-dtype param: one pass over optimizer state instead of torch's ~10 element-wise passes. bf16
storage of record is written with stochastic rounding; fp32 exactly; param (with a master) rounded to nearest.

Random bits: the stochastic rounding takes 16 bits per stored value from Triton's counter-based Philox
generator. One Philox call (``tl.randint4x``: 4 x 32 bits, ~10 rounds of 32-bit multiplies) serves a group of
4 consecutive elements: element 4g+j takes word j of Philox(seed, g), its low 16 bits for m and its high 16
bits for v; a bf16 weight of record (no master) takes word j of a second stream Philox(seed_p, g). One call per
element per state (the first version) made the 0.5B AdamW step compute-bound on the generator: 6.1 ms for
~3.6 ms of memory traffic on an H100. Seeds are derived from the call's seed as torch_ref_optim does
(``derive_seed(seed, "m" | "p")``). The bits are a pure function of (seed, tensor, index): reproducible on
every run, independent of the launch geometry and of the device type (GPU and interpreter produce the same
bits) - but *not* the bits of torch's generator, so bf16 results match the torch reference in distribution
(unbiased rounding), not bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmq_ray.backends.base import check_adamw_shards, check_stochastic_round_args
from llmq_ray.backends.torch_ref_optim import check_m_scale, derive_seed
from llmq_ray.backends.triton._common import cast_to, elementwise_block, num_warps_for

_SEED_MASK = (1 << 63) - 1


@triton.jit
def sr_bf16(x, r16):
    """Stochastically round fp32 x to bf16 with random bits r16 (int32 in [0, 65536)). inf/nan pass through,
    finite values saturate at +-max bf16 (see torch_ref_optim's docstring for why it is unbiased)."""
    bits = x.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    sign = bits ^ mag
    finite = mag < 0x7F800000
    mag = tl.where(finite, mag, 0)
    rounded = tl.minimum(((mag + r16) >> 16) << 16, 0x7F7F0000)
    out = tl.where(finite, (sign | rounded).to(tl.float32, bitcast=True), x)
    return cast_to(out, tl.bfloat16)  # exact for finite values (low bits zero); nan stays nan


@triton.jit
def _philox_words(seed, groups):
    """[G] group indices -> [G, 4] uint32: word j of Philox(seed, g) for element 4g+j."""
    r0, r1, r2, r3 = tl.randint4x(seed, groups)
    j = tl.arange(0, 4)[None, :]
    return tl.where(j == 0, r0[:, None], tl.where(j == 1, r1[:, None], tl.where(j == 2, r2[:, None], r3[:, None])))


@triton.jit
def _store_state(ptr, offs, mask, value, r16):
    if ptr.dtype.element_ty == tl.bfloat16:
        tl.store(ptr + offs, sr_bf16(value, r16), mask=mask)
    else:
        tl.store(ptr + offs, value, mask=mask)


@triton.jit
def adamw_math(g, p, m, v, decay, beta2, one_minus_beta1, one_minus_beta2, bias_correction2_sqrt, neg_step_size,
               eps, LERP_FROM_START: tl.constexpr):
    """torch.optim.AdamW's step on fp32 values (g already scaled) in its operation order -> (p, m, v)."""
    p = p * decay
    if LERP_FROM_START:  # torch.lerp: weight < 0.5 -> start + w (end - start), else end - (1 - w)(end - start)
        m = tl.fma(one_minus_beta1, g - m, m)
    else:
        m = g - (g - m) * (1.0 - one_minus_beta1)
    v = tl.fma(one_minus_beta2 * g, g, v * beta2)
    denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    p = p + tl.div_rn(neg_step_size * m, denom)
    return p, m, v


@triton.jit
def load_scaled_grad(grad_ptr, offs, mask, grad_scale_ptr, grad_scale, SCALE_IS_TENSOR: tl.constexpr):
    """fp32 grad * grad_scale (a float argument, or the 0-d tensor at grad_scale_ptr)."""
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if SCALE_IS_TENSOR:
        g = g * tl.load(grad_scale_ptr).to(tl.float32)
    else:
        g = g * grad_scale
    return g


# The seeds change at every step and chunk: were they specialized (Triton keys compiled variants on whether an
# int argument is 1 or a multiple of 16), a step whose seeds first hit a new combination would stop the host
# for a JIT compile mid-update (seen at 7B as the 4th update ~0.6 s slower, the 5th faster, in every run).
@triton.jit(do_not_specialize=["seed_mv", "seed_p"])
def _adamw_kernel(param_ptr, grad_ptr, m_ptr, v_ptr, master_ptr, grad_scale_ptr, n, grad_scale,
                  decay, beta2, one_minus_beta1, one_minus_beta2, bias_correction2_sqrt, neg_step_size, eps,
                  seed_mv, seed_p, HAS_MASTER: tl.constexpr, SCALE_IS_TENSOR: tl.constexpr,
                  LERP_FROM_START: tl.constexpr, BLOCK: tl.constexpr):
    groups = tl.program_id(0).to(tl.int64) * (BLOCK // 4) + tl.arange(0, BLOCK // 4)
    offs = groups[:, None] * 4 + tl.arange(0, 4)[None, :]  # [BLOCK/4, 4] elements, 4 per Philox call
    mask = offs < n
    g = load_scaled_grad(grad_ptr, offs, mask, grad_scale_ptr, grad_scale, SCALE_IS_TENSOR)
    if HAS_MASTER:
        rec_ptr = master_ptr
    else:
        rec_ptr = param_ptr
    p = tl.load(rec_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p, m, v = adamw_math(g, p, m, v, decay, beta2, one_minus_beta1, one_minus_beta2, bias_correction2_sqrt,
                         neg_step_size, eps, LERP_FROM_START)
    if m_ptr.dtype.element_ty == tl.bfloat16 or v_ptr.dtype.element_ty == tl.bfloat16:
        r_mv = _philox_words(seed_mv, groups)
    else:
        r_mv = tl.zeros(offs.shape, dtype=tl.uint32)  # unused: fp32 states are stored exactly
    _store_state(m_ptr, offs, mask, m, (r_mv & 0xFFFF).to(tl.int32))
    _store_state(v_ptr, offs, mask, v, (r_mv >> 16).to(tl.int32))
    if rec_ptr.dtype.element_ty == tl.bfloat16:
        stored = sr_bf16(p, (_philox_words(seed_p, groups) & 0xFFFF).to(tl.int32))
    else:
        stored = p
    tl.store(rec_ptr + offs, stored, mask=mask)
    if HAS_MASTER:
        tl.store(param_ptr + offs, cast_to(stored.to(tl.float32), param_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["seed"])  # per-call seeds: no recompiles (see _adamw_kernel)
def _stochastic_round_kernel(out_ptr, x_ptr, n, seed, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, sr_bf16(x, (tl.randint(seed, offs) & 0xFFFF).to(tl.int32)), mask=mask)


def adamw_update(param, grad, m, v, *, master, lr, beta1, beta2, eps, weight_decay, step, grad_scale, seed,
                 m_scale=None):
    """One AdamW step in place on flat [n] shards (see Backend.adamw_update); a single kernel launch. An e4m3
    m (with its block scales ``m_scale``) goes to adamw_fp8m.py's kernel."""
    n = check_adamw_shards(param, grad, m, v, master, step)
    check_m_scale(m, m_scale)
    if n == 0:
        return
    scale_is_tensor = isinstance(grad_scale, torch.Tensor)
    if m_scale is not None:
        from llmq_ray.backends.triton import adamw_fp8m

        scalars = dict(decay=1.0 - lr * weight_decay, beta2=beta2, one_minus_beta1=1.0 - beta1,
                       one_minus_beta2=1.0 - beta2, bias_correction2_sqrt=(1.0 - beta2 ** step) ** 0.5,
                       neg_step_size=-(lr / (1.0 - beta1 ** step)), eps=eps)
        adamw_fp8m.launch(param, grad, m.view(torch.uint8), m_scale, v, master, n, scalars,
                          (derive_seed(seed, "m"), derive_seed(seed, "p")), scale_is_tensor=scale_is_tensor,
                          grad_scale=grad_scale)
        return
    block = elementwise_block()
    _adamw_kernel[(triton.cdiv(n, block),)](
        param, grad, m, v, master if master is not None else param,
        grad_scale if scale_is_tensor else grad, n, 0.0 if scale_is_tensor else float(grad_scale),
        1.0 - lr * weight_decay, beta2, 1.0 - beta1, 1.0 - beta2, (1.0 - beta2 ** step) ** 0.5,
        -(lr / (1.0 - beta1 ** step)), eps,
        derive_seed(seed, "m"), derive_seed(seed, "p"),
        HAS_MASTER=master is not None, SCALE_IS_TENSOR=scale_is_tensor, LERP_FROM_START=(1.0 - beta1) < 0.5,
        BLOCK=block, num_warps=num_warps_for(block))


def stochastic_round(out, inp, seed: int) -> None:
    """out (bf16) = inp (fp32) stochastically rounded with Philox(seed, index) bits; same shape, contiguous."""
    n = check_stochastic_round_args(out, inp)
    if n == 0:
        return
    block = elementwise_block()
    _stochastic_round_kernel[(triton.cdiv(n, block),)](out.view(-1), inp.reshape(-1), n, int(seed) & _SEED_MASK,
                                                       BLOCK=block, num_warps=num_warps_for(block))
