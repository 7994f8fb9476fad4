#!/usr/bin/env bash
# Session 3, 2026-11-23 (nvidia-h100-x1). With CUDA graphs, does the overlapped update pay at GA=1? Alternating
# A/B (overlap, then --no-overlap-update, twice) at 0.5B bf16 B=32 and once each at 1.5B bf16 / e4m3 B=16,
# single process, back-to-back step timing, 10 timed steps each.
export PYTHONPATH=$PWD PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L="$OUT/overlap_ab.log"
T0=$(date +%s)
run() { name=$1; tmo=$2; shift 2; echo "== $name" >> "$L"; timeout -s INT -k 20 $tmo python3 "$@" >> "$L" 2>&1; echo "== $name rc $? $(( $(date +%s) - T0 ))s" >> "$L"; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$L"
E="benchmarks/engine_step.py --backend triton --cuda-graphs --steps 10"
for i in 1 2; do
  run 05b_bf16_overlap_$i 35 $E --model Qwen2.5-0.5B --batch-size 32
  run 05b_bf16_nooverlap_$i 35 $E --model Qwen2.5-0.5B --batch-size 32 --no-overlap-update
done
for dt in bf16 e4m3; do
  M=""; [ $dt = e4m3 ] && M="--matmul-dtype e4m3"
  run 15b_${dt}_overlap 45 $E --model Qwen2.5-1.5B --batch-size 16 $M
  run 15b_${dt}_nooverlap 45 $E --model Qwen2.5-1.5B --batch-size 16 $M --no-overlap-update
done
grep -E "^== |^RESULT" "$L" | sed -E 's/backend=triton //; s/TFLOPs=[0-9.]+ //' | cut -c1-160
