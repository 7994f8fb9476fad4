"""The CuPy backend: ``get_backend("cupy", "cuda")`` -> :class:`CupyBackend`.

Hand-written CUDA C++ kernels kept as ``.cu`` sources in ``backends/cupy/kernels/`` (one file per kernel
family, each opening with what it computes and why it is fast), compiled at first use by NVRTC through
``cupy.RawModule`` for the GPU's architecture and cached on disk by CuPy (``$CUPY_CACHE_DIR``). They run on
torch tensors' memory (raw pointers) on torch's current stream. CuPy is imported only when the backend is
instantiated: without CuPy or without a GPU, that ends in one ConfigError sentence saying what to install.
"""

from __future__ import annotations

from llmq_ray.backends.cupy.backend import CupyBackend

__all__ = ["CupyBackend"]
