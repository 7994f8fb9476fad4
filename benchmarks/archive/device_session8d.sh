#!/usr/bin/env bash
# Session 8, calls 4 and 5 (nvidia-h100-x1; carry .whl): issue 6's speed table from one script,
# benchmarks/speed_table.py. For one model it runs triton bf16 / e4m3 (+ the side-stream wgrads at 100 SMs),
# the torch reference and the HF baseline, each as its own process, and prints the table.
#   bash benchmarks/archive/device_session8d.sh Qwen2.5-0.5B     (call 4)
#   bash benchmarks/archive/device_session8d.sh Qwen2.5-1.5B     (call 5)
# Merge the two: python benchmarks/speed_table.py --merge speed_*.json
M=${1:?model preset}
source benchmarks/device_lib.sh "speed_$M.log" "smi_$M.csv"
run "table_$M" 580 benchmarks/speed_table.py --models "$M" --overlap-wgrad-sms 100 --row-timeout-s 170 \
    --log "$OUT/rows_$M.log" --json-out "$OUT/speed_$M.json" --markdown-out "$OUT/speed_$M.md"
stop_smi 10
grep -E "^== |^\[" "$L" | cut -c1-220
cat "$OUT/speed_$M.md"
