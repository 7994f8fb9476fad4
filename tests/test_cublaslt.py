"""backends/cublaslt.py on CPU: what can be checked without a GPU (the GPU checks are in test_fp8_gpu.py).

make_backend switches GEMM tuning off exactly when the run asks for bit-reproducibility, and without CUDA the
Triton backend's GEMMs are torch's own.
"""

import pytest
import torch

from llmq_ray.backends import cublaslt, get_backend
from llmq_ray.model.config import PRESETS
from llmq_ray.engine.train_engine import TrainEngine, make_backend
from llmq_ray.errors import ConfigError
from _helpers import checked_settings, train_settings


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_not_available_without_cuda():
    assert cublaslt.available() is False


def test_pointer_alignment():
    """The alignment cuBLASLt's heuristic is told: the largest power of two dividing the address, capped at 256."""
    assert [cublaslt.pointer_alignment(p) for p in (0, 512, 768, 16, 48, 2, 1 << 40, 4096 + 8)] == \
        [256, 256, 256, 16, 16, 2, 256, 8]


@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_runs_get_untimed_gemms_and_the_deterministic_attention(deterministic):
    """make_backend gives a bit-reproducible run (--deterministic-attention) the deterministic attention provider
    and GEMM algorithms that do not depend on timings; the engine refuses a backend built otherwise."""
    opts = train_settings(model="tiny", batch_size=2, seq_len=16, deterministic_attention=deterministic)
    backend = make_backend("triton", opts, "cpu")
    assert backend.gemm.tuning is (not deterministic)
    assert backend.attention.name == ("deterministic" if deterministic else "sdpa")
    TrainEngine(PRESETS["tiny"], opts, backend)
    other = get_backend("triton", "cpu", gemm_tuning=deterministic)  # the opposite of what the options need
    with pytest.raises(ConfigError, match=r"^the triton backend was built with .*make_backend"):
        TrainEngine(PRESETS["tiny"], opts, other)


@pytest.mark.parametrize("ta,tb", [(False, True), (False, False), (True, False)])
def test_triton_matmul_on_cpu_is_torchs(ta, tb):
    """With tuning on but no CUDA, the GEMM is the reference's (bit-equal), in each layout the model uses."""
    be = get_backend("triton", "cpu")
    assert be.gemm.name == "cublaslt" and be.gemm.tuning
    g = torch.Generator().manual_seed(0)
    a = torch.randn(48, 32, generator=g) if not ta else torch.randn(32, 48, generator=g)
    b = torch.randn(40, 32, generator=g) if tb else torch.randn(32, 40, generator=g)
    out = torch.randn(48, 40, generator=g)
    ref = out.clone().addmm_(a.t() if ta else a, b.t() if tb else b)
    be.matmul(out, a, b, transpose_a=ta, transpose_b=tb, accumulate=True)
    assert torch.equal(out, ref)
    assert be.gemm._cublaslt is None  # never even loaded
