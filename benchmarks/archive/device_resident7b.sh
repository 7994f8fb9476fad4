#!/usr/bin/env bash
# 2026-11-23 session 2 (nvidia-h100-x1; carry .whl), one call: --opt-resident-gib (part of the offloaded Adam
# state kept on the GPU). GPU test of it, a 7B bf16 step profile with compute-stream gaps, then the 7B trainer
# runs through Ray: bf16 with 10 GiB kept, e4m3 --transient-quants with 3 GiB kept.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled NCCL_NVLS_ENABLE=0
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L="$OUT/resident7b.log"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$L"
run() { name=$1; shift; echo "== $name" >> "$L"; timeout ${TMO:-200} python3 "$@" >> "$L" 2>&1; echo "== $name rc $?" | tee -a "$L"; }
T0=$(date +%s)
timeout 60 python3 -m pytest -m gpu -p no:cacheprovider -q -rfE tests/test_offload.py -k "offload_on_cuda" >> "$L" 2>&1
echo "GPU tests rc=$? $(( $(date +%s) - T0 ))s"
TMO=90 run prof_bf16_kept10 benchmarks/engine_step.py --model Qwen2.5-7B --backend triton --batch-size 8 \
  --grad-accumulation 2 --steps 1 --master-dtype bf16 --offload-opt --lmhead-chunks 4 --opt-resident-gib 10 --profile
echo "profile done $(( $(date +%s) - T0 ))s"
B="benchmarks/bench_train.py --model Qwen2.5-7B --gpus 1 --backend triton --batch-size 8 --seq-len 1024
 --grad-accumulation 16 --steps 8 --warmup-steps 2 --lmhead-chunks 4 --master-dtype bf16 --opt-m-dtype bf16
 --opt-v-dtype bf16 --offload-opt-m --offload-opt-v --model-dtype bf16 --memory-table"
TMO=210 run 7b_bf16_kept10 $B --opt-resident-gib 10
echo "bf16 done $(( $(date +%s) - T0 ))s"
TMO=180 run 7b_e4m3_kept3 $B --matmul-dtype e4m3 --transient-quants --opt-resident-gib 3
echo "all done $(( $(date +%s) - T0 ))s"
grep -E "passed|failed|^FAILED|^ERROR" "$L" | tail -5
grep -E "^== |^step|^RESULT|^KERNELS [a-z]|^KERNELS wall|^GAPS|^tokens/s|Error|adam|allocated|total" "$L" | cut -c1-230 | tail -75
