"""The four block linears (QKV, attention-out, up+gate, down; GPT-2's c_fc ``up_w`` for up+gate) in the model
dtype or in FP8.

A linear layer y[N, OC] = x[N, K] W[OC, K]^T (+ b) has three GEMMs per training step:

    forward  y  = x  W^T          FP8: a = q(x)    [N, K],  b = q(W)    [OC, K]
    dgrad    dx = dy W            FP8: a = q(dy)   [N, OC], b = q(W^T)  [K, OC]
    wgrad    dW += dy^T x         FP8: a = q(dy^T) [OC, N], b = q(x^T)  [K, N]

FP8 tensor cores want both operands K-major ("TN"), so each operand is quantized in the layout its GEMM
needs: ``quantize_transpose`` writes the transposed copy in the same pass as the cast.

Scaling is per tensor and "current": every quantization uses the absmax of the very tensor it casts. For
activations that absmax comes out of the kernel that produced them (rmsnorm, swiglu write it for free), and so
does it for the gradients dy (the swiglu and RMSNorm backward kernels write max|dy|); the attention output and
the QKV gradient need one extra absmax pass.

``store_xt`` (on unless the model recomputes activations): the forward quantizes x in both layouts in one
pass and keeps q(x^T) for the wgrad, instead of reading the bf16 x again in the backward to re-quantize it.
It costs one FP8 byte per GEMM input element per layer (2.97 GB for Qwen2.5-0.5B at B=16, T=1024) and saves
2 bytes of traffic per element per micro-step. Since the backward then never reads the bf16 ln1, ln2 and
swiglu outputs, the model keeps one shared buffer for each instead of one per layer (``Activations``,
``unread_by_backward``): 2 bytes per element less for three of the four inputs (10.8 GiB at 7B, B=8).

Weight copies. Weights change only at the optimizer update, and quantizing the same bf16 values again gives
the same bytes, so *when* W_q / W^T_q are made never changes the results -- only what it costs:

* ``quants="persistent"`` (ZeRO-1/2 always; ZeRO-3 when chosen): the copies of all L layers
  stay for the whole optimizer step (``invalidate_weights`` at each step's start); each layer is quantized
  once per step, at its first use (under CUDA graphs: all layers at once before the replay, so the graph only
  reads them -- except a step's first micro-step with the overlapped update, whose graph quantizes each layer
  after waiting for its update, llmq_ray/engine/cuda_graphs.py). Costs as many device bytes as the bf16 block weights. Under ZeRO-3
  a layer's bf16 weights are then needed only once per step (``needs_weights``), so the store gathers each
  layer once per step instead of twice per micro-step.
* ``quants="host"``: the same persistent copies, kept in (pinned) host memory; two device slots hold layer l
  in slot l % 2, fetched one layer ahead on a side stream. The engine applies it (``HostWeightCopies`` in
  llmq_ray/engine/offload.py, a subclass handed over as ``ModelPolicies.block_linears``); the slots are here.
* ``quants="layer"`` (the ZeRO-3 default): only two device slots (layer l in slot l % 2),
  filled lazily, one matrix and one layout at a time, by the GEMM that needs it: the forward GEMM makes W_q,
  the dgrad makes W^T_q (a layout a pass does not use is never written), unless the slot still holds that
  layout of that layer from earlier in the step. Each weight's absmax is taken once per step, at its first
  quantization, and kept (``w_amax``): the weights change only at the update. Costs two layers of FP8 bytes
  and, per layer and pass, one read of the bf16 weights and one FP8 write. The forward, the recomputation and
  the backward of a micro-step all read copies made from the same bf16 weights with the same scale, so they
  see the same bytes as the persistent copies. ``keep_copies`` (a byte budget the engine sets) spends spare
  device memory on persistent copies of the first matrices that fit (layer 0 first, each layout on its own):
  those are quantized once per step, at their first use, like the persistent ones; the rest still use the
  slots. Under ZeRO-3 a layer whose eight copies (four matrices, both layouts) are all kept and made is not
  gathered again in that step (``needs_weights``); the engine makes every rank of the shard group keep the
  same copies (the least any rank has room for), since the skipped gathers must match up. On two NVLink H200s
  (1.5B) skipping them changed no speed -- the gathers were hidden behind compute -- while keeping every
  layer's copies gave +2.5% (benchmarks/results/h200x2-2026-11-28.md); the skip saves interconnect traffic,
  which shows where gathers are not hidden. At 7B e4m3 (B=6) the two weight quantizations per layer and
  micro-step took ~12.8 ms of a ~297 ms micro-step on an H100 (benchmarks/LOG.md, 2026-11-28): ~0.3% per GiB
  kept by that count; measured beside a run without, 1.4 GiB gave +1.0% (one lease; fewer memory-bound passes
  may also leave more of the power cap to the GEMMs).

The model announces each layer with ``begin_layer(layer, backward)`` after the weight store's ``begin``.

Forward operands use e4m3 (more mantissa); gradient operands use ``gradient_dtype`` (e4m3 or e5m2, more range),
each scaled to its own format's maximum.
"""

from __future__ import annotations

import torch

from llmq_ray.backends.base import Backend
from llmq_ray.model.layers.units import Policy

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
BLOCK_WEIGHTS = ("qkv_w", "out_w", "up_gate_w", "down_w")
GPT2_BLOCK_WEIGHTS = ("qkv_w", "out_w", "up_w", "down_w")  # GPT-2's MLP has one first matrix, not gated


def block_weights(cfg) -> tuple[str, ...]:
    """The names of a block's four matrices for ``cfg`` (a ModelConfig), in the layout's order."""
    return GPT2_BLOCK_WEIGHTS if cfg.is_gpt2 else BLOCK_WEIGHTS


class BlockLinears(Policy):
    """Runs the block GEMMs for a model; ``fp8=False`` is a thin pass-through to ``backend.matmul``.

    weights: the model's named views (``layers.{l}.{name}``, read only when quantizing or in the model dtype);
    shapes: {key: (OC, K)} of every block weight (known without touching the weights, which ZeRO-3 has not
    gathered yet); rows = N tokens of a micro-batch.
    FP8 scratch (allocated once): x quantized [N, max K], x^T [max K, N] (without ``store_xt``), dy and dy^T
    quantized [N, max OC] / [max OC, N]; the weight copies W_q [OC, K] and W^T_q [K, OC] (e4m3) and a
    descale (fp32 0-d, on the device) per block weight,
    held as ``quants`` says (module docstring): all layers on the device ("persistent"), all layers in host
    memory plus two device slots ("host"), or two device slots ("layer"; plus the copies ``keep_copies`` keeps
    for the step).
    ``names``: the block's four matrices (``block_weights(cfg)``; GPT-2's ``up_w`` for ``up_gate_w``).
    ``sharded``: the weights are not all resident (ZeRO-3's gathers), so persistent copies are made one layer at a time
    in ``begin_layer`` rather than all at once.

    A unit policy (llmq_ray/model/layers/units.py): ``begin(layer)`` is ``begin_layer``.
    """

    QUANTS = ("persistent", "layer")

    def __init__(self, backend: Backend, weights, shapes: dict[str, tuple[int, int]], num_layers: int, rows: int,
                 matmul_dtype: str | None, gradient_dtype: str | None, store_xt: bool = True,
                 quants: str = "persistent", sharded: bool = False, names: tuple[str, ...] = BLOCK_WEIGHTS):
        if quants not in self.QUANTS:
            raise ValueError(f"quants={quants!r} must be one of {self.QUANTS}")
        self.be, self.w, self.num_layers = backend, weights, num_layers
        self.shapes = shapes
        # quants="layer" + keep_copies: {(key, transposed): W_q [OC, K] or W^T_q [K, OC]} kept for the step
        self.kept: dict[tuple[str, bool], torch.Tensor] = {}
        self.names = names
        self.fp8 = matmul_dtype == "e4m3"
        self.store_xt = self.fp8 and store_xt
        self.quants, self.sharded = quants, sharded
        self.overlap = None  # a WgradOverlap (llmq_ray/engine/wgrad_overlap.py): model-dtype wgrads on a side stream
        if not self.fp8:
            return
        dev = backend.device
        self.fwd_dtype = FP8_DTYPES["e4m3"]
        self.grad_dtype = FP8_DTYPES[gradient_dtype or "e4m3"]
        # the widest GEMM input (K: x, q(x^T)) and output (OC: dy, q(dy^T)) of the block; q(x^T) needs scratch
        # only without store_xt (it is otherwise the stored copy): 0.33 GiB less at 7B, B=6
        widest_in = max(shapes[f"layers.0.{name}"][1] for name in self.names)
        widest_out = max(shapes[f"layers.0.{name}"][0] for name in self.names)
        self.x_q = torch.empty(rows * widest_in, dtype=self.fwd_dtype, device=dev)
        self.xt_q = torch.empty(0 if self.store_xt else rows * widest_in, dtype=self.fwd_dtype, device=dev)
        self.dy_q = torch.empty(rows * widest_out, dtype=self.grad_dtype, device=dev)
        self.dyt_q = torch.empty(rows * widest_out, dtype=self.grad_dtype, device=dev)
        # Descales of x, x^T, dy (and dy^T, same scale): separate 0-d tensors, not views of one [4] tensor, because cuBLASLt
        # rejects scale pointers that are not 16-byte aligned (CUBLAS_STATUS_NOT_SUPPORTED, seen on H100).
        self.scales = [torch.ones((), dtype=torch.float32, device=dev) for _ in range(3)]
        self.dy_amax = torch.zeros((), dtype=torch.float32, device=dev)
        self.key_of = {(layer, name): f"layers.{layer}.{name}" for layer in range(num_layers) for name in self.names}
        self.layer_of = {key: ln for ln, key in self.key_of.items()}
        self.w_descale = {key: torch.ones((), dtype=torch.float32, device=dev) for key in self.layer_of}
        # max|W| per block weight (fp32 0-d): taken once per step (weights change only at the update)
        self.w_amax = {key: torch.zeros((), dtype=torch.float32, device=dev) for key in self.layer_of}
        # persistent copies of every layer: on the device (a subclass may keep them elsewhere: ``_new_copy``)
        self.w_q: dict[str, torch.Tensor] = {}
        self.wt_q: dict[str, torch.Tensor] = {}
        if quants != "layer":
            for key in self.layer_of:
                oc, k = shapes[key]
                self.w_q[key] = self._new_copy(oc, k)
                self.wt_q[key] = self._new_copy(k, oc)
        # two device slots (layer l in slot l % 2): {name: (W_q [OC, K], W^T_q [K, OC])}
        self.slots: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        if quants != "persistent":
            for _ in range(2):
                slot = {}
                for name in self.names:
                    oc, k = shapes[f"layers.0.{name}"]
                    slot[name] = (torch.empty(oc, k, dtype=self.fwd_dtype, device=dev),
                                  torch.empty(k, oc, dtype=self.fwd_dtype, device=dev))
                self.slots.append(slot)
        # store_xt: q(x^T) [K, N] of every block GEMM input and its descale, written by the forward
        self.xt_store: dict[str, torch.Tensor] = {}
        self.x_descale: dict[str, torch.Tensor] = {}
        if self.store_xt:
            for key in self.layer_of:
                self.xt_store[key] = torch.empty(shapes[key][1], rows, dtype=self.fwd_dtype, device=dev)
                self.x_descale[key] = torch.ones((), dtype=torch.float32, device=dev)
        self.invalidate_weights()

    def _new_copy(self, rows: int, cols: int) -> torch.Tensor:
        """A persistent FP8 weight copy [rows, cols] (on the device here)."""
        return torch.empty(rows, cols, dtype=self.fwd_dtype, device=self.be.device)

    # ------------------------------------------------------------------ weight copies
    def invalidate_weights(self) -> None:
        """The weights changed (optimizer update, checkpoint load): re-quantize them before the next use."""
        if self.fp8:
            self.valid = [False] * self.num_layers       # persistent copy of layer l is current
            self.slot_holder: list[int | None] = [None, None]  # which layer's copies each device slot holds
            # quants="layer": {(name, transposed): layer} whose copy each slot holds; keys with a current w_amax
            self.slot_has: list[dict] = [{}, {}]
            self.amax_valid: set[str] = set()
            self.kept_valid: set[tuple[str, bool]] = set()  # kept copies made from the current weights

    def ensure_quantized(self) -> None:
        """Resident persistent copies: quantize every stale layer now (before a CUDA-graph replay that only reads
        them; the first micro-step's graph under the overlapped update quantizes them itself)."""
        if self.fp8 and self.quants == "persistent" and not self.sharded:
            for layer in range(self.num_layers):
                if not self.valid[layer]:
                    self._quantize_layer(layer, None)

    def mark_quantized(self) -> None:
        """A CUDA-graph replay just re-quantized every layer's persistent copies (llmq_ray/engine/cuda_graphs.py)."""
        if self.fp8 and self.quants == "persistent" and not self.sharded:
            self.valid = [True] * self.num_layers
            self.amax_valid = set(self.key_of.values())

    def needs_weights(self, layer: int) -> bool:
        """Whether the bf16 weights of ``layer`` will be read (ZeRO-3 skips gathering them when not): False
        only when the layer's FP8 copies are current -- its persistent copy, or (quants="layer") kept copies of
        all its matrices in both layouts (``keep_copies``) -- as the block GEMMs then read nothing else. The
        answer must be the same on every rank of a shard group (it decides whether a collective is issued): it
        depends only on the step's call order and on the kept plan, which the engine makes the same on all."""
        if not self.fp8:
            return True
        if self.quants == "layer":
            return not all((self.key_of[layer, name], transposed) in self.kept_valid
                           for name in self.names for transposed in (False, True))
        return not self.valid[layer]

    def begin(self, unit, backward: bool = False) -> None:
        if isinstance(unit, int):
            self.begin_layer(unit, backward)

    def begin_layer(self, layer: int, backward: bool = False) -> None:
        """``layer``'s GEMMs run next (its weights, if needed, are gathered): make its FP8 copies available.
        Persistent copies: a stale layer is quantized at its first use in the step; quants="layer": the GEMMs
        quantize what they need (``_copy``)."""
        if self.fp8 and self.quants == "persistent" and not self.valid[layer]:
            self._quantize_layer(layer, None)

    def _quantize_layer(self, layer: int, slot: int | None) -> None:
        """W_q, W^T_q and the descale of ``layer``'s four matrices from their current weights, into the
        persistent copies (slot None) or device slot ``slot``."""
        for name in self.names:
            key = self.key_of[layer, name]
            w = self.w[key]
            dst = (self.w_q[key], self.wt_q[key]) if slot is None else self.slots[slot][name]
            self.be.quantize_with_transpose(dst[0], dst[1], self.w_descale[key], w, self._weight_amax(key))
        if slot is None:
            self.valid[layer] = True

    def _weight_amax(self, key: str) -> torch.Tensor:
        """max|W| of block weight ``key`` for this step (measured at its first use since the weights changed)."""
        amax = self.w_amax[key]
        if key not in self.amax_valid:
            self.be.absmax(amax, self.w[key])
            self.amax_valid.add(key)
        return amax

    def _copy(self, key: str, transposed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """quants="layer": (W_q [OC, K] or, ``transposed``, W^T_q [K, OC]; descale) of ``key`` in its layer's
        slot, quantized now unless the slot already holds that layout of that layer from earlier in the step."""
        kept = self.kept.get((key, transposed))
        if kept is not None:  # keep_copies: made once per step
            if (key, transposed) not in self.kept_valid:
                w, amax = self.w[key], self._weight_amax(key)
                if transposed:
                    self.be.quantize_transpose(kept, self.w_descale[key], w, amax)
                else:
                    self.be.quantize(kept, self.w_descale[key], w, amax)
                self.kept_valid.add((key, transposed))
            return kept, self.w_descale[key]
        layer, name = self.layer_of[key]
        slot = layer % 2
        dst = self.slots[slot][name][1 if transposed else 0]
        if self.slot_has[slot].get((name, transposed)) != layer:
            w, amax = self.w[key], self._weight_amax(key)
            if transposed:
                self.be.quantize_transpose(dst, self.w_descale[key], w, amax)
            else:
                self.be.quantize(dst, self.w_descale[key], w, amax)
            self.slot_has[slot][(name, transposed)] = layer
        return dst, self.w_descale[key]

    def kept_copies_plan(self, budget_bytes: int) -> list[tuple[str, bool, tuple[int, int]]]:
        """quants="layer": the (key, transposed, shape) of the FP8 copies to keep (``keep_copies``) in
        ``budget_bytes``: the first block matrices that fit, layer by layer; within a layer the four matrices in order, forward
        layout then transposed; one that does not fit is skipped and smaller ones after it may still fit.
        Empty for the other placements. One FP8 byte per element."""
        if not self.fp8 or self.quants != "layer":
            return []
        plan, used = [], 0
        for layer in range(self.num_layers):
            for name in self.names:
                key = self.key_of[layer, name]
                oc, k = self.shapes[key]
                for transposed in (False, True):
                    if used + oc * k <= budget_bytes:
                        plan.append((key, transposed, (k, oc) if transposed else (oc, k)))
                        used += oc * k
        return plan

    def keep_copies(self, plan: list[tuple[str, bool, tuple[int, int]]]) -> int:
        """Allocate the copies of ``plan`` (``kept_copies_plan``'s list) on the device, kept for the whole step
        (quantized at their first use in a step). Returns the bytes allocated (the memory table counts them under
        "FP8 copies + scratch"). Calling it again replaces the earlier choice."""
        self.kept, self.kept_valid = {}, set()
        for key, transposed, shape in plan:
            self.kept[key, transposed] = torch.empty(shape, dtype=self.fwd_dtype, device=self.be.device)
        return sum(t.numel() for t in self.kept.values())

    def _copies(self, key: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(W_q [OC, K], W^T_q [K, OC], descale) of block weight ``key`` for the GEMM about to run."""
        layer, _ = self.layer_of[key]
        if not self.valid[layer]:
            if self.sharded:
                raise RuntimeError(f"FP8 copies of layer {layer} used before begin_layer({layer})")
            self.ensure_quantized()
        return self.w_q[key], self.wt_q[key], self.w_descale[key]

    def host_tensors(self) -> list[torch.Tensor]:
        """The FP8 copies kept in host memory ([] here; see ``HostWeightCopies``)."""
        return []

    def device_copies(self) -> list[torch.Tensor]:
        """The FP8 weight copies on the device (persistent and kept ones)."""
        return [*self.w_q.values(), *self.wt_q.values(), *self.kept.values()]

    def fp8_bytes(self) -> int:
        """Bytes of FP8 scratch and weight copies on the device (0 in the model dtype)."""
        if not self.fp8:
            return 0
        slots = [t for s in self.slots for pair in s.values() for t in pair]
        tensors = [self.x_q, self.xt_q, self.dy_q, self.dyt_q, *self.device_copies(), *slots,
                   *self.xt_store.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    # ------------------------------------------------------------------ the three GEMMs
    def x_quant_buffers(self, key: str, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """FP8 with ``store_xt``: where a kernel that produces the GEMM input x[N, K] of ``key`` writes q(x)
        [N, K], q(x^T) [K, N] (kept for the wgrad) and the descale itself (``forward(..., x_quantized=True)``
        then reads them)."""
        if not (self.fp8 and self.store_xt):
            raise RuntimeError("x_quant_buffers: only FP8 linears that keep q(x^T) take a pre-quantized input")
        return self.x_q[:n * k].view(n, k), self.xt_store[key], self.x_descale[key]

    def forward(self, out: torch.Tensor, x: torch.Tensor, key: str, x_amax: torch.Tensor | None,
                bias: torch.Tensor | None = None, x_quantized: bool = False,
                weight_fp8: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """out[N, OC] = x[N, K] W^T (+ bias). FP8 needs x_amax = max|x| (fp32 0-d device tensor), or
        ``x_quantized``: the producer of x wrote ``x_quant_buffers`` itself (x is then only read for its shape).
        ``weight_fp8`` (FP8): (an FP8 copy [OC, K], its descale) the caller made, used instead of W's own
        (Smooth-SwiGLU's W diag(c), llmq_ray/model/layers/smooth_swiglu.py)."""
        if not self.fp8:
            self.be.matmul(out, x, self.w[key], transpose_b=True, bias=bias)
            return
        if weight_fp8 is not None:
            w_q, w_descale = weight_fp8
        elif self.quants == "layer":
            w_q, w_descale = self._copy(key, transposed=False)
        else:
            w_q, _, w_descale = self._copies(key)
        xq = self.x_q[:x.numel()].view(x.shape)
        if x_quantized:
            xq, _, descale = self.x_quant_buffers(key, *x.shape)
        elif self.store_xt:  # both layouts in one pass; q(x^T) waits for this layer's wgrad
            descale = self.x_descale[key]
            self.be.quantize_with_transpose(xq, self.xt_store[key], descale, x, x_amax)
        else:
            descale = self.scales[0]
            self.be.quantize(xq, descale, x, x_amax)
        self.be.matmul_fp8(out, xq, w_q, descale, w_descale, bias=bias)

    def dy_quant_buffers(self, n: int, oc: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """FP8 scratch for a backward's dy[N, OC]: (q(dy) [N, OC], q(dy^T) [OC, N], descale, absmax), for a kernel
        that quantizes the gradient it produces (``backward(..., dy_quantized=True)`` then reads them)."""
        return (self.dy_q[:n * oc].view(n, oc), self.dyt_q[:n * oc].view(oc, n), self.scales[2], self.dy_amax)

    def backward(self, dx: torch.Tensor, dw: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, key: str,
                 x_amax: torch.Tensor | None, accumulate: bool = True, dy_amax_ready: bool = False,
                 dy_quantized: bool = False, after_dgrad=None, wgrad_columns: torch.Tensor | None = None) -> None:
        """dx[N, K] = dy[N, OC] W (overwritten); dw[OC, K] += dy^T x (accumulate), or dw = dy^T x when
        ``accumulate`` is False (the caller knows dw is still zero: 0 + v == v, so the result is the same bits
        while the GEMM skips reading dw, and the FP8 GEMM writes straight into it without a temporary).
        ``dy_amax_ready``: the kernel that produced dy already wrote max|dy| into ``self.dy_amax``.
        ``dy_quantized`` (FP8): that kernel wrote q(dy) and q(dy^T) into ``dy_quant_buffers`` itself; dy is then
        only read for its shape. ``after_dgrad``: called once dx's GEMM is queued, before the wgrad's (tensor
        parallelism starts dx's reduce-scatter there, to run beside the wgrad).
        ``wgrad_columns`` (FP8; [K] powers of two in dw's dtype): x is stored divided by them column by column
        (Smooth-SwiGLU), so dw += (dy^T x) diag(wgrad_columns): dw is divided by them before the accumulating
        GEMM and multiplied after it -- exact, as only exponents change."""
        be = self.be
        if not self.fp8:
            be.matmul(dx, dy, self.w[key])
            if after_dgrad is not None:
                after_dgrad()
            if self.overlap is None:
                be.matmul(dw, dy, x, transpose_a=True, accumulate=accumulate)
            else:  # tagged by the weight's name: the model waits for it before overwriting dy or x
                self.overlap.submit(key.rsplit(".", 1)[-1], lambda sm: be.matmul_beside(
                    dw, dy, x, transpose_a=True, accumulate=accumulate, sm_count=sm), reads=(dy, x))
            return
        if self.quants == "layer":
            wt_q, w_descale = self._copy(key, transposed=True)
        else:
            _, wt_q, w_descale = self._copies(key)
        n, oc = dy.shape
        k = x.shape[1]
        dyq, dyt, dy_descale, _ = self.dy_quant_buffers(n, oc)
        if not dy_quantized:
            if not dy_amax_ready:
                be.absmax(self.dy_amax, dy)
            be.quantize_with_transpose(dyq, dyt, dy_descale, dy, self.dy_amax)  # one read of dy, both layouts
        be.matmul_fp8(dx, dyq, wt_q, self.scales[2], w_descale)
        if after_dgrad is not None:
            after_dgrad()
        if self.store_xt:
            xt, x_descale = self.xt_store[key], self.x_descale[key]
        else:
            xt, x_descale = self.xt_q[:x.numel()].view(k, n), self.scales[1]
            be.quantize_transpose(xt, x_descale, x, x_amax)
        if wgrad_columns is not None and accumulate:
            dw.div_(wgrad_columns)
        be.matmul_fp8(dw, dyt, xt, self.scales[2], x_descale, accumulate=accumulate)
        if wgrad_columns is not None:
            dw.mul_(wgrad_columns)


class Projection:
    """One of a block's projections as a piece: out = x W^T (+ b) through the model's ``BlockLinears``.

    ``forward`` and ``backward`` return the tensor the block goes on with: ``out`` / ``dx`` here. A plan over the
    model's pieces (llmq_ray/parallel/tensor.py) replaces a projection with a column- or row-parallel one of the
    same interface, whose returned tensor is then the sum over its group (this process's rows of it)."""

    def __init__(self, lin: BlockLinears):
        self.lin = lin

    def forward(self, out: torch.Tensor, x: torch.Tensor, key: str, x_amax: torch.Tensor | None,
                **kw) -> torch.Tensor:
        self.lin.forward(out, x, key, x_amax, **kw)
        return out

    def backward(self, dx: torch.Tensor, dw: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, key: str,
                 x_amax: torch.Tensor | None, accumulate: bool, **kw) -> torch.Tensor:
        self.lin.backward(dx, dw, dy, x, key, x_amax, accumulate, **kw)
        return dx
