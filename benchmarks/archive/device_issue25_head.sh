#!/usr/bin/env bash
# Issue 25, session 13 call 1 (nvidia-h100-x1): the FP8 LM head (--lmhead-dtype e4m3).
#   1. GPU tests: the FP8 classifier at the full vocabulary against the torch reference, the FP8 head in the
#      model on torch / triton / cupy, and the e4m3-moment AdamW kernels after the K_MIN = -117 change;
#   2. benchmarks/speed_table.py at Qwen2.5-0.5B: triton bf16, triton e4m3 with the FP8 head, llm.q bf16 and
#      e4m3 beside them (same lease);
#   3. the e4m3 row without the FP8 head (bench_train.py, the speed table's argv) for the A/B, and the FP8-head
#      row once more, alternating; then 1.5B e4m3 with the head if time is left.
# Carry .whl (Ray wheels) and .anchors (an ignored folder holding llmq-bin/). One call:
#   bash benchmarks/archive/device_issue25_head.sh
source benchmarks/device_lib.sh head25.log smi25h.csv
echo "== GPU tests" | tee -a "$L"
PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE -m "gpu or not gpu" \
  tests/test_triton_gpu.py tests/test_fp8_gpu.py -k "classifier or lm_head" >> "$L" 2>&1
echo "gpu tests (head) rc=$?" | tee -a "$L"; grep -E "passed|failed|error" "$L" | tail -2
PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE -m "gpu or not gpu" \
  tests/test_triton_kernels.py tests/test_cupy_gpu.py -k "adamw or e4m3" >> "$L" 2>&1
echo "gpu tests (e4m3 m) rc=$?" | tee -a "$L"; grep -E "passed|failed|error" "$L" | tail -2
echo "== speed table $(( $(date +%s) - T0 ))s" | tee -a "$L"
PYTHONPATH=/tmp/site:$PWD timeout 330 python3 benchmarks/speed_table.py --models Qwen2.5-0.5B --backends triton \
  --matmul-dtypes bf16 e4m3 --fp8-head --llmq-bin .anchors/llmq-bin --no-hf-baseline --row-timeout-s 100 \
  --log $OUT/speed_table.log --json-out $OUT/table.json --markdown-out $OUT/table.md 2>&1 | tail -8 | tee -a "$L"
B05="benchmarks/bench_train.py --model Qwen2.5-0.5B --backend triton --batch-size 32 --grad-accumulation 1 --seq-len 1024 --steps 25 --warmup-steps 5 --opt-m-dtype bf16 --opt-v-dtype bf16 --gpus 1 --matmul-dtype e4m3 --use-cuda-graphs"
for kind in nohead head; do
  left=$(( 585 - ($(date +%s) - T0) ))
  if [ $left -lt 75 ]; then echo "== $kind skipped for time" | tee -a "$L"; continue; fi
  extra=""; [ $kind = head ] && extra="--lmhead-dtype e4m3"
  run $kind $(( left < 100 ? left - 5 : 100 )) $B05 $extra --json $OUT/$kind.json
  python3 -c "import json; r=json.load(open('$OUT/$kind.json')); print('AB $kind', r.get('tokens_per_s_per_gpu'), r.get('step_ms'), r.get('peak_memory_gib'))" 2>&1 | tee -a "$L"
done
left=$(( 585 - ($(date +%s) - T0) ))
if [ $left -gt 110 ]; then
  run head15 $(( left - 5 )) benchmarks/bench_train.py --model Qwen2.5-1.5B --backend triton --batch-size 16 \
    --grad-accumulation 16 --seq-len 1024 --steps 6 --warmup-steps 2 --opt-m-dtype bf16 --opt-v-dtype bf16 --gpus 1 \
    --matmul-dtype e4m3 --lmhead-dtype e4m3 --use-cuda-graphs --json $OUT/head15.json
  python3 -c "import json; r=json.load(open('$OUT/head15.json')); print('AB head15', r.get('tokens_per_s_per_gpu'), r.get('step_ms'), r.get('peak_memory_gib'))" 2>&1 | tee -a "$L"
fi
stop_smi 10
cat $OUT/table.md 2>/dev/null | tee -a "$L"
grep -E "^AB |rc=" "$L"
