#!/usr/bin/env bash
# Issue 27, session 14 (nvidia-h100-x2; carry .whl and .anchors): Qwen2.5-1.5B on 1 and 2 GPUs, ZeRO-1, CUDA graphs,
# bf16 and e4m3 (+ FP8 head), llm.q's binary on 1 and 2 GPUs beside them (default communication: one
# reduce-scatter and one all-gather between steps); then, if time is left, 0.5B on 2 GPUs with --overlap-comm and
# NCCL limited to 2 channels (fewer SMs taken from the compute kernels).
source benchmarks/device_lib.sh table27.log smi27t.csv
PYTHONPATH=/tmp/site:$PWD timeout 500 python3 benchmarks/speed_table.py --models Qwen2.5-1.5B \
  --backends triton --matmul-dtypes bf16 e4m3 --fp8-head --gpus 1 2 --llmq-bin .anchors/llmq-bin --no-hf-baseline \
  --row-timeout-s 95 --log $OUT/speed_table.log --json-out $OUT/table-1.5B.json \
  --markdown-out $OUT/table-1.5B.md 2>&1 | tail -3 | tee -a "$L"
cat $OUT/table-1.5B.md | tee -a "$L"
if [ $(( $(date +%s) - T0 )) -lt 530 ]; then
  NCCL_MAX_NCHANNELS=2 run overlap-comm-2ch $(( 590 - ($(date +%s) - T0) )) benchmarks/bench_train.py --model Qwen2.5-0.5B \
    --backend triton --batch-size 32 --grad-accumulation 1 --steps 20 --warmup-steps 5 --opt-m-dtype bf16 \
    --opt-v-dtype bf16 --gpus 2 --use-cuda-graphs --overlap-comm
  grep -E "tokens/s" "$L" | tail -1
fi
stop_smi 10
