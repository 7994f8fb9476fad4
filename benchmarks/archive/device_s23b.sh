#!/usr/bin/env bash
# Session 23, the last ~420 s of device time (nvidia-h100-x1; carry .whl and .anchors): issue 25's 1.5B e4m3 bar
# with 5 timed steps -- triton bf16, e4m3 + FP8 head + --fp8-delayed-swiglu-scale and llm.q in one speed table
# (1.5B's triton shape: B=16 x 16, 2 warm-up + 5 timed steps), no HF row (it needs ~150 s of compile and the
# budget does not hold it; session 13's lease D has it).
source benchmarks/device_lib.sh s23b.log smi_s23b.csv
PYTHONPATH=/tmp/site:$PWD timeout ${LIMIT:-360} python3 benchmarks/speed_table.py --models Qwen2.5-1.5B \
  --backends triton --matmul-dtypes bf16 e4m3 --fp8-head --fp8-delayed-swiglu-scale --no-hf-baseline \
  --llmq-bin .anchors/llmq-bin --row-timeout-s 110 --log $OUT/speed_table.log --json-out $OUT/table.json \
  --markdown-out $OUT/table.md 2>&1 | tail -4 | tee -a "$L"
stop_smi 10
cat $OUT/table.md | tee -a "$L"
grep -hE "tokens/s|Error|error" $OUT/speed_table.log | cut -c1-240 | tail -12
