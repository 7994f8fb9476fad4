"""ZeRO-2 and ZeRO-3: each rank keeps only its shard of the gradients (ZeRO-2, ``ResidentGradShards``) and
also only its shard of the weights (ZeRO-3, ``ShardedWeights``), a layer's weights gathered just before use.

The flat parameter buffer (``ParamLayout``) is cut into W equal shards [r*S, (r+1)*S) exactly as for the
optimizer state under ZeRO-1, so the optimizer, its checkpoints and resharding are unchanged. Under ZeRO-3 rank
r's ``params_shard`` [S] *is* its slice of the flat buffer, and nobody holds the whole weight buffer any more.

What the model sees (the store behind ``model.w`` / ``.g``; see ``ResidentWeights`` in
llmq_ray/model/buffers.py for the protocol). Under ZeRO-2 the weights are the full flat buffer, resident
and all-gathered after each update as under ZeRO-1, and only the "gradients" point below applies; under
ZeRO-3 all of it:

* **gather units**: each layer's four matrices (qkv, out, up+gate, down -- contiguous in the layout), the
  embedding and the untied LM head. A unit's range [lo, hi) of the flat buffer generally spans one or two
  shards; every owner broadcasts its piece into a device buffer (one async collective per piece: uneven
  pieces are fine for a broadcast, where all-gather would need equal ones).
* **layers** rotate through two layer-sized buffers: ``begin(l)`` waits for layer l (gathered while layer
  l-1 ran) and starts gathering layer l+1 into the other buffer -- l-1 in the backward, which runs in reverse.
  The last two layers of the forward are still resident when the backward starts. With FP8 matmuls and
  --persistent-quants a layer is gathered (in bf16) only once per step: its FP8 copies, made from that
  gather, serve every later pass, and ``layer_needed`` tells the store to skip the gather. Trade-off against
  gathering FP8 bytes every pass (each rank quantizing its own slice with an all-reduced MAX scale): half
  the bytes per gather but 2 x grad_accumulation gathers per step instead of one, and more collectives.
  The per-layer copies with --kept-quants-gib skip the same way for the layers whose copies are all kept,
  from the micro-step after the one that made them.
* **embedding / LM head** share one [V, C] buffer, gathered for the embedding lookup and for the loss phase
  (a tied head reuses the gathered embedding). GPT-2's position table [P, C] belongs to the embedding unit: it
  follows the (tied) token table in the layout, so the unit is the one range [embed, pos_embed) and the buffer
  [(V + P) C]; its gradient is reduced with the embedding's at the end of the backward.
* **norm weights and biases** (the layout's non-decayed tail, ~0.01% of the weights) are replicated on every
  rank, like weights under ZeRO-1: their owners broadcast them after each update.
* **gradients**: each layer's block-weight gradients go to one of two layer-sized buffers, overwritten (not
  accumulated) by the backward; at ``end(l, backward)`` they are reduced (summed) to their owners
  asynchronously while layer l-1's backward runs, and each owner adds its piece into the shard-sized
  gradient accumulator (``sink``: the engine's ``grad_shard``, on the host with --offload-gradients). The
  head's and embedding's gradients go the same way from a [V, C] buffer; the replicated norm/bias
  gradients are reduced once per micro-step.

Collectives are issued in the same order on every rank (the model's call order), so they match up; on
NCCL their async handles order the compute stream after the copy (``wait``), on gloo ``wait`` blocks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from llmq_ray.model.params import ParamLayout
from llmq_ray.model.layers.units import Policy


def shard_pieces(lo: int, hi: int, shard_size: int) -> list[tuple[int, int, int]]:
    """[(owner rank, piece lo, piece hi)] covering the flat range [lo, hi) cut at the shard boundaries
    r * shard_size (empty for an empty range)."""
    if hi <= lo:
        return []
    return [(r, max(lo, r * shard_size), min(hi, (r + 1) * shard_size))
            for r in range(lo // shard_size, (hi - 1) // shard_size + 1)]


class _NamedViews:
    """``store.w`` / ``store.g``: name -> view, resolved at each access into whichever buffer holds it."""

    def __init__(self, store: "ShardedWeights", grads: bool):
        self.store, self.grads = store, grads

    def __contains__(self, name: str) -> bool:
        return name in self.store.layout.slots

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.store.view(name, self.grads)

    def get(self, name: str, default=None):
        return self[name] if name in self else default


class ShardedGradients(Policy):
    """The gradient half of ZeRO-2 and ZeRO-3: per-layer gradient buffers reduced onto their owners during the
    backward (module docstring, "gradients"), so no rank holds a full gradient buffer.

    Buffers (model dtype, on ``device``): ``plain_grads`` [P] (the replicated tail's gradients);
    ``layer_grads`` 2 x [layer numel]; ``head_grad`` [V*C]. ``sink(offset, piece)`` adds a reduced gradient
    piece into the rank's accumulator at ``offset`` within the shard (the engine decides copy-or-add for the
    first micro-step). Subclasses say where the weights are: ``weight_view`` and the three gather hooks.
    """

    layer_grads_fresh = True  # the layer gradient buffers are overwritten by every backward

    @staticmethod
    def layer_needed(layer: int) -> bool:
        """Whether ``layer``'s weights will be read when it runs next; the engine sets the model's
        ``needs_weights`` here (False once a persistent FP8 copy of the layer exists this step)."""
        return True

    def __init__(self, layout: ParamLayout, comm, shard_size: int, dtype: torch.dtype, device: torch.device,
                 sink: Callable[[int, torch.Tensor], None], before_reduce: Callable[[object], None] | None = None):
        self.layout, self.comm, self.sink = layout, comm, sink
        self.shard_size, self.shard_lo = shard_size, comm.rank * shard_size
        self.dtype, self.device = dtype, device
        cfg = layout.cfg
        self.plain_lo = layout.decay_end
        self.plain_grads = self._zeros(layout.numel - self.plain_lo)
        # units: name -> [lo, hi) of the flat buffer
        embed_end = layout.slots["embed"].end
        if "pos_embed" in layout.slots:  # learned positions: part of the embedding unit (module docstring)
            if layout.slots["pos_embed"].offset != embed_end:
                raise ValueError("the position table must follow the token table (a tied head) to share its unit")
            embed_end = layout.slots["pos_embed"].end
        self.units: dict = {"embed": (layout.slots["embed"].offset, embed_end)}
        if not cfg.tie_word_embeddings:
            self.units["lm_head"] = (layout.slots["lm_head"].offset, layout.slots["lm_head"].end)
        for layer in range(cfg.num_layers):
            p = f"layers.{layer}."
            self.units[layer] = (layout.slots[p + "qkv_w"].offset, layout.slots[p + "down_w"].end)
        self.unit_of = {}
        for name, slot in layout.slots.items():
            if slot.offset < self.plain_lo:
                self.unit_of[name] = (int(name.split(".")[1]) if name.startswith("layers.")
                                      else "embed" if name == "pos_embed" else name)
        layer_numel = {hi - lo for u, (lo, hi) in self.units.items() if isinstance(u, int)}
        assert len(layer_numel) == 1, "every layer has the same matrices"
        self.layer_numel = layer_numel.pop()
        self.head_numel = self.units["embed"][1] - self.units["embed"][0]
        self.layer_grads = [self._zeros(self.layer_numel), self._zeros(self.layer_numel)]
        self.head_grad = self._zeros(self.head_numel)
        # which layer each buffer pair holds, and the reduces still in flight on it
        self.layer_holder: list = [None, None]
        self.grad_reduces: list[list] = [[], []]
        self.head_reduces: list = []
        self._views: dict = {}
        self.w, self.g = _NamedViews(self, False), _NamedViews(self, True)
        # tensor parallelism: called with a layer index or "plain" just before that part's gradients are reduced
        # (the engine sums the parts the group's ranks each hold a share of: TensorParallel.reduce_grads)
        self.before_reduce = before_reduce

    def _zeros(self, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=self.dtype, device=self.device)

    # ------------------------------------------------------------------ collectives on ranges
    def _pieces(self, lo: int, hi: int):
        return shard_pieces(lo, hi, self.shard_size)

    def _reduce(self, lo: int, hi: int, buf: torch.Tensor) -> list:
        """Start summing the gradient pieces buf[0:hi-lo] of [lo, hi) onto their owners."""
        return [(self.comm.reduce_sum(buf[plo - lo:phi - lo], dst=r), r, plo, buf[plo - lo:phi - lo])
                for r, plo, phi in self._pieces(lo, hi)]

    def _finish(self, pending: list) -> None:
        """Wait for reduces started by ``_reduce``; the owner adds its piece into the accumulator."""
        for handle, r, plo, piece in pending:
            handle.wait()
            if r == self.comm.rank:
                self.sink(plo - self.shard_lo, piece)
        pending.clear()

    @staticmethod
    def _wait(handles: list) -> None:
        for h in handles:
            h.wait()
        handles.clear()

    # ------------------------------------------------------------------ the model's accessors
    def view(self, name: str, grads: bool) -> torch.Tensor:
        """The tensor ``name`` (a weight, or with ``grads`` its gradient) in the buffer that holds it now."""
        slot = self.layout.slots[name]
        if slot.offset >= self.plain_lo and grads:
            key = (name, grads)
            if key not in self._views:
                self._views[key] = self.plain_grads[slot.offset - self.plain_lo:slot.end - self.plain_lo].view(slot.shape)
            return self._views[key]
        if not grads:
            return self.weight_view(name)
        unit = self.unit_of[name]
        if isinstance(unit, int):
            i = unit % 2
            if self.layer_holder[i] != unit:
                raise RuntimeError(f"ZeRO: the gradient of {name} used while layer {unit} does not run")
            flat = self.layer_grads[i]
        else:
            flat = self.head_grad
        lo = self.units[unit][0]
        return flat[slot.offset - lo:slot.end - lo].view(slot.shape)

    def weight_view(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def _ensure_layer(self, layer: int) -> None:
        """Make buffer pair layer % 2 the layer's (its gradients go there; ZeRO-3 also gathers its weights)."""
        self.layer_holder[layer % 2] = layer

    def _wait_layer(self, layer: int) -> None:
        """The layer's weights are in place (ZeRO-3 waits for its gather)."""

    def _ensure_head(self, unit: str) -> None:
        """The embedding / LM head weights are in place (ZeRO-3 gathers them)."""

    def begin(self, unit, backward: bool = False) -> None:
        if isinstance(unit, int):
            self._ensure_layer(unit)
            self._wait_layer(unit)
            nxt = unit - 1 if backward else unit + 1
            if 0 <= nxt < self.layout.cfg.num_layers:
                self._ensure_layer(nxt)  # prefetch into the other buffer (its previous layer is done)
            if backward:
                self._finish(self.grad_reduces[unit % 2])  # layer unit+2's gradients leave this buffer first
            return
        tied = "lm_head" not in self.units
        if unit == "embed" and not backward:
            self._ensure_head("embed")
        elif unit == "head":
            self._ensure_head("embed" if tied else "lm_head")
            if backward:
                self.head_grad.zero_()  # the LM head's GEMMs accumulate into it
        elif unit == "embed" and backward and not tied:
            self._finish(self.head_reduces)  # the LM head's gradient has left the buffer
            self.head_grad.zero_()
        # tied embedding, backward: keep accumulating onto the head's gradient

    def end(self, unit, backward: bool = False) -> None:
        if not backward:
            return
        if isinstance(unit, int):
            if self.before_reduce is not None:
                self.before_reduce(unit)
            self.grad_reduces[unit % 2] = self._reduce(*self.units[unit], self.layer_grads[unit % 2])
        elif unit == "embed" or "lm_head" in self.units:  # the untied head, or the (tied) embedding at the end
            name = "embed" if unit == "embed" else "lm_head"
            self.head_reduces = self._reduce(*self.units[name], self.head_grad)

    # ------------------------------------------------------------------ the engine's calls
    def zero_grads(self) -> None:
        """Start of an optimizer step (the per-micro-step buffers reset themselves)."""
        self.plain_grads.zero_()

    def finish_micro_step(self) -> None:
        """After a forward+backward: every gradient reduce lands in the accumulator, and the replicated
        norm/bias gradients are reduced too (then zeroed for the next micro-step)."""
        for pending in (*self.grad_reduces, self.head_reduces):
            self._finish(pending)
        if self.before_reduce is not None:
            self.before_reduce("plain")
        self._finish(self._reduce(self.plain_lo, self.layout.numel, self.plain_grads))
        self.plain_grads.zero_()

    def tensors(self) -> dict[str, list[torch.Tensor]]:
        """{"weights": [...], "grads": [...]}: the device buffers by role (memory table)."""
        return {"weights": [], "grads": [self.plain_grads, *self.layer_grads, self.head_grad]}


class ResidentGradShards(ShardedGradients):
    """ZeRO-2: every rank holds all the weights (``params``, the flat buffer [>= layout.numel], all-gathered
    after each update as under ZeRO-1), but only its shard of the gradients: the backward writes each layer's
    gradients into a two-layer scratch that is reduced onto the owners while the next layer's backward runs."""

    weights_resident = True  # as ResidentWeights: every weight is in ``params``

    def __init__(self, layout: ParamLayout, comm, shard_size: int, params: torch.Tensor,
                 sink: Callable[[int, torch.Tensor], None], before_reduce: Callable[[object], None] | None = None):
        super().__init__(layout, comm, shard_size, params.dtype, params.device, sink, before_reduce)
        self.params = params

    def weight_view(self, name: str) -> torch.Tensor:
        key = (name, False)
        if key not in self._views:
            slot = self.layout.slots[name]
            self._views[key] = self.params[slot.offset:slot.end].view(slot.shape)
        return self._views[key]


class ShardedWeights(ShardedGradients):
    """ZeRO-3: this rank's weight shard, the replicated norms/biases and the gather buffers, on top of the
    gradient half (``ShardedGradients``).

    Buffers (model dtype, on ``device``): ``params_shard`` [S]; ``plain`` [P] (the replicated tail);
    ``layer_bufs`` 2 x [layer numel]; ``head_buf`` [V*C].
    """

    def __init__(self, layout: ParamLayout, comm, shard_size: int, dtype: torch.dtype, device: torch.device,
                 sink: Callable[[int, torch.Tensor], None], before_reduce: Callable[[object], None] | None = None):
        super().__init__(layout, comm, shard_size, dtype, device, sink, before_reduce)
        self.params_shard = self._zeros(shard_size)
        self.plain = self._zeros(layout.numel - self.plain_lo)
        self.layer_bufs = [self._zeros(self.layer_numel), self._zeros(self.layer_numel)]
        self.head_buf = self._zeros(self.head_numel)
        self.layer_gathered = [False, False]  # False: the buffer is the layer's for gradients, weights skipped
        self.layer_gathers: list[list] = [[], []]
        self.head_holder = None

    def _gather(self, lo: int, hi: int, buf: torch.Tensor) -> list:
        """Start filling buf[0:hi-lo] with the weights [lo, hi): each owner broadcasts its piece."""
        handles = []
        for r, plo, phi in self._pieces(lo, hi):
            piece = buf[plo - lo:phi - lo]
            if r == self.comm.rank:
                piece.copy_(self.params_shard[plo - self.shard_lo:phi - self.shard_lo])
            handles.append(self.comm.broadcast(piece, src=r))
        return handles

    def weight_view(self, name: str) -> torch.Tensor:
        slot = self.layout.slots[name]
        if slot.offset >= self.plain_lo:
            key = (name, False)
            if key not in self._views:
                self._views[key] = self.plain[slot.offset - self.plain_lo:slot.end - self.plain_lo].view(slot.shape)
            return self._views[key]
        unit = self.unit_of[name]
        if isinstance(unit, int):
            i = unit % 2
            if self.layer_holder[i] != unit or not self.layer_gathered[i]:
                raise RuntimeError(f"ZeRO-3: {name} used while layer {unit} is not gathered")
            flat = self.layer_bufs[i]
        else:
            if self.head_holder != unit:
                raise RuntimeError(f"ZeRO-3: {name} used while it is not gathered")
            flat = self.head_buf
        lo = self.units[unit][0]
        return flat[slot.offset - lo:slot.end - lo].view(slot.shape)

    def _ensure_layer(self, layer: int) -> None:
        """Make buffer layer % 2 the layer's (its gradients go there); gather its weights unless
        ``layer_needed`` says nobody will read them (the same answer on every rank: the model's state)."""
        i = layer % 2
        needed = self.layer_needed(layer)
        if self.layer_holder[i] != layer or (needed and not self.layer_gathered[i]):
            self.layer_gathers[i] = self._gather(*self.units[layer], self.layer_bufs[i]) if needed else []
            self.layer_holder[i] = layer
            self.layer_gathered[i] = needed

    def _wait_layer(self, layer: int) -> None:
        self._wait(self.layer_gathers[layer % 2])

    def _ensure_head(self, unit: str) -> None:
        if self.head_holder != unit:
            self._wait(self._gather(*self.units[unit], self.head_buf))
            self.head_holder = unit

    # ------------------------------------------------------------------ the engine's calls
    def after_update(self) -> None:
        """The shards changed (optimizer step, checkpoint load): gathered copies are stale, and the replicated
        norms/biases are re-broadcast from their owners (a collective: all ranks call it)."""
        self.layer_holder = [None, None]
        self.layer_gathered = [False, False]
        self.head_holder = None
        self._wait(self._gather(self.plain_lo, self.layout.numel, self.plain))

    def full_params(self, chunk: int = 1 << 26) -> torch.Tensor:
        """The whole flat weight buffer [layout.numel] as a new CPU tensor, gathered in chunks through a
        device buffer of ``chunk`` elements (a collective: all ranks call it)."""
        n = self.layout.numel
        out = torch.empty(n, dtype=self.params_shard.dtype)
        tmp = torch.empty(min(chunk, n), dtype=self.params_shard.dtype, device=self.params_shard.device)
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            self._wait(self._gather(lo, hi, tmp))
            out[lo:hi].copy_(tmp[:hi - lo])
        return out

    def tensors(self) -> dict[str, list[torch.Tensor]]:
        """{"weights": [...], "grads": [...]}: the device buffers by role (memory table)."""
        return {"weights": [self.params_shard, self.plain, *self.layer_bufs, self.head_buf],
                "grads": super().tensors()["grads"]}
