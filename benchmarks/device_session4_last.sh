#!/usr/bin/env bash
# Session 4 (2026-11-23), call 6 (nvidia-h100-x1; carry .whl), after the FP8 SwiGLU backward (376af5c): where a
# 1.5B e4m3 step goes now (profile, 4 micro-steps per update), whether B=24 fits and helps at 1.5B, and 1.5B e4m3
# with 16 micro-steps through the Ray worker.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled NCCL_NVLS_ENABLE=0
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L="$OUT/last.log"; S="$OUT/smi_last.csv"
T0=$(date +%s)
run() { name=$1; tmo=$2; shift 2; echo "== $name $(( $(date +%s) - T0 ))s" >> "$L"; timeout -s INT -k 20 $tmo python3 "$@" >> "$L" 2>&1; echo "== $name rc $? $(( $(date +%s) - T0 ))s" | tee -a "$L"; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$L"
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,utilization.gpu --format=csv,noheader -l 1 > "$S" 2>&1 &
SMI=$!
E="benchmarks/engine_step.py --backend triton --cuda-graphs --model Qwen2.5-1.5B --grad-accumulation 4"
run prof_15b_e4m3_b16_ga4 55 $E --batch-size 16 --matmul-dtype e4m3 --steps 3 --profile
run 15b_e4m3_b24_ga4 55 $E --batch-size 24 --matmul-dtype e4m3 --steps 5
run 15b_bf16_b24_ga4 60 $E --batch-size 24 --steps 5
run ray_15b_e4m3_b16_ga16 100 benchmarks/bench_train.py --model Qwen2.5-1.5B --gpus 1 --backend triton --batch-size 16 \
  --seq-len 1024 --grad-accumulation 16 --steps 6 --warmup-steps 2 --use-cuda-graphs --opt-m-dtype bf16 \
  --opt-v-dtype bf16 --matmul-dtype e4m3
kill $SMI
echo "== smi: SM MHz, W, C every 10 s" >> "$L"
awk -F', ' 'NR % 10 == 0 {printf "%s %s %s | ", $2, $3, $4} END {print ""}' "$S" >> "$L"
grep -E "^== |^RESULT|^KERNELS [a-z]|^KERNELS wall|^GAPS streams|^tokens/s|OutOfMemory|out of memory" "$L" | cut -c1-200 | tail -40
