"""Time the streamed optimizer step (host-offloaded Adam state) against the PCIe link it is bound by.

    python benchmarks/offload_stream.py --numel 2000000000 --backend triton

Prints, for pinned host memory on this GPU: the copy rate host->device, device->host and both directions at
once (1 GiB buffers); then one ``ShardedAdamW.step`` over the first ``--numel`` parameters of the Qwen2.5-7B
layout with bf16 weights as the master and bf16 m and v offloaded (``--offload-opt-m --offload-opt-v``, 8 bytes
per parameter over PCIe), once as the pipeline runs it (three slots, one copy stream per direction) and once
with the copies forced onto one stream and two slots (the way it ran before: the directions take turns).
Figures are per update, scaled to the 7.6B parameters of Qwen2.5-7B.
"""

import argparse
import sys
import os
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llmq_ray.backends import get_backend  # noqa: E402
from llmq_ray.model.config import PRESETS  # noqa: E402
from llmq_ray.engine.optim import ShardedAdamW  # noqa: E402
from llmq_ray.model.params import ParamLayout  # noqa: E402


def copy_rate(direction: str, nbytes: int = 1 << 30, reps: int = 5) -> float:
    """GB/s of pinned<->device copies of ``nbytes`` ("h2d", "d2h" or "both" at once on two streams)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        if direction in ("h2d", "both"):
            with torch.cuda.stream(s1):
                dev.copy_(host, non_blocking=True)
        if direction in ("d2h", "both"):
            with torch.cuda.stream(s2):
                host2.copy_(dev2, non_blocking=True)
    torch.cuda.synchronize()
    moved = nbytes * reps * (2 if direction == "both" else 1)
    return moved / (time.perf_counter() - t0) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=2_000_000_000, help="parameters in the timed shard")
    ap.add_argument("--backend", default="triton", choices=["torch", "triton", "cupy"])
    ap.add_argument("--reps", type=int, default=3, help="timed steps per variant (after one warmup)")
    a = ap.parse_args()
    for d in ("h2d", "d2h", "both"):
        print(f"RESULT copy {d}: {copy_rate(d):.1f} GB/s", flush=True)
    cfg = PRESETS["Qwen2.5-7B"]
    layout = ParamLayout(cfg)
    n = min(a.numel, layout.numel)
    backend = get_backend(a.backend, "cuda")
    params = torch.randn(n, dtype=torch.bfloat16, device="cuda") * 0.02
    grads = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    opt = ShardedAdamW(backend, layout, params, 0, n, master_dtype=torch.bfloat16, m_dtype=torch.bfloat16,
                       v_dtype=torch.bfloat16, offload=("m", "v"))
    staging = opt.staging
    pipelined = (staging.download, staging.SLOTS)
    step = 0
    for name, serial in (("pipelined", False), ("serial", True), ("pipelined", False)):
        staging.download, staging.SLOTS = (staging.upload, 2) if serial else pipelined
        times = []
        for _ in range(a.reps + 1):
            step += 1
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.step(grads, lr=1e-4, step=step, grad_scale=1.0)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        best = min(times[1:])
        scale = layout.numel / n
        pcie = 8 * n / best / 1e9
        print(f"RESULT adamw {name}: {best * 1e3:.0f} ms for {n / 1e9:.2f}B params ({pcie:.1f} GB/s of m/v traffic) "
              f"-> {best * scale:.2f} s per Qwen2.5-7B update", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
