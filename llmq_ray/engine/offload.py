"""Host offloading: state kept in (pinned) host memory and streamed through small device buffers.

Why: a 7B model's fp32 master weights and Adam moments (~90 GB in fp32) do not fit next to its bf16 weights,
gradients and activations on one 80 GB GPU, but they are touched only once per optimizer step. Keeping them
in host memory costs one trip over PCIe per step; doing that trip in chunks, pipelined, lets the upload of
one chunk and the download of another run on side streams while the kernel works on a third, so only three
chunk-sized device buffers per streamed tensor ever exist.

Host memory is **pinned** (page-locked) when the device is CUDA: only pinned memory can be copied
asynchronously, and a kernel can read it directly over PCIe (``--use-zero-copy``). When the device is the
CPU (tests, CI) "host" memory is ordinary memory and every copy is synchronous, so the same code path, chunk
boundaries and staging buffers run in CPU tests; results are bit-identical to keeping the state resident
because the same kernels see the same values in the same chunks.

Streams on CUDA (``StagedChunks.run``): three staging slots per name and two copy streams, one per PCIe
direction, so that the upload of chunk i+2, the kernel on chunk i+1 and the download of chunk i all run at
once (a GPU has a copy engine for each direction; with one copy stream the two directions took turns and a
7B update moved its 60 GB at half the link's duplex rate)::

    upload stream:    H2D(0) H2D(1) H2D(2) | wait D2H(0) H2D(3) | wait D2H(1) H2D(4) | ...
    main stream:      wait H2D(0) C(0) | wait H2D(1) C(1) | wait H2D(2) C(2) | ...
    download stream:  wait C(0) D2H(0) | wait C(1) D2H(1) | wait C(2) D2H(2) | ...

Chunk i and i+3 share slot i % 3; H2D(i+3) waits for D2H(i) (or, for a name that is only loaded, for C(i)), so
a slot is never overwritten while in use. At the end the main stream waits for both copy streams (later work
may reuse what the last chunks read), and ``StagedChunks.sync()`` lets host code wait before it reads the host
copies (checkpoints).

The same idea for two of the model's buffers, handed to it as policies (``ModelPolicies``, llmq_ray/model/build.py):
``OffloadedResiduals`` keeps the saved residual stream in host memory and ``HostWeightCopies`` the persistent FP8
weight copies, each streamed through two device slots one layer ahead of the unit loop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from llmq_ray.engine.schedule import Schedule
from llmq_ray.host_memory import host_zeros
from llmq_ray.model.layers.linear import BlockLinears
from llmq_ray.model.layers.units import EMBED, Policy


def is_host(t: torch.Tensor | None, device: torch.device) -> bool:
    """True when ``t`` lives in host memory while the compute device is a GPU (a CPU engine has no "host")."""
    return t is not None and torch.device(device).type == "cuda" and t.device.type == "cpu"


def fixed_chunks(start: int, end: int, chunk: int) -> list[tuple[int, int]]:
    """Split the global range [start, end) at the multiples of ``chunk``: [(lo, hi)], in order.

    Boundaries depend only on global offsets, so two ranks (or two runs with and without offloading) that
    cover the same elements cut them identically; a range inside one chunk is returned whole."""
    out = []
    lo = start
    while lo < end:
        hi = min(end, (lo // chunk + 1) * chunk)
        out.append((lo, hi))
        lo = hi
    return out


class StagedChunks:
    """Staging slots per named stream and the pipelined loop over chunks.

    ``specs``: {name: dtype} of the tensors that may be streamed; ``chunk``: elements per slot. Slots are
    allocated once (SLOTS x chunk x itemsize per name) on ``device``.
    """

    SLOTS = 3  # upload, compute and download each own one slot at a time

    def __init__(self, device: torch.device, specs: Mapping[str, torch.dtype], chunk: int, schedule=None,
                 name: str = "staging"):
        self.device = torch.device(device)
        self.chunk = int(chunk)
        self.slots = {name: [torch.empty(self.chunk, dtype=dt, device=self.device) for _ in range(self.SLOTS)]
                      for name, dt in specs.items()}
        self.cuda = self.device.type == "cuda"
        # the schedule's ``<name>-upload`` / ``<name>-download`` streams (llmq_ray/engine/schedule.py)
        schedule = schedule if schedule is not None else Schedule(self.device)
        self.upload = schedule.stream(f"{name}-upload")
        self.download = schedule.stream(f"{name}-download")
        self._done: torch.cuda.Event | None = None

    def run(self, ranges: Sequence[tuple[int, int]], load: Mapping[str, torch.Tensor],
            store: Mapping[str, torch.Tensor], compute: Callable[[int, dict[str, torch.Tensor]], None]) -> None:
        """For each (lo, hi) in ``ranges`` (at most ``chunk`` long, indices into the host tensors):

        1. copy ``load[name][lo:hi]`` into a staging slot (H2D, upload stream);
        2. ``compute(i, staged)`` on the current stream, where ``staged`` maps every name of ``load`` and
           ``store`` to its device view [hi - lo] (a name only in ``store`` starts with undefined contents);
        3. copy ``staged[name]`` back into ``store[name][lo:hi]`` (D2H, download stream) for every name in
           ``store``.

        A name may be in both (read-modify-write). Host tensors are 1-D. On the CPU every copy is synchronous
        and the same slots and chunk boundaries are used."""
        names = list(dict.fromkeys([*load, *store]))
        nslots = self.SLOTS
        n = len(ranges)
        if not self.cuda:
            for i, (lo, hi) in enumerate(ranges):
                views = {k: self.slots[k][i % nslots][:hi - lo] for k in names}
                for k, src in load.items():
                    views[k].copy_(src[lo:hi])
                compute(i, views)
                for k, dst in store.items():
                    dst[lo:hi].copy_(views[k])
            return
        up, down = self.upload, self.download
        main = torch.cuda.current_stream(self.device)
        # host data written through another stream (ordered into main) is complete before it is read or overwritten
        up.wait_stream(main)
        down.wait_stream(main)
        freed: list = [None] * n  # event: chunk i's slot may be refilled (its download, or its compute, is done)

        def stage(i: int):
            lo, hi = ranges[i]
            views = {k: self.slots[k][i % nslots][:hi - lo] for k in names}
            if i >= nslots:
                up.wait_event(freed[i - nslots])
            with torch.cuda.stream(up):
                for k, src in load.items():
                    views[k].copy_(src[lo:hi], non_blocking=True)
                return views, up.record_event()

        staged = [stage(i) for i in range(min(nslots, n))]
        for i in range(n):
            views, ready = staged[i]
            main.wait_event(ready)
            compute(i, views)
            lo, hi = ranges[i]
            computed = main.record_event()
            if store:
                down.wait_event(computed)
                with torch.cuda.stream(down):
                    for k, dst in store.items():
                        dst[lo:hi].copy_(views[k], non_blocking=True)
                    freed[i] = down.record_event()
            else:
                freed[i] = computed
            if i + nslots < n:
                staged.append(stage(i + nslots))  # same slot as chunk i: queued behind its download
            staged[i] = None
        main.wait_stream(up)
        main.wait_stream(down)
        down.wait_stream(up)  # sync() also covers uploads still reading host memory (load-only runs)
        self._done = down.record_event()

    def sync(self) -> None:
        """Block the host until every copy of the last ``run`` has landed (before host code reads them)."""
        if self._done is not None:
            self._done.synchronize()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for slots in self.slots.values() for t in slots)


class OffloadedResiduals(Policy):
    """The residual stream x_0 .. x_L [R, C] (model dtype; R = N, or this rank's token rows under sequence
    parallelism) that the forward saves for the backward, ``res[l]``, kept in host memory: the model's residual
    store (``ModelPolicies.residuals``; llmq_ray/model/buffers.py's ``ResidentResiduals`` is the device one).

    x_0 .. x_{L-1} live in host memory (pinned on CUDA), the device holds two slots (x_l in slot l % 2) and the
    final x_L. The model announces
    each block with ``forward_layer(l)`` / ``backward_layer(l)``, and this class moves the data one layer
    ahead on a side stream:

    * forward, block l: x_l (already in its slot) starts copying to the host; x_{l+1} will be written into
      the other slot, once x_{l-1}'s copy out of it (started one block earlier) has finished;
    * backward, block l: x_l must be in its slot (the forward left x_{L-1} and x_{L-2} there; older ones were
      fetched one block ahead); x_{l-1} starts copying in, into the slot block l+1 just finished with.

    Indexing a layer that is not on the device raises (a scheduling bug must not read stale data). On a CPU
    device the copies are synchronous and the same slots are used, so CPU tests check the bookkeeping.
    """

    def __init__(self, num_layers: int, rows: int, hidden: int, dtype: torch.dtype, device: torch.device,
                 stream=None):
        self.num_layers = num_layers
        empty = lambda: torch.empty(rows, hidden, dtype=dtype, device=device)  # noqa: E731
        self.host = [host_zeros(rows * hidden, dtype, device).view(rows, hidden) for _ in range(num_layers)]
        self.slots = [empty(), empty()]
        self.final = empty()
        self.holder: list[int | None] = [None, None]   # which x_l each slot holds
        self.stream = stream                            # the schedule's side stream; None: copy in order
        self.cuda = stream is not None
        self.copied_out: list = [None, None]            # event: the slot's x_l has reached the host
        self.copied_in: list = [None, None]             # event: the slot's x_l has arrived from the host
        nbytes = rows * hidden * dtype.itemsize
        # two device slots + the final residual; x_0..x_{L-1} on the host
        self.per_layer_bytes, self.shared_bytes, self.host_bytes = 0, 3 * nbytes, num_layers * nbytes

    def __iter__(self):
        """The device buffers: the two slots and the final one."""
        return iter([*self.slots, self.final])

    def host_tensors(self) -> list[torch.Tensor]:
        return self.host

    def __getitem__(self, layer: int) -> torch.Tensor:
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
        """The unit policy (llmq_ray/model/layers/units.py): a new forward at the embedding, then one layer at a time."""
        if unit == EMBED and not backward:
            self.begin_forward()
        elif isinstance(unit, int):
            (self.backward_layer if backward else self.forward_layer)(unit)

    def begin_forward(self) -> None:
        """Before the embedding writes x_0 into slot 0: earlier copies are finished, the slots are free."""
        if self.cuda:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
        self.holder = [0, None]
        self.copied_out = [None, None]
        self.copied_in = [None, None]

    def forward_layer(self, layer: int) -> None:
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


class HostWeightCopies(BlockLinears):
    """The block GEMMs with their persistent FP8 weight copies kept in (pinned) host memory (``quants="host"``,
    llmq_ray/model/layers/linear.py): two device slots hold layer l in slot l % 2, fetched one layer ahead on
    the side stream ``stream`` (like the offloaded residuals). A layer's first use in a step quantizes into its
    slot and copies the result out to the host; later uses fetch it back. The engine hands it to the model as
    ``ModelPolicies.block_linears`` (``functools.partial(HostWeightCopies, stream=...)``)."""

    QUANTS = ("host",)

    def __init__(self, *args, stream=None, **kw):
        kw["quants"] = "host"
        super().__init__(*args, **kw)
        self.stream = stream  # the schedule's side stream for the copies (None: copy in order)
        self.cuda = stream is not None
        self.copied_out: list = [None, None]  # event: the slot's fresh copies have reached the host
        self.copied_in: list = [None, None]   # event: the slot's copies have arrived from the host

    def _new_copy(self, rows: int, cols: int) -> torch.Tensor:
        return host_zeros(rows * cols, self.fwd_dtype, self.be.device).view(rows, cols)

    def host_tensors(self) -> list[torch.Tensor]:
        return [*self.w_q.values(), *self.wt_q.values()] if self.fp8 else []

    def device_copies(self) -> list[torch.Tensor]:
        return []

    def begin_layer(self, layer: int, backward: bool = False) -> None:
        """Make ``layer``'s copies available in its slot and start fetching the next layer's (layer+1, or
        layer-1 in the backward)."""
        if not self.fp8:
            return
        slot = layer % 2
        if self.slot_holder[slot] != layer:
            if self.valid[layer]:
                self._fetch(layer)  # not prefetched: the first layer of a pass
            else:
                self._claim(slot)
                self._quantize_layer(layer, slot)
                self.slot_holder[slot] = layer
                self._copy_out(layer)
        if self.copied_in[slot] is not None:
            torch.cuda.current_stream(self.stream.device).wait_event(self.copied_in[slot])
            self.copied_in[slot] = None
        nxt = layer - 1 if backward else layer + 1
        if 0 <= nxt < self.num_layers and self.valid[nxt] and self.slot_holder[nxt % 2] != nxt:
            self._fetch(nxt)

    def _copies(self, key: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        layer, name = self.layer_of[key]
        slot = layer % 2
        if self.slot_holder[slot] != layer:
            raise RuntimeError(f"FP8 copies of layer {layer} are not on the device "
                               f"(slot {slot} holds {self.slot_holder[slot]})")
        w_q, wt_q = self.slots[slot][name]
        return w_q, wt_q, self.w_descale[key]

    def _claim(self, slot: int) -> None:
        """Before the compute stream overwrites device slot ``slot``: copies into or out of it have finished."""
        for events in (self.copied_in, self.copied_out):
            if events[slot] is not None:
                torch.cuda.current_stream(self.stream.device).wait_event(events[slot])
                events[slot] = None

    def _copy_out(self, layer: int) -> None:
        """quants="host": slot layer % 2 was just quantized; copy it to the layer's host copies (side stream)."""
        slot = layer % 2
        pairs = [(self.w_q[self.key_of[layer, n]], self.slots[slot][n][0]) for n in self.names]
        pairs += [(self.wt_q[self.key_of[layer, n]], self.slots[slot][n][1]) for n in self.names]
        self.copied_out[slot] = self._copy_pairs(pairs)
        self.valid[layer] = True

    def _copy_pairs(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]):
        """dst.copy_(src) for every pair: on CUDA on the side stream, after all work queued so far on the
        current stream, returning the event that marks the copies done (None on CPU, where they are done)."""
        if not self.cuda:
            for dst, src in pairs:
                dst.copy_(src)
            return None
        side = self.stream
        side.wait_stream(torch.cuda.current_stream(side.device))
        with torch.cuda.stream(side):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            return side.record_event()

    def _fetch(self, layer: int) -> None:
        """quants="host": start copying ``layer``'s host copies into slot layer % 2 (side stream, after every
        GEMM queued so far, which may still read the slot's previous layer)."""
        slot = layer % 2
        pairs = [(self.slots[slot][n][0], self.w_q[self.key_of[layer, n]]) for n in self.names]
        pairs += [(self.slots[slot][n][1], self.wt_q[self.key_of[layer, n]]) for n in self.names]
        self.copied_in[slot] = self._copy_pairs(pairs)
        self.slot_holder[slot] = layer
