"""The Llama family: Llama, Qwen2 (QKV bias) and Qwen3 (QK-norm) dense decoders.

One block, for N = B*T rows (the residual stream ``x_l`` [N, C] is the block's input; model dtype unless said):

    h      = rmsnorm(x_l)                 ln1           [N, C]     (rstd1 [N] fp32)
    qkv    = rope(h Wqkv^T + b)           qkv           [B, T, Hq+2Hkv, D]   (Qwen3: rmsnorm of q, k first)
    a, lse = causal_gqa_attention(qkv)    att           [B, T, Hq, D], lse [B, Hq, T] fp32
    x_mid  = x_l + a Wo^T                 residual_mid  [N, C]
    h2     = rmsnorm(x_mid)               ln2           [N, C]     (rstd2 [N] fp32)
    u      = h2 Wug^T                     up_gate       [N, 2I]  ([up | gate])
    s      = up * silu(gate)              swiglu        [N, I]
    x_l+1  = x_mid + s Wd^T

x_0 = wte[tokens]; after the last block final_ln = rmsnorm(x_L) goes to the LM head. Every residual add is fused
with the norm after it (``RMSNorm.residual_forward``), so the block writes the next block's ln1 (or final_ln).
The four GEMMs are ``Projection`` pieces over the model's ``BlockLinears`` (model dtype or FP8,
llmq_ray/model/layers/linear.py); the norms, attention and embedding are the pieces of llmq_ray/model/layers/.

The down projection's FP8 input s has three scales (``ModelBuild.swiglu_scale``):

* "current": max|s| of this very tensor, written by the SwiGLU kernel.
* "delayed": the maxima of the layer's previous forward (``swiglu_out_amax`` [L] fp32) and, for the SwiGLU
  backward's FP8 output, of its previous backward (``swiglu_dy_amax`` [L]): each kernel then quantizes in the same
  pass that computes, one read less per tensor. The first pass measures its own (``_swiglu_*_filled`` False until
  then). The forward's delayed scale needs q(x^T) kept for the wgrad (no recomputation): its kernel writes only
  the FP8 copies of s. Values beyond the kept maximum saturate at the FP8 maximum (the FP8 monitor counts them:
  ``count_saturated_swiglu_fp8``).
* "smooth": per-channel power-of-two factors folded into the down projection (llmq_ray/model/layers/smooth_swiglu.py).
"""

from __future__ import annotations

import torch

from llmq_ray.model.decoder import Decoder
from llmq_ray.model.layers.norms import RMSNorm
from llmq_ray.model.layers.smooth_swiglu import SmoothSwiGLU


class LlamaModel(Decoder):
    """Llama / Qwen2 / Qwen3 (``Decoder``'s constructor: cfg, backend, build, and the weights, schedule and
    policies it takes)."""

    ROPE = True
    NORM = RMSNorm
    MLP_OUT = "swiglu"  # the down projection's input
    PROJECTIONS = ("qkv", "out", "up_gate", "down")
    WGRAD_OVERLAP = True

    def __init__(self, cfg, backend, build, **kw):
        super().__init__(cfg, backend, build, **kw)
        dev, L = self.device, cfg.num_layers
        delayed = build.swiglu_scale == "delayed" and self.lin.fp8
        self.swiglu_dy_amax = torch.zeros(L, dtype=torch.float32, device=dev) if delayed else None
        self._swiglu_dy_measured = torch.zeros_like(self.swiglu_dy_amax) if delayed else None
        self.swiglu_out_amax = (torch.zeros(L, dtype=torch.float32, device=dev)
                                if delayed and self.lin.store_xt else None)
        self._swiglu_dy_amax_filled = self._swiglu_out_amax_filled = False
        if build.swiglu_scale == "smooth" and self.lin.fp8:
            hidden, inter = self.layout.slots[self.w.blocks[0].key("down_w")].shape
            self.smooth = SmoothSwiGLU(backend, L, hidden, inter, self.dtype, self.lin.fwd_dtype, dev)
        self._apply_plan()

    def _mlp_in_grad_buffer(self, n: int) -> torch.Tensor:
        width = 2 * self.cfg.intermediate_size
        if self.build.fp8 and not self.backend.swiglu_backward_fp8_writes_dinp(self.dtype):
            # FP8: the SwiGLU backward writes only the up+gate GEMM's FP8 gradient, which then reads d_up_gate
            # for its shape alone: a [N, 2I] view of one element instead of the buffer
            return torch.empty((), dtype=self.dtype, device=self.device).expand(n, width)
        return torch.empty(n, width, dtype=self.dtype, device=self.device)

    def needs_weights(self, layer: int) -> bool:
        """Smooth-SwiGLU makes its down-projection copy from the model-dtype weight every micro-step."""
        return True if self.smooth is not None else super().needs_weights(layer)

    # ------------------------------------------------------------------ forward
    def embed_forward(self, tokens: torch.Tensor) -> None:
        self.embedding.forward(self.acts.residual[0], tokens, self.w.embed)

    def first_norm(self) -> None:
        a = self.acts
        self.norm.forward(a.get("ln1", 0), a.rstd1[0], a.residual[0], self.w.blocks[0].ln1_w, amax=self._amax(0, 0))

    def _qkv_forward(self, layer: int) -> torch.Tensor:
        """qkv = rope(qk_norm(ln1 Wqkv^T + b)) of ``layer``."""
        a, w = self.acts, self.w.blocks[layer]
        qkv = a.get("qkv", layer)
        self.proj["qkv"].forward(qkv.view(self.build.rows, -1), a.get("ln1", layer), w.key("qkv_w"),
                                 self._amax(layer, 0), bias=w.qkv_b)
        self.attention.position_qk(qkv, *self._qk_norm_args(layer))
        return qkv

    def _qk_norm_args(self, layer: int) -> tuple:
        if not self.cfg.qk_norm:
            return ()
        w = self.w.blocks[layer]
        return self.acts.get("qk_in", layer), self.acts.get("qk_rstd", layer), w.q_norm_w, w.k_norm_w

    def _attention_forward(self, layer: int, qkv: torch.Tensor) -> None:
        a = self.acts
        self.attention.forward(a.get("att", layer), a.get("lse", layer), qkv, self._amax(layer, 1))

    def _out_proj(self, layer: int) -> torch.Tensor:
        """The attention branch a Wo^T (the tensor the residual add reads)."""
        att = self.acts.get("att", layer)
        return self.proj["out"].forward(self.scratch_nc, att.view(self.build.rows, -1),
                                        self.w.blocks[layer].key("out_w"), self._amax(layer, 1))

    def _mlp_forward(self, layer: int) -> torch.Tensor:
        """The MLP branch swiglu(ln2 Wug^T) Wd^T, the SwiGLU output quantized at the build's scale."""
        be, a, w, lin, down = self.backend, self.acts, self.w.blocks[layer], self.lin, self.proj["down"]
        up_gate, swiglu, key = a.get("up_gate", layer), a.get("swiglu", layer), w.key("down_w")
        self.proj["up_gate"].forward(up_gate, a.get("ln2", layer), w.key("up_gate_w"), self._amax(layer, 2))
        hist = self.swiglu_out_amax
        if hist is not None and self._swiglu_out_amax_filled:  # one pass at the last forward's scale
            xq, xt, descale = lin.x_quant_buffers(key, self.build.rows, self.cfg.intermediate_size)
            be.swiglu_forward_fp8(xq, xt, descale, up_gate, self.amax[layer, 3], swiglu, hist[layer])
            return down.forward(self.scratch_nc, swiglu, key, None, x_quantized=True)
        if self.smooth is not None:  # h / c into the FP8 GEMM with W diag(c)
            be.swiglu_forward(swiglu, up_gate)
            self.smooth.smooth_(layer, swiglu, self.amax[layer, 3])
            return down.forward(self.scratch_nc, swiglu, key, self.amax[layer, 3],
                                weight_fp8=self.smooth.weight_copy(layer, lin.w[key]))
        be.swiglu_forward(swiglu, up_gate, absmax=self._amax(layer, 3))
        return down.forward(self.scratch_nc, swiglu, key, self._amax(layer, 3))

    def block_forward(self, layer: int) -> None:
        a, w = self.acts, self.w.blocks[layer]
        self._attention_forward(layer, self._qkv_forward(layer))
        mid = a.get("residual_mid", layer)
        self.norm.residual_forward(mid, a.get("ln2", layer), a.rstd2[layer], a.residual[layer],
                                   self._out_proj(layer), w.ln2_w, amax=self._amax(layer, 2))
        branch = self._mlp_forward(layer)
        last = layer + 1 == self.cfg.num_layers
        self.norm.residual_forward(a.residual[layer + 1], self.final_ln if last else a.get("ln1", layer + 1),
                                   self.final_rstd if last else a.rstd1[layer + 1], mid, branch,
                                   self.w.final_norm if last else self.w.blocks[layer + 1].ln1_w,
                                   amax=self.head.x_amax if last else self._amax(layer + 1, 0))

    def after_forward(self, training: bool) -> None:
        """A training forward's SwiGLU maxima become the next forward's delayed scales; an evaluation's or
        generation's forward uses the kept scales but does not replace them, so the training forward after a
        periodic eval quantizes as if the eval had not run."""
        if self.swiglu_out_amax is not None and training:
            self.swiglu_out_amax.copy_(self.amax[:, 3])
            self._swiglu_out_amax_filled = True

    # ------------------------------------------------------------------ backward
    def _recompute(self, layer: int) -> None:
        """Refill the shared buffers of ``layer`` that the forward did not keep (same kernels, same inputs)."""
        rc, be, a, w = self.recompute, self.backend, self.acts, self.w.blocks[layer]
        if rc.norm:
            self.norm.forward(a.get("ln1", layer), a.rstd1[layer], a.residual[layer], w.ln1_w,
                              amax=self._amax(layer, 0))
        qkv = self._qkv_forward(layer) if rc.qkv else a.get("qkv", layer)
        if rc.att:
            self._attention_forward(layer, qkv)
        if rc.block:
            self.norm.residual_forward(a.get("residual_mid", layer), a.get("ln2", layer), a.rstd2[layer],
                                       a.residual[layer], self._out_proj(layer), w.ln2_w,
                                       amax=self._amax(layer, 2))
        elif rc.norm:
            self.norm.forward(a.get("ln2", layer), a.rstd2[layer], a.get("residual_mid", layer), w.ln2_w,
                              amax=self._amax(layer, 2))
        if rc.ffn:
            self.proj["up_gate"].forward(a.get("up_gate", layer), a.get("ln2", layer), w.key("up_gate_w"),
                                         self._amax(layer, 2))
        if rc.swiglu:
            be.swiglu_forward(a.get("swiglu", layer), a.get("up_gate", layer), absmax=self._amax(layer, 3))
            if self.smooth is not None:  # the same h: the forward's factors again
                self.smooth.reapply_(layer, a.get("swiglu", layer), self.amax[layer, 3])

    def final_norm_backward(self, d_head_in: torch.Tensor) -> None:
        self.norm.backward(self.d_residual, self.g.final_norm, d_head_in, self.acts.residual[-1], self.w.final_norm,
                           self.final_rstd, amax=self._dy_amax())

    def _swiglu_backward(self, layer: int) -> None:
        """d(up+gate) from d_swiglu; FP8: straight into the up+gate GEMM's FP8 gradient (both layouts)."""
        be, lin, up_gate = self.backend, self.lin, self.acts.get("up_gate", layer)
        if not lin.fp8:
            self._wait_wgrad("up_gate_w")
            be.swiglu_backward(self.d_up_gate, self.d_swiglu, up_gate)
            return
        q, q_t, descale, amax = lin.dy_quant_buffers(*self.d_up_gate.shape)
        hist, delayed = self.swiglu_dy_amax, None
        if hist is not None:  # measured into this layer's slot; the kept scale once there is one
            amax = self._swiglu_dy_measured[layer]
            delayed = hist[layer] if self._swiglu_dy_amax_filled else None
        be.swiglu_backward_fp8(q, q_t, descale, self.d_swiglu, up_gate, amax, self.d_up_gate, scale_absmax=delayed)

    def block_backward(self, layer: int) -> None:
        """On entry d_residual = dL/dx_{l+1} (and, under FP8, max|d_residual| in ``lin.dy_amax`` from the norm
        backward above); on exit dL/dx_l. Weight grads += .

        With the wgrad overlap, the waits below guard the buffers a pending wgrad reads: d_residual (down_w,
        out_w), the shared d_up_gate and d_qkv (the layer above's up_gate_w, qkv_w; implied by the other two,
        kept to name each hazard), and the recomputed ln1 (the layer above's qkv_w)."""
        be, a, cfg, lin, p = self.backend, self.acts, self.cfg, self.lin, self.proj
        w, g = self.w.blocks[layer], self.g.blocks[layer]
        n = self.build.rows
        if self.recompute.norm:  # the recomputed ln1 is shared: the layer above's qkv wgrad reads it (the others
            self._wait_wgrad("qkv_w")  # are done: its out_w wait covered them, the side stream runs in order)
        self._recompute(layer)
        dres, acc = self.d_residual, not (self._block_grads_zero or self.store.layer_grads_fresh)
        # MLP: x_{l+1} = x_mid + swiglu(ln2 Wug^T) Wd^T
        p["down"].backward(self.d_swiglu, g.down_w, dres, a.get("swiglu", layer), w.key("down_w"),
                           self._amax(layer, 3), acc, dy_amax_ready=True,
                           wgrad_columns=None if self.smooth is None else self.smooth.wgrad_factors(layer, g.down_w.dtype))
        self._swiglu_backward(layer)
        d_ln = p["up_gate"].backward(self.d_ln, g.up_gate_w, self.d_up_gate, a.get("ln2", layer), w.key("up_gate_w"),
                                     self._amax(layer, 2), acc, dy_quantized=lin.fp8)
        self._wait_wgrad("down_w")
        self.norm.backward(dres, g.ln2_w, d_ln, a.get("residual_mid", layer), w.ln2_w, a.rstd2[layer],
                           dresidual=dres, amax=self._dy_amax())  # FP8: the out-projection's dy scale
        # attention: x_mid = x_l + attention(rope(ln1 Wqkv^T + b)) Wo^T
        att = a.get("att", layer)
        p["out"].backward(self.d_att.view(n, -1), g.out_w, dres, att.view(n, -1), w.key("out_w"),
                          self._amax(layer, 1), acc, dy_amax_ready=True)
        self._wait_wgrad("qkv_w")
        self.attention.backward(self.d_qkv, self.d_att, att, a.get("lse", layer), a.get("qkv", layer))
        if cfg.qk_norm:  # Qwen3: through the QK-norm to the QKV GEMM's output
            qk_in, qk_rstd, qw, kw = self._qk_norm_args(layer)
            self.attention.qk_norm_backward(self.d_qkv, g.q_norm_w, g.k_norm_w, qk_in, qk_rstd, qw, kw)
        d_qkv = self.d_qkv.view(n, -1)
        if cfg.qkv_bias:  # FP8: the same read of d_qkv gives the QKV GEMM's dy scale
            be.bias_backward(g.qkv_b, d_qkv, absmax=self._dy_amax())
        d_ln = p["qkv"].backward(self.d_ln, g.qkv_w, d_qkv, a.get("ln1", layer), w.key("qkv_w"), self._amax(layer, 0),
                                 acc, dy_amax_ready=cfg.qkv_bias)
        self._wait_wgrad("out_w")
        self.norm.backward(dres, g.ln1_w, d_ln, a.residual[layer], w.ln1_w, a.rstd1[layer], dresidual=dres,
                           amax=self._dy_amax() if layer > 0 else None)  # FP8: the down projection's dy below

    def embed_backward(self, tokens: torch.Tensor) -> None:
        self.embedding.backward(self.g.embed, tokens, self.d_residual)

    def after_backward(self) -> None:
        """This backward's SwiGLU gradient maxima: the scales of the next one (delayed scale)."""
        if self.swiglu_dy_amax is not None:
            self.swiglu_dy_amax.copy_(self._swiglu_dy_measured)
            self._swiglu_dy_amax_filled = True

    # ------------------------------------------------------------------ the FP8 monitor
    def count_saturated_swiglu_fp8(self, counts: torch.Tensor) -> int:
        """The FP8 monitor's saturation count, after a forward at delayed scales (``swiglu_out_delayed`` was
        True before it): add to ``counts`` [L] (int64, on the model's device) how many of each layer's
        down-projection FP8 inputs sit at the FP8 maximum, read from the q(x^T) [I, N] each layer keeps for its
        wgrad; returns the elements counted per layer. Every value beyond the earlier maximum saturates there
        (with those that round to it: within half an FP8 step of it), so the share is an upper bound on the
        clipped share. (At current scales nothing is clipped by construction -- the tensor's own maximum is
        the scale -- and the caller counts nothing.) Read in slices of the I rows, so that the temporaries
        stay near 32 MB."""
        lin = self.lin
        top = torch.tensor(torch.finfo(lin.fwd_dtype).max, dtype=lin.fwd_dtype).view(torch.uint8).item()
        elements = 0
        for layer in range(self.cfg.num_layers):
            qt = lin.xt_store[self.w.blocks[layer].key("down_w")].view(torch.uint8)  # [I, N], sign in bit 7
            for part in qt.split(max(1, (32 << 20) // max(qt.shape[1], 1))):
                counts[layer] += ((part & 0x7F) == top).sum()
            elements = qt.numel()
        return elements
