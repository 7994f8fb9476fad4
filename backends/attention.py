"""Attention providers: causal grouped-query attention any backend can take, kept apart from the kernel backends.

A backend's ``attention_forward`` / ``attention_backward`` / ``attention_rope_backward`` are this component's (the
contracts, shapes and dtypes are documented on ``Backend`` in backends/base.py). Two providers:

* ``sdpa``: on CUDA in bf16/fp16, torch's fused cuDNN kernels called without autograd (backends/_aten_attention.py;
  its backward hands back dq/dk/dv as separate tensors, which go straight into the backend's
  ``rope_backward_from``); otherwise (CPU, fp32) the exact reference math below. Fast, but cuDNN's backward sums
  with atomics, so its bits can differ between runs.
* ``deterministic`` (--deterministic-attention): the same forward, and the backward through our own Triton kernel
  (backends/triton/attention_bwd.py, no atomics: the same bits on every run; under the Triton interpreter on CPU).

Document masking (``--document-masking``): every op takes an optional ``documents`` (a ``DocumentMask``: the
document index of each token inside its window, [B, T], and each document's bounds, built on the device once per
forward by DocumentMask.refresh: no host sync, so CUDA graphs capture it); a query then attends only to earlier
keys of its own document (causal and block-diagonal). The exact math masks the scores with the segment ids. On
the GPU (``DOCUMENT_KERNELS``), by default our Triton forward and backward (backends/triton/attention_fwd.py,
attention_bwd.py; the latter is also --deterministic-attention's) take the segment ids and skip every tile
outside a document. The alternative, "cudnn", hands cuDNN's fused kernels (which take no segment ids) an
additive score bias [B, 1, T, T] (0 inside a document, -30000 across) shared by every layer: they compute every
causal tile and read the bias besides. Why not the variable-length (cumulative sequence lengths) kernels: they
size their launch by the number of documents, which lives on the device (a host sync per step, no graph capture)
unless padded to the worst case of one document per token; and flash's kernel is ~1.6x slower than cuDNN's dense
causal one at our shapes (module docstring of _aten_attention.py), which masking would not win back at
documents of hundreds of tokens.
"""

from __future__ import annotations

import math

import torch


# The score bias across documents: finite, so that a tile of keys all in other documents gives an online softmax
# no (-inf) - (-inf) = NaN, yet far enough below any real score that exp() of it is exactly 0 in fp32 (a
# probability of exactly zero, as -inf would give: below about -104 exp underflows).
MASKED_SCORE_BIAS = -30000.0


class DocumentMask:
    """The documents of a packed batch, as the attention ops take them (module docstring).

    ``segments`` [B, T] int32: the document index of each token inside its window (the model fills it on the
    device from each micro-step's inputs, then calls ``refresh``). ``starts`` / ``ends`` [B, T] int32: the position
    of the first token of each token's document and one past its last (inside the window): the tile bounds of the
    Triton backward (backends/triton/attention_bwd.py), which skips whole tiles outside a document. ``bias``
    [B, 1, T, T] in the model dtype, or None: 0 where query and key lie in the same document, ``MASKED_SCORE_BIAS``
    elsewhere; made only when the fused cuDNN kernel will run (SdpaAttention.document_mask), B*T*T*2 bytes
    (64 MiB at B=32, T=1024), shared by every layer's forward, recompute and backward. ``rows(sl)`` is the mask
    of a slice of the batch (the chunked backward)."""

    def __init__(self, segments: torch.Tensor, bias: torch.Tensor | None = None):
        self.segments = segments
        self.starts = torch.zeros_like(segments)
        self.ends = torch.zeros_like(segments)
        self.bias = bias
        self._cross = None if bias is None else torch.empty(bias.shape, dtype=torch.bool, device=bias.device)

    def refresh(self) -> None:
        """Rebuild ``starts``, ``ends`` and ``bias`` from ``segments`` (after the model wrote this micro-step's);
        device work only, no host sync."""
        seg = self.segments
        t = seg.shape[1]
        pos = torch.arange(t, dtype=torch.int32, device=seg.device).expand_as(seg)
        new_doc = torch.ones_like(seg, dtype=torch.bool)
        torch.ne(seg[:, 1:], seg[:, :-1], out=new_doc[:, 1:])
        self.starts.copy_(torch.where(new_doc, pos, 0).cummax(dim=1).values)
        doc_ends = torch.ones_like(new_doc)  # the last token of a document: the next token starts another
        doc_ends[:, :-1] = new_doc[:, 1:]
        self.ends.copy_(torch.where(doc_ends, pos + 1, t).flip(1).cummin(dim=1).values.flip(1))
        if self.bias is not None:
            torch.ne(seg[:, None, :, None], seg[:, None, None, :], out=self._cross)
            self.bias.zero_().masked_fill_(self._cross, MASKED_SCORE_BIAS)

    def rows(self, sl: slice) -> "DocumentMask":
        part = DocumentMask.__new__(DocumentMask)
        part.segments, part.starts, part.ends = self.segments[sl], self.starts[sl], self.ends[sl]
        part.bias = None if self.bias is None else self.bias[sl]
        part._cross = None
        return part


def _allowed_mask_to_fill(t: int, segments: torch.Tensor | None, device) -> torch.Tensor:
    """The True-where-masked score mask: causal [T, T], or with ``segments`` [B, T] causal-and-same-document
    as [B, 1, T, T] (broadcast over the heads). The diagonal is never masked, so no softmax row is empty."""
    causal = torch.ones(t, t, dtype=torch.bool, device=device).triu(1)
    if segments is None:
        return causal
    other_doc = segments[:, None, :, None] != segments[:, None, None, :]
    return causal | other_doc


def _bias(documents: DocumentMask | None) -> torch.Tensor | None:
    """The fused kernel's score bias of ``documents`` (None without document masking)."""
    if documents is None:
        return None
    if documents.bias is None:
        raise ValueError("document masking on the fused cuDNN path needs the DocumentMask's bias: make the mask "
                         "with the attention provider's document_mask() for the model dtype")
    return documents.bias


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
    # The kernels under document masking on the GPU: "triton" (backends/triton/attention_fwd.py and
    # attention_bwd.py, which skip the tiles outside each document; no bias tensor) or "cudnn" (cuDNN's fused
    # kernels with the score bias). benchmarks/attention_doc_mask.py times both.
    DOCUMENT_KERNELS = "triton"

    def __init__(self, device: torch.device):
        self.device = device
        self._triton = None  # (attention_fwd, attention_bwd) of backends/triton/, when document masking needs them
        self._aten = None  # backends/_aten_attention.py on CUDA
        if device.type == "cuda":
            from llmq_ray.backends import _aten_attention

            self._aten = _aten_attention

    def _fused(self, qkv_dtype: torch.dtype) -> bool:
        return self._aten is not None and qkv_dtype in (torch.bfloat16, torch.float16)

    def document_mask(self, segments: torch.Tensor, dtype: torch.dtype) -> DocumentMask:
        """The DocumentMask over ``segments`` [B, T] for attention in ``dtype`` (the model dtype): with the
        score bias cuDNN's fused kernels need when they will run (CUDA, bf16/fp16, ``DOCUMENT_KERNELS`` "cudnn"
        or no triton), the segment ids and document bounds alone otherwise."""
        if not self._fused(dtype) or self._tile_skipping(DocumentMask(segments)):
            return DocumentMask(segments)
        b, t = segments.shape
        return DocumentMask(segments, torch.zeros(b, 1, t, t, dtype=dtype, device=segments.device))

    def forward(self, out, lse, qkv, n_q_heads, n_kv_heads, documents=None):
        if self._fused(qkv.dtype):
            if self._tile_skipping(documents):
                return self._triton[0].attention_forward(out, lse, qkv, n_q_heads, n_kv_heads, documents)
            return self._aten.forward(out, lse, qkv, n_q_heads, n_kv_heads, _bias(documents))
        segments = None if documents is None else documents.segments
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

    def _tile_skipping(self, documents) -> bool:
        """Whether document masking on the fused path runs our Triton kernels (``DOCUMENT_KERNELS``; they need
        triton: without it, cuDNN's with the score bias)."""
        if documents is None or self.DOCUMENT_KERNELS != "triton":
            return False
        if self._triton is None:
            try:
                from llmq_ray.backends.triton import attention_bwd, attention_fwd
            except ImportError:
                self.DOCUMENT_KERNELS = "cudnn"
                return False
            self._triton = (attention_fwd, attention_bwd)
        return True

    def backward(self, dqkv, dout, out, lse, qkv, n_q_heads, n_kv_heads, documents=None):
        if self._fused(qkv.dtype):
            if self._tile_skipping(documents):
                return self._triton[1].attention_backward(dqkv, dout, out, lse, qkv, n_q_heads, n_kv_heads,
                                                          documents)
            return self._aten.backward(dqkv, dout, out, lse, qkv, n_q_heads, n_kv_heads, _bias(documents))
        segments = None if documents is None else documents.segments
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

    def rope_backward(self, backend, dqkv, dout, out, lse, qkv, cos, sin, n_q_heads, n_kv_heads, documents=None):
        """The gradient of the pre-RoPE qkv: cuDNN's dq/dk/dv go straight into ``backend.rope_backward_from``
        (no copy into dqkv first); otherwise ``backward`` then ``backend.rope_backward`` in place."""
        if self._fused(qkv.dtype) and not self._tile_skipping(documents):
            dq, dk, dv = self._aten.backward_parts(dout, out, lse, qkv, n_q_heads, n_kv_heads, _bias(documents))
            return backend.rope_backward_from(dqkv, dq, dk, dv, cos, sin, n_q_heads, n_kv_heads)
        self.backward(dqkv, dout, out, lse, qkv, n_q_heads, n_kv_heads, documents)
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

    def backward(self, dqkv, dout, out, lse, qkv, n_q_heads, n_kv_heads, documents=None):
        self._kernel.attention_backward(dqkv, dout, out, lse, qkv, n_q_heads, n_kv_heads, documents)

    def rope_backward(self, backend, dqkv, dout, out, lse, qkv, cos, sin, n_q_heads, n_kv_heads, documents=None):
        # our backward writes dqkv whole: the plain order, no cuDNN parts
        self.backward(dqkv, dout, out, lse, qkv, n_q_heads, n_kv_heads, documents)
        backend.rope_backward(dqkv, cos, sin, n_q_heads, n_kv_heads)


ATTENTION_PROVIDERS = {"sdpa": SdpaAttention, "deterministic": DeterministicAttention}
