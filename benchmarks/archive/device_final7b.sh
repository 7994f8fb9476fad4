#!/usr/bin/env bash
# 2026-11-23 session 2 (nvidia-h100-x1; carry .whl), one call: 7B through the Ray trainer with more of the Adam
# state kept on the GPU (--opt-resident-gib), at 16 and 32 micro-steps per update; GC pauses and allocator
# events per step (the slow 4th update); then one profiled 7B bf16 micro-step with the compute-stream gaps.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled NCCL_NVLS_ENABLE=0
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L="$OUT/final7b.log"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$L"
run() { name=$1; shift; echo "== $name" >> "$L"; timeout ${TMO:-200} python3 "$@" >> "$L" 2>&1; echo "== $name rc $? $(( $(date +%s) - T0 ))s" | tee -a "$L"; }
T0=$(date +%s)
B="benchmarks/bench_train.py --model Qwen2.5-7B --gpus 1 --backend triton --batch-size 8 --seq-len 1024
 --warmup-steps 2 --lmhead-chunks 4 --master-dtype bf16 --opt-m-dtype bf16
 --opt-v-dtype bf16 --offload-opt-m --offload-opt-v --model-dtype bf16 --memory-table"
TMO=150 run 7b_bf16_ga16_kept12 $B --grad-accumulation 16 --steps 8 --opt-resident-gib 12
TMO=170 run 7b_bf16_ga32_kept12 $B --grad-accumulation 32 --steps 6 --opt-resident-gib 12
TMO=130 run 7b_e4m3_ga16_kept4 $B --grad-accumulation 16 --steps 9 --matmul-dtype e4m3 --transient-quants --opt-resident-gib 4
TMO=110 run prof_bf16_ga1 benchmarks/engine_step.py --model Qwen2.5-7B --backend triton --batch-size 8 \
  --grad-accumulation 1 --steps 1 --master-dtype bf16 --offload-opt --lmhead-chunks 4 --opt-resident-gib 10 --profile
grep -E "^== |^step|^RESULT|^KERNELS [a-z]|^KERNELS wall|^GAPS|^tokens/s|Error|allocated|total" "$L" | cut -c1-200 | tail -80
