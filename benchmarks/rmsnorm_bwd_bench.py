"""The Triton RMSNorm backward's launch shapes at one model's size (it ran at ~2.4 TB/s in the 1.5B profile).

Times ``backends.triton.rmsnorm.rmsnorm_backward`` (with the residual gradient fused, as the model calls it;
with and without the FP8 absmax) for rows per tile x partial-row count x warps, median of 20, with the
effective bandwidth of its N x C traffic (dout, inp, dresidual read; dinp written); prints the fastest.

    python benchmarks/rmsnorm_bwd_bench.py --rows 16384 --channels 1536
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backends.triton import rmsnorm  # noqa: E402
from benchmarks.kernel_timing import median_ms  # noqa: E402

VARIANTS = [(2048, 512, None), (2048, 1024, None), (2048, 512, 4), (4096, 512, None), (4096, 512, 16),
            (4096, 1024, None), (8192, 512, None), (8192, 256, 16), (2048, 264, None), (4096, 264, None)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--channels", type=int, default=1536)
    args = ap.parse_args()
    n, c, bf = args.rows, args.channels, torch.bfloat16
    x, dy, dres = (torch.randn(n, c, device="cuda", dtype=bf) for _ in range(3))
    w = torch.randn(c, device="cuda", dtype=bf)
    rstd = torch.rand(n, device="cuda") + 0.5
    dx, dw, amax = torch.empty_like(x), torch.zeros(c, device="cuda", dtype=bf), torch.zeros((), device="cuda")
    gbytes = 4 * n * c * 2 / 1e9
    for with_amax in (False, True):
        best = None
        for tile, progs, warps in VARIANTS:
            def fn():
                rmsnorm.rmsnorm_backward(dx, dw, dy, x, w, rstd, dresidual=dres, absmax=amax if with_amax else None,
                                         tile_elems=tile, max_programs=progs, num_warps=warps)
            ms = median_ms(fn, 20)
            print(f"rmsnorm_bwd amax={int(with_amax)} tile={tile} programs<={progs} warps={warps}: {ms * 1e3:7.1f} us, "
                  f"{gbytes / ms:.2f} TB/s")
            if best is None or ms < best[0]:
                best = (ms, tile, progs, warps)
        print(f"BEST amax={int(with_amax)} tile={best[1]} programs<={best[2]} warps={best[3]} {best[0] * 1e3:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
