"""Per-kernel times of the fast backends at Qwen2.5-0.5B shapes, as a markdown table.

    python3 benchmarks/kernel_timing.py                       # triton and cupy, bf16, B=16 x T=1024 tokens
    python3 benchmarks/kernel_timing.py --backends triton,cupy,torch --reps 50

Shapes: N = B*T = 16384 rows, hidden 896, intermediate 4864, 14 query / 2 kv heads of 64, vocab 151936 (the
classifier over 2048 rows: one LM-head chunk of 8); AdamW over 494M parameters as the engine runs it (bf16
param and grad, fp32 master, bf16 m and v). Each time is the median over ``--reps`` calls, each timed on
its own with CUDA events after warm-up calls (which also compile / load the kernels). "GB/s" is the bytes
the kernel must move at least (read once, write once), over the median time: memory-bound kernels should
come close to the copy bandwidth (~3.0 TB/s H100, ~4.3 TB/s H200).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmq_ray.backends import get_backend  # noqa: E402

DEV = "cuda"
B, T, C, I, V, HQ, HKV, D = 16, 1024, 896, 4864, 151936, 14, 2, 64
N = B * T
CLS_ROWS = 2048
N_PARAMS = 494_032_768


def median_ms(fn, reps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def build_cases():
    """name -> (callable(backend), bytes moved at least). Tensors are shared by all backends."""
    bf, f32 = torch.bfloat16, torch.float32
    g = torch.Generator(device=DEV).manual_seed(0)

    def rnd(*shape, dtype=bf, scale=1.0):
        return (torch.randn(*shape, generator=g, device=DEV) * scale).to(dtype)

    x, y, w = rnd(N, C), rnd(N, C), (1 + 0.1 * rnd(C, dtype=f32)).to(bf)
    res, out, dx = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)
    rstd, amax = torch.empty(N, device=DEV), torch.empty((), device=DEV)
    dw = torch.zeros(C, dtype=bf, device=DEV)
    ug, sw = rnd(N, 2 * I, scale=2.0), torch.empty(N, I, dtype=bf, device=DEV)
    dug = torch.empty_like(ug)
    qkv = rnd(B, T, HQ + 2 * HKV, D)
    ang = torch.arange(T, device=DEV, dtype=f32)[:, None] * torch.rand(D // 2, device=DEV)[None, :]
    cos, sin = ang.cos(), ang.sin()
    logits = rnd(CLS_ROWS, V, scale=4.0)
    targets = torch.randint(0, V, (CLS_ROWS,), device=DEV)
    losses = torch.empty(CLS_ROWS, device=DEV)
    q8, q8t = torch.empty(N, C, dtype=torch.float8_e4m3fn, device=DEV), torch.empty(C, N, dtype=torch.float8_e4m3fn, device=DEV)
    q8i = torch.empty(N, I, dtype=torch.float8_e4m3fn, device=DEV)
    ds = torch.empty((), device=DEV)
    tokens = torch.randint(0, V, (N,), device=DEV)
    table = rnd(V, C)
    dtab = torch.zeros(V, C, dtype=bf, device=DEV)
    p, grad = rnd(N_PARAMS, scale=0.02), rnd(N_PARAMS, scale=1e-3)
    master, m, v = p.float(), torch.zeros(N_PARAMS, dtype=bf, device=DEV), torch.zeros(N_PARAMS, dtype=bf, device=DEV)
    norm = torch.zeros((), device=DEV)
    nc, nc2 = N * C * 2, N * 2 * I * 2

    def adamw(be):
        be.adamw_update(p, grad, m, v, master=master, lr=1e-9, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0,
                        step=10, grad_scale=1.0, seed=0)

    return {
        "embedding_forward": (lambda be: be.embedding_forward(out, tokens, table), 2 * nc),
        "embedding_backward": (lambda be: be.embedding_backward(dtab, tokens, x), 3 * nc),
        "rmsnorm_forward+absmax": (lambda be: be.rmsnorm_forward(out, rstd, x, w, 1e-6, absmax=amax), 2 * nc),
        "fused_residual_rmsnorm+absmax": (
            lambda be: be.fused_residual_rmsnorm_forward(res, out, rstd, x, y, w, 1e-6, absmax=amax), 4 * nc),
        "rmsnorm_backward (+dresidual)": (lambda be: be.rmsnorm_backward(dx, dw, x, y, w, rstd, dresidual=dx), 4 * nc),
        "rope_forward": (lambda be: be.rope_forward(qkv, cos, sin, HQ, HKV), 2 * B * T * (HQ + HKV) * D * 2),
        "rope_backward": (lambda be: be.rope_backward(qkv, cos, sin, HQ, HKV), 2 * B * T * (HQ + HKV) * D * 2),
        "swiglu_forward+absmax": (lambda be: be.swiglu_forward(sw, ug, absmax=amax), nc2 + nc2 // 2),
        "swiglu_backward": (lambda be: be.swiglu_backward(dug, sw, ug), 2 * nc2 + nc2 // 2),
        "absmax [N,C]": (lambda be: be.absmax(amax, x), nc),
        "quantize e4m3 [N,C]": (lambda be: be.quantize(q8, ds, x, amax), nc + nc // 2),
        "quantize e4m3 [N,I]": (lambda be: be.quantize(q8i, ds, sw, amax), nc2 // 2 + nc2 // 4),
        "quantize_transpose e4m3 [N,C]": (lambda be: be.quantize_transpose(q8t, ds, x, amax), nc + nc // 2),
        "quantize_with_transpose e4m3 [N,C]": (lambda be: be.quantize_with_transpose(q8, q8t, ds, x, amax), 2 * nc),
        f"fused_classifier {CLS_ROWS}xV (loss+dlogits)": (
            lambda be: be.fused_classifier(logits, losses, targets, 1.0 / N, write_dlogits=True), 3 * CLS_ROWS * V * 2),
        f"fused_classifier {CLS_ROWS}xV (loss only)": (
            lambda be: be.fused_classifier(logits, losses, targets, 1.0, write_dlogits=False), CLS_ROWS * V * 2),
        "global_norm_squared 494M bf16": (lambda be: be.global_norm_squared(norm, grad), N_PARAMS * 2),
        "adamw 494M (bf16 p/g/m/v, fp32 master)": (adamw, N_PARAMS * (2 + 2 + 2 * 2 * 2 + 4 * 2)),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="triton,cupy", help="comma list of backends (torch is slow at 494M)")
    ap.add_argument("--reps", type=int, default=30, help="timed calls per kernel and backend (median reported)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("kernel_timing.py needs a CUDA GPU", file=sys.stderr)
        return 1
    names = [b for b in args.backends.split(",") if b]
    backends = {name: get_backend(name, DEV) for name in names}
    cases = build_cases()
    rows = []
    for case, (fn, nbytes) in cases.items():
        times = {}
        for name, be in backends.items():
            try:
                times[name] = median_ms(lambda: fn(be), args.reps)
            except Exception as exc:  # noqa: BLE001 - one failing kernel should not hide the rest of the table
                print(f"{case} / {name}: {type(exc).__name__}: {exc}", file=sys.stderr)
                times[name] = float("nan")
        rows.append((case, nbytes, times))
    gpu = torch.cuda.get_device_name()
    print(f"Kernel times on {gpu}, median of {args.reps} CUDA-event-timed calls, bf16, "
          f"B={B} T={T} C={C} I={I} V={V} heads {HQ}/{HKV}x{D}\n")
    head = "| kernel | " + " | ".join(f"{n} ms" for n in names) + " | " + " | ".join(f"{n} GB/s" for n in names)
    if len(names) >= 2:
        head += f" | {names[1]}/{names[0]}"
    print(head + " |")
    print("|---" * (1 + 2 * len(names) + (1 if len(names) >= 2 else 0)) + "|")
    totals = {n: 0.0 for n in names}
    for case, nbytes, times in rows:
        cells = [f"{times[n]:.3f}" for n in names] + [f"{nbytes / times[n] / 1e6:.0f}" for n in names]
        if len(names) >= 2:
            cells.append(f"{times[names[1]] / times[names[0]]:.2f}")
        for n in names:
            totals[n] += times[n]
        print(f"| {case} | " + " | ".join(cells) + " |")
    print("| **sum** | " + " | ".join(f"{totals[n]:.3f}" for n in names) + " |" + " |" * (len(names) + (1 if len(names) >= 2 else 0)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
