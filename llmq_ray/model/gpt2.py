"""GPT-2 (llm.c's model): learned positions, LayerNorm with bias, biased projections and a GELU MLP.

The unit loop, the buffers and the LM head are the shared decoder's (llmq_ray/model/decoder.py); the block, for
N = B*T rows (model dtype unless said):

    x_0    = wte[tokens] + wpe[0..T-1]    positions 0..T-1 in every window (per document with reset positions)
    h      = layernorm(x_l)               ln1           [N, C]   (mean1, rstd1 [N] fp32)
    qkv    = h Wqkv^T + bqkv              qkv           [B, T, 3H, D]   (MHA, no RoPE)
    a, lse = causal_attention(qkv)        att           [B, T, H, D], lse [B, H, T] fp32
    x_mid  = x_l + a Wo^T + bo            residual_mid  [N, C]
    h2     = layernorm(x_mid)             ln2           [N, C]   (mean2, rstd2 [N] fp32)
    f      = h2 Wup^T + bup               fc            [N, I]
    g      = gelu_tanh(f)                 gelu          [N, I]
    x_l+1  = x_mid + g Wd^T + bd

and final_ln = layernorm(x_L) into the (tied) head. The four GEMMs are the same ``BlockLinears`` as Llama's (FP8
included; ``up_w`` in place of ``up_gate_w``); the recompute kinds map kind for kind (``swiglu`` recomputes the
GELU output, ``ffn`` c_fc's). The norms, GELU and positions are the backend's (``TORCH_DEFAULT_OPS`` in
backends/base.py). GPT-2 takes no SwiGLU scale (its MLP is not gated) and, under document masking, needs its
learned positions restarted at every document start for a document to be computed as if alone.
"""

from __future__ import annotations

import torch

from llmq_ray.model.decoder import Decoder
from llmq_ray.model.layers.embedding import LearnedPositions
from llmq_ray.model.layers.norms import LayerNorm


class GPT2Model(Decoder):
    """GPT-2 (``Decoder``'s constructor: cfg, backend, build, and the weights, schedule and policies it takes)."""

    ROPE = False
    NORM = LayerNorm
    MLP_OUT = "gelu"  # the down projection's input
    PROJECTIONS = ("qkv", "out", "up", "down")
    WGRAD_OVERLAP = False  # its waits are written for the Llama block

    def __init__(self, cfg, backend, build, **kw):
        if build.swiglu_scale != "current":
            raise ValueError(f"a {build.swiglu_scale!r} SwiGLU scale: GPT-2's GELU MLP has no SwiGLU")
        if build.separator is not None and not build.restart_positions:
            raise ValueError("document masking with learned positions needs them reset at every document start")
        super().__init__(cfg, backend, build, **kw)
        self.final_mean = torch.empty(build.rows, dtype=torch.float32, device=self.device)
        self.positions = LearnedPositions(backend, build.seq)
        self._apply_plan()

    def _mlp_in_grad_buffer(self, n: int) -> torch.Tensor:
        return torch.empty(n, self.cfg.intermediate_size, dtype=self.dtype, device=self.device)  # d of c_fc's output

    @property
    def _token_positions(self) -> torch.Tensor | None:
        """Each token's position in its document (reset positions), or None: 0..T-1 in every window."""
        docs = self.attention.documents
        return None if docs is None else docs.positions

    # ------------------------------------------------------------------ forward
    def embed_forward(self, tokens: torch.Tensor) -> None:
        x0 = self.acts.residual[0]
        self.embedding.forward(x0, tokens, self.w.embed)
        self.positions.forward(x0, self.w.pos_embed, self._token_positions)

    def first_norm(self) -> None:
        a, w0 = self.acts, self.w.blocks[0]
        self.norm.forward(a.get("ln1", 0), a.mean1[0], a.rstd1[0], a.residual[0], w0.ln1_w, w0.ln1_b,
                          self._amax(0, 0))

    def _attention_branch(self, layer: int, qkv_forward: bool = True, att_forward: bool = True) -> None:
        """qkv = ln1 Wqkv^T + bqkv and the attention over it (each part only where asked: recompute)."""
        a, w, n = self.acts, self.w.blocks[layer], self.build.rows
        qkv = a.get("qkv", layer)
        if qkv_forward:
            self.proj["qkv"].forward(qkv.view(n, -1), a.get("ln1", layer), w.key("qkv_w"), self._amax(layer, 0),
                                     bias=w.qkv_b)
        if att_forward:
            self.attention.forward(a.get("att", layer), a.get("lse", layer), qkv, self._amax(layer, 1))

    def _out_proj(self, layer: int) -> torch.Tensor:
        a, w = self.acts, self.w.blocks[layer]
        return self.proj["out"].forward(self.scratch_nc, a.get("att", layer).view(self.build.rows, -1),
                                        w.key("out_w"), self._amax(layer, 1), bias=w.out_b)

    def _ln2(self, layer: int, branch: torch.Tensor) -> None:
        """x_mid = x_l + branch; ln2 = layernorm(x_mid)."""
        a, w = self.acts, self.w.blocks[layer]
        self.norm.residual_forward(a.get("residual_mid", layer), a.get("ln2", layer), a.mean2[layer], a.rstd2[layer],
                                   a.residual[layer], branch, w.ln2_w, w.ln2_b, self._amax(layer, 2))

    def _fc(self, layer: int) -> None:
        a, w = self.acts, self.w.blocks[layer]
        self.proj["up"].forward(a.get("fc", layer), a.get("ln2", layer), w.key("up_w"), self._amax(layer, 2),
                                bias=w.up_b)

    def _gelu(self, layer: int) -> None:
        self.backend.gelu_tanh_forward(self.acts.get("gelu", layer), self.acts.get("fc", layer),
                                       absmax=self._amax(layer, 3))

    def block_forward(self, layer: int) -> None:
        """ln1 of ``layer`` is already written (by the embedding's LayerNorm or the previous block's fused
        residual add), and this block writes the next one's (or the final norm's)."""
        a, w = self.acts, self.w.blocks[layer]
        self._attention_branch(layer)
        self._ln2(layer, self._out_proj(layer))
        self._fc(layer)
        self._gelu(layer)
        branch = self.proj["down"].forward(self.scratch_nc, a.get("gelu", layer), w.key("down_w"),
                                           self._amax(layer, 3), bias=w.down_b)
        mid = a.get("residual_mid", layer)
        if layer + 1 == self.cfg.num_layers:
            self.norm.residual_forward(a.residual[layer + 1], self.final_ln, self.final_mean, self.final_rstd, mid,
                                       branch, self.w.final_norm, self.w.final_norm_b, self.head.x_amax)
        else:
            nw = self.w.blocks[layer + 1]
            self.norm.residual_forward(a.residual[layer + 1], a.get("ln1", layer + 1), a.mean1[layer + 1],
                                       a.rstd1[layer + 1], mid, branch, nw.ln1_w, nw.ln1_b, self._amax(layer + 1, 0))

    # ------------------------------------------------------------------ backward
    def _recompute(self, layer: int) -> None:
        """The same recompute kinds, the same kernels on the same inputs as the forward."""
        rc, a, w = self.recompute, self.acts, self.w.blocks[layer]
        if rc.norm:
            self.norm.forward(a.get("ln1", layer), a.mean1[layer], a.rstd1[layer], a.residual[layer], w.ln1_w,
                              w.ln1_b, self._amax(layer, 0))
        self._attention_branch(layer, qkv_forward=rc.qkv, att_forward=rc.att)
        if rc.block:
            self._ln2(layer, self._out_proj(layer))
        elif rc.norm:
            self.norm.forward(a.get("ln2", layer), a.mean2[layer], a.rstd2[layer], a.get("residual_mid", layer),
                              w.ln2_w, w.ln2_b, self._amax(layer, 2))
        if rc.ffn:
            self._fc(layer)
        if rc.swiglu:
            self._gelu(layer)

    def final_norm_backward(self, d_head_in: torch.Tensor) -> None:
        self.norm.backward(self.d_residual, self.g.final_norm, self.g.final_norm_b, d_head_in, self.acts.residual[-1],
                           self.w.final_norm, self.final_mean, self.final_rstd, amax=self._dy_amax())

    def block_backward(self, layer: int) -> None:
        """On entry d_residual = dL/dx_{l+1} (and, under FP8, max|d_residual| in ``lin.dy_amax`` from the
        LayerNorm backward above); on exit dL/dx_l. Weight and bias grads += ."""
        be, a, p = self.backend, self.acts, self.proj
        w, g = self.w.blocks[layer], self.g.blocks[layer]
        n = self.build.rows
        self._recompute(layer)
        dres, acc = self.d_residual, not (self._block_grads_zero or self.store.layer_grads_fresh)
        # MLP: x_{l+1} = x_mid + gelu(ln2 Wup^T + bup) Wd^T + bd
        be.bias_backward(g.down_b, dres)
        p["down"].backward(self.d_swiglu, g.down_w, dres, a.get("gelu", layer), w.key("down_w"), self._amax(layer, 3),
                           acc, dy_amax_ready=True)
        d_fc = self.d_up_gate
        be.gelu_tanh_backward(d_fc, self.d_swiglu, a.get("fc", layer), absmax=self._dy_amax())
        be.bias_backward(g.up_b, d_fc)
        d_ln = p["up"].backward(self.d_ln, g.up_w, d_fc, a.get("ln2", layer), w.key("up_w"), self._amax(layer, 2),
                                acc, dy_amax_ready=True)
        self.norm.backward(dres, g.ln2_w, g.ln2_b, d_ln, a.get("residual_mid", layer), w.ln2_w, a.mean2[layer],
                           a.rstd2[layer], dresidual=dres, amax=self._dy_amax())
        # attention: x_mid = x_l + attention(ln1 Wqkv^T + bqkv) Wo^T + bo
        be.bias_backward(g.out_b, dres)
        att = a.get("att", layer)
        p["out"].backward(self.d_att.view(n, -1), g.out_w, dres, att.view(n, -1), w.key("out_w"), self._amax(layer, 1),
                          acc, dy_amax_ready=True)
        self.attention.backward(self.d_qkv, self.d_att, att, a.get("lse", layer), a.get("qkv", layer))
        d_qkv = self.d_qkv.view(n, -1)
        be.bias_backward(g.qkv_b, d_qkv, absmax=self._dy_amax())  # FP8: the QKV GEMM's dy scale, same read
        d_ln = p["qkv"].backward(self.d_ln, g.qkv_w, d_qkv, a.get("ln1", layer), w.key("qkv_w"), self._amax(layer, 0),
                                 acc, dy_amax_ready=True)
        self.norm.backward(dres, g.ln1_w, g.ln1_b, d_ln, a.residual[layer], w.ln1_w, a.mean1[layer], a.rstd1[layer],
                           dresidual=dres, amax=self._dy_amax() if layer > 0 else None)

    def embed_backward(self, tokens: torch.Tensor) -> None:
        self.embedding.backward(self.g.embed, tokens, self.d_residual)
        self.positions.backward(self.g.pos_embed, self.d_residual, self._token_positions)
