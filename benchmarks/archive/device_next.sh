#!/usr/bin/env bash
# Prepared 2026-11-23 for the next GPU session (nvidia-h100-x1; carry .whl), two calls:
#   bash benchmarks/archive/device_next.sh 1   GPU tests of what changed without a GPU (per-layout FP8 weight copies with
#                                      absmax once per step, heap freeze), then 7B e4m3 --transient-quants
#   bash benchmarks/archive/device_next.sh 2   7B bf16 (is the slow 4th update gone?), then a torch-profiler table of
#                                      one 7B micro-step + update (where the time goes against the 14k bar)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled NCCL_NVLS_ENABLE=0
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L="$OUT/next$1.log"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$L"
COMMON="--model Qwen2.5-7B --gpus 1 --backend triton --batch-size 8 --seq-len 1024 --grad-accumulation 16 --steps 9 --warmup-steps 2
 --lmhead-chunks 4 --master-dtype bf16 --opt-m-dtype bf16 --opt-v-dtype bf16 --offload-opt-m --offload-opt-v --model-dtype bf16"
run() { name=$1; shift; echo "== $name" >> "$L"; timeout 240 python3 "$@" >> "$L" 2>&1; echo "== $name rc $?" | tee -a "$L"; }
if [ "$1" = 1 ]; then
  timeout 150 python3 -m pytest -m gpu -p no:cacheprovider -rfE tests/test_offload.py tests/test_update_overlap.py \
    tests/test_cuda_graphs.py tests/test_fp8_gpu.py tests/test_zero3.py >> "$L" 2>&1; echo "GPU tests rc=$?"
  run 7b_e4m3_transient benchmarks/bench_train.py $COMMON --matmul-dtype e4m3 --transient-quants --memory-table
else
  run 7b_bf16 benchmarks/bench_train.py $COMMON
  run 7b_profile benchmarks/engine_step.py --model Qwen2.5-7B --backend triton --batch-size 8 --grad-accumulation 1 \
    --steps 1 --master-dtype bf16 --offload-opt --lmhead-chunks 4 --profile
fi
grep -E "^== |^tokens/s|^step |^RESULT|^FAILED|^ERROR|passed|failed|Error" "$L" | tail -30
[ "$1" = 2 ] && sed -n '/== 7b_profile/,$p' "$L" | sed -n '/Name/,$p' | cut -c1-62,120-175 | head -30
