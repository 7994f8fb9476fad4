"""Smooth-SwiGLU (the "smooth" SwiGLU FP8 scale): per-channel scaling of the SwiGLU output before its FP8 quantization,
folded back exactly into the down projection.

Why: with one scale per tensor, the down projection's FP8 input h = up * silu(gate) [N, I] shares e4m3's range
among all I channels, and in long runs a few channels grow far beyond the rest (the outliers the FP8 monitor's
per-layer maxima show). Channels more than about 2^15 below the largest then fall into e4m3's subnormals or to
zero, and the columns of the down projection's weight gradient dy^T h that read them are lost (Adam normalizes
each weight's update, so a lost column is a wrong update, however small its values). Here each channel j is
first divided by a factor c_j from its own maximum over the micro-batch's N rows, so every channel's maximum
lands in [1, 2) before the per-tensor scale is taken, and the down projection's weight takes the factors:

    y = h W^T = (h diag(1/c)) (W diag(c))^T            h [N, I], W [C, I] (the local columns under
                                                        tensor parallelism), c [I] fp32

c_j = 2^floor(log2 max_n |h_nj|) (kept within 2^-32 .. 2^32; 1 for an all-zero channel) is a power of two, so dividing h and multiplying W's columns by it change only
exponents: h' = h / c and W diag(c) are exact in bf16, and the fold is exact -- the only difference from the
plain FP8 path is where the FP8 roundings fall. The factors are current (this forward's maxima, kept per layer
[L, I] for the backward), so nothing is carried from one step to the next and a resumed run stays bit-exact.

Per micro-step and layer this costs, beside the plain FP8 path: one read of h for the channel maxima, one
read-write of h to divide it (and its per-tensor absmax, read again), and an FP8 copy of W diag(c) made from the
bf16 weight (W diag(c) written to a bf16 scratch [C, I], its absmax and the cast) -- the forward's persistent
copy of W cannot be used, as its factors change with every micro-batch (so ZeRO-3 gathers every layer's bf16
weights in every pass, even with persistent FP8 copies, the backward's included). In the backward:

* dgrad: dh = dy W reads the ordinary transposed copy of W (unsmoothed), so it is unchanged;
* wgrad: the kept q(h'^T) gives dy^T h' = (dy^T h) diag(1/c); the true gradient is that times diag(c). The
  accumulating FP8 GEMM writes into the gradient buffer, so the buffer is divided by c before the GEMM and
  multiplied by c after it: dw <- (dw / c + dy^T h') c = dw + dy^T h, exact again (powers of two).

What it does not change: the forward's error. y = h W^T is dominated by the large channels either way, and the
copy of W diag(c) now carries the channels' spread on the weight side (tests/test_smooth_swiglu.py measures
both). The scratch for W diag(c) costs C x I x 3 bytes on the device (bf16 and its FP8 copy; 204 MB at Qwen2.5-7B).
Written here, not taken from a library: it is the model's own FP8 data path. The idea is from Fishman et al.,
"Scaling FP8 training to trillion-token LLMs" (2024), who fold per-channel factors into the MLP's weights.
"""

from __future__ import annotations

import torch

MAX_EXPONENT = 32  # the factors stay within 2^-32 .. 2^32 (SmoothSwiGLU.smooth_)


class SmoothSwiGLU:
    """Per-layer channel factors of the SwiGLU output and the down projection's FP8 copy that absorbs them.

    num_layers, intermediate = I (this rank's part under tensor parallelism), hidden = C; ``fp8_dtype``: the
    forward operands' FP8 dtype; ``dtype``: the model dtype (the bf16 weights and h)."""

    def __init__(self, backend, num_layers: int, hidden: int, intermediate: int, dtype: torch.dtype,
                 fp8_dtype: torch.dtype, device: torch.device):
        self.be = backend
        self.factors = torch.ones(num_layers, intermediate, dtype=torch.float32, device=device)  # c [L, I]
        self.raw_amax = torch.zeros(num_layers, dtype=torch.float32, device=device)  # max|h| per layer, unsmoothed
        self._w_scaled = torch.empty(hidden, intermediate, dtype=dtype, device=device)  # W diag(c) [C, I]
        self._w_q = torch.empty(hidden, intermediate, dtype=fp8_dtype, device=device)
        self._w_amax = torch.zeros((), dtype=torch.float32, device=device)
        self._w_descale = torch.ones((), dtype=torch.float32, device=device)

    def smooth_(self, layer: int, h: torch.Tensor, h_amax: torch.Tensor) -> None:
        """Forward: measure each channel's max|h| of h [N, I] (model dtype), keep c = 2^floor(log2 max) as
        layer ``layer``'s factors (1 for an all-zero channel), divide h by them in place and write max|h / c|
        into ``h_amax`` (fp32 0-d: the FP8 quantization's absmax)."""
        chan = torch.linalg.vector_norm(h, ord=float("inf"), dim=0, dtype=torch.float32)  # [I]
        torch.amax(chan, dim=0, out=self.raw_amax[layer])
        exponent = torch.frexp(chan).exponent  # chan = m * 2^e with m in [0.5, 1): floor(log2 chan) = e - 1
        # 2^(e-1) built from its exponent bits (exact on every device), kept within 2^-32 .. 2^32 so that
        # neither 1/c nor the gradient buffer's dw / c and dw * c can overflow or underflow (a channel beyond
        # that range is only partly smoothed; the fold stays exact)
        bits = ((exponent - 1).clamp_(-MAX_EXPONENT, MAX_EXPONENT) + 127).to(torch.int32) << 23
        c = self.factors[layer]
        c.copy_(bits.view(torch.float32))
        c.masked_fill_(chan == 0, 1.0)
        self.reapply_(layer, h, h_amax)

    def reapply_(self, layer: int, h: torch.Tensor, h_amax: torch.Tensor) -> None:
        """Divide h [N, I] by layer ``layer``'s kept factors in place and write max|h / c| into ``h_amax`` (the
        recomputation of h in the backward: the same h, the same factors)."""
        h.mul_(self.factors[layer].reciprocal().to(h.dtype))  # powers of two: exact
        self.be.absmax(h_amax, h)

    def weight_copy(self, layer: int, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q(W diag(c)) [C, I] FP8, its descale) of the down projection's weight w [C, I] with layer
        ``layer``'s factors, for the forward GEMM (valid until the next call)."""
        torch.mul(w, self.factors[layer].to(w.dtype), out=self._w_scaled)  # powers of two: exact
        self.be.absmax(self._w_amax, self._w_scaled)
        self.be.quantize(self._w_q, self._w_descale, self._w_scaled, self._w_amax)
        return self._w_q, self._w_descale

    def wgrad_factors(self, layer: int, dtype: torch.dtype) -> torch.Tensor:
        """c of ``layer`` [I] in the gradient buffer's dtype, for ``BlockLinears.backward(wgrad_columns=...)``."""
        return self.factors[layer].to(dtype)

    def tensors(self) -> list[torch.Tensor]:
        """The device tensors this holds (the factors, the weight scratch and its scalars; the memory table's
        ``fp8`` row)."""
        return [self.factors, self.raw_amax, self._w_scaled, self._w_q, self._w_amax, self._w_descale]
