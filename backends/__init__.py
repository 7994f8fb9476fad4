"""Kernel backends, picked by name: ``get_backend("torch", device)``.

``torch`` (alias ``torch_ref``) is the PyTorch reference and ground truth; ``triton`` and ``cupy`` are the
fast paths. The GEMMs and the attention are components any backend takes (backends/gemm.py,
backends/attention.py); ``Backend`` in backends/base.py is the protocol. Backends are imported lazily so that a missing optional dependency (CuPy, a GPU) only matters
when that backend is asked for, and then ends in one clear sentence.
"""

from __future__ import annotations

import importlib

from llmq_ray.backends.base import Backend

_REGISTRY = {
    "torch": ("llmq_ray.backends.torch_ref", "TorchBackend"),
    "torch_ref": ("llmq_ray.backends.torch_ref", "TorchBackend"),
    "triton": ("llmq_ray.backends.triton", "TritonBackend"),
    "cupy": ("llmq_ray.backends.cupy", "CupyBackend"),
}


def available_backends() -> list[str]:
    """Names accepted by get_backend (whether or not their dependencies are installed)."""
    return sorted(k for k in _REGISTRY if k != "torch_ref")


def get_backend(name: str, device="cpu", *, gemm: str | None = None, attention: str = "sdpa",
                gemm_tuning: bool = True) -> Backend:
    """Instantiate the backend called ``name`` on ``device`` with its components (backends/base.py): the GEMM
    provider ``gemm`` (None: the backend's default; "torch" or "cublaslt") with ``gemm_tuning``, and the attention
    provider ``attention`` ("sdpa" or "deterministic"). Unknown names raise ConfigError."""
    from llmq_ray.errors import ConfigError

    if name not in _REGISTRY:
        raise ConfigError(f"--backend={name!r} is not a known backend; choose one of {available_backends()}.")
    module_name, cls_name = _REGISTRY[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith(module_name):
            raise ConfigError(f"--backend={name!r} is not implemented yet in this version of llmq-ray.") from exc
        raise
    return getattr(module, cls_name)(device, gemm=gemm, attention=attention, gemm_tuning=gemm_tuning)


__all__ = ["Backend", "get_backend", "available_backends"]
