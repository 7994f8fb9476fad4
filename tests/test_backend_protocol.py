"""The backend protocol (backends/base.py): every op is a backend's own kernel, a component's (GEMM / attention
provider) or an explicit entry of its fallback table; nothing is inherited silently, the start-up line names the
fallbacks, components go with any backend, and the engine and model never ask a backend what it has."""

from __future__ import annotations

import ast
import os
import re

import pytest
import torch

from llmq_ray.backends import get_backend
from llmq_ray.backends.base import ATTENTION_OPS, COMPOSED_OPS, GEMM_OPS, KERNEL_OPS, OPS, TORCH_DEFAULT_OPS, Backend
from llmq_ray.backends.cupy.backend import CupyBackend
from llmq_ray.backends.torch_ref import TorchBackend
from llmq_ray.backends.triton.backend import TritonBackend
from llmq_ray.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cupy_on_cpu() -> CupyBackend:
    """A CupyBackend without CuPy (its start-up line and tables only; no kernel is launched)."""
    be = CupyBackend.__new__(CupyBackend)
    Backend.__init__(be, "cpu")
    return be


def test_every_op_is_documented_on_the_protocol():
    for op in OPS:
        doc = getattr(Backend, op).__doc__
        assert doc and re.search(r"\[|dtype|fp32|model dtype", doc), f"Backend.{op} documents no shapes/dtypes"
    assert set(KERNEL_OPS).isdisjoint(GEMM_OPS + ATTENTION_OPS) and set(COMPOSED_OPS) <= set(KERNEL_OPS)


def test_torch_default_ops_are_documented_defaults_outside_the_kernel_table():
    """Ops with a default in torch operations on Backend (Qwen3's QK-norm, GPT-2's LayerNorm, GELU-tanh and
    positions): every backend inherits a working op, none of them is a kernel op, a component's or a fallback."""
    assert set(TORCH_DEFAULT_OPS).isdisjoint(OPS)
    for op in TORCH_DEFAULT_OPS:
        doc = getattr(Backend, op).__doc__
        assert doc and "[" in doc and "torch" in doc, f"Backend.{op} must document its shapes and its torch default"
        for cls in (TorchBackend, TritonBackend, CupyBackend):
            assert op not in cls.FALLBACKS and callable(getattr(cls, op))


@pytest.mark.parametrize("cls", [TorchBackend, TritonBackend, CupyBackend])
def test_each_kernel_op_is_native_or_in_the_fallback_table(cls):
    assert TorchBackend not in cls.__mro__[1:], f"{cls.__name__} subclasses the torch reference"
    for op in KERNEL_OPS:
        native = getattr(cls, op) is not getattr(Backend, op) or op in COMPOSED_OPS
        assert native != (op in cls.FALLBACKS), f"{cls.__name__}.{op}: native={native}, in FALLBACKS={op in cls.FALLBACKS}"
    for op in GEMM_OPS + ATTENTION_OPS:
        assert getattr(cls, op) is getattr(Backend, op), f"{cls.__name__}.{op} must be the component's"
    assert sorted(cls.native_ops() + list(cls.FALLBACKS)) == sorted(KERNEL_OPS)


def test_cupy_start_up_line_lists_exactly_its_fallback_table():
    be = _cupy_on_cpu()
    line = be.describe()
    m = re.fullmatch(r"cupy: (\d+) native ops, (\d+) from torch: ([a-z0-9_, ]+); GEMM torch, attention sdpa", line)
    assert m, line
    listed = m.group(3).split(", ")
    assert listed == list(CupyBackend.FALLBACKS) and int(m.group(2)) == len(listed)
    assert int(m.group(1)) + len(listed) == len(KERNEL_OPS)
    for op in CupyBackend.FALLBACKS:  # bound to the torch reference's kernel, not CuPy's
        assert getattr(be, op).__self__.__class__ is TorchBackend
    assert get_backend("triton", "cpu").describe() == \
        f"triton: {len(KERNEL_OPS)} native ops, none from torch; GEMM cublaslt, attention sdpa"


def test_a_backend_that_leaves_an_op_out_or_overrides_a_component_is_refused_at_definition():
    with pytest.raises(TypeError, match=r"neither implements nor lists in FALLBACKS: .*stochastic_round"):
        type("Partial", (Backend,), {op: (lambda self, *a, **k: None) for op in KERNEL_OPS if op != "stochastic_round"})
    with pytest.raises(TypeError, match=r"matmul: GEMMs and attention are components"):
        type("OwnGemm", (TorchBackend,), {"matmul": lambda self, *a, **k: None})
    with pytest.raises(TypeError, match="both implemented and listed in FALLBACKS"):
        type("Both", (TorchBackend,), {"FALLBACKS": ("absmax",)})


@pytest.mark.parametrize("name", ["torch", "triton"])
@pytest.mark.parametrize("gemm", ["torch", "cublaslt"])
def test_any_backend_takes_any_gemm_provider(name, gemm):
    """On the CPU both providers are torch's call: the same bits from any backend."""
    be = get_backend(name, "cpu", gemm=gemm)
    assert be.gemm.name == gemm
    g = torch.Generator().manual_seed(0)
    a, b, out = torch.randn(24, 16, generator=g), torch.randn(20, 16, generator=g), torch.randn(24, 20, generator=g)
    want = out.clone().addmm_(a, b.t())
    be.matmul(out, a, b, transpose_b=True, accumulate=True)
    assert torch.equal(out, want)


def test_unknown_providers_are_refused_in_one_sentence():
    with pytest.raises(ConfigError, match=r"^--gemm='cutlass' is not a GEMM provider; choose one of \['cublaslt', 'torch'\]\.$"):
        get_backend("torch", "cpu", gemm="cutlass")
    with pytest.raises(ConfigError, match=r"^attention='flash' is not an attention provider"):
        get_backend("torch", "cpu", attention="flash")


def test_engine_and_model_never_ask_a_backend_what_it_has():
    bad = []
    for sub in ("engine", "model", "train", "observe", "checkpoints"):
        folder = os.path.join(REPO, "llmq_ray", sub)
        for f in sorted(os.listdir(folder)):
            if not f.endswith(".py"):
                continue
            path = os.path.join(folder, f)
            for node in ast.walk(ast.parse(open(path).read(), path)):
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("hasattr", "getattr") \
                        and node.args and "backend" in ast.unparse(node.args[0]).lower().replace("be.", "backend."):
                    bad.append(f"llmq_ray/{sub}/{f}:{node.lineno}: {ast.unparse(node)}")
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("hasattr", "getattr") \
                        and node.args and ast.unparse(node.args[0]) in ("be", "self.backend", "backend"):
                    bad.append(f"llmq_ray/{sub}/{f}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, "\n".join(bad)
