#!/usr/bin/env bash
# Session 26 call A, one H100, carry .whl and .anchors: the GPU test loosened last session (deterministic
# attention in the engine, fp32) and session 25's GPU-touched tests, then issue 25's 0.5B bf16 row beside llm.q
# (one speed table, no HF row) and a profile of one 0.5B bf16 engine step (where the time goes now).
source benchmarks/device_lib.sh s26a.log smi_s26a.csv
PYTHONPATH=/tmp/site:$PWD timeout -s INT 150 python3 -m pytest -o addopts="" -q -p no:cacheprovider \
  tests/test_triton_kernels.py tests/test_params_init.py tests/test_offload.py -k "deterministic or params or kept or offload" >> "$L" 2>&1
echo "== tests rc $? $(( $(date +%s) - T0 ))s" | tee -a "$L"
PYTHONPATH=/tmp/site:$PWD timeout 300 python3 benchmarks/speed_table.py --models Qwen2.5-0.5B \
  --backends triton --matmul-dtypes bf16 --no-hf-baseline \
  --llmq-bin .anchors/llmq-bin --row-timeout-s 120 --log $OUT/speed_table.log --json-out $OUT/table.json \
  --markdown-out $OUT/table.md 2>&1 | tail -4 | tee -a "$L"
echo "== table $(( $(date +%s) - T0 ))s" | tee -a "$L"
run prof05 120 benchmarks/engine_step.py --model Qwen2.5-0.5B --backend triton --batch-size 32 --seq-len 1024 \
  --steps 4 --profile
stop_smi 10
cat $OUT/table.md | tee -a "$L"
grep -hE "^== |passed|failed|FAILED|tokens/s|Error|error" "$L" | cut -c1-220 | tail -30
