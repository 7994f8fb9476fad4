#!/usr/bin/env bash
# Issue 25, written in session 20 for the next lease (nvidia-h100-x1): what --fp8-delayed-swiglu-scale still needs
# before it can be the default (session 20 measured +5.3% at 0.5B and 1.5B e4m3 + FP8 head, h100-2026-11-27.md).
#   bash benchmarks/archive/device_issue25_next.sh conv      # carry .whl and runs/shake: the 4-seed loss check,
#       bf16 and the delayed scale alternating per seed in one lease (device_issue25_conv.sh's setup, ~9 min)
#   bash benchmarks/archive/device_issue25_next.sh table M   # carry .whl and .anchors (llmq-bin/): the speed table
#       of model M -- triton bf16, e4m3 + FP8 head + delayed scale, llm.q and the HF baseline, one lease (1.5B now
#       times 5 steps after the warm-up)
case "$1" in
  conv)
    KIND=dly EXTRA="--matmul-dtype e4m3 --lmhead-dtype e4m3 --fp8-delayed-swiglu-scale" LOG=conv25n.log \
      bash benchmarks/archive/device_issue25_conv.sh 42 43 44 45 ;;
  table)
    MODEL=${2:-Qwen2.5-0.5B}
    source benchmarks/device_lib.sh table25n.log smi25n.csv
    PYTHONPATH=/tmp/site:$PWD timeout $(( 575 - ($(date +%s) - T0) )) python3 benchmarks/speed_table.py \
      --models $MODEL --backends triton --matmul-dtypes bf16 e4m3 --fp8-head --fp8-delayed-swiglu-scale \
      --llmq-bin .anchors/llmq-bin --row-timeout-s 130 --log $OUT/speed_table.log \
      --json-out $OUT/table-$MODEL.json --markdown-out $OUT/table-$MODEL.md 2>&1 | tail -4 | tee -a "$L"
    stop_smi 10
    cat $OUT/table-$MODEL.md | tee -a "$L" ;;
  *) echo "usage: $0 conv | table MODEL"; exit 2 ;;
esac
