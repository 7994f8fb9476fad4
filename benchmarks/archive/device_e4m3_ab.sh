#!/usr/bin/env bash
# Session 3, 2026-11-23 (nvidia-h100-x1). 0.5B e4m3 B=32 with CUDA graphs: call 3 gave 159,111 tokens/s with the
# overlapped update (back-to-back timing), call 2 152,392 (split timing). Alternating A/B, overlap vs
# --no-overlap-update, twice, then --split-timing once.
export PYTHONPATH=$PWD PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L="$OUT/e4m3_ab.log"
run() { name=$1; shift; echo "== $name" >> "$L"; timeout -s INT -k 20 35 python3 "$@" >> "$L" 2>&1; echo "== $name rc $?" >> "$L"; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$L"
E="benchmarks/engine_step.py --backend triton --cuda-graphs --steps 10 --model Qwen2.5-0.5B --batch-size 32 --matmul-dtype e4m3"
for i in 1 2; do
  run overlap_$i $E
  run nooverlap_$i $E --no-overlap-update
done
run split $E --split-timing
grep -E "^== |^RESULT" "$L" | sed -E 's/backend=triton //; s/TFLOPs=[0-9.]+ //' | cut -c1-160
