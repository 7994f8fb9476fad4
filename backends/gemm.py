"""GEMM providers: the matrix multiplies any backend can take (``--gemm``), kept apart from the kernel backends.

A backend's ``matmul`` / ``matmul_fp8`` / ``matmul_beside`` / ``prepare_beside`` are this component's (the
contracts, shapes and dtypes are documented on ``Backend`` in backends/base.py). Two providers:

* ``torch``: ``torch.mm`` / ``addmm`` (cuBLAS) for the model dtype, ``torch._scaled_mm`` for FP8 on CUDA and an
  exact fp32 emulation of it on the CPU (FP8 values are exactly representable in fp32). The reference.
* ``cublaslt``: on CUDA, the GEMMs go through backends/cublaslt.py, which adds the FP8 weight gradients of
  micro-steps after the first in the GEMM's epilogue (beta = 1) and, with ``tuning``, takes the fastest of torch's
  call and cuBLASLt's candidate algorithms, timed once per problem; ``matmul_beside`` sizes a side stream's GEMM
  for a number of SMs. Anything it cannot do (CPU tensors, a bias, a layout cuBLASLt refuses) is torch's call.

``tuning`` is off for bit-reproducible runs (--deterministic-attention): the timed choice, and with it the
summation order, can differ between runs; the heuristic's first choice does not.
"""

from __future__ import annotations

import torch

from llmq_ray.backends import cublaslt


class TorchGemm:
    """GEMMs through torch (cuBLAS on CUDA)."""

    name = "torch"

    def __init__(self, device: torch.device, tuning: bool = True):
        self.device, self.tuning = device, tuning
        self.beside_fallbacks = 0  # matmul_beside calls that could not size the GEMM for their SMs

    def matmul(self, out, a, b, *, transpose_a=False, transpose_b=False, bias=None, accumulate=False):
        a_ = a.t() if transpose_a else a
        b_ = b.t() if transpose_b else b
        if accumulate:
            out.addmm_(a_, b_)  # one rounding of out + a@b (beta = 1 in BLAS terms)
            if bias is not None:
                out.add_(bias)
        elif bias is not None:
            torch.addmm(bias, a_, b_, out=out)
        else:
            torch.mm(a_, b_, out=out)

    def matmul_beside(self, out, a, b, *, transpose_a=False, transpose_b=False, accumulate=False, sm_count=0):
        if sm_count and out.device.type == "cuda":
            self.beside_fallbacks += 1
        TorchGemm.matmul(self, out, a, b, transpose_a=transpose_a, transpose_b=transpose_b, accumulate=accumulate)

    def prepare_beside(self, stream) -> None:
        """cuBLAS keeps a workspace per stream: nothing to make."""

    def matmul_fp8(self, out, a, b, a_descale, b_descale, *, bias=None, accumulate=False):
        if out.device.type == "cuda":
            if not accumulate:  # straight into the output buffer: no temporary, no copy
                torch._scaled_mm(a, b.t(), scale_a=a_descale, scale_b=b_descale, bias=bias, out_dtype=out.dtype,
                                 out=out)
                return
            # torch exposes no beta=1 for FP8 GEMMs: compute, then add (one extra pass over out)
            res = torch._scaled_mm(a, b.t(), scale_a=a_descale, scale_b=b_descale, out_dtype=out.dtype)
        else:  # exact emulation: FP8 values are exactly representable in fp32
            res = (a.float() * a_descale) @ (b.float() * b_descale).t()
            if bias is not None and not accumulate:
                res = res + bias.float()
        if accumulate:
            out.add_(res if bias is None else res + bias)
        else:
            out.copy_(res)


class CublasLtGemm(TorchGemm):
    """GEMMs through cuBLASLt on CUDA (module docstring), torch's call for everything else."""

    name = "cublaslt"

    def __init__(self, device: torch.device, tuning: bool = True):
        super().__init__(device, tuning)
        self._cublaslt = None  # llmq_ray.backends.cublaslt.CublasLt once loaded; False when it cannot be

    def _lt(self, out: torch.Tensor):
        if self._cublaslt is None:
            try:
                self._cublaslt = cublaslt.for_device(out.device) if cublaslt.available() else False
            except cublaslt.CublasLtError:  # the library loads but a handle cannot be made: torch's GEMMs only
                self._cublaslt = False
        return self._cublaslt

    def matmul(self, out, a, b, *, transpose_a=False, transpose_b=False, bias=None, accumulate=False):
        """With ``tuning`` on CUDA (no bias): the fastest of torch's call and cuBLASLt's candidate algorithms,
        timed at the problem's first call; otherwise torch's call."""
        torch_call = super().matmul
        if self.tuning and bias is None and out.device.type == "cuda" and self._cublaslt is not False:
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
        super().matmul_beside(out, a, b, transpose_a=transpose_a, transpose_b=transpose_b, accumulate=accumulate,
                              sm_count=sm_count)

    def prepare_beside(self, stream) -> None:
        if stream is not None and self._cublaslt is not False:
            with torch.cuda.device(stream.device):
                lt = self._lt(torch.empty(0, device=stream.device))
            if lt:
                lt.side_workspace(stream)

    def matmul_fp8(self, out, a, b, a_descale, b_descale, *, bias=None, accumulate=False):
        """``accumulate`` (dw += dy^T x) adds in the GEMM's epilogue through cuBLASLt (beta = 1) instead of a
        torch._scaled_mm into a temporary plus an add: one pass over dw less. With ``tuning`` the algorithm is
        the fastest of cuBLASLt's candidates (and, without accumulation, of torch._scaled_mm's), timed at the
        problem's first call; without, cuBLASLt's heuristic choice."""
        torch_call = super().matmul_fp8
        if bias is None and out.device.type == "cuda" and self._cublaslt is not False:
            lt = self._lt(out)
            if lt and lt.supports(out, a, b) and (accumulate or self.tuning):
                fallback = None if accumulate else (
                    lambda: torch_call(out, a, b, a_descale, b_descale))
                try:
                    lt.gemm(out, a, b, a_descale=a_descale, b_descale=b_descale, accumulate=accumulate,
                            fallback=fallback, algo_index=None if self.tuning else 0)
                    return
                except cublaslt.CublasLtError:  # no algorithm for this problem (before anything was written): torch's
                    pass
        torch_call(out, a, b, a_descale, b_descale, bias=bias, accumulate=accumulate)


GEMM_PROVIDERS = {"torch": TorchGemm, "cublaslt": CublasLtGemm}
