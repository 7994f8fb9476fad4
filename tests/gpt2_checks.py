"""Checks of a fast backend's GPT-2 kernels (LayerNorm with the fused residual add, its backward, GELU-tanh) against
the base class's torch defaults on a CUDA GPU, shared by test_triton_gpu.py and test_cupy_gpu.py. Not a test module
itself.

Tolerances: fp32 outputs (and the fp32 statistics) within 1e-5 of the default relative to the tensor's max
magnitude; bf16 outputs within 2 ulp elementwise (both compute in fp32 and round once); the bf16 weight/bias
gradients, accumulated into nonzero ones, at twice the larger of the old value and the result (as the CPU test in
test_triton_kernels.py and qk_norm_checks.py). The absmax outputs must be exactly max|stored|, the residual
inp1 + inp2 rounded once, and recompute (the plain forward of the stored residual) and a second run bit-identical.
"""

from __future__ import annotations

import torch

import kernel_checks as kc
from kernel_checks import DEV, randn

GPT2_N, GPT2_C, GPT2_I = 4096, 768, 3072  # GPT-2 124M: B*T = 4 x 1024 rows, hidden 768, MLP 3072
OPS = ("layernorm_forward", "fused_residual_layernorm_forward", "layernorm_backward", "gelu_tanh_forward",
       "gelu_tanh_backward")


def gpt2_close(got, want, dtype, what, old=None):
    """fp32 (and the fp32 statistics): within 1e-5 relative to max|ref|; bf16: 2 ulp elementwise (the weight/bias
    gradients, accumulated into nonzero ones, at twice the larger of the old value and the result), as the CPU
    test in test_triton_kernels.py."""
    from qk_norm_checks import assert_ulps

    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype)
    if dtype == torch.float32 or want.dtype == torch.float32:
        kc.assert_close(got, want, 1e-5, what)
    else:
        mag = None if old is None else 2 * torch.maximum(want.float().abs(), old.float().abs())
        assert_ulps(got, want, 2, what, magnitude=mag)


def gpt2_ops(be, use_default):
    """The five GPT-2 ops of ``be``: its own methods, or (use_default) the base class's torch defaults."""
    from llmq_ray.backends.base import Backend

    if use_default:
        return {op: (lambda *a, _op=op, **k: getattr(Backend, _op)(be, *a, **k)) for op in OPS}
    return {op: getattr(be, op) for op in OPS}


def gpt2_run(ops, a, b, w, bias, dout, dres0, dw0, db0, fc, dgelu):
    """One fused-residual forward, the block's backward (dinp aliasing dresidual, with absmax) and the final norm's
    (neither), GELU forward and backward with absmax: a dict of every output (absmax outputs start at a wrong value,
    so a missing write shows)."""
    n, c = a.shape
    o = {"residual": torch.empty_like(a), "out": torch.empty_like(a), "mean": torch.empty(n, device=DEV),
         "rstd": torch.empty(n, device=DEV), "absmax": torch.full((), -3.0, device=DEV)}
    ops["fused_residual_layernorm_forward"](o["residual"], o["out"], o["mean"], o["rstd"], a, b, w, bias, 1e-5,
                                            absmax=o["absmax"])
    o["dinp"], o["dweight"], o["dbias"] = dres0.clone(), dw0.clone(), db0.clone()
    o["dabsmax"] = torch.full((), -3.0, device=DEV)
    ops["layernorm_backward"](o["dinp"], o["dweight"], o["dbias"], dout, o["residual"], w, o["mean"], o["rstd"],
                              dresidual=o["dinp"], absmax=o["dabsmax"])  # dinp aliasing dresidual, as the model
    o["dinp_final"] = torch.empty_like(a)  # the final norm's form: no residual gradient, no absmax
    o["dweight_final"], o["dbias_final"] = dw0.clone(), db0.clone()
    ops["layernorm_backward"](o["dinp_final"], o["dweight_final"], o["dbias_final"], dout, o["residual"], w,
                              o["mean"], o["rstd"])
    o["gelu"], o["gelu_absmax"] = torch.empty_like(fc), torch.full((), -3.0, device=DEV)
    ops["gelu_tanh_forward"](o["gelu"], fc, absmax=o["gelu_absmax"])
    o["dfc"], o["dfc_absmax"] = torch.empty_like(fc), torch.full((), -3.0, device=DEV)
    ops["gelu_tanh_backward"](o["dfc"], dgelu, fc, absmax=o["dfc_absmax"])
    return o


def check_layernorm_and_gelu(fast, ref, dtype, n=GPT2_N, c=GPT2_C, i=GPT2_I, label="fast", timings=True):
    """``fast``'s LayerNorm (fused residual forward, backward with and without the residual gradient) and GELU-tanh
    against the base class's torch defaults (run on ``ref``) on [n, c] / [n, i]: every output, the absmax outputs
    exactly max|stored|, recompute and a second run bit-identical; then, with ``timings`` (bf16), a timing line per
    op (``label`` heads the fast backend's column)."""
    a, b = randn(n, c, seed=80, dtype=dtype, scale=2.0) + 0.5, randn(n, c, seed=81, dtype=dtype)
    w, bias = (1.0 + 0.3 * randn(c, seed=82)).to(dtype), (0.3 * randn(c, seed=83)).to(dtype)
    dout, dres0 = randn(n, c, seed=84, dtype=dtype), randn(n, c, seed=85, dtype=dtype)
    dw0, db0 = (0.5 * randn(c, seed=86)).to(dtype), (0.5 * randn(c, seed=87)).to(dtype)
    fc, dgelu = randn(n, i, seed=88, dtype=dtype, scale=3.0), randn(n, i, seed=89, dtype=dtype)
    args = (a, b, w, bias, dout, dres0, dw0, db0, fc, dgelu)
    got, want = gpt2_run(gpt2_ops(fast, False), *args), gpt2_run(gpt2_ops(ref, True), *args)
    assert torch.equal(got["residual"], want["residual"]), "residual must be inp1 + inp2 rounded once"
    for name in ("out", "mean", "rstd", "dinp", "dinp_final", "gelu", "dfc"):
        gpt2_close(got[name], want[name], dtype, name)
    for name, old in (("dweight", dw0), ("dbias", db0), ("dweight_final", dw0), ("dbias_final", db0)):
        gpt2_close(got[name], want[name], dtype, name, old=old)
    for amax, of in (("absmax", "out"), ("dabsmax", "dinp"), ("gelu_absmax", "gelu"), ("dfc_absmax", "dfc")):
        assert got[amax].item() == got[of].float().abs().max().item() > 0, f"{amax} is not max|{of}| as stored"
        kc.assert_close(got[amax], want[amax], kc.TOL[dtype], amax)
    out2, m2, r2, a2 = (torch.empty_like(got[k]) for k in ("out", "mean", "rstd", "absmax"))
    fast.layernorm_forward(out2, m2, r2, got["residual"], w, bias, 1e-5, absmax=a2)
    assert all(torch.equal(x, got[k]) for x, k in ((out2, "out"), (m2, "mean"), (r2, "rstd"), (a2, "absmax"))), \
        "layernorm_forward(residual) must reproduce the fused kernel bit for bit (recompute)"
    again = gpt2_run(gpt2_ops(fast, False), *args)
    assert all(torch.equal(again[k], got[k]) for k in got), "a second run gave other bits"
    if timings and dtype == torch.bfloat16:
        res, out, mean, rstd = (torch.empty_like(got[k]) for k in ("residual", "out", "mean", "rstd"))
        amax, gel, dfc, dx = torch.empty((), device=DEV), torch.empty_like(fc), torch.empty_like(fc), dres0.clone()
        dw, db = torch.zeros(c, dtype=dtype, device=DEV), torch.zeros(c, dtype=dtype, device=DEV)
        cases = {
            "fused_residual_layernorm+absmax": lambda o: o["fused_residual_layernorm_forward"](
                res, out, mean, rstd, a, b, w, bias, 1e-5, absmax=amax),
            "layernorm_backward (dresidual)+absmax": lambda o: o["layernorm_backward"](
                dx, dw, db, dout, got["residual"], w, got["mean"], got["rstd"], dresidual=dx, absmax=amax),
            "gelu_tanh_forward+absmax": lambda o: o["gelu_tanh_forward"](gel, fc, absmax=amax),
            "gelu_tanh_backward+absmax": lambda o: o["gelu_tanh_backward"](dfc, dgelu, fc, absmax=amax),
        }
        fast_ops, default = gpt2_ops(fast, False), gpt2_ops(ref, True)
        head = f"{label} ms"
        print(f"\n  GPT-2 124M ops, N={n} C={c} I={i}, bf16: {head:>10s} {'torch default ms':>17s}")
        for name, fn in cases.items():
            print(f"  {name:40s} {kc.time_cuda(lambda: fn(fast_ops)):10.4f} {kc.time_cuda(lambda: fn(default)):17.4f}")
