"""The memory table printed at start: what one worker's ``TrainEngine`` has actually allocated, by role.

Rows come from the tensors themselves (their storages' byte sizes), not from size formulas, so the table
adds up to what is allocated: every tensor reachable from the engine on its device is counted exactly once
(views of a buffer -- the per-parameter weight views, the optimizer's shard view of the weights, the ZeRO-1
gradient shard -- share their buffer's storage and are not counted again). Roles, in the order they claim
storages:

    weights       the flat parameter buffer (model dtype)
    master        the optimizer's separate master copy of this rank's shard (0 when the weights are it)
    adam_m/adam_v the AdamW moments of this rank's shard
    grads         ZeRO-1: the flat gradient buffer; ZeRO-2/3: the shard accumulator and the per-layer scratch
    activations   the saved forward activations (``model.acts``: per-layer and recomputed scratch buffers)
    fp8           FP8 copies of the block weights and FP8 operand scratch (``model.lin``; 0 without FP8;
                  with --fp8-smooth-swiglu also its factors and down-projection copy, ``model.smooth``), and
                  the FP8 LM head's (``model.head``, --lmhead-dtype e4m3)
    scratch       the model's other buffers: logits chunk, losses, final norm, backward buffers, RoPE tables...
    other         anything else reachable from the engine (e.g. backend workspaces); usually 0

With an ``--offload-*`` flag, the state it moves lives in host memory (pinned on CUDA): it leaves the
device rows above and appears in host rows instead (``host_master``, ``host_adam_m``, ``host_adam_v``,
``host_grads``, ``host_activations``, ``host_fp8``; listed only when something is offloaded), which are not
part of the device sum. The ``fp8`` row holds all layers' FP8 weight copies when they are persistent on the
device, two layers' slots when they are made per layer (ZeRO-3, --transient-quants) or fetched from the host (--offload-quants). The optimizer's and the gradient accumulator's pipelined staging slots stay on the device
(in ``other``).

On CUDA three device rows follow (not part of the tensor sum): ``cuda_allocated``
(``torch.cuda.memory_allocated``, everything torch's allocator handed out in this process), ``free`` and
``total`` (``torch.cuda.mem_get_info``: the whole device, other processes included).
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

TENSOR_ROWS = ("weights", "master", "adam_m", "adam_v", "grads", "activations", "fp8", "scratch", "other")
DEVICE_ROWS = ("cuda_allocated", "free", "total")
HOST_ROWS = ("host_master", "host_adam_m", "host_adam_v", "host_grads", "host_activations", "host_fp8")

LABELS = {"weights": "weights", "master": "master weights", "adam_m": "Adam m", "adam_v": "Adam v",
          "grads": "gradients", "activations": "activations", "fp8": "FP8 copies + scratch",
          "scratch": "other model scratch", "other": "other (backend, ...)",
          "cuda_allocated": "torch allocated (CUDA)", "free": "free on device", "total": "device total",
          "host_master": "host: master weights", "host_adam_m": "host: Adam m", "host_adam_v": "host: Adam v",
          "host_grads": "host: gradients", "host_activations": "host: activations",
          "host_fp8": "host: FP8 weight copies"}

_ATOMS = (str, bytes, int, float, bool, complex, type(None))


def iter_tensors(root, _seen: set | None = None) -> Iterator[torch.Tensor]:
    """Every ``torch.Tensor`` reachable from ``root`` through object attributes (``__dict__`` and
    ``__slots__``), lists, tuples, sets and dict values. Each object is visited once; modules, classes and
    functions are not entered, nor are tensors (a tensor's attributes are not followed)."""
    seen = set() if _seen is None else _seen
    stack = [root]
    while stack:
        obj = stack.pop()
        if isinstance(obj, _ATOMS) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            yield obj
            continue
        if isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, (type, torch.device, torch.dtype)) or callable(obj) and not hasattr(obj, "__dict__"):
            continue
        else:
            if type(obj).__module__ in ("builtins",) or isinstance(obj, type(torch)):
                continue  # modules, builtins
            d = getattr(obj, "__dict__", None)
            if isinstance(d, dict):
                stack.extend(d.values())
            for cls in type(obj).__mro__:
                for slot in getattr(cls, "__slots__", ()) or ():
                    if isinstance(slot, str) and hasattr(obj, slot):
                        stack.append(getattr(obj, slot))


def _storage_key(t: torch.Tensor) -> tuple:
    s = t.untyped_storage()
    return (t.device.type, t.device.index, s.data_ptr())


def _storage_bytes(t: torch.Tensor) -> int:
    return int(t.untyped_storage().nbytes())


class _Counter:
    """Claims storages for roles: the first role to see a storage owns its bytes."""

    def __init__(self, device: torch.device, host: Iterable[torch.Tensor] = ()):
        self.device = device
        self.claimed: set[tuple] = set()
        self.host = {_storage_key(t) for t in host}  # offloaded storages: never device bytes

    def claim(self, tensors: Iterable[torch.Tensor | None]) -> int:
        total = 0
        for t in tensors:
            if t is None or not isinstance(t, torch.Tensor) or t.device != self.device:
                continue
            if _storage_key(t) in self.host:
                continue
            if t.untyped_storage().nbytes() == 0:
                continue
            key = _storage_key(t)
            if key in self.claimed:
                continue
            self.claimed.add(key)
            total += _storage_bytes(t)
        return total


def _kept(opt, name: str) -> list[torch.Tensor]:
    """The device part of an offloaded optimizer state that --opt-resident-gib keeps on the GPU (or nothing)."""
    kept = getattr(opt, "resident", {}).get(name)
    return [kept] if kept is not None else []


def memory_table(engine, device_rows: bool = True) -> list[tuple[str, int]]:
    """Bytes of each role of ``engine``'s allocated tensors on its device: a list of (name, bytes) in
    ``TENSOR_ROWS`` order, then (on CUDA, with ``device_rows``) ``DEVICE_ROWS``. See the module docstring.

    ``engine``: a ``TrainEngine`` (uses ``params``, ``grads``, ``grad_shard``, ``optimizer.master/m/v``,
    ``model.acts``, ``model.lin``, and walks everything else reachable from it)."""
    device = engine.device
    host = list(engine.host_tensors()) if hasattr(engine, "host_tensors") else []
    c = _Counter(device, host)
    opt, model = engine.optimizer, engine.model
    weights = engine.weight_tensors() if hasattr(engine, "weight_tensors") else [engine.params]
    rows = [
        ("weights", c.claim(weights)),
        ("master", c.claim([getattr(opt, "master", None), *_kept(opt, "master")])),
        ("adam_m", c.claim([getattr(opt, "m", None), getattr(opt, "m_scale", None), *_kept(opt, "m")])),
        ("adam_v", c.claim([getattr(opt, "v", None), *_kept(opt, "v")])),
        ("grads", c.claim(engine.grad_tensors() if hasattr(engine, "grad_tensors") else
                          [engine.grads, getattr(engine, "grad_shard", None)])),
        ("activations", c.claim(iter_tensors(model.acts))),
        ("fp8", c.claim([*iter_tensors(model.lin), *model.head.fp8_tensors(),
                         *(model.smooth.tensors() if getattr(model, "smooth", None) is not None else ())])),
        ("scratch", c.claim(iter_tensors(model))),
        ("other", c.claim(iter_tensors(engine))),
    ]
    if host:
        offloaded = set(getattr(opt, "offloaded", ()))
        opt_host = lambda name: [getattr(opt, name)] if name in offloaded else []  # noqa: E731
        grads_host = [engine.grad_shard] if engine.settings.memory.offload_gradients else []
        h = _Counter(torch.device("cpu"))
        rows += [("host_master", h.claim(opt_host("master"))), ("host_adam_m", h.claim(opt_host("m"))),
                 ("host_adam_v", h.claim(opt_host("v"))), ("host_grads", h.claim(grads_host)),
                 ("host_activations", h.claim(model.acts.residual.host_tensors())),
                 ("host_fp8", h.claim(model.lin.host_tensors()))]
    if device_rows and device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        rows += [("cuda_allocated", int(torch.cuda.memory_allocated(device))), ("free", int(free)),
                 ("total", int(total))]
    return rows


def tensor_bytes(rows: list[tuple[str, int]]) -> int:
    """Sum of the device tensor rows (what the engine holds on its device), leaving out device and host rows."""
    return sum(b for name, b in rows if name not in DEVICE_ROWS and name not in HOST_ROWS)


def host_bytes(rows: list[tuple[str, int]]) -> int:
    """Sum of the host rows (offloaded state)."""
    return sum(b for name, b in rows if name in HOST_ROWS)


def memory_dict(rows: list[tuple[str, int]]) -> dict[str, int]:
    """The rows as a dict (the JSON log's "allocator" record and the worker's set-up info)."""
    return {name: int(b) for name, b in rows}


def _human(b: int) -> str:
    if b >= 2**30:
        return f"{b / 2**30:9.2f} GiB"
    return f"{b / 2**20:9.2f} MiB"


def format_memory_table(rows: list[tuple[str, int]], title: str | None = "memory") -> str:
    """Aligned text table: one line per row (label, MiB or GiB, share of the tensor sum), then the sum of the
    tensor rows, then the device rows. Example::

        memory (rank 0)
          weights                   942.29 MiB   20.0%
          ...
          sum of tensors              4.60 GiB  100.0%
          free on device             70.12 GiB
    """
    total = tensor_bytes(rows)
    width = max(len(LABELS.get(n, n)) for n, _ in rows + [("sum of tensors", 0), ("host: sum (pinned)", 0)])
    out = [title] if title else []
    line = lambda label, b, pct: f"  {label:<{width}} {_human(b)}" + (f" {pct:6.1f}%" if pct is not None else "")  # noqa: E731
    for name, b in rows:
        if name not in DEVICE_ROWS and name not in HOST_ROWS:
            out.append(line(LABELS.get(name, name), b, 100.0 * b / total if total else 0.0))
    out.append(line("sum of tensors", total, 100.0 if total else 0.0))
    for name, b in rows:
        if name in DEVICE_ROWS:
            out.append(line(LABELS.get(name, name), b, None))
    if any(name in HOST_ROWS for name, _ in rows):
        for name, b in rows:
            if name in HOST_ROWS and b:
                out.append(line(LABELS.get(name, name), b, None))
        out.append(line("host: sum (pinned)", host_bytes(rows), None))
    return "\n".join(out)
