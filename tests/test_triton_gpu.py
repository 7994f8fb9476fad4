"""Triton backend on a CUDA GPU at realistic shapes (Qwen2.5-0.5B-like), against the torch reference.

Run on the GPU machine:  python -m pytest tests/test_triton_gpu.py -m gpu -q -p no:cacheprovider -s
(``-m gpu`` overrides the default ``-m 'not gpu'`` of pyproject.toml; ``-s`` shows the timing table.)
Everything here is skipped without CUDA. The checks themselves live in kernel_checks.py (shared with the
CuPy backend's test_cupy_gpu.py): tolerances as in test_triton_kernels.py; FP8 must be bit-exact against
torch's float8 casts at the same scale; whole-model gradients (bf16) must have cosine >= 0.99 with the
torch backend's for every parameter tensor.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

if torch.cuda.is_available():
    pytest.importorskip("triton")

import gpt2_checks  # noqa: E402
import kernel_checks as kc  # noqa: E402
from llmq_ray.backends import get_backend  # noqa: E402
from kernel_checks import DEV, DTYPES, HKV, HQ, C, D, I, N, V, randn  # noqa: E402


@pytest.fixture(scope="module")
def tri():
    return get_backend("triton", DEV)


@pytest.fixture(scope="module")
def ref():
    return get_backend("torch", DEV)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_fused_and_backward(tri, ref, dtype):
    kc.check_rmsnorm_fused_and_backward(tri, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope(tri, ref, dtype):
    kc.check_rope(tri, ref, dtype)


def test_rope_backward_from_cudnn_parts(tri, ref):
    kc.check_rope_backward_from_cudnn_parts(tri, ref)


def test_deterministic_attention_backward(tri):
    kc.check_deterministic_attention_backward(tri)


def test_deterministic_attention_backward_fp32_is_not_tf32(tri):
    kc.check_deterministic_attention_backward_fp32()


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu(tri, ref, dtype):
    kc.check_swiglu(tri, ref, dtype)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("n,i", [(N, I), (16000, 4860)])
def test_swiglu_backward_fp8(tri, fp8, n, i):
    kc.check_swiglu_backward_fp8(tri, fp8, n, i)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_backward(tri, ref, dtype):
    kc.check_bias_backward(tri, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_classifier_full_vocab(tri, ref, dtype):
    kc.check_fused_classifier_full_vocab(tri, ref, dtype)


@pytest.mark.parametrize("fp8", [torch.float8_e5m2, torch.float8_e4m3fn])
def test_fused_classifier_fp8_full_vocab(tri, ref, fp8):
    kc.check_fused_classifier_fp8_full_vocab(tri, ref, fp8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_backward_deterministic(tri, ref, dtype):
    kc.check_embedding_backward_deterministic(tri, ref, dtype)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_quantize_bit_exact(tri, ref, fp8, dtype):
    kc.check_fp8_quantize_bit_exact(tri, ref, fp8, dtype)


def test_adamw_and_norm(tri, ref):
    kc.check_adamw_and_norm(tri, ref)


def _compiled_variants(jit_fn) -> int | None:
    """How many compiled variants a @triton.jit function holds (None if this Triton keeps them elsewhere)."""
    caches = getattr(jit_fn, "device_caches", None)
    if not caches:
        return None
    return sum(len(entry[0]) for entry in caches.values())


def test_adamw_seeds_never_cause_a_recompile(tri):
    """Seeds change every step; Triton keys compiled variants on whether an int is 1 or a multiple of 16. If
    the seeds were specialized, a step whose seeds first hit a new combination would JIT-compile mid-update
    (the slow 4th 7B update). Seeds of both kinds, same shapes: one compiled variant of each kernel."""
    from llmq_ray.backends.torch_ref_optim import derive_seed
    from llmq_ray.backends.triton import adamw as tri_adamw

    n = 4096
    p, g = randn(n, dtype=torch.bfloat16), randn(n, dtype=torch.bfloat16)
    m, v = randn(n, dtype=torch.bfloat16), randn(n, dtype=torch.bfloat16).abs()
    seeds = list(range(1, 49))  # includes 1, 16, 32, 48 (stochastic_round's own seed classes)
    derived = [derive_seed(s, tag) % 16 == 0 for s in seeds for tag in ("m", "p")]
    assert any(derived) and not all(derived)  # the AdamW kernel sees seeds of both classes
    counts = []
    for s in seeds:
        tri.adamw_update(p, g, m, v, master=None, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                         step=3, grad_scale=1.0, seed=s)
        tri.stochastic_round(p, randn(n, dtype=torch.float32), s)
        counts.append((_compiled_variants(tri_adamw._adamw_kernel),
                       _compiled_variants(tri_adamw._stochastic_round_kernel)))
    if counts[0][0] is None:
        pytest.skip("this Triton version keeps its compiled kernels elsewhere")
    assert all(c == counts[0] for c in counts), counts


def test_stochastic_round_unbiased(tri):
    kc.check_stochastic_round_unbiased(tri)


@pytest.mark.parametrize("which", ["tiny", "mid", "tiny-qwen3", "tiny-gpt2"])
def test_whole_model_gradients_triton_vs_torch_bf16(which):
    kc.check_whole_model_gradients_bf16("triton", which)


# ---------------------------------------------------------------------------------------------- timings
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
    parts = tuple(x.transpose(1, 2).contiguous().transpose(1, 2)  # dq, dk, dv in cuDNN's storage order
                  for x in (qkv[:, :, :HQ], qkv[:, :, HQ:HQ + HKV], qkv[:, :, HQ + HKV:]))
    att_out = torch.empty(16, 1024, HQ, D, dtype=bf, device=DEV)
    att_lse = torch.empty(16, HQ, 1024, device=DEV)
    ref.attention_forward(att_out, att_lse, qkv, HQ, HKV)
    att_dout, att_dqkv = torch.randn_like(att_out), torch.empty_like(qkv)

    det = get_backend("triton", DEV, attention="deterministic")

    def att_bwd(be):  # the triton column: the deterministic provider's kernel; the torch column: cuDNN
        (det if be is tri else be).attention_backward(att_dqkv, att_dout, att_out, att_lse, qkv, HQ, HKV)

    dqkv_rows, dqb = qkv.view(N, -1), torch.zeros(qkv.shape[2] * D, device=DEV)
    logits = randn(2048, V, seed=5, dtype=bf)
    targets = torch.randint(0, V, (2048,), device=DEV)
    losses = torch.empty(2048, device=DEV)
    q8 = torch.empty(N, C, dtype=torch.float8_e4m3fn, device=DEV)
    ds = torch.empty((), device=DEV)
    e4m3 = torch.float8_e4m3fn
    ug8, ugt8 = torch.empty(N, 2 * I, dtype=e4m3, device=DEV), torch.empty(2 * I, N, dtype=e4m3, device=DEV)
    tokens = torch.randint(0, V, (N,), device=DEV)
    dtab = torch.zeros(V, C, dtype=bf, device=DEV)
    n_opt = 50_000_000
    pp, gg, mm, vv = (randn(n_opt, seed=s, scale=1e-2) for s in range(6, 10))
    cases = {
        "fused_residual_rmsnorm+absmax": lambda be: be.fused_residual_rmsnorm_forward(res, out, rstd, x, y, w, 1e-6, absmax=amax),
        "rmsnorm_backward": lambda be: be.rmsnorm_backward(out, dw, x, y, w, rstd, dresidual=out),
        "swiglu_forward+absmax": lambda be: be.swiglu_forward(sw, ug, absmax=amax),
        "swiglu_backward": lambda be: be.swiglu_backward(dug, sw, ug),
        "swiglu_backward + quantize both layouts (e4m3)": lambda be: (
            be.swiglu_backward(dug, sw, ug, absmax=amax), be.quantize_with_transpose(ug8, ugt8, ds, dug, amax)),
        "swiglu_backward_fp8 (e4m3)": lambda be: be.swiglu_backward_fp8(ug8, ugt8, ds, sw, ug, amax, dug),
        "bias_backward+absmax (dqkv)": lambda be: be.bias_backward(dqb, dqkv_rows, absmax=amax),
        "rope_forward": lambda be: be.rope_forward(qkv, cos, sin, HQ, HKV),
        "rope_backward_from (dq, dk, dv)": lambda be: be.rope_backward_from(qkv, *parts, cos, sin, HQ, HKV),
        "attention_backward (cuDNN / deterministic)": lambda be: att_bwd(be),
        "fused_classifier 2048xV": lambda be: be.fused_classifier(logits, losses, targets, 1.0, write_dlogits=False),
        "quantize e4m3": lambda be: be.quantize(q8, ds, x, amax),
        "embedding_backward": lambda be: be.embedding_backward(dtab, tokens, x),
        "adamw fp32 50M": lambda be: be.adamw_update(pp, gg, mm, vv, master=None, lr=1e-9, beta1=0.9, beta2=0.95,
                                                     eps=1e-8, weight_decay=0.0, step=1, grad_scale=1.0, seed=0),
    }
    print(f"\n  {'kernel':34s} {'triton ms':>10s} {'torch ms':>10s}")
    for name, fn in cases.items():
        print(f"  {name:34s} {kc.time_cuda(lambda: fn(tri)):10.3f} {kc.time_cuda(lambda: fn(ref)):10.3f}")


# ---------------------------------------------------------------------------------------------- QK-norm (Qwen3)
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_qwen3_shapes(tri, ref, dtype):
    """The fused QK-norm at Qwen3-0.6B-like shapes (B*T = 4096, Hq = 16, Hkv = 8, D = 128) against the torch
    reference (tolerances in qk_norm_checks.py), then a timing line (bf16)."""
    import qk_norm_checks as qc

    qc.check_qk_norm(tri, ref, dtype, 2, 2048, 16, 8, 128, DEV)
    if dtype == torch.bfloat16:
        qc.time_qk_norm(tri, ref, 2, 2048, 16, 8, 128, DEV)


# --------------------------------------------------------------------------------------- LayerNorm, GELU-tanh (GPT-2)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpt2_layernorm_and_gelu_124m_shapes(tri, ref, dtype):
    """Triton's LayerNorm (fused residual forward, backward with and without the residual gradient) and GELU-tanh
    kernels at GPT-2 124M shapes against the base class's torch defaults: every output, the absmax outputs exactly
    max|stored|, recompute (plain forward of the stored residual) and a second run bit-identical; then (bf16) a
    timing line per op (gpt2_checks.py)."""
    gpt2_checks.check_layernorm_and_gelu(tri, ref, dtype, label="triton")
