#!/usr/bin/env bash
# Session 17, call 6 (nvidia-h100-x1; carry .whl): Qwen3-1.7B (bf16, e4m3 + FP8 head) beside the HF baseline in one
# lease; the HF row gets 300 s (it took more than 150 s in call 2).
source benchmarks/device_lib.sh s17f.log smi17e.csv
export PYTHONUNBUFFERED=1
PYTHONPATH=/tmp/site:$PWD timeout -s INT 580 python3 benchmarks/speed_table.py --models Qwen3-1.7B \
  --backends triton --matmul-dtypes bf16 e4m3 --fp8-head --row-timeout-s 300 --log $OUT/speed_table.log \
  --json-out $OUT/table-Qwen3-1.7B.json --markdown-out $OUT/table-Qwen3-1.7B.md 2>&1 | tail -8 >> "$L"
echo "== table Qwen3-1.7B rc $? $(( $(date +%s) - T0 ))s" | tee -a "$L"
stop_smi 10
grep -E "^\| |RESULT|Error|error:|== " "$L" | cut -c1-200 | tail -20
