"""Time the tile shapes of the Triton kernels that write an FP8 tensor transposed in one pass, at the shapes
the models run, and check that every tile shape writes the same bytes.

    python3 benchmarks/fp8_tiles.py                 # every kind, every candidate, the 0.5B / 1.5B / 7B shapes
    python3 benchmarks/fp8_tiles.py --kinds swiglu_bwd --reps 30

Kinds (keys of ``llmq_ray.backends.triton.fp8.TILES``): "quantize" (quantize_with_transpose of an activation or
gradient [N, K], quantize_transpose of a weight [OC, K]), "swiglu_fwd" / "swiglu_bwd" (the SwiGLU's delayed-
scale FP8 kernels over up+gate [N, 2I]). For each (kind, shape) every candidate (BLOCK_M, BLOCK_K, num_warps)
is set in TILES, run, compared byte for byte with the current default's output (a tile shape that writes
anything else is reported as WRONG and never picked), and timed: median of ``--reps`` CUDA-event timings
after warm-up. GB/s counts the bytes the kernel must move (read once, write once). Memory-bound kernels run
near 3.0 TB/s on an H100 when their stores coalesce; the transposed FP8 store is what the tile shape changes.
Last line per kind: the candidate with the least summed time over the shapes (the table in fp8.py is edited
by hand from it). Each shape's bytes are compared with those of the table's entry at the start.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmq_ray.backends.triton import fp8 as tfp8  # noqa: E402
from llmq_ray.backends.triton import swiglu as tswiglu  # noqa: E402
from benchmarks.kernel_timing import median_ms  # noqa: E402  (CUDA-event median)

E4M3 = torch.float8_e4m3fn
CANDIDATES = [(64, 64, 4), (64, 64, 8), (128, 64, 4), (128, 64, 8), (64, 128, 4), (64, 128, 8), (128, 128, 4),
              (128, 128, 8), (32, 128, 4), (128, 32, 4), (256, 64, 8), (64, 256, 8), (256, 128, 8), (32, 64, 2),
              (32, 64, 4), (32, 128, 8), (64, 32, 4), (64, 64, 16), (16, 128, 4), (32, 64, 8), (32, 256, 8)]
# (name, N tokens per micro-step, hidden C, intermediate I, qkv width, a weight [OC, K] to quantize transposed)
MODELS = [("0.5B B=32", 32768, 896, 4864, 1152), ("1.5B B=16", 16384, 1536, 8960, 2048),
          ("7B B=6", 6144, 3584, 18944, 4608)]


def cases(kind: str):
    """(label, run() -> the outputs to compare, bytes moved) per model shape."""
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    for name, n, c, i, qkv in MODELS:
        if kind == "quantize":
            for label, (m, k), both in ((f"{name} x [N, C]", (n, c), True), (f"{name} dy [N, qkv]", (n, qkv), True),
                                        (f"{name} W^T up+gate [2I, C]", (2 * i, c), False),
                                        (f"{name} W^T down [C, I]", (c, i), False)):
                x = torch.randn(m, k, generator=g, device=dev).to(torch.bfloat16)
                amax = x.float().abs().max().reshape(())
                q, qt, ds = torch.empty(m, k, dtype=E4M3, device=dev), torch.empty(k, m, dtype=E4M3, device=dev), \
                    torch.empty((), device=dev)
                if both:
                    def run(q=q, qt=qt, ds=ds, x=x, amax=amax):
                        tfp8.quantize_with_transpose(q, qt, ds, x, amax)
                        return q.view(torch.uint8), qt.view(torch.uint8), ds
                else:
                    def run(qt=qt, ds=ds, x=x, amax=amax):
                        tfp8.quantize_transpose(qt, ds, x, amax)
                        return qt.view(torch.uint8), ds
                yield label, run, m * k * (2 + (2 if both else 1))
            continue
        inp = (torch.randn(n, 2 * i, generator=g, device=dev) * 2).to(torch.bfloat16)
        q, qt = torch.empty(n, i, dtype=E4M3, device=dev), torch.empty(i, n, dtype=E4M3, device=dev)
        ds, amax, scale = torch.empty((), device=dev), torch.empty((), device=dev), torch.full((), 4.0, device=dev)
        if kind == "swiglu_fwd":
            def run(q=q, qt=qt, ds=ds, inp=inp, amax=amax, scale=scale):
                tswiglu.swiglu_forward_fp8(q, qt, ds, inp, amax, scale, torch.bfloat16)
                return q.view(torch.uint8), qt.view(torch.uint8), ds, amax.clone()
            yield f"{name} [N, 2I] -> [N, I]", run, n * i * (4 + 2)
        else:
            dout = torch.randn(n, i, generator=g, device=dev).to(torch.bfloat16)
            q2, qt2 = torch.empty(n, 2 * i, dtype=E4M3, device=dev), torch.empty(2 * i, n, dtype=E4M3, device=dev)

            def run(q=q2, qt=qt2, ds=ds, dout=dout, inp=inp, amax=amax, scale=scale):
                tswiglu.swiglu_backward_fp8(q, qt, ds, dout, inp, amax, torch.bfloat16, scale_absmax=scale)
                return q.view(torch.uint8), qt.view(torch.uint8), ds, amax.clone()
            yield f"{name} [N, 2I] + dout -> [N, 2I]", run, n * i * (6 + 4)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", default="quantize,swiglu_fwd,swiglu_bwd")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    for kind in args.kinds.split(","):
        default = tfp8.TILES[kind]
        totals = {cfg: 0.0 for cfg in CANDIDATES}
        for label, run, nbytes in cases(kind):
            tfp8.TILES[kind] = default
            want = [t.clone() for t in run()]
            row = []
            for cfg in CANDIDATES:
                tfp8.TILES[kind] = cfg
                try:
                    got = run()
                    same = all(torch.equal(a, b) for a, b in zip(want, got))
                    ms = median_ms(run, args.reps)
                except Exception as exc:  # a tile shape the compiler rejects (shared memory, registers)
                    print(f"TILE {kind} {label} {cfg} failed: {str(exc).splitlines()[0][:120]}")
                    totals[cfg] = float("inf")
                    continue
                if not same:
                    print(f"TILE {kind} {label} {cfg} WRONG: its bytes differ from {default}'s")
                    totals[cfg] = float("inf")
                    continue
                totals[cfg] += ms
                row.append((ms, cfg))
                print(f"TILE {kind:10s} {label:32s} {str(cfg):15s} {ms * 1e3:8.1f} us {nbytes / ms / 1e6:7.0f} GB/s",
                      flush=True)
            best_ms, best = min(row)
            base_ms = next(ms for ms, cfg in row if cfg == default)
            print(f"SHAPE {kind} {label}: best {best} {best_ms * 1e3:.1f} us vs default {default} "
                  f"{base_ms * 1e3:.1f} us ({base_ms / best_ms:.2f}x)", flush=True)
        tfp8.TILES[kind] = default
        best = min(totals, key=totals.get)
        print(f"BEST {kind}: {best} {totals[best] * 1e3:.0f} us summed over the shapes, default {default} "
              f"{totals[default] * 1e3:.0f} us", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
