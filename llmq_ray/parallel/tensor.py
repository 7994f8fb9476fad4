"""Tensor parallelism's split of the weights and the full-layout split / join of flat buffers (a group of T
ranks; the Ray workers build the groups in actors/worker.py). What it changes in a model's forward and backward
is llmq_ray/parallel/tensor_pieces.py's plan over the model's pieces.

The split (Megatron-style, written for this project's fused layouts; see llmq_ray/model/params.py):

* attention: query heads split evenly, rank r holding heads [r*Hq/T, (r+1)*Hq/T). Key/value heads split
  evenly when there are at least T of them; with fewer (GQA, e.g. Qwen2.5-0.5B's 2 KV heads on T=4) each KV
  head is *replicated* on the T/Hkv consecutive ranks whose query heads read it, so every rank still holds
  whole groups and its attention is local. The replicas' gradients must be summed over those ranks.
* ``qkv_w`` [(Hq+2Hkv)*D, C] is column-parallel (rows of the stored matrix): each rank holds its q rows, then
  its k rows, then its v rows, in that order (the local layout is the fused layout of a model with the local
  head counts); ``qkv_b`` likewise.
* ``out_w`` [C, Hq*D] is row-parallel (columns of the stored matrix): the columns of the rank's query heads;
  the partial outputs are summed over the ranks (a reduce-scatter over the sequence with sequence parallelism).
* ``up_gate_w`` [2I, C] column-parallel: the rank's slice of the up rows, then the same slice of the gate rows
  (so the local SwiGLU reads [up | gate] as the full one does); ``down_w`` [C, I] row-parallel on that slice.
* the embedding and the LM head are vocabulary-parallel: rank r holds rows [r*Vs, (r+1)*Vs) with Vs = ceil(V / T)
  (``vocab_range``); the local tables are [Vs, C] on every rank, the last rank's padded with zero rows when T does
  not divide V (they get no gradient and stay zero; checkpoints and exports never hold them). The lookup takes
  the rank's rows and zeros for other tokens, summed over the group; the head's logits [N, Vs] of each rank go
  through ``vocab_parallel_cross_entropy`` (llmq_ray/parallel/tensor_pieces.py), which gives the exact losses without
  gathering the full logits, and the head's input gradient is summed over the group.
* norms (and Qwen3's QK-norm weights, per head and shared by all heads) are replicated.

Sequence parallelism (always on in a group of T > 1): outside the column- and row-parallel GEMMs every rank
holds only its rows of the [N, C] token matrix (N = B*T_seq flattened, rank r rows [r*N/T, (r+1)*N/T)): the
residual stream, the norms and their saved inputs and rstd. A norm writes its rows of the next GEMM input and
the group all-gathers them (``all_gather_rows``); a row-parallel GEMM's partial [N, C] output is summed and
split by rows in one reduce-scatter (``reduce_scatter_rows``) instead of an all-reduce -- the same bytes on the
wire as the all-reduce alone, with the residual stream and the norms' work divided by T. The backward mirrors
it: the residual gradient's rows are all-gathered before the GEMMs that read it, their input gradients
reduce-scattered. The norm weights' gradients are then partial sums over each rank's rows, summed over the
group with the other shared gradients (``TensorParallel.reduce_grads``).

Why our own: the split depends on this project's fused flat layout (q|k|v rows, up|gate rows).
"""

from __future__ import annotations

import dataclasses

import torch

from llmq_ray.errors import ConfigError
from llmq_ray.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class TensorParallelPlan:
    """Which rows/columns of each block weight rank ``r`` of a tensor-parallel group of ``size`` holds."""

    cfg: ModelConfig
    size: int

    def __post_init__(self):
        cfg, t = self.cfg, self.size

        def need(cond: bool, msg: str):
            if not cond:
                raise ConfigError(msg)

        need(isinstance(t, int) and t >= 1, f"a tensor-parallel group of {t!r}: its size must be an integer >= 1.")
        need(not cfg.is_gpt2, "tensor parallelism does not take GPT-2 yet (its biased row-parallel projections and "
                              "learned positions have no split here).")
        need(cfg.num_heads % t == 0,
             f"a tensor-parallel group of {t} must divide the model's {cfg.num_heads} attention heads.")
        need(cfg.num_kv_heads % t == 0 or t % cfg.num_kv_heads == 0,
             f"a tensor-parallel group of {t} and the model's {cfg.num_kv_heads} key/value heads: one must divide the "
             f"other (more ranks than KV heads replicate each KV head on {t} / {cfg.num_kv_heads} ranks).")
        need(cfg.intermediate_size % t == 0,
             f"a tensor-parallel group of {t} must divide the model's intermediate size {cfg.intermediate_size}.")

    # ---------------------------------------------------------------- heads
    @property
    def q_heads_per_rank(self) -> int:
        return self.cfg.num_heads // self.size

    @property
    def kv_heads_per_rank(self) -> int:
        return max(self.cfg.num_kv_heads // self.size, 1)

    @property
    def kv_replicas(self) -> int:
        """On how many ranks each KV head lives (1 unless there are fewer KV heads than ranks)."""
        return max(self.size // self.cfg.num_kv_heads, 1)

    def q_heads(self, rank: int) -> range:
        n = self.q_heads_per_rank
        return range(rank * n, (rank + 1) * n)

    def kv_heads(self, rank: int) -> range:
        if self.kv_replicas > 1:
            head = rank // self.kv_replicas
            return range(head, head + 1)
        n = self.kv_heads_per_rank
        return range(rank * n, (rank + 1) * n)

    def local_config(self) -> ModelConfig:
        """The shape one rank computes: its head counts, intermediate slice and vocabulary shard ``vocab_shard``
        (the rows of its embedding / LM head tables; head_dim, hidden size and the rest as the model's)."""
        return dataclasses.replace(self.cfg, num_heads=self.q_heads_per_rank, num_kv_heads=self.kv_heads_per_rank,
                                   intermediate_size=self.cfg.intermediate_size // self.size,
                                   head_dim=self.cfg.head_dim, vocab_size=self.vocab_shard)

    @property
    def vocab_shard(self) -> int:
        """Rows of every rank's embedding / LM head table: ceil(V / T)."""
        return -(-self.cfg.vocab_size // self.size)

    # ---------------------------------------------------------------- row / column ranges of the fused weights
    def qkv_rows(self, rank: int) -> list[tuple[int, int]]:
        """Row ranges of ``qkv_w`` / ``qkv_b`` ([(Hq+2Hkv)*D, ...]) rank ``rank`` holds, in its local order."""
        cfg, d = self.cfg, self.cfg.head_dim
        q, kv = self.q_heads(rank), self.kv_heads(rank)
        k0, v0 = cfg.num_heads * d, (cfg.num_heads + cfg.num_kv_heads) * d
        return [(q.start * d, q.stop * d), (k0 + kv.start * d, k0 + kv.stop * d),
                (v0 + kv.start * d, v0 + kv.stop * d)]

    def out_cols(self, rank: int) -> tuple[int, int]:
        """Column range of ``out_w`` [C, Hq*D] (the attention output of the rank's query heads)."""
        q, d = self.q_heads(rank), self.cfg.head_dim
        return q.start * d, q.stop * d

    def ffn_slice(self, rank: int) -> tuple[int, int]:
        """The rank's range of the intermediate dimension [0, I)."""
        n = self.cfg.intermediate_size // self.size
        return rank * n, (rank + 1) * n

    def up_gate_rows(self, rank: int) -> list[tuple[int, int]]:
        """Row ranges of ``up_gate_w`` [2I, C] = [up; gate]: the rank's up rows, then its gate rows."""
        lo, hi = self.ffn_slice(rank)
        i = self.cfg.intermediate_size
        return [(lo, hi), (i + lo, i + hi)]

    def vocab_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of the vocabulary rows rank ``rank`` holds of the embedding and the LM head."""
        shard = -(-self.cfg.vocab_size // self.size)
        return min(rank * shard, self.cfg.vocab_size), min((rank + 1) * shard, self.cfg.vocab_size)

    REPLICATED = frozenset({"ln1_w", "ln2_w", "final_norm", "q_norm_w", "k_norm_w"})

    def shard(self, name: str, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s part of the full tensor of layout slot ``name`` (e.g. ``layers.3.qkv_w``), a copy in
        the rank's local layout; the replicated ones (``REPLICATED``: norm weights) come back whole; a name of
        neither kind is a KeyError (never silently replicated)."""
        kind = name.rsplit(".", 1)[-1]
        if kind in ("qkv_w", "qkv_b"):
            return torch.cat([full[a:b] for a, b in self.qkv_rows(rank)])
        if kind == "up_gate_w":
            return torch.cat([full[a:b] for a, b in self.up_gate_rows(rank)])
        if kind == "out_w":
            a, b = self.out_cols(rank)
            return full[:, a:b].clone()
        if kind == "down_w":
            a, b = self.ffn_slice(rank)
            return full[:, a:b].clone()
        if kind in ("embed", "lm_head"):  # [Vs, C]: the rank's rows, then zero rows up to Vs (last rank)
            a, b = self.vocab_range(rank)
            out = full.new_zeros((self.vocab_shard,) + tuple(full.shape[1:]))
            out[:b - a] = full[a:b]
            return out
        if kind in self.REPLICATED:
            return full.clone()
        raise KeyError(f"TensorParallelPlan.shard: no split known for {name!r}")


class TensorParallelRank:
    """What the plan over a model's pieces needs of its tensor-parallel group (``TensorParallel``): sums over the
    group, sums over the ranks holding the same replicated KV heads, which rows of the local qkv_w / qkv_b are K
    and V (empty unless the KV heads are replicated), and its vocabulary range (``vocab_start``, ``vocab_valid``:
    the real rows of its [Vs, C] embedding / head tables). ``comm`` / ``kv_replica_comm``: the engine's
    Communicator over the group and over this rank's replica set (None when the KV heads are not replicated)."""

    def __init__(self, plan: TensorParallelPlan, rank: int, comm, kv_replica_comm=None, overlap: bool = False):
        if plan.kv_replicas > 1 and kv_replica_comm is None:
            raise ValueError("replicated KV heads need the communicator over their replicas")
        self.plan, self.rank, self.comm, self.kv_replica_comm = plan, rank, comm, kv_replica_comm
        # the column-parallel GEMMs' input-gradient reduce-scatter beside their wgrad (--overlap-tensor-parallel;
        # the engine sets it from its options)
        self.overlap = overlap
        start, end = plan.vocab_range(rank)
        self.vocab_start, self.vocab_valid = start, end - start  # this rank's token ids: [start, start + valid)
        local = plan.local_config()
        q, kv = local.num_heads * local.head_dim, local.num_kv_heads * local.head_dim
        self.kv_rows = [slice(q, q + 2 * kv)] if plan.kv_replicas > 1 else []

    @property
    def sequence_parallel(self) -> bool:
        """True in a group of more than one rank: the token rows are split (module docstring)."""
        return self.plan.size > 1

    def row_range(self, n: int) -> tuple[int, int]:
        """This rank's rows [start, end) of an [n, ...] token matrix split by sequence (T divides n)."""
        rows = n // self.plan.size
        return self.rank * rows, (self.rank + 1) * rows

    def all_gather_rows(self, full: torch.Tensor, mine: torch.Tensor | None = None) -> None:
        """full [n, ...] (contiguous) = every rank's rows, in rank order, on every rank: each rank's ``mine``
        [n/T, ...], or (None) the rows it already wrote into its own ``row_range`` of ``full``."""
        if mine is None:
            start, end = self.row_range(full.shape[0])
            mine = full[start:end]
        self.comm.all_gather(full.view(-1), mine.reshape(-1))

    def reduce_scatter_rows(self, rows_out: torch.Tensor, full: torch.Tensor) -> None:
        """rows_out [n/T, ...] = this rank's rows of the sum over the group of ``full`` [n, ...] (contiguous)."""
        self.comm.reduce_scatter_sum(rows_out.view(-1), full.view(-1))

    def reduce_scatter_rows_start(self, rows_out: torch.Tensor, full: torch.Tensor):
        """``reduce_scatter_rows`` started asynchronously where the backend allows (NCCL); returns the handle.
        ``full`` must stay unwritten and ``rows_out`` unread until ``wait()``."""
        return self.comm.reduce_scatter_start(rows_out.view(-1), full.view(-1))

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        self.comm.all_reduce_sum(tensor)

    def all_reduce_sum_packed(self, tensors: list[torch.Tensor]) -> None:
        """Sum every tensor of ``tensors`` (one dtype) over the group with one collective: packed into one flat
        buffer, reduced, copied back. The norm weights' gradients are 2L+1 small tensors (a few KB each) whose
        separate all-reduces would each pay a launch and a round trip."""
        if len(tensors) <= 1:
            for t in tensors:
                self.comm.all_reduce_sum(t)
            return
        if len({t.dtype for t in tensors}) > 1:  # torch.cat would promote them and the sums would round apart
            raise ValueError(f"all_reduce_sum_packed: tensors of dtypes {sorted({str(t.dtype) for t in tensors})}")
        flat = torch.cat([t.reshape(-1) for t in tensors])
        self.comm.all_reduce_sum(flat)
        parts = flat.split([t.numel() for t in tensors])
        torch._foreach_copy_(tensors, [p.view_as(t) for p, t in zip(parts, tensors)])

    def kv_replica_sum(self, tensor: torch.Tensor) -> None:
        if self.kv_replica_comm is not None:
            self.kv_replica_comm.all_reduce_sum(tensor)


def shard_params(plan: TensorParallelPlan, full_layout, full: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank ``rank``'s flat parameter (or gradient) buffer in the layout of ``plan.local_config()``, cut from the
    full model's flat buffer ``full`` in ``full_layout`` (llmq_ray/model/params.py). Checkpoints keep the full
    layout; this is how a rank takes its part of one."""
    from llmq_ray.model.params import ParamLayout

    local_layout = ParamLayout(plan.local_config())
    out = torch.empty(local_layout.numel, dtype=full.dtype, device=full.device)
    for name, slot in local_layout.slots.items():
        src = full_layout.slots[name]
        view = full[src.offset:src.end].view(src.shape)
        out[slot.offset:slot.end] = plan.shard(name, view, rank).reshape(-1)
    return out


def unshard_slot(plan: TensorParallelPlan, name: str, full: torch.Tensor, parts: list[torch.Tensor]) -> None:
    """Write the full tensor of layout slot ``name`` into ``full`` (its full shape) from every rank's local part
    (``parts[r]``: rank r's, in its local shape). Replicated tensors come from rank 0 (equal on every rank);
    replicated KV heads from each rank that holds them (equal too); the vocabulary rows without the last rank's
    zero padding."""
    kind = name.rsplit(".", 1)[-1]
    for rank, local in enumerate(parts):
        if kind in ("qkv_w", "qkv_b", "up_gate_w"):
            ranges = plan.qkv_rows(rank) if kind != "up_gate_w" else plan.up_gate_rows(rank)
            row = 0
            for a, b in ranges:
                full[a:b] = local[row:row + b - a]
                row += b - a
        elif kind == "out_w":
            a, b = plan.out_cols(rank)
            full[:, a:b] = local
        elif kind == "down_w":
            a, b = plan.ffn_slice(rank)
            full[:, a:b] = local
        elif kind in ("embed", "lm_head"):
            a, b = plan.vocab_range(rank)
            full[a:b] = local[:b - a]
        elif kind in plan.REPLICATED:
            if rank == 0:
                full.copy_(local)
        else:
            raise KeyError(f"unshard: no split known for {name!r}")


def unshard_params(plan: TensorParallelPlan, full_layout, parts: list[torch.Tensor]) -> torch.Tensor:
    """The inverse of ``shard_params``: the full model's flat buffer in ``full_layout`` from every rank's local
    buffer (``parts[r]``: rank r's, in the layout of ``plan.local_config()``). Holds every part and the whole
    result at once: for small models and tests; a run joins its ranks' parts slot by slot (``join_parts``)."""
    from llmq_ray.model.params import ParamLayout

    if len(parts) != plan.size:
        raise ValueError(f"unshard_params: {len(parts)} parts for a group of {plan.size}")
    local_layout = ParamLayout(plan.local_config())
    out = torch.empty(full_layout.numel, dtype=parts[0].dtype, device=parts[0].device)
    for name, slot in full_layout.slots.items():
        ls = local_layout.slots[name]
        unshard_slot(plan, name, out[slot.offset:slot.end].view(slot.shape),
                     [flat[ls.offset:ls.end].view(ls.shape) for flat in parts])
    return out


def join_parts(plan: TensorParallelPlan, full_layout, local: torch.Tensor, comm, device, *, keep: bool,
               start: int = 0, end: int | None = None) -> torch.Tensor | None:
    """[start, end) of the whole model's flat tensor (full layout; default: all of it) from every rank's
    ``local`` [local layout numel] (weights, or one optimizer state, on the device or the host), as a new CPU
    tensor on the ranks that ``keep`` it (None on the others). A collective over ``comm`` (the tensor-parallel
    group; every rank passes the same start and end): one all-gather per layout slot, so the device holds T x
    the largest slot at a time (the embedding: V x C), never the whole model."""
    from llmq_ray.model.params import ParamLayout

    end = full_layout.numel if end is None else end
    local_layout = ParamLayout(plan.local_config())
    out = torch.empty(end - start, dtype=local.dtype) if keep else None
    for name, src in full_layout.slots.items():
        if src.end <= start or src.offset >= end:
            continue
        ls = local_layout.slots[name]
        piece = local[ls.offset:ls.end].to(device).contiguous()
        gathered = torch.empty(plan.size * piece.numel(), dtype=piece.dtype, device=device)
        comm.all_gather(gathered, piece)
        if keep:
            full = torch.empty(src.shape, dtype=piece.dtype, device=device)
            unshard_slot(plan, name, full, [g.view(ls.shape) for g in gathered.split(piece.numel())])
            lo, hi = max(src.offset, start), min(src.end, end)
            out[lo - start:hi - start] = full.reshape(-1)[lo - src.offset:hi - src.offset].cpu()
            del full
        del gathered, piece
    return out
