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
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from llmq_ray.engine.schedule import Schedule
from llmq_ray.host_memory import host_zeros  # noqa: F401 - re-exported (engine, optim)


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
