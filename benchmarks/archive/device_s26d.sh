#!/usr/bin/env bash
# Session 26 call D, one H100, carry .whl and .anchors: the whole GPU-marked suite (`pytest -m gpu`) on the session's
# code, then issue 25's 0.5B bf16 row beside llm.q at B=32 x 4 micro-steps (the update and Ray's per-step cost spread
# over 4x the tokens, on both sides), 3 warm-up + 9 timed steps.
source benchmarks/device_lib.sh s26d.log smi_s26d.csv
PYTHONPATH=/tmp/site:$PWD timeout -s INT 330 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs >> "$L" 2>&1
echo "== gpu suite rc $? $(( $(date +%s) - T0 ))s" | tee -a "$L"
PYTHONPATH=/tmp/site:$PWD timeout 220 python3 benchmarks/speed_table.py --models Qwen2.5-0.5B \
  --backends triton --matmul-dtypes bf16 --no-hf-baseline --triton-shape 32 4 12 3 \
  --llmq-bin .anchors/llmq-bin --row-timeout-s 100 --log $OUT/speed_table.log --json-out $OUT/table.json \
  --markdown-out $OUT/table.md 2>&1 | tail -3 | tee -a "$L"
echo "== table $(( $(date +%s) - T0 ))s" | tee -a "$L"
stop_smi 10
cat $OUT/table.md
grep -hE "^== |passed|failed|FAILED|ERROR|SKIPPED" "$L" | cut -c1-220 | tail -40
