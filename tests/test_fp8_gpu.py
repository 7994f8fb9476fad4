"""FP8 block GEMMs on the GPU (torch._scaled_mm, e4m3 / e5m2) with the torch and Triton backends, and the
cuBLASLt GEMMs of backends/cublaslt.py (FP8 with beta = 1; bf16 in every layout; tuning).
Run on the device with `pytest -m gpu`. The model and checks are in kernel_checks.py (shared with
test_cupy_gpu.py, which runs the same checks on the CuPy backend)."""

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import kernel_checks as kc  # noqa: E402


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("gradient_dtype", [None, "e5m2"])
def test_fp8_first_step_loss_within_one_percent_of_bf16(backend, gradient_dtype):
    kc.check_fp8_first_step_loss_within_one_percent_of_bf16(backend, gradient_dtype)


@pytest.mark.parametrize("backend", ["torch", "triton", "cupy"])
def test_fp8_lm_head_on_the_gpu(backend):
    """--lmhead-dtype e4m3 with e4m3 blocks, real FP8 GEMMs: loss within 1% of bf16, gradient cosine >= 0.98, and
    the triton backend's gradients follow the torch reference's FP8 head (cosine >= 0.99)."""
    if backend == "cupy":
        pytest.importorskip("cupy")
    loss16, g16 = kc.fp8_run(backend)
    loss8, g8 = kc.fp8_run(backend, "e4m3", lmhead_dtype="e4m3")
    assert abs(loss8 - loss16) / loss16 < 0.01, (loss8, loss16)
    assert kc.cosine(g8, g16) >= 0.98
    if backend == "triton":
        _, g_ref = kc.fp8_run("torch", "e4m3", lmhead_dtype="e4m3")
        assert kc.cosine(g8, g_ref) >= 0.99


@pytest.mark.parametrize("backend", ["torch", "triton", "cupy"])
def test_fp8_smooth_swiglu_on_the_gpu(backend):
    """--fp8-smooth-swiglu with real FP8 GEMMs: loss within 1% of bf16 and gradient cosine >= 0.98 (the bars of
    plain e4m3), and a GPU backend's gradients follow the torch reference's smooth path (cosine >= 0.99)."""
    if backend == "cupy":
        pytest.importorskip("cupy")
    loss16, g16 = kc.fp8_run(backend)
    loss8, g8 = kc.fp8_run(backend, "e4m3", smooth_swiglu=True)
    factors = kc.LAST_MODEL["model"].smooth.factors  # powers of two on the GPU too: the fold is exact
    assert bool((torch.frexp(factors).mantissa == 0.5).all())
    assert abs(loss8 - loss16) / loss16 < 0.01, (loss8, loss16)
    assert kc.cosine(g8, g16) >= 0.98
    if backend != "torch":
        _, g_ref = kc.fp8_run("torch", "e4m3", smooth_swiglu=True)
        assert kc.cosine(g8, g_ref) >= 0.99


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp8_monitor_saturated_share_at_a_delayed_scale(backend):
    """The FP8 monitor's count of SwiGLU outputs saturated at a delayed scale equals torch's float8 cast,
    with the triton backend's one-pass SwiGLU -> FP8 kernel (kernel_checks.check_saturated_share)."""
    kc.check_saturated_share(backend, "cuda")


def test_triton_fp8_gradients_follow_torch_fp8():
    _, g_torch = kc.fp8_run("torch", "e4m3")
    _, g_triton = kc.fp8_run("triton", "e4m3")
    assert kc.cosine(g_triton, g_torch) >= 0.99


# ---------------------------------------------------------------- cuBLASLt FP8 GEMM, beta = 1 (backends/cublaslt.py)
def _fp8_operands(m, n, k, a_dtype, b_dtype, gen):
    """Random FP8 operands (values spread over the format's range, no zeros forced) and positive descales."""
    a = (torch.randn(m, k, device="cuda", generator=gen) * 40).to(a_dtype)
    b = (torch.randn(n, k, device="cuda", generator=gen) * 40).to(b_dtype)
    a_descale = torch.tensor(0.013, device="cuda")
    b_descale = torch.tensor(0.0021, device="cuda")
    return a, b, a_descale, b_descale


@pytest.mark.parametrize("a_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("m,n,k", [(1536, 8960, 4096), (2048, 1536, 16384), (112, 48, 64)])
def test_cublaslt_fp8_accumulate_matches_fp64(a_dtype, m, n, k):
    """dw[M, N] += dy^T x through cuBLASLt (beta = 1) against an fp64 reference: within one bf16 step (2^-7
    relative to max |ref|; the H100 showed 4.4e-3, the same as torch's path), and on average no farther from it
    than torch's _scaled_mm-then-add (on the H100 the two gave the same errors to four digits)."""
    from llmq_ray.backends import cublaslt
    from llmq_ray.backends.torch_ref import TorchBackend
    gen = torch.Generator(device="cuda").manual_seed(m + n + k)
    a, b, da, db = _fp8_operands(m, n, k, a_dtype, torch.float8_e4m3fn, gen)
    out0 = torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16)
    ref = out0.double() + (a.double() * da.double()) @ (b.double() * db.double()).t()
    lt = cublaslt.for_device(torch.device("cuda"))
    assert lt.supports(out0, a, b)
    out_lt = out0.clone()
    lt.gemm(out_lt, a, b, a_descale=da, b_descale=db, accumulate=True, algo_index=0)
    out_torch = out0.clone()
    TorchBackend("cuda", gemm="torch").matmul_fp8(out_torch, a, b, da, db, accumulate=True)
    scale = ref.abs().max().item()
    err_lt = (out_lt.double() - ref).abs()
    err_torch = (out_torch.double() - ref).abs()
    print(f"  cuBLASLt beta=1 {a_dtype} {m}x{n}x{k}: max error {err_lt.max().item() / scale:.2e} "
          f"(torch add {err_torch.max().item() / scale:.2e}), mean {err_lt.mean().item():.3e} "
          f"(torch {err_torch.mean().item():.3e}); bit-equal to torch's path: {torch.equal(out_lt, out_torch)}")
    assert err_lt.max().item() <= 2 ** -7 * scale
    assert err_lt.mean().item() <= 1.001 * err_torch.mean().item()
    # every candidate (tuning may pick any), beta = 1 and beta = 0 (which overwrites), within one bf16 step
    plain = (a.double() * da.double()) @ (b.double() * db.double()).t()
    for acc, want in ((True, ref), (False, plain)):
        plan = lt.plan(out0, a, b, False, True, acc)
        for j in range(plan.count):
            out_j = out0.clone() if acc else torch.full_like(out0, 7.0)
            lt.gemm(out_j, a, b, a_descale=da, b_descale=db, accumulate=acc, algo_index=j)
            err = (out_j.double() - want).abs().max().item() / want.abs().max().item()
            assert err <= 2 ** -7, f"candidate {j} of {plan.count}, beta={int(acc)}: error {err:.2e}"


def test_triton_backend_accumulates_fp8_through_cublaslt():
    """The Triton backend's accumulating FP8 GEMM goes through cuBLASLt (a tuned plan for the problem exists
    afterwards) and gives the bits of that plan's choice; with tuning off it takes the heuristic's first."""
    from llmq_ray.backends import cublaslt
    from llmq_ray.backends.triton.backend import TritonBackend
    gen = torch.Generator(device="cuda").manual_seed(5)
    m, n, k = 256, 384, 512
    a, b, da, db = _fp8_operands(m, n, k, torch.float8_e5m2, torch.float8_e4m3fn, gen)
    out0 = torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16)
    be = TritonBackend("cuda")
    out_be = out0.clone()
    be.matmul_fp8(out_be, a, b, da, db, accumulate=True)
    lt = cublaslt.for_device(torch.device("cuda"))
    assert be.gemm._cublaslt is lt
    plan = lt.plan(out0, a, b, False, True, True)
    assert plan.choice is not None and plan.choice >= 0 and len(plan.timings) == plan.count  # no fallback here
    out_lt = out0.clone()
    lt.gemm(out_lt, a, b, a_descale=da, b_descale=db, accumulate=True, algo_index=plan.choice)
    assert torch.equal(out_be, out_lt)
    be.gemm.tuning = False
    out_be0 = out0.clone()
    be.matmul_fp8(out_be0, a, b, da, db, accumulate=True)
    lt.gemm(out_lt.copy_(out0), a, b, a_descale=da, b_descale=db, accumulate=True, algo_index=0)
    assert torch.equal(out_be0, out_lt)


# ---------------------------------------------------------------- bf16 GEMMs through cuBLASLt, every layout
LAYOUTS = {  # name: (a shape, b shape, transpose_a, transpose_b) for out[M, N] with M=384, N=256, K=512
    "forward x W^T": ((384, 512), (256, 512), False, True),
    "dgrad dy W": ((384, 512), (512, 256), False, False),
    "wgrad dy^T x": ((512, 384), (512, 256), True, False),
    "a^T b^T": ((512, 384), (256, 512), True, True),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("accumulate", [False, True])
def test_cublaslt_bf16_every_candidate_matches_fp64(layout, accumulate):
    """Every cuBLASLt candidate algorithm, in each of the four transpose layouts, against an fp64 reference
    (bf16 inputs, fp32 accumulation, one bf16 rounding: 2^-7 relative to max |ref|), beta = 0 and 1."""
    _check_every_candidate(layout, accumulate, sm_count=0)


@pytest.mark.parametrize("layout", ["forward x W^T", "wgrad dy^T x"])
@pytest.mark.parametrize("sm_count", [66, 100])
def test_cublaslt_sm_count_target(layout, sm_count):
    """With an SM count target (a GEMM meant to share the GPU with a concurrent stream) the plan is a separate
    one and every candidate it offers is as exact as without (beta = 1)."""
    from llmq_ray.backends import cublaslt
    a_shape, b_shape, ta, tb = LAYOUTS[layout]
    a = torch.ones(*a_shape, device="cuda", dtype=torch.bfloat16)
    b = torch.ones(*b_shape, device="cuda", dtype=torch.bfloat16)
    out = torch.zeros(384, 256, device="cuda", dtype=torch.bfloat16)
    lt = cublaslt.for_device(torch.device("cuda"))
    assert lt.plan(out, a, b, ta, tb, True, sm_count) is not lt.plan(out, a, b, ta, tb, True)
    _check_every_candidate(layout, True, sm_count)


def _check_every_candidate(layout: str, accumulate: bool, sm_count: int) -> None:
    from llmq_ray.backends import cublaslt
    a_shape, b_shape, ta, tb = LAYOUTS[layout]
    gen = torch.Generator(device="cuda").manual_seed(11)
    a = torch.randn(*a_shape, device="cuda", generator=gen).to(torch.bfloat16)
    b = torch.randn(*b_shape, device="cuda", generator=gen).to(torch.bfloat16)
    out0 = torch.randn(384, 256, device="cuda", generator=gen).to(torch.bfloat16)
    op_a = a.double().t() if ta else a.double()
    op_b = b.double().t() if tb else b.double()
    ref = op_a @ op_b + (out0.double() if accumulate else 0)
    lt = cublaslt.for_device(torch.device("cuda"))
    assert lt.supports(out0, a, b, ta, tb)
    plan = lt.plan(out0, a, b, ta, tb, accumulate, sm_count)
    scale = ref.abs().max().item()
    for j in range(plan.count):
        out = out0.clone()
        lt.gemm(out, a, b, trans_a=ta, trans_b=tb, accumulate=accumulate, algo_index=j, sm_count=sm_count)
        err = (out.double() - ref).abs().max().item() / scale
        assert err <= 2 ** -7, f"candidate {j} of {plan.count}: error {err:.2e}"
    print(f"  cuBLASLt bf16 {layout} beta={int(accumulate)} SM target {sm_count}: {plan.count} candidates "
          f"within 2^-7")


def test_triton_backend_bf16_gemm_tuning():
    """With tuning the backend's bf16 GEMM is timed against torch's once and its choice reused (the same
    bits on the second call); with it off, the GEMM is torch's own (bit-equal to torch.mm)."""
    from llmq_ray.backends import cublaslt
    from llmq_ray.backends.triton.backend import TritonBackend
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(4096, 1536, device="cuda", generator=gen).to(torch.bfloat16)
    w = torch.randn(8960, 1536, device="cuda", generator=gen).to(torch.bfloat16)
    be = TritonBackend("cuda")
    y1 = torch.empty(4096, 8960, device="cuda", dtype=torch.bfloat16)
    be.matmul(y1, x, w, transpose_b=True)
    plan = cublaslt.for_device(torch.device("cuda")).plan(y1, x, w, False, True, False)
    assert plan.choice is not None and len(plan.timings) == plan.count + 1  # torch's call, then the candidates
    print(f"  tuned bf16 4096x8960x1536: choice {plan.choice} (-1 = torch), ms {[round(t, 3) for t in plan.timings]}")
    y2 = torch.empty_like(y1)
    be.matmul(y2, x, w, transpose_b=True)
    assert torch.equal(y1, y2)
    ref = (x.double() @ w.double().t())
    assert (y1.double() - ref).abs().max().item() <= 2 ** -7 * ref.abs().max().item()
    be.gemm.tuning = False
    y3 = torch.empty_like(y1)
    be.matmul(y3, x, w, transpose_b=True)
    assert torch.equal(y3, torch.mm(x, w.t()))


def test_cublaslt_views_at_16_byte_offsets():
    """Operands that are views at 16- and 48-byte offsets (less than the 256 bytes cuBLASLt assumes unless told):
    supported, planned with their real alignment, and every candidate exact to one bf16 step; an 8-byte offset
    is refused (the backend then takes torch's call)."""
    from llmq_ray.backends import cublaslt
    lt = cublaslt.for_device(torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(9)
    m, n, k = 256, 128, 512
    base_a = torch.randn(m * k + 64, device="cuda", generator=gen).to(torch.bfloat16)
    base_b = torch.randn(n * k + 64, device="cuda", generator=gen).to(torch.bfloat16)
    base_out = torch.zeros(m * n + 64, device="cuda", dtype=torch.bfloat16)
    a = base_a[8:8 + m * k].view(m, k)  # 16 bytes in
    b = base_b[24:24 + n * k].view(n, k)  # 48 bytes in
    out = base_out[8:8 + m * n].view(m, n)
    assert cublaslt.pointer_alignment(a.data_ptr()) == 16 and cublaslt.pointer_alignment(b.data_ptr()) == 16
    assert lt.supports(out, a, b)
    ref = a.double() @ b.double().t()
    plan = lt.plan(out, a, b, False, True, False)
    for j in range(plan.count):
        lt.gemm(out, a, b, algo_index=j)
        assert (out.double() - ref).abs().max().item() <= 2 ** -7 * ref.abs().max().item(), f"candidate {j}"
    assert not lt.supports(out, base_a[4:4 + m * k].view(m, k), b)  # 8 bytes in
