#!/usr/bin/env bash
# Issue 25's loss point for the 8-bit Adam first moment (session 12, nvidia-h100-x1; carry .whl and runs/shake):
# 300 steps of Qwen2.5-0.5B from scratch on tiny-shakespeare, the bf16 path against the same with
# --opt-m-dtype e4m3, four seeds, the setup of h100-2026-11-24.md section 36 (B=4, T=1024, lr 6e-4 cosine, warmup
# 30, eval every 50 steps). runs/shake: python -m llmq_ray.data_pipeline.tokenize --input tiny-shakespeare --out runs/shake
#   bash benchmarks/archive/device_issue25_conv.sh 42 43 44 45
# KIND / EXTRA (environment): the name and flags of the run compared with bf16 (default: m8, --opt-m-dtype e4m3;
# device_issue25_conv_head.sh sets fp8h, the FP8 block GEMMs and LM head); LOG: the log's name.
SEEDS="${*:-42 43 44 45}"
KIND=${KIND:-m8}; EXTRA=${EXTRA:---opt-m-dtype e4m3}
source benchmarks/device_lib.sh ${LOG:-conv25.log} smi25c.csv
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
