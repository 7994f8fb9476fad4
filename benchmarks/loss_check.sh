#!/usr/bin/env bash
# The four-seed loss check: 300 steps of Qwen2.5-0.5B from scratch on tiny-shakespeare (B=4, T=1024, lr 6e-4
# cosine, warmup 30, eval every 50 steps), bf16 against one other kind, seed by seed, on one GPU; from the
# repository root, carry .whl and runs/shake (python -m llmq_ray.data_pipeline.tokenize --input tiny-shakespeare
# --out runs/shake):
#   bash benchmarks/loss_check.sh 42 43 44 45                   # bf16 vs the 8-bit Adam m (--opt-m-dtype e4m3)
#   KIND=fp8h EXTRA="--matmul-dtype e4m3 --lmhead-dtype e4m3" bash benchmarks/loss_check.sh 42 43 44 45
# KIND / EXTRA: the name and flags of the run compared with bf16; LOG: the log's name. The runs' JSON logs go to
# $OUT/conv_<kind>_<seed>.json and benchmarks/conv_summary.py prints each seed's final evals and each kind's
# spread. Eight runs take 8-9 minutes on an H100; the recipe of benchmarks/results/h100-2026-11-26.md
# (issue 25's 8-bit first moment and FP8 LM head checks).
SEEDS="${*:-42 43 44 45}"
KIND=${KIND:-m8}; EXTRA=${EXTRA:---opt-m-dtype e4m3}
source benchmarks/device_lib.sh ${LOG:-loss_check.log} smi_loss_check.csv
C="examples/train.py --model Qwen2.5-0.5B --from-scratch --train-file runs/shake/train-*.bin --eval-file runs/shake/eval.bin --batch-size 4 --seq-len 1024 --steps 300 --gpus 1 --backend triton --learning-rate 6e-4 --lr-schedule cosine --warmup 30 --eval-every-n-steps 50 --no-export --sample-tokens 0 --no-progress"
for seed in $SEEDS; do
  for kind in bf16 $KIND; do
    if [ $(( $(date +%s) - T0 )) -gt 520 ]; then echo "== $kind $seed skipped for time" | tee -a "$L"; continue; fi
    extra=""; [ $kind = $KIND ] && extra="$EXTRA"
    run ${kind}_$seed 100 $C --seed $seed $extra --out-dir $OUT/${kind}_$seed --log-file $OUT/conv_${kind}_$seed.json
  done
done
stop_smi 10
python3 benchmarks/conv_summary.py "$OUT" bf16 $KIND --seeds $SEEDS | tee -a "$L"  # per seed, then each kind's spread
