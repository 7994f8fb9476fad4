#!/usr/bin/env bash
# Session 17, call 5 (nvidia-h100-x1; carry .whl): GPT-2 1558M (padded LM head) beside the HF baseline in one
# lease; the HF row gets 300 s (its torch.compile of 48 layers took more than 150 s in call 3).
source benchmarks/device_lib.sh s17e.log smi17e.csv
export PYTHONUNBUFFERED=1
PYTHONPATH=/tmp/site:$PWD timeout -s INT 580 python3 benchmarks/speed_table.py --models gpt2-xl \
  --backends triton --matmul-dtypes bf16 --row-timeout-s 300 --log $OUT/speed_table.log \
  --json-out $OUT/table-gpt2-xl.json --markdown-out $OUT/table-gpt2-xl.md 2>&1 | tail -8 >> "$L"
echo "== table gpt2-xl rc $? $(( $(date +%s) - T0 ))s" | tee -a "$L"
stop_smi 10
grep -E "^\| |RESULT|Error|error:|== " "$L" | cut -c1-200 | tail -20
