"""CuPy backend on a CUDA GPU, against the torch reference: the same checks as the Triton backend's
(kernel_checks.py: realistic 0.5B shapes, fp32 <= 1e-5 / bf16 <= 1e-2 relative error, FP8 bit-exact with
torch's casts, whole-model bf16 gradient cosine >= 0.99, e4m3 first-step loss within 1% of bf16), the Qwen3 QK-norm
and GPT-2 LayerNorm / GELU-tanh kernels against the torch defaults (qk_norm_checks.py, gpt2_checks.py, as the
Triton backend's), plus odd shapes that take the kernels' scalar (non-16-byte) paths, the software FP8
conversion, and a side stream.

Run on the GPU machine:  python3 -m pytest -m gpu tests/test_cupy_gpu.py -q -p no:cacheprovider -s
Skipped without CuPy or without a GPU CuPy can use.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")
try:
    _CUDA = torch.cuda.is_available() and bool(cupy.cuda.is_available())
except Exception:  # noqa: BLE001
    _CUDA = False
if not _CUDA:
    pytest.skip("needs a CUDA GPU that both torch and CuPy can use", allow_module_level=True)

import gpt2_checks  # noqa: E402
import kernel_checks as kc  # noqa: E402
import qk_norm_checks as qc  # noqa: E402
from llmq_ray.backends import get_backend  # noqa: E402
from llmq_ray.backends.cupy import _runtime as rt  # noqa: E402
from kernel_checks import DEV, DTYPES, TOL, assert_close, randn  # noqa: E402

FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.fixture(scope="module")
def cp():
    return get_backend("cupy", DEV)


@pytest.fixture(scope="module")
def ref():
    return get_backend("torch", DEV)


@pytest.fixture(scope="module")
def cp_soft_fp8():
    """The CuPy backend with its FP8 conversion forced to the software path (-DLLMQ_SOFT_FP8)."""
    be = get_backend("cupy", DEV)
    be.k = rt.Kernels(cupy, be.device, extra_options=("-DLLMQ_SOFT_FP8",))
    return be


def test_compiles_for_the_device_architecture(cp):
    major, minor = torch.cuda.get_device_capability()
    assert cp.k.arch == f"sm_{major}{minor}"
    seconds = cp.compile_all()
    print(f"  all modules ready in {seconds:.2f} s (CUPY_CACHE_DIR cold or warm)")


# ---------------------------------------------------------------------------------------------- 0.5B shapes
@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_fused_and_backward(cp, ref, dtype):
    kc.check_rmsnorm_fused_and_backward(cp, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope(cp, ref, dtype):
    kc.check_rope(cp, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu(cp, ref, dtype):
    kc.check_swiglu(cp, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_classifier_full_vocab(cp, ref, dtype):
    kc.check_fused_classifier_full_vocab(cp, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_backward_deterministic(cp, ref, dtype):
    kc.check_embedding_backward_deterministic(cp, ref, dtype)


@pytest.mark.parametrize("fp8", FP8_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_quantize_bit_exact(cp, ref, fp8, dtype):
    kc.check_fp8_quantize_bit_exact(cp, ref, fp8, dtype)


@pytest.mark.parametrize("fp8", FP8_DTYPES)
def test_fp8_software_conversion_bit_exact(cp_soft_fp8, ref, fp8):
    """The integer fp32 -> FP8 path (used below sm_89) gives the same bytes as the cvt instruction / torch."""
    kc.check_fp8_quantize_bit_exact(cp_soft_fp8, ref, fp8, torch.bfloat16, m=4096)


def test_adamw_and_norm(cp, ref):
    kc.check_adamw_and_norm(cp, ref)


def test_stochastic_round_unbiased(cp):
    kc.check_stochastic_round_unbiased(cp)


# ---------------------------------------------------------------------------------------------- Qwen3, GPT-2 ops
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_qwen3_shapes(cp, ref, dtype):
    """The QK-norm kernels (qk_norm.cu) at Qwen3-0.6B-like shapes (B*T = 4096, Hq = 16, Hkv = 8, D = 128) against
    the torch reference (tolerances in qk_norm_checks.py), then a timing line (bf16)."""
    qc.check_qk_norm(cp, ref, dtype, 2, 2048, 16, 8, 128, DEV)
    if dtype == torch.bfloat16:
        qc.time_qk_norm(cp, ref, 2, 2048, 16, 8, 128, DEV)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gpt2_layernorm_and_gelu_124m_shapes(cp, ref, dtype):
    """The LayerNorm (fused residual forward, backward with and without the residual gradient) and GELU-tanh
    kernels (layernorm.cu, gelu.cu) at GPT-2 124M shapes against the base class's torch defaults: every output, the
    absmax outputs exactly max|stored|, recompute and a second run bit-identical; then (bf16) a timing line per op
    (gpt2_checks.py)."""
    gpt2_checks.check_layernorm_and_gelu(cp, ref, dtype, label="cupy")


def test_torch_default_ops_are_overridden(cp):
    from llmq_ray.backends.base import TORCH_DEFAULT_OPS, Backend

    own = {op for op in TORCH_DEFAULT_OPS if getattr(type(cp), op) is not getattr(Backend, op)}
    assert own == set(TORCH_DEFAULT_OPS) - {"position_embedding_forward", "position_embedding_backward"}


@pytest.mark.parametrize("which", ["tiny", "mid", "tiny-qwen3", "tiny-gpt2"])
def test_whole_model_gradients_cupy_vs_torch_bf16(which):
    kc.check_whole_model_gradients_bf16("cupy", which)


@pytest.mark.parametrize("gradient_dtype", [None, "e5m2"])
def test_fp8_first_step_loss_within_one_percent_of_bf16(gradient_dtype):
    kc.check_fp8_first_step_loss_within_one_percent_of_bf16("cupy", gradient_dtype)


def test_cupy_fp8_gradients_follow_torch_fp8():
    _, g_torch = kc.fp8_run("torch", "e4m3")
    _, g_cupy = kc.fp8_run("cupy", "e4m3")
    assert kc.cosine(g_cupy, g_torch) >= 0.99


# ---------------------------------------------------------------------------------------------- odd shapes
@pytest.mark.parametrize("dtype", DTYPES)
def test_odd_shapes_take_the_scalar_paths(cp, ref, dtype):
    """Rows that are not 16-byte multiples and unaligned views: every kernel's VEC = 1 variant."""
    n, c, i, v = 37, 100, 99, 1001
    a, b = randn(n, c, seed=1, dtype=dtype), randn(n, c, seed=2, dtype=dtype)
    w = (1 + 0.2 * randn(c, seed=3)).to(dtype)
    res = {}
    for name, be in (("cp", cp), ("ref", ref)):
        r, o, rs, am = (torch.empty(n, c, dtype=dtype, device=DEV), torch.empty(n, c, dtype=dtype, device=DEV),
                        torch.empty(n, device=DEV), torch.empty((), device=DEV))
        be.fused_residual_rmsnorm_forward(r, o, rs, a, b, w, 1e-6, absmax=am)
        dx, dw = torch.empty(n, c, dtype=dtype, device=DEV), torch.zeros(c, dtype=dtype, device=DEV)
        be.rmsnorm_backward(dx, dw, a, r, w, rs)
        res[name] = (r, o, rs, dx, dw)
    assert torch.equal(res["cp"][0], res["ref"][0])
    for k, what in ((1, "out"), (2, "rstd"), (3, "dinp"), (4, "dweight")):
        assert_close(res["cp"][k], res["ref"][k], TOL[dtype] if k != 2 else 1e-5, f"rmsnorm {what}")

    ug, dout = randn(n, 2 * i, seed=4, dtype=dtype, scale=2.0), randn(n, i, seed=5, dtype=dtype)
    sw = {}
    for name, be in (("cp", cp), ("ref", ref)):
        o, am, d = torch.empty(n, i, dtype=dtype, device=DEV), torch.empty((), device=DEV), torch.empty_like(ug)
        be.swiglu_forward(o, ug, absmax=am)
        be.swiglu_backward(d, dout, ug)
        sw[name] = (o, am, d)
    assert_close(sw["cp"][0], sw["ref"][0], TOL[dtype], "swiglu out")
    assert sw["cp"][1].item() == sw["cp"][0].float().abs().max().item()
    assert_close(sw["cp"][2], sw["ref"][2], TOL[dtype], "swiglu dinp")

    qkv = randn(2, 7, 6 + 2 * 2, 20, seed=6, dtype=dtype)  # head dim 20: half = 10, no 16-byte vectors
    ang = torch.arange(7.0)[:, None] * (1e4 ** (-torch.arange(10) / 10))[None, :]
    cos, sin = ang.cos().to(DEV), ang.sin().to(DEV)
    for op in ("rope_forward", "rope_backward"):
        x, y = qkv.clone(), qkv.clone()
        getattr(cp, op)(x, cos, sin, 6, 2)
        getattr(ref, op)(y, cos, sin, 6, 2)
        assert_close(x, y, TOL[dtype], op)

    logits = randn(n, v, seed=7, dtype=dtype, scale=3.0)
    targets = torch.randint(0, v, (n,), device=DEV, dtype=torch.int32)
    targets[3] = -100
    lc, lr, losses_c, losses_r = logits.clone(), logits.clone(), torch.empty(n, device=DEV), torch.empty(n, device=DEV)
    cp.fused_classifier(lc, losses_c, targets, 0.5)
    ref.fused_classifier(lr, losses_r, targets.long(), 0.5)
    assert_close(losses_c, losses_r, 1e-5, "losses")
    assert_close(lc, lr, TOL[dtype], "dlogits")

    tokens = torch.randint(0, 50, (n,), device=DEV, dtype=torch.int32)
    table = randn(50, c, seed=8, dtype=dtype)
    e1, e2 = torch.empty(n, c, dtype=dtype, device=DEV), torch.empty(n, c, dtype=dtype, device=DEV)
    cp.embedding_forward(e1, tokens, table)
    ref.embedding_forward(e2, tokens, table)
    assert torch.equal(e1, e2)
    d1, d2 = torch.zeros(50, c, dtype=dtype, device=DEV), torch.zeros(50, c, dtype=dtype, device=DEV)
    cp.embedding_backward(d1, tokens, a)
    ref.embedding_backward(d2, tokens, a)
    assert_close(d1, d2, TOL[dtype], "embedding dtable")

    flat = randn(1001, seed=9, dtype=dtype)[1:]  # 1000 elements at an address that is not 16-byte aligned
    am_c, am_r = torch.empty((), device=DEV), torch.empty((), device=DEV)
    cp.absmax(am_c, flat)
    ref.absmax(am_r, flat)
    assert torch.equal(am_c, am_r)
    n_c, n_r = torch.zeros((), device=DEV), torch.zeros((), device=DEV)
    cp.global_norm_squared(n_c, flat)
    ref.global_norm_squared(n_r, flat)
    assert_close(n_c, n_r, 1e-5, "global norm^2 (unaligned)")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,t,hq,hkv,d", [(2, 7, 6, 2, 30),    # D = 30: one vector of one element per lane, K = 1
                                          (3, 5, 4, 1, 102),   # D = 102: K = 4 scalars per lane (the last one on 6 lanes)
                                          (1, 33, 3, 3, 20)])  # D = 20: fp32 takes float4 (G = 8 lanes), bf16 scalars
def test_qk_norm_odd_head_dims(cp, ref, dtype, b, t, hq, hkv, d):
    """Head dims that are not multiples of 8 (bf16) or 4 (fp32): qk_norm.cu's scalar (VEC = 1) variants, partial
    lane groups and a block's last, partly empty, row group; checked as at the Qwen3 shapes."""
    if d % rt.VEC[dtype] == 0:
        assert d == 20 and dtype == torch.float32
    qc.check_qk_norm(cp, ref, dtype, b, t, hq, hkv, d, DEV)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,c,i", [(37, 102, 99),     # C % 4 != 0, N*I odd: the scalar variants of every kernel
                                   (301, 1030, 77)])  # a longer scalar row: K = 8, 160 threads a row
def test_gpt2_layernorm_and_gelu_odd_shapes(cp, ref, dtype, n, c, i):
    """layernorm.cu and gelu.cu on rows that are not 16-byte multiples (VEC = 1; C = 102: 8 rows a block, the
    last block partly empty), checked as at the 124M shapes."""
    assert c % rt.VEC[dtype] and (n * i) % rt.VEC[dtype]
    gpt2_checks.check_layernorm_and_gelu(cp, ref, dtype, n=n, c=c, i=i, timings=False)


@pytest.mark.parametrize("fp8", FP8_DTYPES)
def test_fp8_odd_shapes_bit_exact(cp, ref, fp8):
    """k % 8 != 0 (scalar loads), m % 16 != 0 (byte stores of the transpose), partial tiles."""
    kc.check_fp8_quantize_bit_exact(cp, ref, fp8, torch.bfloat16, m=333, k=100)
    kc.check_fp8_quantize_bit_exact(cp, ref, fp8, torch.float32, m=130, k=72)


def test_adamw_odd_length_and_bf16_states(cp, ref):
    """A shard length that is not a multiple of 4 at an unaligned offset (scalar path + tail), bf16 states."""
    n = 100_003
    bigs = [randn(n + 1, seed=20, scale=0.05), randn(n + 1, seed=21, scale=1e-3), randn(n + 1, seed=22, scale=1e-4),
            randn(n + 1, seed=23, scale=1e-3) ** 2]
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=7, seed=3, grad_scale=0.25)
    out = {}
    for name, be in (("cp", cp), ("ref", ref)):
        s = [big.clone()[1:] for big in bigs]  # views one element in: 4-byte but not 16-byte aligned
        be.adamw_update(s[0], s[1], s[2], s[3], master=None, **kw)
        out[name] = s
    for k, what in ((0, "param"), (2, "m"), (3, "v")):
        assert_close(out["cp"][k], out["ref"][k], 1e-6, f"adamw {what}")
    # bf16 master and moments (stochastic rounding): close to the reference in value
    p, g, m, v = (big[1:] for big in bigs)
    s = [p.to(torch.bfloat16), g.to(torch.bfloat16), m.to(torch.bfloat16), v.to(torch.bfloat16)]
    master = p.to(torch.bfloat16)
    cp.adamw_update(s[0], s[1], s[2], s[3], master=master, **kw)
    assert torch.equal(s[0], master)  # param = master rounded to the model dtype (here the same dtype)
    assert_close(master, out["ref"][0], 1e-2, "adamw bf16 master")


def test_kernels_run_on_torchs_current_stream(cp, ref):
    """Work queued on a side stream: our kernels must follow torch's fill on that stream, not race it."""
    x = torch.empty(1 << 24, device=DEV, dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    amax = torch.empty((), device=DEV)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        x.fill_(3.0)
        x[12345] = -7.5
        cp.absmax(amax, x)
        x.fill_(1.0)  # must not overtake the absmax above
    side.synchronize()
    assert amax.item() == 7.5


# ---------------------------------------------------------------------------------------------- e4m3 m
# The e4m3 first moment (backends/fp8_moment.py), as tests/test_triton_kernels.py checks it for Triton.
ADAM_E4M3 = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=7, seed=1234)


def _shard(t, offset):
    """t copied `offset` elements into a bigger buffer (offset 1: no pointer is 4-element aligned, VEC = 1)."""
    buf = torch.zeros(t.numel() + offset, dtype=t.dtype, device=t.device)
    buf[offset:] = t
    return buf[offset:]


@pytest.mark.parametrize("n,offset", [(5003, 0), (5003, 1), (3 * 2**20 + 77, 0)])
@pytest.mark.parametrize("v_dtype", DTYPES)
def test_adamw_e4m3_m_is_a_stochastic_rounding_of_the_fp32_update(cp, ref, n, offset, v_dtype):
    """master and v within 1e-6 of the torch reference's fp32 update made from the same (dequantized) m; the new m
    one of the two e4m3 neighbours of the reference's fp32 m at the block scale its maxima call for (partial last
    block: n % 256 != 0); reproducible for a seed."""
    from _helpers import bf16_stochastic_neighbours, e4m3_stochastic_neighbours
    from llmq_ray.backends import fp8_moment

    master, grad = randn(n, seed=40, scale=0.1), randn(n, seed=41, scale=0.01)
    v0 = (randn(n, seed=42, scale=1e-3) ** 2 * 100).to(v_dtype)
    m0 = randn(n, seed=43, scale=1e-3) * torch.logspace(-3, 0, n, device=DEV).roll(n // 3)  # blocks of all sizes
    m0[256:512] = 0.0  # an all-zero block: scale 2^-126
    r16 = torch.randint(0, 1 << 16, (n,), generator=torch.Generator(device=DEV).manual_seed(44), device=DEV,
                        dtype=torch.int32)
    q0, scale0 = fp8_moment.quantize(m0, r16)
    want = dict(param=master.clone(), m=fp8_moment.dequantize(q0, scale0), v=v0.to(torch.float32, copy=True))
    ref.adamw_update(want["param"], grad, want["m"], want["v"], master=None, grad_scale=0.5, **ADAM_E4M3)
    runs = []
    for _ in range(2):
        s = dict(param=_shard(master.to(torch.bfloat16), offset), m=_shard(q0, offset), scale=scale0.clone(),
                 v=_shard(v0, offset), master=_shard(master, offset))
        cp.adamw_update(s["param"], _shard(grad, offset), s["m"], s["v"], master=s["master"],
                        grad_scale=torch.tensor(0.5, device=DEV), m_scale=s["scale"], **ADAM_E4M3)
        runs.append(s)
    for k in runs[0]:
        assert torch.equal(runs[0][k].view(torch.uint8), runs[1][k].view(torch.uint8)), f"{k} not reproducible"
    s = runs[0]
    assert_close(s["master"], want["param"], 1e-6, "master (fp32)")
    assert torch.equal(s["param"], s["master"].to(torch.bfloat16)), "param = master rounded to nearest"
    if v_dtype == torch.float32:
        assert_close(s["v"], want["v"], 1e-6, "v")
    else:
        assert bf16_stochastic_neighbours(s["v"], want["v"])
    assert e4m3_stochastic_neighbours(s["m"].cpu(), s["scale"].cpu(), want["m"].cpu()) == []
    assert not torch.equal(s["m"].view(torch.uint8), q0.view(torch.uint8))


def test_adamw_e4m3_m_rounding_is_unbiased(cp):
    """16,384 elements whose new m is one value between two e4m3 grid points: the stored values average to it
    (within 4 standard errors), and both neighbours occur."""
    from llmq_ray.backends import fp8_moment

    n = 64 * 256
    g = torch.full((n,), 0.0123456, device=DEV)
    q = torch.zeros(n, dtype=fp8_moment.DTYPE, device=DEV)
    scale = torch.ones(fp8_moment.num_blocks(n), device=DEV)
    cp.adamw_update(torch.zeros(n, device=DEV), g, q, torch.zeros(n, device=DEV), master=None, grad_scale=1.0,
                    m_scale=scale, **{**ADAM_E4M3, "step": 1})
    got = fp8_moment.dequantize(q, scale).cpu().double()
    x = 0.1 * 0.0123456  # (1 - beta1) * g
    assert got.unique().numel() == 2
    spacing = (got.max() - got.min()).item()
    assert abs(got.mean().item() - x) < 4 * 0.5 * spacing / n ** 0.5, (got.mean().item(), x)
