"""TritonBackend: Triton kernels for every non-GEMM, non-attention op of backends/base.py.

GEMMs and attention are components (backends/base.py): by default the ``cublaslt`` GEMM provider
(backends/gemm.py: FP8 weight gradients accumulated in the GEMM's epilogue, algorithms timed once per problem)
and the ``sdpa`` attention provider (backends/attention.py: cuDNN through torch). Everything else is one (or, where a deterministic cross-program reduction is needed, two or three) Triton
launches, with no host sync. On a machine without CUDA the kernels run under the Triton interpreter
(``TRITON_INTERPRET=1``, set before triton is imported; backends/triton/__init__.py sets it when no GPU is
visible) on CPU tensors.
"""

from __future__ import annotations

import torch

from llmq_ray.backends.base import Backend
from llmq_ray.backends.triton import adamw as _adamw
from llmq_ray.backends.triton import classifier as _classifier
from llmq_ray.backends.triton import embedding as _embedding
from llmq_ray.backends.triton import fp8 as _fp8
from llmq_ray.backends.triton import gelu as _gelu
from llmq_ray.backends.triton import layernorm as _layernorm
from llmq_ray.backends.triton import reduce as _reduce
from llmq_ray.backends.triton import rmsnorm as _rmsnorm
from llmq_ray.backends.triton import bias as _bias
from llmq_ray.backends.triton import qk_norm as _qk_norm
from llmq_ray.backends.triton import rope as _rope
from llmq_ray.backends.triton import swiglu as _swiglu
from llmq_ray.backends.triton._common import INTERPRET


def _contiguous(*tensors: torch.Tensor | None) -> None:
    for t in tensors:
        if t is not None and not t.is_contiguous():
            raise ValueError(f"triton backend: expected a contiguous tensor, got shape {tuple(t.shape)} "
                             f"strides {t.stride()}")


def _fp8_tiles_fall_back(dtype: torch.dtype) -> bool:
    """Whether the SwiGLU FP8 kernels for inputs of ``dtype`` go through Backend's generic two-pass path: the
    dual-store FP8 tile kernels miscompile fp32 tiles (see fp8.py), so fp32 does (and then the backward writes
    its bf16/fp32 ``dinp`` too)."""
    return dtype == torch.float32


class TritonBackend(Backend):
    """Triton kernels (CUDA, or CPU under the Triton interpreter) for every kernel op; GEMMs from the cuBLASLt
    provider by default, attention from the sdpa (or, --deterministic-attention, the deterministic) provider."""

    name = "triton"
    graph_capturable = True  # every kernel is launched without a host sync (checked on the H100)
    DEFAULT_GEMM = "cublaslt"

    def __init__(self, device="cpu", **components):
        super().__init__(device, **components)
        if self.device.type == "cpu" and not INTERPRET:
            raise RuntimeError("the triton backend on CPU needs the Triton interpreter: set TRITON_INTERPRET=1 "
                               "before anything imports triton (or run on a CUDA device).")
        if self.device.type not in ("cpu", "cuda"):
            raise RuntimeError(f"the triton backend runs on cuda (or cpu via the interpreter), not {self.device}")

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

    # ------------------------------------------------------------------ QK-norm (Qwen3)
    def qk_norm_forward(self, qkv, saved, rstd, q_weight, k_weight, n_q_heads, n_kv_heads, eps):
        """The fused kernel of backends/triton/qk_norm.py (one pass over the q/k heads) for the base class's
        torch default; same contract (Backend.qk_norm_forward)."""
        _qk_norm.qk_norm_forward(qkv, saved, rstd, q_weight, k_weight, n_q_heads, n_kv_heads, eps)

    def qk_norm_backward(self, dqkv, dq_weight, dk_weight, saved, rstd, q_weight, k_weight, n_q_heads, n_kv_heads):
        """qk_norm.py's backward: dx in place, weight gradients through a deterministic two-kernel reduction."""
        _qk_norm.qk_norm_backward(dqkv, dq_weight, dk_weight, saved, rstd, q_weight, k_weight, n_q_heads,
                                  n_kv_heads)

    # ------------------------------------------------------------------ LayerNorm, GELU-tanh (GPT-2)
    def layernorm_forward(self, out, mean, rstd, inp, weight, bias, eps, absmax=None):
        """The fused kernel of backends/triton/layernorm.py for the base class's torch default; same contract
        (Backend.layernorm_forward)."""
        _contiguous(out, mean, rstd, inp, weight, bias)
        _layernorm.layernorm_forward(out, mean, rstd, inp, weight, bias, eps, absmax)

    def fused_residual_layernorm_forward(self, residual, out, mean, rstd, inp1, inp2, weight, bias, eps,
                                         absmax=None):
        """layernorm.py's forward with the residual add fused in: one read of each input, one write of each
        output (Backend.fused_residual_layernorm_forward)."""
        _contiguous(residual, out, mean, rstd, inp1, inp2, weight, bias)
        _layernorm.layernorm_forward(out, mean, rstd, inp1, weight, bias, eps, absmax, inp2=inp2, residual=residual)

    def layernorm_backward(self, dinp, dweight, dbias, dout, inp, weight, mean, rstd, dresidual=None, absmax=None):
        """layernorm.py's backward: dx (+ dresidual) in one pass, weight and bias gradients through a
        deterministic two-kernel reduction (Backend.layernorm_backward)."""
        _contiguous(dinp, dweight, dbias, dout, inp, weight, mean, rstd, dresidual)
        _layernorm.layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, dresidual, absmax)

    def gelu_tanh_forward(self, out, inp, absmax=None):
        """backends/triton/gelu.py's element-wise kernel for the base class's torch default (same contract)."""
        _contiguous(out, inp)
        _gelu.gelu_tanh_forward(out, inp, absmax)

    def gelu_tanh_backward(self, dinp, dout, inp, absmax=None):
        """gelu.py's backward (the tanh recomputed from inp), with the fused max|dinp| (Backend.gelu_tanh_backward)."""
        _contiguous(dinp, dout, inp)
        _gelu.gelu_tanh_backward(dinp, dout, inp, absmax)

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

    def swiglu_forward_fp8(self, q, q_t, descale, inp, absmax, out, scale_absmax):
        if _fp8_tiles_fall_back(inp.dtype):
            return Backend.swiglu_forward_fp8(self, q, q_t, descale, inp, absmax, out, scale_absmax)
        _contiguous(q, q_t, inp)
        _swiglu.swiglu_forward_fp8(q, q_t, descale, inp, absmax, scale_absmax, out.dtype)  # out is not written

    def swiglu_backward(self, dinp, dout, inp, absmax=None):
        _contiguous(dinp, dout, inp)
        _swiglu.swiglu_backward(dinp, dout, inp, absmax)

    def swiglu_backward_fp8(self, q, q_t, descale, dout, inp, absmax, dinp, scale_absmax=None):
        if _fp8_tiles_fall_back(inp.dtype):
            return Backend.swiglu_backward_fp8(self, q, q_t, descale, dout, inp, absmax, dinp, scale_absmax)
        _contiguous(q, q_t, dout, inp)
        _swiglu.swiglu_backward_fp8(q, q_t, descale, dout, inp, absmax, dinp.dtype,  # dinp itself is not written
                                    scale_absmax=scale_absmax)

    def swiglu_backward_fp8_writes_dinp(self, dtype):
        return _fp8_tiles_fall_back(dtype)  # only the fallback above writes it

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

    def fused_classifier_fp8(self, logits, losses, targets, q, q_t, descale, dloss=1.0):
        _contiguous(losses, targets)
        _classifier.fused_classifier_fp8(logits, losses, targets, q, q_t, descale, dloss)

    # ------------------------------------------------------------------ optimizer
    def adamw_update(self, param, grad, m, v, *, master, lr, beta1, beta2, eps, weight_decay, step, grad_scale,
                     seed, m_scale=None):
        _contiguous(param, grad, m, v, master, m_scale)
        if isinstance(grad_scale, torch.Tensor) and grad_scale.device != param.device:
            grad_scale = grad_scale.to(param.device, non_blocking=True)
        _adamw.adamw_update(param, grad, m, v, master=master, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                            weight_decay=weight_decay, step=step, grad_scale=grad_scale, seed=seed,
                            m_scale=m_scale)

    def global_norm_squared(self, out, tensor):
        if out.dtype != torch.float32 or out.numel() != 1:
            raise TypeError(f"global_norm_squared: out must be an fp32 scalar tensor, got {out.dtype} "
                            f"{tuple(out.shape)}")
        _contiguous(tensor)
        _reduce.global_norm_squared(out, tensor)

    def stochastic_round(self, out, inp, seed):
        _contiguous(out, inp)
        _adamw.stochastic_round(out, inp, seed)
