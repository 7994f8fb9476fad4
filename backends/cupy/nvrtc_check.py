"""Compile the CuPy backend's kernel sources with NVRTC without a GPU (a syntax and instantiation check).

NVRTC is a plain library: it needs no driver and no device, so the ``.cu`` files can be compiled on a CPU
machine (CI) to catch C++ errors, bad template instantiations and, with a real ``-arch=sm_XY``, invalid inline
PTX before any GPU time is spent. This talks to ``libnvrtc`` through ctypes (from the ``nvidia-cuda-nvrtc``
wheel, or wherever the loader finds it), so it needs neither CuPy nor CUDA. The options mirror what CuPy's
RawModule passes on the GPU machine (backends/cupy/_runtime.py).

    python -m llmq_ray.backends.cupy.nvrtc_check            # every module, PTX for compute_90 + an sm_90 PTX-assembly probe
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys
import time

from llmq_ray.backends.cupy import _runtime as rt

CUPY_ADDED_OPTIONS = ("--device-as-default-execution-space", "-ftz=true")


class NvrtcUnavailable(RuntimeError):
    pass


def _candidates() -> list[str]:
    paths = []
    for entry in sys.path:
        for sub in ("nvidia/cu13/lib", "nvidia/cuda_nvrtc/lib", "nvidia/cu12/lib"):
            paths += sorted(glob.glob(os.path.join(entry, sub, "libnvrtc.so*")))
    paths = [p for p in paths if "builtins" not in p and ".alt." not in p]
    found = ctypes.util.find_library("nvrtc")
    if found:
        paths.append(found)
    return paths + ["libnvrtc.so"]


_LIB = None


def load_nvrtc():
    """The NVRTC shared library (ctypes handle); raises NvrtcUnavailable when none can be loaded."""
    global _LIB
    if _LIB is not None:
        return _LIB
    errors = []
    for path in _candidates():
        try:
            # libnvrtc dlopens libnvrtc-builtins by name: load the one beside it first, so it is found
            for builtins in sorted(glob.glob(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so*"))):
                if ".alt." not in builtins:
                    ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
            lib = ctypes.CDLL(path)
            lib.nvrtcVersion  # noqa: B018 - raises AttributeError for a library that is not NVRTC
        except (OSError, AttributeError) as exc:
            errors.append(f"{path}: {exc}")
            continue
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        _LIB = lib
        return lib
    raise NvrtcUnavailable("no loadable libnvrtc (pip install nvidia-cuda-nvrtc); tried " + "; ".join(errors[:3]))


def nvrtc_version() -> tuple[int, int]:
    lib = load_nvrtc()
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


def compile_source(source: str, name: str, options: list[str], name_expressions=()) -> tuple[bytes, str]:
    """Compile ``source``; returns (PTX or CUBIN bytes, log). Raises RuntimeError with NVRTC's log on failure."""
    lib = load_nvrtc()
    prog = ctypes.c_void_p()

    def check(status, what):
        if status != 0:
            raise RuntimeError(f"{what}: {lib.nvrtcGetErrorString(status).decode()}")

    check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None),
          "nvrtcCreateProgram")
    try:
        for expr in name_expressions:
            check(lib.nvrtcAddNameExpression(prog, expr.encode()), f"nvrtcAddNameExpression({expr})")
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        status = lib.nvrtcCompileProgram(prog, len(options), opts)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace")
        if status != 0:
            raise RuntimeError(f"NVRTC failed on {name} ({lib.nvrtcGetErrorString(status).decode()}):\n{log}")
        for expr in name_expressions:
            lowered = ctypes.c_char_p()
            check(lib.nvrtcGetLoweredName(prog, expr.encode(), ctypes.byref(lowered)), f"lowered name of {expr}")
        cubin = any(o.startswith("-arch=sm_") for o in options)
        get_size, get = ((lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN) if cubin else (lib.nvrtcGetPTXSize, lib.nvrtcGetPTX))
        check(get_size(prog, ctypes.byref(size)), "output size")
        out = ctypes.create_string_buffer(size.value)
        check(get(prog, out), "output")
        return out.raw, log
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def module_options(arch: str, defines=()) -> list[str]:
    return [f"-arch={arch}", *rt.NVRTC_OPTIONS, *CUPY_ADDED_OPTIONS, *[f"-D{d}" for d in defines]]


def compile_module(module: str, arch: str = "compute_90", defines=()) -> bytes:
    """Compile one kernel module (common.cuh + <module>.cu) with all its name expressions."""
    out, _ = compile_source(rt.kernel_source(module), f"{module}.cu", module_options(arch, defines), rt.MODULES[module])
    return out


# Every inline-PTX helper of common.cuh in one small kernel: assembled for a real architecture, so ptxas
# checks the instructions NVVM passes through unparsed.
ASM_PROBE = r"""
__global__ void asm_probe(float* f, unsigned short* h, unsigned* u) {
    const float a = f[threadIdx.x], b = f[threadIdx.x + 32];
    f[threadIdx.x] = mul_rn(a, b) + div_rn(a, b);
    h[threadIdx.x] = from_f32<bf16>(a) ^ fp8x2<0>(a, b) ^ fp8x2<1>(a, b);
    u[threadIdx.x] = warp_max_u32(abs_bits(a));
}
"""


def compile_asm_probe(arch: str = "sm_90") -> bytes:
    common = (rt.KERNEL_DIR / rt.COMMON_HEADER).read_text()
    out, _ = compile_source(common + ASM_PROBE, "asm_probe.cu", module_options(arch), ["asm_probe"])
    return out


def main() -> int:
    print(f"NVRTC {nvrtc_version()}")
    for module in rt.MODULES:
        t0 = time.perf_counter()
        ptx = compile_module(module)
        print(f"  {module:11s} {len(rt.MODULES[module]):3d} kernels  PTX {len(ptx):8d} B  {time.perf_counter() - t0:.2f} s")
    print(f"  asm probe sm_90 cubin {len(compile_asm_probe()):d} B")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
