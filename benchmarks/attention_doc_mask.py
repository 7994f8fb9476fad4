"""What --document-masking costs the attention on the GPU, forward + backward at one model's head shapes: cuDNN's
dense causal kernels (no masking), the two kernel choices under masking (backends/attention.py DOCUMENT_KERNELS:
our tile-skipping Triton kernels, and cuDNN's with the DocumentMask's score bias), our Triton kernels on
windows of one document each (their dense speed), and without masking cuDNN's forward with our Triton backward
(--deterministic-attention's path).

    python benchmarks/attention_doc_mask.py                      # Qwen2.5-0.5B heads, B=32, T=1024
    python benchmarks/attention_doc_mask.py --heads 16 8 128 --batch-size 16   # Qwen3-0.6B's

Documents of --min-len..--max-len tokens packed back to back (the end-to-end cost at typical packing is
bench_train.py --document-masking on make_packed_docs.py's shards). Prints one line per variant: median ms of
forward, backward and the bias rebuild (once per micro-step, for all layers), over --reps timed repeats.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llmq_ray.backends.attention import DeterministicAttention, SdpaAttention  # noqa: E402


def time_ms(fn, reps: int) -> float:
    """Median ms of ``fn`` over ``reps`` CUDA-event-timed calls (after 3 untimed ones)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def packed_segments(b: int, t: int, min_len: int, max_len: int, seed: int = 0) -> torch.Tensor:
    """[B, T] int32 document ids (CPU) of documents of min_len..max_len tokens packed back to back over the whole
    stream of B windows, then counted per window from 0 (as the model computes them)."""
    gen = torch.Generator().manual_seed(seed)
    flat = torch.zeros(b * t, dtype=torch.int32)
    pos = 0
    while pos < b * t:
        pos += int(torch.randint(min_len, max_len + 1, (1,), generator=gen))
        flat[pos:] += 1
    seg = flat.view(b, t)
    return seg - seg[:, :1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, nargs=3, default=[14, 2, 64], metavar=("HQ", "HKV", "D"))
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--min-len", type=int, default=200)
    ap.add_argument("--max-len", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("attention_doc_mask.py needs a CUDA GPU (cuDNN attention).")
    dev = torch.device("cuda")
    hq, hkv, d = a.heads
    b, t = a.batch_size, a.seq_len
    seg = packed_segments(b, t, a.min_len, a.max_len).to(dev)
    qkv = torch.randn(b, t, hq + 2 * hkv, d, device=dev).bfloat16()
    dout = torch.randn(b, t, hq, d, device=dev).bfloat16()
    out = torch.empty(b, t, hq, d, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(b, hq, t, dtype=torch.float32, device=dev)
    dqkv = torch.empty_like(qkv)

    def provider(kernels: str) -> SdpaAttention:
        attn = SdpaAttention(dev)
        attn.DOCUMENT_KERNELS = kernels
        return attn

    def mask_of(attn: SdpaAttention, segments: torch.Tensor):
        m = attn.document_mask(segments, torch.bfloat16)
        m.refresh()
        return m

    docs = float((seg.max(dim=1).values + 1).float().mean())
    print(f"B={b} T={t} heads {hq}/{hkv}x{d}, documents of {a.min_len}..{a.max_len}: {docs:.2f} per window")
    cudnn, tri = provider("cudnn"), provider("triton")
    variants = [("cuDNN dense causal (no masking)", cudnn, None),
                ("cuDNN + document bias", cudnn, mask_of(cudnn, seg)),
                ("Triton, tile-skipping", tri, mask_of(tri, seg)),
                ("Triton, one document per window", tri, mask_of(tri, torch.zeros_like(seg))),
                ("cuDNN forward + our Triton backward, no masking", DeterministicAttention(dev), None)]
    rows = []
    for name, attn, documents in variants:
        fwd = time_ms(lambda: attn.forward(out, lse, qkv, hq, hkv, documents), a.reps)
        bwd = time_ms(lambda: attn.backward(dqkv, dout, out, lse, qkv, hq, hkv, documents), a.reps)
        rows.append((name, fwd, bwd))
    base = rows[0][1] + rows[0][2]
    print("| variant | forward ms | backward ms | fwd+bwd ms | vs dense cuDNN |")
    print("|---|---|---|---|---|")
    for name, fwd, bwd in rows:
        print(f"| {name} | {fwd:.3f} | {bwd:.3f} | {fwd + bwd:.3f} | {(fwd + bwd) / base:.3f}x |")
    for name, _, documents in variants[1:3]:
        print(f"| mask rebuild, {name} (once per micro-step) | {time_ms(documents.refresh, a.reps):.3f} | | | |")


if __name__ == "__main__":
    main()
