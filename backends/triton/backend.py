"""TritonBackend: Triton kernels for every non-GEMM, non-attention op of backends/base.py.

GEMMs (``matmul``, ``matmul_fp8``) and attention come from TorchBackend, i.e. cuBLAS(Lt) and the cuDNN / flash
attention kernels through torch, as every backend may; on CUDA the GEMMs go through backends/cublaslt.py, which
adds the FP8 weight gradients of micro-steps after the first in the GEMM's epilogue (beta = 1) and takes the
fastest of torch's call and cuBLASLt's candidate algorithms, timed once per problem (``gemm_tuning``).
Everything else is one (or, where a deterministic cross-program reduction is needed, two or three) Triton
launches, with no host sync. On a machine without CUDA the kernels run under the Triton interpreter
(``TRITON_INTERPRET=1``, set before triton is imported; backends/triton/__init__.py sets it when no GPU is
visible) on CPU tensors.
"""

from __future__ import annotations

import torch

from llmq_ray.backends import cublaslt
from llmq_ray.backends.base import Backend
from llmq_ray.backends.torch_ref import TorchBackend
from llmq_ray.backends.triton import adamw as _adamw
from llmq_ray.backends.triton import classifier as _classifier
from llmq_ray.backends.triton import embedding as _embedding
from llmq_ray.backends.triton import fp8 as _fp8
from llmq_ray.backends.triton import reduce as _reduce
from llmq_ray.backends.triton import rmsnorm as _rmsnorm
from llmq_ray.backends.triton import attention_bwd as _attention_bwd
from llmq_ray.backends.triton import bias as _bias
from llmq_ray.backends.triton import rope as _rope
from llmq_ray.backends.triton import swiglu as _swiglu
from llmq_ray.backends.triton._common import INTERPRET


def _contiguous(*tensors: torch.Tensor | None) -> None:
    for t in tensors:
        if t is not None and not t.is_contiguous():
            raise ValueError(f"triton backend: expected a contiguous tensor, got shape {tuple(t.shape)} "
                             f"strides {t.stride()}")


class TritonBackend(TorchBackend):
    """Triton kernels (CUDA, or CPU under the Triton interpreter); GEMMs and attention from TorchBackend."""

    name = "triton"
    graph_capturable = True  # every kernel is launched without a host sync (checked on the H100)
    # --deterministic-attention: the attention backward through our own kernels (attention_bwd.py, no atomics:
    # the same bits on every run) instead of cuDNN's (TorchBackend, CUDA) or the reference math (CPU)
    deterministic_attention = False

    def __init__(self, device="cpu"):
        super().__init__(device)
        if self.device.type == "cpu" and not INTERPRET:
            raise RuntimeError("the triton backend on CPU needs the Triton interpreter: set TRITON_INTERPRET=1 "
                               "before anything imports triton (or run on a CUDA device).")
        if self.device.type not in ("cpu", "cuda"):
            raise RuntimeError(f"the triton backend runs on cuda (or cpu via the interpreter), not {self.device}")

    # ------------------------------------------------------------------ GEMMs through cuBLASLt
    # Tune GEMM algorithms by timing (backends/cublaslt.py): on by default; the engine turns it off for
    # --deterministic-attention, since the choice (and with it the summation order) can differ between runs.
    gemm_tuning = True
    _cublaslt = None  # llmq_ray.backends.cublaslt.CublasLt once loaded; False when it cannot be

    def _lt(self, out: torch.Tensor):
        if self._cublaslt is None:
            try:
                self._cublaslt = cublaslt.for_device(out.device) if cublaslt.available() else False
            except cublaslt.CublasLtError:  # the library loads but a handle cannot be made: torch's GEMMs only
                self._cublaslt = False
        return self._cublaslt

    def matmul(self, out, a, b, *, transpose_a=False, transpose_b=False, bias=None, accumulate=False):
        """As TorchBackend's; with ``gemm_tuning`` on CUDA (no bias), the fastest of torch's call and cuBLASLt's
        candidate algorithms, timed at the problem's first call."""
        torch_call = super().matmul
        if self.gemm_tuning and bias is None and out.device.type == "cuda" and self._cublaslt is not False:
            lt = self._lt(out)
            if lt and lt.supports(out, a, b, transpose_a, transpose_b):
                try:
                    lt.gemm(out, a, b, trans_a=transpose_a, trans_b=transpose_b, accumulate=accumulate,
                            fallback=lambda: torch_call(out, a, b, transpose_a=transpose_a, transpose_b=transpose_b,
                                                        accumulate=accumulate))
                    return
                except cublaslt.CublasLtError:  # no algorithm for this problem (before anything was written): torch's
                    pass
        torch_call(out, a, b, transpose_a=transpose_a, transpose_b=transpose_b, bias=bias, accumulate=accumulate)

    beside_fallbacks = 0  # matmul_beside calls that could not take cuBLASLt's SM-targeted path (tests assert 0)

    def matmul_beside(self, out, a, b, *, transpose_a=False, transpose_b=False, accumulate=False, sm_count=0):
        """On CUDA with ``sm_count``: cuBLASLt's heuristic choice for that many SMs, with the current stream's own
        workspace (the compute stream's GEMMs may run at the same time); otherwise torch's call (cuBLAS keeps a
        workspace per stream), never the tuned path, which shares one workspace with the compute stream. Each
        such fallback is counted in ``beside_fallbacks``."""
        if sm_count and out.device.type == "cuda" and self._cublaslt is not False:
            lt = self._lt(out)
            if lt and lt.supports(out, a, b, transpose_a, transpose_b):
                try:
                    lt.gemm(out, a, b, trans_a=transpose_a, trans_b=transpose_b, accumulate=accumulate,
                            algo_index=0, sm_count=sm_count)
                    return
                except cublaslt.CublasLtError:  # no algorithm for this target (raised before anything is written)
                    pass
        if sm_count:
            self.beside_fallbacks += 1
        super().matmul(out, a, b, transpose_a=transpose_a, transpose_b=transpose_b, accumulate=accumulate)

    def prepare_beside(self, stream) -> None:
        if stream is not None and self._cublaslt is not False:
            with torch.cuda.device(stream.device):
                lt = self._lt(torch.empty(0, device=stream.device))
            if lt:
                lt.side_workspace(stream)

    def matmul_fp8(self, out, a, b, a_descale, b_descale, *, bias=None, accumulate=False):
        """As TorchBackend's, but ``accumulate`` (dw += dy^T x) adds in the GEMM's epilogue through cuBLASLt
        (beta = 1) instead of a torch._scaled_mm into a temporary plus an add: one pass over dw less. With
        ``gemm_tuning`` the algorithm is the fastest of cuBLASLt's candidates (and, without accumulation, of
        torch._scaled_mm's), timed at the problem's first call; without, cuBLASLt's heuristic choice."""
        torch_call = super().matmul_fp8
        if bias is None and out.device.type == "cuda" and self._cublaslt is not False:
            lt = self._lt(out)
            if lt and lt.supports(out, a, b) and (accumulate or self.gemm_tuning):
                fallback = None if accumulate else (
                    lambda: torch_call(out, a, b, a_descale, b_descale))
                try:
                    lt.gemm(out, a, b, a_descale=a_descale, b_descale=b_descale, accumulate=accumulate,
                            fallback=fallback, algo_index=None if self.gemm_tuning else 0)
                    return
                except cublaslt.CublasLtError:  # no algorithm for this problem (before anything was written): torch's
                    pass
        torch_call(out, a, b, a_descale, b_descale, bias=bias, accumulate=accumulate)

    # ------------------------------------------------------------------ attention
    def attention_backward(self, dqkv, dout, out, lse, qkv, n_q_heads, n_kv_heads):
        if self.deterministic_attention:
            return _attention_bwd.attention_backward(dqkv, dout, out, lse, qkv, n_q_heads, n_kv_heads)
        return super().attention_backward(dqkv, dout, out, lse, qkv, n_q_heads, n_kv_heads)

    def attention_rope_backward(self, dqkv, dout, out, lse, qkv, cos, sin, n_q_heads, n_kv_heads):
        if self.deterministic_attention:  # our own backward writes dqkv whole: the plain order, no cuDNN parts
            return Backend.attention_rope_backward(self, dqkv, dout, out, lse, qkv, cos, sin, n_q_heads, n_kv_heads)
        return super().attention_rope_backward(dqkv, dout, out, lse, qkv, cos, sin, n_q_heads, n_kv_heads)

    # ------------------------------------------------------------------ embedding
    def embedding_forward(self, out, tokens, table):
        _contiguous(out, tokens, table)
        _embedding.embedding_forward(out, tokens, table)

    def embedding_backward(self, dtable, tokens, dout):
        _contiguous(dtable, dout)
        _embedding.embedding_backward(dtable, tokens, dout)

    # ------------------------------------------------------------------ RMSNorm
    def rmsnorm_forward(self, out, rstd, inp, weight, eps, absmax=None):
        _contiguous(out, rstd, inp, weight)
        _rmsnorm.rmsnorm_forward(out, rstd, inp, weight, eps, absmax)

    def fused_residual_rmsnorm_forward(self, residual, out, rstd, inp1, inp2, weight, eps, absmax=None):
        _contiguous(residual, out, rstd, inp1, inp2, weight)
        _rmsnorm.rmsnorm_forward(out, rstd, inp1, weight, eps, absmax, inp2=inp2, residual=residual)

    def rmsnorm_backward(self, dinp, dweight, dout, inp, weight, rstd, dresidual=None, absmax=None):
        _contiguous(dinp, dweight, dout, inp, weight, rstd, dresidual)
        _rmsnorm.rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd, dresidual, absmax)

    # ------------------------------------------------------------------ RoPE
    def rope_forward(self, qkv, cos, sin, n_q_heads, n_kv_heads):
        _rope.rope(qkv, cos, sin, n_q_heads, n_kv_heads, inverse=False)

    def rope_backward(self, dqkv, cos, sin, n_q_heads, n_kv_heads):
        _rope.rope(dqkv, cos, sin, n_q_heads, n_kv_heads, inverse=True)

    def rope_backward_from(self, dqkv, dq, dk, dv, cos, sin, n_q_heads, n_kv_heads):
        _rope.rope_backward_from(dqkv, dq, dk, dv, cos, sin, n_q_heads, n_kv_heads)

    # ------------------------------------------------------------------ SwiGLU
    def swiglu_forward(self, out, inp, absmax=None):
        _contiguous(out, inp)
        _swiglu.swiglu_forward(out, inp, absmax)

    def swiglu_backward(self, dinp, dout, inp, absmax=None):
        _contiguous(dinp, dout, inp)
        _swiglu.swiglu_backward(dinp, dout, inp, absmax)

    def swiglu_backward_fp8(self, q, q_t, descale, dout, inp, absmax, dinp):
        if inp.dtype == torch.float32:  # the dual-store FP8 tile kernels miscompile fp32 tiles (see fp8.py)
            return Backend.swiglu_backward_fp8(self, q, q_t, descale, dout, inp, absmax, dinp)
        _contiguous(q, q_t, dout, inp)
        _swiglu.swiglu_backward_fp8(q, q_t, descale, dout, inp, absmax, dinp.dtype)  # dinp itself is not written

    def bias_backward(self, dbias, dout, absmax=None):
        _contiguous(dbias, dout)
        _bias.bias_backward(dbias, dout, absmax)

    # ------------------------------------------------------------------ FP8 quantization
    def absmax(self, out, inp):
        _contiguous(inp)
        _reduce.absmax(out, inp)

    def quantize(self, out, descale, inp, absmax):
        _contiguous(out, inp)
        _fp8.quantize(out, descale, inp, absmax)

    def quantize_transpose(self, out_t, descale, inp, absmax):
        _contiguous(out_t, inp)
        _fp8.quantize_transpose(out_t, descale, inp, absmax)

    def quantize_with_transpose(self, out, out_t, descale, inp, absmax):
        _contiguous(out, out_t, inp)
        _fp8.quantize_with_transpose(out, out_t, descale, inp, absmax)

    # ------------------------------------------------------------------ loss
    def fused_classifier(self, logits, losses, targets, dloss=1.0, write_dlogits=True):
        _contiguous(losses, targets)
        _classifier.fused_classifier(logits, losses, targets, dloss, write_dlogits)

    # ------------------------------------------------------------------ optimizer
    def adamw_update(self, param, grad, m, v, *, master, lr, beta1, beta2, eps, weight_decay, step, grad_scale,
                     seed):
        _contiguous(param, grad, m, v, master)
        if isinstance(grad_scale, torch.Tensor) and grad_scale.device != param.device:
            grad_scale = grad_scale.to(param.device, non_blocking=True)
        _adamw.adamw_update(param, grad, m, v, master=master, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                            weight_decay=weight_decay, step=step, grad_scale=grad_scale, seed=seed)

    def global_norm_squared(self, out, tensor):
        if out.dtype != torch.float32 or out.numel() != 1:
            raise TypeError(f"global_norm_squared: out must be an fp32 scalar tensor, got {out.dtype} "
                            f"{tuple(out.shape)}")
        _contiguous(tensor)
        _reduce.global_norm_squared(out, tensor)

    def stochastic_round(self, out, inp, seed):
        _contiguous(out, inp)
        _adamw.stochastic_round(out, inp, seed)
