#!/usr/bin/env bash
# Session 31 call C, one H200, carry .whl: the HF baseline rows that timed out in calls A-B (0.5B: measured, then
# hung at exit in inductor's compile-worker shutdown; 1.5B: its torch.compile ran past the 110 s row limit), now
# through speed_table.py's own --hf-timeout-s and hf_baseline.py's exit without the interpreter's exit handlers.
# Each row must end right after its RESULT line, with rc 0 and its JSON record.
source benchmarks/device_lib.sh s31c.log smi_s31c.csv
for m in Qwen2.5-0.5B:16 Qwen2.5-1.5B:8; do
  run hf_${m%%:*} 280 benchmarks/hf_baseline.py --model ${m%%:*} --batch-size ${m##*:} --seq-len 1024 --steps 10 \
    --json "$OUT/hf_${m%%:*}.json"
  ls -l "$OUT/hf_${m%%:*}.json" >> "$L" 2>&1
done
stop_smi 10
grep -hE "^== |RESULT|hf_|Error|error" "$L" | cut -c1-220 | tail -20
