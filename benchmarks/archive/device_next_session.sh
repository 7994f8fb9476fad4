#!/usr/bin/env bash
# Prepared 2026-11-23 (session 2) for the next GPU session, on branch fused-attn-rope-bwd (nvidia-h100-x1; carry
# .whl). Two calls of <= ~8 minutes:
#   bash benchmarks/archive/device_next_session.sh 1
#     GPU tests of what only ran on CPU: the one-pass RoPE backward from cuDNN's dq/dk/dv (branch), the AdamW
#     no-recompile test, the ZeRO-1 kept-chunks offload case, FP8 with shared bf16 GEMM-input buffers, CUDA
#     graphs (they capture the new paths); is cuDNN's attention backward bit-reproducible; then 7B e4m3 two ways
#     now that FP8 keeps no per-layer bf16 ln1/ln2/swiglu (~10.8 GiB freed): --transient-quants with 13 GiB of
#     the Adam state kept, and the default all-layer FP8 copies with 2 GiB kept (was 18,006 with 3 GiB kept).
#   bash benchmarks/archive/device_next_session.sh 2
#     0.5B fused/unfused A/B (B=32, graphs, bf16 and e4m3), 7B bf16 through Ray at 32 micro-steps per update
#     with 12 GiB kept over 6 updates (was 13,970 on 2 steady updates), then one profiled 7B bf16 micro-step
#     with the compute-stream gaps (last: it may be cut).
# 7B set-up alone takes ~95 s before the first step: keep the timeouts below. A timeout sends SIGINT, so a cut
# Ray run shuts its workers down (SIGTERM left them holding GPU memory, and the next run ran out of it).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled NCCL_NVLS_ENABLE=0
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L="$OUT/next$1.log"
T0=$(date +%s)
run() { name=$1; tmo=$2; shift 2; echo "== $name" >> "$L"; timeout -s INT -k 30 $tmo python3 "$@" >> "$L" 2>&1; echo "== $name rc $? $(( $(date +%s) - T0 ))s" | tee -a "$L"; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$L"
B7="benchmarks/bench_train.py --model Qwen2.5-7B --gpus 1 --backend triton --batch-size 8 --seq-len 1024
 --warmup-steps 2 --lmhead-chunks 4 --master-dtype bf16 --opt-m-dtype bf16 --opt-v-dtype bf16 --offload-opt-m
 --offload-opt-v --model-dtype bf16 --memory-table"
if [ "$1" = 1 ]; then
  run gpu_tests 190 -m pytest -m gpu -p no:cacheprovider -q -rfE tests/test_triton_gpu.py tests/test_cuda_graphs.py \
    tests/test_offload.py tests/test_fp8_gpu.py -s -k "rope or recompile or whole_model or graph or offload_on_cuda or fp8 or deterministic_attention or kernel_timings"
  run attn_determinism 40 benchmarks/attention_determinism.py
  # e4m3 now frees ~10.8 GiB of bf16 activations: either keep more Adam state (transient FP8 weight copies,
  # made per layer and pass: ~39 GB of traffic per micro-step) or keep the FP8 copies of all layers for the step
  run 7b_e4m3_transient_kept13 165 $B7 --grad-accumulation 16 --steps 7 --matmul-dtype e4m3 --transient-quants --opt-resident-gib 13
  run 7b_e4m3_persistent_kept2 165 $B7 --grad-accumulation 16 --steps 7 --matmul-dtype e4m3 --opt-resident-gib 2
else
  # call 2 (session 3): the 0.5B A/B (fused vs unfused RoPE backward, and the deterministic attention backward),
  # 7B bf16 at 32 micro-steps with the fused path, and a 1.5B e4m3 profile (issue 6: where the time goes)
  E="benchmarks/engine_step.py --model Qwen2.5-0.5B --backend triton --batch-size 32 --steps 8 --cuda-graphs"
  run ab_fused_bf16 45 $E
  run ab_unfused_bf16 45 $E --unfused-attn-rope-bwd
  run ab_det_bf16 45 $E --deterministic-attention
  run ab_fused_e4m3 45 $E --matmul-dtype e4m3
  run 7b_bf16_ga32_kept12 270 $B7 --grad-accumulation 32 --steps 5 --opt-resident-gib 12
  run prof_1p5b_e4m3 70 benchmarks/engine_step.py --model Qwen2.5-1.5B --backend triton --batch-size 16 --steps 3 \
    --matmul-dtype e4m3 --profile
fi
grep -E "passed|failed|^FAILED|^ERROR" "$L" | tail -5
grep -E "^== |^DETERMINISM|cuDNN backward|  attention_backward|^RESULT|^KERNELS [a-z]|^KERNELS wall|^GAPS|^step |^tokens/s|Error|activations|allocated" "$L" | cut -c1-200 | tail -60
