"""--document-masking on the GPU in bf16: cuDNN's fused attention with the DocumentMask's score bias, against the
exact masked math (fp32, the path tests/test_document_masking.py checks against documents run alone).

Run on the GPU machine:  python3 -m pytest -m gpu tests/test_document_masking_gpu.py -q -p no:cacheprovider -s
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from llmq_ray.backends.attention import SdpaAttention  # noqa: E402

DEV = torch.device("cuda")
HQ, HKV, D = 14, 2, 64  # Qwen2.5-0.5B's attention


def _segments(b: int, t: int, seed: int) -> torch.Tensor:
    """[B, T] int32 document ids: documents of 20..700 tokens packed back to back in every row."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(b):
        ids, doc = [], 0
        while len(ids) < t:
            ids += [doc] * int(torch.randint(20, 700, (1,), generator=gen))
            doc += 1
        rows.append(ids[:t])
    return torch.tensor(rows, dtype=torch.int32, device=DEV)


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().flatten(), b.float().flatten()
    return float(a @ b / (a.norm() * b.norm()))


def _run(attn: SdpaAttention, qkv, dout, documents):
    b, t = qkv.shape[:2]
    out = torch.empty(b, t, HQ, D, dtype=qkv.dtype, device=DEV)
    lse = torch.empty(b, HQ, t, dtype=torch.float32, device=DEV)
    attn.forward(out, lse, qkv, HQ, HKV, documents)
    dqkv = torch.empty_like(qkv)
    attn.backward(dqkv, dout, out, lse, qkv, HQ, HKV, documents)
    return out, lse, dqkv


@pytest.mark.parametrize("b,t", [(2, 1024), (4, 512)])
def test_fused_document_mask_matches_the_exact_masked_attention(b, t):
    """Forward (out, lse) and backward (dq, dk, dv) of the fused bf16 path equal the exact masked math on the
    same bf16 inputs: cosine >= 0.9999 and relative error (norm of the difference / norm) <= 1e-2 per part; lse
    within 2e-2 absolute (bf16 inputs, fp32 softmax statistics on both sides)."""
    torch.manual_seed(0)
    qkv = torch.randn(b, t, HQ + 2 * HKV, D, device=DEV).bfloat16()
    dout = torch.randn(b, t, HQ, D, device=DEV).bfloat16()
    segments = _segments(b, t, seed=b)
    fused = SdpaAttention(DEV)
    exact = SdpaAttention(DEV)
    exact._aten = None  # the exact math on the GPU
    mask = fused.document_mask(segments, torch.bfloat16)
    assert mask.bias is not None
    mask.refresh()
    got = _run(fused, qkv, dout, mask)
    want = _run(exact, qkv, dout, exact.document_mask(segments, torch.bfloat16))
    for name, g, w in (("out", got[0], want[0]), ("dq", got[2][:, :, :HQ], want[2][:, :, :HQ]),
                       ("dk", got[2][:, :, HQ:HQ + HKV], want[2][:, :, HQ:HQ + HKV]),
                       ("dv", got[2][:, :, HQ + HKV:], want[2][:, :, HQ + HKV:])):
        assert torch.isfinite(g).all(), name
        rel = float((g.float() - w.float()).norm() / w.float().norm())
        print(f"  B={b} T={t} {name}: cosine {_cosine(g, w):.6f}, rel {rel:.2e}")
        assert _cosine(g, w) >= 0.9999 and rel <= 1e-2, name
    assert (got[1] - want[1]).abs().max().item() <= 2e-2
    # and the mask does something: without it the first document's later neighbours see other keys
    plain = _run(fused, qkv, dout, None)
    assert (plain[0].float() - got[0].float()).abs().max().item() > 0.1


def test_a_document_is_blind_to_the_other_documents_of_its_window():
    """Changing every token of the other documents leaves a document's outputs and its q/k/v gradients exactly
    as they were (the bias makes those probabilities exactly 0)."""
    torch.manual_seed(1)
    b, t = 2, 1024
    segments = _segments(b, t, seed=7)
    fused = SdpaAttention(DEV)
    mask = fused.document_mask(segments, torch.bfloat16)
    mask.refresh()
    qkv = torch.randn(b, t, HQ + 2 * HKV, D, device=DEV).bfloat16()
    dout = torch.randn(b, t, HQ, D, device=DEV).bfloat16()
    keep = (segments == 1)[:, :, None, None]  # document 1 of every row
    qkv2 = torch.where(keep, qkv, torch.randn_like(qkv.float()).bfloat16())
    dout2 = torch.where(keep, dout, torch.randn_like(dout.float()).bfloat16())
    one, two = _run(fused, qkv, dout, mask), _run(fused, qkv2, dout2, mask)
    for g, w in ((one[0], two[0]), (one[2], two[2])):
        diff = (g.float() - w.float()).abs()[keep.expand_as(g)]
        print(f"  max change inside document 1: {diff.max().item():.3e}")
        assert diff.max().item() <= 2e-2 * g.float().abs().max().item()  # cuDNN's backward sums with atomics
    assert torch.equal(one[0][keep.expand_as(one[0])], two[0][keep.expand_as(two[0])])  # the forward is exact
