"""Triton backend on a CUDA GPU at realistic shapes (Qwen2.5-0.5B-like), against the torch reference.

Run on the GPU machine:  python -m pytest tests/test_triton_gpu.py -m gpu -q -p no:cacheprovider -s
(``-m gpu`` overrides the default ``-m 'not gpu'`` of pyproject.toml; ``-s`` shows the timing table.)
Everything here is skipped without CUDA. Tolerances as in test_triton_kernels.py; FP8 must be bit-exact
against torch's float8 casts at the same scale; whole-model gradients (bf16) must have cosine >= 0.99 with
the torch backend's for every parameter tensor.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

if torch.cuda.is_available():
    pytest.importorskip("triton")

from backends import get_backend  # noqa: E402

DEV = "cuda"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
N, C, I, V = 16 * 1024, 896, 4864, 151936
HQ, HKV, D = 14, 2, 64


@pytest.fixture(scope="module")
def tri():
    return get_backend("triton", DEV)


@pytest.fixture(scope="module")
def ref():
    return get_backend("torch", DEV)


def randn(*shape, seed=0, dtype=torch.float32, scale=1.0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(*shape, generator=g, device=DEV) * scale
    x = torch.where(x.abs() < 1e-3, torch.full_like(x, 1e-3), x)
    return x.to(dtype)


def assert_close(got, want, tol, what=""):
    got, want = got.double(), want.double()
    err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
    print(f"  {what}: max error {err:.2e} (relative to max |ref|)")
    assert err <= tol, f"{what}: max error {err:.3e} exceeds {tol:.0e}"


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_fused_and_backward(tri, ref, dtype):
    a, b = randn(N, C, seed=1, dtype=dtype), randn(N, C, seed=2, dtype=dtype)
    w = (1 + 0.2 * randn(C, seed=3)).to(dtype)
    outs = {}
    for name, be in (("tri", tri), ("ref", ref)):
        res, out = torch.empty(N, C, dtype=dtype, device=DEV), torch.empty(N, C, dtype=dtype, device=DEV)
        rstd, amax = torch.empty(N, device=DEV), torch.empty((), device=DEV)
        be.fused_residual_rmsnorm_forward(res, out, rstd, a, b, w, 1e-6, absmax=amax)
        outs[name] = (res, out, rstd, amax)
    res, out, rstd, amax = outs["tri"]
    assert torch.equal(res, outs["ref"][0])
    assert_close(out, outs["ref"][1], TOL[dtype], "rmsnorm out")
    assert_close(rstd, outs["ref"][2], 1e-5, "rstd")
    assert amax.item() == out.float().abs().max().item()
    out2, rstd2, amax2 = torch.empty_like(out), torch.empty_like(rstd), torch.empty_like(amax)
    tri.rmsnorm_forward(out2, rstd2, res, w, 1e-6, absmax=amax2)
    assert torch.equal(out2, out) and torch.equal(rstd2, rstd) and torch.equal(amax2, amax), \
        "rmsnorm_forward(residual) must reproduce the fused kernel bit for bit (recompute)"
    dout = randn(N, C, seed=4, dtype=dtype)
    grads = {}
    for name, be in (("tri", tri), ("ref", ref)):
        dres = randn(N, C, seed=5, dtype=dtype)
        dw = torch.zeros(C, dtype=dtype, device=DEV)
        damax = torch.empty((), device=DEV)
        be.rmsnorm_backward(dres, dw, dout, res, w, rstd, dresidual=dres, absmax=damax)
        grads[name] = (dres, dw)
        assert damax.item() == dres.float().abs().max().item() > 0, f"{name}: fused max|dinp|"
    assert_close(grads["tri"][0], grads["ref"][0], TOL[dtype], "rmsnorm dinp")
    assert_close(grads["tri"][1], grads["ref"][1], TOL[dtype], "rmsnorm dweight")
    dw_again = torch.zeros(C, dtype=dtype, device=DEV)
    tri.rmsnorm_backward(torch.empty_like(dout), dw_again, dout, res, w, rstd)
    dw_twice = dw_again.clone()
    tri.rmsnorm_backward(torch.empty_like(dout), dw_twice, dout, res, w, rstd)
    assert torch.equal(dw_twice, (dw_again.float() * 2).to(dtype)) or dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope(tri, ref, dtype):
    b, t = 16, 1024
    qkv = randn(b, t, HQ + 2 * HKV, D, seed=6, dtype=dtype)
    inv = 1e6 ** (-torch.arange(0, D // 2, dtype=torch.float32) / (D // 2))
    ang = torch.arange(t, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = ang.cos().to(DEV), ang.sin().to(DEV)
    for op in ("rope_forward", "rope_backward"):
        x, y = qkv.clone(), qkv.clone()
        getattr(tri, op)(x, cos, sin, HQ, HKV)
        getattr(ref, op)(y, cos, sin, HQ, HKV)
        assert_close(x, y, TOL[dtype], op)
        assert torch.equal(x[:, :, HQ + HKV:], qkv[:, :, HQ + HKV:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu(tri, ref, dtype):
    inp = randn(N, 2 * I, seed=7, dtype=dtype, scale=2.0)
    dout = randn(N, I, seed=8, dtype=dtype)
    res = {}
    for name, be in (("tri", tri), ("ref", ref)):
        out, amax = torch.empty(N, I, dtype=dtype, device=DEV), torch.empty((), device=DEV)
        be.swiglu_forward(out, inp, absmax=amax)
        dinp = torch.empty(N, 2 * I, dtype=dtype, device=DEV)
        damax = torch.empty((), device=DEV)
        be.swiglu_backward(dinp, dout, inp, absmax=damax)
        res[name] = (out, amax, dinp, damax)
    assert_close(res["tri"][0], res["ref"][0], TOL[dtype], "swiglu out")
    assert res["tri"][1].item() == res["tri"][0].float().abs().max().item()
    assert res["tri"][3].item() == res["tri"][2].float().abs().max().item() > 0  # fused absmax of dinp, exact
    assert_close(res["tri"][2], res["ref"][2], TOL[dtype], "swiglu dinp")


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_classifier_full_vocab(tri, ref, dtype):
    n = 1024
    logits = randn(n, V, seed=9, dtype=dtype, scale=4.0)
    targets = torch.randint(0, V, (n,), device=DEV)
    targets[::7] = -100
    res = {}
    for name, be in (("tri", tri), ("ref", ref)):
        lg, losses = logits.clone(), torch.empty(n, device=DEV)
        be.fused_classifier(lg, losses, targets, dloss=1.0 / 900, write_dlogits=True)
        res[name] = (lg, losses)
    assert_close(res["tri"][1], res["ref"][1], 1e-5, "losses")
    assert_close(res["tri"][0], res["ref"][0], TOL[dtype], "dlogits")
    assert (res["tri"][0][::7] == 0).all() and (res["tri"][1][::7] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_backward_deterministic(tri, ref, dtype):
    # Zipf-like token frequencies: a few tokens repeat thousands of times, as in real text
    g = torch.Generator(device="cpu").manual_seed(10)
    ranks = torch.multinomial(1.0 / torch.arange(1, 5001, dtype=torch.float64), N, replacement=True, generator=g)
    tokens = (ranks * 29 % V).to(DEV)
    table = randn(V, C, seed=11, dtype=dtype)
    out, out_ref = torch.empty(N, C, dtype=dtype, device=DEV), torch.empty(N, C, dtype=dtype, device=DEV)
    tri.embedding_forward(out, tokens, table)
    ref.embedding_forward(out_ref, tokens, table)
    assert torch.equal(out, out_ref)
    dout = randn(N, C, seed=12, dtype=dtype)
    d1, d2, dr = (torch.zeros(V, C, dtype=dtype, device=DEV) for _ in range(3))
    tri.embedding_backward(d1, tokens, dout)
    tri.embedding_backward(d2, tokens, dout)
    ref.embedding_backward(dr, tokens, dout)
    assert torch.equal(d1, d2)
    assert_close(d1, dr, TOL[dtype], "embedding dtable")


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_quantize_bit_exact(tri, ref, fp8, dtype):
    g = torch.Generator(device=DEV).manual_seed(13)
    x = (torch.randn(N, C, generator=g, device=DEV)
         * torch.exp2(torch.randint(-16, 4, (N, C), generator=g, device=DEV).float())).to(dtype)
    amax, amax_ref = torch.empty((), device=DEV), torch.empty((), device=DEV)
    tri.absmax(amax, x)
    ref.absmax(amax_ref, x)
    assert torch.equal(amax, amax_ref)
    for a in (amax, amax * 53.0):
        q, qr = torch.empty(N, C, dtype=fp8, device=DEV), torch.empty(N, C, dtype=fp8, device=DEV)
        ds, dsr = torch.empty((), device=DEV), torch.empty((), device=DEV)
        tri.quantize(q, ds, x, a)
        ref.quantize(qr, dsr, x, a)
        assert torch.equal(ds, dsr)
        bad = (q.view(torch.uint8) != qr.view(torch.uint8)).sum().item()
        assert bad == 0, f"{bad} FP8 values differ from torch's cast"
        qt, qtr = torch.empty(C, N, dtype=fp8, device=DEV), torch.empty(C, N, dtype=fp8, device=DEV)
        tri.quantize_transpose(qt, ds, x, a)
        ref.quantize_transpose(qtr, dsr, x, a)
        assert torch.equal(qt.view(torch.uint8), qtr.view(torch.uint8))


def test_adamw_and_norm(tri, ref):
    n = 10_000_019
    p, gr = randn(n, seed=14, scale=0.05), randn(n, seed=15, scale=1e-3)
    m, v = randn(n, seed=16, scale=1e-4), randn(n, seed=17, scale=1e-3) ** 2
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=3, seed=5)
    out = {}
    for name, be in (("tri", tri), ("ref", ref)):
        s = [t.clone() for t in (p, gr, m, v)]
        be.adamw_update(s[0], s[1], s[2], s[3], master=None, grad_scale=torch.tensor(0.5, device=DEV), **kw)
        out[name] = s
    for i, what in ((0, "param"), (2, "m"), (3, "v")):
        assert_close(out["tri"][i], out["ref"][i], 1e-6, f"adamw fp32 {what}")
    # bf16 m/v/param with fp32 master: reproducible, master close to the reference
    runs = []
    for _ in range(2):
        s = dict(param=p.to(torch.bfloat16), m=m.to(torch.bfloat16), v=v.to(torch.bfloat16), master=p.clone())
        tri.adamw_update(s["param"], gr.to(torch.bfloat16), s["m"], s["v"], master=s["master"], grad_scale=0.5,
                         **kw)
        runs.append(s)
    for k in runs[0]:
        assert torch.equal(runs[0][k], runs[1][k]), k
    nrm, nrm_ref = torch.zeros((), device=DEV), torch.zeros((), device=DEV)
    tri.global_norm_squared(nrm, gr)
    ref.global_norm_squared(nrm_ref, gr)
    assert_close(nrm, nrm_ref, 1e-5, "global norm^2")


def test_stochastic_round_unbiased(tri):
    n = 1 << 22
    x = randn(n, seed=18) * 5
    out = torch.empty(n, dtype=torch.bfloat16, device=DEV)
    tri.stochastic_round(out, x, seed=1)
    bias = (out.double() - x.double()).mean().item()
    spread = (out.double() - x.double()).abs().mean().item()
    assert abs(bias) < 0.01 * spread, (bias, spread)
    again = torch.empty_like(out)
    tri.stochastic_round(again, x, seed=1)
    assert torch.equal(out, again)


# ---------------------------------------------------------------------------------------------- whole model
def _model_grads(cfg, backend_name, b, t, dtype):
    from llmq_ray.model import LlamaModel
    from llmq_ray.params import init_params

    be = get_backend(backend_name, DEV)
    model = LlamaModel(cfg, be, batch_size=b, seq_len=t, dtype=dtype)
    flat = torch.zeros(model.layout.numel, dtype=torch.float32)
    init_params(model.layout, flat, seed=3)
    views = model.layout.views(flat)
    gen = torch.Generator().manual_seed(4)
    for name, view in views.items():
        if name.endswith(("ln1_w", "ln2_w", "final_norm")):
            view.add_(0.1 * torch.randn(view.shape, generator=gen))
    model.params[:model.layout.numel].copy_(flat.to(dtype))
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, cfg.vocab_size, (b, t + 1), generator=g)
    inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    targets[0, :5] = -100
    model.zero_grads()
    model.forward_backward(inputs.to(DEV), targets.to(DEV))
    torch.cuda.synchronize()
    loss = (model.loss_sum / model.target_count).item()
    return loss, {k: v.float().clone() for k, v in model.layout.views(model.grads).items()}


def _configs():
    from llmq_ray.config import PRESETS

    mid = dataclasses.replace(PRESETS["Qwen2.5-0.5B"], num_layers=4, name="qwen0.5b-4layers")
    return [("tiny", PRESETS["tiny"], 4, 128), ("mid", mid, 4, 512)]


@pytest.mark.parametrize("which", ["tiny", "mid"])
def test_whole_model_gradients_triton_vs_torch_bf16(which):
    name, cfg, b, t = next(c for c in _configs() if c[0] == which)
    loss_t, g_t = _model_grads(cfg, "triton", b, t, torch.bfloat16)
    loss_r, g_r = _model_grads(cfg, "torch", b, t, torch.bfloat16)
    assert abs(loss_t - loss_r) / loss_r < 1e-2, (loss_t, loss_r)
    worst = 1.0
    for k, ref in g_r.items():
        a, r = g_t[k].double().flatten(), ref.double().flatten()
        cos = (a @ r / (a.norm() * r.norm()).clamp_min(1e-30)).item()
        worst = min(worst, cos)
        assert cos >= 0.99, f"{which}: {k} gradient cosine {cos:.5f}"
    print(f"  {which}: loss triton {loss_t:.5f} torch {loss_r:.5f}, worst gradient cosine {worst:.6f}")


# ---------------------------------------------------------------------------------------------- timings
def _time(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def test_print_kernel_timings(tri, ref):
    """Not an assertion: a table of triton vs torch-reference times at 0.5B shapes (bf16, N = 16k rows)."""
    bf = torch.bfloat16
    x, y, w = randn(N, C, seed=1, dtype=bf), randn(N, C, seed=2, dtype=bf), (1 + 0.1 * randn(C)).to(bf)
    res, out, rstd, amax = torch.empty_like(x), torch.empty_like(x), torch.empty(N, device=DEV), torch.empty((), device=DEV)
    dw = torch.zeros(C, dtype=bf, device=DEV)
    ug, sw = randn(N, 2 * I, seed=3, dtype=bf), torch.empty(N, I, dtype=bf, device=DEV)
    dug = torch.empty_like(ug)
    qkv = randn(16, 1024, HQ + 2 * HKV, D, seed=4, dtype=bf)
    cos, sin = torch.rand(1024, D // 2, device=DEV), torch.rand(1024, D // 2, device=DEV)
    logits = randn(2048, V, seed=5, dtype=bf)
    targets = torch.randint(0, V, (2048,), device=DEV)
    losses = torch.empty(2048, device=DEV)
    q8 = torch.empty(N, C, dtype=torch.float8_e4m3fn, device=DEV)
    ds = torch.empty((), device=DEV)
    tokens = torch.randint(0, V, (N,), device=DEV)
    dtab = torch.zeros(V, C, dtype=bf, device=DEV)
    n_opt = 50_000_000
    pp, gg, mm, vv = (randn(n_opt, seed=s, scale=1e-2) for s in range(6, 10))
    cases = {
        "fused_residual_rmsnorm+absmax": lambda be: be.fused_residual_rmsnorm_forward(res, out, rstd, x, y, w, 1e-6, absmax=amax),
        "rmsnorm_backward": lambda be: be.rmsnorm_backward(out, dw, x, y, w, rstd, dresidual=out),
        "swiglu_forward+absmax": lambda be: be.swiglu_forward(sw, ug, absmax=amax),
        "swiglu_backward": lambda be: be.swiglu_backward(dug, sw, ug),
        "rope_forward": lambda be: be.rope_forward(qkv, cos, sin, HQ, HKV),
        "fused_classifier 2048xV": lambda be: be.fused_classifier(logits, losses, targets, 1.0, write_dlogits=False),
        "quantize e4m3": lambda be: be.quantize(q8, ds, x, amax),
        "embedding_backward": lambda be: be.embedding_backward(dtab, tokens, x),
        "adamw fp32 50M": lambda be: be.adamw_update(pp, gg, mm, vv, master=None, lr=1e-9, beta1=0.9, beta2=0.95,
                                                     eps=1e-8, weight_decay=0.0, step=1, grad_scale=1.0, seed=0),
    }
    print(f"\n  {'kernel':34s} {'triton ms':>10s} {'torch ms':>10s}")
    for name, fn in cases.items():
        print(f"  {name:34s} {_time(lambda: fn(tri)):10.3f} {_time(lambda: fn(ref)):10.3f}")
