"""The Llama/Qwen2/Qwen3 decoder and GPT-2, with an explicit forward and backward over preallocated buffers.

No autograd: every activation the backward needs is written into a buffer allocated once, and the backward
is written out kernel by kernel (as llm.c / llm.q do). That is what makes fine-grained recomputation, FP8 in
all GEMMs, bit-exact recompute tests and CUDA graphs possible. All math goes through a Backend.

One block, for N = B*T rows (the residual stream ``x_l`` is the block's input):

    h      = rmsnorm(x_l)                 ln1      [N, C]
    qkv    = rope(h Wqkv^T + b)           qkv      [B, T, Hq+2Hkv, D]
    a, lse = causal_gqa_attention(qkv)    att      [B, T, Hq, D], lse [B, Hq, T]
    x_mid  = x_l + a Wo^T                 residual_mid [N, C]
    h2     = rmsnorm(x_mid)               ln2      [N, C]
    u      = h2 Wug^T                     up_gate  [N, 2I]  ([up | gate])
    s      = up * silu(gate)              swiglu   [N, I]
    x_l+1  = x_mid + s Wd^T

GPT-2 (``cfg.is_gpt2``; llm.c's model) is the same loop with its own block: x_0 = wte[tokens] + wpe[0..T-1]
(positions 0..T-1 in every window, ``position_embedding_forward``), LayerNorm with bias where Llama has RMSNorm
(the mean is kept beside rstd), every projection with a bias, a non-gated MLP and no RoPE (MHA):

    h      = layernorm(x_l)               ln1      [N, C]
    qkv    = h Wqkv^T + bqkv              qkv      [B, T, 3H, D]
    a, lse = causal_attention(qkv)        att, lse
    x_mid  = x_l + a Wo^T + bo            residual_mid
    h2     = layernorm(x_mid)             ln2
    f      = h2 Wup^T + bup               fc       [N, I]
    g      = gelu_tanh(f)                 gelu     [N, I]
    x_l+1  = x_mid + g Wd^T + bd

(``_gpt2_block_forward`` / ``_gpt2_block_backward`` / ``_gpt2_recompute``; the Llama path's methods do not look at
the architecture, the trunk picks the block once per unit.) The four GEMMs are the same ``BlockLinears`` (FP8
included), the recompute flags map kind for kind (``--recompute-swiglu`` recomputes the GELU output, ``-ffn`` the
c_fc output); the norms, GELU and positions are the backend's ``TORCH_DEFAULT_OPS`` (backends/base.py).

then ``final_norm`` and the LM head, run in ``lmhead_chunks`` row chunks: each chunk's logits [N/chunks, V]
go through the fused classifier, which turns them into dlogits in place, and the chunk's LM-head backward
runs at once, so the full [N, V] logits never exist (llmq_ray/model/lm_head.py; ``lmhead_dtype="e4m3"`` runs
its three GEMMs in FP8).

Loss scaling: the classifier writes the gradient of the *sum* of token losses. Gradients are therefore sums
over all tokens of all micro-steps (and all ranks); the update divides by the true number of unmasked target
tokens, known only then. This makes "mean over unmasked targets" exact under gradient accumulation and data
parallelism, where a per-micro-step mean would weight micro-batches with many masked tokens wrongly.

Recomputation (llm.q's flags): every activation kind is either stored per layer or kept in one shared
scratch buffer and recomputed in the backward from what is stored, with the very same kernels on the same
inputs, so results are bit-identical to not recomputing.
"""

from __future__ import annotations


import torch

from llmq_ray.backends.base import Backend
from llmq_ray.model.config import ModelConfig
from llmq_ray.errors import ConfigError
from llmq_ray.model.smooth_swiglu import SmoothSwiGLU
from llmq_ray.model.linear import BlockLinears, block_weights
from llmq_ray.model.lm_head import LMHead
from llmq_ray.options import RecomputeOptions  # noqa: F401 - defined with the other options, used here
from llmq_ray.model.params import ModelParams, ParamLayout
from llmq_ray.model.units import EMBED, HEAD, Policy, UnitHooks


# Which flag turns each activation kind from per-layer storage into a shared, recomputed scratch buffer.
_RECOMPUTED_BY = {"ln1": "norm", "qkv": "qkv", "att": "att", "lse": "att", "residual_mid": "block",
                  "ln2": "norm", "up_gate": "ffn", "swiglu": "swiglu", "qk_in": "qkv", "qk_rstd": "qkv",
                  "fc": "ffn", "gelu": "swiglu"}  # GPT-2: c_fc's output and the GELU's


class ResidualStream(Policy):
    """The residual stream x_0 .. x_L [N, C] (model dtype; [N/T, C], this rank's token rows, under sequence
    parallelism) that the forward saves for the backward; ``res[l]``.

    Resident: L+1 device buffers. Offloaded (``--offload-residual``): x_0 .. x_{L-1} live in host memory
    (pinned on CUDA), the device holds two slots (x_l in slot l % 2) and the final x_L. The model announces
    each block with ``forward_layer(l)`` / ``backward_layer(l)``, and this class moves the data one layer
    ahead on a side stream:

    * forward, block l: x_l (already in its slot) starts copying to the host; x_{l+1} will be written into
      the other slot, once x_{l-1}'s copy out of it (started one block earlier) has finished;
    * backward, block l: x_l must be in its slot (the forward left x_{L-1} and x_{L-2} there; older ones were
      fetched one block ahead); x_{l-1} starts copying in, into the slot block l+1 just finished with.

    Indexing a layer that is not on the device raises (a scheduling bug must not read stale data). On a CPU
    device the copies are synchronous and the same slots are used, so CPU tests check the bookkeeping.
    """

    def __init__(self, num_layers: int, n: int, c: int, dtype: torch.dtype, device: torch.device, offload: bool,
                 stream=None):
        self.num_layers, self.offload = num_layers, offload
        empty = lambda: torch.empty(n, c, dtype=dtype, device=device)  # noqa: E731
        if not offload:
            self.bufs = [empty() for _ in range(num_layers + 1)]
            return
        from llmq_ray.host_memory import host_zeros

        self.host = [host_zeros(n * c, dtype, device).view(n, c) for _ in range(num_layers)]
        self.slots = [empty(), empty()]
        self.final = empty()
        self.holder: list[int | None] = [None, None]   # which x_l each slot holds
        self.stream = stream                            # the schedule's side stream; None: copy in order
        self.cuda = stream is not None
        self.copied_out: list = [None, None]            # event: the slot's x_l has reached the host
        self.copied_in: list = [None, None]             # event: the slot's x_l has arrived from the host

    def __iter__(self):
        """The device buffers (all L+1 resident ones, or the two slots and the final one)."""
        return iter(self.bufs if not self.offload else [*self.slots, self.final])

    def host_tensors(self) -> list[torch.Tensor]:
        return self.host if self.offload else []

    def __getitem__(self, layer: int) -> torch.Tensor:
        if not self.offload:
            return self.bufs[layer]
        layer %= self.num_layers + 1
        if layer == self.num_layers:
            return self.final
        if self.holder[layer % 2] != layer:
            raise RuntimeError(f"offloaded residual {layer} is not on the device "
                               f"(slot {layer % 2} holds {self.holder[layer % 2]})")
        return self.slots[layer % 2]

    def _on_side(self):
        """Context: the side stream, after everything queued so far on the current stream."""
        side = self.stream
        side.wait_stream(torch.cuda.current_stream(side.device))
        return torch.cuda.stream(side)

    def begin(self, unit, backward: bool = False) -> None:
        """The unit policy (llmq_ray/model/units.py): a new forward at the embedding, then one layer at a time."""
        if unit == EMBED and not backward:
            self.begin_forward()
        elif isinstance(unit, int):
            (self.backward_layer if backward else self.forward_layer)(unit)

    def begin_forward(self) -> None:
        """Before the embedding writes x_0 into slot 0: earlier copies are finished, the slots are free."""
        if not self.offload:
            return
        if self.cuda:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
        self.holder = [0, None]
        self.copied_out = [None, None]
        self.copied_in = [None, None]

    def forward_layer(self, layer: int) -> None:
        if not self.offload:
            return
        nxt = layer + 1
        if nxt < self.num_layers:
            event = self.copied_out[nxt % 2]
            if event is not None:
                torch.cuda.current_stream(self.stream.device).wait_event(event)
            self.holder[nxt % 2] = nxt
        src, dst = self.slots[layer % 2], self.host[layer]
        if self.cuda:
            with self._on_side():
                dst.copy_(src, non_blocking=True)
                self.copied_out[layer % 2] = self.stream.record_event()
        else:
            dst.copy_(src)

    def backward_layer(self, layer: int) -> None:
        if not self.offload:
            return
        slot = layer % 2
        if self.holder[slot] != layer:  # not prefetched (cannot happen in forward_backward's order)
            self._fetch(layer)
        if self.copied_in[slot] is not None:
            torch.cuda.current_stream(self.stream.device).wait_event(self.copied_in[slot])
            self.copied_in[slot] = None
        if layer >= 1 and self.holder[(layer - 1) % 2] != layer - 1:
            self._fetch(layer - 1)

    def _fetch(self, layer: int) -> None:
        slot = layer % 2
        if self.cuda:
            with self._on_side():
                self.slots[slot].copy_(self.host[layer], non_blocking=True)
                self.copied_in[slot] = self.stream.record_event()
        else:
            self.slots[slot].copy_(self.host[layer])
        self.holder[slot] = layer


class Activations:
    """The forward's saved tensors: per layer where kept, one shared buffer where recomputed.

    Always per layer: ``residual`` (L+1 entries: the input of each block and the final residual; see
    ``ResidualStream`` for where they live) and the fp32 ``rstd1``/``rstd2`` of both norms (``rows`` floats each).
    ``unread_by_backward``: kinds the backward never reads (FP8 with stored q(x^T): ln1, ln2 and swiglu are
    read only by their forward GEMM, which keeps its own FP8 transposed copy for the wgrad); one shared
    buffer each, like a recomputed kind, but nothing refills them.
    GPT-2: ``fc`` [N, I] (c_fc's output) and ``gelu`` [N, I] in place of ``up_gate`` and ``swiglu``, and the fp32
    row means ``mean1`` / ``mean2`` of its LayerNorms beside the rstd.
    ``rows``: the token rows this rank keeps of the residual stream, ``residual_mid`` and the rstd (sequence
    parallelism, llmq_ray/engine/tensor_parallel.py: N / T; default all N). The norm outputs ``ln1`` / ``ln2``
    stay [N, C]: they are the gathered inputs of the column-parallel GEMMs.
    """

    def __init__(self, cfg: ModelConfig, batch: int, seq: int, dtype: torch.dtype, device: torch.device,
                 recompute: RecomputeOptions, offload_residual: bool = False,
                 unread_by_backward: frozenset = frozenset(), residual_stream=None, rows: int | None = None):
        n, c, L = batch * seq, cfg.hidden_size, cfg.num_layers
        r = n if rows is None else rows
        shapes = {
            "ln1": (n, c), "qkv": (batch, seq, cfg.num_heads + 2 * cfg.num_kv_heads, cfg.head_dim),
            "att": (batch, seq, cfg.num_heads, cfg.head_dim), "lse": (batch, cfg.num_heads, seq),
            "residual_mid": (r, c), "ln2": (n, c), "up_gate": (n, 2 * cfg.intermediate_size),
            "swiglu": (n, cfg.intermediate_size),
        }
        if cfg.is_gpt2:  # one MLP input matrix, GELU
            del shapes["up_gate"], shapes["swiglu"]
            shapes["fc"] = shapes["gelu"] = (n, cfg.intermediate_size)
        if cfg.qk_norm:  # Qwen3: the QK-norm's inputs and rstd, per query and key head (recomputed with qkv)
            shapes["qk_in"] = (n, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
            shapes["qk_rstd"] = (n, cfg.num_heads + cfg.num_kv_heads)
        self.recompute = recompute
        self.per_layer_bytes = 0
        self.shared_bytes = 0
        self._store: dict[str, list[torch.Tensor]] = {}
        for kind, shape in shapes.items():
            kind_dtype = torch.float32 if kind in ("lse", "qk_rstd") else dtype
            recomputed = getattr(recompute, _RECOMPUTED_BY[kind]) or kind in unread_by_backward
            count = 1 if recomputed else L
            bufs = [torch.empty(shape, dtype=kind_dtype, device=device) for _ in range(count)]
            self._store[kind] = bufs
            nbytes = bufs[0].numel() * bufs[0].element_size()
            if recomputed:
                self.shared_bytes += nbytes
            else:
                self.per_layer_bytes += nbytes
        self.residual = ResidualStream(L, r, c, dtype, device, offload_residual, residual_stream)
        self.rstd1 = [torch.empty(r, dtype=torch.float32, device=device) for _ in range(L)]
        self.rstd2 = [torch.empty(r, dtype=torch.float32, device=device) for _ in range(L)]
        self.per_layer_bytes += 2 * r * 4  # two rstd
        if cfg.is_gpt2:  # LayerNorm: the row means too
            self.mean1 = [torch.empty(n, dtype=torch.float32, device=device) for _ in range(L)]
            self.mean2 = [torch.empty(n, dtype=torch.float32, device=device) for _ in range(L)]
            self.per_layer_bytes += 2 * n * 4
        res_bytes = r * c * dtype.itemsize
        if offload_residual:  # two device slots + the final residual; x_0..x_{L-1} on the host
            self.shared_bytes += 3 * res_bytes
            self.host_bytes = L * res_bytes
        else:  # x_0..x_{L-1} per layer, plus the (L+1)-th: the last block's output
            self.per_layer_bytes += res_bytes
            self.shared_bytes += res_bytes
            self.host_bytes = 0

    def get(self, kind: str, layer: int) -> torch.Tensor:
        bufs = self._store[kind]
        return bufs[0] if len(bufs) == 1 else bufs[layer]

    def total_bytes(self, num_layers: int) -> int:
        return self.per_layer_bytes * num_layers + self.shared_bytes


class ResidentWeights(Policy):
    """Where the model reads weights and writes gradients: by default one full flat buffer of each (ZeRO-1).

    The model touches weights and gradients only through the name mappings ``w[name]`` / ``g[name]`` (read
    through the typed views of llmq_ray/model/params.py: ``model.w.blocks[l].qkv_w``), and
    brackets every use with ``begin(unit, backward)`` / ``end(unit, backward)``, where ``unit`` is a layer
    index, ``"embed"`` (the embedding lookup; its backward is the scatter-add at the very end) or ``"head"``
    (the LM head, forward and backward in the loss phase; the embedding itself when tied). Here those hooks do
    nothing unless an optimizer update is still running on a side stream (``llmq_ray/engine/update_overlap.py``):
    then ``ready`` holds, per unit, the event after which its weights are updated, and ``begin`` makes the
    compute stream wait for it; ``zero_grads`` is deferred to each unit's first ``begin`` (the update is still
    reading the gradients). The stores of llmq_ray/engine/zero3.py reduce a unit's gradients onto their owners
    after the backward's ``end`` (ZeRO-2 and 3) and gather its weights in ``begin`` (ZeRO-3).

    ``params`` / ``grads``: flat [>= layout.numel] model dtype (may be longer, e.g. padded for ZeRO).
    """

    # True when every layer's block-weight gradients start from zero at each micro-step (a fresh per-layer
    # buffer), so the block GEMMs may always overwrite them instead of accumulating.
    layer_grads_fresh = False

    weights_resident = True  # every weight is in ``params`` (BlockLinears may quantize all layers at once)

    def __init__(self, layout: ParamLayout, params: torch.Tensor, grads: torch.Tensor):
        self.params, self.grads = params, grads
        self.w = layout.views(params)
        self.g = layout.views(grads)
        self.ready: dict = {}        # unit -> CUDA event (None on the CPU): its part of the update is done
        self.unit_grads: dict = {}   # unit -> [gradient views]: what a deferred zero_grads zeroes at begin
        self.unzeroed: set = set()   # units whose gradients a deferred zero_grads has not zeroed yet

    def begin(self, unit, backward: bool = False) -> None:
        """``unit``'s weights (and, in the backward, its gradient buffers) are about to be used."""
        if unit in self.ready:
            event = self.ready.pop(unit)
            if event is not None:
                torch.cuda.current_stream(self.params.device).wait_event(event)
        if unit in self.unzeroed:
            self.unzeroed.discard(unit)
            for g in self.unit_grads[unit]:
                g.zero_()

    def end(self, unit, backward: bool = False) -> None:
        """The model is done with ``unit`` (in the backward: its gradients are complete for this micro-step)."""

    def zero_grads(self) -> None:
        """Zero the gradients now, or, while an update still reads them, each unit's at its first ``begin``."""
        if self.ready:
            self.unzeroed = set(self.unit_grads)
        else:
            self.grads.zero_()


class LlamaModel:
    """Explicit forward/backward of a Llama-family decoder for fixed micro-batch shape [B, T].

    ``params`` and ``grads`` are flat buffers in ``ParamLayout`` order (model dtype; they may be longer than
    the layout, e.g. padded for ZeRO). Gradients accumulate (+=) into ``grads`` until ``zero_grads()``.
    Instead of the two buffers a ``weights`` store may be given (see ``ResidentWeights``; ZeRO-3's keeps
    only this rank's shard). ``loss_sum`` (fp32) and ``target_count`` (int64) accumulate on the device
    alongside them.

    Memory options: ``offload_residual`` keeps the saved residual stream on the host (``ResidualStream``);
    ``attn_bwd_chunks`` runs the attention backward over the batch in that many pieces (the kernel's
    scratch, e.g. the reference's [B, H, T, T] probabilities, shrinks by that factor; results are the same).
    ``document_separator`` (a token id, e.g. EOS; None: off) turns on document masking: a window packs several
    documents, each ending with that token, and a token attends only to earlier tokens of its own document
    (``segments`` [B, T] int32, the document index of each token, computed on the device from the inputs of
    each forward: no host sync). RoPE needs no position reset for this: its scores depend only on the distance
    between two positions, so a document gets the attention it would get alone up to rounding. GPT-2's learned
    positions do need one: ``reset_positions`` (--reset-positions) makes each document's positions start at 0.
    The target at a separator position (the next document's first token) stays a target, as without masking.
    ``tensor_parallel`` (the training engine's, ``--tensor-parallel``): this rank's part of a
    tensor-parallel group (llmq_ray/engine/tensor_parallel.py's ``TensorParallelRank``: ``all_reduce_sum``,
    ``kv_replica_sum`` and ``kv_rows`` for the replicated KV heads, ``row_range`` / ``all_gather_rows`` /
    ``reduce_scatter_rows(_start)`` and ``overlap`` for sequence parallelism). ``cfg`` is then the rank's local
    config (its heads, intermediate slice and vocabulary shard) and the weights its shards. In a group of more
    than one rank the residual stream is split by token rows (sequence parallelism): this rank keeps rows
    ``_my_rows`` of the residual stream, residual_mid, the rstd and d_residual; a norm writes its rows of the next
    GEMM input (ln1 / ln2 / final_ln stay [N, C]) and the group all-gathers them; the embedding lookup (each rank
    its vocabulary rows) and the row-parallel outputs (attention out-projection, down projection) are
    reduce-scattered by rows before the residual add, the input gradients of the column-parallel GEMMs (QKV,
    up+gate, the LM head) before their norm's backward, and d_residual is all-gathered before the GEMMs that read
    it; the loss is the vocabulary-parallel cross-entropy of the rank's logits (llmq_ray/model/lm_head.py);
    ``reduce_tensor_parallel_grads()`` sums the gradients every rank holds a part of (the norm weights, QK-norm
    weights, replicated KV rows): once per optimizer step under ZeRO-1, per unit and micro-step under ZeRO-2/3.
    ``quants`` (FP8 only): where the FP8 weight copies live -- "persistent" (all layers, device), "host" (all
    layers, host memory, streamed one layer ahead) or "layer" (made per layer from the gathered weights); see
    llmq_ray/model/linear.py. The results are the same bits in every case.
    """

    def __init__(self, cfg: ModelConfig, backend: Backend, *, batch_size: int, seq_len: int,
                 dtype: torch.dtype = torch.float32, recompute: RecomputeOptions | None = None,
                 lmhead_chunks: int = 1, params: torch.Tensor | None = None, grads: torch.Tensor | None = None,
                 matmul_dtype: str | None = None, gradient_dtype: str | None = None,
                 weights=None, offload_residual: bool = False, attn_bwd_chunks: int = 1,
                 quants: str = "persistent", schedule: UnitHooks | None = None, lmhead_dtype: str | None = None,
                 delayed_swiglu_scale: bool = False, document_separator: int | None = None,
                 reset_positions: bool = False, tensor_parallel=None, smooth_swiglu: bool = False):
        self.cfg, self.backend = cfg, backend
        if tensor_parallel is not None and cfg.is_gpt2:
            raise ConfigError("--tensor-parallel does not take GPT-2 yet.")
        self.tp = tensor_parallel
        # the embedding and head split by vocabulary (a group of one holds the whole vocabulary: the plain path)
        self.vocab_parallel = tensor_parallel is not None and tensor_parallel.plan.size > 1
        if reset_positions and document_separator is None:
            raise ConfigError("--reset-positions needs --document-masking: positions restart at document starts.")
        if document_separator is not None and cfg.is_gpt2 and not reset_positions:
            raise ConfigError("--document-masking with GPT-2 needs --reset-positions: its learned positions must "
                              "restart at every document start for a document to be computed as if alone.")
        self.document_separator = document_separator
        self.segments = (torch.zeros(batch_size, seq_len, dtype=torch.int32, device=backend.device)
                         if document_separator is not None else None)
        # what the attention ops take: the segment ids, plus the fused GPU kernel's score bias (backends/attention.py)
        self.documents = (backend.attention_document_mask(self.segments, dtype)
                          if self.segments is not None else None)
        # per-token positions [B, T] (GPT-2 with --reset-positions; RoPE attends by distance, so a reset changes
        # nothing there and the RoPE models keep their tables)
        self.positions = (torch.zeros(batch_size, seq_len, dtype=torch.int64, device=backend.device)
                          if reset_positions and cfg.is_gpt2 else None)
        # the policies around each unit and the side streams they use (llmq_ray/model/units.py); the engine
        # passes its Schedule, a model built on its own runs them in order on the compute stream
        self.schedule = schedule if schedule is not None else UnitHooks(backend.device)
        self.device = backend.device
        self.dtype = dtype
        self.batch_size, self.seq_len = batch_size, seq_len
        self.recompute = (recompute or RecomputeOptions()).resolved()
        n = batch_size * seq_len
        if lmhead_chunks < 1 or n % lmhead_chunks:
            raise ConfigError(f"--lmhead-chunks={lmhead_chunks} must be >= 1 and divide batch*seq_len = {n}.")
        if seq_len > cfg.max_position_embeddings:
            raise ConfigError(f"--seq-len={seq_len} exceeds the model's max_position_embeddings "
                              f"({cfg.max_position_embeddings}).")
        # sequence parallelism (llmq_ray/engine/tensor_parallel.py): this rank keeps rows [row0, row0 + rows) of the
        # residual stream, the norms and their gradients; everything else is [N, ...] as without it
        self.sequence_parallel = self.vocab_parallel
        if self.sequence_parallel and n % tensor_parallel.plan.size:
            raise ConfigError(f"--tensor-parallel={tensor_parallel.plan.size} must divide the micro-batch's "
                              f"batch*seq_len = {n} tokens (sequence parallelism splits them by rows).")
        row0, row1 = tensor_parallel.row_range(n) if self.sequence_parallel else (0, n)
        self.rows, self._my_rows = row1 - row0, slice(row0, row1)
        if attn_bwd_chunks < 1 or batch_size % attn_bwd_chunks:
            raise ConfigError(f"--attn-bwd-chunks={attn_bwd_chunks} must be >= 1 and divide --batch-size={batch_size}.")
        self.lmhead_chunks = lmhead_chunks
        self.attn_bwd_chunks = attn_bwd_chunks
        self.layout = ParamLayout(cfg)
        if weights is None:
            params = params if params is not None else torch.zeros(self.layout.numel, dtype=dtype, device=self.device)
            grads = grads if grads is not None else torch.zeros(self.layout.numel, dtype=dtype, device=self.device)
            for what, buf in (("params", params), ("grads", grads)):
                if buf.dtype != dtype or buf.numel() < self.layout.numel or buf.device != self.device:
                    raise ValueError(f"{what} buffer must be {dtype} on {self.device} with >= {self.layout.numel} "
                                     f"elements, got {buf.dtype} {tuple(buf.shape)} on {buf.device}")
            weights = ResidentWeights(self.layout, params, grads)
        elif params is not None or grads is not None:
            raise ValueError("LlamaModel: pass either params/grads buffers or a weights store, not both")
        self.store = weights
        self.params, self.grads = getattr(weights, "params", None), getattr(weights, "grads", None)
        # typed views (llmq_ray/model/params.py): self.w.blocks[l].qkv_w, self.g.embed, ...
        self.w, self.g = ModelParams(weights.w, cfg), ModelParams(weights.g, cfg)

        self.gpt2 = cfg.is_gpt2
        if self.gpt2:
            if delayed_swiglu_scale:
                raise ConfigError("--fp8-delayed-swiglu-scale is for the SwiGLU MLP; GPT-2's GELU MLP does not take it.")
            if smooth_swiglu:
                raise ConfigError("--fp8-smooth-swiglu is for the SwiGLU MLP; GPT-2's GELU MLP does not take it.")
            self.rope_cos = self.rope_sin = None  # learned absolute positions instead
        else:
            positions = torch.arange(seq_len, dtype=torch.float32)
            angles = positions[:, None] * cfg.rope_inv_freq()[None, :]
            self.rope_cos = angles.cos().to(self.device)
            self.rope_sin = angles.sin().to(self.device)

        dev, c = self.device, cfg.hidden_size
        rc = self.recompute
        # FP8 without recomputation (recompute = the user asked for less memory) stores q(x^T) of each block GEMM
        # input for the wgrad (linear.py, store_xt), so the bf16 ln1 / ln2 / swiglu outputs are dead once their
        # forward GEMM has read them
        store_xt = not (rc.norm or rc.qkv or rc.att or rc.block or rc.ffn or rc.swiglu)
        mlp_out = "gelu" if self.gpt2 else "swiglu"  # the down projection's input
        unread = frozenset({"ln1", "ln2", mlp_out}) if matmul_dtype == "e4m3" and store_xt else frozenset()
        self.acts = Activations(cfg, batch_size, seq_len, dtype, dev, self.recompute, offload_residual,
                                unread_by_backward=unread,
                                residual_stream=self.schedule.stream("residual") if offload_residual else None,
                                rows=self.rows)
        empty = lambda *shape, dt=dtype: torch.empty(*shape, dtype=dt, device=dev)  # noqa: E731
        self.final_ln = empty(n, c)  # the head's input: gathered [N, C] under sequence parallelism
        self.final_rstd = empty(self.rows, dt=torch.float32)
        self.final_mean = empty(n, dt=torch.float32) if self.gpt2 else None
        self.scratch_nc = empty(n, c)  # attention-out / MLP-out projection before the residual add
        # sequence parallelism: the projection summed over the group, this rank's rows (its reduce-scatter)
        self.scratch_rows = empty(self.rows, c) if self.sequence_parallel else self.scratch_nc
        if lmhead_dtype not in (None, "e4m3"):
            raise ValueError(f"lmhead_dtype={lmhead_dtype!r} must be None (the model dtype) or 'e4m3'")
        self.head = LMHead(backend, cfg.vocab_size, c, n // lmhead_chunks, lmhead_chunks, dtype,
                           fp8=lmhead_dtype == "e4m3", pad=not self.vocab_parallel)
        self.logits = self.head.logits
        self.losses = empty(n, dt=torch.float32)
        # backward buffers, shared by all layers
        self.d_residual = empty(self.rows, c)  # this rank's rows under sequence parallelism
        self.d_ln = empty(n, c)  # a column-parallel GEMM's input gradient (this rank's part of the sum)
        # sequence parallelism: d_residual gathered for the GEMMs that read all rows; d_ln's sum, this rank's rows
        self.d_residual_full = empty(n, c) if self.sequence_parallel else self.d_residual
        self.d_ln_rows = empty(self.rows, c) if self.sequence_parallel else self.d_ln
        self.d_swiglu = empty(n, cfg.intermediate_size)
        width = (1 if self.gpt2 else 2) * cfg.intermediate_size  # GPT-2: d of c_fc's output
        if matmul_dtype == "e4m3" and not self.gpt2 and not backend.swiglu_backward_fp8_writes_dinp(dtype):
            # FP8: the SwiGLU backward writes only the up+gate GEMM's FP8 gradient, which then reads d_up_gate
            # for its shape alone: a [N, 2I] view of one element instead of the buffer
            self.d_up_gate = torch.empty((), dtype=dtype, device=backend.device).expand(n, width)
        else:
            self.d_up_gate = empty(n, width)
        self.d_att = empty(batch_size, seq_len, cfg.num_heads, cfg.head_dim)
        self.d_qkv = empty(batch_size, seq_len, cfg.num_heads + 2 * cfg.num_kv_heads, cfg.head_dim)
        # FP8 (matmul_dtype="e4m3"): absmax of the four GEMM inputs of each layer [L, 4] = (ln1, att, ln2,
        # swiglu), written by the producing kernels and kept for the wgrad's quantization in the backward.
        self.lin = BlockLinears(backend, weights.w, {k: slot.shape for k, slot in self.layout.slots.items()},
                                cfg.num_layers, n, matmul_dtype, gradient_dtype,
                                store_xt=store_xt,
                                quants=quants, sharded=not getattr(weights, "weights_resident", False),
                                stream=self.schedule.stream("fp8-copies") if quants == "host" else None,
                                names=block_weights(cfg))
        if hasattr(weights, "layer_needed"):  # ZeRO-3: skip gathering layers whose FP8 copies are current
            weights.layer_needed = self.lin.needs_weights
        # what each unit needs before it runs, in this order: its weights, their FP8 copies, the saved residual
        for policy in (weights, self.lin, self.acts.residual):
            self.schedule.add(policy)
        self.amax = torch.zeros(cfg.num_layers, 4, dtype=torch.float32, device=dev)
        # --fp8-delayed-swiglu-scale: per layer [L] fp32, max|d(up+gate)| of its last backward and max|SwiGLU out|
        # of its last forward, the scales of the next ones; filled by the first pass (which measures its own
        # scales), used from the second on. Each pass's kernels write what they measure into per-layer slots
        # (``_swiglu_dy_measured``, ``amax[:, 3]``) that one copy per pass turns into the next pass's scales.
        # The forward's needs q(x^T) kept for the wgrad (``store_xt``: no recomputation), as its kernel writes
        # only the FP8 copies of the SwiGLU output.
        delayed = delayed_swiglu_scale and self.lin.fp8
        self.swiglu_dy_amax = torch.zeros(cfg.num_layers, dtype=torch.float32, device=dev) if delayed else None
        self._swiglu_dy_measured = torch.zeros_like(self.swiglu_dy_amax) if delayed else None
        self.swiglu_out_amax = (torch.zeros(cfg.num_layers, dtype=torch.float32, device=dev)
                                if delayed and self.lin.store_xt else None)
        self._swiglu_dy_amax_filled = self._swiglu_out_amax_filled = False
        # --fp8-smooth-swiglu (llmq_ray/model/smooth_swiglu.py): per-channel factors of the SwiGLU output, folded
        # into the down projection; its forward copy is made from the bf16 weight every micro-step, so ZeRO-3
        # gathers every layer's weights in every pass
        self.smooth = None
        if smooth_swiglu and delayed_swiglu_scale:
            raise ConfigError("--fp8-smooth-swiglu and --fp8-delayed-swiglu-scale both set how the down "
                              "projection's FP8 input is scaled; use one of them.")
        if smooth_swiglu and self.lin.fp8:
            hidden, inter = self.layout.slots[self.w.blocks[0].key("down_w")].shape
            self.smooth = SmoothSwiGLU(backend, cfg.num_layers, hidden, inter, dtype, self.lin.fwd_dtype, dev)
            if hasattr(weights, "layer_needed"):
                weights.layer_needed = lambda layer: True
        self._block_grads_zero = False
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=dev)
        self.target_count = torch.zeros((), dtype=torch.int64, device=dev)

    # ------------------------------------------------------------------ bookkeeping
    @property
    def swiglu_out_absmax(self) -> torch.Tensor:
        """[L] fp32: each layer's max|SwiGLU output| in its last forward (FP8; the FP8 monitor reads it) -- before
        Smooth-SwiGLU's per-channel division, which leaves every channel's maximum in [1, 2)."""
        return self.smooth.raw_amax if self.smooth is not None else self.amax[:, 3]

    @property
    def swiglu_out_delayed(self) -> bool:
        """The next forward quantizes the SwiGLU outputs at delayed scales (--fp8-delayed-swiglu-scale, after its
        first, measuring pass). Read it before a forward to know which scales that forward used."""
        return self.swiglu_out_amax is not None and self._swiglu_out_amax_filled

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

    def zero_grads(self) -> None:
        """Start a new optimizer step: zero gradients, the loss sum and the target count."""
        self.store.zero_grads()
        self._block_grads_zero = True  # the first backward may overwrite the block weight grads
        self.lin.invalidate_weights()  # the weights changed at the last update
        self.loss_sum.zero_()
        self.target_count.zero_()

    def activation_bytes(self) -> dict[str, int]:
        """Bytes of saved activations on the device: per layer, shared scratch, total for the whole model; and
        "host": the residual stream kept in host memory with --offload-residual (0 otherwise)."""
        return {"per_layer": self.acts.per_layer_bytes, "shared": self.acts.shared_bytes,
                "total": self.acts.total_bytes(self.cfg.num_layers), "host": self.acts.host_bytes}

    def _amax(self, layer: int, which: int) -> torch.Tensor | None:
        """Slot for the absmax of GEMM input ``which`` (0 ln1, 1 att, 2 ln2, 3 swiglu) of ``layer``; None
        outside FP8, so the bf16 path spends nothing on it."""
        return self.amax[layer, which] if self.lin.fp8 else None

    # ------------------------------------------------------------------ sequence parallelism
    def _mine(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of an [N, ...] tensor (all of it without sequence parallelism)."""
        return full[self._my_rows] if self.sequence_parallel else full

    def _gather_rows(self, full: torch.Tensor, amax: torch.Tensor | None = None) -> None:
        """Sequence parallelism: every rank's rows of ``full`` [N, C] (each wrote its own through ``_mine``);
        under FP8, ``amax`` = max |x| over the gathered whole (the kernel that wrote the rows measured only
        them). Nothing without sequence parallelism."""
        if self.sequence_parallel:
            self.tp.all_gather_rows(full)
            if amax is not None:
                self.backend.absmax(amax, full)

    def _rows_amax(self, slot: torch.Tensor | None) -> torch.Tensor | None:
        """Where a norm kernel working on this rank's rows writes its FP8 absmax: ``slot``, or None under
        sequence parallelism, where the absmax of the gathered whole is taken after the gather instead
        (``_gather_rows``, ``_residual_grad_rows_all``) and the rows' own would only be overwritten."""
        return None if self.sequence_parallel else slot

    def _sum_rows(self, full: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """A row-parallel GEMM's partial output, or a column-parallel GEMM's input gradient, [N, C] summed over
        the group: returns this rank's rows of the sum, in ``out`` [N/T, C] (reduce-scatter) under sequence
        parallelism, ``full`` itself otherwise (a group of one holds the whole sum)."""
        if not self.sequence_parallel:
            return full
        self.tp.reduce_scatter_rows(out, full)
        return out

    def _column_backward(self, dw: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, key: str,
                         x_amax: torch.Tensor | None, accumulate: bool, **kw) -> torch.Tensor:
        """A column-parallel GEMM's backward (``lin.backward`` into d_ln) and its input gradient summed over the
        group: returns the rows of the sum this rank keeps (``_sum_rows``). With ``tp.overlap`` the
        reduce-scatter starts as soon as the dgrad GEMM is queued and runs beside the wgrad GEMM (on NCCL's
        stream; the same sums either way)."""
        if not (self.sequence_parallel and self.tp.overlap):
            self.lin.backward(self.d_ln, dw, dy, x, key, x_amax, accumulate, **kw)
            return self._sum_rows(self.d_ln, self.d_ln_rows)
        started = []
        self.lin.backward(self.d_ln, dw, dy, x, key, x_amax, accumulate, **kw,
                          after_dgrad=lambda: started.append(self.tp.reduce_scatter_rows_start(self.d_ln_rows,
                                                                                               self.d_ln)))
        started[0].wait()
        return self.d_ln_rows

    def _residual_grad_rows_all(self) -> torch.Tensor:
        """d_residual as the backward's GEMMs read it, all N rows: gathered under sequence parallelism (and
        under FP8 max |dy| of the whole in ``lin.dy_amax``, where the norm backward wrote its own rows')."""
        if not self.sequence_parallel:
            return self.d_residual
        self.tp.all_gather_rows(self.d_residual_full, self.d_residual)
        if self.lin.fp8:
            self.backend.absmax(self.lin.dy_amax, self.d_residual_full)
        return self.d_residual_full

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

    # ------------------------------------------------------------------ forward
    def _block_forward(self, layer: int) -> None:
        be, a, w, cfg = self.backend, self.acts, self.w.blocks[layer], self.cfg
        n = self.batch_size * self.seq_len
        ln1, qkv, att = a.get("ln1", layer), a.get("qkv", layer), a.get("att", layer)
        lin = self.lin
        lin.forward(qkv.view(n, -1), ln1, w.key("qkv_w"), self._amax(layer, 0), bias=w.qkv_b)
        self._qk_norm_forward(layer, qkv)
        be.rope_forward(qkv, self.rope_cos, self.rope_sin, cfg.num_heads, cfg.num_kv_heads)
        self._attention_forward(layer, qkv)
        lin.forward(self.scratch_nc, att.view(n, -1), w.key("out_w"), self._amax(layer, 1))
        out = self._sum_rows(self.scratch_nc, self.scratch_rows)  # row-parallel: the partial outputs, summed
        mid, ln2 = a.get("residual_mid", layer), a.get("ln2", layer)
        be.fused_residual_rmsnorm_forward(mid, self._mine(ln2), a.rstd2[layer], a.residual[layer], out,
                                          w.ln2_w, cfg.rms_norm_eps, absmax=self._rows_amax(self._amax(layer, 2)))
        self._gather_rows(ln2, self._amax(layer, 2))
        up_gate, swiglu = a.get("up_gate", layer), a.get("swiglu", layer)
        lin.forward(up_gate, ln2, w.key("up_gate_w"), self._amax(layer, 2))
        hist = self.swiglu_out_amax
        if hist is not None and self._swiglu_out_amax_filled:  # one pass at the last forward's scale
            xq, xt, descale = lin.x_quant_buffers(w.key("down_w"), n, cfg.intermediate_size)
            be.swiglu_forward_fp8(xq, xt, descale, up_gate, self.amax[layer, 3], swiglu, hist[layer])
            lin.forward(self.scratch_nc, swiglu, w.key("down_w"), None, x_quantized=True)
        elif self.smooth is not None:  # h / c into the FP8 GEMM with W diag(c)
            be.swiglu_forward(swiglu, up_gate)
            self.smooth.smooth_(layer, swiglu, self.amax[layer, 3])
            key = w.key("down_w")
            lin.forward(self.scratch_nc, swiglu, key, self.amax[layer, 3],
                        weight_fp8=self.smooth.weight_copy(layer, lin.w[key]))
        else:
            be.swiglu_forward(swiglu, up_gate, absmax=self._amax(layer, 3))
            lin.forward(self.scratch_nc, swiglu, w.key("down_w"), self._amax(layer, 3))
        out = self._sum_rows(self.scratch_nc, self.scratch_rows)  # row-parallel down projection, summed
        last = layer + 1 == cfg.num_layers
        next_ln = self.final_ln if last else a.get("ln1", layer + 1)
        next_rstd = self.final_rstd if last else a.rstd1[layer + 1]
        next_w = self.w.final_norm if last else self.w.blocks[layer + 1].ln1_w
        next_amax = self.head.x_amax if last else self._amax(layer + 1, 0)
        be.fused_residual_rmsnorm_forward(a.residual[layer + 1], self._mine(next_ln), next_rstd, mid, out,
                                          next_w, cfg.rms_norm_eps, absmax=self._rows_amax(next_amax))
        self._gather_rows(next_ln, next_amax)

    def _forward_trunk(self, tokens: torch.Tensor, training: bool = True) -> None:
        """Embedding, all blocks and the final norm; leaves the result in ``final_ln``. ``training``: a forward
        of a training micro-step, whose SwiGLU maxima become the next forward's delayed scales
        (--fp8-delayed-swiglu-scale); an evaluation's or generation's forward uses the kept scales but does not
        replace them, so the training forward after a periodic eval quantizes as if the eval had not run."""
        be, a, hooks = self.backend, self.acts, self.schedule
        if self.segments is not None:  # document index = separators strictly before each token
            is_sep = (tokens.view(self.batch_size, self.seq_len) == self.document_separator).to(torch.int32)
            torch.cumsum(is_sep, dim=1, out=self.segments)
            self.segments.sub_(is_sep)
            self.documents.refresh()
            if self.positions is not None:  # t minus the start of its document (a running max of the starts)
                t = torch.arange(self.seq_len, device=tokens.device).expand(self.batch_size, -1)
                starts_here = torch.zeros_like(is_sep, dtype=torch.bool)
                starts_here[:, 1:] = is_sep[:, :-1].bool()
                start = torch.where(starts_here, t, torch.zeros_like(t)).cummax(dim=1).values
                torch.sub(t, start, out=self.positions)
        hooks.before(EMBED)
        if self.vocab_parallel:  # this rank's vocabulary rows, zeros for other tokens, summed over the group
            self._tp_tokens = self._vocab_local(tokens)  # (into this rank's token rows: sequence parallelism)
            local, mine = self._tp_tokens
            be.embedding_forward(self.scratch_nc, local, self.w.embed)
            self.scratch_nc.mul_(mine[:, None].to(self.scratch_nc.dtype))
            self.tp.reduce_scatter_rows(a.residual[0], self.scratch_nc)
        else:
            be.embedding_forward(a.residual[0], tokens, self.w.embed)
        if self.gpt2:
            be.position_embedding_forward(a.residual[0], self.w.pos_embed, self.seq_len, self.positions)
        hooks.after(EMBED)
        w0 = self.w.blocks[0]
        if self.gpt2:
            be.layernorm_forward(a.get("ln1", 0), a.mean1[0], a.rstd1[0], a.residual[0], w0.ln1_w, w0.ln1_b,
                                 self.cfg.rms_norm_eps, absmax=self._amax(0, 0))
        else:
            be.rmsnorm_forward(self._mine(a.get("ln1", 0)), a.rstd1[0], a.residual[0], w0.ln1_w,
                               self.cfg.rms_norm_eps, absmax=self._rows_amax(self._amax(0, 0)))
            self._gather_rows(a.get("ln1", 0), self._amax(0, 0))
        block_forward = self._gpt2_block_forward if self.gpt2 else self._block_forward
        for layer in range(self.cfg.num_layers):
            hooks.before(layer)
            block_forward(layer)
            hooks.after(layer)
        if self.swiglu_out_amax is not None and training:  # this forward's maxima: the scales of the next one
            self.swiglu_out_amax.copy_(self.amax[:, 3])
            self._swiglu_out_amax_filled = True

    def _attention_forward(self, layer: int, qkv: torch.Tensor) -> None:
        """att and lse of ``layer`` from its post-RoPE qkv (within documents under document masking); FP8: the
        out-projection's input absmax. Shared by both block kinds' forward and recompute."""
        att = self.acts.get("att", layer)
        self.backend.attention_forward(att, self.acts.get("lse", layer), qkv, self.cfg.num_heads,
                                       self.cfg.num_kv_heads, self.documents)
        if self.lin.fp8:
            self.backend.absmax(self.amax[layer, 1], att)

    def _qk_norm_forward(self, layer: int, qkv: torch.Tensor) -> None:
        """Qwen3: the per-head RMSNorm of the query and key heads of ``qkv``, in place, before RoPE."""
        cfg = self.cfg
        if cfg.qk_norm:
            w = self.w.blocks[layer]
            self.backend.qk_norm_forward(qkv, self.acts.get("qk_in", layer), self.acts.get("qk_rstd", layer),
                                         w.q_norm_w, w.k_norm_w, cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps)

    # ------------------------------------------------------------------ backward
    def _recompute(self, layer: int) -> None:
        """Refill the shared buffers of ``layer`` that the forward did not keep (same kernels, same inputs)."""
        rc, be, a, w, cfg = self.recompute, self.backend, self.acts, self.w.blocks[layer], self.cfg
        n = self.batch_size * self.seq_len
        eps = cfg.rms_norm_eps
        if rc.norm:
            be.rmsnorm_forward(self._mine(a.get("ln1", layer)), a.rstd1[layer], a.residual[layer], w.ln1_w, eps,
                               absmax=self._rows_amax(self._amax(layer, 0)))
            self._gather_rows(a.get("ln1", layer), self._amax(layer, 0))
        qkv, lin = a.get("qkv", layer), self.lin
        if rc.qkv:
            lin.forward(qkv.view(n, -1), a.get("ln1", layer), w.key("qkv_w"), self._amax(layer, 0),
                        bias=w.qkv_b)
            self._qk_norm_forward(layer, qkv)
            be.rope_forward(qkv, self.rope_cos, self.rope_sin, cfg.num_heads, cfg.num_kv_heads)
        if rc.att:
            self._attention_forward(layer, qkv)
        if rc.block:
            lin.forward(self.scratch_nc, a.get("att", layer).view(n, -1), w.key("out_w"), self._amax(layer, 1))
            out = self._sum_rows(self.scratch_nc, self.scratch_rows)
            be.fused_residual_rmsnorm_forward(a.get("residual_mid", layer), self._mine(a.get("ln2", layer)),
                                              a.rstd2[layer], a.residual[layer], out, w.ln2_w, eps,
                                              absmax=self._rows_amax(self._amax(layer, 2)))
            self._gather_rows(a.get("ln2", layer), self._amax(layer, 2))
        elif rc.norm:
            be.rmsnorm_forward(self._mine(a.get("ln2", layer)), a.rstd2[layer], a.get("residual_mid", layer),
                               w.ln2_w, eps, absmax=self._rows_amax(self._amax(layer, 2)))
            self._gather_rows(a.get("ln2", layer), self._amax(layer, 2))
        if rc.ffn:
            lin.forward(a.get("up_gate", layer), a.get("ln2", layer), w.key("up_gate_w"), self._amax(layer, 2))
        if rc.swiglu:
            be.swiglu_forward(a.get("swiglu", layer), a.get("up_gate", layer), absmax=self._amax(layer, 3))
            if self.smooth is not None:  # the same h: the forward's factors again (GPT-2 never has them)
                self.smooth.reapply_(layer, a.get("swiglu", layer), self.amax[layer, 3])

    def use_wgrad_overlap(self, overlap) -> None:
        """Run the block wgrads through ``overlap`` (a WgradOverlap, llmq_ray/engine/wgrad_overlap.py, which makes
        it and checks the SM count): model dtype only, with all weights resident (ZeRO-3 reduces each layer's
        gradients as its backward ends). Before the first micro-step (a captured CUDA graph keeps the order it
        was captured with)."""
        if self.lin.fp8:
            raise ConfigError("the wgrad overlap runs the model-dtype GEMMs; it does not apply with "
                              "--matmul-dtype e4m3")
        if self.gpt2:
            raise ConfigError("--overlap-wgrad-sms is built for the Llama-family block; GPT-2 does not take it yet.")
        if not isinstance(self.store, ResidentWeights):
            raise ConfigError("the wgrad overlap needs the full gradient buffer of ZeRO-1 (ZeRO-2/3 reduce each "
                              "layer's gradients as soon as its backward ends)")
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

    def _block_backward(self, layer: int) -> None:
        """Backward of one block. On entry d_residual = dL/dx_{l+1}; on exit dL/dx_l. Weight grads += .

        With the wgrad overlap, the waits below guard the buffers a pending wgrad reads: d_residual (down_w,
        out_w), the shared d_up_gate and d_qkv (the layer above's up_gate_w, qkv_w; implied by the other two,
        kept to name each hazard), and the recomputed ln1 (the layer above's qkv_w)."""
        be, a, cfg = self.backend, self.acts, self.cfg
        w, g = self.w.blocks[layer], self.g.blocks[layer]
        n = self.batch_size * self.seq_len
        if self.recompute.norm:  # the recomputed ln1 is shared: the layer above's qkv wgrad reads it (the others
            self._wait_wgrad("qkv_w")  # are done: its out_w wait covered them, the side stream runs in order)
        self._recompute(layer)
        dres = self.d_residual
        # MLP: x_{l+1} = x_mid + swiglu(ln2 Wug^T) Wd^T
        lin, acc = self.lin, not (self._block_grads_zero or self.store.layer_grads_fresh)
        # dres and max|dres| (in lin.dy_amax under FP8) come from the RMSNorm backward above this block
        dy = self._residual_grad_rows_all()  # all rows (gathered under sequence parallelism)
        lin.backward(self.d_swiglu, g.down_w, dy, a.get("swiglu", layer), w.key("down_w"), self._amax(layer, 3),
                     acc, dy_amax_ready=True, wgrad_columns=None if self.smooth is None
                     else self.smooth.wgrad_factors(layer, g.down_w.dtype))
        if lin.fp8:  # the up+gate GEMM's FP8 gradient (both layouts) straight out of the SwiGLU backward
            q, q_t, descale, amax = lin.dy_quant_buffers(*self.d_up_gate.shape)
            hist = self.swiglu_dy_amax
            delayed = None
            if hist is not None:  # measured into this layer's slot; the kept scale once there is one
                amax = self._swiglu_dy_measured[layer]
                delayed = hist[layer] if self._swiglu_dy_amax_filled else None
            be.swiglu_backward_fp8(q, q_t, descale, self.d_swiglu, a.get("up_gate", layer), amax, self.d_up_gate,
                                   scale_absmax=delayed)
        else:
            self._wait_wgrad("up_gate_w")
            be.swiglu_backward(self.d_up_gate, self.d_swiglu, a.get("up_gate", layer))
        d_ln = self._column_backward(g.up_gate_w, self.d_up_gate, a.get("ln2", layer), w.key("up_gate_w"),
                                     self._amax(layer, 2), acc, dy_quantized=lin.fp8)
        self._wait_wgrad("down_w")
        be.rmsnorm_backward(dres, g.ln2_w, d_ln, a.get("residual_mid", layer), w.ln2_w,
                            a.rstd2[layer], dresidual=dres, absmax=self._rows_amax(self._dy_amax()))  # FP8: out-proj dy scale
        # attention: x_mid = x_l + attention(rope(ln1 Wqkv^T + b)) Wo^T
        att = a.get("att", layer)
        dy = self._residual_grad_rows_all()
        lin.backward(self.d_att.view(n, -1), g.out_w, dy, att.view(n, -1), w.key("out_w"), self._amax(layer, 1),
                     acc, dy_amax_ready=True)
        self._wait_wgrad("qkv_w")
        self._attention_backward(att, a.get("lse", layer), a.get("qkv", layer))  # d_qkv before RoPE
        if cfg.qk_norm:  # Qwen3: through the QK-norm to the QKV GEMM's output
            be.qk_norm_backward(self.d_qkv, g.q_norm_w, g.k_norm_w, a.get("qk_in", layer), a.get("qk_rstd", layer),
                                w.q_norm_w, w.k_norm_w, cfg.num_heads, cfg.num_kv_heads)
        d_qkv = self.d_qkv.view(n, -1)
        if cfg.qkv_bias:  # FP8: the same read of d_qkv gives the QKV GEMM's dy scale
            be.bias_backward(g.qkv_b, d_qkv, absmax=self._dy_amax())
        d_ln = self._column_backward(g.qkv_w, d_qkv, a.get("ln1", layer), w.key("qkv_w"), self._amax(layer, 0),
                                     acc, dy_amax_ready=cfg.qkv_bias)
        self._wait_wgrad("out_w")
        be.rmsnorm_backward(dres, g.ln1_w, d_ln, a.residual[layer], w.ln1_w,
                            a.rstd1[layer], dresidual=dres,
                            absmax=self._rows_amax(self._dy_amax()) if layer > 0 else None)  # FP8: the down-proj dy below

    def _vocab_local(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tensor parallelism: (row of each token in this rank's vocabulary shard, clamped into it; whether the
        token is in the shard) for tokens [N] -- the lookup reads a real row for every token and the mask zeroes
        the others."""
        start, valid = self.tp.vocab_start, self.tp.vocab_valid
        mine = (tokens >= start) & (tokens < start + valid)
        return (tokens - start).clamp(0, max(valid - 1, 0)), mine

    def reduce_tensor_parallel_grads(self, unit=None) -> None:
        """Tensor parallelism: sum the gradients each rank holds only a part of -- the norm weights ln1_w, ln2_w
        and final_norm (sequence parallelism: each rank's norms saw only its token rows) and the QK-norm weights
        (shared by all heads, each rank saw its own heads) over the group, the K and V rows of replicated KV heads
        (each replica saw its own query heads) over the replicas. Everything else is this rank's own shard.
        ``unit``: None = all of them (ZeRO-1: once per step, after the last micro-step); under ZeRO-2/3, before
        each gradient reduce of every micro-step (sums are linear), a layer index = that layer's qkv_w rows,
        ``"plain"`` = the norm-and-bias tail (norm and QK-norm weights, qkv_b rows)."""
        if self.tp is None:
            return
        layers = [unit] if isinstance(unit, int) else range(self.cfg.num_layers)
        group_sums = []  # summed over the whole group in one packed collective below
        for layer in layers:
            g = self.g.blocks[layer]
            if unit is None or unit == "plain":
                if self.sequence_parallel:  # each rank's norms saw only its rows
                    group_sums += [g.ln1_w, g.ln2_w]
                if self.cfg.qk_norm:
                    group_sums += [g.q_norm_w, g.k_norm_w]
                if g.qkv_b is not None:
                    for rows in self.tp.kv_rows:
                        self.tp.kv_replica_sum(g.qkv_b[rows])
            if unit is None or isinstance(unit, int):
                for rows in self.tp.kv_rows:
                    self.tp.kv_replica_sum(g.qkv_w[rows])
        if self.sequence_parallel and unit in (None, "plain"):
            group_sums.append(self.g.final_norm)
        self.tp.all_reduce_sum_packed(group_sums)

    def _attention_backward(self, att: torch.Tensor, lse: torch.Tensor, qkv: torch.Tensor) -> None:
        """d_qkv (the gradient of the pre-RoPE qkv) from d_att, in ``attn_bwd_chunks`` slices of the batch (rows
        of a batch are independent, RoPE depends only on the position, and slices along B of these contiguous
        [B, ...] buffers are contiguous)."""
        cfg, step = self.cfg, self.batch_size // self.attn_bwd_chunks
        for lo in range(0, self.batch_size, step):
            sl = slice(lo, lo + step)
            self.backend.attention_rope_backward(self.d_qkv[sl], self.d_att[sl], att[sl], lse[sl], qkv[sl],
                                                 self.rope_cos, self.rope_sin, cfg.num_heads, cfg.num_kv_heads,
                                                 None if self.documents is None else self.documents.rows(sl))

    # ------------------------------------------------------------------ GPT-2's block
    def _gpt2_block_forward(self, layer: int) -> None:
        """GPT-2's block (module docstring); ln1 of ``layer`` is already written (by the embedding's LayerNorm or
        the previous block's fused residual add), and this block writes the next one's (or the final norm)."""
        be, a, w, cfg, lin = self.backend, self.acts, self.w.blocks[layer], self.cfg, self.lin
        n, eps = self.batch_size * self.seq_len, cfg.rms_norm_eps
        qkv, att = a.get("qkv", layer), a.get("att", layer)
        lin.forward(qkv.view(n, -1), a.get("ln1", layer), w.key("qkv_w"), self._amax(layer, 0), bias=w.qkv_b)
        self._attention_forward(layer, qkv)
        lin.forward(self.scratch_nc, att.view(n, -1), w.key("out_w"), self._amax(layer, 1), bias=w.out_b)
        mid, ln2 = a.get("residual_mid", layer), a.get("ln2", layer)
        be.fused_residual_layernorm_forward(mid, ln2, a.mean2[layer], a.rstd2[layer], a.residual[layer],
                                            self.scratch_nc, w.ln2_w, w.ln2_b, eps, absmax=self._amax(layer, 2))
        fc, gelu = a.get("fc", layer), a.get("gelu", layer)
        lin.forward(fc, ln2, w.key("up_w"), self._amax(layer, 2), bias=w.up_b)
        be.gelu_tanh_forward(gelu, fc, absmax=self._amax(layer, 3))
        lin.forward(self.scratch_nc, gelu, w.key("down_w"), self._amax(layer, 3), bias=w.down_b)
        if layer + 1 == cfg.num_layers:
            be.fused_residual_layernorm_forward(a.residual[layer + 1], self.final_ln, self.final_mean,
                                                self.final_rstd, mid, self.scratch_nc, self.w.final_norm,
                                                self.w.final_norm_b, eps, absmax=self.head.x_amax)
        else:
            nw = self.w.blocks[layer + 1]
            be.fused_residual_layernorm_forward(a.residual[layer + 1], a.get("ln1", layer + 1), a.mean1[layer + 1],
                                                a.rstd1[layer + 1], mid, self.scratch_nc, nw.ln1_w, nw.ln1_b, eps,
                                                absmax=self._amax(layer + 1, 0))

    def _gpt2_recompute(self, layer: int) -> None:
        """``_recompute`` for GPT-2's block: the same flags, the same kernels on the same inputs as its forward."""
        rc, be, a, w, cfg, lin = self.recompute, self.backend, self.acts, self.w.blocks[layer], self.cfg, self.lin
        n, eps = self.batch_size * self.seq_len, cfg.rms_norm_eps
        if rc.norm:
            be.layernorm_forward(a.get("ln1", layer), a.mean1[layer], a.rstd1[layer], a.residual[layer], w.ln1_w,
                                 w.ln1_b, eps, absmax=self._amax(layer, 0))
        qkv = a.get("qkv", layer)
        if rc.qkv:
            lin.forward(qkv.view(n, -1), a.get("ln1", layer), w.key("qkv_w"), self._amax(layer, 0), bias=w.qkv_b)
        if rc.att:
            self._attention_forward(layer, qkv)
        if rc.block:
            lin.forward(self.scratch_nc, a.get("att", layer).view(n, -1), w.key("out_w"), self._amax(layer, 1),
                        bias=w.out_b)
            be.fused_residual_layernorm_forward(a.get("residual_mid", layer), a.get("ln2", layer), a.mean2[layer],
                                                a.rstd2[layer], a.residual[layer], self.scratch_nc, w.ln2_w, w.ln2_b,
                                                eps, absmax=self._amax(layer, 2))
        elif rc.norm:
            be.layernorm_forward(a.get("ln2", layer), a.mean2[layer], a.rstd2[layer], a.get("residual_mid", layer),
                                 w.ln2_w, w.ln2_b, eps, absmax=self._amax(layer, 2))
        if rc.ffn:
            lin.forward(a.get("fc", layer), a.get("ln2", layer), w.key("up_w"), self._amax(layer, 2), bias=w.up_b)
        if rc.swiglu:
            be.gelu_tanh_forward(a.get("gelu", layer), a.get("fc", layer), absmax=self._amax(layer, 3))

    def _gpt2_block_backward(self, layer: int) -> None:
        """Backward of ``_gpt2_block_forward``. On entry d_residual = dL/dx_{l+1} (and, under FP8, max|d_residual|
        in ``lin.dy_amax`` from the LayerNorm backward above); on exit dL/dx_l. Weight and bias grads += ."""
        be, a, cfg, lin = self.backend, self.acts, self.cfg, self.lin
        w, g = self.w.blocks[layer], self.g.blocks[layer]
        n = self.batch_size * self.seq_len
        self._gpt2_recompute(layer)
        dres, acc = self.d_residual, not (self._block_grads_zero or self.store.layer_grads_fresh)
        # MLP: x_{l+1} = x_mid + gelu(ln2 Wup^T + bup) Wd^T + bd
        be.bias_backward(g.down_b, dres)
        lin.backward(self.d_swiglu, g.down_w, dres, a.get("gelu", layer), w.key("down_w"), self._amax(layer, 3),
                     acc, dy_amax_ready=True)
        d_fc = self.d_up_gate
        be.gelu_tanh_backward(d_fc, self.d_swiglu, a.get("fc", layer), absmax=self._dy_amax())
        be.bias_backward(g.up_b, d_fc)
        lin.backward(self.d_ln, g.up_w, d_fc, a.get("ln2", layer), w.key("up_w"), self._amax(layer, 2), acc,
                     dy_amax_ready=True)
        be.layernorm_backward(dres, g.ln2_w, g.ln2_b, self.d_ln, a.get("residual_mid", layer), w.ln2_w,
                              a.mean2[layer], a.rstd2[layer], dresidual=dres, absmax=self._dy_amax())
        # attention: x_mid = x_l + attention(ln1 Wqkv^T + bqkv) Wo^T + bo
        be.bias_backward(g.out_b, dres)
        att, lse, qkv = a.get("att", layer), a.get("lse", layer), a.get("qkv", layer)
        lin.backward(self.d_att.view(n, -1), g.out_w, dres, att.view(n, -1), w.key("out_w"), self._amax(layer, 1),
                     acc, dy_amax_ready=True)
        step = self.batch_size // self.attn_bwd_chunks
        for lo in range(0, self.batch_size, step):
            sl = slice(lo, lo + step)
            be.attention_backward(self.d_qkv[sl], self.d_att[sl], att[sl], lse[sl], qkv[sl], cfg.num_heads,
                                  cfg.num_kv_heads, None if self.documents is None else self.documents.rows(sl))
        d_qkv = self.d_qkv.view(n, -1)
        be.bias_backward(g.qkv_b, d_qkv, absmax=self._dy_amax())  # FP8: the QKV GEMM's dy scale, same read
        lin.backward(self.d_ln, g.qkv_w, d_qkv, a.get("ln1", layer), w.key("qkv_w"), self._amax(layer, 0), acc,
                     dy_amax_ready=True)
        be.layernorm_backward(dres, g.ln1_w, g.ln1_b, self.d_ln, a.residual[layer], w.ln1_w, a.mean1[layer],
                              a.rstd1[layer], dresidual=dres, absmax=self._dy_amax() if layer > 0 else None)

    # ------------------------------------------------------------------ public steps
    def _lm_head_loss(self, targets: torch.Tensor, backward: bool) -> None:
        """Chunked LM head + fused cross-entropy; with ``backward``, also dL/d final_ln into d_ln and the
        LM-head weight gradient. Adds the chunk losses to ``loss_sum``."""
        self.schedule.before(HEAD, backward)
        w_head, g_head = self._lm_head(backward)  # g_head is None without backward
        if self.vocab_parallel:  # this rank's logits, the cross-entropy over the group
            self.head.run_vocab_parallel(self.final_ln, w_head, self.losses, targets, self.tp,
                                         dx=self.d_ln if backward else None, dw=g_head)
        else:
            self.head.run(self.final_ln, w_head, self.losses, targets, dx=self.d_ln if backward else None, dw=g_head)
        self.schedule.after(HEAD, backward)
        self.loss_sum += self.losses.sum()
        self.target_count += (targets != -100).sum()

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """One micro-step: inputs/targets int [B, T] (targets -100 = masked). Accumulates into ``grads``
        the gradient of the *sum* of target losses, into ``loss_sum`` that sum, into ``target_count`` the
        number of unmasked targets. No host sync."""
        tokens, targets = self._check_batch(inputs, targets)
        self._forward_trunk(tokens)
        self._lm_head_loss(targets, backward=True)
        a, hooks = self.acts, self.schedule
        if self.gpt2:
            self.backend.layernorm_backward(self.d_residual, self.g.final_norm, self.g.final_norm_b, self.d_ln,
                                            a.residual[-1], self.w.final_norm, self.final_mean, self.final_rstd,
                                            absmax=self._dy_amax())
        else:  # the head's input gradient: this rank's vocabulary part, summed over the group (its rows)
            d_ln = self._sum_rows(self.d_ln, self.d_ln_rows)
            self.backend.rmsnorm_backward(self.d_residual, self.g.final_norm, d_ln, a.residual[-1],
                                          self.w.final_norm, self.final_rstd, absmax=self._rows_amax(self._dy_amax()))
        block_backward = self._gpt2_block_backward if self.gpt2 else self._block_backward
        for layer in reversed(range(self.cfg.num_layers)):
            hooks.before(layer, backward=True)
            block_backward(layer)
            hooks.after(layer, backward=True)
        hooks.before(EMBED, backward=True)
        if self.vocab_parallel:  # every token's gradient (gathered), zeroed where the token is not in this shard
            local, mine = self._tp_tokens
            self.tp.all_gather_rows(self.d_residual_full, self.d_residual)
            self.d_residual_full.mul_(mine[:, None].to(self.d_residual_full.dtype))
            self.backend.embedding_backward(self.g.embed, local, self.d_residual_full)
        else:
            self.backend.embedding_backward(self.g.embed, tokens, self.d_residual)
        if self.gpt2:
            self.backend.position_embedding_backward(self.g.pos_embed, self.d_residual, self.seq_len,
                                                     self.positions)
        hooks.after(EMBED, backward=True)
        if self.lin.overlap is not None:  # every gradient complete before anything reads them
            self.lin.overlap.wait_all()
        self._block_grads_zero = False  # a second micro-step must accumulate
        if self.swiglu_dy_amax is not None:  # this backward's maxima: the scales of the next one
            self.swiglu_dy_amax.copy_(self._swiglu_dy_measured)
            self._swiglu_dy_amax_filled = True

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
        if self.vocab_parallel:
            raise ConfigError("logits_for does not run under --tensor-parallel (each rank holds a vocabulary "
                              "shard): export the model and load it in one process.")
        tokens, _ = self._check_batch(inputs, None)
        self.lin.invalidate_weights()
        self._forward_trunk(tokens, training=False)
        self.schedule.before(HEAD)
        w_head, _ = self._lm_head(backward=False)
        out = torch.empty(tokens.numel(), self.cfg.vocab_size, dtype=self.dtype, device=self.device)
        self.backend.matmul(out, self.final_ln, w_head, transpose_b=True)
        self.schedule.after(HEAD)
        return out.float().view(self.batch_size, self.seq_len, -1)
