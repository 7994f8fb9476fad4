"""FP8 block GEMMs on the GPU (torch._scaled_mm, e4m3 / e5m2) with the torch and Triton backends.
Run on the device with `pytest -m gpu`."""

import pytest
import torch

from _helpers import perturb_norms_and_biases
from backends import get_backend
from llmq_ray.config import ModelConfig
from llmq_ray.model import LlamaModel
from llmq_ray.params import init_params

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

# FP8 GEMMs need every dimension a multiple of 16.
CFG = ModelConfig("qwen2", 512, 1408, 4, 8, 2, 4096, tie_word_embeddings=True, qkv_bias=True, name="fp8-gpu")
B, T = 4, 512


def _run(backend, matmul_dtype=None, gradient_dtype=None):
    model = LlamaModel(CFG, get_backend(backend, "cuda"), batch_size=B, seq_len=T, dtype=torch.bfloat16,
                       matmul_dtype=matmul_dtype, gradient_dtype=gradient_dtype)
    init_params(model.layout, model.params, seed=11)
    perturb_norms_and_biases(model)
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, CFG.vocab_size, (B, T + 1), generator=gen)
    model.zero_grads()
    model.forward_backward(tokens[:, :-1], tokens[:, 1:])
    torch.cuda.synchronize()
    return model.loss_sum.item(), model.grads.float()


def _cos(a, b):
    a, b = a.double(), b.double()
    return (a @ b / (a.norm() * b.norm())).item()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("gradient_dtype", [None, "e5m2"])
def test_fp8_first_step_loss_within_one_percent_of_bf16(backend, gradient_dtype):
    loss16, g16 = _run(backend)
    loss8, g8 = _run(backend, "e4m3", gradient_dtype)
    assert abs(loss8 - loss16) / loss16 < 0.01, (loss8, loss16)
    cos = _cos(g8, g16)
    print(f"{backend} grad={gradient_dtype or 'e4m3'}: loss bf16 {loss16:.3f} fp8 {loss8:.3f}, grad cosine {cos:.5f}")
    assert cos >= 0.98


def test_triton_fp8_gradients_follow_torch_fp8():
    _, g_torch = _run("torch", "e4m3")
    _, g_triton = _run("triton", "e4m3")
    assert _cos(g_triton, g_torch) >= 0.99
