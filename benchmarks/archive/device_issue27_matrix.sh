#!/usr/bin/env bash
# Issue 27 (nvidia-h100-x2 or nvidia-h200-x2; carry .whl and .anchors, an ignored folder holding llmq-bin/): the
# two-GPU matrix, one device call per model and dtype (each fits the 10-minute limit), merged afterwards with
# `python benchmarks/speed_table.py --merge OUT1/table.json OUT2/table.json ...`:
#   bash benchmarks/archive/device_issue27_matrix.sh Qwen2.5-0.5B bf16
#   bash benchmarks/archive/device_issue27_matrix.sh Qwen2.5-0.5B e4m3   (and the same for Qwen2.5-1.5B)
# Rows: ours on 1 GPU (ZeRO-1, CUDA graphs) and on 2 GPUs with ZeRO-1 (CUDA graphs), ZeRO-2 and ZeRO-3; llm.q's
# binary on 1 and 2 GPUs beside them; peak memory per GPU in every row of ours (llm.q prints none).
MODEL=${1:-Qwen2.5-0.5B}; DTYPE=${2:-bf16}
source benchmarks/device_lib.sh matrix27.log smi27m.csv
HEAD=""; [ "$DTYPE" = e4m3 ] && HEAD="--fp8-head"
PYTHONPATH=/tmp/site:$PWD timeout 585 python3 benchmarks/speed_table.py --models $MODEL --backends triton \
  --matmul-dtypes $DTYPE $HEAD --gpus 1 2 --zero-levels 1 2 3 --llmq-bin .anchors/llmq-bin --no-hf-baseline \
  --row-timeout-s 110 --log $OUT/speed_table.log --json-out $OUT/table.json --markdown-out $OUT/table.md \
  2>&1 | tail -3 | tee -a "$L"
stop_smi 10
[ -f $OUT/table.md ] || python3 benchmarks/speed_table.py --merge $OUT/table.json --markdown-out $OUT/table.md
cat $OUT/table.md | tee -a "$L"
