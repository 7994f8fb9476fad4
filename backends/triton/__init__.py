"""The Triton backend: ``get_backend("triton", device)`` -> :class:`TritonBackend`.

One module per kernel family (rmsnorm, layernorm, qk_norm, rope, swiglu, gelu, classifier, embedding, fp8, adamw,
reduce); each opens with what it computes and why it is fast. Without a visible GPU, the Triton interpreter is
switched on here (``TRITON_INTERPRET=1``) *before* triton is imported, so that the backend also runs, slowly, on
CPU tensors (tests, CPU smoke runs). If triton was already imported without it, the backend refuses CPU tensors
with a clear message instead of failing deep inside Triton.
"""

from __future__ import annotations

import os
import sys

if "triton" not in sys.modules:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")

from llmq_ray.backends.triton.backend import TritonBackend  # noqa: E402

__all__ = ["TritonBackend"]
