#!/usr/bin/env bash
# Session 25, one H100, carry .whl: the SwiGLU FP8 kernels' tiles with 7 more candidates (fp8_tiles.py), then
# the engine (no Ray) at 7B e4m3, B=6 x 21, delayed scale, --kept-quants-gib 1.4: the table's tiles vs the
# sweep's best, A/B.
source benchmarks/device_lib.sh s25_tiles2.log smi_s25_tiles2.csv
run sweep 120 benchmarks/fp8_tiles.py --reps 20 --kinds swiglu_bwd,swiglu_fwd
BEST=$(grep -h "^BEST " "$L" | sed -E 's/^BEST ([a-z_]+): \(([0-9]+), ([0-9]+), ([0-9]+)\).*/--fp8-tiles \1=\2,\3,\4/' | tr '\n' ' ')
echo "best: $BEST" | tee -a "$L"
S7="benchmarks/engine_step.py --model Qwen2.5-7B --backend triton --batch-size 6 --grad-accumulation 21 --steps 3
 --master-dtype bf16 --opt-m-dtype e4m3 --opt-v-dtype bf16 --matmul-dtype e4m3 --lmhead-dtype e4m3 --lmhead-chunks 4
 --transient-quants --fp8-delayed-swiglu-scale --kept-quants-gib 1.4"
run e7_table 110 $S7
run e7_best 110 $S7 $BEST
stop_smi 10
grep -hE "^== |^best|SHAPE|BEST|WRONG|failed|RESULT|Error|error" "$L" | cut -c1-220
