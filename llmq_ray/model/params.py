"""Where every parameter lives: one flat buffer, named views into it, typed per-layer views, the from-scratch init.

All parameters of the model (and, with the same layout, its gradients, master weights and Adam moments) sit
in one contiguous 1-D tensor. That makes ZeRO sharding a matter of slicing [rank*S, (rank+1)*S), lets the
optimizer run over a few long flat ranges instead of hundreds of small tensors, and lets a collective move
all gradients in one call.

Order: every tensor that gets weight decay (embeddings and matrices) comes first, then the ones that don't
(norm weights, biases). So any contiguous range splits into at most two runs with one decay setting each.

Fused layouts (HF names in brackets):
* ``layers.{l}.qkv_w`` [(Hq+2Hkv)*D, C] = rows of [q_proj; k_proj; v_proj], ``qkv_b`` likewise (Qwen2).
* ``layers.{l}.up_gate_w`` [2I, C] = rows of [up_proj; gate_proj]; swiglu reads [up | gate].
* ``layers.{l}.q_norm_w`` / ``k_norm_w`` [D] (Qwen3's per-head QK-norm: ``self_attn.q_norm`` / ``k_norm``).
* GPT-2: ``pos_embed`` [P, C] (``wpe``, decayed like the token embedding, right after it and the untied head);
  per layer ``qkv_w`` [3C, C] (c_attn, stored transposed by HF), ``up_w`` [I, C] (c_fc: one matrix, no gate) instead
  of ``up_gate_w``, and the biases ``qkv_b``, ``out_b``, ``up_b``, ``down_b`` and LayerNorm biases ``ln1_b``,
  ``ln2_b``, ``final_norm_b`` among the plain tensors.

The names are the layout's (and the checkpoints' and HF mapping's); the model reads its weights and writes its
gradients through ``ModelParams`` / ``BlockParams`` (``w.blocks[l].qkv_w``), typed views over any name -> tensor
mapping: the flat buffers' views, or a ZeRO-3 store whose gathered buffers change as layers come and go.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import TYPE_CHECKING

from llmq_ray.model.config import ModelConfig

if TYPE_CHECKING:  # the layout is arithmetic: a checkpoint manifest (written by the coordinator) needs no torch
    import torch


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """One named tensor inside the flat buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int
    decay: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def end(self) -> int:
        return self.offset + self.numel


class ParamLayout:
    """Names, shapes and offsets of all parameters of a ModelConfig in one flat buffer."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        c, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
        decayed: list[tuple[str, tuple[int, ...]]] = [("embed", (v, c))]
        if not cfg.tie_word_embeddings:
            decayed.append(("lm_head", (v, c)))
        gpt2 = cfg.is_gpt2
        if gpt2:
            decayed.append(("pos_embed", (cfg.max_position_embeddings, c)))
        plain: list[tuple[str, tuple[int, ...]]] = []
        for layer in range(cfg.num_layers):
            p = f"layers.{layer}."
            up = (p + "up_w", (i, c)) if gpt2 else (p + "up_gate_w", (2 * i, c))
            decayed += [(p + "qkv_w", (cfg.qkv_channels, c)), (p + "out_w", (c, cfg.attn_channels)), up,
                        (p + "down_w", (c, i))]
            plain += [(p + "ln1_w", (c,)), (p + "ln2_w", (c,))]
            if cfg.qkv_bias:
                plain.append((p + "qkv_b", (cfg.qkv_channels,)))
            if cfg.qk_norm:
                plain += [(p + "q_norm_w", (cfg.head_dim,)), (p + "k_norm_w", (cfg.head_dim,))]
            if gpt2:
                plain += [(p + "ln1_b", (c,)), (p + "ln2_b", (c,)), (p + "out_b", (c,)), (p + "up_b", (i,)),
                          (p + "down_b", (c,))]
        plain.append(("final_norm", (c,)))
        if gpt2:
            plain.append(("final_norm_b", (c,)))
        self.slots: dict[str, ParamSlot] = {}
        offset = 0
        for names, decay in ((decayed, True), (plain, False)):
            for name, shape in names:
                self.slots[name] = ParamSlot(name, shape, offset, decay)
                offset += math.prod(shape)
            if decay:
                self.decay_end = offset  # [0, decay_end) gets weight decay
        self.numel = offset

    def __iter__(self):
        return iter(self.slots.values())

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named views (no copies) into a flat buffer of this layout."""
        if flat.numel() < self.numel:
            raise ValueError(f"flat buffer has {flat.numel()} elements, layout needs {self.numel}")
        return {s.name: flat[s.offset:s.end].view(s.shape) for s in self.slots.values()}

    def decay_runs(self, start: int, end: int) -> list[tuple[int, int, bool]]:
        """Split the flat range [start, end) into runs of equal decay setting: [(start, end, decay)]."""
        runs = []
        if start < min(end, self.decay_end):
            runs.append((start, min(end, self.decay_end), True))
        if max(start, self.decay_end) < end:
            runs.append((max(start, self.decay_end), end, False))
        return runs

    def shard_range(self, rank: int, world_size: int) -> tuple[int, int]:
        """The [start, end) of the flat buffer owned by ``rank`` under ZeRO (last shard may be shorter)."""
        size = self.shard_size(world_size)
        return min(rank * size, self.numel), min((rank + 1) * size, self.numel)

    def shard_size(self, world_size: int) -> int:
        """Elements per ZeRO shard: ceil(numel / world_size). Flat buffers are padded to size * world_size."""
        return -(-self.numel // world_size)


class BlockParams:
    """The tensors of one block, resolved through ``mapping`` (name -> tensor) at each access, so that they follow
    a store whose buffers change (ZeRO-3 gathers a layer into one of two slots). Model dtype:

    ``ln1_w``, ``ln2_w`` [C]; ``qkv_w`` [(Hq+2Hkv)*D, C]; ``qkv_b`` [(Hq+2Hkv)*D] or None (no QKV bias);
    ``out_w`` [C, Hq*D]; ``up_gate_w`` [2I, C] (rows [up; gate]); ``down_w`` [C, I]; ``q_norm_w``, ``k_norm_w``
    [D] or None (Qwen3's QK-norm only). GPT-2 only (None otherwise): ``up_w`` [I, C] (its MLP's first matrix, in
    place of ``up_gate_w``), ``ln1_b``, ``ln2_b`` [C], ``out_b`` [C], ``up_b`` [I], ``down_b`` [C].
    ``key(name)`` is the layout's name of one of them (``layers.{l}.qkv_w``): what the FP8 copies are kept by."""

    __slots__ = ("layer", "_m", "_prefix")

    def __init__(self, mapping, layer: int):
        self.layer, self._m, self._prefix = layer, mapping, f"layers.{layer}."

    def key(self, name: str) -> str:
        return self._prefix + name

    @property
    def ln1_w(self) -> torch.Tensor:
        return self._m[self._prefix + "ln1_w"]

    @property
    def qkv_w(self) -> torch.Tensor:
        return self._m[self._prefix + "qkv_w"]

    @property
    def qkv_b(self) -> torch.Tensor | None:
        return self._m.get(self._prefix + "qkv_b")

    @property
    def q_norm_w(self) -> torch.Tensor | None:
        return self._m.get(self._prefix + "q_norm_w")

    @property
    def k_norm_w(self) -> torch.Tensor | None:
        return self._m.get(self._prefix + "k_norm_w")

    @property
    def out_w(self) -> torch.Tensor:
        return self._m[self._prefix + "out_w"]

    @property
    def ln2_w(self) -> torch.Tensor:
        return self._m[self._prefix + "ln2_w"]

    @property
    def up_gate_w(self) -> torch.Tensor:
        return self._m[self._prefix + "up_gate_w"]

    @property
    def down_w(self) -> torch.Tensor:
        return self._m[self._prefix + "down_w"]

    # GPT-2
    @property
    def up_w(self) -> torch.Tensor | None:
        return self._m.get(self._prefix + "up_w")

    @property
    def ln1_b(self) -> torch.Tensor | None:
        return self._m.get(self._prefix + "ln1_b")

    @property
    def ln2_b(self) -> torch.Tensor | None:
        return self._m.get(self._prefix + "ln2_b")

    @property
    def out_b(self) -> torch.Tensor | None:
        return self._m.get(self._prefix + "out_b")

    @property
    def up_b(self) -> torch.Tensor | None:
        return self._m.get(self._prefix + "up_b")

    @property
    def down_b(self) -> torch.Tensor | None:
        return self._m.get(self._prefix + "down_b")


class ModelParams:
    """Typed views of a whole model's tensors over ``mapping`` (see BlockParams): ``embed`` [V, C],
    ``blocks[l]``, ``final_norm`` [C] and ``lm_head`` [V, C] (the embedding itself when tied); GPT-2 also
    ``pos_embed`` [P, C] and ``final_norm_b`` [C] (None otherwise)."""

    def __init__(self, mapping, cfg: ModelConfig):
        self.mapping = mapping
        self._head = "embed" if cfg.tie_word_embeddings else "lm_head"
        self.blocks = [BlockParams(mapping, layer) for layer in range(cfg.num_layers)]

    @property
    def embed(self) -> torch.Tensor:
        return self.mapping["embed"]

    @property
    def final_norm(self) -> torch.Tensor:
        return self.mapping["final_norm"]

    @property
    def pos_embed(self) -> torch.Tensor | None:
        return self.mapping.get("pos_embed")

    @property
    def final_norm_b(self) -> torch.Tensor | None:
        return self.mapping.get("final_norm_b")

    @property
    def lm_head(self) -> torch.Tensor:
        return self.mapping[self._head]


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_params(layout: ParamLayout, flat: "torch.Tensor", seed: int, start: int = 0) -> None:
    """Fill ``flat`` with a from-scratch initialization, identical for any device and number of workers.

    ``flat`` holds the global elements [start, start + flat.numel()) of the layout (the whole buffer by
    default; under ZeRO-3 one rank's shard): only the tensors overlapping that range are drawn, and each
    is drawn whole, so a shard gets exactly the values the full buffer would have there.

    Scheme (GPT-2 / llm.c style): embeddings and matrices ~ N(0, 0.02); the two projections that write into
    the residual stream (``out_w``, ``down_w``) ~ N(0, 0.02 / sqrt(2 * num_layers)) so that the residual's
    variance does not grow with depth; norm weights = 1; biases (GPT-2's LayerNorm biases too) = 0; GPT-2's
    position table ~ N(0, 0.02) like the token embedding. Every tensor draws from its own CPU
    generator seeded by (seed, name) in fp32, so the values do not depend on the device, the model dtype
    (beyond the final rounding) or how the buffer is later sharded.

    The draws run in a thread pool (torch's CPU ``normal_`` is serial and releases the GIL): at 7B one thread
    draws ~7.6G values for ~40 s. Each tensor keeps its own generator, so the values are the same for any number
    of threads. Threads: ``torch.get_num_threads()`` (the CPUs Ray gave this worker), at most 8; each holds one
    whole fp32 tensor at a time, so the host memory in flight is that of up to 8 tensors (at 7B: the embedding
    and the untied head, 2.2 GB each, beside six block matrices of up to 0.54 GB: up to ~7.6 GB, where one thread
    held at most 2.2 GB).
    """
    from concurrent.futures import ThreadPoolExecutor

    import torch

    std = 0.02
    residual_std = std / math.sqrt(2 * layout.cfg.num_layers)
    end = start + flat.numel()

    def draw(slot: ParamSlot, lo: int, hi: int, scale: float) -> None:
        gen = torch.Generator(device="cpu").manual_seed(_tensor_seed(seed, slot.name))
        values = torch.empty(slot.shape, dtype=torch.float32).normal_(0.0, scale, generator=gen)
        flat[lo - start:hi - start].copy_(values.view(-1)[lo - slot.offset:hi - slot.offset])

    with ThreadPoolExecutor(max_workers=max(1, min(8, torch.get_num_threads()))) as pool:
        drawn = []
        for slot in layout:
            lo, hi = max(slot.offset, start), min(slot.end, end)
            if lo >= hi:
                continue
            leaf = slot.name.rsplit(".", 1)[-1]
            if leaf in ("ln1_w", "ln2_w", "final_norm", "q_norm_w", "k_norm_w"):
                flat[lo - start:hi - start].fill_(1.0)
            elif leaf in ("qkv_b", "out_b", "up_b", "down_b", "ln1_b", "ln2_b", "final_norm_b"):
                flat[lo - start:hi - start].zero_()
            else:
                scale = residual_std if leaf in ("out_w", "down_w") else std
                drawn.append(pool.submit(draw, slot, lo, hi, scale))
        for future in drawn:
            future.result()  # re-raises a draw's error here
