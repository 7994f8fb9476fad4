"""FP8 GEMMs through cuBLASLt (ctypes), for what torch._scaled_mm does not expose: beta = 1.

Why: with gradient accumulation, every micro-step after the first adds its FP8 weight gradient into the bf16
gradient buffer. ``torch._scaled_mm`` has no C input, so the torch path writes the product to a temporary and
adds it in a second kernel (an extra read and write of the [OC, K] gradient: 7.1 ms per 1.5B step of 4
micro-steps on the H100, ~0.8%). cuBLASLt computes D = alpha * op(A) op(B) + beta * C in the GEMM's epilogue;
with C = D = the gradient and beta = 1 the accumulation costs no extra pass, and the sum is rounded once (from
fp32) instead of twice.

Layout. Our operands follow ``Backend.matmul_fp8``: out[M, N] = (a[M, K] * sa) @ (b[N, K] * sb)^T with a, b
row-major (K contiguous) in FP8. cuBLASLt is column-major, so we compute out^T[N, M] = b a^T: cuBLAS's A is our
b seen as a column-major [K, N] matrix (ld K) with op T, its B our a as column-major [K, M] (ld K) with op N, and
C = D our row-major out as column-major [N, M] (ld N). That is the "TN" layout FP8 needs; A's scale is b's
descale, B's is a's. Accumulation in fp32 (CUBLAS_COMPUTE_32F), no fast accumulation (the same numerics as
``torch._scaled_mm``'s default).

The library is the one torch already loaded (found in /proc/self/maps), so there is no second copy of cuBLASLt
in the process. Enum values are cublasLt.h's / library_types.h's (CUDA 12 and 13 agree). The algorithm is
cuBLASLt's first heuristic choice for the shape, cached; descriptors are cached per shape and dtype, and the scale
pointers set per call (host-side only, so a CUDA-graph capture records the right pointers). The first call in a
process must be eager (it allocates the workspace); the CUDA-graph runner's eager first micro-step sees to that.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

import torch

# library_types.h: cudaDataType_t
_CUDA_TYPE = {torch.float32: 0, torch.float16: 2, torch.bfloat16: 14, torch.float8_e4m3fn: 28,
              torch.float8_e5m2: 29}
_COMPUTE_32F = 68  # cublas_api.h: CUBLAS_COMPUTE_32F
_CUDA_R_32F = 0
_OP_N, _OP_T = 0, 1
# cublasLt.h: cublasLtMatmulDescAttributes_t
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_DESC_A_SCALE_POINTER, _DESC_B_SCALE_POINTER = 17, 18
_DESC_FAST_ACCUM = 25
_PREF_MAX_WORKSPACE_BYTES = 1  # cublasLtMatmulPreferenceAttributes_t
_WORKSPACE_BYTES = 32 << 20  # what torch gives cuBLASLt on Hopper
_CANDIDATES = 8  # heuristic results kept per problem (the first is used; the others for benchmarks)


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


class CublasLtError(RuntimeError):
    """A cuBLASLt call returned a status other than CUBLAS_STATUS_SUCCESS."""


def _library_path() -> str | None:
    """The libcublasLt torch already mapped into this process, else whatever the loader finds."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "libcublasLt.so" in path:
                    return path
    except OSError:
        pass
    return ctypes.util.find_library("cublasLt")


_lib = None
_lib_error: str | None = None
_lock = threading.Lock()


def _load():
    """Load libcublasLt once and declare the functions used; raises CublasLtError if it cannot."""
    global _lib, _lib_error
    with _lock:
        if _lib is not None or _lib_error is not None:
            if _lib is None:
                raise CublasLtError(_lib_error)
            return _lib
        torch.cuda.init()  # torch_cuda (and with it cuBLASLt) is loaded by now
        path = _library_path()
        if path is None:
            _lib_error = "libcublasLt was not found in this process or on the loader path"
            raise CublasLtError(_lib_error)
        lib = ctypes.CDLL(path)
        vp, i, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        for name, args in {
            "cublasLtCreate": [ctypes.POINTER(vp)],
            "cublasLtMatmulDescCreate": [ctypes.POINTER(vp), i, i],
            "cublasLtMatmulDescSetAttribute": [vp, i, vp, sz],
            "cublasLtMatrixLayoutCreate": [ctypes.POINTER(vp), i, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64],
            "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(vp)],
            "cublasLtMatmulPreferenceSetAttribute": [vp, i, vp, sz],
            "cublasLtMatmulPreferenceDestroy": [vp],
            "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, i, ctypes.POINTER(_HeuristicResult),
                                               ctypes.POINTER(i)],
            "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, ctypes.POINTER(_Algo), vp, sz, vp],
        }.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
        _lib = lib
        return lib


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CublasLtError(f"cuBLASLt {what} failed with status {status}")


def available() -> bool:
    """True when CUDA is up and libcublasLt could be loaded."""
    if not torch.cuda.is_available():
        return False
    try:
        _load()
        return True
    except (CublasLtError, OSError):
        return False


class _Plan:
    """Descriptors and the chosen algorithm for one (M, N, K, dtypes, beta != 0) problem."""

    def __init__(self, lib, handle, m, n, k, a_dtype, b_dtype, out_dtype, workspace_bytes):
        vp = ctypes.c_void_p
        self.desc = vp()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F, _CUDA_R_32F), "MatmulDescCreate")
        for attr, value in ((_DESC_TRANSA, _OP_T), (_DESC_TRANSB, _OP_N)):
            v = ctypes.c_int32(value)
            _check(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(v), 4), "set trans")
        fast = ctypes.c_int8(0)
        _check(lib.cublasLtMatmulDescSetAttribute(self.desc, _DESC_FAST_ACCUM, ctypes.byref(fast), 1), "set accum")
        self.layouts = []
        for dtype, rows, cols in ((b_dtype, k, n), (a_dtype, k, m), (out_dtype, n, m), (out_dtype, n, m)):
            lay = vp()
            _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), _CUDA_TYPE[dtype], rows, cols, rows),
                   "MatrixLayoutCreate")
            self.layouts.append(lay)
        pref = vp()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "PreferenceCreate")
        ws = ctypes.c_uint64(workspace_bytes)
        _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws), 8),
               "set workspace")
        self.results = (_HeuristicResult * _CANDIDATES)()
        count = ctypes.c_int(0)
        _check(lib.cublasLtMatmulAlgoGetHeuristic(handle, self.desc, *self.layouts, pref, _CANDIDATES, self.results,
                                                  ctypes.byref(count)), "AlgoGetHeuristic")
        lib.cublasLtMatmulPreferenceDestroy(pref)
        self.count = count.value
        if self.count == 0:
            raise CublasLtError(f"cuBLASLt has no algorithm for M={m} N={n} K={k} "
                                f"({a_dtype} x {b_dtype} -> {out_dtype})")
        self.choice = 0


class CublasLtFp8:
    """out[M, N] (+)= (a[M, K] * a_descale) @ (b[N, K] * b_descale)^T through cublasLtMatmul, on the current
    stream. One per device; plans cached per problem. (bf16 / fp16 operands also work, without scales: the
    benchmarks' algorithm survey uses that.)"""

    def __init__(self, device: torch.device):
        self.lib = _load()
        self.device = torch.device(device)
        self.handle = ctypes.c_void_p()
        with torch.cuda.device(self.device):
            _check(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "Create")
        self.plans: dict[tuple, _Plan] = {}
        # One workspace, allocated here (outside any CUDA-graph capture: the backend creates this object in an
        # eager micro-step). Shared by all calls: our FP8 GEMMs run in order on the compute stream (or on the
        # capture stream while a graph is recorded), never two at once.
        self.workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._one = ctypes.c_float(1.0)
        self._zero = ctypes.c_float(0.0)

    def supports(self, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
        """Row-major contiguous operands with dimensions cuBLASLt's FP8 kernels take (multiples of 16), and not
        both e5m2 (no such FP8 kernel)."""
        return (a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and b.dtype in (torch.float8_e4m3fn,
                torch.float8_e5m2) and not (a.dtype == b.dtype == torch.float8_e5m2)
                and out.dtype in (torch.bfloat16, torch.float16, torch.float32)
                and a.is_contiguous() and b.is_contiguous() and out.is_contiguous()
                and a.shape[1] == b.shape[1] and out.shape == (a.shape[0], b.shape[0])
                and a.shape[1] % 16 == 0 and a.shape[0] % 16 == 0 and b.shape[0] % 16 == 0)

    def plan(self, m: int, n: int, k: int, a_dtype, b_dtype, out_dtype) -> _Plan:
        key = (m, n, k, a_dtype, b_dtype, out_dtype)
        p = self.plans.get(key)
        if p is None:
            p = self.plans[key] = _Plan(self.lib, self.handle, m, n, k, a_dtype, b_dtype, out_dtype,
                                        _WORKSPACE_BYTES)
        return p

    def matmul(self, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_descale: torch.Tensor,
               b_descale: torch.Tensor, accumulate: bool, algo_index: int | None = None) -> None:
        """out (+)= the scaled product; ``accumulate`` adds into out (beta = 1). ``algo_index`` picks another of
        the heuristic's candidates (benchmarks only). Check ``supports`` first."""
        m, k = a.shape
        n = b.shape[0]
        p = self.plan(m, n, k, a.dtype, b.dtype, out.dtype)
        idx = p.choice if algo_index is None else algo_index
        if idx >= p.count:
            raise CublasLtError(f"algorithm {idx} of {p.count}")
        lib = self.lib
        if a.element_size() == 1:  # FP8: per-tensor scales (device fp32 scalars); other types take none
            for attr, t in ((_DESC_A_SCALE_POINTER, b_descale), (_DESC_B_SCALE_POINTER, a_descale)):
                ptr = ctypes.c_void_p(t.data_ptr())
                _check(lib.cublasLtMatmulDescSetAttribute(p.desc, attr, ctypes.byref(ptr), 8), "set scale pointer")
        stream = torch.cuda.current_stream(self.device)
        res = p.results[idx]
        la, lb, lc, ld = p.layouts
        beta = self._one if accumulate else self._zero
        _check(lib.cublasLtMatmul(self.handle, p.desc, ctypes.byref(self._one), b.data_ptr(), la, a.data_ptr(), lb,
                                  ctypes.byref(beta), out.data_ptr(), lc, out.data_ptr(), ld, ctypes.byref(res.algo),
                                  self.workspace.data_ptr(), _WORKSPACE_BYTES, stream.cuda_stream), "Matmul")


_instances: dict[int, CublasLtFp8] = {}


def for_device(device: torch.device) -> CublasLtFp8:
    """The per-device instance (created on first use)."""
    idx = torch.device(device).index
    idx = torch.cuda.current_device() if idx is None else idx
    inst = _instances.get(idx)
    if inst is None:
        inst = _instances[idx] = CublasLtFp8(torch.device("cuda", idx))
    return inst
