#!/usr/bin/env bash
# Session 8, call 1 (nvidia-h100-x1; carry .whl), on main at 8e88d09 (wgrad-overlap merged in 011718b).
# Session 7 was cut off before it wrote up its calls (its commit messages report +1.2% at 1.5B bf16 through Ray
# with --overlap-wgrad-sms 100: 60,399 / 60,534 against 59,659 / 59,772 plain); this call re-measures on a new lease:
# 1. The whole GPU test suite, `pytest -m gpu` (the merge has not been tested on a GPU as a whole).
# 2. The 1.5B bf16 bar through Ray with --overlap-wgrad-sms 100.
# 3. The 0.5B bf16 bar through Ray, --overlap-wgrad-sms 100 against plain (does it help there too?).
source benchmarks/device_lib.sh session8.log smi8.csv
run gpu_tests 300 -m pytest -m gpu -p no:cacheprovider -q -rA -s tests/
R="benchmarks/bench_train.py --gpus 1 --backend triton --seq-len 1024 --use-cuda-graphs --opt-m-dtype bf16 --opt-v-dtype bf16"
run ray15_side100 100 $R --model Qwen2.5-1.5B --batch-size 16 --grad-accumulation 16 --steps 6 --warmup-steps 2 --overlap-wgrad-sms 100
R05="$R --model Qwen2.5-0.5B --batch-size 32 --steps 25 --warmup-steps 5"
run ray05_side100 70 $R05 --overlap-wgrad-sms 100
run ray05_plain 70 $R05
stop_smi 10
grep -E "PASSED|FAILED|^ERROR|SKIPPED| passed| failed" "$L" | cut -c1-160 | tail -60
grep -E "^== |^tokens/s" "$L" | cut -c1-220
