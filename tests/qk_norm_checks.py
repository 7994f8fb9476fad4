"""Checks of a fast backend's QK-norm (Qwen3: per-head RMSNorm of the q and k heads) against the torch reference,
shared by test_triton_kernels.py (small shapes, CPU interpreter or GPU) and the GPU test files (test_triton_gpu.py,
test_cupy_gpu.py: Qwen3-0.6B-like shapes). Not a test module itself.

Tolerances: fp32 outputs within 1e-5 of the reference relative to the tensor's max magnitude (as every kernel
check); bf16 outputs within 2 ulp of the reference's, elementwise: both compute in fp32 and round once, and
rsqrt vs 1/sqrt or another summation order may move a value across one rounding boundary. The bf16 weight
gradients are accumulated into a nonzero gradient: the reference rounds the new sum to bf16 before adding (two
roundings), a fused kernel adds in fp32 (one), so there the ulp is taken at twice the larger of the old value and
the result (a cancellation leaves a small result carrying the sum's rounding error). The value heads must come
back untouched, ``saved`` bit-identical, and a second run must give the same bits (no atomics).
"""

from __future__ import annotations


import torch

NAMES = ("y", "saved", "rstd", "dx", "dq_weight", "dk_weight")


def randn(*shape, seed, device, dtype=torch.float32, scale=1.0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(*shape, generator=g) * scale
    x = torch.where(x.abs() < 1e-3, torch.full_like(x, 1e-3), x)
    return x.to(dtype).to(device)


def assert_rel(got, want, tol, what):
    got, want = got.double(), want.double()
    err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
    assert err <= tol, f"{what}: max error {err:.3e} relative to max |ref| exceeds {tol:.0e}"


def assert_ulps(got, want, ulps, what, atol_rel=1e-6, magnitude=None):
    """Elementwise |got - want| <= ulps units in the last place of want's dtype at ``magnitude`` (default |want|)
    plus atol_rel * max|want| (values out of a cancellation)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype)
    g, w = got.double(), want.double()
    mag = w.abs() if magnitude is None else magnitude.double().abs()
    mant = {torch.float32: 23, torch.bfloat16: 7}[want.dtype]
    ulp = torch.exp2(torch.floor(torch.log2(mag.clamp_min(1e-30))) - mant)
    bad = (g - w).abs() > ulps * ulp + atol_rel * w.abs().max()
    assert not bad.any(), f"{what}: {int(bad.sum())} values off by more than {ulps} ulp, worst " \
                          f"{((g - w).abs() / ulp)[bad].max().item():.1f} ulp"


def run_qk_norm(be, qkv, wq, wk, dy, dwq0, dwk0, hq, hkv, eps=1e-6):
    """Forward on a copy of qkv, then backward on a copy of dy: (y, saved, rstd, dx, dq_weight, dk_weight)."""
    n, h, d = qkv.shape[0] * qkv.shape[1], hq + hkv, qkv.shape[-1]
    y = qkv.clone()
    saved = torch.empty(n, h, d, dtype=qkv.dtype, device=qkv.device)
    rstd = torch.empty(n, h, dtype=torch.float32, device=qkv.device)
    be.qk_norm_forward(y, saved, rstd, wq, wk, hq, hkv, eps)
    dx, dwq, dwk = dy.clone(), dwq0.clone(), dwk0.clone()
    be.qk_norm_backward(dx, dwq, dwk, saved, rstd, wq, wk, hq, hkv)
    return y, saved, rstd, dx, dwq, dwk


def check_qk_norm(fast, ref, dtype, b, t, hq, hkv, d, device):
    """Forward output and rstd, backward dx and both weight gradients of ``fast`` against ``ref``."""
    qkv = randn(b, t, hq + 2 * hkv, d, seed=60, device=device, dtype=dtype, scale=2.0)
    wq = (1.0 + 0.3 * randn(d, seed=61, device=device)).to(dtype)
    wk = (1.0 + 0.3 * randn(d, seed=62, device=device)).to(dtype)
    dy = randn(b, t, hq + 2 * hkv, d, seed=63, device=device, dtype=dtype)
    dwq0 = (0.5 * randn(d, seed=64, device=device)).to(dtype)
    dwk0 = (0.5 * randn(d, seed=65, device=device)).to(dtype)
    got = run_qk_norm(fast, qkv, wq, wk, dy, dwq0, dwk0, hq, hkv)
    want = run_qk_norm(ref, qkv, wq, wk, dy, dwq0, dwk0, hq, hkv)
    v = slice(hq + hkv, None)  # value heads: never touched
    assert torch.equal(got[0][:, :, v], qkv[:, :, v]) and torch.equal(got[3][:, :, v], dy[:, :, v])
    assert torch.equal(got[1], want[1]), "saved must be the q/k heads' input, bit for bit"
    assert_rel(got[2], want[2], 1e-6, "rstd (fp32)")
    old = {"dq_weight": dwq0, "dk_weight": dwk0}
    for name, g, w in zip(NAMES, got, want):
        if name in ("saved", "rstd"):
            continue
        if dtype == torch.float32:
            assert_rel(g, w, 1e-5, name)
        elif name in old:
            assert_ulps(g, w, 2, name, magnitude=2 * torch.maximum(w.float().abs(), old[name].float().abs()))
        else:
            assert_ulps(g, w, 2, name)
    again = run_qk_norm(fast, qkv, wq, wk, dy, dwq0, dwk0, hq, hkv)
    assert all(torch.equal(a, g) for a, g in zip(again, got)), "a second run gave other bits"
    return qkv, wq, wk, dy, dwq0, dwk0


def time_qk_norm(fast, ref, b, t, hq, hkv, d, device):
    """Prints forward and backward times (ms, kernel_checks.time_cuda) of ``fast`` and ``ref`` in bf16."""
    from kernel_checks import time_cuda

    qkv = randn(b, t, hq + 2 * hkv, d, seed=60, device=device, dtype=torch.bfloat16)
    w = torch.ones(d, dtype=torch.bfloat16, device=device)
    n, h = b * t, hq + hkv
    saved = torch.empty(n, h, d, dtype=torch.bfloat16, device=device)
    rstd = torch.empty(n, h, device=device)
    dy = randn(b, t, hq + 2 * hkv, d, seed=63, device=device, dtype=torch.bfloat16)
    dwq, dwk = torch.zeros(d, device=device), torch.zeros(d, device=device)
    print(f"\n  qk_norm at N={n}, Hq={hq}, Hkv={hkv}, D={d}, bf16:  {'fast ms':>9s} {'torch ms':>9s}")
    for what, fn in (("forward", lambda be: be.qk_norm_forward(qkv, saved, rstd, w, w, hq, hkv, 1e-6)),
                     ("backward", lambda be: be.qk_norm_backward(dy, dwq, dwk, saved, rstd, w, w, hq, hkv))):
        print(f"  {what:44s} {time_cuda(lambda: fn(fast)):9.4f} {time_cuda(lambda: fn(ref)):9.4f}")
