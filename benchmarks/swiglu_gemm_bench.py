"""The SwiGLU fused into its GEMMs (backends/triton/swiglu_gemm.py) against the GEMM and the SwiGLU kernel apart.

For each model's MLP at B x T tokens, the median time (ms) of
  forward:  up+gate GEMM (the Triton backend's tuned cuBLAS(Lt) call) + swiglu_forward   vs   the fused kernel
  backward: down dgrad (tuned cuBLAS(Lt)) + swiglu_backward                              vs   the fused kernel
and each GEMM alone, with the TFLOP/s of the GEMMs and the autotuned tile shape chosen for the fused kernels.

    python benchmarks/swiglu_gemm_bench.py --model Qwen2.5-1.5B --tokens 16384
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backends import get_backend  # noqa: E402
from backends.triton import swiglu_gemm  # noqa: E402
from benchmarks.kernel_timing import median_ms  # noqa: E402
from llmq_ray.config import PRESETS  # noqa: E402


def bench(model: str, tokens: int, reps: int) -> None:
    cfg = PRESETS[model]
    c, i, n, bf = cfg.hidden_size, cfg.intermediate_size, tokens, torch.bfloat16
    tri = get_backend("triton", "cuda")
    x = torch.randn(n, c, device="cuda", dtype=bf)
    w_ug = torch.randn(2 * i, c, device="cuda", dtype=bf) * c ** -0.5
    w_down = torch.randn(c, i, device="cuda", dtype=bf) * i ** -0.5
    dy = torch.randn(n, c, device="cuda", dtype=bf)
    ug, out = torch.empty(n, 2 * i, device="cuda", dtype=bf), torch.empty(n, i, device="cuda", dtype=bf)
    dug, d_out = torch.empty_like(ug), torch.empty_like(out)

    def fwd_gemm():
        tri.matmul(ug, x, w_ug, transpose_b=True)

    def fwd_apart():
        fwd_gemm()
        tri.swiglu_forward(out, ug)

    def bwd_gemm():
        tri.matmul(d_out, dy, w_down)

    def bwd_apart():
        bwd_gemm()
        tri.swiglu_backward(dug, d_out, ug)

    def fwd_fused():
        swiglu_gemm.up_gate_swiglu(ug, out, x, w_ug)

    def bwd_fused():
        swiglu_gemm.down_dgrad_swiglu_backward(dug, dy, w_down, ug)

    flop_f, flop_b = 2 * n * c * 2 * i, 2 * n * c * i
    rows = []
    for name, fn, flop in (("fwd GEMM alone (cuBLAS)", fwd_gemm, flop_f), ("fwd GEMM + swiglu", fwd_apart, flop_f),
                           ("fwd fused", fwd_fused, flop_f), ("bwd dgrad alone (cuBLAS)", bwd_gemm, flop_b),
                           ("bwd dgrad + swiglu_backward", bwd_apart, flop_b), ("bwd fused", bwd_fused, flop_b)):
        fn()  # tuning / autotuning outside the timing
        ms = median_ms(fn, reps)
        rows.append((name, ms, flop / ms / 1e9))
    print(f"\n{model}: N={n} C={c} I={i}")
    for name, ms, tflops in rows:
        print(f"  {name:32s} {ms:8.3f} ms  {tflops:6.0f} TFLOP/s (GEMM FLOPs)")
    for key, choice in swiglu_gemm.chosen().items():
        if key[1:4] == (n, i, c):
            print(f"  {key[0]}: (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps), flatten = {choice}")
    gain = (rows[1][1] - rows[2][1]) + (rows[4][1] - rows[5][1])
    print(f"RESULT swiglu_gemm model={model} fwd_apart={rows[1][1]:.3f} fwd_fused={rows[2][1]:.3f} "
          f"bwd_apart={rows[4][1]:.3f} bwd_fused={rows[5][1]:.3f} saved_per_layer_ms={gain:.3f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", help="preset name (repeatable)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[16384], help="B x T per model (one, or one each)")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    models = args.model or ["Qwen2.5-0.5B", "Qwen2.5-1.5B"]
    tokens = args.tokens * len(models) if len(args.tokens) == 1 else args.tokens
    for model, n in zip(models, tokens):
        bench(model, n, args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
