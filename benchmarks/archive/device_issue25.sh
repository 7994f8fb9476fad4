#!/usr/bin/env bash
# Issue 25, first GPU call (session 12): the 8-bit Adam first moment and llm.q beside us in the speed table.
#   1. the GPU tests of the new kernels (Triton and CuPy AdamW with an e4m3 m, against the torch reference);
#   2. benchmarks/speed_table.py for Qwen2.5-0.5B: triton bf16 and e4m3 (bf16 m and v, the README rows) and
#      llm.q's prebuilt binary at the same shapes, bf16 and e4m3 (its e4m3 path may abort on CUDA 13);
#   3. the same triton bf16 row with --opt-m-dtype e4m3 (what the 8-bit m costs or saves in the update).
# Carry .whl (Ray wheels) and .anchors (an ignored folder holding llmq-bin/: the prebuilt llm.q binary and its
# library, built for sm_90 against CUDA 13). One call:
#   bash benchmarks/archive/device_issue25.sh
source benchmarks/device_lib.sh issue25.log smi25.csv
echo "== GPU tests" | tee -a "$L"
PYTHONPATH=/tmp/site:$PWD timeout 240 python3 -m pytest -q -p no:cacheprovider -rfE \
  -m "gpu or not gpu" tests/test_triton_kernels.py tests/test_cupy_gpu.py -k "adamw or e4m3" >> "$L" 2>&1
echo "gpu tests rc=$?" | tee -a "$L"; grep -E "passed|failed|error" "$L" | tail -3
echo "== speed table $(( $(date +%s) - T0 ))s" | tee -a "$L"
PYTHONPATH=/tmp/site:$PWD timeout 420 python3 benchmarks/speed_table.py --models Qwen2.5-0.5B --backends triton \
  --matmul-dtypes bf16 e4m3 --llmq-bin .anchors/llmq-bin --no-hf-baseline --row-timeout-s 110 \
  --log $OUT/speed_table.log --json-out $OUT/table.json --markdown-out $OUT/table.md 2>&1 | tail -12 | tee -a "$L"
left=$(( 590 - ($(date +%s) - T0) ))
echo "== m8 row, ${left}s left" | tee -a "$L"
if [ $left -gt 100 ]; then
  run m8 $(( left - 10 )) benchmarks/bench_train.py --model Qwen2.5-0.5B --backend triton --batch-size 32 \
    --grad-accumulation 1 --seq-len 1024 --steps 25 --warmup-steps 5 --opt-m-dtype e4m3 --opt-v-dtype bf16 \
    --gpus 1 --use-cuda-graphs --json $OUT/m8.json
  python3 -c "import json; r=json.load(open('$OUT/m8.json')); print('M8', r.get('tokens_per_s_per_gpu'), r.get('step_ms'), r.get('peak_memory_gib'))" 2>&1 | tee -a "$L"
fi
stop_smi 10
