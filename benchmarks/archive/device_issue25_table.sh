#!/usr/bin/env bash
# Issue 25, session 13 (nvidia-h100-x1): the README speed table from one run per model -- ours (triton bf16, and
# e4m3 with the FP8 LM head), llm.q's prebuilt binary and the HF/PyTorch baseline, same lease -- after the GPU
# tests of the FP8 classifier (row kernel + FP8 transpose). The table runs only if those tests pass.
# Carry .whl and .anchors (an ignored folder holding llmq-bin/).
#   bash benchmarks/archive/device_issue25_table.sh Qwen2.5-0.5B [TESTS]
MODEL=${1:-Qwen2.5-0.5B}
source benchmarks/device_lib.sh table25.log smi25t.csv
if [ "${2:-}" = TESTS ]; then
  PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE -m "gpu or not gpu" \
    tests/test_triton_gpu.py tests/test_fp8_gpu.py -k "classifier or lm_head" >> "$L" 2>&1
  rc=$?; echo "gpu tests (head) rc=$rc" | tee -a "$L"; grep -E "passed|failed" "$L" | tail -1
  [ $rc = 0 ] || exit 1
fi
echo "== speed table $MODEL $(( $(date +%s) - T0 ))s" | tee -a "$L"
PYTHONPATH=/tmp/site:$PWD timeout $(( 575 - ($(date +%s) - T0) )) python3 benchmarks/speed_table.py --models $MODEL \
  --backends triton --matmul-dtypes bf16 e4m3 --fp8-head --llmq-bin .anchors/llmq-bin --row-timeout-s 130 \
  --log $OUT/speed_table.log --json-out $OUT/table-$MODEL.json --markdown-out $OUT/table-$MODEL.md 2>&1 | tail -4 | tee -a "$L"
stop_smi 10
cat $OUT/table-$MODEL.md | tee -a "$L"
