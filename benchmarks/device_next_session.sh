#!/usr/bin/env bash
# Prepared 2026-11-23 (session 2) for the next GPU session, branch fused-attn-rope-bwd (nvidia-h100-x1; carry
# .whl). One call, ~9 minutes:
#   1. GPU tests of the branch: the one-pass RoPE backward from cuDNN's dq/dk/dv, whole-model gradients,
#      CUDA graphs (they capture the new path), the AdamW no-recompile test;
#   2. 0.5B engine A/B in the same call: fused vs --unfused-attn-rope-bwd (B=32, CUDA graphs, bf16 and e4m3);
#   3. one profiled 7B bf16 micro-step with the compute-stream gaps (engine_step, GA 1, 10 GiB kept);
#   4. 7B bf16 through Ray, 32 micro-steps per update, 12 GiB kept, 6 updates (set-up alone is ~95 s).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled NCCL_NVLS_ENABLE=0
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L="$OUT/next.log"
T0=$(date +%s)
run() { name=$1; tmo=$2; shift 2; echo "== $name" >> "$L"; timeout $tmo python3 "$@" >> "$L" 2>&1; echo "== $name rc $? $(( $(date +%s) - T0 ))s" | tee -a "$L"; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$L"
run gpu_tests 120 -m pytest -m gpu -p no:cacheprovider -q -rfE tests/test_triton_gpu.py tests/test_cuda_graphs.py \
  -k "rope or recompile or whole_model or graph"
E="benchmarks/engine_step.py --model Qwen2.5-0.5B --backend triton --batch-size 32 --steps 8 --cuda-graphs"
run ab_fused_bf16 60 $E
run ab_unfused_bf16 60 $E --unfused-attn-rope-bwd
run ab_fused_e4m3 60 $E --matmul-dtype e4m3
run ab_unfused_e4m3 60 $E --matmul-dtype e4m3 --unfused-attn-rope-bwd
run prof_7b_bf16 150 benchmarks/engine_step.py --model Qwen2.5-7B --backend triton --batch-size 8 --grad-accumulation 1 \
  --steps 1 --master-dtype bf16 --offload-opt --lmhead-chunks 4 --opt-resident-gib 10 --profile
run 7b_bf16_ga32_kept12 230 benchmarks/bench_train.py --model Qwen2.5-7B --gpus 1 --backend triton --batch-size 8 \
  --seq-len 1024 --warmup-steps 2 --lmhead-chunks 4 --master-dtype bf16 --opt-m-dtype bf16 --opt-v-dtype bf16 \
  --offload-opt-m --offload-opt-v --model-dtype bf16 --grad-accumulation 32 --steps 6 --opt-resident-gib 12
grep -E "passed|failed|^FAILED|^ERROR" "$L" | tail -5
grep -E "^== |^RESULT|^KERNELS [a-z]|^KERNELS wall|^GAPS|^step |^tokens/s|Error" "$L" | cut -c1-200 | tail -60
