"""The MLP's SwiGLU fused into the GEMMs next to it (model dtype only; the FP8 path keeps its own kernels).

Forward, ``up_gate_swiglu``: one GEMM computes a [BLOCK_M, BLOCK_N] tile of the up projection *and* the same
columns of the gate projection (two accumulators over the same x tile: the weight is [W_up; W_gate], so
columns c and I + c of up_gate = x W^T), stores both (the backward needs them) and, from the stored values,
the SwiGLU output up * silu(gate). Against the GEMM followed by ``swiglu_forward`` this skips reading the
[N, 2I] up_gate back (2 x 2I bytes per token in bf16) and one launch per layer.

Backward, ``down_dgrad_swiglu_backward``: the down projection's dgrad d_s = dy W_down [N, I] never reaches
memory; its epilogue reads up and gate for the tile and writes the SwiGLU gradient [d up | d gate] straight
into d_up_gate [N, 2I]. Against the dgrad followed by ``swiglu_backward`` this skips writing and reading
d_s (2 x I x 2 bytes per token) and one launch per layer.

Both give the same values as the unfused pair up to the GEMM's summation order: the epilogues round the
accumulator to the model dtype first and then run the arithmetic of backends/triton/swiglu.py, exactly as the
separate kernel does on the stored tensor.

The GEMMs are persistent (one program per SM walking the tiles in grouped order, so neighbouring programs
share weight columns in L2) and load their operands with TMA tensor descriptors (Hopper and newer); tile
shapes are picked per problem on the GPU by timing each candidate at the problem's first call (``_tune``). Under the Triton interpreter (CPU tests) they run with one small
fixed tile shape, loading through the same descriptors, with the dot in fp32 (the interpreter's bf16
arithmetic is wrong, ../shared/ENVIRONMENT.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from backends.triton._common import INTERPRET, SOFT_CVT, cast_to


@triton.jit
def _tile_origin(tile, num_m, num_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Row and column origin of tile number ``tile``: GROUP_M row blocks at a time sweep all column blocks,
    so the programs running together share a few weight column blocks (L2 reuse)."""
    per_group = GROUP_M * num_n
    first_m = (tile // per_group) * GROUP_M
    rows_in_group = tl.minimum(num_m - first_m, GROUP_M)
    pm = first_m + (tile % per_group) % rows_in_group
    pn = (tile % per_group) // rows_in_group
    return pm * BLOCK_M, pn * BLOCK_N


@triton.jit
def _up_gate_swiglu_kernel(x_desc, wu_desc, wg_desc, u_desc, g_desc, s_desc, M, I, K,
                           OUT_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, FLATTEN: tl.constexpr):
    """u = x W_up^T, g = x W_gate^T (x [M, K], W_* [I, K]), s = u * silu(g), all [M, I] in OUT_DTYPE."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(I, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_m * num_n, tl.num_programs(0), flatten=FLATTEN):
        om, on = _tile_origin(tile, num_m, num_n, BLOCK_M, BLOCK_N, GROUP_M)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kt in range(k_tiles):
            ok = kt * BLOCK_K
            a = x_desc.load([om, ok])
            bu = wu_desc.load([on, ok])
            bg = wg_desc.load([on, ok])
            if SOFT_CVT:  # interpreter: bf16 dot is wrong there
                a, bu, bg = a.to(tl.float32), bu.to(tl.float32), bg.to(tl.float32)
            acc_u = tl.dot(a, bu.T, acc_u)
            acc_g = tl.dot(a, bg.T, acc_g)
        up = cast_to(acc_u, OUT_DTYPE)
        gate = cast_to(acc_g, OUT_DTYPE)
        u_desc.store([om, on], up)
        g_desc.store([om, on], gate)
        upf = up.to(tl.float32)
        gatef = gate.to(tl.float32)
        s_desc.store([om, on], cast_to(upf * (gatef / (1.0 + tl.exp(-gatef))), OUT_DTYPE))


@triton.jit
def _down_dgrad_swiglu_kernel(dy_desc, w_desc, u_desc, g_desc, du_desc, dg_desc, M, I, K,
                              OUT_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, FLATTEN: tl.constexpr):
    """ds = dy W (dy [M, K], W [K, I]), rounded to OUT_DTYPE; then, with u, g [M, I] the forward's up and gate:
    du = ds * silu(g), dg = ds * u * silu'(g), written in OUT_DTYPE."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(I, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_m * num_n, tl.num_programs(0), flatten=FLATTEN):
        om, on = _tile_origin(tile, num_m, num_n, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kt in range(k_tiles):
            ok = kt * BLOCK_K
            a = dy_desc.load([om, ok])
            b = w_desc.load([ok, on])
            if SOFT_CVT:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc)
        ds = cast_to(acc, OUT_DTYPE).to(tl.float32)
        up = u_desc.load([om, on]).to(tl.float32)
        gate = g_desc.load([om, on]).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-gate))
        du_desc.store([om, on], cast_to(ds * (gate * sig), OUT_DTYPE))
        dg_desc.store([om, on], cast_to(ds * up * sig * (1.0 + gate * (1.0 - sig)), OUT_DTYPE))


_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}

# Which of the block sizes make each descriptor's tile.
_FWD_DESCS = {"x_desc": "MK", "wu_desc": "NK", "wg_desc": "NK", "u_desc": "MN", "g_desc": "MN", "s_desc": "MN"}
_BWD_DESCS = {"dy_desc": "MK", "w_desc": "KN", "u_desc": "MN", "g_desc": "MN", "du_desc": "MN", "dg_desc": "MN"}
# Tile shapes (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps) tried on the GPU, each with and without the flattened
# (pipelined across tiles) persistent loop. The forward's BLOCK_N is per accumulator: its two make a
# [BLOCK_M, 2 BLOCK_N] tile.
_FWD_SHAPES = [(128, 128, 64, 3, 8), (128, 128, 64, 4, 8), (128, 64, 64, 4, 4), (128, 64, 64, 5, 8),
               (64, 128, 64, 4, 4)]
_BWD_SHAPES = [(128, 256, 64, 3, 8), (128, 128, 64, 4, 8), (128, 128, 64, 5, 4), (64, 256, 64, 4, 8),
               (128, 64, 64, 5, 4)]
_INTERPRET_SHAPE = (16, 16, 16, 1, 4)
# problem -> the chosen (shape, flatten); filled by _tune at a problem's first (eager) call
_chosen: dict[tuple, tuple] = {}


def _run(kernel, descs: dict, layout: dict, m: int, i: int, k: int, out_dtype, shape, flatten: bool,
         programs: int) -> None:
    bm, bn, bk, stages, warps = shape
    sizes = {"M": bm, "N": bn, "K": bk}
    for name, dims in layout.items():
        descs[name].block_shape = [sizes[d] for d in dims]
    tiles = triton.cdiv(m, bm) * triton.cdiv(i, bn)
    kernel[(min(programs, tiles),)](**descs, M=m, I=i, K=k, OUT_DTYPE=_TL[out_dtype], BLOCK_M=bm, BLOCK_N=bn,
                                    BLOCK_K=bk, GROUP_M=8, FLATTEN=flatten, num_stages=stages, num_warps=warps)


def _tune(kernel, descs, layout, m, i, k, out_dtype, shapes, programs) -> tuple:
    """The fastest (shape, flatten) for this problem: each candidate compiled and run once (one that fails to
    compile or launch, e.g. out of shared memory, is skipped), then timed (median of 5). The kernels only
    overwrite their outputs, so running them here on the real tensors is harmless."""
    timings = []
    for shape in shapes:
        for flatten in (False, True):
            try:
                _run(kernel, descs, layout, m, i, k, out_dtype, shape, flatten, programs)
            except Exception:  # noqa: BLE001 -- a tile shape this GPU / compiler cannot run is just not a candidate
                continue
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(5)]
            for start, end in events:
                start.record()
                _run(kernel, descs, layout, m, i, k, out_dtype, shape, flatten, programs)
                end.record()
            torch.cuda.synchronize()
            timings.append((sorted(s.elapsed_time(e) for s, e in events)[2], shape, flatten))
    if not timings:
        raise RuntimeError(f"swiglu_gemm: no tile shape of {kernel.__name__} runs for M={m} I={i} K={k}")
    return min(timings)[1:]


def _launch(kernel, descs: dict, layout: dict, shapes, m: int, i: int, k: int, out_dtype: torch.dtype) -> None:
    if INTERPRET:
        _run(kernel, descs, layout, m, i, k, out_dtype, _INTERPRET_SHAPE, False, programs=4)
        return
    key = (kernel.__name__, m, i, k, out_dtype, descs[next(iter(descs))].base.device.index)
    if key not in _chosen:
        _chosen[key] = _tune(kernel, descs, layout, m, i, k, out_dtype, shapes,
                             torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count)
    shape, flatten = _chosen[key]
    _run(kernel, descs, layout, m, i, k, out_dtype, shape, flatten,
         torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count)


def chosen() -> dict:
    """{(kernel, M, I, K, dtype, device): ((BLOCK_M, BLOCK_N, BLOCK_K, stages, warps), flatten)} so far."""
    return dict(_chosen)


def supported(half: int, *tensors: torch.Tensor) -> bool:
    """Whether the fused kernels can take these 2-D tensors, whose halves at column (or row) ``half`` become
    separate descriptors: CUDA on compute capability >= 9 (TMA) with a 16-bit model dtype, or the interpreter; one dtype, contiguous,
    16-byte aligned starts, row strides and half offsets (TMA's rules)."""
    x = tensors[0]
    if x.dtype not in _TL or any(t.dtype != x.dtype or t.dim() != 2 or not t.is_contiguous() for t in tensors):
        return False
    if x.device.type == "cuda":  # fp32 would run as TF32 in tl.dot: less exact than torch's fp32 GEMM
        if x.dtype == torch.float32 or torch.cuda.get_device_capability(x.device)[0] < 9:
            return False
    elif not INTERPRET:
        return False
    elem = x.element_size()
    return (half * elem) % 16 == 0 and all(t.data_ptr() % 16 == 0 and (t.shape[1] * elem) % 16 == 0
                                           for t in tensors)


def _desc(t: torch.Tensor) -> TensorDescriptor:
    """A descriptor over t (2-D, unit last stride); its block shape is set per launch."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [16, 16])


def up_gate_swiglu(up_gate: torch.Tensor, out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """up_gate[N, 2I] = x[N, K] w[2I, K]^T with w = [W_up; W_gate]; out[N, I] = up * silu(gate) of the stored
    up_gate values (model dtype, fp32 accumulation)."""
    n, k = x.shape
    i = w.shape[0] // 2
    descs = {"x_desc": _desc(x), "wu_desc": _desc(w[:i]), "wg_desc": _desc(w[i:]),
             "u_desc": _desc(up_gate[:, :i]), "g_desc": _desc(up_gate[:, i:]), "s_desc": _desc(out)}
    _launch(_up_gate_swiglu_kernel, descs, _FWD_DESCS, _FWD_SHAPES, n, i, k, out.dtype)


def down_dgrad_swiglu_backward(d_up_gate: torch.Tensor, dy: torch.Tensor, w: torch.Tensor,
                               up_gate: torch.Tensor) -> None:
    """d_up_gate[N, 2I] = swiglu_backward(dy[N, C] w[C, I], up_gate[N, 2I]): the down projection's dgrad
    (w = W_down [C, I]) rounded to the model dtype, then [d up | d gate] as backends/triton/swiglu.py."""
    n, c = dy.shape
    i = w.shape[1]
    descs = {"dy_desc": _desc(dy), "w_desc": _desc(w), "u_desc": _desc(up_gate[:, :i]),
             "g_desc": _desc(up_gate[:, i:]), "du_desc": _desc(d_up_gate[:, :i]),
             "dg_desc": _desc(d_up_gate[:, i:])}
    _launch(_down_dgrad_swiglu_kernel, descs, _BWD_DESCS, _BWD_SHAPES, n, i, c, d_up_gate.dtype)
