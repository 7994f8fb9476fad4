#!/usr/bin/env bash
# Session 17, call 2 (nvidia-h100-x1; carry .whl): tile shapes of the Triton attention under --document-masking at
# Qwen3's heads (16/8 x 128, B=16; the winners are printed, not applied), then the speed rows of Qwen3-1.7B (bf16,
# e4m3 + FP8 head) and GPT-2 124M (bf16), each beside the HF baseline, through Ray, CUDA graphs.
source benchmarks/device_lib.sh s17b.log smi17b.csv
export PYTHONUNBUFFERED=1
run tiles_q3 100 benchmarks/attention_tiles.py --heads 16 8 128 --batch-size 16 --json-out $OUT/tiles128.json
for spec in "Qwen3-1.7B bf16 e4m3" "gpt2 bf16"; do
  set -- $spec; m=$1; shift
  left=$(( 590 - ($(date +%s) - T0) ))
  PYTHONPATH=/tmp/site:$PWD timeout -s INT $left python3 benchmarks/speed_table.py --models $m \
    --backends triton --matmul-dtypes "$@" --fp8-head --row-timeout-s 150 --log $OUT/speed_table.log \
    --json-out $OUT/table-$m.json --markdown-out $OUT/table-$m.md 2>&1 | tail -8 >> "$L"
  echo "== table $m rc $? $(( $(date +%s) - T0 ))s" | tee -a "$L"
done
stop_smi 10
grep -E "^\| |passed|failed|Error|error:|== |Killed|memory" "$L" | grep -v "cosine vs current" | cut -c1-230 | tail -40
