"""What every decoder family shares: its buffers, the unit loop of a micro-step and the LM head's loss.

No autograd: every activation the backward needs is written into a buffer allocated once, and the backward is
written out kernel by kernel (as llm.c / llm.q do). That is what makes fine-grained recomputation, FP8 in all
GEMMs, bit-exact recompute tests and CUDA graphs possible. All math goes through a Backend.

A micro-step is a loop over units (llmq_ray/model/layers/units.py): the embedding, each block, the LM head, and
back. The schedule runs the registered policies around each unit (weights gathered, FP8 copies made, saved
residuals fetched); the family (llmq_ray/model/llama.py, gpt2.py) writes only what happens inside a unit:

    embed_forward(tokens)     x_0 from the tokens (and positions); then first_norm()
    block_forward(l)          x_l -> x_{l+1}, and the next norm's output (the last block's: the head's input)
    block_backward(l)         d_residual = dL/dx_{l+1} -> dL/dx_l; weight gradients +=
    final_norm_backward(d)    from the head's input gradient d to dL/dx_L
    embed_backward(tokens)    the tables' gradients

then ``final_ln`` goes through the LM head in ``lmhead_chunks`` row chunks: each chunk's logits [N/chunks, V] go
through the fused classifier, which turns them into dlogits in place, and the chunk's LM-head backward runs at
once, so the full [N, V] logits never exist (llmq_ray/model/layers/lm_head.py).

Loss scaling: the classifier writes the gradient of the *sum* of token losses. Gradients are therefore sums
over all tokens of all micro-steps (and all ranks); the update divides by the true number of unmasked target
tokens, known only then. This makes "mean over unmasked targets" exact under gradient accumulation and data
parallelism, where a per-micro-step mean would weight micro-batches with many masked tokens wrongly.

Recomputation (``Recompute``, llmq_ray/model/build.py): every activation kind is either stored per layer or kept
in one shared scratch buffer and recomputed in the backward from what is stored, with the very same kernels on
the same inputs, so results are bit-identical to not recomputing.

What is applied from outside comes in once, as ``ModelPolicies`` (llmq_ray/model/build.py): the residual store,
the FP8 weight-copy placement, and a plan over the pieces (``self.norm``, ``self.proj[...]``, ``self.embedding``,
``self.head``) that may replace them, e.g. with tensor- and sequence-parallel ones (llmq_ray/parallel/tensor.py);
then ``rows`` < N: this process keeps only its token rows of the residual stream, the norms' inputs and rstd.
"""

from __future__ import annotations

import torch

from llmq_ray.backends.base import Backend
from llmq_ray.model.buffers import Activations, ResidentWeights
from llmq_ray.model.build import ModelBuild, ModelPolicies
from llmq_ray.model.config import ModelConfig
from llmq_ray.model.layers.attention import Attention
from llmq_ray.model.layers.embedding import Embedding
from llmq_ray.model.layers.linear import BlockLinears, Projection, block_weights
from llmq_ray.model.layers.lm_head import LMHead
from llmq_ray.model.layers.units import EMBED, HEAD, UnitHooks
from llmq_ray.model.params import ModelParams, ParamLayout


class Decoder:
    """Explicit forward/backward of a decoder for fixed micro-batches of ``build``'s shape [B, T].

    ``params`` and ``grads`` are flat buffers in ``ParamLayout`` order (model dtype; they may be longer than the
    layout, e.g. padded for ZeRO). Gradients accumulate (+=) into ``grads`` until ``zero_grads()``. Instead of the
    two buffers a ``weights`` store may be given (``ResidentWeights``'s protocol; ZeRO-3's keeps only this rank's
    shard). ``loss_sum`` (fp32) and ``target_count`` (int64) accumulate on the device beside them. ``schedule``:
    the policies around each unit and the side streams they use (the engine's; a model built on its own runs them
    in order on the compute stream). ``policies``: what the engine applies from outside (module docstring).

    Subclasses set ``ROPE`` (rotary positions in the attention) and the five unit methods, and may extend
    ``__init__`` after this one (buffers of their own)."""

    ROPE = True
    # the delayed SwiGLU scale's state (llmq_ray/model/llama.py); None / False in families without it
    swiglu_dy_amax = swiglu_out_amax = None
    _swiglu_dy_amax_filled = _swiglu_out_amax_filled = False
    smooth = None

    def __init__(self, cfg: ModelConfig, backend: Backend, build: ModelBuild, *, params: torch.Tensor | None = None,
                 grads: torch.Tensor | None = None, weights=None, schedule: UnitHooks | None = None,
                 policies: ModelPolicies | None = None):
        if build.seq > cfg.max_position_embeddings:
            raise ValueError(f"a window of {build.seq} tokens is longer than the model's "
                             f"{cfg.max_position_embeddings} positions")
        self.cfg, self.backend, self.build = cfg, backend, build
        self.policies = policies = policies or ModelPolicies()
        self.schedule = schedule if schedule is not None else UnitHooks(backend.device)
        self.device, self.dtype = backend.device, build.dtype
        self.batch_size, self.seq_len = build.batch, build.seq
        self.recompute = build.recompute
        self.lmhead_chunks, self.attn_bwd_chunks = build.head_chunks, build.attention_chunks
        n, c, dtype, dev = build.rows, cfg.hidden_size, build.dtype, backend.device
        # the token rows [row0, row1) this process keeps of the residual stream (all N unless a plan splits them)
        row0, row1 = policies.plan.rows(n) if policies.plan is not None else (0, n)
        self.rows = row1 - row0
        self.layout = ParamLayout(cfg)
        if weights is None:
            params = params if params is not None else torch.zeros(self.layout.numel, dtype=dtype, device=dev)
            grads = grads if grads is not None else torch.zeros(self.layout.numel, dtype=dtype, device=dev)
            for what, buf in (("params", params), ("grads", grads)):
                if buf.dtype != dtype or buf.numel() < self.layout.numel or buf.device != dev:
                    raise ValueError(f"{what} buffer must be {dtype} on {dev} with >= {self.layout.numel} "
                                     f"elements, got {buf.dtype} {tuple(buf.shape)} on {buf.device}")
            weights = ResidentWeights(self.layout, params, grads)
        elif params is not None or grads is not None:
            raise ValueError("pass either params/grads buffers or a weights store, not both")
        self.store = weights
        self.params, self.grads = getattr(weights, "params", None), getattr(weights, "grads", None)
        # typed views (llmq_ray/model/params.py): self.w.blocks[l].qkv_w, self.g.embed, ...
        self.w, self.g = ModelParams(weights.w, cfg), ModelParams(weights.g, cfg)
        self.attention = Attention(backend, cfg, build, rope=self.ROPE)

        # FP8 without recomputation stores q(x^T) of each block GEMM input for the wgrad (layers/linear.py), so the
        # model-dtype ln1 / ln2 / MLP-activation outputs are dead once their forward GEMM has read them
        store_xt = build.store_xt
        unread = frozenset({"ln1", "ln2", self.MLP_OUT}) if build.fp8 and store_xt else frozenset()
        self.acts = Activations(cfg, build, dev, unread_by_backward=unread, rows=self.rows,
                                residuals=policies.residuals)
        empty = lambda *shape, dt=dtype: torch.empty(*shape, dtype=dt, device=dev)  # noqa: E731
        self.final_ln = empty(n, c)  # the head's input: all N rows (gathered when a plan splits them)
        self.final_rstd = empty(self.rows, dt=torch.float32)
        self.scratch_nc = empty(n, c)  # attention-out / MLP-out projection before the residual add
        self.head = LMHead(backend, cfg.vocab_size, c, n // build.head_chunks, build.head_chunks, dtype,
                           fp8=build.head_dtype == "e4m3")
        self.logits = self.head.logits
        self.losses = empty(n, dt=torch.float32)
        # backward buffers, shared by all layers
        self.d_residual = empty(self.rows, c)  # this process's rows of dL/dx
        self.d_ln = empty(n, c)  # a norm's output gradient (the GEMM input gradient above it)
        self.d_swiglu = empty(n, cfg.intermediate_size)  # the down projection's input gradient
        self.d_up_gate = self._mlp_in_grad_buffer(n)
        self.d_att = empty(build.batch, build.seq, cfg.num_heads, cfg.head_dim)
        self.d_qkv = empty(build.batch, build.seq, cfg.num_heads + 2 * cfg.num_kv_heads, cfg.head_dim)
        linears = policies.block_linears or BlockLinears
        self.lin = linears(backend, weights.w, {k: slot.shape for k, slot in self.layout.slots.items()},
                           cfg.num_layers, n, build.block_dtype, build.grad_fp8, store_xt=store_xt,
                           quants=build.weight_copies, sharded=not getattr(weights, "weights_resident", False),
                           names=block_weights(cfg))
        # the pieces a plan may replace (llmq_ray/parallel/tensor.py): the projections by name, the norm kind,
        # the token embedding, the head
        self.proj = {name: Projection(self.lin) for name in self.PROJECTIONS}
        self.norm = self.NORM(backend, cfg.rms_norm_eps)
        self.embedding = Embedding(backend)
        # what each unit needs before it runs, in this order: its weights, their FP8 copies, the saved residual
        for policy in (weights, self.lin, self.acts.residual):
            self.schedule.add(policy)
        # FP8: absmax of the four GEMM inputs of each layer [L, 4] = (ln1, att, ln2, MLP activation), written by
        # the producing kernels and kept for the wgrad's quantization in the backward
        self.amax = torch.zeros(cfg.num_layers, 4, dtype=torch.float32, device=dev)
        self._block_grads_zero = False
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=dev)
        self.target_count = torch.zeros((), dtype=torch.int64, device=dev)

    def _apply_plan(self) -> None:
        """The last step of a family's construction: the plan replaces the pieces it parallelizes."""
        if self.policies.plan is not None:
            self.policies.plan.apply(self)

    def _mlp_in_grad_buffer(self, n: int) -> torch.Tensor:
        """The gradient of the MLP's first GEMM output [N, width] (the family says its width)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ bookkeeping
    @property
    def documents(self):
        """The document mask the attention kernels get (None without document masking)."""
        return self.attention.mask

    @property
    def swiglu_out_absmax(self) -> torch.Tensor:
        """[L] fp32: each layer's max|MLP activation| (the down projection's FP8 input) in its last forward --
        before Smooth-SwiGLU's per-channel division, which leaves every channel's maximum in [1, 2)."""
        return self.smooth.raw_amax if self.smooth is not None else self.amax[:, 3]

    @property
    def swiglu_out_delayed(self) -> bool:
        """The next forward quantizes the SwiGLU outputs at delayed scales (after the first, measuring pass).
        Read it before a forward to know which scales that forward used."""
        return self.swiglu_out_amax is not None and self._swiglu_out_amax_filled

    def needs_weights(self, layer: int) -> bool:
        """Whether ``layer``'s model-dtype weights will be read when it runs next (a sharded store may skip
        gathering them when not): False only while its FP8 copies are current (``BlockLinears.needs_weights``)."""
        return self.lin.needs_weights(layer)

    def zero_grads(self) -> None:
        """Start a new optimizer step: zero gradients, the loss sum and the target count."""
        self.store.zero_grads()
        self._block_grads_zero = True  # the first backward may overwrite the block weight grads
        self.lin.invalidate_weights()  # the weights changed at the last update
        self.loss_sum.zero_()
        self.target_count.zero_()

    def activation_bytes(self) -> dict[str, int]:
        """Bytes of saved activations on the device: per layer, shared scratch, total for the whole model; and
        "host": the residual stream kept in host memory by the residual store (0 otherwise)."""
        return {"per_layer": self.acts.per_layer_bytes, "shared": self.acts.shared_bytes,
                "total": self.acts.total_bytes(self.cfg.num_layers), "host": self.acts.host_bytes}

    def _amax(self, layer: int, which: int) -> torch.Tensor | None:
        """Slot for the absmax of GEMM input ``which`` (0 ln1, 1 att, 2 ln2, 3 MLP activation) of ``layer``; None
        outside FP8, so the model-dtype path spends nothing on it."""
        return self.amax[layer, which] if self.lin.fp8 else None

    def _dy_amax(self) -> torch.Tensor | None:
        """FP8: where the kernel producing a block GEMM's output gradient writes max|dy| (read by the GEMM's
        backward right after, ``BlockLinears.backward(dy_amax_ready=True)``); None outside FP8."""
        return self.lin.dy_amax if self.lin.fp8 else None

    def _lm_head(self, backward: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.w.lm_head, self.g.lm_head if backward else None

    def check_batch_shape(self, inputs: torch.Tensor, targets: torch.Tensor | None) -> None:
        """One ValueError sentence unless inputs (and targets) are [B, T] for this model's micro-batch."""
        shape = (self.batch_size, self.seq_len)
        if tuple(inputs.shape) != shape or (targets is not None and tuple(targets.shape) != shape):
            raise ValueError(f"batch must be {shape} tokens, got inputs {tuple(inputs.shape)}"
                             + ("" if targets is None else f", targets {tuple(targets.shape)}"))

    def _check_batch(self, inputs: torch.Tensor, targets: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.check_batch_shape(inputs, targets)
        inputs = inputs.to(self.device, non_blocking=True).reshape(-1)
        if targets is not None:
            targets = targets.to(self.device, non_blocking=True).reshape(-1)
        return inputs, targets

    # ------------------------------------------------------------------ the wgrad overlap
    def use_wgrad_overlap(self, overlap) -> None:
        """Run the block wgrads through ``overlap`` (a WgradOverlap, llmq_ray/engine/wgrad_overlap.py, which makes
        it and checks what it runs with). Before the first micro-step (a captured CUDA graph keeps the order it
        was captured with)."""
        if self.lin.fp8 or not isinstance(self.store, ResidentWeights) or not self.WGRAD_OVERLAP:
            raise ValueError("the wgrad overlap runs model-dtype GEMMs of a SwiGLU block into a full gradient buffer")
        if self.lin.overlap is not None and self.lin.overlap.pending:
            raise RuntimeError("use_wgrad_overlap between micro-steps only (wgrads are still pending)")
        self.lin.overlap = overlap
        if self.device.type == "cuda":  # the side stream's scratch (or, serial, the compute stream's) before capture
            stream = overlap.stream
            self.backend.prepare_beside(stream if stream is not None else torch.cuda.current_stream(self.device))

    def _wait_wgrad(self, *names: str) -> None:
        """Before overwriting an input of the wgrads ``names`` still running beside the compute stream."""
        if self.lin.overlap is not None:
            self.lin.overlap.wait(*names)

    # ------------------------------------------------------------------ the unit loop
    def _forward_trunk(self, tokens: torch.Tensor, training: bool = True) -> None:
        """Embedding, all blocks and the final norm; leaves the result in ``final_ln``. ``training``: a forward
        of a training micro-step (``after_forward`` may keep what it measured for the next one)."""
        hooks = self.schedule
        if self.attention.documents is not None:
            self.attention.documents.refresh(tokens)
        hooks.before(EMBED)
        self.embed_forward(tokens)
        hooks.after(EMBED)
        self.first_norm()
        for layer in range(self.cfg.num_layers):
            hooks.before(layer)
            self.block_forward(layer)
            hooks.after(layer)
        self.after_forward(training)

    def _lm_head_loss(self, targets: torch.Tensor, backward: bool) -> torch.Tensor | None:
        """Chunked LM head + fused cross-entropy; with ``backward``, also the LM-head weight gradient, and returns
        the head's input gradient (dL/d final_ln: ``d_ln``, or this process's rows of its sum when a plan splits
        the vocabulary). Adds the chunk losses to ``loss_sum``."""
        self.schedule.before(HEAD, backward)
        w_head, g_head = self._lm_head(backward)  # g_head is None without backward
        d = self.head.run(self.final_ln, w_head, self.losses, targets, dx=self.d_ln if backward else None,
                          dw=g_head)
        self.schedule.after(HEAD, backward)
        self.loss_sum += self.losses.sum()
        self.target_count += (targets != -100).sum()
        return d

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """One micro-step: inputs/targets int [B, T] (targets -100 = masked). Accumulates into ``grads``
        the gradient of the *sum* of target losses, into ``loss_sum`` that sum, into ``target_count`` the
        number of unmasked targets. No host sync."""
        tokens, targets = self._check_batch(inputs, targets)
        self._forward_trunk(tokens)
        self.final_norm_backward(self._lm_head_loss(targets, backward=True))
        hooks = self.schedule
        for layer in reversed(range(self.cfg.num_layers)):
            hooks.before(layer, backward=True)
            self.block_backward(layer)
            hooks.after(layer, backward=True)
        hooks.before(EMBED, backward=True)
        self.embed_backward(tokens)
        hooks.after(EMBED, backward=True)
        if self.lin.overlap is not None:  # every gradient complete before anything reads them
            self.lin.overlap.wait_all()
        self._block_grads_zero = False  # a second micro-step must accumulate
        self.after_backward()

    def forward_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """Evaluation: adds the summed loss and target count of a batch to loss_sum / target_count
        (call zero_grads() or reset them first); gradients untouched."""
        tokens, targets = self._check_batch(inputs, targets)
        self.lin.invalidate_weights()  # eval may follow an update without a zero_grads() in between
        self._forward_trunk(tokens, training=False)
        self._lm_head_loss(targets, backward=False)

    @torch.no_grad()
    def logits_for(self, inputs: torch.Tensor) -> torch.Tensor:
        """Full logits [B, T, V] in fp32 for inputs [B, T] (tests, generation; allocates [N, V])."""
        tokens, _ = self._check_batch(inputs, None)
        self.lin.invalidate_weights()
        self._forward_trunk(tokens, training=False)
        self.schedule.before(HEAD)
        w_head, _ = self._lm_head(backward=False)
        out = torch.empty(tokens.numel(), self.cfg.vocab_size, dtype=self.dtype, device=self.device)
        self.head.logits_for(out, self.final_ln, w_head)
        self.schedule.after(HEAD)
        return out.float().view(self.batch_size, self.seq_len, -1)

    # ------------------------------------------------------------------ what a family writes
    def embed_forward(self, tokens: torch.Tensor) -> None:
        raise NotImplementedError

    def first_norm(self) -> None:
        raise NotImplementedError

    def block_forward(self, layer: int) -> None:
        raise NotImplementedError

    def after_forward(self, training: bool) -> None:
        """After the last block (what a training forward keeps for the next one)."""

    def final_norm_backward(self, d_head_in: torch.Tensor) -> None:
        raise NotImplementedError

    def block_backward(self, layer: int) -> None:
        raise NotImplementedError

    def embed_backward(self, tokens: torch.Tensor) -> None:
        raise NotImplementedError

    def after_backward(self) -> None:
        """After the embedding's backward (what a backward keeps for the next one)."""
