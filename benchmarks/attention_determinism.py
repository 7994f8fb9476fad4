"""Is the attention backward bit-reproducible on this GPU? Runs cuDNN's backward (the path every backend uses for
bf16 on CUDA, backends/_aten_attention.py) several times on the same inputs and compares dq/dk/dv bitwise.

    python benchmarks/attention_determinism.py            # 0.5B, 1.5B and 7B head shapes, B=8, T=1024

Why: llmq-ray promises that a resumed run reproduces the uninterrupted one bit for bit. Same-command 7B runs on
an H100 printed different losses by step 3 (benchmarks/LOG.md, 2026-11-23); PyTorch builds cuDNN's SDPA
backward graph without asking for the deterministic algorithm, and cuDNN may then accumulate dQ with atomics.
Prints one line per shape: how many of the repeats differ from the first, and the largest difference.
"""

from __future__ import annotations

import argparse

import torch

from llmq_ray.backends import _aten_attention

SHAPES = {"Qwen2.5-0.5B": (14, 2, 64), "Qwen2.5-1.5B": (12, 2, 128), "Qwen2.5-7B": (28, 4, 128)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("attention_determinism.py needs a CUDA GPU (cuDNN attention).")
    b, t = args.batch_size, args.seq_len
    for name, (hq, hkv, d) in SHAPES.items():
        gen = torch.Generator(device="cuda").manual_seed(0)
        qkv = torch.randn(b, t, hq + 2 * hkv, d, device="cuda", generator=gen).to(torch.bfloat16)
        dout = torch.randn(b, t, hq, d, device="cuda", generator=gen).to(torch.bfloat16)
        out = torch.empty(b, t, hq, d, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(b, hq, t, dtype=torch.float32, device="cuda")
        _aten_attention.forward(out, lse, qkv, hq, hkv)
        first = torch.empty_like(qkv)
        _aten_attention.backward(first, dout, out, lse, qkv, hq, hkv)
        differ, worst = 0, 0.0
        for _ in range(args.repeats - 1):
            again = torch.empty_like(qkv)
            _aten_attention.backward(again, dout, out, lse, qkv, hq, hkv)
            if not torch.equal(again, first):
                differ += 1
                worst = max(worst, (again.float() - first.float()).abs().max().item())
        print(f"DETERMINISM {name} (Hq={hq}, Hkv={hkv}, D={d}, B={b}, T={t}): {differ} of {args.repeats - 1} "
              f"repeats differ from the first, max |diff| {worst:.3g}", flush=True)


if __name__ == "__main__":
    main()
