"""Survey of the GEMMs of one model's micro-step: torch's choice against each of cuBLASLt's heuristic candidates.

For the four block linears of a preset (forward, dgrad, wgrad shapes at B x T tokens), in FP8 (e4m3 x e4m3;
wgrad also e5m2 x e4m3 is what --gradient-dtype e5m2 runs) and bf16, prints the median time of
``torch._scaled_mm`` / ``torch.mm`` and of every candidate algorithm cuBLASLt's heuristic offers through
backends/cublaslt.py (same "TN" layout), with beta = 0 and, for wgrad, beta = 1 (the accumulation of micro-steps
after the first). The question it answers: would picking algorithms by timing (instead of the heuristic's first)
or the fused beta = 1 pay, and by how much per shape.

    python benchmarks/gemm_algos.py --model Qwen2.5-1.5B --tokens 16384
    python benchmarks/gemm_algos.py --model Qwen2.5-1.5B --kinds bf16,bf16+= --sustain-ms 200   # under load
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llmq_ray.backends import cublaslt  # noqa: E402
from benchmarks.kernel_timing import median_ms  # noqa: E402
from llmq_ray.model.config import PRESETS  # noqa: E402


def shapes(cfg, tokens: int) -> list[tuple[str, int, int, int]]:
    """(name, M, N, K) of out[M, N] = a[M, K] b[N, K]^T for each linear's forward, dgrad and wgrad."""
    h, i, qkv, att = cfg.hidden_size, cfg.intermediate_size, cfg.qkv_channels, cfg.attn_channels
    out = []
    for name, oc, ic in (("qkv", qkv, h), ("att_out", h, att), ("up_gate", 2 * i, h), ("down", h, i)):
        out += [(f"{name}.fwd", tokens, oc, ic), (f"{name}.dgrad", tokens, ic, oc), (f"{name}.wgrad", oc, ic, tokens)]
    return out


def timed(fn, reps: int, sustain_ms: float) -> float:
    """median_ms of fn, after running it back to back for ``sustain_ms`` (checked every 16 calls)."""
    if sustain_ms > 0:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        while True:
            for _ in range(16):
                fn()
            end.record()
            end.synchronize()
            if start.elapsed_time(end) >= sustain_ms:
                break
    return median_ms(fn, reps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="Qwen2.5-1.5B", choices=sorted(PRESETS))
    p.add_argument("--tokens", type=int, default=16384, help="tokens per micro-step (B x T)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--kinds", default="e4m3,bf16,e4m3+=,bf16+=", help="comma list of e4m3, bf16, e4m3+=, bf16+=")
    p.add_argument("--sustain-ms", type=float, default=0.0,
                   help="run each GEMM back to back this long before timing it, so that it is timed at the "
                        "clock the 700 W cap allows under sustained load (as inside a training step)")
    args = p.parse_args()
    wanted = set(args.kinds.split(","))
    cfg = PRESETS[args.model]
    lt = cublaslt.for_device(torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    one = torch.tensor(1.0, device="cuda")
    totals = {}
    print(f"{'gemm':16} {'kind':10} {'torch ms':>9} {'lt#0 ms':>9} {'best ms':>9} {'best':>5} {'TFLOP/s':>8}  "
          f"candidates (ms)")
    for name, m, n, k in shapes(cfg, args.tokens):
        flop = 2.0 * m * n * k
        kinds = [("e4m3", torch.float8_e4m3fn, False), ("bf16", torch.bfloat16, False)]
        if name.endswith("wgrad"):
            kinds += [("e4m3+=", torch.float8_e4m3fn, True), ("bf16+=", torch.bfloat16, True)]
        for kind, dtype, acc in kinds:
            if kind not in wanted:
                continue
            a = torch.randn(m, k, device="cuda", generator=gen).mul_(30 if dtype != torch.bfloat16 else 1).to(dtype)
            b = torch.randn(n, k, device="cuda", generator=gen).mul_(30 if dtype != torch.bfloat16 else 1).to(dtype)
            out = torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16)
            if dtype == torch.bfloat16:
                ref = (lambda: torch.addmm(out, a, b.t(), out=out)) if acc else (lambda: torch.mm(a, b.t(), out=out))
            elif acc:  # what the torch path does: a temporary, then an add
                ref = lambda: out.add_(torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one,  # noqa: E731
                                                        out_dtype=torch.bfloat16))
            else:
                ref = lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one,  # noqa: E731
                                               out_dtype=torch.bfloat16, out=out)
            t_ref = timed(ref, args.reps, args.sustain_ms)
            plan = lt.plan(out, a, b, False, True, acc)
            cands = [timed(lambda j=j: lt.matmul(out, a, b, one, one, accumulate=acc, algo_index=j), args.reps,
                           args.sustain_ms)
                     for j in range(plan.count)]
            best = min(range(len(cands)), key=cands.__getitem__)
            tot = totals.setdefault(kind, [0.0, 0.0, 0.0])
            tot[0] += t_ref
            tot[1] += cands[0]
            tot[2] += cands[best]
            print(f"{name:16} {kind:10} {t_ref:9.3f} {cands[0]:9.3f} {cands[best]:9.3f} {'#' + str(best):>5} "
                  f"{flop / cands[best] / 1e9:8.0f}  " + " ".join(f"{c:.3f}" for c in cands))
    for kind, (t_ref, t0, tb) in totals.items():
        print(f"GEMMALGOS total {kind:8} torch {t_ref:8.3f} ms  lt#0 {t0:8.3f} ms  best-of-candidates {tb:8.3f} ms "
              f"({100 * (t_ref - tb) / t_ref:+.1f}% vs torch)")


if __name__ == "__main__":
    main()
