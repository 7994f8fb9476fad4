#!/usr/bin/env bash
# Session 25, one H100, carry .whl: the tile shapes of the FP8 transposing Triton kernels (quantize with
# transpose, the delayed-scale SwiGLU forward/backward), all (64, 64, 4) so far. 1) benchmarks/fp8_tiles.py:
# every candidate at the 0.5B / 1.5B / 7B shapes, bytes compared with the default's; 2) the engine (no Ray) at
# 7B e4m3 (the README row's options, B=6) and 0.5B e4m3 with the default tiles and with the sweep's best, A/B/A/B.
source benchmarks/device_lib.sh s25_tiles.log smi_s25_tiles.csv
run sweep 200 benchmarks/fp8_tiles.py --reps 20
BEST=$(grep -h "^BEST " "$L" | sed -E 's/^BEST ([a-z_]+): \(([0-9]+), ([0-9]+), ([0-9]+)\).*/--fp8-tiles \1=\2,\3,\4/' | tr '\n' ' ')
echo "best: $BEST" | tee -a "$L"
S7="benchmarks/engine_step.py --model Qwen2.5-7B --backend triton --batch-size 6 --grad-accumulation 21 --steps 3
 --master-dtype bf16 --opt-m-dtype e4m3 --opt-v-dtype bf16 --matmul-dtype e4m3 --lmhead-dtype e4m3 --lmhead-chunks 4
 --transient-quants --fp8-delayed-swiglu-scale"
S05="benchmarks/engine_step.py --model Qwen2.5-0.5B --backend triton --batch-size 32 --steps 20 --master-dtype fp32
 --opt-dtype bf16 --matmul-dtype e4m3 --lmhead-dtype e4m3 --fp8-delayed-swiglu-scale --cuda-graphs"
run e05_default_1 60 $S05
run e05_best_1 60 $S05 $BEST
run e7_default 110 $S7
run e7_best 110 $S7 $BEST
run e05_default_2 60 $S05
run e05_best_2 60 $S05 $BEST
stop_smi 10
grep -hE "^== |^best|SHAPE|BEST|WRONG|failed|RESULT|Error|error" "$L" | cut -c1-220
