"""Pick the tile shapes of our Triton attention kernels (backends/triton/attention_fwd.py, attention_bwd.py) on the
GPU: times each candidate (BLOCK_M, BLOCK_N, num_warps, num_stages) of the forward, the dK/dV and the dQ kernel
under --document-masking at one model's head shapes, checks its result against the current choice (cosine >=
0.99999; a candidate that does not compile or fit is skipped), and prints the fastest of each beside the current
``TILES`` entry.

    python benchmarks/attention_tiles.py                                   # Qwen2.5-0.5B heads, B=32, T=1024
    python benchmarks/attention_tiles.py --heads 16 8 128 --batch-size 16  # Qwen3's
    python benchmarks/attention_tiles.py --json-out tiles.json             # also the winners, for TILES

Documents of --min-len..--max-len tokens packed back to back, as benchmarks/attention_doc_mask.py makes them. The
dK/dV and dQ candidates are timed as the whole backward with the other kernel at its current tiles (the delta
kernel is the same in every run), so their differences are the kernel's own.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from attention_doc_mask import packed_segments, time_ms  # noqa: E402  (benchmarks/, the script's folder)
from llmq_ray.backends.attention import DocumentMask  # noqa: E402

# (BLOCK_M, BLOCK_N, warps) tried with each --stages; the current TILES entry is always tried too.
FWD = ((128, 64, 8), (128, 128, 8), (128, 32, 8), (64, 64, 4), (64, 128, 4), (128, 64, 4))
# dK/dV: BLOCK_M is the inner (query) tile, BLOCK_N the program's keys; dQ: BLOCK_M the program's queries
DKDV = ((64, 64, 4), (32, 128, 4), (32, 128, 8), (64, 128, 8), (16, 128, 4), (32, 64, 4), (128, 128, 8))
DQ = ((64, 64, 4), (128, 32, 4), (128, 32, 8), (128, 64, 8), (64, 32, 4), (128, 16, 4))
# a candidate whose result is further than this from the current tiles' is reported and not chosen: a different
# summation order in bf16 stays above 0.99999 (seen on an H100); some shapes fell to 0.9994 there (benchmarks/LOG.md,
# 2026-11-26), which the exact-math GPU test of the chosen tiles (tests/test_document_masking_gpu.py) would not pass
MIN_COSINE = 0.99999


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().flatten(), b.float().flatten()
    return float(a @ b / (a.norm() * b.norm()))


def _sweep(name: str, candidates, current, run, reference: torch.Tensor, result: torch.Tensor, reps: int):
    """[(ms, tiles)] of the candidates that ran and matched ``reference``, fastest first; prints one line each."""
    rows = []
    for tiles in candidates:
        try:
            ms = time_ms(lambda: run(tiles), reps)
        except Exception as e:  # out of shared memory / registers for this shape: not a candidate here
            print(f"  {name} {tiles}: skipped ({type(e).__name__}: {str(e).splitlines()[0][:80]})")
            continue
        cos = _cosine(result, reference)
        mark = " (current)" if tuple(tiles) == tuple(current) else ""
        mark += "" if cos >= MIN_COSINE else " DIFFERS: not a candidate"
        print(f"  {name} {tiles}: {ms:.3f} ms, cosine vs current {cos:.6f}{mark}")
        if cos >= MIN_COSINE:
            rows.append((ms, tuple(tiles)))
    rows.sort()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, nargs=3, default=[14, 2, 64], metavar=("HQ", "HKV", "D"))
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--min-len", type=int, default=200)
    ap.add_argument("--max-len", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4], help="pipeline stages to try")
    ap.add_argument("--json-out", help="write {head_dim, fwd, dkdv, dq} of the fastest candidates here")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("attention_tiles.py needs a CUDA GPU.")
    from llmq_ray.backends.triton import attention_bwd, attention_fwd

    dev = torch.device("cuda")
    hq, hkv, d = a.heads
    b, t = a.batch_size, a.seq_len
    documents = DocumentMask(packed_segments(b, t, a.min_len, a.max_len).to(dev))
    documents.refresh()
    qkv = torch.randn(b, t, hq + 2 * hkv, d, device=dev).bfloat16()
    dout = torch.randn(b, t, hq, d, device=dev).bfloat16()
    out = torch.empty(b, t, hq, d, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(b, hq, t, dtype=torch.float32, device=dev)
    key = 64 if d <= 64 else 128
    cur_fwd, (cur_dkdv, cur_dq) = attention_fwd.TILES[key], attention_bwd.TILES[key]
    print(f"B={b} T={t} heads {hq}/{hkv}x{d}; current fwd {cur_fwd}, dkdv {cur_dkdv}, dq {cur_dq}")

    def candidates(shapes, current):
        tried = [tuple(current)] + [(bm, bn, w, st) for bm, bn, w in shapes for st in a.stages]
        return list(dict.fromkeys(tried))

    attention_fwd.attention_forward(out, lse, qkv, hq, hkv, documents)
    ref_out, ref_lse = out.clone(), lse.clone()
    fwd_out = torch.empty_like(out)
    fwd_lse = torch.empty_like(lse)
    fwd = _sweep("fwd", candidates(FWD, cur_fwd), cur_fwd,
                 lambda tiles: attention_fwd.attention_forward(fwd_out, fwd_lse, qkv, hq, hkv, documents, tiles=tiles),
                 ref_out, fwd_out, a.reps)

    ref_dqkv = torch.empty_like(qkv)
    attention_bwd.attention_backward(ref_dqkv, dout, ref_out, ref_lse, qkv, hq, hkv, documents)
    dqkv = torch.empty_like(qkv)

    def bwd(tiles):
        attention_bwd.attention_backward(dqkv, dout, ref_out, ref_lse, qkv, hq, hkv, documents, tiles=tiles)

    dkdv = _sweep("dkdv", candidates(DKDV, cur_dkdv), cur_dkdv, lambda tiles: bwd((tiles, cur_dq)), ref_dqkv, dqkv, a.reps)
    dq = _sweep("dq", candidates(DQ, cur_dq), cur_dq, lambda tiles: bwd((cur_dkdv, tiles)), ref_dqkv, dqkv, a.reps)
    best = {"head_dim": key, "fwd": list(fwd[0][1]), "dkdv": list(dkdv[0][1]), "dq": list(dq[0][1])}
    cur_ms = time_ms(lambda: bwd((cur_dkdv, cur_dq)), a.reps)
    new_ms = time_ms(lambda: bwd((tuple(best["dkdv"]), tuple(best["dq"]))), a.reps)
    print("| kernel | current tiles | ms | fastest tiles | ms |")
    print("|---|---|---|---|---|")
    cur_f = next((ms for ms, tl_ in fwd if tl_ == tuple(cur_fwd)), float("nan"))
    print(f"| forward | {cur_fwd} | {cur_f:.3f} | {fwd[0][1]} | {fwd[0][0]:.3f} |")
    print(f"| backward (delta + dK/dV + dQ) | {cur_dkdv} {cur_dq} | {cur_ms:.3f} | {dkdv[0][1]} {dq[0][1]} | "
          f"{new_ms:.3f} |")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(best, f)


if __name__ == "__main__":
    main()
