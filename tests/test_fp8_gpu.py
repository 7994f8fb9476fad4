"""FP8 block GEMMs on the GPU (torch._scaled_mm, e4m3 / e5m2) with the torch and Triton backends.
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


def test_triton_fp8_gradients_follow_torch_fp8():
    _, g_torch = kc.fp8_run("torch", "e4m3")
    _, g_triton = kc.fp8_run("triton", "e4m3")
    assert kc.cosine(g_triton, g_torch) >= 0.99


# ---------------------------------------------------------------- cuBLASLt FP8 GEMM with beta = 1 (backends/cublaslt.py)
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
    from backends import cublaslt
    from backends.torch_ref import TorchBackend
    gen = torch.Generator(device="cuda").manual_seed(m + n + k)
    a, b, da, db = _fp8_operands(m, n, k, a_dtype, torch.float8_e4m3fn, gen)
    out0 = torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16)
    ref = out0.double() + (a.double() * da.double()) @ (b.double() * db.double()).t()
    lt = cublaslt.for_device(torch.device("cuda"))
    assert lt.supports(out0, a, b)
    out_lt = out0.clone()
    lt.matmul(out_lt, a, b, da, db, accumulate=True)
    out_torch = out0.clone()
    TorchBackend("cuda").matmul_fp8(out_torch, a, b, da, db, accumulate=True)
    scale = ref.abs().max().item()
    err_lt = (out_lt.double() - ref).abs()
    err_torch = (out_torch.double() - ref).abs()
    print(f"  cuBLASLt beta=1 {a_dtype} {m}x{n}x{k}: max error {err_lt.max().item() / scale:.2e} "
          f"(torch add {err_torch.max().item() / scale:.2e}), mean {err_lt.mean().item():.3e} "
          f"(torch {err_torch.mean().item():.3e}); bit-equal to torch's path: {torch.equal(out_lt, out_torch)}")
    assert err_lt.max().item() <= 2 ** -7 * scale
    assert err_lt.mean().item() <= 1.001 * err_torch.mean().item()
    # beta = 0 overwrites: the same as torch._scaled_mm up to one bf16 rounding of the same fp32 sum
    out_set = torch.full_like(out0, 7.0)
    lt.matmul(out_set, a, b, da, db, accumulate=False)
    plain = torch._scaled_mm(a, b.t(), scale_a=da, scale_b=db, out_dtype=torch.bfloat16)
    diff = (out_set.float() - plain.float()).abs().max().item()
    assert diff <= 2 ** -8 * plain.float().abs().max().item()


def test_triton_backend_accumulates_fp8_through_cublaslt():
    """The Triton backend's accumulating FP8 GEMM goes through cuBLASLt (a plan for the shape exists afterwards)
    and gives its bits; the non-accumulating one stays on torch._scaled_mm (no plan for it)."""
    from backends import cublaslt
    from backends.triton.backend import TritonBackend
    gen = torch.Generator(device="cuda").manual_seed(5)
    m, n, k = 256, 384, 512
    a, b, da, db = _fp8_operands(m, n, k, torch.float8_e5m2, torch.float8_e4m3fn, gen)
    out0 = torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16)
    be = TritonBackend("cuda")
    out_be = out0.clone()
    be.matmul_fp8(out_be, a, b, da, db, accumulate=True)
    lt = cublaslt.for_device(torch.device("cuda"))
    assert be._cublaslt is lt
    assert (m, n, k, a.dtype, b.dtype, torch.bfloat16) in lt.plans
    out_lt = out0.clone()
    lt.matmul(out_lt, a, b, da, db, accumulate=True)
    assert torch.equal(out_be, out_lt)
    a2 = a[:128].contiguous()  # a shape not used above, not accumulated
    be.matmul_fp8(torch.empty(128, n, device="cuda", dtype=torch.bfloat16), a2, b, da, db)
    assert (128, n, k, a2.dtype, b.dtype, torch.bfloat16) not in lt.plans
