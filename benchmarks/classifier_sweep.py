"""Launch shapes of the fused classifier on the GPU: can the second read of each logits row come from L2?

    python3 benchmarks/classifier_sweep.py            # N = 16384 rows of V = 151936 bf16 (0.5B, B=16 x T=1024)
    python3 benchmarks/classifier_sweep.py --rows 32768

The default launch is one program per row; ``programs=P`` keeps P rows in flight (each program takes every
P-th row). With P x 300 KB below L2's 50 MB, a row's second read may hit L2. Every variant must give the same
bits as the default (checked here). Prints one line per variant: median ms over --reps, and the bandwidth
counted as 3 passes (2 reads + 1 write of the row: what HBM moves without L2 reuse) -- above ~3.0 TB/s on an
H100 means part of the second read came from L2.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends.triton import classifier  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    n, v = a.rows, a.vocab
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(n, v, generator=gen, device="cuda") * 3).to(torch.bfloat16)
    targets = torch.randint(0, v, (n,), generator=gen, device="cuda")
    work = torch.empty_like(logits)
    losses = torch.empty(n, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def run(**kw):
        work.copy_(logits)
        classifier.fused_classifier(work, losses, targets, 1.0 / n, **kw)

    run()
    want_lg, want_loss = work.clone(), losses.clone()
    variants = [dict()]
    for per_sm in (0.5, 1, 2, 4):
        for block_v, warps in ((4096, 8), (8192, 16), (2048, 4)):
            variants.append(dict(programs=int(sms * per_sm), block_v=block_v, num_warps=warps))
    print(f"fused classifier, {n} x {v} bf16, {sms} SMs; bytes per pass {n * v * 2 / 1e9:.2f} GB")
    for kw in variants:
        run(**kw)
        same = torch.equal(work, want_lg) and torch.equal(losses, want_loss)
        times = []
        for _ in range(a.reps):
            work.copy_(logits)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            classifier.fused_classifier(work, losses, targets, 1.0 / n, **kw)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        ms = statistics.median(times)
        print(f"CLS {str(kw or 'default'):58s} {ms:7.3f} ms  {3 * n * v * 2 / ms / 1e9:6.0f} GB/s (3 passes)  "
              f"same bits: {same}")


if __name__ == "__main__":
    main()
