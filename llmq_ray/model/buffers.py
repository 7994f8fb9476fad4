"""Where a model's tensors live unless the engine says otherwise: the saved activations, the residual stream and
the weights with their gradients.

``Activations``: every tensor the forward saves for the backward, per layer where kept and in one shared buffer
where recomputed (``Recompute``, llmq_ray/model/build.py). ``ResidentResiduals``: the residual stream x_0 .. x_L,
L+1 device buffers (the engine may hand over another store, e.g. one that keeps them in host memory:
``ModelPolicies.residuals``). ``ResidentWeights``: one full flat buffer of weights and one of gradients (ZeRO-1);
the stores of llmq_ray/parallel/data.py shard them (ZeRO-2/3) behind the same protocol.
"""

from __future__ import annotations

import torch

from llmq_ray.model.build import ModelBuild
from llmq_ray.model.config import ModelConfig
from llmq_ray.model.layers.units import Policy
from llmq_ray.model.params import ParamLayout


class ResidentResiduals(Policy):
    """The residual stream x_0 .. x_L [R, C] (model dtype; R = N, or this process's token rows), ``res[l]``:
    L+1 device buffers. What another store must offer: indexing by layer (negative from the end), iteration
    over its device buffers, ``host_tensors()``, the byte counts below, and the unit hooks (no-ops here)."""

    def __init__(self, num_layers: int, rows: int, hidden: int, dtype: torch.dtype, device: torch.device):
        self.bufs = [torch.empty(rows, hidden, dtype=dtype, device=device) for _ in range(num_layers + 1)]
        nbytes = rows * hidden * dtype.itemsize
        # x_0..x_{L-1} per layer, plus the (L+1)-th: the last block's output
        self.per_layer_bytes, self.shared_bytes, self.host_bytes = nbytes, nbytes, 0

    def __iter__(self):
        return iter(self.bufs)

    def __getitem__(self, layer: int) -> torch.Tensor:
        return self.bufs[layer]

    def host_tensors(self) -> list[torch.Tensor]:
        return []


# Which recompute kind turns each activation kind from per-layer storage into a shared, recomputed scratch buffer.
_RECOMPUTED_BY = {"ln1": "norm", "qkv": "qkv", "att": "att", "lse": "att", "residual_mid": "block",
                  "ln2": "norm", "up_gate": "ffn", "swiglu": "swiglu", "qk_in": "qkv", "qk_rstd": "qkv",
                  "fc": "ffn", "gelu": "swiglu"}  # GPT-2: c_fc's output and the GELU's



class Activations:
    """The forward's saved tensors: per layer where kept, one shared buffer where recomputed.

    Always per layer: ``residual`` (L+1 entries: the input of each block and the final residual; see
    ``ModelPolicies.residuals`` for where they live) and the fp32 ``rstd1``/``rstd2`` of both norms (``rows`` floats each).
    ``unread_by_backward``: kinds the backward never reads (FP8 with stored q(x^T): ln1, ln2 and swiglu are
    read only by their forward GEMM, which keeps its own FP8 transposed copy for the wgrad); one shared
    buffer each, like a recomputed kind, but nothing refills them.
    GPT-2: ``fc`` [N, I] (c_fc's output) and ``gelu`` [N, I] in place of ``up_gate`` and ``swiglu``, and the fp32
    row means ``mean1`` / ``mean2`` of its LayerNorms beside the rstd.
    ``rows``: the token rows this rank keeps of the residual stream, ``residual_mid`` and the rstd (sequence
    parallelism: N / T; default all N). The norm outputs ``ln1`` / ``ln2``
    stay [N, C]: they are the gathered inputs of the column-parallel GEMMs.
    """

    def __init__(self, cfg: ModelConfig, build: ModelBuild, device: torch.device,
                 unread_by_backward: frozenset = frozenset(), rows: int | None = None, residuals=None):
        batch, seq, dtype, recompute = build.batch, build.seq, build.dtype, build.recompute
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
        self.residual = (residuals or ResidentResiduals)(L, r, c, dtype, device)
        self.rstd1 = [torch.empty(r, dtype=torch.float32, device=device) for _ in range(L)]
        self.rstd2 = [torch.empty(r, dtype=torch.float32, device=device) for _ in range(L)]
        self.per_layer_bytes += 2 * r * 4  # two rstd
        if cfg.is_gpt2:  # LayerNorm: the row means too
            self.mean1 = [torch.empty(n, dtype=torch.float32, device=device) for _ in range(L)]
            self.mean2 = [torch.empty(n, dtype=torch.float32, device=device) for _ in range(L)]
            self.per_layer_bytes += 2 * n * 4
        self.per_layer_bytes += self.residual.per_layer_bytes
        self.shared_bytes += self.residual.shared_bytes
        self.host_bytes = self.residual.host_bytes

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
    reading the gradients). The stores of llmq_ray/parallel/data.py reduce a unit's gradients onto their owners
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
