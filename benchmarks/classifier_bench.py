"""The fused classifier's launch shapes at one LM head's size: one program per row against a few programs per SM.

Times ``backends.triton.classifier.fused_classifier`` (loss and dlogits in place) on bf16 logits [N, V] for each
(programs per SM, warps, BLOCK_V), median of 10, and the effective bandwidth for the two reads and one write of
the logits; prints the fastest as ``BEST pps warps block_v``.

    python benchmarks/classifier_bench.py --rows 16384 --vocab 151936
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backends.triton import classifier  # noqa: E402
from benchmarks.kernel_timing import median_ms  # noqa: E402

VARIANTS = [(0, None, 4096), (0, 16, 8192), (1, 16, 4096), (1, 16, 8192), (1, 32, 8192), (2, 8, 4096),
            (2, 16, 4096), (2, 16, 8192), (4, 8, 4096), (4, 8, 8192), (8, 4, 4096), (8, 8, 4096)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--vocab", type=int, default=151936)
    args = ap.parse_args()
    n, v = args.rows, args.vocab
    logits = torch.randn(n, v, device="cuda").mul_(3).to(torch.bfloat16)
    targets = torch.randint(0, v, (n,), device="cuda")
    losses = torch.empty(n, device="cuda")
    gbytes = 3 * n * v * 2 / 1e9
    best = None
    for pps, warps, block_v in VARIANTS:
        classifier.PROGRAMS_PER_SM, classifier.NUM_WARPS, classifier.BLOCK_V = pps, warps, block_v
        ms = median_ms(lambda: classifier.fused_classifier(logits, losses, targets), 10)
        print(f"classifier pps={pps} warps={warps} block_v={block_v}: {ms:.3f} ms, {gbytes / ms:.2f} TB/s "
              f"(two reads + one write)")
        if best is None or ms < best[0]:
            best = (ms, pps, warps or 0, block_v)
    print(f"BEST {best[1]} {best[2]} {best[3]} {best[0]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
