#!/usr/bin/env bash
# 2026-11-23 session 2, last call (nvidia-h100-x1; carry .whl; ~5 device-minutes left): 7B bf16 through the Ray
# trainer, 32 micro-steps per update, 12 GiB of the Adam state kept on the GPU, with the AdamW seeds no longer
# specialized by Triton (is the slow 4th update gone?); then the GPU test of that.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled NCCL_NVLS_ENABLE=0
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L="$OUT/jitfix7b.log"
T0=$(date +%s)
timeout 210 python3 benchmarks/bench_train.py --model Qwen2.5-7B --gpus 1 --backend triton --batch-size 8 --seq-len 1024 \
  --warmup-steps 2 --lmhead-chunks 4 --master-dtype bf16 --opt-m-dtype bf16 --opt-v-dtype bf16 --offload-opt-m \
  --offload-opt-v --model-dtype bf16 --grad-accumulation 32 --steps 5 --opt-resident-gib 12 > "$L" 2>&1
echo "bench rc=$? $(( $(date +%s) - T0 ))s" | tee -a "$L"
timeout 40 python3 -m pytest -m gpu -p no:cacheprovider -q -rfE tests/test_triton_gpu.py -k "recompile" >> "$L" 2>&1
echo "test rc=$? $(( $(date +%s) - T0 ))s" | tee -a "$L"
grep -E "^step|^tokens/s|Error|passed|failed|skipped" "$L" | cut -c1-200
