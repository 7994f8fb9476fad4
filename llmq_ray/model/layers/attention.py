"""Causal attention as a piece: RoPE, Qwen3's QK-norm, document masking and the chunked backward.

Shapes (B batch, T sequence, Hq query heads, Hkv key/value heads, D head dim): the fused projection output
qkv [B, T, Hq + 2 Hkv, D] (model dtype; heads in the order q | k | v), the attention output att [B, T, Hq, D]
(model dtype) and the log-sum-exp of every score row, lse [B, Hq, T] (fp32, what the backward needs to rebuild
the probabilities without storing them). Grouped-query attention: query head h reads key/value head
h // (Hq / Hkv). The kernels are the backend's attention provider (``backend.attention``: SDPA, cuDNN, Triton or
the exact deterministic reference); this module decides only what they are given.

    qkv    = rope(qk_norm(qkv))           (RoPE families; Qwen3's per-head RMSNorm of q and k first)
    a, lse = causal_attention(qkv)        within documents under document masking

RoPE tables (``rope_cos``, ``rope_sin`` [T, D/2] fp32) are made once from the config's inverse frequencies.
Learned-position families (GPT-2) get none: their positions are added at the embedding.

Document masking (``ModelBuild.separator``): a window packs several documents, each ending with the
separator token, and a token attends only to earlier tokens of its own document. ``Documents`` keeps the
document index of every token (``segments`` [B, T] int32) and, for learned positions with ``reset_positions``,
each token's position inside its document (``positions`` [B, T] int64), both recomputed on the device from the
inputs of every forward (no host sync). RoPE needs no reset: its scores depend only on the distance between two
positions, so a document gets the attention it would get alone up to rounding.

The backward runs in ``attn_bwd_chunks`` slices of the batch (rows of a batch are independent, RoPE depends
only on the position, and slices along B of these contiguous [B, ...] buffers are contiguous): the kernel's
scratch (the reference's [B, H, T, T] probabilities) shrinks by that factor, the results do not change.
"""

from __future__ import annotations

import torch

from llmq_ray.backends.base import Backend
from llmq_ray.model.build import ModelBuild
from llmq_ray.model.config import ModelConfig


class Documents:
    """The document index of each token (and, with ``reset_positions``, its position in its document) for the
    micro-batch of the last forward; ``mask`` is what the attention kernels take (backends/attention.py)."""

    def __init__(self, backend: Backend, build: ModelBuild, learned_positions: bool):
        b, t, dev = build.batch, build.seq, backend.device
        self.separator = build.separator
        self.segments = torch.zeros(b, t, dtype=torch.int32, device=dev)
        self.mask = backend.attention_document_mask(self.segments, build.dtype)
        self.positions = (torch.zeros(b, t, dtype=torch.int64, device=dev)
                          if build.restart_positions and learned_positions else None)

    def refresh(self, tokens: torch.Tensor) -> None:
        """From tokens [N]: document index = separators strictly before each token; position = t minus the start
        of its document (a running max of the starts)."""
        b, t = self.segments.shape
        is_sep = (tokens.view(b, t) == self.separator).to(torch.int32)
        torch.cumsum(is_sep, dim=1, out=self.segments)
        self.segments.sub_(is_sep)
        self.mask.refresh()
        if self.positions is not None:
            pos = torch.arange(t, device=tokens.device).expand(b, -1)
            starts_here = torch.zeros_like(is_sep, dtype=torch.bool)
            starts_here[:, 1:] = is_sep[:, :-1].bool()
            start = torch.where(starts_here, pos, torch.zeros_like(pos)).cummax(dim=1).values
            torch.sub(pos, start, out=self.positions)


class Attention:
    """Causal attention over the fused qkv of ``cfg`` for micro-batches of ``build``'s shape (module docstring).
    ``rope``: apply rotary position embeddings (False: learned positions elsewhere)."""

    def __init__(self, backend: Backend, cfg: ModelConfig, build: ModelBuild, rope: bool):
        self.be, self.cfg = backend, cfg
        self.batch_size, self.chunks = build.batch, build.attention_chunks
        self.rope = rope
        self.documents = (Documents(backend, build, learned_positions=not rope)
                          if build.separator is not None else None)
        self.rope_cos = self.rope_sin = None
        if rope:
            angles = torch.arange(build.seq, dtype=torch.float32)[:, None] * cfg.rope_inv_freq()[None, :]
            self.rope_cos, self.rope_sin = angles.cos().to(backend.device), angles.sin().to(backend.device)

    @property
    def mask(self):
        """The document mask the kernels take (None without document masking)."""
        return None if self.documents is None else self.documents.mask

    def position_qk(self, qkv: torch.Tensor, qk_in=None, qk_rstd=None, q_norm_w=None, k_norm_w=None) -> None:
        """In place on the projection output qkv: Qwen3's QK-norm (its inputs and rstd saved into ``qk_in``
        [N, Hq+Hkv, D] / ``qk_rstd`` [N, Hq+Hkv] fp32) when the config has one, then RoPE."""
        cfg = self.cfg
        if cfg.qk_norm:
            self.be.qk_norm_forward(qkv, qk_in, qk_rstd, q_norm_w, k_norm_w, cfg.num_heads, cfg.num_kv_heads,
                                    cfg.rms_norm_eps)
        if self.rope:
            self.be.rope_forward(qkv, self.rope_cos, self.rope_sin, cfg.num_heads, cfg.num_kv_heads)

    def forward(self, att: torch.Tensor, lse: torch.Tensor, qkv: torch.Tensor,
                amax: torch.Tensor | None = None) -> None:
        """att, lse from the post-RoPE qkv; FP8: ``amax`` = max|att|, the out-projection's input scale."""
        self.be.attention_forward(att, lse, qkv, self.cfg.num_heads, self.cfg.num_kv_heads, self.mask)
        if amax is not None:
            self.be.absmax(amax, att)

    def backward(self, d_qkv: torch.Tensor, d_att: torch.Tensor, att: torch.Tensor, lse: torch.Tensor,
                 qkv: torch.Tensor) -> None:
        """d_qkv (the gradient of the pre-RoPE qkv under RoPE) from d_att, in ``attn_bwd_chunks`` slices."""
        cfg, be, step = self.cfg, self.be, self.batch_size // self.chunks
        for lo in range(0, self.batch_size, step):
            sl = slice(lo, lo + step)
            rows = None if self.documents is None else self.documents.mask.rows(sl)
            if self.rope:
                be.attention_rope_backward(d_qkv[sl], d_att[sl], att[sl], lse[sl], qkv[sl], self.rope_cos,
                                           self.rope_sin, cfg.num_heads, cfg.num_kv_heads, rows)
            else:
                be.attention_backward(d_qkv[sl], d_att[sl], att[sl], lse[sl], qkv[sl], cfg.num_heads,
                                      cfg.num_kv_heads, rows)

    def qk_norm_backward(self, d_qkv, dq_w, dk_w, qk_in, qk_rstd, q_norm_w, k_norm_w) -> None:
        """Qwen3: through the QK-norm to the QKV GEMM's output (after ``backward``)."""
        cfg = self.cfg
        self.be.qk_norm_backward(d_qkv, dq_w, dk_w, qk_in, qk_rstd, q_norm_w, k_norm_w, cfg.num_heads,
                                 cfg.num_kv_heads)
