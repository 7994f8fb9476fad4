"""Tokens/s that one TokenStream consumer receives on CPU (plain path and Ray Data path).

    python benchmarks/data_throughput.py [--seq-len 1024] [--batch-size 8] [--tokens 50_000_000] [--seconds 5]

Writes synthetic llm.q shards (random ids, one with a loss mask) to a temporary folder, then times
next_batch() in a loop after a warm-up (the first Ray Data batch costs seconds of startup) and prints
tokens/s delivered (B*T per batch). The bar: >= 1M tokens/s per consumer; one H100 consumes ~0.2M
tokens/s training the 0.5B model.
"""

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from llmq_ray.data_pipeline.shards import write_shard  # noqa: E402
from llmq_ray.data_pipeline.stream import TokenStream  # noqa: E402


def measure(stream: TokenStream, seconds: float, warmup: int) -> tuple[float, int]:
    for _ in range(warmup):
        stream.next_batch()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        x, _ = stream.next_batch()
        n += x.numel()
    return n / (time.perf_counter() - t0), n


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--tokens", type=int, default=50_000_000, help="synthetic dataset size (4 shards)")
    p.add_argument("--seconds", type=float, default=5.0, help="timed seconds per path")
    p.add_argument("--no-ray", action="store_true", help="time only the plain path")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="llmq-bench-") as d:
        rng = np.random.default_rng(0)
        per = a.tokens // 4
        for i in range(4):
            mask = rng.random(per) < 0.9 if i == 0 else None
            write_shard(f"{d}/train-{i:03d}.bin", rng.integers(0, 151643, per, dtype=np.int32), 151646, mask=mask)
        glob = f"{d}/train-*.bin"
        print(f"data: {a.tokens:,} tokens in 4 shards, T={a.seq_len}, B={a.batch_size}")
        rate, n = measure(TokenStream(glob, a.seq_len, a.batch_size, seed=0, use_ray=False), a.seconds, 5)
        print(f"plain (use_ray=False): {rate / 1e6:.2f}M tokens/s per consumer ({n:,} tokens)")
        if not a.no_ray:
            import ray

            ray.init(num_cpus=4, include_dashboard=False, object_store_memory=512 * 2**20,
                     _temp_dir=f"/tmp/rayb-{os.getpid()}", log_to_driver=False)
            s = TokenStream(glob, a.seq_len, a.batch_size, seed=0, use_ray=True, prefetch=8)
            rate, n = measure(s, a.seconds, 20)
            print(f"ray data (use_ray=True): {rate / 1e6:.2f}M tokens/s per consumer ({n:,} tokens)")
            s.close()
            ray.shutdown()


if __name__ == "__main__":
    main()
