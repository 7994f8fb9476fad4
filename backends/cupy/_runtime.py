"""Compiling, caching and launching the CUDA C++ kernels of the CuPy backend.

The kernels live as ``.cu`` files in ``backends/cupy/kernels/`` (package data). Each file is one
``cupy.RawModule``: ``common.cuh`` is prepended to its text (so the cache key covers the shared helpers too)
and its template instantiations are listed as NVRTC *name expressions* (``MODULES`` below). A module is
compiled the first time one of its kernels is launched, by NVRTC for the architecture of the current device
(CuPy passes ``-arch=sm_XY`` from the device's compute capability, the one torch reports), and the cubin
is stored in CuPy's on-disk kernel cache (``$CUPY_CACHE_DIR``, default ``~/.cupy/kernel_cache``), keyed by
source, options, architecture and NVRTC version: a second process loads it without compiling.

Launches go to torch's current stream (``cupy.cuda.ExternalStream`` around
``torch.cuda.current_stream().cuda_stream``) with raw device pointers (``tensor.data_ptr()``) as arguments:
no copies, no DLPack objects, and ordering with torch's own kernels is the stream's.

Nothing here imports cupy at module import time; :func:`require_cupy` does, and turns a missing CuPy or a
missing GPU into one sentence (a ``ConfigError``).
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import numpy as np
import torch

KERNEL_DIR = Path(__file__).with_name("kernels")
COMMON_HEADER = "common.cuh"
# CuPy adds -arch=sm_XY (the device's), --device-as-default-execution-space and -ftz=true itself.
NVRTC_OPTIONS = ("--std=c++17",)

INSTALL_HINT = ("pip install 'llmq-ray[cupy13]' for a CUDA 13 driver or 'llmq-ray[cupy12]' for a CUDA 12 "
                "driver (nvidia-smi shows the driver's CUDA version)")

T_NAME = {torch.float32: "float", torch.bfloat16: "bf16"}
VEC = {torch.float32: 4, torch.bfloat16: 8}  # elements per 16-byte access
FP8_FMT = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1}
# rmsnorm: vectors per thread (K) of the 16-byte path; the scalar path (rows not a multiple of 16 bytes) uses
# K = 8, so rows up to 8 x 1024 elements.
ROW_K = (1, 2, 4)
ROW_K_SCALAR = 8
# qk_norm: vectors per lane (K) of a head row, 16-byte and scalar paths alike: head dims up to 8 x 32 vectors
# (2048 bf16 / 1024 fp32 elements, 256 on the scalar path); a longer one goes to the torch default.
QK_K = (1, 2, 4, 8)


def _both_vecs(dtype):
    return (VEC[dtype], 1)


def row_ks(vec: int) -> tuple[int, ...]:
    return ROW_K if vec > 1 else (ROW_K_SCALAR,)


def _name_expressions() -> dict[str, list[str]]:
    """Every kernel instantiation the backend may launch, per .cu file."""
    dts = (torch.float32, torch.bfloat16)
    mods: dict[str, list[str]] = {}
    mods["embedding"] = (
        [f"emb_fwd<{w}, {ti}>" for w in ("uint4", "unsigned int", "unsigned short") for ti in ("int", "long long")]
        + [f"{k}<{T_NAME[d]}, {v}>" for k in ("emb_bwd_head", "emb_bwd_segments") for d in dts for v in _both_vecs(d)])
    mods["rmsnorm"] = [f"{k}<{T_NAME[d]}, {v}, {kk}>" for k in ("rmsnorm_fwd", "rmsnorm_bwd") for d in dts
                       for v in _both_vecs(d) for kk in row_ks(v)]
    mods["layernorm"] = [f"{k}<{T_NAME[d]}, {v}, {kk}>" for k in ("layernorm_fwd", "layernorm_bwd") for d in dts
                         for v in _both_vecs(d) for kk in row_ks(v)]
    mods["qk_norm"] = [f"{k}<{T_NAME[d]}, {v}, {kk}>" for k in ("qk_norm_fwd", "qk_norm_bwd") for d in dts
                       for v in _both_vecs(d) for kk in QK_K]
    mods["rope"] = [f"rope<{T_NAME[d]}, {v}>" for d in dts for v in _both_vecs(d)]
    mods["swiglu"] = [f"{k}<{T_NAME[d]}, {v}>" for k in ("swiglu_fwd", "swiglu_bwd") for d in dts for v in _both_vecs(d)]
    mods["gelu"] = [f"{k}<{T_NAME[d]}, {v}>" for k in ("gelu_fwd", "gelu_bwd") for d in dts for v in _both_vecs(d)]
    mods["reduce"] = ([f"{k}<{T_NAME[d]}, {v}>" for k in ("absmax_kernel", "sumsq_partial") for d in dts
                       for v in _both_vecs(d)] + ["finish_sum"] + [f"column_sum<{T_NAME[d]}>" for d in dts])
    mods["fp8"] = [f"{k}<{T_NAME[d]}, {v}, {f}>" for k in ("quantize_flat", "quantize_tiles") for d in dts
                   for v in _both_vecs(d) for f in (0, 1)]
    mods["classifier"] = [f"classifier<{T_NAME[d]}, {v}, {ti}>" for d in dts for v in _both_vecs(d)
                          for ti in ("int", "long long")]
    mods["adamw"] = [f"{k}<{v}>" for k in ("adamw", "stochastic_round") for v in (4, 1)]
    return mods


MODULES = _name_expressions()


@functools.lru_cache(maxsize=None)
def kernel_source(module: str) -> str:
    """The full text NVRTC compiles for ``module``: common.cuh followed by ``<module>.cu``."""
    common = (KERNEL_DIR / COMMON_HEADER).read_text()
    body = (KERNEL_DIR / f"{module}.cu").read_text()
    return f"{common}\n// ---------------- {module}.cu\n{body}"


def require_cupy(device: torch.device):
    """Import CuPy and check that it can drive ``device``; otherwise raise ConfigError (one sentence)."""
    from llmq_ray.errors import ConfigError

    try:
        import cupy
    except ImportError as exc:
        raise ConfigError(f"--backend=cupy needs CuPy, which is not installed here: {INSTALL_HINT}.") from exc
    if device.type != "cuda" or not torch.cuda.is_available() or not _cupy_sees_gpu(cupy):
        raise ConfigError("--backend=cupy needs an NVIDIA GPU with a working CUDA driver and none is usable here "
                          f"(device {device}); use --backend=torch on CPU, or on a GPU machine {INSTALL_HINT}.")
    return cupy


def _cupy_sees_gpu(cupy) -> bool:
    try:
        return bool(cupy.cuda.is_available())
    except Exception:  # noqa: BLE001 - a broken driver / runtime mismatch reads as "no GPU" here
        return False


# ---------------------------------------------------------------------------------------------- arguments
def ptr(t: torch.Tensor | None) -> np.uint64:
    """A tensor's device address as a kernel argument (0 for None: a null pointer)."""
    return np.uint64(0 if t is None else t.data_ptr())


def i32(x: int) -> np.int32:
    return np.int32(x)


def i64(x: int) -> np.int64:
    return np.int64(x)


def f32(x: float) -> np.float32:
    return np.float32(x)


def u64(x: int) -> np.uint64:
    return np.uint64(int(x) & ((1 << 64) - 1))


def aligned(*tensors: torch.Tensor | None, to: int = 16) -> bool:
    """True when every given tensor's address is a multiple of ``to`` bytes."""
    return all(t is None or t.data_ptr() % to == 0 for t in tensors)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------------------------- kernels
class _StreamHandle:
    """A raw cudaStream_t exposed through the CUDA stream protocol (what Stream.from_external reads)."""

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


class Kernels:
    """The compiled modules and launch plumbing for one CUDA device (lazily compiled, disk-cached)."""

    def __init__(self, cupy, device: torch.device, extra_options: tuple[str, ...] = ()):
        self.cupy = cupy
        self.options = NVRTC_OPTIONS + tuple(extra_options)  # e.g. -DLLMQ_SOFT_FP8 (tests)
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.sm_count = torch.cuda.get_device_properties(self.index).multi_processor_count
        self._modules: dict[str, object] = {}
        self._functions: dict[tuple[str, str], object] = {}
        self._streams: dict[int, object] = {}
        self.compile_seconds: dict[str, float] = {}
        cap = torch.cuda.get_device_capability(self.index)
        with cupy.cuda.Device(self.index):
            cupy_cap = cupy.cuda.Device(self.index).compute_capability
        if cupy_cap != f"{cap[0]}{cap[1]}":  # CuPy compiles for its view of the device: it must be torch's
            raise RuntimeError(f"cupy sees compute capability {cupy_cap} on device {self.index}, torch {cap}")
        self.arch = f"sm_{cap[0]}{cap[1]}"

    def _module(self, name: str):
        mod = self._modules.get(name)
        if mod is None:
            mod = self.cupy.RawModule(code=kernel_source(name), options=self.options,
                                      name_expressions=MODULES[name])
            self._modules[name] = mod
        return mod

    def function(self, module: str, name: str):
        key = (module, name)
        fn = self._functions.get(key)
        if fn is None:
            if name not in MODULES[module]:
                raise KeyError(f"{name} is not an instantiation listed for {module}.cu in MODULES")
            t0 = time.perf_counter()
            with self.cupy.cuda.Device(self.index):
                fn = self._load(module, name)
            self.compile_seconds[module] = self.compile_seconds.get(module, 0.0) + time.perf_counter() - t0
            self._functions[key] = fn
        return fn

    def _load(self, module: str, name: str):
        try:
            return self._module(module).get_function(name)  # the first call compiles (or loads from the cache)
        except Exception as exc:  # noqa: BLE001
            text = str(exc)
            if "nvrtc" in text.lower() and ("not found" in text.lower() or "cannot open" in text.lower()
                                             or "failed to load" in text.lower()):
                from llmq_ray.errors import ConfigError

                raise ConfigError(f"--backend=cupy could not load NVRTC to compile its kernels ({text.strip()}); "
                                  f"install the CUDA runtime compiler: {INSTALL_HINT}, plus nvidia-cuda-nvrtc "
                                  "of the same CUDA major version if torch did not bring it.") from exc
            raise

    def compile_all(self) -> float:
        """Compile (or load from the disk cache) every module now; returns the seconds it took."""
        t0 = time.perf_counter()
        for module, names in MODULES.items():
            self.function(module, names[0])
        return time.perf_counter() - t0

    def stream(self):
        """torch's current stream on this device, as a CuPy stream (cached per stream handle)."""
        s = torch.cuda.current_stream(self.index).cuda_stream
        ext = self._streams.get(s)
        if ext is None:
            ext = self._wrap_stream(s)
            self._streams[s] = ext
        return ext

    def _wrap_stream(self, handle: int):
        stream_cls = self.cupy.cuda.Stream
        if hasattr(stream_cls, "from_external"):  # CuPy >= 14: the CUDA stream protocol
            return stream_cls.from_external(_StreamHandle(handle))
        return self.cupy.cuda.ExternalStream(handle, self.index)  # CuPy 13

    def launch(self, module: str, name: str, grid, block, args, shared_mem: int = 0) -> None:
        fn = self.function(module, name)
        grid = grid if isinstance(grid, tuple) else (grid,)
        block = block if isinstance(block, tuple) else (block,)
        if self.cupy.cuda.runtime.getDevice() != self.index:
            with self.cupy.cuda.Device(self.index):
                fn(grid, block, args, shared_mem=shared_mem, stream=self.stream())
        else:
            fn(grid, block, args, shared_mem=shared_mem, stream=self.stream())

    def zero_u32(self, t: torch.Tensor) -> None:
        """Zero a 4-byte device scalar (an absmax about to receive atomicMax) on the current stream."""
        self.cupy.cuda.runtime.memsetAsync(t.data_ptr(), 0, 4, self.stream().ptr)

    def grid_for(self, work_items: int, threads: int, per_sm: int = 8) -> int:
        """Blocks for a grid-stride loop over ``work_items``: enough to fill the GPU, no more."""
        return max(1, min(cdiv(work_items, threads), self.sm_count * per_sm))
