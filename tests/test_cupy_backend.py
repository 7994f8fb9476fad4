"""The CuPy backend on a CPU machine: what can be checked without a GPU, in a few seconds.

* ``get_backend("cupy")`` without CuPy, or without a usable GPU, ends in one ConfigError sentence that says
  what to install;
* every kernel source compiles with NVRTC (a library that needs no GPU) with all its template
  instantiations, and the inline PTX assembles for sm_90 (skipped when libnvrtc cannot be loaded);
* the host side of every backend method, run on CPU tensors with a recording launcher instead of the GPU,
  launches only instantiations that exist, with arguments whose number and C types match the kernel's
  parameters, and with legal launch geometry;
* the .cu files ship as package data.
"""

from __future__ import annotations

import fnmatch
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from llmq_ray.backends import get_backend
from llmq_ray.backends.cupy import _runtime as rt
from llmq_ray.backends.cupy.backend import CupyBackend
from llmq_ray.backends.base import Backend
from llmq_ray.backends.torch_ref import TorchBackend
from llmq_ray.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def _one_sentence(msg: str) -> bool:
    return "\n" not in msg and msg.endswith(".") and ". " not in msg


# ---------------------------------------------------------------------------------------------- errors
def test_without_cupy_get_backend_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` now raises ImportError
    with pytest.raises(ConfigError) as err:
        get_backend("cupy", "cuda")
    msg = str(err.value)
    assert "pip install 'llmq-ray[cupy13]'" in msg and "'llmq-ray[cupy12]'" in msg, msg
    assert _one_sentence(msg), msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_without_a_gpu_get_backend_is_one_clear_sentence(device):
    pytest.importorskip("cupy")
    with pytest.raises(ConfigError) as err:
        get_backend("cupy", device)
    msg = str(err.value)
    assert "needs an NVIDIA GPU" in msg and "--backend=torch" in msg and "llmq-ray[cupy13]" in msg, msg
    assert _one_sentence(msg), msg


# ---------------------------------------------------------------------------------------------- NVRTC
def test_every_kernel_source_compiles_with_nvrtc():
    from llmq_ray.backends.cupy import nvrtc_check

    try:
        nvrtc_check.load_nvrtc()
    except nvrtc_check.NvrtcUnavailable as exc:
        pytest.skip(str(exc))
    for module in rt.MODULES:
        assert b".entry" in nvrtc_check.compile_module(module, "compute_90"), module
    # inline PTX (cvt bf16 / e4m3x2 / e5m2x2, mul.rn, div.rn, redux) through ptxas for a real architecture
    assert nvrtc_check.compile_asm_probe("sm_90")
    # the fallbacks: software FP8 conversion, and pre-sm_80 bf16 rounding / shuffle max
    nvrtc_check.compile_module("fp8", "compute_90", defines=("LLMQ_SOFT_FP8",))
    nvrtc_check.compile_module("reduce", "compute_75")
    nvrtc_check.compile_module("layernorm", "compute_75")


def test_every_kernel_file_is_a_module_and_package_data():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    files = {p.name for p in rt.KERNEL_DIR.iterdir()}
    assert files == {f"{m}.cu" for m in rt.MODULES} | {rt.COMMON_HEADER}
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["llmq_ray.backends.cupy"]
    for f in files:
        assert any(fnmatch.fnmatch(f"kernels/{f}", p) for p in patterns), f


# ---------------------------------------------------------------------------------------------- host side
_PARAM_TYPES = {"float": np.float32, "int": np.int32, "i64": np.int64, "u64": np.uint64}


def _kernel_signatures() -> dict[str, list[type]]:
    """kernel name -> numpy type of each parameter, parsed from the .cu sources (pointers -> uint64)."""
    sigs = {}
    for module in rt.MODULES:
        src = rt.kernel_source(module)
        for m in re.finditer(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(([^)]*)\)", src):
            types = []
            for param in m.group(2).split(","):
                param = param.strip()
                if "*" in param:
                    types.append(np.uint64)
                else:
                    types.append(_PARAM_TYPES[param.split()[-2]])
            sigs[m.group(1)] = types
    return sigs


class RecordingKernels(rt.Kernels):
    """Stands in for the GPU: checks and records each launch instead of running it."""

    def __init__(self):  # no CuPy, no device
        self.sm_count = 132
        self.launches = []
        self.calls = []  # (name, grid, block, args) of each launch
        self.sigs = _kernel_signatures()

    def launch(self, module, name, grid, block, args, shared_mem=0):
        assert name in rt.MODULES[module], f"{name} is not instantiated in {module}.cu"
        want = self.sigs[name.split("<")[0]]
        got = [type(a) for a in args]
        assert got == want, f"{name}: argument types {got} do not match the kernel's parameters {want}"
        grid = grid if isinstance(grid, tuple) else (grid,)
        block = block if isinstance(block, tuple) else (block,)
        threads = int(np.prod(block))
        assert 32 <= threads <= 1024 and threads % 32 == 0 and block[0] % 32 == 0, (name, block)
        assert all(g >= 1 for g in grid) and all(g <= 65535 for g in grid[1:]), (name, grid)
        assert shared_mem <= 48 * 1024, (name, shared_mem)
        self.launches.append(name)
        self.calls.append((name, grid, block, args))

    def zero_u32(self, t):
        assert t.dtype == torch.float32 and t.numel() == 1


@pytest.fixture()
def rec():
    be = CupyBackend.__new__(CupyBackend)
    Backend.__init__(be, "cpu")  # everything of CupyBackend.__init__ but CuPy itself
    be._reference = TorchBackend("cpu")
    be.k = RecordingKernels()
    return be


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,c,i,v,d", [(64, 896, 4864, 1024, 64), (37, 100, 99, 1001, 20)])
def test_host_side_launches_match_the_kernels(rec, dtype, n, c, i, v, d):
    def t(*shape, dt=dtype):
        return torch.randn(*shape).to(dt)

    x, w = t(n, c), t(c)
    rstd, amax = torch.empty(n), torch.empty(())
    rec.rmsnorm_forward(t(n, c), rstd, x, w, 1e-6, absmax=amax)
    rec.fused_residual_rmsnorm_forward(t(n, c), t(n, c), rstd, x, t(n, c), w, 1e-6)
    rec.rmsnorm_backward(t(n, c), t(c), t(n, c), x, w, rstd, dresidual=t(n, c))
    qkv = t(2, 8, 6 + 2 * 2, d)
    cos, sin = torch.rand(8, d // 2), torch.rand(8, d // 2)
    rec.rope_forward(qkv, cos, sin, 6, 2)
    rec.rope_backward(qkv, cos, sin, 6, 2)
    rec.swiglu_forward(t(n, i), t(n, 2 * i), absmax=amax)
    rec.swiglu_backward(t(n, 2 * i), t(n, i), t(n, 2 * i))
    # the TORCH_DEFAULT_OPS with kernels of their own: QK-norm, LayerNorm (+ fused residual), GELU-tanh
    saved, qk_rstd = t(2 * 8, 6 + 2, d), torch.empty(2 * 8, 6 + 2)
    rec.qk_norm_forward(qkv, saved, qk_rstd, t(d), t(d), 6, 2, 1e-6)
    rec.qk_norm_backward(qkv, t(d), t(d), saved, qk_rstd, t(d), t(d), 6, 2)
    mean = torch.empty(n)
    rec.layernorm_forward(t(n, c), mean, rstd, x, w, t(c), 1e-5, absmax=amax)
    rec.fused_residual_layernorm_forward(t(n, c), t(n, c), mean, rstd, x, t(n, c), w, t(c), 1e-5)
    rec.layernorm_backward(t(n, c), t(c), t(c), t(n, c), x, w, mean, rstd, dresidual=t(n, c), absmax=amax)
    rec.layernorm_backward(t(n, c), t(c), t(c), t(n, c), x, w, mean, rstd)
    rec.gelu_tanh_forward(t(n, i), t(n, i), absmax=amax)
    rec.gelu_tanh_backward(t(n, i), t(n, i), t(n, i), absmax=amax)
    for tokens in (torch.randint(0, v, (n,)), torch.randint(0, v, (n,), dtype=torch.int32)):
        rec.embedding_forward(t(n, c), tokens, t(v, c))
        rec.embedding_backward(t(v, c), tokens, t(n, c))
        rec.fused_classifier(t(n, v), torch.empty(n), tokens)
    rec.absmax(amax, x)
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        rec.quantize(torch.empty(n, c, dtype=fp8), torch.empty(()), x, amax)
        rec.quantize_transpose(torch.empty(c, n, dtype=fp8), torch.empty(()), x, amax)
        rec.quantize_with_transpose(torch.empty(n, c, dtype=fp8), torch.empty(c, n, dtype=fp8), torch.empty(()), x,
                                    amax)
    flat = t(1003)
    rec.global_norm_squared(torch.zeros(()), flat)
    rec.global_norm_squared(torch.zeros(()), flat[1:])
    rec.stochastic_round(torch.empty(1003, dtype=torch.bfloat16), torch.randn(1003), seed=1)
    for master in (None, torch.randn(1003)):
        rec.adamw_update(t(1003), t(1003), t(1003), torch.rand(1003).to(dtype), master=master, lr=1e-3, beta1=0.9,
                         beta2=0.95, eps=1e-8, weight_decay=0.1, step=2, grad_scale=torch.tensor(0.5), seed=1)
        # the e4m3 first moment (backends/fp8_moment.py): bytes + [ceil(n/256)] fp32 block scales
        rec.adamw_update(t(1003), t(1003), torch.zeros(1003, dtype=torch.float8_e4m3fn), torch.rand(1003).to(dtype),
                         master=master, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=2,
                         grad_scale=0.5, seed=1, m_scale=torch.ones(4))
    names = {name.split("<")[0] for name in rec.k.launches}
    assert names == {"rmsnorm_fwd", "rmsnorm_bwd", "column_sum", "rope", "swiglu_fwd", "swiglu_bwd", "emb_fwd",
                     "emb_bwd_head", "emb_bwd_segments", "classifier", "absmax_kernel", "quantize_flat",
                     "quantize_tiles", "sumsq_partial", "finish_sum", "stochastic_round", "adamw", "qk_norm_fwd",
                     "qk_norm_bwd", "layernorm_fwd", "layernorm_bwd", "gelu_fwd", "gelu_bwd"}
    vec = rt.VEC[dtype]
    launched = " ".join(rec.k.launches)
    for kernel, size in (("rmsnorm_fwd", c), ("layernorm_fwd", c), ("layernorm_bwd", c), ("qk_norm_fwd", d),
                         ("qk_norm_bwd", d), ("gelu_fwd", n * i)):
        assert (f"{kernel}<{rt.T_NAME[dtype]}, {vec}" in launched) == (size % vec == 0), kernel
        assert (f"{kernel}<{rt.T_NAME[dtype]}, 1" in launched) == (size % vec != 0), kernel


ADAM = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=2, seed=1)


@pytest.mark.parametrize("n", [1003, 4096, 3 * 2**20 + 77])
@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("master_dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("v_dtype", [torch.float32, torch.bfloat16])
def test_adamw_e4m3_m_launch(rec, n, offset, master_dtype, v_dtype):
    """An e4m3 m goes to adamw<VEC>'s block path: m_scale's pointer (null otherwise), 256 threads, one block per
    1024 elements (4 scale blocks) up to the grid-stride cap; VEC = 1 when a shard is not 4-element aligned
    (offset 1 shifts every pointer by one element); m's dtype flag is 0 (the kernel reads bytes)."""
    def flat(dt):  # a shard `offset` elements into a bigger buffer
        return torch.zeros(n + offset, dtype=dt)[offset:]

    param, m, v = flat(torch.bfloat16), flat(torch.float8_e4m3fn), flat(v_dtype)
    master = None if master_dtype is None else flat(master_dtype)
    m_scale = torch.ones(-(-n // 256))
    rec.adamw_update(param, flat(torch.bfloat16), m, v, master=master, grad_scale=torch.tensor(0.5),
                     m_scale=m_scale, **ADAM)
    (name, grid, block, args), = rec.k.calls
    assert name == f"adamw<{1 if offset else 4}>"
    assert block == (256,) and grid == (min(-(-n // 1024), 132 * 8),)
    assert int(args[2]) == m.data_ptr() and int(args[3]) == m_scale.data_ptr()
    assert [int(a) for a in args[6:11]] == [1, 1, 0, int(v_dtype == torch.bfloat16),
                                           int(master_dtype == torch.bfloat16)]
    # the fp32 / bf16 m path passes a null m_scale
    rec.adamw_update(param, flat(torch.bfloat16), flat(torch.float32), v, master=master, grad_scale=0.5, **ADAM)
    assert int(rec.k.calls[-1][3][3]) == 0


def test_adamw_e4m3_m_needs_its_block_scales(rec):
    p, g, v = torch.zeros(1003), torch.zeros(1003), torch.zeros(1003)
    q = torch.zeros(1003, dtype=torch.float8_e4m3fn)
    for bad in (None, torch.ones(3), torch.ones(4, dtype=torch.bfloat16)):
        with pytest.raises(ValueError, match="m_scale"):
            rec.adamw_update(p, g, q, v, master=None, grad_scale=1.0, m_scale=bad, **ADAM)
    with pytest.raises(ValueError, match="only for an e4m3 m"):
        rec.adamw_update(p, g, torch.zeros(1003), v, master=None, grad_scale=1.0, m_scale=torch.ones(4), **ADAM)
    with pytest.raises(TypeError, match="v must be fp32 or bf16"):
        rec.adamw_update(p, g, q, q.clone(), master=None, grad_scale=1.0, m_scale=torch.ones(4), **ADAM)
    assert rec.k.launches == []


def test_row_layout_for_real_hidden_sizes():
    from llmq_ray.backends.cupy.backend import _row_layout

    # Qwen2.5-0.5B bf16: 112 vectors of 8 -> a warp per row with 4 vectors each in the forward
    assert _row_layout(896 // 8, 8, prefer_small_k=False) == (4, 32)
    assert _row_layout(896 // 8, 8, prefer_small_k=True) == (1, 128)
    for c in (896, 1536, 2048, 3584, 4096, 5120, 8192):
        for vec in (8, 4):
            k, tx = _row_layout(c // vec, vec, prefer_small_k=False)
            assert tx * k >= c // vec and tx % 32 == 0 and tx <= 1024
    assert _row_layout(8191, 1, prefer_small_k=False) == (8, 1024)
    with pytest.raises(ValueError, match="too long"):
        _row_layout(8193, 1, prefer_small_k=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128, 256, 30, 102, 1000, 2048])
def test_qk_norm_launch_geometry(rec, dtype, d):
    """Every head dim the kernels take gets whole warps, lane groups of a power of two that cover the row, at most
    48 KiB of shared memory (RecordingKernels checks), and partial rows [2, P, D] summed by two column_sum launches;
    a head dim beyond 32 x 8 vectors goes to the torch default (no launch)."""
    hq, hkv, n = 4, 2, 3 * 5
    qkv = torch.randn(3, 5, hq + 2 * hkv, d).to(dtype)
    saved, rstd = torch.empty(n, hq + hkv, d, dtype=dtype), torch.empty(n, hq + hkv)
    w = torch.ones(d, dtype=dtype)
    rec.qk_norm_forward(qkv, saved, rstd, w, w, hq, hkv, 1e-6)
    rec.qk_norm_backward(qkv, w.clone(), w.clone(), saved, rstd, w, w, hq, hkv)
    vec = rt.VEC[dtype] if d % rt.VEC[dtype] == 0 else 1
    if d // vec > 32 * max(rt.QK_K):
        assert rec.k.launches == []
        return
    (fwd, fgrid, fblock, fargs), (bwd, bgrid, bblock, bargs), *sums = rec.k.calls
    g = int(fargs[-2])
    k = int(fwd.split(",")[-1].rstrip(">"))
    assert fwd == f"qk_norm_fwd<{rt.T_NAME[dtype]}, {vec}, {k}>" and bwd.startswith("qk_norm_bwd<")
    assert g & (g - 1) == 0 and g <= 32 and g * k >= d // vec and (k == 1 or g == 32)
    assert fgrid[0] * (fblock[0] // g) >= n * (hq + hkv)
    assert [s[0] for s in sums] == [f"column_sum<{rt.T_NAME[dtype]}>"] * 2
    blocks, rows_per_block = bgrid[0], int(bargs[-1])
    assert blocks * rows_per_block >= n * (hq + hkv) > (blocks - 1) * rows_per_block
    assert all(int(s[3][2]) == blocks and int(s[3][3]) == d for s in sums)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("c", [768, 1600, 102, 1030, 8192, 8201])
def test_layernorm_launch_geometry(rec, dtype, c):
    """LayerNorm rows of every size the register-row layout takes (up to 8192 on the scalar path) launch within
    the limits, with [2, P, C] partial rows summed by two column_sum launches; a longer scalar row goes to the torch
    default."""
    n = 7
    x, w = torch.randn(n, c).to(dtype), torch.ones(c, dtype=dtype)
    mean, rstd = torch.empty(n), torch.empty(n)
    rec.layernorm_forward(torch.empty_like(x), mean, rstd, x, w, w, 1e-5, absmax=torch.empty(()))
    rec.layernorm_backward(torch.empty_like(x), w.clone(), w.clone(), x, x, w, mean, rstd, dresidual=x.clone())
    vec = rt.VEC[dtype] if c % rt.VEC[dtype] == 0 else 1
    if vec == 1 and c > 1024 * rt.ROW_K_SCALAR:
        assert rec.k.launches == []
        return
    assert [name.split("<")[0] for name in rec.k.launches] == ["layernorm_fwd", "layernorm_bwd", "column_sum",
                                                                "column_sum"]
    assert rec.k.launches[0].startswith(f"layernorm_fwd<{rt.T_NAME[dtype]}, {vec}, ")


def test_torch_default_ops_fall_back_for_other_dtypes_and_layouts(rec):
    """fp16 tensors and non-contiguous inputs go to the base class's torch default for that call (no launch), with
    its result; mismatched shapes raise."""
    from llmq_ray.backends.base import Backend

    ref = TorchBackend("cpu")
    qkv = torch.randn(2, 3, 4 + 2 * 2, 16).half()
    outs = []
    for be in (rec, ref):
        y, saved, rstd = qkv.clone(), torch.empty(6, 6, 16, dtype=torch.half), torch.empty(6, 6)
        w = torch.linspace(0.5, 1.5, 16).half()
        be.qk_norm_forward(y, saved, rstd, w, w, 4, 2, 1e-6)
        outs.append(y)
    assert torch.equal(outs[0], outs[1])
    x = torch.randn(10, 48).t()  # [48, 10], not contiguous
    w = torch.randn(10)
    outs = []
    for be in (rec, ref):
        out, mean, rstd = torch.empty(48, 10), torch.empty(48), torch.empty(48)
        be.layernorm_forward(out, mean, rstd, x, w, w, 1e-5)
        g = torch.empty(48, 10)
        be.gelu_tanh_forward(g, x)
        outs.append((out, g))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    out, want = torch.empty(7, 9, dtype=torch.half), torch.empty(7, 9, dtype=torch.half)
    h = torch.randn(7, 9).half()
    rec.gelu_tanh_backward(out, h, h)
    Backend.gelu_tanh_backward(ref, want, h, h)
    assert torch.equal(out, want)
    assert rec.k.launches == []
    with pytest.raises(ValueError, match="Hq \\+ 2\\*Hkv"):
        rec.qk_norm_forward(torch.randn(2, 3, 7, 16), torch.empty(6, 6, 16), torch.empty(6, 6), torch.ones(16),
                            torch.ones(16), 4, 2, 1e-6)
    with pytest.raises(ValueError, match="bias"):
        rec.layernorm_forward(torch.empty(5, 8), torch.empty(5), torch.empty(5), torch.randn(5, 8), torch.ones(8),
                              torch.ones(7), 1e-5)
    with pytest.raises(ValueError, match="shapes differ"):
        rec.gelu_tanh_forward(torch.empty(5, 8), torch.randn(5, 9))
