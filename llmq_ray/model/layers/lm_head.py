"""The LM head and the loss over row chunks: logits = x W^T, the fused cross-entropy, and in training the
head's dgrad and wgrad -- in the model dtype, or (``fp8``) as three FP8 GEMMs.

x is the final RMSNorm's output [N, C]; W [V, C] is the head's weight (the embedding table when tied). Each
chunk of N / chunks rows has its logits [rows, Vp] (Vp: V, or V padded as below) in one reused buffer, so the
full [N, V] logits never exist.

A vocabulary that is no multiple of 64 (GPT-2's 50,257) is padded to one (50,304) inside the model-dtype head:
the logits buffer is [rows, Vp], the weight is copied once per call into a [Vp, C] buffer whose extra rows are
zero, and the extra logits are set to -10000 before the cross-entropy, so their probabilities are exactly 0 in
fp32 (exp(-10000 - max) underflows), the loss and dx equal the unpadded ones and dlogits is 0 there. Why: rows of
50,257 bf16 values are not 16-byte aligned, and cuBLAS then runs the head's three GEMMs on slow kernels: at GPT-2
124M on an H100 the step took 438 ms unpadded against 241 ms with a 50,304 vocabulary (benchmarks/LOG.md,
2026-11-26). The weight gradient is the GEMM of the first V columns of dlogits (a strided view, leading dimension
Vp), accumulated straight into dW [V, C].

Why FP8 here: the head's GEMMs are 2 N C V FLOPs each, ~28% of the linear layers' FLOPs in Qwen2.5-0.5B
(V = 151,936 against C = 896), and in an e4m3 step with a bf16 head they were 19% of the time on an H100.
The three GEMMs and their FP8 operands (per-tensor scaling, as the block linears in llmq_ray/model/layers/linear.py):

    forward  logits[n, V] = q(x) q(W)^T        x [n, C] e4m3 at max|x| (written by the final RMSNorm)
                                               W [V, C] e4m3 at max|W|
    dgrad    dx[n, C]     = q(d) q(W^T)^T      d [n, V] e5m2 at a static scale, W^T [C, V] e4m3
    wgrad    dW[V, C]    += q(d^T) q(x^T)^T    d^T [V, n] e5m2, x^T [C, n] e4m3

d = softmax - onehot is never written in the model dtype: the classifier (backends/base.py
``fused_classifier_fp8``) writes q(d) and q(d^T) itself (on Triton, q^T by a byte transpose right after). Its scale is static because |d| <= 1 always (no
absmax pass, nothing saturates); e5m2 and not e4m3 because d holds the probabilities of the whole
vocabulary, most of them far below 1e-5, which e4m3 at that scale (smallest step 2^-9 / 448 = 4.4e-6) would
flush to zero while e5m2 keeps them down to ~2.7e-10.

The weight copies are made at every micro-step (one absmax read and one dual-layout pass over V x C: ~0.3 ms
at 0.5B) rather than kept across the step: the head's weights may be the tied embedding, gathered per pass
under ZeRO-3 or captured in a CUDA graph, and re-quantizing unchanged weights gives the same bytes anyway.
Memory with fp8: 2 FP8 bytes of gradient per logit beside the model-dtype logits, 2 V C bytes of weight
copies, 2 (N / chunks) C bytes for x. ``logits_for`` (generation, tests) keeps the model-dtype head. The CuPy
backend takes the torch reference's classifier for this (fp32 temporaries in blocks of rows: slower, more memory).

A plan that splits the vocabulary (llmq_ray/parallel/tensor.py) replaces this head with one of the same
``run`` whose loss is the cross-entropy over every process's logit columns.
"""

from __future__ import annotations

import torch

from llmq_ray.backends.base import Backend


VOCAB_ALIGN = 64  # the model-dtype head pads the vocabulary to a multiple of this (module docstring)
PAD_LOGIT = -10000.0  # the padded logits: exp(PAD_LOGIT - max) is exactly 0 in fp32


class LMHead:
    """Buffers and GEMMs of the chunked LM head. rows = tokens per chunk; ``x_amax`` (fp32 0-d) is where the
    kernel producing x writes max|x| when ``fp8`` (the model's final RMSNorm). ``logits`` [rows, Vp]: Vp = V, or
    V padded to a multiple of ``VOCAB_ALIGN`` (model-dtype head; the module docstring says why)."""

    def __init__(self, backend: Backend, vocab: int, hidden: int, rows: int, chunks: int, dtype: torch.dtype,
                 fp8: bool, pad: bool = True):
        dev = backend.device
        self.be, self.chunks, self.fp8, self.vocab = backend, chunks, fp8, vocab
        self._dlogits32 = None  # run_vocab_parallel's fp32 logit gradient [rows, V], made on first use
        self._d_absmax = None   # run_vocab_parallel with fp8: the absmax that gives the classifier's static scale
        padded = vocab if fp8 or not pad or vocab % VOCAB_ALIGN == 0 else -(-vocab // VOCAB_ALIGN) * VOCAB_ALIGN
        self.logits = torch.empty(rows, padded, dtype=dtype, device=dev)
        # [Vp, C]: the weight's rows, then zeros (written once; ``run`` copies the weight in per call)
        self.w_padded = torch.zeros(padded, hidden, dtype=dtype, device=dev) if padded != vocab else None
        self.x_amax = None
        if not fp8:
            return
        if dev.type == "cuda" and (vocab % 16 or hidden % 16 or rows % 16):
            raise ValueError(f"an FP8 LM head needs the vocabulary ({vocab}), the hidden size ({hidden}) and the "
                             f"rows per LM-head chunk ({rows}) to be multiples of 16 (FP8 GEMM shapes)")
        e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
        self.w_q = torch.empty(vocab, hidden, dtype=e4m3, device=dev)
        self.wt_q = torch.empty(hidden, vocab, dtype=e4m3, device=dev)
        self.x_q = torch.empty(rows, hidden, dtype=e4m3, device=dev)
        self.xt_q = torch.empty(hidden, rows, dtype=e4m3, device=dev)
        self.d_q = torch.empty(rows, vocab, dtype=e5m2, device=dev)
        self.dt_q = torch.empty(vocab, rows, dtype=e5m2, device=dev)
        self.x_amax = torch.zeros((), dtype=torch.float32, device=dev)
        self.w_amax = torch.zeros((), dtype=torch.float32, device=dev)
        # separate 0-d tensors: cuBLASLt wants 16-byte aligned scale pointers (llmq_ray/model/layers/linear.py)
        self.x_descale, self.w_descale, self.d_descale = (torch.ones((), dtype=torch.float32, device=dev)
                                                          for _ in range(3))

    def fp8_tensors(self) -> list[torch.Tensor]:
        """The FP8 buffers and their scales (for the memory table's fp8 row; [] without fp8)."""
        if not self.fp8:
            return []
        return [self.w_q, self.wt_q, self.x_q, self.xt_q, self.d_q, self.dt_q, self.x_amax, self.w_amax,
                self.x_descale, self.w_descale, self.d_descale]

    def _quantize_weight(self, w: torch.Tensor, backward: bool) -> None:
        """FP8: q(W) at max|W| (and q(W^T) for the dgrad when ``backward``)."""
        self.be.absmax(self.w_amax, w)
        if backward:
            self.be.quantize_with_transpose(self.w_q, self.wt_q, self.w_descale, w, self.w_amax)
        else:
            self.be.quantize(self.w_q, self.w_descale, w, self.w_amax)

    def _quantize_x(self, xc: torch.Tensor, backward: bool) -> None:
        """FP8: q(x) of one chunk at ``x_amax`` (and q(x^T), which waits for the wgrad, when ``backward``)."""
        if backward:
            self.be.quantize_with_transpose(self.x_q, self.xt_q, self.x_descale, xc, self.x_amax)
        else:
            self.be.quantize(self.x_q, self.x_descale, xc, self.x_amax)

    def run(self, x: torch.Tensor, w: torch.Tensor, losses: torch.Tensor, targets: torch.Tensor,
            dx: torch.Tensor | None = None, dw: torch.Tensor | None = None) -> torch.Tensor | None:
        """losses[N] (fp32) = cross-entropy of x[N, C] W[V, C]^T against targets[N] (-100 = masked); with dx
        and dw (training), dx[N, C] = dL/dx (overwritten) and dw[V, C] += dL/dW, L = the *sum* of the losses.
        Returns the input gradient the final norm's backward reads (``dx``)."""
        be, backward = self.be, dw is not None
        rows, vocab = self.logits.shape[0], self.vocab
        w_head = w
        if self.w_padded is not None:
            self.w_padded[:vocab].copy_(w)
            w_head = self.w_padded
        if self.fp8:
            self._quantize_weight(w, backward)
        for chunk in range(self.chunks):
            sl = slice(chunk * rows, (chunk + 1) * rows)
            xc = x[sl]
            if not self.fp8:
                be.matmul(self.logits, xc, w_head, transpose_b=True)
                if w_head is not w:
                    self.logits[:, vocab:].fill_(PAD_LOGIT)
                be.fused_classifier(self.logits, losses[sl], targets[sl], 1.0, write_dlogits=backward)
                if backward:
                    be.matmul(dx[sl], self.logits, w_head)
                    be.matmul(dw, self.logits[:, :vocab], xc, transpose_a=True, accumulate=True)
                continue
            self._quantize_x(xc, backward)
            be.matmul_fp8(self.logits, self.x_q, self.w_q, self.x_descale, self.w_descale)
            if not backward:
                be.fused_classifier(self.logits, losses[sl], targets[sl], 1.0, write_dlogits=False)
                continue
            be.fused_classifier_fp8(self.logits, losses[sl], targets[sl], self.d_q, self.dt_q, self.d_descale, 1.0)
            be.matmul_fp8(dx[sl], self.d_q, self.wt_q, self.d_descale, self.w_descale)
            be.matmul_fp8(dw, self.dt_q, self.xt_q, self.d_descale, self.x_descale, accumulate=True)
        return dx

    def logits_for(self, out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
        """out[N, V] = x W^T in the model dtype, all logits at once (generation, tests)."""
        self.be.matmul(out, x, w, transpose_b=True)
