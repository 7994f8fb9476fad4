#!/usr/bin/env bash
# Session 7, call 2 (nvidia-h100-x1; carry .whl), on branch wgrad-overlap with --overlap-wgrad-sms plumbed
# through the trainer. Call 1 (device_session7.sh) measured the side-stream wgrads in the engine at 1.5B bf16:
# +1.4% at 100 SMs, +0.0% at 116.
# 1. The engine at 84, 92 and 108 SMs (is 100 the best?).
# 2. The 1.5B bf16 bar through Ray, alternating plain / --overlap-wgrad-sms 100, twice each.
source benchmarks/device_lib.sh session7b.log smi7b.csv
E15="benchmarks/engine_step.py --backend triton --cuda-graphs --model Qwen2.5-1.5B --batch-size 16 --grad-accumulation 4 --steps 6"
run side92_15b 45 $E15 --overlap-wgrad 92
run side108_15b 45 $E15 --overlap-wgrad 108
run side84_15b 45 $E15 --overlap-wgrad 84
R="benchmarks/bench_train.py --gpus 1 --backend triton --seq-len 1024 --use-cuda-graphs --opt-m-dtype bf16 --opt-v-dtype bf16 --model Qwen2.5-1.5B --batch-size 16 --grad-accumulation 16 --steps 6 --warmup-steps 2"
run ray_plain 100 $R
run ray_side100 100 $R --overlap-wgrad-sms 100
run ray_plain_2 100 $R
run ray_side100_2 100 $R --overlap-wgrad-sms 100
stop_smi 10
grep -E "^== |^RESULT|^tokens/s" "$L" | cut -c1-220
