"""Checks shared by the GPU tests of the fast backends (test_triton_gpu.py, test_cupy_gpu.py, test_fp8_gpu.py).

Each ``check_*`` runs one kernel family of a fast backend against the torch reference at realistic shapes
(Qwen2.5-0.5B-like: N = 16k rows, C = 896, I = 4864, V = 151936, 14/2 heads of 64) and asserts the common
contract: fp32 outputs within 1e-5 of the reference (relative to the tensor's max magnitude), bf16 within
1e-2, FP8 bytes equal to torch's casts at the same scale, deterministic reductions bit-identical run to run.
Not a test module itself (no ``test_`` prefix): the test files call these with their backend.
"""

from __future__ import annotations

import dataclasses

import torch

from _helpers import bf16_stochastic_neighbours, perturb_norms_and_biases, train_settings

DEV = "cuda"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.bfloat16]
N, C, I, V = 16 * 1024, 896, 4864, 151936
HQ, HKV, D = 14, 2, 64


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


# ---------------------------------------------------------------------------------------------- kernels
def check_rmsnorm_fused_and_backward(fast, ref, dtype):
    a, b = randn(N, C, seed=1, dtype=dtype), randn(N, C, seed=2, dtype=dtype)
    w = (1 + 0.2 * randn(C, seed=3)).to(dtype)
    outs = {}
    for name, be in (("fast", fast), ("ref", ref)):
        res, out = torch.empty(N, C, dtype=dtype, device=DEV), torch.empty(N, C, dtype=dtype, device=DEV)
        rstd, amax = torch.empty(N, device=DEV), torch.empty((), device=DEV)
        be.fused_residual_rmsnorm_forward(res, out, rstd, a, b, w, 1e-6, absmax=amax)
        outs[name] = (res, out, rstd, amax)
    res, out, rstd, amax = outs["fast"]
    assert torch.equal(res, outs["ref"][0])
    assert_close(out, outs["ref"][1], TOL[dtype], "rmsnorm out")
    assert_close(rstd, outs["ref"][2], 1e-5, "rstd")
    assert amax.item() == out.float().abs().max().item()
    out2, rstd2, amax2 = torch.empty_like(out), torch.empty_like(rstd), torch.empty_like(amax)
    fast.rmsnorm_forward(out2, rstd2, res, w, 1e-6, absmax=amax2)
    assert torch.equal(out2, out) and torch.equal(rstd2, rstd) and torch.equal(amax2, amax), \
        "rmsnorm_forward(residual) must reproduce the fused kernel bit for bit (recompute)"
    dout = randn(N, C, seed=4, dtype=dtype)
    grads = {}
    for name, be in (("fast", fast), ("ref", ref)):
        dres = randn(N, C, seed=5, dtype=dtype)
        dw = torch.zeros(C, dtype=dtype, device=DEV)
        damax = torch.empty((), device=DEV)
        be.rmsnorm_backward(dres, dw, dout, res, w, rstd, dresidual=dres, absmax=damax)
        grads[name] = (dres, dw)
        assert damax.item() == dres.float().abs().max().item() > 0, f"{name}: fused max|dinp|"
    assert_close(grads["fast"][0], grads["ref"][0], TOL[dtype], "rmsnorm dinp")
    assert_close(grads["fast"][1], grads["ref"][1], TOL[dtype], "rmsnorm dweight")
    dw_again = torch.zeros(C, dtype=dtype, device=DEV)
    fast.rmsnorm_backward(torch.empty_like(dout), dw_again, dout, res, w, rstd)
    dw_twice = dw_again.clone()
    fast.rmsnorm_backward(torch.empty_like(dout), dw_twice, dout, res, w, rstd)
    assert torch.equal(dw_twice, (dw_again.float() * 2).to(dtype)) or dtype == torch.bfloat16


def check_rope(fast, ref, dtype):
    b, t = 16, 1024
    qkv = randn(b, t, HQ + 2 * HKV, D, seed=6, dtype=dtype)
    inv = 1e6 ** (-torch.arange(0, D // 2, dtype=torch.float32) / (D // 2))
    ang = torch.arange(t, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = ang.cos().to(DEV), ang.sin().to(DEV)
    for op in ("rope_forward", "rope_backward"):
        x, y = qkv.clone(), qkv.clone()
        getattr(fast, op)(x, cos, sin, HQ, HKV)
        getattr(ref, op)(y, cos, sin, HQ, HKV)
        assert_close(x, y, TOL[dtype], op)
        assert torch.equal(x[:, :, HQ + HKV:], qkv[:, :, HQ + HKV:])


def check_rope_backward_from_cudnn_parts(fast, ref):
    """bf16, B=16 x T=1024: cuDNN's dq/dk/dv (through ``attention_rope_backward``) placed and un-rotated by
    the fast backend's one-pass kernel vs the reference's copy-then-rotate; v must be bit-equal."""
    b, t = 16, 1024
    dtype = torch.bfloat16
    qkv = randn(b, t, HQ + 2 * HKV, D, seed=31, dtype=dtype)
    dout = randn(b, t, HQ, D, seed=32, dtype=dtype)
    inv = 1e6 ** (-torch.arange(0, D // 2, dtype=torch.float32) / (D // 2))
    ang = torch.arange(t, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = ang.cos().to(DEV), ang.sin().to(DEV)
    out = torch.empty(b, t, HQ, D, dtype=dtype, device=DEV)
    lse = torch.empty(b, HQ, t, dtype=torch.float32, device=DEV)
    ref.attention_forward(out, lse, qkv, HQ, HKV)
    got, want = torch.full_like(qkv, float("nan")), torch.full_like(qkv, float("nan"))
    fast.attention_rope_backward(got, dout, out, lse, qkv, cos, sin, HQ, HKV)
    ref.attention_backward(want, dout, out, lse, qkv, HQ, HKV)
    ref.rope_backward(want, cos, sin, HQ, HKV)
    assert not got.isnan().any()
    assert torch.equal(got[:, :, HQ + HKV:], want[:, :, HQ + HKV:])
    assert_close(got, want, TOL[dtype], "attention_rope_backward")

def check_deterministic_attention_backward(fast):
    """bf16, B=16 x T=1024 at 0.5B and 7B head shapes: the triton backend's own attention backward
    (--deterministic-attention) against the reference math in fp32 (tolerance bf16's), the same bits in three
    runs; and how often cuDNN's backward (the default) differs between runs of the same inputs."""
    from llmq_ray.backends import _aten_attention
    from llmq_ray.backends.triton import attention_bwd

    for b, hq, hkv, d in ((16, HQ, HKV, D), (4, 28, 4, 128)):
        t = 1024
        qkv = randn(b, t, hq + 2 * hkv, d, seed=41, dtype=torch.bfloat16)
        dout = randn(b, t, hq, d, seed=42, dtype=torch.bfloat16)
        out = torch.empty(b, t, hq, d, dtype=torch.bfloat16, device=DEV)
        lse = torch.empty(b, hq, t, dtype=torch.float32, device=DEV)
        _aten_attention.forward(out, lse, qkv, hq, hkv)
        runs = []
        for _ in range(3):
            got = torch.full_like(qkv, float("nan"))
            attention_bwd.attention_backward(got, dout, out, lse, qkv, hq, hkv)
            runs.append(got)
        assert not runs[0].isnan().any()
        assert all(torch.equal(r, runs[0]) for r in runs[1:]), (hq, hkv, d)
        math_ref = get_backend_plain()
        want = torch.empty(qkv.shape, dtype=torch.float32, device=DEV)
        math_ref.attention_backward(want, dout.float(), out.float(), lse, qkv.float(), hq, hkv)
        assert_close(runs[0], want, TOL[torch.bfloat16], f"deterministic attention backward {hq}/{hkv}/{d}")
        cudnn = [torch.empty_like(qkv) for _ in range(3)]
        for c in cudnn:
            _aten_attention.backward(c, dout, out, lse, qkv, hq, hkv)
        print(f"cuDNN backward, Hq={hq} Hkv={hkv} D={d}: {sum(not torch.equal(c, cudnn[0]) for c in cudnn[1:])} of 2 "
              f"repeats differ from the first")


def check_deterministic_attention_backward_fp32():
    """fp32 (--model-dtype fp32 --deterministic-attention): true fp32 products, not TF32 (Triton's default for
    fp32 dots on NVIDIA, ~1e-3 relative error), so within the fp32 tolerance of the plain reference math."""
    from llmq_ray.backends.triton import attention_bwd

    b, t, hq, hkv, d = 2, 256, HQ, HKV, D
    qkv = randn(b, t, hq + 2 * hkv, d, seed=43)
    dout = randn(b, t, hq, d, seed=44)
    ref = get_backend_plain()
    out = torch.empty(b, t, hq, d, device=DEV)
    lse = torch.empty(b, hq, t, device=DEV)
    ref.attention_forward(out, lse, qkv, hq, hkv)
    got = torch.full_like(qkv, float("nan"))
    attention_bwd.attention_backward(got, dout, out, lse, qkv, hq, hkv)
    want = torch.empty_like(qkv)
    ref.attention_backward(want, dout, out, lse, qkv, hq, hkv)
    assert_close(got, want, TOL[torch.float32], "deterministic attention backward fp32")


def get_backend_plain():
    """The torch reference with its plain math even on CUDA (no cuDNN): the fp32 ground truth."""
    from llmq_ray.backends import get_backend

    be = get_backend("torch", DEV)
    be.attention._aten = None
    return be


def check_swiglu(fast, ref, dtype):
    inp = randn(N, 2 * I, seed=7, dtype=dtype, scale=2.0)
    dout = randn(N, I, seed=8, dtype=dtype)
    res = {}
    for name, be in (("fast", fast), ("ref", ref)):
        out, amax = torch.empty(N, I, dtype=dtype, device=DEV), torch.empty((), device=DEV)
        be.swiglu_forward(out, inp, absmax=amax)
        dinp = torch.empty(N, 2 * I, dtype=dtype, device=DEV)
        damax = torch.empty((), device=DEV)
        be.swiglu_backward(dinp, dout, inp, absmax=damax)
        res[name] = (out, amax, dinp, damax)
    assert_close(res["fast"][0], res["ref"][0], TOL[dtype], "swiglu out")
    assert res["fast"][1].item() == res["fast"][0].float().abs().max().item()
    assert res["fast"][3].item() == res["fast"][2].float().abs().max().item() > 0  # fused max|dinp|, exact
    assert_close(res["fast"][2], res["ref"][2], TOL[dtype], "swiglu dinp")


def check_swiglu_backward_fp8(fast, fp8, n=N, i=I):
    """The two-pass FP8 SwiGLU backward (bf16): the same bytes, scale and absmax as swiglu_backward followed by
    quantize_with_transpose, at 0.5B shapes and at a ragged one (partial tiles on both axes)."""
    bf = torch.bfloat16
    inp, dout = randn(n, 2 * i, seed=42, dtype=bf, scale=2.0), randn(n, i, seed=43, dtype=bf)
    dinp, amax = torch.empty(n, 2 * i, dtype=bf, device=DEV), torch.zeros((), device=DEV)
    d = torch.zeros((), device=DEV)
    fast.swiglu_backward(dinp, dout, inp, absmax=amax)
    q_want, qt_want = torch.empty(n, 2 * i, dtype=fp8, device=DEV), torch.empty(2 * i, n, dtype=fp8, device=DEV)
    fast.quantize_with_transpose(q_want, qt_want, d, dinp, amax)
    q, qt = torch.empty_like(q_want), torch.empty_like(qt_want)
    amax2, d2 = torch.zeros((), device=DEV), torch.zeros((), device=DEV)
    fast.swiglu_backward_fp8(q, qt, d2, dout, inp, amax2, dinp)
    assert amax2.item() == amax.item() == dinp.float().abs().max().item() > 0 and torch.equal(d2, d)
    assert torch.equal(q.view(torch.uint8), q_want.view(torch.uint8)), "q differs"
    assert torch.equal(qt.view(torch.uint8), qt_want.view(torch.uint8)), "q^T differs"
    print(f"  swiglu_backward_fp8 {fp8} {n}x{i}: bytes, scale and absmax equal to backward + quantize")


def check_bias_backward(fast, ref, dtype):
    """dbias += dqkv.sum(0) with max|dqkv| (the QKV bias gradient: N rows x (HQ + 2 HKV) * D columns)."""
    c = (HQ + 2 * HKV) * D
    dout = randn(N, c, seed=40, dtype=dtype)
    db0 = randn(c, seed=41, dtype=dtype)
    res = {}
    for name, be in (("fast", fast), ("ref", ref)):
        db, amax = db0.clone(), torch.empty((), device=DEV)
        be.bias_backward(db, dout, absmax=amax)
        res[name] = (db, amax)
    want = (db0.double() + dout.double().sum(0)).to(dtype)
    assert_close(res["fast"][0], want, TOL[dtype], "dbias vs the fp64 sum")
    assert_close(res["fast"][0], res["ref"][0], TOL[dtype], "dbias vs torch_ref")
    assert res["fast"][1].item() == dout.float().abs().max().item() > 0  # max|dout|, exact


def check_fused_classifier_full_vocab(fast, ref, dtype):
    n = 1024
    logits = randn(n, V, seed=9, dtype=dtype, scale=4.0)
    targets = torch.randint(0, V, (n,), device=DEV)
    targets[::7] = -100
    res = {}
    for name, be in (("fast", fast), ("ref", ref)):
        lg, losses = logits.clone(), torch.empty(n, device=DEV)
        be.fused_classifier(lg, losses, targets, dloss=1.0 / 900, write_dlogits=True)
        res[name] = (lg, losses)
    assert_close(res["fast"][1], res["ref"][1], 1e-5, "losses")
    assert_close(res["fast"][0], res["ref"][0], TOL[dtype], "dlogits")
    assert (res["fast"][0][::7] == 0).all() and (res["fast"][1][::7] == 0).all()


def codes_agree(fast: torch.Tensor, ref: torch.Tensor, min_equal: float = 0.999) -> None:
    """FP8 tensors from kernels whose fp32 inputs may differ in the last bit (a GPU's fast exp against torch's):
    at least ``min_equal`` of the codes equal, the others one step apart (same sign, adjacent codes)."""
    a, b = fast.view(torch.uint8).int(), ref.view(torch.uint8).int()
    equal = (a == b).float().mean().item()
    assert equal >= min_equal, f"only {equal:.5f} of the FP8 codes equal the reference's"
    assert (a - b).abs().max().item() <= 1, "an FP8 code is more than one step from the reference's"


def check_fused_classifier_fp8_full_vocab(fast, ref, fp8):
    """The FP8 LM head's classifier at the real vocabulary (V = 151,936) against the torch reference at the same
    static scale: losses within 1e-5, codes per codes_agree, q^T exactly the transpose of q."""
    n = 512
    logits = randn(n, V, seed=9, dtype=torch.bfloat16, scale=4.0)
    targets = torch.randint(0, V, (n,), device=DEV)
    targets[::7] = -100
    res = {}
    for name, be in (("fast", fast), ("ref", ref)):
        lg, losses = logits.clone(), torch.empty(n, device=DEV)
        q, q_t = torch.empty(n, V, dtype=fp8, device=DEV), torch.empty(V, n, dtype=fp8, device=DEV)
        descale = torch.zeros((), device=DEV)
        be.fused_classifier_fp8(lg, losses, targets, q, q_t, descale, dloss=1.0)
        assert torch.equal(lg, logits)
        res[name] = (losses, q, q_t, descale)
    assert_close(res["fast"][0], res["ref"][0], 1e-5, "losses")
    assert res["fast"][3].item() == res["ref"][3].item()
    codes_agree(res["fast"][1], res["ref"][1])
    assert torch.equal(res["fast"][2].view(torch.uint8), res["fast"][1].view(torch.uint8).t().contiguous())
    assert (res["fast"][1][::7].float() == 0).all()


def check_embedding_backward_deterministic(fast, ref, dtype):
    # Zipf-like token frequencies: a few tokens repeat thousands of times, as in real text
    g = torch.Generator(device="cpu").manual_seed(10)
    ranks = torch.multinomial(1.0 / torch.arange(1, 5001, dtype=torch.float64), N, replacement=True, generator=g)
    tokens = (ranks * 29 % V).to(DEV)
    table = randn(V, C, seed=11, dtype=dtype)
    out, out_ref = torch.empty(N, C, dtype=dtype, device=DEV), torch.empty(N, C, dtype=dtype, device=DEV)
    fast.embedding_forward(out, tokens, table)
    ref.embedding_forward(out_ref, tokens, table)
    assert torch.equal(out, out_ref)
    dout = randn(N, C, seed=12, dtype=dtype)
    d1, d2, dr = (torch.zeros(V, C, dtype=dtype, device=DEV) for _ in range(3))
    fast.embedding_backward(d1, tokens, dout)
    fast.embedding_backward(d2, tokens, dout)
    ref.embedding_backward(dr, tokens, dout)
    assert torch.equal(d1, d2)
    assert_close(d1, dr, TOL[dtype], "embedding dtable")


def fp8_test_input(dtype, m=N, k=C, seed=13):
    """Values over ~20 binades (so FP8 subnormals, normals and saturation all occur at the scales used)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(m, k, generator=g, device=DEV)
            * torch.exp2(torch.randint(-16, 4, (m, k), generator=g, device=DEV).float())).to(dtype)


def check_fp8_quantize_bit_exact(fast, ref, fp8, dtype, m=N, k=C):
    x = fp8_test_input(dtype, m, k)
    amax, amax_ref = torch.empty((), device=DEV), torch.empty((), device=DEV)
    fast.absmax(amax, x)
    ref.absmax(amax_ref, x)
    assert torch.equal(amax, amax_ref)
    for a in (amax, amax * 53.0):
        q, qr = torch.empty(m, k, dtype=fp8, device=DEV), torch.empty(m, k, dtype=fp8, device=DEV)
        ds, dsr = torch.empty((), device=DEV), torch.empty((), device=DEV)
        fast.quantize(q, ds, x, a)
        ref.quantize(qr, dsr, x, a)
        assert torch.equal(ds, dsr)
        bad = (q.view(torch.uint8) != qr.view(torch.uint8)).sum().item()
        assert bad == 0, f"{bad} FP8 values differ from torch's cast"
        qt, qtr = torch.empty(k, m, dtype=fp8, device=DEV), torch.empty(k, m, dtype=fp8, device=DEV)
        fast.quantize_transpose(qt, ds, x, a)
        ref.quantize_transpose(qtr, dsr, x, a)
        assert torch.equal(qt.view(torch.uint8), qtr.view(torch.uint8))
        q2, qt2 = torch.empty_like(q), torch.empty_like(qt)
        fast.quantize_with_transpose(q2, qt2, ds, x, a)
        assert torch.equal(q2.view(torch.uint8), qr.view(torch.uint8))
        assert torch.equal(qt2.view(torch.uint8), qtr.view(torch.uint8))


def check_adamw_and_norm(fast, ref):
    n = 10_000_019
    p, gr = randn(n, seed=14, scale=0.05), randn(n, seed=15, scale=1e-3)
    m, v = randn(n, seed=16, scale=1e-4), randn(n, seed=17, scale=1e-3) ** 2
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=3, seed=5)
    out = {}
    for name, be in (("fast", fast), ("ref", ref)):
        s = [t.clone() for t in (p, gr, m, v)]
        be.adamw_update(s[0], s[1], s[2], s[3], master=None, grad_scale=torch.tensor(0.5, device=DEV), **kw)
        out[name] = s
    for i, what in ((0, "param"), (2, "m"), (3, "v")):
        assert_close(out["fast"][i], out["ref"][i], 1e-6, f"adamw fp32 {what}")
    # bf16 m/v/param with fp32 master: reproducible, master close to the reference, param = master rounded to
    # nearest, m and v one of the two stochastic-rounding neighbours of the reference's fp32 result
    runs = []
    for _ in range(2):
        s = dict(param=p.to(torch.bfloat16), m=m.to(torch.bfloat16), v=v.to(torch.bfloat16), master=p.clone())
        fast.adamw_update(s["param"], gr.to(torch.bfloat16), s["m"], s["v"], master=s["master"], grad_scale=0.5,
                          **kw)
        runs.append(s)
    for k in runs[0]:
        assert torch.equal(runs[0][k], runs[1][k]), k
    want = dict(param=p.clone(), m=m.to(torch.bfloat16).float(), v=v.to(torch.bfloat16).float())
    ref.adamw_update(want["param"], gr.to(torch.bfloat16).float(), want["m"], want["v"], master=None,
                     grad_scale=torch.tensor(0.5, device=DEV), **kw)
    got = runs[0]
    assert_close(got["master"], want["param"], 1e-6, "adamw bf16 states: master (fp32)")
    assert torch.equal(got["param"], got["master"].to(torch.bfloat16)), "param = master rounded to nearest"
    assert bf16_stochastic_neighbours(got["m"], want["m"]), "m is not a stochastic rounding of the reference"
    assert bf16_stochastic_neighbours(got["v"], want["v"]), "v is not a stochastic rounding of the reference"
    nrm, nrm_ref = torch.zeros((), device=DEV), torch.zeros((), device=DEV)
    fast.global_norm_squared(nrm, gr)
    ref.global_norm_squared(nrm_ref, gr)
    assert_close(nrm, nrm_ref, 1e-5, "global norm^2")


def check_stochastic_round_unbiased(fast):
    n = 1 << 22
    x = randn(n, seed=18) * 5
    out = torch.empty(n, dtype=torch.bfloat16, device=DEV)
    fast.stochastic_round(out, x, seed=1)
    bias = (out.double() - x.double()).mean().item()
    spread = (out.double() - x.double()).abs().mean().item()
    assert abs(bias) < 0.01 * spread, (bias, spread)
    again = torch.empty_like(out)
    fast.stochastic_round(again, x, seed=1)
    assert torch.equal(out, again)


# ---------------------------------------------------------------------------------------------- whole model
def model_grads(cfg, backend_name, b, t, dtype):
    from llmq_ray.backends import get_backend
    from llmq_ray.model import build_model
    from llmq_ray.model.params import init_params

    be = get_backend(backend_name, DEV)
    model = build_model(cfg, be, batch=b, seq=t, dtype=dtype)
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


def model_configs():
    from llmq_ray.model.config import PRESETS

    mid = dataclasses.replace(PRESETS["Qwen2.5-0.5B"], num_layers=4, name="qwen0.5b-4layers")
    return [("tiny", PRESETS["tiny"], 4, 128), ("mid", mid, 4, 512),
            ("tiny-qwen3", PRESETS["tiny-qwen3"], 4, 128),  # QK-norm on, head_dim != hidden / heads
            ("tiny-gpt2", PRESETS["tiny-gpt2"], 4, 128)]  # LayerNorm with bias, GELU-tanh, learned positions


def check_whole_model_gradients_bf16(backend_name, which):
    """bf16 loss within 1% and every parameter's gradient with cosine >= 0.99 against the torch backend's."""
    name, cfg, b, t = next(c for c in model_configs() if c[0] == which)
    loss_t, g_t = model_grads(cfg, backend_name, b, t, torch.bfloat16)
    loss_r, g_r = model_grads(cfg, "torch", b, t, torch.bfloat16)
    assert abs(loss_t - loss_r) / loss_r < 1e-2, (loss_t, loss_r)
    worst = 1.0
    for k, ref in g_r.items():
        a, r = g_t[k].double().flatten(), ref.double().flatten()
        cos = (a @ r / (a.norm() * r.norm()).clamp_min(1e-30)).item()
        worst = min(worst, cos)
        assert cos >= 0.99, f"{which}: {k} gradient cosine {cos:.5f}"
    print(f"  {which}: loss {backend_name} {loss_t:.5f} torch {loss_r:.5f}, worst gradient cosine {worst:.6f}")


# ---------------------------------------------------------------------------------------------- FP8 model
def fp8_model_config():
    from llmq_ray.model.config import ModelConfig

    # FP8 GEMMs need every dimension a multiple of 16.
    return ModelConfig("qwen2", 512, 1408, 4, 8, 2, 4096, tie_word_embeddings=True, qkv_bias=True, name="fp8-gpu")


FP8_B, FP8_T = 4, 512


LAST_MODEL = {}  # fp8_run's last model, for checks of its state


def fp8_run(backend, matmul_dtype=None, gradient_dtype=None, lmhead_dtype=None, smooth_swiglu=False):
    """(summed loss, flat fp32 gradients) of one forward+backward of the FP8 test model in bf16 / FP8
    (``smooth_swiglu``: --fp8-smooth-swiglu)."""
    from llmq_ray.backends import get_backend
    from llmq_ray.model import build_model
    from llmq_ray.model.params import init_params

    cfg = fp8_model_config()
    model = build_model(cfg, get_backend(backend, "cuda"), batch=FP8_B, seq=FP8_T, dtype=torch.bfloat16,
                       block_dtype=matmul_dtype, grad_fp8=gradient_dtype, head_dtype=lmhead_dtype,
                       swiglu_scale="smooth" if smooth_swiglu else "current")
    init_params(model.layout, model.params, seed=11)
    perturb_norms_and_biases(model)
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, cfg.vocab_size, (FP8_B, FP8_T + 1), generator=gen)
    model.zero_grads()
    model.forward_backward(tokens[:, :-1], tokens[:, 1:])
    torch.cuda.synchronize()
    LAST_MODEL["model"] = model
    return model.loss_sum.item(), model.grads.float()


def cosine(a, b):
    a, b = a.double(), b.double()
    return (a @ b / (a.norm() * b.norm())).item()


def check_fp8_first_step_loss_within_one_percent_of_bf16(backend, gradient_dtype):
    loss16, g16 = fp8_run(backend)
    loss8, g8 = fp8_run(backend, "e4m3", gradient_dtype)
    assert abs(loss8 - loss16) / loss16 < 0.01, (loss8, loss16)
    cos = cosine(g8, g16)
    print(f"{backend} grad={gradient_dtype or 'e4m3'}: loss bf16 {loss16:.3f} fp8 {loss8:.3f}, grad cosine {cos:.5f}")
    assert cos >= 0.98


# ---------------------------------------------------------------------------------------------- timings
def time_cuda(fn, reps=20):
    """Mean milliseconds of ``fn`` over ``reps`` back-to-back calls (after one warm-up call)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def check_saturated_share(backend: str, device: str) -> None:
    """The FP8 monitor's saturated share under --fp8-delayed-swiglu-scale (``TrainEngine.monitor_take``). The
    first micro-step measures (current scales: nothing counted); the delayed scales are then halved by hand, and
    the second micro-step's count per layer must equal the number of 448s in torch's own float8 cast of that
    layer's SwiGLU output at the halved scale -- recomputed from the layer's kept up+gate GEMM output with the
    torch reference (the FP8 path keeps only the last layer's SwiGLU output) -- and be above 1 (more than the
    maximum itself went over the edge)."""
    from llmq_ray.backends import get_backend
    from llmq_ray.engine.train_engine import TrainEngine
    from llmq_ray.model.config import PRESETS

    cfg = PRESETS["tiny"]
    opts = train_settings(model="tiny", batch_size=2, seq_len=32, model_dtype="bf16", matmul_dtype="e4m3",
                        fp8_delayed_swiglu_scale=True, grad_accumulation=2, fp8_monitor_every=1)
    e = TrainEngine(cfg, opts, get_backend(backend, device))
    x = torch.randint(0, cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(5))
    e.monitor_begin()
    e.micro_step(x[:, :-1], x[:, 1:])
    assert e._monitor_elements == 0  # the first pass measured its own scales
    e.model.swiglu_out_amax.mul_(0.5)
    scales = e.model.swiglu_out_amax.clone()
    e.micro_step(x[:, :-1], x[:, 1:])
    want, ref = [], get_backend("torch", device)
    for layer in range(cfg.num_layers):
        up_gate = e.model.acts.get("up_gate", layer)
        out = torch.empty(up_gate.shape[0], cfg.intermediate_size, dtype=up_gate.dtype, device=up_gate.device)
        ref.swiglu_forward(out, up_gate)
        q = (out.float() * (448.0 / scales[layer])).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
        want.append(int((q.abs() == 448.0).sum()))
    e.update(1e-3, 1)
    taken = e.monitor_take()
    n = taken["saturated_elements"]
    assert n == 2 * 32 * cfg.intermediate_size
    assert [round(v * n) for v in taken["saturated_share"]] == want, (taken["saturated_share"], want)
    assert all(w > 1 for w in want)
