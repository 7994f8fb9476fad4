#!/usr/bin/env bash
# Ran at commit ca7b431 (its tools are there; main later removed what this call showed slower or inconclusive).
# Session 6, call 4 (nvidia-h100-x1; carry .whl). GEMM algorithms timed under sustained load (backends/cublaslt.py
# _TUNE_HEAT_MS / round-robin) against the cold timing of anchor_6 (untracked; = 90fe610):
#   git archive 90fe610 backends llmq_ray benchmarks/engine_step.py benchmarks/bench_train.py | (mkdir -p anchor_6 && tar -x -C anchor_6)
# 1. GPU tests of the cuBLASLt path. 2. Alternating A/B, 1.5B bf16 (B=16 x 4) twice, 0.5B bf16 (B=32) once.
# 3. The four issue-6 bars through Ray, with whichever tree was faster at 1.5B bf16.
source benchmarks/device_lib.sh session6d.log smi6d.csv
run gpu_tests 90 -m pytest -m gpu -p no:cacheprovider -q -rA -s tests/test_fp8_gpu.py -k "cublaslt or tuning or accumulates"
E15="benchmarks/engine_step.py --backend triton --cuda-graphs --model Qwen2.5-1.5B --batch-size 16 --grad-accumulation 4 --steps 6"
E05="benchmarks/engine_step.py --backend triton --cuda-graphs --model Qwen2.5-0.5B --batch-size 32 --steps 10"
run_in anchor_6 cold_15b 60 anchor_6/$E15
run hot_15b 60 $E15
run_in anchor_6 cold_15b_2 60 anchor_6/$E15
run hot_15b_2 60 $E15
run_in anchor_6 cold_05b 40 anchor_6/$E05
run hot_05b 40 $E05
tps() { awk -v n="== $1 " '$0 ~ n {f=1} f && /^RESULT/ {for (i=1;i<=NF;i++) if ($i ~ /^tokens_per_s=/) {split($i,a,"="); print a[2]; exit}}' "$L"; }
cold=$(( $(tps cold_15b) + $(tps cold_15b_2) )); hot=$(( $(tps hot_15b) + $(tps hot_15b_2) ))
TREE=.; [ "$hot" -lt "$cold" ] && TREE=anchor_6
echo "== A/B 1.5B bf16: cold $cold, hot $hot (sums of two runs); Ray runs with tree '$TREE'" | tee -a "$L"
R="$TREE/benchmarks/bench_train.py --gpus 1 --backend triton --seq-len 1024 --use-cuda-graphs --opt-m-dtype bf16 --opt-v-dtype bf16"
run_in $TREE ray_15b_bf16 110 $R --model Qwen2.5-1.5B --batch-size 16 --grad-accumulation 16 --steps 6 --warmup-steps 2
run_in $TREE ray_15b_e4m3 100 $R --model Qwen2.5-1.5B --batch-size 16 --grad-accumulation 16 --steps 6 --warmup-steps 2 --matmul-dtype e4m3
run_in $TREE ray_05b_bf16 70 $R --model Qwen2.5-0.5B --batch-size 32 --steps 25 --warmup-steps 5
run_in $TREE ray_05b_e4m3 70 $R --model Qwen2.5-0.5B --batch-size 32 --steps 25 --warmup-steps 5 --matmul-dtype e4m3
stop_smi 10
grep -E "[0-9] passed|[0-9] failed|^FAILED|^ERROR|tuned bf16" "$L" | cut -c1-220 | tail -8
grep -E "^== |^RESULT|^tokens/s" "$L" | cut -c1-220 | tail -30
