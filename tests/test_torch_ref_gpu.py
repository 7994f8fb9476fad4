"""The torch reference backend on CUDA: the cuDNN attention path against the written-out math, and the whole
model in bf16 on the GPU against fp32 on the CPU. Run on the device with `pytest -m gpu`."""

import pytest
import torch

from llmq_ray.backends import get_backend
from llmq_ray.backends.torch_ref import TorchBackend
from llmq_ray.model.config import ModelConfig
from llmq_ray.model import build_model
from llmq_ray.model.params import init_params

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


def _math_backend():
    be = TorchBackend("cuda")
    be.attention._aten = None  # force the written-out math path
    return be


@pytest.mark.parametrize("b,t,hq,hkv,d", [(2, 256, 14, 2, 64), (4, 1024, 12, 2, 128), (1, 100, 6, 3, 64)])
def test_cudnn_attention_matches_math(b, t, hq, hkv, d):
    torch.manual_seed(0)
    qkv = torch.randn(b, t, hq + 2 * hkv, d, device="cuda").bfloat16()
    fast, ref = get_backend("torch", "cuda"), _math_backend()
    out_f = torch.empty(b, t, hq, d, device="cuda", dtype=torch.bfloat16)
    out_r = torch.empty_like(out_f)
    lse_f = torch.empty(b, hq, t, device="cuda")
    lse_r = torch.empty_like(lse_f)
    fast.attention_forward(out_f, lse_f, qkv, hq, hkv)
    ref.attention_forward(out_r, lse_r, qkv, hq, hkv)
    assert (out_f.float() - out_r.float()).abs().max().item() < 2e-2
    assert (lse_f - lse_r).abs().max().item() < 1e-2
    dout = torch.randn_like(out_f)
    dq_f = torch.empty_like(qkv)
    dq_r = torch.empty_like(qkv)
    fast.attention_backward(dq_f, dout, out_f, lse_f, qkv, hq, hkv)
    ref.attention_backward(dq_r, dout, out_r, lse_r, qkv, hq, hkv)
    a, r = dq_f.float().flatten(), dq_r.float().flatten()
    cos = (a @ r / (a.norm() * r.norm())).item()
    assert cos > 0.999, cos


def test_whole_model_bf16_cuda_follows_fp32_cpu():
    cfg = ModelConfig("qwen2", 256, 704, 3, 8, 2, 2000, tie_word_embeddings=True, qkv_bias=True, name="mid")
    b, t = 4, 128
    torch.manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (b, t + 1))
    grads = {}
    for key, device, dtype in (("cpu32", "cpu", torch.float32), ("cuda16", "cuda", torch.bfloat16)):
        model = build_model(cfg, get_backend("torch", device), batch=b, seq=t, dtype=dtype)
        init_params(model.layout, model.params, seed=3)
        model.zero_grads()
        model.forward_backward(tokens[:, :-1], tokens[:, 1:])
        grads[key] = (model.grads.float().cpu(), model.loss_sum.item())
    g32, l32 = grads["cpu32"]
    g16, l16 = grads["cuda16"]
    assert abs(l16 - l32) / l32 < 1e-2
    from llmq_ray.model.params import ParamLayout

    layout = ParamLayout(cfg)
    for slot in layout:
        a, r = g16[slot.offset:slot.end].double(), g32[slot.offset:slot.end].double()
        cos = (a @ r / (a.norm() * r.norm())).item()
        assert cos >= 0.99, f"{slot.name}: cosine {cos}"
