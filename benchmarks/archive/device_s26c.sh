#!/usr/bin/env bash
# Session 26 call C, one H100, carry .whl: profiles of one engine step at 7B bf16 (every optimizer state on the GPU,
# B=6 x 3 micro-steps) and 1.5B bf16 (B=16 x 4), for issue 25's bf16 bars: the GEMMs' in-step TFLOP/s, the SM clock
# at the 700 W cap, and what the rest (attention, SwiGLU, norms, classifier, AdamW) takes per 1k tokens.
source benchmarks/device_lib.sh s26c.log smi_s26c.csv
run prof_7b_bf16 200 benchmarks/engine_step.py --model Qwen2.5-7B --backend triton --batch-size 6 --grad-accumulation 3 \
  --steps 2 --master-dtype bf16 --opt-m-dtype e4m3 --opt-v-dtype bf16 --lmhead-chunks 4 --profile
run prof_15_bf16 150 benchmarks/engine_step.py --model Qwen2.5-1.5B --backend triton --batch-size 16 --grad-accumulation 4 \
  --steps 3 --profile
stop_smi 5
grep -hE "^== |^step|^KERNELS|^TOPKERNEL|^GAPS|tokens/s|Error|error" "$L" | cut -c1-200 | head -120
