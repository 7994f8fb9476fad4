#!/usr/bin/env bash
# Session 7, call 3 (nvidia-h100-x1; carry .whl), on main after merging wgrad-overlap (011718b and later):
# 1. The whole GPU test suite, `pytest -m gpu`.
# 2. The 0.5B bf16 bar through Ray, alternating plain / --overlap-wgrad-sms 100 (does the overlap help there too?).
# 3. The 1.5B bf16 bar through Ray with --overlap-wgrad-sms 84 (the engine sweep's best, within noise of 100).
source benchmarks/device_lib.sh session7c.log smi7c.csv
run gpu_tests 270 -m pytest -m gpu -p no:cacheprovider -q -rA -s tests/
R="benchmarks/bench_train.py --gpus 1 --backend triton --seq-len 1024 --use-cuda-graphs --opt-m-dtype bf16 --opt-v-dtype bf16"
R05="$R --model Qwen2.5-0.5B --batch-size 32 --steps 25 --warmup-steps 5"
run ray05_plain 70 $R05
run ray05_side100 70 $R05 --overlap-wgrad-sms 100
run ray05_plain_2 70 $R05
run ray05_side100_2 70 $R05 --overlap-wgrad-sms 100
run ray15_side84 100 $R --model Qwen2.5-1.5B --batch-size 16 --grad-accumulation 16 --steps 6 --warmup-steps 2 --overlap-wgrad-sms 84
stop_smi 10
grep -E "PASSED|FAILED|^ERROR|SKIPPED| passed| failed" "$L" | cut -c1-160 | tail -60
grep -E "^== |^tokens/s" "$L" | cut -c1-220
