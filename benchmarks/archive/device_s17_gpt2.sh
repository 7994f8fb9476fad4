#!/usr/bin/env bash
# Session 17, call 3 (nvidia-h100-x1; carry .whl): why GPT-2 124M trails the HF baseline (call 2: 294,563 vs
# 344,043 tokens/s): one profiled step of the engine (no Ray) at B=64 x 2, and the same with the vocabulary
# padded from 50257 to 50304 (a multiple of 64); the Qwen3-heads tile sweep with the current tiles included;
# then GPT-2 1558M's speed rows (ours bf16, HF baseline).
source benchmarks/device_lib.sh s17c.log smi17c.csv
export PYTHONUNBUFFERED=1
ES="benchmarks/engine_step.py --model gpt2 --backend triton --batch-size 64 --grad-accumulation 2 --steps 5 --cuda-graphs"
run gpt2_profile 90 $ES --profile
run gpt2_vocab50304 70 $ES --vocab-size 50304
run tiles_q3 130 benchmarks/attention_tiles.py --heads 16 8 128 --batch-size 16 --stages 2 3 --json-out $OUT/tiles128.json
left=$(( 590 - ($(date +%s) - T0) ))
PYTHONPATH=/tmp/site:$PWD timeout -s INT $left python3 benchmarks/speed_table.py --models gpt2-xl \
  --backends triton --matmul-dtypes bf16 --row-timeout-s 150 --log $OUT/speed_table.log \
  --json-out $OUT/table-gpt2-xl.json --markdown-out $OUT/table-gpt2-xl.md 2>&1 | tail -8 >> "$L"
echo "== table gpt2-xl rc $? $(( $(date +%s) - T0 ))s" | tee -a "$L"
stop_smi 10
grep -E "^\| |RESULT|KERNELS|GAPS|Error|error:|== |memory" "$L" | grep -v "cosine vs current" | cut -c1-200 | tail -60
