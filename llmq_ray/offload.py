"""Host offloading: state kept in (pinned) host memory and streamed through small device buffers.

Why: a 7B model's fp32 master weights and Adam moments (~90 GB in fp32) do not fit next to its bf16 weights,
gradients and activations on one 80 GB GPU, but they are touched only once per optimizer step. Keeping them
in host memory costs one trip over PCIe per step; doing that trip in chunks, double-buffered, lets the copy
of chunk i+1 run on a side stream while the kernel works on chunk i, so only two chunk-sized device buffers
per streamed tensor ever exist.

Host memory is **pinned** (page-locked) when the device is CUDA: only pinned memory can be copied
asynchronously, and a kernel can read it directly over PCIe (``--use-zero-copy``). When the device is the
CPU (tests, CI) "host" memory is ordinary memory and every copy is synchronous, so the same code path, chunk
boundaries and staging buffers run in CPU tests; results are bit-identical to keeping the state resident
because the same kernels see the same values in the same chunks.

Streams on CUDA (``StagedChunks.run``)::

    side stream:  H2D(0) H2D(1) | wait C(0) D2H(0) H2D(2) | wait C(1) D2H(1) H2D(3) | ...
    main stream:  wait H2D(0) C(0) | wait H2D(1) C(1) | wait H2D(2) C(2) | ...

Chunk i and i+2 share staging slot i % 2; H2D(i+2) is queued on the side stream after D2H(i), so a slot is
never overwritten while in use. At the end the main stream waits for the side stream (later work may reuse
what the last chunks read), and ``StagedChunks.sync()`` lets host code wait before it reads the host copies
(checkpoints).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch


def host_zeros(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled 1-D host tensor [numel] that ``device`` can stream from: pinned for CUDA, plain for CPU."""
    pin = torch.device(device).type == "cuda"
    return torch.zeros(numel, dtype=dtype, device="cpu", pin_memory=pin)


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
    """Two device staging slots per named stream, and the double-buffered loop over chunks.

    ``specs``: {name: dtype} of the tensors that may be streamed; ``chunk``: elements per slot. Slots are
    allocated once (2 x chunk x itemsize per name) on ``device``.
    """

    def __init__(self, device: torch.device, specs: Mapping[str, torch.dtype], chunk: int):
        self.device = torch.device(device)
        self.chunk = int(chunk)
        self.slots = {name: [torch.empty(self.chunk, dtype=dt, device=self.device) for _ in range(2)]
                      for name, dt in specs.items()}
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._done: torch.cuda.Event | None = None

    def run(self, ranges: Sequence[tuple[int, int]], load: Mapping[str, torch.Tensor],
            store: Mapping[str, torch.Tensor], compute: Callable[[int, dict[str, torch.Tensor]], None]) -> None:
        """For each (lo, hi) in ``ranges`` (at most ``chunk`` long, indices into the host tensors):

        1. copy ``load[name][lo:hi]`` into a staging slot (H2D, side stream);
        2. ``compute(i, staged)`` on the current stream, where ``staged`` maps every name of ``load`` and
           ``store`` to its device view [hi - lo] (a name only in ``store`` starts with undefined contents);
        3. copy ``staged[name]`` back into ``store[name][lo:hi]`` (D2H, side stream) for every name in ``store``.

        A name may be in both (read-modify-write). Host tensors are 1-D."""
        names = list(dict.fromkeys([*load, *store]))
        cuda, side = self.cuda, self.stream
        main = torch.cuda.current_stream(self.device) if cuda else None
        n = len(ranges)

        def stage(i: int):
            lo, hi = ranges[i]
            views = {k: self.slots[k][i % 2][:hi - lo] for k in names}
            if not cuda:
                for k, src in load.items():
                    views[k].copy_(src[lo:hi])
                return views, None
            with torch.cuda.stream(side):
                for k, src in load.items():
                    views[k].copy_(src[lo:hi], non_blocking=True)
                return views, side.record_event()

        if cuda:
            side.wait_stream(main)  # host data written through another stream (ordered into main) is complete
        staged = [stage(i) for i in range(min(2, n))]
        for i in range(n):
            views, ready = staged[i]
            if ready is not None:
                main.wait_event(ready)
            compute(i, views)
            lo, hi = ranges[i]
            if cuda:
                side.wait_event(main.record_event())
                with torch.cuda.stream(side):
                    for k, dst in store.items():
                        dst[lo:hi].copy_(views[k], non_blocking=True)
            else:
                for k, dst in store.items():
                    dst[lo:hi].copy_(views[k])
            if i + 2 < n:
                staged.append(stage(i + 2))  # same slot as chunk i: queued after its write-back
        if cuda:
            main.wait_stream(side)
            self._done = side.record_event()

    def sync(self) -> None:
        """Block the host until every copy of the last ``run`` has landed (before host code reads them)."""
        if self._done is not None:
            self._done.synchronize()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.slots.values() for t in pair)
