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
