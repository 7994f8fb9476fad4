"""Could memory-bound kernels run underneath the GEMMs? Two probes at Qwen2.5-1.5B's bf16 shapes (B=16, T=1024).

Inside a training step the H100 holds its 700 W cap while the GEMMs run (results section 28), and the
memory-bound kernels between them draw less. If a GEMM is held back by power rather than by its SM count,
giving it fewer SMs costs less than in proportion, and the freed SMs could run the next memory-bound kernel
at the same time.

1. SM count under load. The up+gate forward GEMM and the accumulating down-projection wgrad, timed after
   200 ms of back-to-back runs (the capped clock), with cuBLASLt's SM count target at 0 (all SMs) and at
   fewer. Each runs with the heuristic's first algorithm for its target.
2. Overlap. A wgrad GEMM (SM count target T) on a low-priority side stream, and on a high-priority main stream
   the memory-bound kernel that follows it in the backward, against the two one after the other. The pairs
   are the down wgrad with swiglu_backward, and the up+gate wgrad with rmsnorm_backward. Each loop is timed
   after 200 ms of itself.

    python benchmarks/overlap_probe.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llmq_ray.backends import cublaslt, get_backend  # noqa: E402
from benchmarks.gemm_algos import timed  # noqa: E402

N, C, I = 16384, 1536, 8960
SM_TARGETS = (0, 124, 116, 100, 84, 66)


def main() -> int:
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    lt, tri = cublaslt.for_device(dev), get_backend("triton", "cuda")
    bf = torch.bfloat16

    def rnd(*shape):
        return torch.randn(*shape, device=dev).to(bf)

    x, w_ug, ug = rnd(N, C), rnd(2 * I, C) * C ** -0.5, torch.empty(N, 2 * I, device=dev, dtype=bf)
    dres, swi, dw_down = rnd(N, C), rnd(N, I), torch.zeros(C, I, device=dev, dtype=bf)
    d_ug, ln2, dw_ug = rnd(N, 2 * I), rnd(N, C), torch.zeros(2 * I, C, device=dev, dtype=bf)
    up_gate, d_swi, d_ug2 = rnd(N, 2 * I), rnd(N, I), torch.empty(N, 2 * I, device=dev, dtype=bf)
    dy, xin, dx = rnd(N, C), rnd(N, C), torch.empty(N, C, device=dev, dtype=bf)
    wn, dwn, rstd = rnd(C), torch.zeros(C, device=dev, dtype=bf), torch.rand(N, device=dev) + 0.5

    gemms = {
        "up+gate fwd": lambda sm: lt.gemm(ug, x, w_ug, trans_b=True, algo_index=0, sm_count=sm),
        "down wgrad +=": lambda sm: lt.gemm(dw_down, dres, swi, trans_a=True, trans_b=False, accumulate=True,
                                            algo_index=0, sm_count=sm),
        "up+gate wgrad +=": lambda sm: lt.gemm(dw_ug, d_ug, ln2, trans_a=True, trans_b=False, accumulate=True,
                                               algo_index=0, sm_count=sm),
    }
    print(f"1. GEMMs under sustained load ({sms} SMs), ms (relative time, relative SM count)")
    for name, fn in gemms.items():
        base = None
        for sm in SM_TARGETS:
            ms = timed(lambda: fn(sm), 20, 200.0)
            base = base or ms
            print(f"PROBE sm {name:18s} target {sm or sms:4d}: {ms:7.3f} ms  x{ms / base:.3f} time, "
                  f"x{(sm or sms) / sms:.3f} SMs")

    mem = {
        "swiglu_backward": lambda: tri.swiglu_backward(d_ug2, d_swi, up_gate),
        "rmsnorm_backward": lambda: tri.rmsnorm_backward(dx, dwn, dy, xin, wn, rstd, dresidual=dx),
    }
    pairs = (("down wgrad +=", "swiglu_backward"), ("up+gate wgrad +=", "rmsnorm_backward"))
    # As the backward would issue them: the wgrad first (side stream, low priority), then the memory-bound kernel
    # on the main stream, which runs at high priority so that its blocks take the SMs the GEMM leaves free.
    low, high = torch.cuda.Stream.priority_range()
    main_stream, side = torch.cuda.Stream(dev, priority=high), torch.cuda.Stream(dev, priority=low)
    print("2. A wgrad on a side stream under the next memory-bound kernel, ms per pair")
    with torch.cuda.stream(main_stream):
        for g, m in pairs:
            gemm, kern = gemms[g], mem[m]
            alone_m = timed(kern, 20, 200.0)
            serial = timed(lambda: (gemm(0), kern()), 20, 200.0)
            print(f"PROBE overlap {g} + {m}: serial {serial:.3f} (memory kernel alone {alone_m:.3f})")
            for sm in SM_TARGETS:
                def both(sm=sm):
                    fork = torch.cuda.Event()
                    fork.record()
                    side.wait_event(fork)
                    with torch.cuda.stream(side):
                        gemm(sm)
                        join = torch.cuda.Event()
                        join.record()
                    kern()
                    torch.cuda.current_stream().wait_event(join)
                ms = timed(both, 20, 200.0)
                print(f"PROBE overlap {g} (target {sm or sms}) || {m}: {ms:.3f} ms "
                      f"({100 * (serial - ms) / serial:+.1f}% vs serial)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
