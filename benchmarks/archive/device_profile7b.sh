#!/usr/bin/env bash
# 2026-11-23 session 2 (nvidia-h100-x1; carry .whl), one call: GPU tests of the lazy per-layout FP8 copies and
# the heap freeze, kernel-category profiles of one 7B step (bf16 and e4m3 --transient-quants, no Ray), then the
# 7B e4m3 --transient-quants trainer run through Ray.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled NCCL_NVLS_ENABLE=0
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L="$OUT/prof7b.log"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$L"
run() { name=$1; shift; echo "== $name" >> "$L"; timeout ${TMO:-200} python3 "$@" >> "$L" 2>&1; echo "== $name rc $?" | tee -a "$L"; }
T0=$(date +%s)
timeout 120 python3 -m pytest -m gpu -p no:cacheprovider -q -rfE tests/test_offload.py tests/test_update_overlap.py \
  tests/test_fp8_gpu.py tests/test_cuda_graphs.py >> "$L" 2>&1; echo "GPU tests rc=$? $(( $(date +%s) - T0 ))s"
ES="benchmarks/engine_step.py --model Qwen2.5-7B --backend triton --batch-size 8 --grad-accumulation 2 --steps 1
 --master-dtype bf16 --offload-opt --lmhead-chunks 4 --profile"
TMO=100 run prof_bf16 $ES
TMO=100 run prof_e4m3 $ES --matmul-dtype e4m3 --transient-quants
echo "profiles done $(( $(date +%s) - T0 ))s"
TMO=220 run 7b_e4m3_transient benchmarks/bench_train.py --model Qwen2.5-7B --gpus 1 --backend triton --batch-size 8 \
  --seq-len 1024 --grad-accumulation 16 --steps 7 --warmup-steps 2 --lmhead-chunks 4 --master-dtype bf16 \
  --opt-m-dtype bf16 --opt-v-dtype bf16 --offload-opt-m --offload-opt-v --model-dtype bf16 --matmul-dtype e4m3 --transient-quants
echo "all done $(( $(date +%s) - T0 ))s"
grep -E "passed|failed|^FAILED|^ERROR" "$L" | tail -8
grep -E "^== |^step |^RESULT|^KERNELS|tokens/s|Error" "$L" | tail -60
