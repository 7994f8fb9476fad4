"""Attention providers: causal grouped-query attention any backend can take, kept apart from the kernel backends.

A backend's ``attention_forward`` / ``attention_backward`` / ``attention_rope_backward`` are this component's (the
contracts, shapes and dtypes are documented on ``Backend`` in backends/base.py). Two providers:

* ``sdpa``: on CUDA in bf16/fp16, torch's fused cuDNN kernels called without autograd (backends/_aten_attention.py;
  its backward hands back dq/dk/dv as separate tensors, which go straight into the backend's
  ``rope_backward_from``); otherwise (CPU, fp32) the exact reference math below. Fast, but cuDNN's backward sums
  with atomics, so its bits can differ between runs.
* ``deterministic`` (--deterministic-attention): the same forward, and the backward through our own Triton kernel
  (backends/triton/attention_bwd.py, no atomics: the same bits on every run; under the Triton interpreter on CPU).

Document masking (``--document-masking``): every op takes an optional ``segments`` int [B, T], the document
index of each token inside its window; a query then attends only to earlier keys of its own document (causal
and block-diagonal). Only the exact math takes it so far: the fused cuDNN path and the deterministic backward
refuse it in one sentence (the variable-length GPU path is still to come).
"""

from __future__ import annotations

import math

import torch


def _allowed_mask_to_fill(t: int, segments: torch.Tensor | None, device) -> torch.Tensor:
    """The True-where-masked score mask: causal [T, T], or with ``segments`` [B, T] causal-and-same-document
    as [B, 1, T, T] (broadcast over the heads). The diagonal is never masked, so no softmax row is empty."""
    causal = torch.ones(t, t, dtype=torch.bool, device=device).triu(1)
    if segments is None:
        return causal
    other_doc = segments[:, None, :, None] != segments[:, None, None, :]
    return causal | other_doc


def _refuse_segments(what: str, segments) -> None:
    if segments is not None:
        from llmq_ray.errors import ConfigError

        raise ConfigError(f"--document-masking runs on the exact attention path only (CPU, or fp32), not with "
                          f"{what} yet.")


def _split_heads(qkv: torch.Tensor, n_q: int, n_kv: int):
    """qkv[B, T, Hq+2Hkv, D] -> fp32 q[B, Hq, T, D], k and v[B, Hkv, T, D]."""
    q = qkv[:, :, :n_q].float().transpose(1, 2)
    k = qkv[:, :, n_q:n_q + n_kv].float().transpose(1, 2)
    v = qkv[:, :, n_q + n_kv:].float().transpose(1, 2)
    return q, k, v


class SdpaAttention:
    """cuDNN on CUDA in bf16/fp16, the exact math otherwise (module docstring)."""

    name = "sdpa"
    deterministic = False

    def __init__(self, device: torch.device):
        self.device = device
        self._aten = None  # backends/_aten_attention.py on CUDA
        if device.type == "cuda":
            from llmq_ray.backends import _aten_attention

            self._aten = _aten_attention

    def _fused(self, qkv: torch.Tensor) -> bool:
        return self._aten is not None and qkv.dtype in (torch.bfloat16, torch.float16)

    def forward(self, out, lse, qkv, n_q_heads, n_kv_heads, segments=None):
        if self._fused(qkv):
            _refuse_segments("the fused cuDNN attention (CUDA, bf16)", segments)
            return self._aten.forward(out, lse, qkv, n_q_heads, n_kv_heads)
        q, k, v = _split_heads(qkv, n_q_heads, n_kv_heads)
        group = n_q_heads // n_kv_heads
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        t = q.shape[2]
        scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
        scores.masked_fill_(_allowed_mask_to_fill(t, segments, qkv.device), float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - row_lse[..., None])
        lse.copy_(row_lse)
        out.copy_((probs @ v).transpose(1, 2))

    def backward(self, dqkv, dout, out, lse, qkv, n_q_heads, n_kv_heads, segments=None):
        if self._fused(qkv):
            _refuse_segments("the fused cuDNN attention (CUDA, bf16)", segments)
            return self._aten.backward(dqkv, dout, out, lse, qkv, n_q_heads, n_kv_heads)
        q, k, v = _split_heads(qkv, n_q_heads, n_kv_heads)
        b, _, t, d = q.shape
        group = n_q_heads // n_kv_heads
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scale = 1.0 / math.sqrt(d)
        scores = (q @ k.transpose(-1, -2)) * scale
        scores.masked_fill_(_allowed_mask_to_fill(t, segments, qkv.device), float("-inf"))
        probs = torch.exp(scores - lse.float()[..., None])
        do = dout.float().transpose(1, 2)  # [B, Hq, T, D]
        o = out.float().transpose(1, 2)
        dv = probs.transpose(-1, -2) @ do
        dp = do @ v.transpose(-1, -2)
        row_dot = (do * o).sum(-1, keepdim=True)
        ds = probs * (dp - row_dot)
        dq = (ds @ k) * scale
        dk = (ds.transpose(-1, -2) @ q) * scale
        dk = dk.view(b, n_kv_heads, group, t, d).sum(2)
        dv = dv.view(b, n_kv_heads, group, t, d).sum(2)
        dqkv[:, :, :n_q_heads] = dq.transpose(1, 2).to(dqkv.dtype)
        dqkv[:, :, n_q_heads:n_q_heads + n_kv_heads] = dk.transpose(1, 2).to(dqkv.dtype)
        dqkv[:, :, n_q_heads + n_kv_heads:] = dv.transpose(1, 2).to(dqkv.dtype)

    def rope_backward(self, backend, dqkv, dout, out, lse, qkv, cos, sin, n_q_heads, n_kv_heads, segments=None):
        """The gradient of the pre-RoPE qkv: cuDNN's dq/dk/dv go straight into ``backend.rope_backward_from``
        (no copy into dqkv first); otherwise ``backward`` then ``backend.rope_backward`` in place."""
        if self._fused(qkv):
            _refuse_segments("the fused cuDNN attention (CUDA, bf16)", segments)
            dq, dk, dv = self._aten.backward_parts(dout, out, lse, qkv, n_q_heads, n_kv_heads)
            return backend.rope_backward_from(dqkv, dq, dk, dv, cos, sin, n_q_heads, n_kv_heads)
        self.backward(dqkv, dout, out, lse, qkv, n_q_heads, n_kv_heads, segments)
        backend.rope_backward(dqkv, cos, sin, n_q_heads, n_kv_heads)


class DeterministicAttention(SdpaAttention):
    """The sdpa forward; the backward through our Triton kernel, bit-reproducible (module docstring)."""

    name = "deterministic"
    deterministic = True

    def __init__(self, device: torch.device):
        super().__init__(device)
        try:
            import llmq_ray.backends.triton  # noqa: F401 - the interpreter on without a GPU, before triton loads
            from llmq_ray.backends.triton import attention_bwd
        except ImportError as exc:
            from llmq_ray.errors import ConfigError

            raise ConfigError(f"--deterministic-attention runs a Triton kernel, and triton cannot be imported "
                              f"here ({exc}).") from exc

        self._kernel = attention_bwd

    def backward(self, dqkv, dout, out, lse, qkv, n_q_heads, n_kv_heads, segments=None):
        _refuse_segments("--deterministic-attention", segments)
        self._kernel.attention_backward(dqkv, dout, out, lse, qkv, n_q_heads, n_kv_heads)

    def rope_backward(self, backend, dqkv, dout, out, lse, qkv, cos, sin, n_q_heads, n_kv_heads, segments=None):
        # our backward writes dqkv whole: the plain order, no cuDNN parts
        self.backward(dqkv, dout, out, lse, qkv, n_q_heads, n_kv_heads, segments)
        backend.rope_backward(dqkv, cos, sin, n_q_heads, n_kv_heads)


ATTENTION_PROVIDERS = {"sdpa": SdpaAttention, "deterministic": DeterministicAttention}
