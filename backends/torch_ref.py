"""The PyTorch reference backend: every kernel of backends/base.py written with plain torch ops.

This is the ground truth the Triton and CuPy backends are tested against, and the backend that runs on CPU.
It favours obviously-correct math over speed: statistics in fp32, one rounding to the model dtype at the end
of each kernel. Attention is written out (scores, softmax, weighted sum) so that the CPU path is exact and
has no hidden autograd; on CUDA it goes to the fused flash/cuDNN kernels through ``torch.ops.aten``
(see ``backends/_aten_attention.py``), which every backend may use.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from llmq_ray.backends import torch_ref_optim
from llmq_ray.backends.base import Backend, dlogits_fp8_scale


def _fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


class TorchBackend(Backend):
    """Reference kernels (CPU and CUDA, fp32 and bf16): every kernel op, none from elsewhere. Its GEMMs and
    attention are the providers'; by default ``torch`` (backends/gemm.py) and ``sdpa`` (backends/attention.py)."""

    name = "torch"

    # ------------------------------------------------------------------ embedding
    def embedding_forward(self, out, tokens, table):
        torch.index_select(table, 0, tokens.long(), out=out)

    def embedding_backward(self, dtable, tokens, dout):
        # Sum the rows of each distinct token in fp32 first (index_put_ with accumulate is deterministic,
        # sort-based, on CUDA), then add each distinct row into the table once.
        uniq, inverse = torch.unique(tokens.long(), return_inverse=True)
        acc = torch.zeros(uniq.numel(), dout.shape[-1], dtype=torch.float32, device=dout.device)
        acc.index_put_((inverse,), dout.float(), accumulate=True)
        dtable[uniq] = (dtable[uniq].float() + acc).to(dtable.dtype)

    # ------------------------------------------------------------------ RMSNorm
    def rmsnorm_forward(self, out, rstd, inp, weight, eps, absmax=None):
        x = inp.float()
        r = torch.rsqrt(x.pow(2).mean(-1) + eps)
        rstd.copy_(r)
        y = (x * r[:, None]) * weight.float()
        out.copy_(y)
        if absmax is not None:
            absmax.copy_(out.abs().amax().float())

    def fused_residual_rmsnorm_forward(self, residual, out, rstd, inp1, inp2, weight, eps, absmax=None):
        torch.add(inp1, inp2, out=residual)
        self.rmsnorm_forward(out, rstd, residual, weight, eps, absmax)

    def rmsnorm_backward(self, dinp, dweight, dout, inp, weight, rstd, dresidual=None, absmax=None):
        x = inp.float()
        r = rstd.float()[:, None]
        xhat = x * r
        g = dout.float()
        dweight.add_((g * xhat).sum(0))
        gw = g * weight.float()
        dx = r * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))
        if dresidual is not None:
            dx = dx + dresidual.float()
        dinp.copy_(dx)
        if absmax is not None:
            absmax.copy_(dinp.abs().amax().float())

    # ------------------------------------------------------------------ RoPE
    @staticmethod
    def _rotate(qkv, cos, sin, n_q, n_kv, inverse):
        half = qkv.shape[-1] // 2
        qk = qkv[:, :, :n_q + n_kv]
        x1, x2 = qk[..., :half].float(), qk[..., half:].float()
        c = cos[None, :, None, :]
        s = sin[None, :, None, :]
        if inverse:  # transpose of the rotation matrix
            y1, y2 = x1 * c + x2 * s, x2 * c - x1 * s
        else:
            y1, y2 = x1 * c - x2 * s, x2 * c + x1 * s
        qk[..., :half] = y1.to(qkv.dtype)
        qk[..., half:] = y2.to(qkv.dtype)

    def rope_forward(self, qkv, cos, sin, n_q_heads, n_kv_heads):
        self._rotate(qkv, cos, sin, n_q_heads, n_kv_heads, inverse=False)

    def rope_backward(self, dqkv, cos, sin, n_q_heads, n_kv_heads):
        self._rotate(dqkv, cos, sin, n_q_heads, n_kv_heads, inverse=True)

    # ------------------------------------------------------------------ SwiGLU
    def swiglu_forward(self, out, inp, absmax=None):
        i = out.shape[-1]
        up, gate = inp[:, :i].float(), inp[:, i:].float()
        out.copy_(up * F.silu(gate))
        if absmax is not None:
            absmax.copy_(out.abs().amax().float())

    def swiglu_backward(self, dinp, dout, inp, absmax=None):
        i = dout.shape[-1]
        up, gate = inp[:, :i].float(), inp[:, i:].float()
        g = dout.float()
        sig = torch.sigmoid(gate)
        silu = gate * sig
        dinp[:, :i] = (g * silu).to(dinp.dtype)
        dinp[:, i:] = (g * up * sig * (1.0 + gate * (1.0 - sig))).to(dinp.dtype)
        if absmax is not None:
            absmax.copy_(dinp.abs().amax().float())

    # ------------------------------------------------------------------ bias (the GEMMs are the GEMM provider's)
    def bias_backward(self, dbias, dout, absmax=None):
        dbias.add_(dout.float().sum(0))
        if absmax is not None:
            self.absmax(absmax, dout)

    # ------------------------------------------------------------------ FP8 quantization
    def absmax(self, out, inp):
        out.copy_(inp.abs().amax().float())

    def _scale(self, absmax, dtype):
        amax = absmax.float()
        return torch.where(amax > 0, _fp8_max(dtype) / amax, torch.ones_like(amax))

    def quantize(self, out, descale, inp, absmax):
        s = self._scale(absmax, out.dtype)
        m = _fp8_max(out.dtype)
        out.copy_((inp.float() * s).clamp(-m, m).to(out.dtype))
        descale.copy_(1.0 / s)

    def quantize_transpose(self, out_t, descale, inp, absmax):
        s = self._scale(absmax, out_t.dtype)
        m = _fp8_max(out_t.dtype)
        out_t.copy_((inp.float() * s).clamp(-m, m).to(out_t.dtype).t())
        descale.copy_(1.0 / s)

    # ------------------------------------------------------------------ loss
    def fused_classifier(self, logits, losses, targets, dloss=1.0, write_dlogits=True):
        for sl in self._row_blocks(logits):
            d = self._classifier_rows(logits[sl], losses[sl], targets[sl], dloss, write_dlogits)
            if d is not None:
                logits[sl].copy_(d)

    @staticmethod
    def _row_blocks(logits):
        """Row slices of ~1M elements: the fp32 temporaries stay small (on CPU they are reused from the heap
        instead of being page-faulted afresh; on CUDA, blocks of ~128M, far below the [n, V] size)."""
        n, v = logits.shape
        rows = max(1, (1 << 20) // v) if logits.device.type == "cpu" else max(1, (1 << 27) // v)
        return [slice(lo, min(lo + rows, n)) for lo in range(0, n, rows)]

    @staticmethod
    def _classifier_rows(logits, losses, targets, dloss, write_dlogits):
        """One block of rows: writes losses; returns dloss * (softmax - onehot) in fp32 (a new tensor) when
        ``write_dlogits``, else None. logits are only read."""
        x = logits.float()
        valid = targets != -100
        tgt = torch.where(valid, targets, torch.zeros_like(targets)).long()
        row_lse = torch.logsumexp(x, dim=-1)
        picked = x.gather(1, tgt[:, None])[:, 0]
        losses.copy_(torch.where(valid, row_lse - picked, torch.zeros_like(row_lse)))
        if not write_dlogits:
            return None
        probs = torch.exp(x - row_lse[:, None])
        probs[torch.arange(x.shape[0], device=x.device), tgt] -= 1.0
        return probs.mul_((valid.float() * dloss)[:, None])

    def fused_classifier_fp8(self, logits, losses, targets, q, q_t, descale, dloss=1.0):
        if q.dtype != q_t.dtype or q.shape != logits.shape or q_t.shape != logits.shape[::-1]:
            raise ValueError(f"fused_classifier_fp8: q {q.dtype} {tuple(q.shape)} and q_t {q_t.dtype} "
                             f"{tuple(q_t.shape)} must be one FP8 dtype shaped like logits {tuple(logits.shape)} "
                             f"and its transpose")
        s = dlogits_fp8_scale(q.dtype, dloss)
        fp8_max = float(torch.finfo(q.dtype).max)
        for sl in self._row_blocks(logits):
            d = self._classifier_rows(logits[sl], losses[sl], targets[sl], dloss, True)
            fp8 = (d * s).clamp(-fp8_max, fp8_max).to(q.dtype)
            q[sl].copy_(fp8)
            q_t[:, sl].copy_(fp8.t())
        descale.fill_(1.0 / s)

    # ------------------------------------------------------------------ optimizer
    def adamw_update(self, param, grad, m, v, **kwargs):
        torch_ref_optim.adamw_update(param, grad, m, v, **kwargs)

    def global_norm_squared(self, out, tensor):
        torch_ref_optim.global_norm_squared(out, tensor)

    def stochastic_round(self, out, inp, seed):
        torch_ref_optim.stochastic_round(out, inp, seed)
