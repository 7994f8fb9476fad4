"""The optimizer: ZeRO-sharded AdamW state (the learning-rate schedules are in lr_schedule.py), and gradient clipping.

Division of labour. The backend owns the elementwise math (``Backend.adamw_update``, one fused pass over a
flat range); this module owns *which* ranges, with which hyperparameters and seeds, and the state that lives
between steps. All parameters sit in one flat buffer (``ParamLayout``): decayed tensors first, then the
non-decayed ones, so a ZeRO shard [start, end) is at most two ``adamw_update`` calls.

No function here forces a host sync: lr and step are Python numbers known in advance, norms and clip
factors stay 0-d device tensors until the trainer's one sync per step.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Sequence

import torch

from llmq_ray.backends import fp8_moment
from llmq_ray.errors import CheckpointError
from llmq_ray.engine.offload import StagedChunks, fixed_chunks, host_zeros
from llmq_ray.lr_schedule import SCHEDULES, learning_rate_at  # noqa: F401 - re-exported (schedules live there)
from llmq_ray.model.params import ParamLayout
# Elements per optimizer chunk (--opt-chunk-size): the unit of the offloaded state's trips through the GPU, and
# of the AdamW kernel calls and their rounding seeds (offloaded or not). 2^25 fp32 elements = 128 MiB a slot.
DEFAULT_CHUNK = 1 << 25


# ---------------------------------------------------------------------------------------------------- clipping
def global_grad_norm_squared(backend, grads: torch.Tensor | Iterable[torch.Tensor]) -> torch.Tensor:
    """sum(g^2) over one tensor or several, as a new fp32 0-d tensor on the grads' device (no host sync).

    Under ZeRO each rank passes its own gradient shard; the caller all-reduces (sums) the result across ranks
    and takes the square root: the true global L2 norm (never the squared norm as llm.q clips by).
    """
    tensors = [grads] if isinstance(grads, torch.Tensor) else list(grads)
    if not tensors:
        raise ValueError("global_grad_norm_squared: no gradient tensors given")
    out = torch.zeros((), dtype=torch.float32, device=tensors[0].device)
    for t in tensors:
        backend.global_norm_squared(out, t)
    return out


def clip_coefficient(norm: torch.Tensor, grad_clip: float) -> torch.Tensor:
    """The factor to multiply gradients by: fp32 0-d tensor on norm's device, computed without host sync.

    ``norm`` is the global L2 norm (not squared; 0-d). For a finite norm: grad_clip / norm when grad_clip > 0
    and norm > grad_clip (computed as an fp32 division), else exactly 1.0.

    Non-finite norm (inf or nan, any grad_clip): returns **nan**. Clipping an inf norm would give 0 and make
    the step silently a pure weight-decay step; returning nan instead means the coefficient alone tells the
    caller (``not torch.isfinite(coef)`` at its host sync) that the gradients overflowed, and folding it into
    ``grad_scale`` can never produce a finite-looking update. The caller should skip (or abort) that step.
    """
    norm32 = norm.to(torch.float32)
    one = torch.ones_like(norm32)
    if grad_clip > 0:
        clip = torch.full_like(norm32, float(grad_clip))
        coef = torch.where(norm32 > clip, clip / norm32, one)
    else:
        coef = one
    return torch.where(torch.isfinite(norm32), coef, torch.full_like(norm32, math.nan))


# ---------------------------------------------------------------------------------------------------- AdamW
def _step_seed(seed: int, step: int, run_start: int) -> int:
    """Seed of one adamw_update call: a pure function of (optimizer seed, step, global start of the run).

    Being keyed by the *global* flat offset (not the rank) keeps it reproducible on resume; it is the same on
    every rank that updates the same range."""
    digest = hashlib.blake2b(f"adamw/{int(seed)}/{int(step)}/{int(run_start)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


_DTYPES = (torch.float32, torch.bfloat16)


class ShardedAdamW:
    """AdamW state for one ZeRO shard [start, end) of the flat parameter buffer, updated through a backend.

    Buffers (all 1-D, length n = end - start, on params' device):

    * ``m`` (m_dtype), ``v`` (v_dtype): Adam moments, zero-initialized; fp32 or bf16 (bf16 written with
      stochastic rounding by the backend). m may also be e4m3 (backends/fp8_moment.py): then ``m_scale``
      (fp32) holds its power-of-two scales, one per 256 elements of each chunk (``scale_at[j]``: where chunk
      j's scales start), and checkpoints carry m as its exact bf16 values (``state_tensors``), so they load
      on any world size and a resume on the same one is bit-identical.
    * any of master/m/v named in ``offload`` lives in host memory (pinned on CUDA) instead; ``step`` streams
      it through three chunk-sized device slots per tensor (``staging``), or, with ``zero_copy``, hands the
      host tensors to the kernel directly (CUDA with the triton backend: it reads pinned memory over PCIe).
      ``keep_resident`` keeps the offloaded state of the first chunks on the device (--opt-resident-gib).
    * ``master`` (master_dtype): a separate copy of params[start:end], only when master_dtype differs from the
      params' dtype (typically fp32 master for bf16 weights); otherwise None and the params themselves are
      the storage of record.

    ``params_flat`` is the flat parameter buffer this rank holds; ``params_offset`` is the global flat index
    of its element 0 (0 for a full buffer, as under ZeRO-1/2; ``start`` when a rank holds only its own
    shard). The optimizer writes params_flat[start - params_offset : end - params_offset] in place; the
    caller all-gathers the updated shards.

    ``step`` (1-based, the bias-correction exponent) is passed in by the caller rather than counted here, so
    that resuming from a checkpoint is just "load state, keep counting".
    """

    def __init__(self, backend, layout: ParamLayout, params_flat: torch.Tensor, start: int, end: int, *,
                 master_dtype: torch.dtype, m_dtype: torch.dtype, v_dtype: torch.dtype, beta1: float = 0.9,
                 beta2: float = 0.95, eps: float = 1e-8, weight_decay: float = 0.1, seed: int = 0,
                 params_offset: int = 0, chunk: int = DEFAULT_CHUNK, offload: Iterable[str] = (),
                 zero_copy: bool = False, grads_on_host: bool = False, schedule=None):
        # (the settings' rules, llmq_ray/settings/rules.py, say these to the user; here they are invariants)
        for name, dt in (("master weights", master_dtype), ("first moment", m_dtype), ("second moment", v_dtype)):
            if dt not in _DTYPES and not (name == "first moment" and dt == fp8_moment.DTYPE):
                raise ValueError(f"ShardedAdamW: the {name} must be fp32 or bf16, got {dt}")
        if m_dtype == fp8_moment.DTYPE and "m" in set(offload):
            raise ValueError("ShardedAdamW: the 8-bit first moment is not offloaded (it stays on the device)")
        if params_flat.dim() != 1:
            raise ValueError(f"ShardedAdamW: params_flat must be 1-D, got shape {tuple(params_flat.shape)}")
        if not (0 <= start <= end <= layout.numel):
            raise ValueError(f"ShardedAdamW: shard [{start}, {end}) is not inside the layout's [0, {layout.numel})")
        if not (params_offset <= start and end - params_offset <= params_flat.numel()):
            raise ValueError(f"ShardedAdamW: params_flat (offset {params_offset}, {params_flat.numel()} elements) "
                             f"does not hold the shard [{start}, {end})")
        if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0 and eps >= 0.0 and weight_decay >= 0.0):
            raise ValueError(f"AdamW hyperparameters out of range: beta1={beta1}, beta2={beta2}, eps={eps}, "
                              f"weight_decay={weight_decay} (need 0 <= beta < 1, eps >= 0, weight decay >= 0).")
        self.backend = backend
        self.layout = layout
        self.start, self.end = start, end
        self.beta1, self.beta2, self.eps, self.weight_decay = beta1, beta2, eps, weight_decay
        self.seed = seed
        offload = set(offload)
        if offload - {"master", "m", "v"}:
            raise ValueError(f"ShardedAdamW: offload names must be master, m or v, got {sorted(offload)}")
        if chunk < 1:
            raise ValueError(f"ShardedAdamW: chunks of {chunk} elements; must be >= 1")
        self.params = params_flat[start - params_offset:end - params_offset]  # view: updated in place
        n = end - start
        device = params_flat.device
        self.device = device
        self.chunk = int(chunk)
        self.zero_copy = bool(zero_copy)

        def state(name: str, dtype: torch.dtype) -> torch.Tensor:
            if name in offload:
                return host_zeros(n, dtype, device)
            return torch.zeros(n, dtype=dtype, device=device)

        self.master = None
        if master_dtype != params_flat.dtype:
            self.master = state("master", master_dtype)
            for lo, hi in fixed_chunks(0, n, self.chunk):  # chunk by chunk: no full-size device temporary
                self.master[lo:hi].copy_(self.params[lo:hi])
        self.m = state("m", m_dtype)
        self.v = state("v", v_dtype)
        self.offloaded = {k for k in ("master", "m", "v") if k in offload and getattr(self, k) is not None}
        if self.master is None and "master" in offload:
            raise ValueError("ShardedAdamW: offloading the master weights needs a master copy (a master dtype "
                             "other than the weights')")
        # [(global lo, global hi, decay)]: the decay runs cut at global multiples of ``chunk``. Every kernel
        # call (and every stochastic-rounding seed) is per chunk, offloaded or not, so both give the same bits.
        self.runs = layout.decay_runs(start, end)
        self.chunks = [(lo, hi, decay) for rs, re_, decay in self.runs for lo, hi in fixed_chunks(rs, re_, self.chunk)]
        self.m_scale, self.scale_at = None, []
        if m_dtype == fp8_moment.DTYPE:  # one power-of-two scale per 256 elements of each chunk (kernel call)
            blocks = [fp8_moment.num_blocks(hi - lo) for lo, hi, _ in self.chunks]
            self.scale_at = [sum(blocks[:j]) for j in range(len(blocks))]
            self.m_scale = torch.ones(sum(blocks), dtype=torch.float32, device=device)
        self._m_values = None  # host buffer of m's bf16 values for checkpoints (e4m3 m only; state_tensors)
        self.grads_on_host = bool(grads_on_host)
        streamed = {k: getattr(self, k).dtype for k in self.offloaded}
        if self.grads_on_host:
            streamed["grad"] = params_flat.dtype
        self.staging = None
        self._update_done = None  # event: the update queued on a side stream (step(stream=...)) is done
        if streamed and not self.zero_copy and n > 0:
            self.staging = StagedChunks(device, streamed, min(self.chunk, n), schedule, "optimizer")
        # --opt-resident-gib (keep_resident): chunk index -> offset into the device buffers that hold those
        # chunks' offloaded state during training; state_tensors() copies them back to the host tensors.
        self.resident_at: dict[int, int] = {}
        self.resident: dict[str, torch.Tensor] = {}
        self._kept_order: list[int] = []

    ALIGN = 128  # elements: kept chunks start at multiples of this in their device buffer (vectorized loads)

    @property
    def numel(self) -> int:
        return self.end - self.start

    def keep_resident(self, order: Sequence[int], budget_bytes: int) -> int:
        """Keep the offloaded state (master/m/v named in ``offload``) of the first chunks of ``order`` on the
        device, as many as fit in ``budget_bytes`` (--opt-resident-gib); returns the bytes kept.

        Why: streaming the state costs one PCIe round trip per update (~0.65 s for a 7B model's bf16 m and v on
        an H100); chunks kept on the device skip it. The chunks updated first are the ones kept, so with the
        update overlapped with the next forward (update_overlap.py) the first layers are ready at once while
        the rest still streams. Results are bit-identical: the same kernel runs on the same chunk with the
        same seed, only reading device memory. The host tensors stay the storage of record for checkpoints:
        ``state_tensors`` copies the kept chunks back first, ``load_state_tensors`` refreshes them.
        Not with ``grads_on_host`` or ``zero_copy`` (their chunks stream through the device anyway)."""
        if self.grads_on_host or self.zero_copy:
            raise ValueError("ShardedAdamW: resident chunks do not combine with host gradients or zero-copy")
        self._check_order(order, "keep_resident")
        self.sync()
        self.resident_at, self.resident, self._kept_order = {}, {}, []
        if not self.offloaded or budget_bytes <= 0:
            return 0
        per_element = sum(getattr(self, k).element_size() for k in self.offloaded)
        offset, kept = 0, {}
        for j in order:
            lo, hi, _ = self.chunks[j]
            if (offset + hi - lo) * per_element > budget_bytes:
                break  # a prefix of the order: the first chunks the update (and the forward after it) needs
            kept[j] = offset
            offset += -(-(hi - lo) // self.ALIGN) * self.ALIGN  # every kept chunk starts aligned
        if not kept:
            return 0
        self.resident = {k: torch.zeros(offset, dtype=getattr(self, k).dtype, device=self.device)
                         for k in sorted(self.offloaded)}
        self.resident_at = kept
        self._kept_order = list(kept)  # step() must start with these chunks, in this order (see _run)
        for k, buf in self.resident.items():
            host = getattr(self, k)
            for j, off in kept.items():
                lo, hi = self.chunks[j][0] - self.start, self.chunks[j][1] - self.start
                buf[off:off + hi - lo].copy_(host[lo:hi])
        return offset * per_element

    def _check_order(self, order: Sequence[int], who: str) -> None:
        if sorted(order) != list(range(len(self.chunks))):
            raise ValueError(f"{who}: order must be a permutation of the {len(self.chunks)} chunks")

    def _resident_views(self, j: int) -> dict[str, torch.Tensor]:
        """The device views [chunk length] of chunk j's kept state (keep_resident), by name."""
        lo, hi, _ = self.chunks[j]
        off = self.resident_at[j]
        return {k: buf[off:off + hi - lo] for k, buf in self.resident.items()}

    def _copy_resident(self, to_host: bool) -> None:
        """Copy the kept chunks' state device -> host (``to_host``) or host -> device; blocking."""
        for j in self.resident_at:
            lo, hi = self.chunks[j][0] - self.start, self.chunks[j][1] - self.start
            for k, view in self._resident_views(j).items():
                host = getattr(self, k)[lo:hi]
                host.copy_(view) if to_host else view.copy_(host)

    def step(self, grads_shard: torch.Tensor, *, lr: float, step: int, grad_scale: torch.Tensor | float,
             order: Sequence[int] | None = None, after_chunk: Callable[[int], None] | None = None,
             stream: "torch.cuda.Stream | None" = None) -> None:
        """Apply one update with the gradients of this shard.

        grads_shard: [end - start] (model or fp32 dtype), the reduced gradient of exactly this shard, not yet
        scaled. grad_scale (float or 0-d fp32 device tensor) multiplies it inside the kernel: typically
        1/num_target_tokens times the clip coefficient. step: 1-based update count. One backend call per chunk
        (``self.chunks``): weight_decay on embeddings/matrices, 0 on norms/biases. Seeds depend on (seed, step,
        global chunk start) only, so a resumed run draws the same rounding bits as the uninterrupted one, and
        an offloaded state the same bits as a resident one. With offloaded state the chunks stream through the
        device, pipelined (llmq_ray/engine/offload.py); ``grads_shard`` may itself be a host tensor
        (``grads_on_host``, --offload-gradients).

        ``order``: the chunks (indices into ``self.chunks``) in the order to update them (default: as laid
        out); any order gives the same bits, as chunks are independent. ``after_chunk(j)`` runs on the host
        right after chunk j's kernel is queued. ``stream``: queue the whole update on this CUDA stream (after
        the work queued so far on the current one) and return; ``join()`` / ``sync()`` wait for it.
        """
        if grads_shard.dim() != 1 or grads_shard.numel() != self.numel:
            raise ValueError(f"ShardedAdamW.step: grads_shard has shape {tuple(grads_shard.shape)}, "
                             f"expected [{self.numel}] for shard [{self.start}, {self.end})")
        host = {k: getattr(self, k) for k in self.offloaded}
        if self.grads_on_host:
            host["grad"] = grads_shard
        store = {k: host[k] for k in self.offloaded}
        hyper = dict(lr=lr, beta1=self.beta1, beta2=self.beta2, eps=self.eps, step=step, grad_scale=grad_scale)

        order = list(range(len(self.chunks))) if order is None else list(order)
        self._check_order(order, "ShardedAdamW.step")

        def update(i: int, staged: dict[str, torch.Tensor]) -> None:
            j = order[i]
            g_lo, g_hi, decay = self.chunks[j]
            lo, hi = g_lo - self.start, g_hi - self.start
            part = {k: staged[k] if k in staged else t[lo:hi] for k, t in (
                ("grad", grads_shard), ("m", self.m), ("v", self.v), ("master", self.master)) if t is not None}
            extra = {"m_scale": self._chunk_scales(j)} if self.m_scale is not None else {}
            self.backend.adamw_update(self.params[lo:hi], part["grad"], part["m"], part["v"],
                                      master=part.get("master"), weight_decay=self.weight_decay if decay else 0.0,
                                      seed=_step_seed(self.seed, step, g_lo), **hyper, **extra)
            if after_chunk is not None:
                after_chunk(j)

        if stream is None:
            self._run(host, store, update, order)
            return
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream):
            self._run(host, store, update, order)
            self._update_done = stream.record_event()

    def _chunk_scales(self, j: int) -> torch.Tensor:
        """The block scales of chunk j's e4m3 m (a view of ``m_scale``)."""
        lo, hi, _ = self.chunks[j]
        return self.m_scale[self.scale_at[j]:self.scale_at[j] + fp8_moment.num_blocks(hi - lo)]

    def join(self) -> None:
        """Order the current stream after an update queued on a side stream (``step(stream=...)``)."""
        if self._update_done is not None:  # kept: sync() still waits on it from the host
            torch.cuda.current_stream(self.device).wait_event(self._update_done)

    def _run(self, host: dict[str, torch.Tensor], store: dict[str, torch.Tensor], fn,
             order: Sequence[int] | None = None) -> None:
        """Call ``fn(i, staged)`` for i = 0 .. chunks-1, the i-th chunk being ``self.chunks[order[i]]``:
        through the staging slots when some state is on the host (``staged`` holds the device copies of
        ``host``'s chunk, ``store``'s written back), directly on the tensors otherwise (also with
        --use-zero-copy, where the kernel reads the pinned host memory)."""
        order = range(len(self.chunks)) if order is None else order
        if self.staging is None or not host:
            for i in range(len(self.chunks)):
                fn(i, {})
            return
        if self.resident_at and list(order[:len(self._kept_order)]) != self._kept_order:
            # kept chunks run before the streamed ones: only right (for after_chunk's per-unit readiness) when
            # they are the order's first chunks, as keep_resident chose them
            raise ValueError("ShardedAdamW: the update order must begin with the chunks keep_resident kept")
        streamed = []  # positions in ``order`` whose chunk streams; kept chunks (keep_resident) run first
        for i, j in enumerate(order):
            if j in self.resident_at:
                fn(i, self._resident_views(j))
            else:
                streamed.append(i)
        if streamed:
            ranges = [(self.chunks[order[i]][0] - self.start, self.chunks[order[i]][1] - self.start) for i in streamed]
            self.staging.run(ranges, host, store, lambda s, staged: fn(streamed[s], staged))

    def grad_norm_squared(self, grads_shard: torch.Tensor) -> torch.Tensor:
        """sum(g^2) over this shard's gradient [end - start] as a new fp32 0-d device tensor, one backend call
        per optimizer chunk (so a host-resident gradient, streamed, gives the same bits as a resident one)."""
        out = torch.zeros((), dtype=torch.float32, device=self.device)
        host = {"grad": grads_shard} if self.grads_on_host else {}

        def norm(i: int, staged: dict[str, torch.Tensor]) -> None:
            lo, hi = self.chunks[i][0] - self.start, self.chunks[i][1] - self.start
            self.backend.global_norm_squared(out, staged["grad"] if staged else grads_shard[lo:hi])

        self._run(host, {}, norm)
        return out

    def sync(self) -> None:
        """Wait until the updates and copies queued so far are done, so host code may read or write the host
        tensors. Chunks kept on the device (keep_resident) are current only there: read the state through
        ``state_tensors()``, write it through ``load_state_tensors()``."""
        if self._update_done is not None:
            self._update_done.synchronize()
        if self.staging is not None:
            self.staging.sync()
        elif self.offloaded and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # zero-copy kernels write host memory

    # ------------------------------------------------------------------ checkpoints
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The live state of this shard, for a checkpoint: {"master", "m", "v"}, each 1-D [end - start].

        "master" is always the storage of record of the weights: the separate master copy when there is one,
        else a view of params[start:end]. These are the optimizer's own buffers (no copies, the kept chunks
        copied back into them first): write them out before the next step; to change the state use
        ``load_state_tensors``.
        """
        self.sync()
        self._copy_resident(to_host=True)
        state = self._storage()
        if self.m_scale is not None:
            state["m"] = self._m_bf16_values()
        return state

    def _storage(self) -> dict[str, torch.Tensor]:
        return {"master": self.master if self.master is not None else self.params, "m": self.m, "v": self.v}

    def _m_bf16_values(self) -> torch.Tensor:
        """An e4m3 m as its exact bf16 values [n], chunk by chunk into a host buffer kept for the next call
        (page-locked on CUDA): no device temporary beyond one chunk, which at 7B matters (bf16 m: 15 GB)."""
        if self._m_values is None:
            pin = self.device.type == "cuda"
            self._m_values = torch.empty(self.numel, dtype=torch.bfloat16, pin_memory=pin)
        for j, (g_lo, g_hi, _) in enumerate(self.chunks):
            lo, hi = g_lo - self.start, g_hi - self.start
            values = fp8_moment.dequantize(self.m[lo:hi], self._chunk_scales(j)).to(torch.bfloat16)
            self._m_values[lo:hi].copy_(values, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return self._m_values

    def load_state_tensors(self, state: dict[str, torch.Tensor]) -> None:
        """Copy a checkpoint's {"master", "m", "v"} of this same shard range into the state (and the params).

        Tensors may come from any device; a different fp32/bf16 dtype is converted (round to nearest). With a
        separate master the params are refreshed from it, so the forward sees the restored weights.
        """
        missing = {"master", "m", "v"} - set(state)
        if missing:
            raise CheckpointError(f"optimizer state of shard [{self.start}, {self.end}) lacks {sorted(missing)}")
        self.sync()
        for name, dest in self._storage().items():
            src = state[name]
            if src.numel() != dest.numel():
                raise CheckpointError(f"optimizer state {name!r} has {src.numel()} elements, the shard "
                                      f"[{self.start}, {self.end}) needs {dest.numel()} (another model or world size?)")
            if name == "m" and self.m_scale is not None:
                self._load_e4m3_m(src.reshape(-1))
            else:
                dest.copy_(src.reshape(-1))
        self._copy_resident(to_host=False)
        if self.master is not None:
            for lo, hi in fixed_chunks(0, self.numel, self.chunk):
                self.params[lo:hi].copy_(self.master[lo:hi])

    def _load_e4m3_m(self, values: torch.Tensor) -> None:
        """Quantize a checkpoint's m values into the e4m3 m and its scales, chunk by chunk: the same numbers
        when they were saved from this layout (``fp8_moment.requantize``), rounded to nearest otherwise."""
        for j, (g_lo, g_hi, _) in enumerate(self.chunks):
            lo, hi = g_lo - self.start, g_hi - self.start
            q, scale, _ = fp8_moment.requantize(values[lo:hi].to(self.device))
            self.m[lo:hi].copy_(q)
            self._chunk_scales(j).copy_(scale)

    def memory_bytes(self) -> int:
        """Bytes of optimizer-owned state on the device: m, v and the separate master (if any) unless offloaded,
        the part of the offloaded ones kept on the device (keep_resident), plus the staging slots."""
        tensors = [getattr(self, k) for k in ("master", "m", "v") if k not in self.offloaded]
        tensors += list(self.resident.values()) + [self.m_scale]
        staging = self.staging.nbytes() if self.staging is not None else 0
        return sum(t.numel() * t.element_size() for t in tensors if t is not None) + staging

    def host_tensors(self) -> list[torch.Tensor]:
        """The state kept in host memory (--offload-master/--offload-opt-m/--offload-opt-v)."""
        return [getattr(self, k) for k in sorted(self.offloaded)]
