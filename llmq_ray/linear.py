"""The four block linears (QKV, attention-out, up+gate, down) in the model dtype or in FP8.

A linear layer y[N, OC] = x[N, K] W[OC, K]^T (+ b) has three GEMMs per training step:

    forward  y  = x  W^T          FP8: a = q(x)    [N, K],  b = q(W)    [OC, K]
    dgrad    dx = dy W            FP8: a = q(dy)   [N, OC], b = q(W^T)  [K, OC]
    wgrad    dW += dy^T x         FP8: a = q(dy^T) [OC, N], b = q(x^T)  [K, N]

FP8 tensor cores want both operands K-major ("TN"), so each operand is quantized in the layout its GEMM
needs: ``quantize_transpose`` writes the transposed copy in the same pass as the cast.

Scaling is per tensor and "current": every quantization uses the absmax of the very tensor it casts. For
activations that absmax comes out of the kernel that produced them (rmsnorm, swiglu write it for free), and so
does it for the gradients dy (the swiglu and RMSNorm backward kernels write max|dy|); the attention output and
the QKV gradient need one extra absmax pass.

``store_xt`` (on unless the model recomputes activations): the forward quantizes x in both layouts in one
pass and keeps q(x^T) for the wgrad, instead of reading the bf16 x again in the backward to re-quantize it.
It costs one FP8 byte per GEMM input element per layer (2.97 GB for Qwen2.5-0.5B at B=16, T=1024) and saves
2 bytes of traffic per element per micro-step. Weights change only at the optimizer
update, so their two FP8 copies (W and W^T) are made once per step (``invalidate_weights``) and reused by
every micro-step, the recomputation and the backward.

Forward operands use e4m3 (more mantissa); gradient operands use ``gradient_dtype`` (e4m3 or e5m2, more range),
each scaled to its own format's maximum.
"""

from __future__ import annotations

import torch

from backends.base import Backend

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
BLOCK_WEIGHTS = ("qkv_w", "out_w", "up_gate_w", "down_w")


class BlockLinears:
    """Runs the block GEMMs for a model; ``fp8=False`` is a thin pass-through to ``backend.matmul``.

    weights: the model's named views (``layers.{l}.{name}``); rows = N tokens of a micro-batch.
    FP8 scratch (allocated once): x / dy quantized [N, maxK], x^T / dy^T quantized [maxK, N], and the
    per-step weight copies W_q [OC, K], W^T_q [K, OC] for every block weight (as many bytes as the bf16 weights).
    """

    def __init__(self, backend: Backend, weights: dict[str, torch.Tensor], num_layers: int, rows: int,
                 matmul_dtype: str | None, gradient_dtype: str | None, store_xt: bool = True):
        self.be, self.w, self.num_layers = backend, weights, num_layers
        self.fp8 = matmul_dtype == "e4m3"
        self.store_xt = self.fp8 and store_xt
        if not self.fp8:
            return
        dev = backend.device
        self.fwd_dtype = FP8_DTYPES["e4m3"]
        self.grad_dtype = FP8_DTYPES[gradient_dtype or "e4m3"]
        shapes = [weights[f"layers.0.{name}"].shape for name in BLOCK_WEIGHTS]
        widest = max(max(s) for s in shapes)
        self.x_q = torch.empty(rows * widest, dtype=self.fwd_dtype, device=dev)
        self.xt_q = torch.empty(rows * widest, dtype=self.fwd_dtype, device=dev)
        self.dy_q = torch.empty(rows * widest, dtype=self.grad_dtype, device=dev)
        self.dyt_q = torch.empty(rows * widest, dtype=self.grad_dtype, device=dev)
        # Descales of x, x^T, dy (and dy^T, same scale): separate 0-d tensors, not views of one [4] tensor, because cuBLASLt
        # rejects scale pointers that are not 16-byte aligned (CUBLAS_STATUS_NOT_SUPPORTED, seen on H100).
        self.scales = [torch.ones((), dtype=torch.float32, device=dev) for _ in range(3)]
        self.dy_amax = torch.zeros((), dtype=torch.float32, device=dev)
        self.w_amax = torch.zeros((), dtype=torch.float32, device=dev)
        self.w_q: dict[str, torch.Tensor] = {}
        self.wt_q: dict[str, torch.Tensor] = {}
        self.w_descale: dict[str, torch.Tensor] = {}
        for layer in range(num_layers):
            for name in BLOCK_WEIGHTS:
                key = f"layers.{layer}.{name}"
                oc, k = weights[key].shape
                self.w_q[key] = torch.empty(oc, k, dtype=self.fwd_dtype, device=dev)
                self.wt_q[key] = torch.empty(k, oc, dtype=self.fwd_dtype, device=dev)
                self.w_descale[key] = torch.ones((), dtype=torch.float32, device=dev)
        # store_xt: q(x^T) [K, N] of every block GEMM input and its descale, written by the forward
        self.xt_store: dict[str, torch.Tensor] = {}
        self.x_descale: dict[str, torch.Tensor] = {}
        if self.store_xt:
            for key in self.w_q:
                self.xt_store[key] = torch.empty(weights[key].shape[1], rows, dtype=self.fwd_dtype, device=dev)
                self.x_descale[key] = torch.ones((), dtype=torch.float32, device=dev)
        self._stale = True

    def invalidate_weights(self) -> None:
        """The weights changed (optimizer update, checkpoint load): re-quantize them before the next use."""
        if self.fp8:
            self._stale = True

    def ensure_quantized(self) -> None:
        """Quantize the weights now if they changed (CUDA-graph replays only read the FP8 copies)."""
        if self.fp8 and self._stale:
            self._quantize_weights()

    def fp8_bytes(self) -> int:
        """Bytes of FP8 scratch and weight copies (0 in the model dtype)."""
        if not self.fp8:
            return 0
        tensors = [self.x_q, self.xt_q, self.dy_q, self.dyt_q, *self.w_q.values(), *self.wt_q.values(),
                   *self.xt_store.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _quantize_weights(self) -> None:
        for key, w in ((k, self.w[k]) for k in self.w_q):
            self.be.absmax(self.w_amax, w)
            self.be.quantize_with_transpose(self.w_q[key], self.wt_q[key], self.w_descale[key], w, self.w_amax)
        self._stale = False

    # ------------------------------------------------------------------ the three GEMMs
    def forward(self, out: torch.Tensor, x: torch.Tensor, key: str, x_amax: torch.Tensor | None,
                bias: torch.Tensor | None = None) -> None:
        """out[N, OC] = x[N, K] W^T (+ bias). FP8 needs x_amax = max|x| (fp32 0-d device tensor)."""
        if not self.fp8:
            self.be.matmul(out, x, self.w[key], transpose_b=True, bias=bias)
            return
        if self._stale:
            self._quantize_weights()
        xq = self.x_q[:x.numel()].view(x.shape)
        if self.store_xt:  # both layouts in one pass; q(x^T) waits for this layer's wgrad
            descale = self.x_descale[key]
            self.be.quantize_with_transpose(xq, self.xt_store[key], descale, x, x_amax)
        else:
            descale = self.scales[0]
            self.be.quantize(xq, descale, x, x_amax)
        self.be.matmul_fp8(out, xq, self.w_q[key], descale, self.w_descale[key], bias=bias)

    def backward(self, dx: torch.Tensor, dw: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, key: str,
                 x_amax: torch.Tensor | None, accumulate: bool = True, dy_amax_ready: bool = False) -> None:
        """dx[N, K] = dy[N, OC] W (overwritten); dw[OC, K] += dy^T x (accumulate), or dw = dy^T x when
        ``accumulate`` is False (the caller knows dw is still zero: 0 + v == v, so the result is the same bits
        while the GEMM skips reading dw, and the FP8 GEMM writes straight into it without a temporary).
        ``dy_amax_ready``: the kernel that produced dy already wrote max|dy| into ``self.dy_amax``."""
        be = self.be
        if not self.fp8:
            be.matmul(dx, dy, self.w[key])
            be.matmul(dw, dy, x, transpose_a=True, accumulate=accumulate)
            return
        if self._stale:
            self._quantize_weights()
        n, oc = dy.shape
        k = x.shape[1]
        if not dy_amax_ready:
            be.absmax(self.dy_amax, dy)
        dyq = self.dy_q[:dy.numel()].view(n, oc)
        dyt = self.dyt_q[:dy.numel()].view(oc, n)
        be.quantize_with_transpose(dyq, dyt, self.scales[2], dy, self.dy_amax)  # one read of dy, both layouts
        be.matmul_fp8(dx, dyq, self.wt_q[key], self.scales[2], self.w_descale[key])
        if self.store_xt:
            xt, x_descale = self.xt_store[key], self.x_descale[key]
        else:
            xt, x_descale = self.xt_q[:x.numel()].view(k, n), self.scales[1]
            be.quantize_transpose(xt, x_descale, x, x_amax)
        be.matmul_fp8(dw, dyt, xt, self.scales[2], x_descale, accumulate=accumulate)
