"""GEMMs through cuBLASLt (ctypes): beta = 1 for FP8, and algorithms picked by timing instead of by heuristic.

Why, 1: with gradient accumulation, every micro-step after the first adds its FP8 weight gradient into the bf16
gradient buffer. ``torch._scaled_mm`` has no C input, so the torch path writes the product to a temporary and
adds it in a second kernel (an extra read and write of the [OC, K] gradient: 7.1 ms per 1.5B step of 4
micro-steps on the H100, ~0.8%). cuBLASLt computes D = alpha * op(A) op(B) + beta * C in the GEMM's epilogue;
with C = D = the gradient and beta = 1 the accumulation costs no extra pass.

Why, 2: torch takes cuBLAS's heuristic choice of algorithm. On the H100 at Qwen2.5-1.5B's shapes the fastest of
cuBLASLt's eight heuristic candidates was up to 19% faster for single bf16 GEMMs, 10% over all of a layer's
(benchmarks/gemm_algos.py, results section 24). ``CublasLt.gemm`` times the candidates against the caller's own
call once per problem and keeps the fastest.

Layout. Our operands are row-major; cuBLASLt is column-major, so we compute out^T = op(b)^T op(a)^T: cuBLAS's A
is our b, its B our a, and C = D our out seen as column-major [N, M] (``_Plan``). For FP8 (``matmul``:
out[M, N] = (a[M, K] * sa) @ (b[N, K] * sb)^T, K contiguous in both) that is the "TN" layout FP8 needs; A's
scale is b's descale, B's is a's. Accumulation in fp32 (CUBLAS_COMPUTE_32F), no FP8 fast accumulation (the same
numerics as ``torch._scaled_mm``'s default). Operands must sit at 16-byte aligned addresses (``supports``); the
heuristic is told each one's real alignment (up to 256 bytes, its default assumption), which is part of the plan.

Why a hand-written ctypes binding and not a library: torch exposes neither a cuBLASLt matmul with a C input for
FP8 nor the list of candidate algorithms; NVIDIA's nvmath-python does wrap cuBLASLt, but it is not part of the
GPU image we run on and ships its own CUDA library wheels, where this binding needs nothing beyond torch. The
library is the one torch already loaded (found in /proc/self/maps), so there is no second copy of cuBLASLt
in the process. Enum values are cublasLt.h's / library_types.h's (CUDA 12 and 13 agree). Descriptors are cached
per problem and the FP8 scale pointers set per call (host-side only, so a CUDA-graph capture records the right
pointers). The first call in a process and each problem's first call must be eager (the workspace is allocated,
the candidates timed); the CUDA-graph runner's eager first micro-step of each mode sees to that.
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
_DESC_SM_COUNT_TARGET = 15  # int32; 0 = all of the device's SMs
_PREF_MAX_WORKSPACE_BYTES = 1  # cublasLtMatmulPreferenceAttributes_t
_PREF_MIN_ALIGNMENT_BYTES = (5, 6, 7, 8)  # ... MIN_ALIGNMENT_A/B/C/D_BYTES (uint32, default 256)
_MIN_POINTER_ALIGNMENT = 16  # bytes; cuBLASLt's tensor-core kernels need at least this (FP8 requires it)
# Accumulating problems whose out is larger are not timed (tuning needs a copy of out). The largest tuned one is
# the LM-head gradient: 0.27 GB at 0.5B, 0.47 GB at 1.5B; at 7B (1.09 GB, with the GPU nearly full) it is not.
_TUNE_MAX_SAVED_BYTES = 1 << 30
_WORKSPACE_BYTES = 32 << 20  # what torch gives cuBLASLt on Hopper
_CANDIDATES = 8  # heuristic results kept per problem, timed against each other when tuning
_TUNE_REPS = 5  # timed runs per candidate (median), after one warm-up run
_MARGIN = 0.01  # a cuBLASLt candidate replaces the caller's fallback only if at least this much faster


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


def pointer_alignment(ptr: int) -> int:
    """The largest power of two (at most 256) that divides the address ``ptr``: what cuBLASLt's heuristic must be
    told, since by default it assumes 256-byte aligned operands (a view at an offset may be less)."""
    return min(256, ptr & -ptr) if ptr else 256


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
    """Descriptors, cuBLASLt's candidate algorithms and the chosen one for one problem: out[M, N] = op(a) op(b)
    with the given operand shapes, transposes and dtypes.

    Column-major view (see the module docstring): out^T[N, M] = op(b)^T op(a)^T. cuBLAS's A is b's memory, a
    column-major [b.shape[1], b.shape[0]] matrix (ld b.shape[1]) taken transposed exactly when ``trans_b``; its B
    is a's memory, [a.shape[1], a.shape[0]] (ld a.shape[1]) transposed exactly when ``trans_a``; C = D is out as
    column-major [N, M] (ld N).
    """

    def __init__(self, lib, handle, a_shape, b_shape, trans_a, trans_b, a_dtype, b_dtype, out_dtype, n, m,
                 alignments, sm_count: int = 0):
        vp = ctypes.c_void_p
        self.desc = vp()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F, _CUDA_R_32F), "MatmulDescCreate")
        for attr, value in ((_DESC_TRANSA, _OP_T if trans_b else _OP_N), (_DESC_TRANSB, _OP_T if trans_a else _OP_N)):
            v = ctypes.c_int32(value)
            _check(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(v), 4), "set trans")
        if sm_count:  # the heuristic sizes the kernels for this many SMs (leaving the rest to a concurrent stream)
            v = ctypes.c_int32(sm_count)
            _check(lib.cublasLtMatmulDescSetAttribute(self.desc, _DESC_SM_COUNT_TARGET, ctypes.byref(v), 4),
                   "set SM count target")
        if a_dtype.itemsize == 1:  # FP8: no fast accumulation (torch._scaled_mm's default numerics)
            fast = ctypes.c_int8(0)
            _check(lib.cublasLtMatmulDescSetAttribute(self.desc, _DESC_FAST_ACCUM, ctypes.byref(fast), 1),
                   "set accum")
        self.layouts = []
        for dtype, rows, cols in ((b_dtype, b_shape[1], b_shape[0]), (a_dtype, a_shape[1], a_shape[0]),
                                  (out_dtype, n, m), (out_dtype, n, m)):
            lay = vp()
            _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), _CUDA_TYPE[dtype], rows, cols, rows),
                   "MatrixLayoutCreate")
            self.layouts.append(lay)
        pref = vp()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "PreferenceCreate")
        ws = ctypes.c_uint64(_WORKSPACE_BYTES)
        _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws), 8),
               "set workspace")
        for attr, align in zip(_PREF_MIN_ALIGNMENT_BYTES, alignments):  # cuBLAS's A, B, C, D = our b, a, out, out
            al = ctypes.c_uint32(align)
            _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, attr, ctypes.byref(al), 4), "set alignment")
        self.results = (_HeuristicResult * _CANDIDATES)()
        count = ctypes.c_int(0)
        _check(lib.cublasLtMatmulAlgoGetHeuristic(handle, self.desc, *self.layouts, pref, _CANDIDATES,
                                                  self.results, ctypes.byref(count)), "AlgoGetHeuristic")
        lib.cublasLtMatmulPreferenceDestroy(pref)
        self.count = count.value
        if self.count == 0:
            raise CublasLtError(f"cuBLASLt has no algorithm for out[{m}, {n}] = op(a{list(a_shape)}) "
                                f"op(b{list(b_shape)}) ({a_dtype} x {b_dtype} -> {out_dtype})")
        self.choice: int | None = None  # index into results; -1 = the caller's fallback; None = not tuned yet
        self.timings: list[float] = []  # ms per candidate, fallback first (when tuned)


class CublasLt:
    """GEMMs through cublasLtMatmul on the current stream: out[M, N] (+)= op(a) @ op(b), in bf16 / fp16 / fp32
    or FP8 with per-tensor descales. One per device; plans cached per problem.

    ``gemm(..., fallback=f)`` picks, on a problem's first eager call, the fastest of ``f`` (the caller's usual
    call, e.g. torch.mm) and cuBLASLt's heuristic candidates by timing each (median of a few runs), and keeps
    that choice; a candidate must beat the fallback by ``_MARGIN`` to be taken, so where cuBLASLt offers nothing
    better the numerics stay those of the fallback. Without a fallback (or while a CUDA graph is being captured)
    the heuristic's first candidate is used.
    """

    def __init__(self, device: torch.device):
        self.lib = _load()
        self.device = torch.device(device)
        self.handle = ctypes.c_void_p()
        with torch.cuda.device(self.device):
            _check(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "Create")
        self.plans: dict[tuple, _Plan] = {}
        # One workspace, allocated here (outside any CUDA-graph capture: the backend creates this object in an
        # eager micro-step). Shared by all calls: our GEMMs run in order on the compute stream (or on the
        # capture stream while a graph is recorded), never two at once.
        self.workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        # GEMMs with an SM count target may run on a side stream at the same time as the compute stream's
        # (llmq_ray/engine/wgrad_overlap.py): they get a workspace per stream (``side_workspace``), never the one above.
        self._side_workspaces: dict[int, torch.Tensor] = {}
        self._one = ctypes.c_float(1.0)
        self._zero = ctypes.c_float(0.0)

    def side_workspace(self, stream: torch.cuda.Stream | None = None) -> torch.Tensor:
        """The workspace of the GEMMs with an SM count target issued on ``stream`` (default: the current one):
        one per stream, so that two such GEMMs running at once never share one. Made at the stream's first
        call, which must be eager: call this before a CUDA graph captures work on that stream."""
        stream = stream or torch.cuda.current_stream(self.device)
        ws = self._side_workspaces.get(stream.cuda_stream)
        if ws is None:
            if torch.cuda.is_current_stream_capturing():
                raise CublasLtError("a side-stream cuBLASLt workspace must be made before the CUDA graph is captured")
            ws = self._side_workspaces[stream.cuda_stream] = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8,
                                                                           device=self.device)
        return ws

    # ---------------------------------------------------------------- what it takes
    def supports(self, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, trans_a: bool = False,
                 trans_b: bool = True) -> bool:
        """Contiguous, non-empty 2-D operands at 16-byte aligned addresses, of matching shapes and types
        cuBLASLt takes: both bf16 (or fp16, or fp32) with out the same, or FP8 ("TN": trans_b and not trans_a;
        not both e5m2; dimensions multiples of 16) with out bf16 / fp16 / fp32. (FP8 descales: see ``gemm``.)"""
        if not (a.dim() == b.dim() == out.dim() == 2 and a.is_contiguous() and b.is_contiguous()
                and out.is_contiguous() and a.device == b.device == out.device == self.device
                and min(a.numel(), b.numel(), out.numel()) > 0
                and all(pointer_alignment(t.data_ptr()) >= _MIN_POINTER_ALIGNMENT for t in (a, b, out))):
            return False
        m, k = (a.shape[1], a.shape[0]) if trans_a else tuple(a.shape)
        kb, n = (b.shape[1], b.shape[0]) if trans_b else tuple(b.shape)
        if k != kb or tuple(out.shape) != (m, n):
            return False
        fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
        if a.dtype in fp8 or b.dtype in fp8:
            return (a.dtype in fp8 and b.dtype in fp8 and not (a.dtype == b.dtype == torch.float8_e5m2)
                    and trans_b and not trans_a and out.dtype in (torch.bfloat16, torch.float16, torch.float32)
                    and m % 16 == 0 and n % 16 == 0 and k % 16 == 0)
        return a.dtype == b.dtype == out.dtype and a.dtype in (torch.bfloat16, torch.float16, torch.float32)

    def plan(self, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, trans_a: bool, trans_b: bool,
             accumulate: bool, sm_count: int = 0) -> _Plan:
        """The cached plan of this problem (beta = 0 and beta = 1 are separate problems: their fastest
        algorithms differ; so are SM count targets, ``sm_count`` > 0: kernels sized for that many SMs)."""
        alignments = tuple(pointer_alignment(t.data_ptr()) for t in (b, a, out, out))
        key = (tuple(a.shape), tuple(b.shape), trans_a, trans_b, a.dtype, b.dtype, out.dtype, accumulate, alignments,
               sm_count)
        p = self.plans.get(key)
        if p is None:
            m, n = out.shape
            p = self.plans[key] = _Plan(self.lib, self.handle, tuple(a.shape), tuple(b.shape), trans_a, trans_b,
                                        a.dtype, b.dtype, out.dtype, n, m, alignments, sm_count)
        return p

    # ---------------------------------------------------------------- running
    def _launch(self, p: _Plan, idx: int, out, a, b, a_descale, b_descale, accumulate: bool,
                side: bool = False) -> None:
        lib = self.lib
        workspace = self.side_workspace() if side else self.workspace
        if a.element_size() == 1:  # FP8: per-tensor scales (device fp32 scalars); other types take none
            for attr, t in ((_DESC_A_SCALE_POINTER, b_descale), (_DESC_B_SCALE_POINTER, a_descale)):
                ptr = ctypes.c_void_p(t.data_ptr())
                _check(lib.cublasLtMatmulDescSetAttribute(p.desc, attr, ctypes.byref(ptr), 8), "set scale pointer")
        stream = torch.cuda.current_stream(self.device)
        la, lb, lc, ld = p.layouts
        beta = self._one if accumulate else self._zero
        _check(lib.cublasLtMatmul(self.handle, p.desc, ctypes.byref(self._one), b.data_ptr(), la, a.data_ptr(), lb,
                                  ctypes.byref(beta), out.data_ptr(), lc, out.data_ptr(), ld,
                                  ctypes.byref(p.results[idx].algo), workspace.data_ptr(), _WORKSPACE_BYTES,
                                  stream.cuda_stream), "Matmul")

    def _tune(self, p: _Plan, run_candidate, fallback, out: torch.Tensor, accumulate: bool) -> int:
        """Time the fallback and each candidate on the real operands; returns the chosen index (-1: fallback).
        With ``accumulate`` the runs add into out again and again, so out is saved first and restored after
        (also when a run fails; a candidate that fails counts as infinitely slow). An accumulating problem whose
        out is too large to copy cheaply is not timed: the safe choice is kept."""
        safe = -1 if fallback is not None else 0
        if accumulate and out.numel() * out.element_size() > _TUNE_MAX_SAVED_BYTES:
            return safe
        torch.cuda.synchronize(self.device)  # nothing else running (e.g. wgrads on a side stream) while timing
        try:
            saved = out.clone() if accumulate else None
        except torch.cuda.OutOfMemoryError:  # no room for the copy: keep the safe choice, untimed
            return safe
        cands = ([-1] if fallback is not None else []) + list(range(p.count))
        times = []
        try:
            for idx in cands:
                fn = fallback if idx < 0 else (lambda i=idx: run_candidate(i))
                try:
                    fn()  # warm-up (and any lazy set-up of the fallback)
                except CublasLtError:
                    times.append(float("inf"))
                    continue
                events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                          for _ in range(_TUNE_REPS)]
                for start, end in events:
                    start.record()
                    fn()
                    end.record()
                end.synchronize()
                times.append(sorted(s.elapsed_time(e) for s, e in events)[_TUNE_REPS // 2])
        finally:
            if saved is not None:
                out.copy_(saved)
        p.timings = times
        if min(times) == float("inf"):
            raise CublasLtError(f"no cuBLASLt candidate ran for out{list(out.shape)} ({out.dtype})")
        best = min(range(len(cands)), key=times.__getitem__)
        if fallback is not None and times[best] > (1.0 - _MARGIN) * times[0]:
            return -1
        return cands[best]

    def gemm(self, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, trans_a: bool = False,
             trans_b: bool = True, a_descale: torch.Tensor | None = None, b_descale: torch.Tensor | None = None,
             accumulate: bool = False, fallback=None, algo_index: int | None = None, sm_count: int = 0) -> None:
        """out[M, N] (+)= op(a) @ op(b) (FP8: times a_descale * b_descale). ``accumulate``: beta = 1.
        ``fallback``: a callable doing the same with the caller's usual library call, tuned against (above).
        ``algo_index`` forces a candidate (benchmarks). ``sm_count``: run on about that many SMs (cuBLASLt's
        SM count target; 0 = all), for a GEMM that shares the GPU with a concurrent stream; such a GEMM uses its
        stream's side workspace and needs ``algo_index`` (timed alone, it would not show how it runs beside
        others). Check ``supports`` first; FP8 descales are fp32 tensors of one element (per-tensor scaling)."""
        if a.element_size() == 1 and not all(t is not None and t.dtype == torch.float32 and t.numel() == 1
                                             for t in (a_descale, b_descale)):
            raise CublasLtError("FP8 GEMM: a_descale and b_descale must be fp32 tensors of one element")
        if sm_count and algo_index is None:
            raise CublasLtError("a GEMM with an SM count target takes an explicit algo_index")
        p = self.plan(out, a, b, trans_a, trans_b, accumulate, sm_count)
        if algo_index is not None:
            if not 0 <= algo_index < p.count:
                raise CublasLtError(f"algorithm {algo_index} of {p.count}")
            self._launch(p, algo_index, out, a, b, a_descale, b_descale, accumulate, side=sm_count > 0)
            return
        if p.choice is None:
            if torch.cuda.is_current_stream_capturing():  # no timing inside a capture: pin the safe choice, so
                p.choice = idx = -1 if fallback is not None else 0  # eager calls and the replays agree
            else:
                p.choice = idx = self._tune(
                    p, lambda i: self._launch(p, i, out, a, b, a_descale, b_descale, accumulate), fallback, out,
                    accumulate)
        else:
            idx = p.choice
        if idx < 0 and fallback is None:  # tuned with a fallback by another caller: take the heuristic's first
            idx = 0
        if idx < 0:
            fallback()
        else:
            self._launch(p, idx, out, a, b, a_descale, b_descale, accumulate)

    def matmul(self, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_descale: torch.Tensor,
               b_descale: torch.Tensor, accumulate: bool, algo_index: int | None = None) -> None:
        """FP8 "TN": out (+)= (a[M, K] * a_descale) @ (b[N, K] * b_descale)^T (``Backend.matmul_fp8``'s form)."""
        self.gemm(out, a, b, trans_b=True, a_descale=a_descale, b_descale=b_descale, accumulate=accumulate,
                  algo_index=algo_index)


_instances: dict[int, CublasLt] = {}


def for_device(device: torch.device) -> CublasLt:
    """The per-device instance (created on first use)."""
    idx = torch.device(device).index
    idx = torch.cuda.current_device() if idx is None else idx
    inst = _instances.get(idx)
    if inst is None:
        inst = _instances[idx] = CublasLt(torch.device("cuda", idx))
    return inst
