"""Tensor and sequence parallelism applied to a model: the plan over its pieces (the torchtitan way).

The model (llmq_ray/model/) is written for one process. ``TensorParallel`` is handed to it as
``ModelPolicies.plan``; its ``apply(model)`` replaces the pieces whose work the group splits with pieces of the
same interface that add the collectives (the split of the weights themselves is llmq_ray/parallel/tensor.py's):

    piece                     replaced by                 what it adds
    proj["qkv"], ["up_gate"]  ``ColumnParallel``          backward: the input gradient [N, C] summed over the group,
                                                          this rank's rows of it (reduce-scatter; with ``overlap``
                                                          started beside the wgrad GEMM)
    proj["out"], ["down"]     ``RowParallel``             forward: the partial output summed, this rank's rows
                                                          (reduce-scatter); backward: dy's rows all-gathered first
    norm                      ``SequenceParallelNorm``    normalizes this rank's rows, all-gathers the output (the
                                                          column-parallel GEMMs read all N rows)
    embedding                 ``VocabParallelEmbedding``  looks up this rank's vocabulary rows, zeros for other
                                                          tokens, summed over the group (its rows)
    head                      ``VocabParallelHead``       the logits of this rank's vocabulary columns, the exact
                                                          cross-entropy over the group (``vocab_parallel_cross_entropy``)

and ``rows(n)`` tells the model which token rows it keeps of the residual stream (sequence parallelism: rank r
rows [r*N/T, (r+1)*N/T)). Under FP8 a norm that writes only its rows measures no absmax: the gathered whole's is
taken after the gather (and likewise for a gathered dy). The gradients each rank holds only a part of are summed
by ``reduce_grads`` (the engine calls it: once per step under ZeRO-1, before each reduce under ZeRO-2/3).

A group of one (T = 1) replaces nothing: the plain path, with only ``reduce_grads``'s QK-norm sums.
"""

from __future__ import annotations

import torch

from llmq_ray.model.layers.lm_head import LMHead
from llmq_ray.model.layers.linear import Projection
from llmq_ray.parallel.tensor import TensorParallelRank


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, comm,
                                 dlogits: torch.Tensor | None = None, valid: int | None = None) -> torch.Tensor:
    """Cross-entropy over logits split by vocabulary across the ranks of ``comm`` (the tensor-parallel group).

    logits[N, Vr] (any float dtype; computed in fp32) are this rank's columns [vocab_start, vocab_start + Vr)
    of the full [N, V] logits; ``valid`` (default Vr): how many of them are real vocabulary, the rest being the
    padding of an equal-size shard (left out of the softmax, zero gradient). targets[N] int, global ids, -100 =
    masked. Returns losses[N] fp32, the same on every rank (0 at masked rows). With ``dlogits`` [N, Vr] fp32, also
    writes d(sum of losses)/d logits for this rank's columns: softmax - one-hot, zero at masked rows.

    Two collectives of [N]-sized vectors, never the full logits: the row maxima (all-gathered, then the max, so
    every rank shifts by the same value), then one sum of the stacked [2, N] exp-sums and target logits (each
    target logit from the rank that holds its column, 0 elsewhere). No host sync (gathers and masks, no
    data-dependent shapes). ``comm`` needs ``world_size``, ``all_gather(full, shard)`` and ``all_reduce_sum``
    (the engine's Communicator). Targets must be -100 or in [0, V): the data pipeline checks token ids.
    """
    n, local_v = logits.shape
    valid = local_v if valid is None else valid
    # one fp32 [N, Vr] buffer for everything: dlogits when asked for (its values become exp, then softmax -
    # one-hot), else a temporary; the logits themselves are only read
    x = dlogits if dlogits is not None else torch.empty(n, local_v, dtype=torch.float32, device=logits.device)
    x.copy_(logits)
    xv = x[:, :valid]
    world = comm.world_size
    local_max = xv.max(dim=1).values if valid else torch.full((n,), float("-inf"), device=x.device)
    maxima = torch.empty(world * n, dtype=torch.float32, device=x.device)
    comm.all_gather(maxima, local_max.contiguous())
    row_max = maxima.view(world, n).max(dim=0).values
    local_t = targets.to(x.device).long() - vocab_start
    mine = (local_t >= 0) & (local_t < valid)
    idx = local_t.clamp(0, max(local_v - 1, 0))[:, None]
    target_logit = (torch.where(mine, x.gather(1, idx).squeeze(1), 0.0) if local_v
                    else torch.zeros(n, dtype=torch.float32, device=x.device))
    xv.sub_(row_max[:, None]).exp_()
    sum_exp = xv.sum(dim=1)
    stats = torch.stack([sum_exp, target_logit])  # one collective for both sums
    comm.all_reduce_sum(stats)
    sum_exp, target_logit = stats[0], stats[1]
    masked = targets.to(x.device) == -100
    losses = torch.log(sum_exp) + row_max - target_logit
    losses = losses.masked_fill(masked, 0.0)
    if dlogits is not None:
        xv.div_(sum_exp[:, None])
        x[:, valid:] = 0.0
        if local_v:
            x.scatter_add_(1, idx, -mine.float()[:, None])
        x.mul_((~masked).float()[:, None])
    return losses


class ColumnParallel(Projection):
    """A column-parallel projection: the input gradient [N, K] is this rank's part of the sum; returns this
    rank's rows of the sum, in ``rows_out`` [N/T, K]."""

    def __init__(self, inner: Projection, tp: TensorParallelRank, rows_out: torch.Tensor):
        super().__init__(inner.lin)
        self.tp, self.rows_out = tp, rows_out

    def backward(self, dx, dw, dy, x, key, x_amax, accumulate, **kw) -> torch.Tensor:
        if not self.tp.overlap:
            self.lin.backward(dx, dw, dy, x, key, x_amax, accumulate, **kw)
            self.tp.reduce_scatter_rows(self.rows_out, dx)
            return self.rows_out
        started = []  # the reduce-scatter runs beside the wgrad GEMM (NCCL's stream; the same sums)
        self.lin.backward(dx, dw, dy, x, key, x_amax, accumulate, **kw,
                          after_dgrad=lambda: started.append(self.tp.reduce_scatter_rows_start(self.rows_out, dx)))
        started[0].wait()
        return self.rows_out


class RowParallel(Projection):
    """A row-parallel projection: the forward's partial output [N, C] is summed over the group (this rank's rows,
    in ``rows_out`` [N/T, C]); the backward gathers dy's rows (``dy_full`` [N, C]) before its GEMMs, and under FP8
    measures max|dy| of the whole into ``lin.dy_amax``."""

    def __init__(self, inner: Projection, tp: TensorParallelRank, rows_out: torch.Tensor, dy_full: torch.Tensor):
        super().__init__(inner.lin)
        self.tp, self.rows_out, self.dy_full = tp, rows_out, dy_full

    def forward(self, out, x, key, x_amax, **kw) -> torch.Tensor:
        self.lin.forward(out, x, key, x_amax, **kw)
        self.tp.reduce_scatter_rows(self.rows_out, out)
        return self.rows_out

    def backward(self, dx, dw, dy, x, key, x_amax, accumulate, **kw) -> torch.Tensor:
        self.tp.all_gather_rows(self.dy_full, dy)
        if self.lin.fp8:
            self.lin.be.absmax(self.lin.dy_amax, self.dy_full)
        self.lin.backward(dx, dw, self.dy_full, x, key, x_amax, accumulate, **kw)
        return dx


class SequenceParallelNorm:
    """A norm over this rank's token rows whose output [N, C] is all-gathered (each rank writes its rows).
    Under FP8 the absmax is the gathered whole's (taken after the gather); the backward's is left to the
    gradient's gather (``RowParallel``). The wrapped norm's forward / residual_forward / backward, same
    arguments (any of the norms of llmq_ray/model/layers/norms.py; the output is the first argument after
    the residual's)."""

    def __init__(self, norm, tp: TensorParallelRank, n: int):
        self.inner, self.tp = norm, tp
        self.mine = slice(*tp.row_range(n))

    def _gather(self, out: torch.Tensor, amax: torch.Tensor | None) -> None:
        self.tp.all_gather_rows(out)
        if amax is not None:
            self.inner.be.absmax(amax, out)

    def forward(self, out, *args, amax=None) -> None:
        self.inner.forward(out[self.mine], *args, amax=None)
        self._gather(out, amax)

    def residual_forward(self, x_next, out, *args, amax=None) -> None:
        self.inner.residual_forward(x_next, out[self.mine], *args, amax=None)
        self._gather(out, amax)

    def backward(self, *args, dresidual=None, amax=None) -> None:
        self.inner.backward(*args, dresidual=dresidual, amax=None)


class VocabParallelEmbedding:
    """The token embedding over this rank's vocabulary rows [Vs, C]: the rows of its tokens, zeros for the
    others, summed over the group into this rank's token rows; the backward gathers dL/dx_0's rows and
    scatter-adds those of its own tokens. ``scratch`` [N, C]: the lookup before the sum; ``full`` [N, C]: the
    gathered gradient."""

    def __init__(self, backend, tp: TensorParallelRank, scratch: torch.Tensor, full: torch.Tensor):
        self.be, self.tp, self.scratch, self.full = backend, tp, scratch, full
        self._local = None  # the last forward's (row in the shard, token in the shard) of every token

    def _vocab_local(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start, valid = self.tp.vocab_start, self.tp.vocab_valid
        mine = (tokens >= start) & (tokens < start + valid)
        return (tokens - start).clamp(0, max(valid - 1, 0)), mine

    def forward(self, out: torch.Tensor, tokens: torch.Tensor, table: torch.Tensor) -> None:
        self._local = local, mine = self._vocab_local(tokens)
        self.be.embedding_forward(self.scratch, local, table)
        self.scratch.mul_(mine[:, None].to(self.scratch.dtype))
        self.tp.reduce_scatter_rows(out, self.scratch)

    def backward(self, dtable: torch.Tensor, tokens: torch.Tensor, dout: torch.Tensor) -> None:
        local, mine = self._local
        self.tp.all_gather_rows(self.full, dout)
        self.full.mul_(mine[:, None].to(self.full.dtype))
        self.be.embedding_backward(dtable, local, self.full)


class VocabParallelHead(LMHead):
    """The LM head over this rank's vocabulary shard of W [Vs, C] (``tp.vocab_valid`` real rows from token id
    ``tp.vocab_start``): the logits [rows, Vs] go through ``vocab_parallel_cross_entropy`` over ``tp.comm`` (two
    collectives of [rows] vectors per chunk, never the full logits), losses[N] are the whole vocabulary's on every
    rank, dw [Vs, C] += this shard's gradient, and ``run`` returns this rank's rows of the input gradient summed
    over the group (``rows_out`` [N/T, C]: a reduce-scatter of dlogits W over the shard's columns).

    The logit gradient is made in fp32 by torch ops (a few passes over [rows, Vs]), then rounded to the model
    dtype for the two GEMMs, as the fused classifier does. With ``fp8`` the three GEMMs are the plain head's FP8
    ones on this rank's shard (W's scale is its own shard's max; x's is the whole gathered input's, as the
    model measures it), and the fp32 logit gradient is quantized to e5m2 in both layouts at the static scale
    of ``fused_classifier_fp8`` (|d| <= 1: ``dlogits_fp8_scale``), which has no cross-rank softmax itself."""

    def __init__(self, head: LMHead, tp: TensorParallelRank, rows_out: torch.Tensor):
        super().__init__(head.be, head.vocab, rows_out.shape[1], head.logits.shape[0], head.chunks,
                         head.logits.dtype, fp8=head.fp8, pad=False)
        self.tp, self.rows_out = tp, rows_out
        self._dlogits32 = None  # the fp32 logit gradient [rows, Vs], made on first use
        self._d_absmax = None   # fp8: the absmax that gives the classifier's static scale

    def sum_rows(self, dx: torch.Tensor | None) -> torch.Tensor | None:
        if dx is None:
            return None
        self.tp.reduce_scatter_rows(self.rows_out, dx)
        return self.rows_out

    def logits_for(self, out, x, w) -> None:
        raise ValueError("all logits at once need the whole vocabulary, and each rank holds a shard of it: export "
                         "the model and load it in one process")

    def run(self, x: torch.Tensor, w: torch.Tensor, losses: torch.Tensor, targets: torch.Tensor,
            dx: torch.Tensor | None = None, dw: torch.Tensor | None = None) -> torch.Tensor | None:
        be, backward = self.be, dw is not None
        rows = self.logits.shape[0]
        if backward and self._dlogits32 is None:
            self._dlogits32 = torch.empty(self.logits.shape, dtype=torch.float32, device=self.logits.device)
        if self.fp8:
            self._quantize_weight(w, backward)
            if backward and self._d_absmax is None:  # quantize's s = fp8_max / 1 = dlogits_fp8_scale(e5m2, 1.0)
                self._d_absmax = torch.ones((), dtype=torch.float32, device=self.logits.device)
        for chunk in range(self.chunks):
            sl = slice(chunk * rows, (chunk + 1) * rows)
            xc = x[sl]
            if self.fp8:
                self._quantize_x(xc, backward)
                be.matmul_fp8(self.logits, self.x_q, self.w_q, self.x_descale, self.w_descale)
            else:
                be.matmul(self.logits, xc, w, transpose_b=True)
            losses[sl] = vocab_parallel_cross_entropy(self.logits, targets[sl], self.tp.vocab_start, self.tp.comm,
                                                      dlogits=self._dlogits32 if backward else None,
                                                      valid=self.tp.vocab_valid)
            if not backward:
                continue
            if self.fp8:
                be.quantize_with_transpose(self.d_q, self.dt_q, self.d_descale, self._dlogits32, self._d_absmax)
                be.matmul_fp8(dx[sl], self.d_q, self.wt_q, self.d_descale, self.w_descale)
                be.matmul_fp8(dw, self.dt_q, self.xt_q, self.d_descale, self.x_descale, accumulate=True)
                continue
            self.logits.copy_(self._dlogits32)
            be.matmul(dx[sl], self.logits, w)
            be.matmul(dw, self.logits, xc, transpose_a=True, accumulate=True)
        return self.sum_rows(dx)


class TensorParallel:
    """The plan applied to a model by one rank of a tensor-parallel group (``ModelPolicies.plan``; module
    docstring). ``rank``: its ``TensorParallelRank`` (llmq_ray/parallel/tensor.py)."""

    def __init__(self, rank: TensorParallelRank):
        self.tp = rank
        self.model = None

    @property
    def splits_rows(self) -> bool:
        return self.tp.sequence_parallel

    def rows(self, n: int) -> tuple[int, int]:
        """[start, end) of the N token rows this rank keeps of the residual stream."""
        if not self.splits_rows:
            return 0, n
        if n % self.tp.plan.size:
            raise ValueError(f"a group of {self.tp.plan.size} ranks splits the {n} token rows of a micro-batch by "
                             f"sequence: it must divide them")
        return self.tp.row_range(n)

    def apply(self, model) -> None:
        """Replace the pieces of ``model`` (a decoder of llmq_ray/model/) whose work the group splits."""
        if model.cfg.is_gpt2:
            raise ValueError("GPT-2's biased row-parallel projections and learned positions have no split here")
        self.model = model
        if not self.splits_rows:
            return
        tp, n, c = self.tp, model.build.rows, model.cfg.hidden_size
        rows = model.rows
        empty = lambda *shape: torch.empty(*shape, dtype=model.dtype, device=model.device)  # noqa: E731
        branch_rows = empty(rows, c)   # a row-parallel output's sum, this rank's rows
        grad_rows = empty(rows, c)     # a column-parallel input gradient's sum, this rank's rows
        grad_full = empty(n, c)        # d_residual gathered for the GEMMs that read all rows
        for name in ("qkv", "up_gate"):
            model.proj[name] = ColumnParallel(model.proj[name], tp, grad_rows)
        for name in ("out", "down"):
            model.proj[name] = RowParallel(model.proj[name], tp, branch_rows, grad_full)
        model.norm = SequenceParallelNorm(model.norm, tp, n)
        model.embedding = VocabParallelEmbedding(model.backend, tp, model.scratch_nc, grad_full)
        model.head = VocabParallelHead(model.head, tp, grad_rows)
        model.logits = model.head.logits

    def reduce_grads(self, unit=None) -> None:
        """Sum the gradients each rank holds only a part of -- the norm weights ln1_w, ln2_w and final_norm
        (sequence parallelism: each rank's norms saw only its token rows) and the QK-norm weights (shared by all
        heads, each rank saw its own heads) over the group, the K and V rows of replicated KV heads (each replica
        saw its own query heads) over the replicas. Everything else is this rank's own shard.
        ``unit``: None = all of them (ZeRO-1: once per step, after the last micro-step); under ZeRO-2/3, before
        each gradient reduce of every micro-step (sums are linear), a layer index = that layer's qkv_w rows,
        ``"plain"`` = the norm-and-bias tail (norm and QK-norm weights, qkv_b rows)."""
        model, tp = self.model, self.tp
        layers = [unit] if isinstance(unit, int) else range(model.cfg.num_layers)
        group_sums = []  # summed over the whole group in one packed collective below
        for layer in layers:
            g = model.g.blocks[layer]
            if unit is None or unit == "plain":
                if self.splits_rows:  # each rank's norms saw only its rows
                    group_sums += [g.ln1_w, g.ln2_w]
                if model.cfg.qk_norm:
                    group_sums += [g.q_norm_w, g.k_norm_w]
                if g.qkv_b is not None:
                    for rows in tp.kv_rows:
                        tp.kv_replica_sum(g.qkv_b[rows])
            if unit is None or isinstance(unit, int):
                for rows in tp.kv_rows:
                    tp.kv_replica_sum(g.qkv_w[rows])
        if self.splits_rows and unit in (None, "plain"):
            group_sums.append(model.g.final_norm)
        tp.all_reduce_sum_packed(group_sums)
