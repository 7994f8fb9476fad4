"""--document-masking on the GPU in bf16: the attention provider's two kernel choices (DOCUMENT_KERNELS: our
tile-skipping Triton forward/backward, the default; cuDNN's fused kernels with the DocumentMask's score bias)
against the exact masked math (fp32, the path tests/test_document_masking.py checks against documents run alone).

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


def _segments(b: int, t: int, seed: int) -> torch.Tensor:
    """[B, T] int32 document ids: documents of 20..min(700, T/2) tokens packed back to back in every row (so every
    row holds at least three documents and the mask changes the result)."""
    hi = min(700, t // 2)
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(b):
        ids, doc = [], 0
        while len(ids) < t:
            ids += [doc] * int(torch.randint(20, hi, (1,), generator=gen))
            doc += 1
        rows.append(ids[:t])
    return torch.tensor(rows, dtype=torch.int32, device=DEV)


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().flatten(), b.float().flatten()
    return float(a @ b / (a.norm() * b.norm()))


def _run(attn: SdpaAttention, qkv, dout, documents, hq: int, hkv: int):
    """(out, lse, dqkv) of ``attn``'s forward and backward on qkv[B, T, hq + 2 hkv, D], dout[B, T, hq, D]."""
    b, t, _, d = qkv.shape
    out = torch.empty(b, t, hq, d, dtype=qkv.dtype, device=DEV)
    lse = torch.empty(b, hq, t, dtype=torch.float32, device=DEV)
    attn.forward(out, lse, qkv, hq, hkv, documents)
    dqkv = torch.empty_like(qkv)
    attn.backward(dqkv, dout, out, lse, qkv, hq, hkv, documents)
    return out, lse, dqkv


def _provider(kernels: str) -> SdpaAttention:
    attn = SdpaAttention(DEV)
    attn.DOCUMENT_KERNELS = kernels
    return attn


@pytest.mark.parametrize("kernels", ["triton", "cudnn"])
@pytest.mark.parametrize("b,t,heads", [(2, 1024, (14, 2, 64)), (4, 512, (14, 2, 64)), (2, 1024, (16, 8, 128)),
                                       (1, 300, (4, 4, 64))])
def test_fused_document_mask_matches_the_exact_masked_attention(kernels, b, t, heads):
    """Forward (out, lse) and backward (dq, dk, dv) of the fused bf16 path equal the exact masked math on the
    same bf16 inputs: cosine >= 0.9999 and relative error (norm of the difference / norm) <= 1e-2 per part; lse
    within 2e-2 absolute (bf16 inputs, fp32 softmax statistics on both sides). Heads: Qwen2.5-0.5B's, Qwen3's
    (head_dim 128) and a T that is no multiple of the tiles."""
    hq, hkv, d = heads
    torch.manual_seed(0)
    qkv = torch.randn(b, t, hq + 2 * hkv, d, device=DEV).bfloat16()
    dout = torch.randn(b, t, hq, d, device=DEV).bfloat16()
    segments = _segments(b, t, seed=b)
    fused = _provider(kernels)
    exact = SdpaAttention(DEV)
    exact._aten = None  # the exact math on the GPU
    mask = fused.document_mask(segments, torch.bfloat16)
    assert (mask.bias is not None) == (kernels == "cudnn")
    mask.refresh()
    exact_mask = exact.document_mask(segments, torch.bfloat16)
    exact_mask.refresh()
    got = _run(fused, qkv, dout, mask, hq, hkv)
    want = _run(exact, qkv, dout, exact_mask, hq, hkv)
    for name, g, w in (("out", got[0], want[0]), ("dq", got[2][:, :, :hq], want[2][:, :, :hq]),
                       ("dk", got[2][:, :, hq:hq + hkv], want[2][:, :, hq:hq + hkv]),
                       ("dv", got[2][:, :, hq + hkv:], want[2][:, :, hq + hkv:])):
        assert torch.isfinite(g).all(), name
        rel = float((g.float() - w.float()).norm() / w.float().norm())
        print(f"  {kernels} B={b} T={t} heads {heads} {name}: cosine {_cosine(g, w):.6f}, rel {rel:.2e}")
        assert _cosine(g, w) >= 0.9999 and rel <= 1e-2, name
    assert (got[1] - want[1]).abs().max().item() <= 2e-2
    # and the mask does something: without it the first document's later neighbours see other keys
    plain = _run(fused, qkv, dout, None, hq, hkv)
    assert (plain[0].float() - got[0].float()).abs().max().item() > 0.1


@pytest.mark.parametrize("kernels", ["triton", "cudnn"])
def test_a_document_is_blind_to_the_other_documents_of_its_window(kernels):
    """Changing every token of the other documents leaves a document's outputs exactly as they were, and its
    q/k/v gradients too with our kernels (no atomics; cuDNN's backward sums with atomics: within 2% of the
    largest there). The masked probabilities are exactly 0 either way."""
    hq, hkv, d = 14, 2, 64
    torch.manual_seed(1)
    b, t = 2, 1024
    segments = _segments(b, t, seed=7)
    fused = _provider(kernels)
    mask = fused.document_mask(segments, torch.bfloat16)
    mask.refresh()
    qkv = torch.randn(b, t, hq + 2 * hkv, d, device=DEV).bfloat16()
    dout = torch.randn(b, t, hq, d, device=DEV).bfloat16()
    keep = (segments == 1)[:, :, None, None]  # document 1 of every row
    qkv2 = torch.where(keep, qkv, torch.randn_like(qkv.float()).bfloat16())
    dout2 = torch.where(keep, dout, torch.randn_like(dout.float()).bfloat16())
    one, two = _run(fused, qkv, dout, mask, hq, hkv), _run(fused, qkv2, dout2, mask, hq, hkv)
    for g, w in ((one[0], two[0]), (one[2], two[2])):
        diff = (g.float() - w.float()).abs()[keep.expand_as(g)]
        print(f"  {kernels}: max change inside document 1: {diff.max().item():.3e}")
        assert diff.max().item() <= (0.0 if kernels == "triton" else 2e-2 * g.float().abs().max().item())
    assert torch.equal(one[0][keep.expand_as(one[0])], two[0][keep.expand_as(two[0])])  # the forward is exact
