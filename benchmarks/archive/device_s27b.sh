#!/usr/bin/env bash
# Session 27 call B, one H200, carry .whl and .anchors: the whole GPU-marked suite at 14128c5 (its first GPU run of
# the kept-copies plan made once, eb62ad1), then issue 25's bf16 rows beside llm.q on this H200: 0.5B at B=32 x 4
# and 1.5B at the table's default shape, through Ray.
source benchmarks/device_lib.sh s27b.log smi_s27b.csv
PYTHONPATH=/tmp/site:$PWD timeout -s INT 270 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs >> "$L" 2>&1
echo "== gpu suite rc $? $(( $(date +%s) - T0 ))s" | tee -a "$L"
for spec in "Qwen2.5-0.5B --triton-shape 32 4 12 3" "Qwen2.5-1.5B"; do
  PYTHONPATH=/tmp/site:$PWD timeout 150 python3 benchmarks/speed_table.py --models $spec \
    --backends triton --matmul-dtypes bf16 --no-hf-baseline --llmq-bin .anchors/llmq-bin --row-timeout-s 70 \
    --log $OUT/speed_table.log --json-out $OUT/table_${spec%% *}.json --markdown-out $OUT/table_${spec%% *}.md 2>&1 | tail -3 | tee -a "$L"
  echo "== table $spec $(( $(date +%s) - T0 ))s" | tee -a "$L"
done
stop_smi 10
cat $OUT/table_*.md
grep -hE "^== |passed|failed|FAILED|ERROR" "$L" | cut -c1-220 | tail -30
