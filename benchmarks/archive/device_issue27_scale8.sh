#!/usr/bin/env bash
# Issue 27, session 15 (nvidia-h100-x2; carry .whl and .anchors): 1 -> 2 GPU scaling of Qwen2.5-0.5B at a training
# batch people use (B=32 x 8 micro-steps per GPU: 262k tokens per GPU per step, 524k on two), bf16 and e4m3 (+ FP8
# head), ZeRO-1, CUDA graphs, default communication, llm.q's binary at the same shape on 1 and 2 GPUs beside it.
# (The B=32 x 1 rows of session 14 reduce and gather every 32k tokens: the worst case, 97.95%.)
source benchmarks/device_lib.sh scale27.log smi27s.csv
PYTHONPATH=/tmp/site:$PWD timeout 560 python3 benchmarks/speed_table.py --models Qwen2.5-0.5B \
  --backends triton --matmul-dtypes bf16 e4m3 --fp8-head --gpus 1 2 --llmq-bin .anchors/llmq-bin --no-hf-baseline \
  --triton-shape 32 8 8 2 --row-timeout-s 110 --log $OUT/speed_table.log --json-out $OUT/table-0.5B-acc8.json \
  --markdown-out $OUT/table-0.5B-acc8.md 2>&1 | tail -3 | tee -a "$L"
cat $OUT/table-0.5B-acc8.md | tee -a "$L"
stop_smi 10
