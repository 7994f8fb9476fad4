"""The two norms, as pieces: RMSNorm (Llama, Qwen) and LayerNorm with bias (GPT-2).

Shapes (R token rows: N = B*T, or this process's rows when a plan splits the residual stream): x, out [R, C] in
the model dtype; w, b [C]; rstd and mean [R] fp32, saved for the backward. The forward is fused with the residual
add where a block ends (``residual_forward``: x_next = x + branch, then the norm of x_next): one read of each
input instead of two passes. ``amax`` (FP8 only, fp32 0-d): where the kernel writes max|out|, the scale of the
GEMM that reads ``out`` next; in the backward, max|dx|, the scale of the GEMM gradient that reads it.

    rmsnorm:    out = x * rstd * w,              rstd = 1 / sqrt(mean(x^2) + eps)
    layernorm:  out = (x - mean) * rstd * w + b, rstd = 1 / sqrt(var(x) + eps)

A plan that splits the token rows (sequence parallelism, llmq_ray/parallel/tensor.py) wraps these with the same
methods: each process normalizes its rows and the outputs are gathered.
"""

from __future__ import annotations

import torch

from llmq_ray.backends.base import Backend


class RMSNorm:
    """RMSNorm over the last dimension (the backend's kernels; ``eps`` the config's)."""

    def __init__(self, backend: Backend, eps: float):
        self.be, self.eps = backend, eps

    def forward(self, out: torch.Tensor, rstd: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                amax: torch.Tensor | None = None) -> None:
        self.be.rmsnorm_forward(out, rstd, x, w, self.eps, absmax=amax)

    def residual_forward(self, x_next: torch.Tensor, out: torch.Tensor, rstd: torch.Tensor, x: torch.Tensor,
                         branch: torch.Tensor, w: torch.Tensor, amax: torch.Tensor | None = None) -> None:
        """x_next = x + branch; out = rmsnorm(x_next)."""
        self.be.fused_residual_rmsnorm_forward(x_next, out, rstd, x, branch, w, self.eps, absmax=amax)

    def backward(self, dx: torch.Tensor, dw: torch.Tensor, dout: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                 rstd: torch.Tensor, dresidual: torch.Tensor | None = None,
                 amax: torch.Tensor | None = None) -> None:
        """dx = d rmsnorm(x) (+ dresidual, the gradient arriving along the residual); dw += ."""
        self.be.rmsnorm_backward(dx, dw, dout, x, w, rstd, dresidual=dresidual, absmax=amax)


class LayerNorm:
    """LayerNorm with bias over the last dimension; saves the row means beside rstd."""

    def __init__(self, backend: Backend, eps: float):
        self.be, self.eps = backend, eps

    def forward(self, out, mean, rstd, x, w, b, amax=None) -> None:
        self.be.layernorm_forward(out, mean, rstd, x, w, b, self.eps, absmax=amax)

    def residual_forward(self, x_next, out, mean, rstd, x, branch, w, b, amax=None) -> None:
        """x_next = x + branch; out = layernorm(x_next)."""
        self.be.fused_residual_layernorm_forward(x_next, out, mean, rstd, x, branch, w, b, self.eps, absmax=amax)

    def backward(self, dx, dw, db, dout, x, w, mean, rstd, dresidual=None, amax=None) -> None:
        self.be.layernorm_backward(dx, dw, db, dout, x, w, mean, rstd, dresidual=dresidual, absmax=amax)
