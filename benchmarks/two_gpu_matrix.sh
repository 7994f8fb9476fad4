#!/usr/bin/env bash
# The two-GPU matrix (nvidia-h100-x2 / nvidia-h200-x2), in four parts of under ten minutes each (a device call's
# limit), all in one lease; from the repository root, carry .whl (+ .anchors for `scale`, runs/shake for `curves`):
#   bash benchmarks/two_gpu_matrix.sh scale05  # 1 -> 2 GPUs at 0.5B (B=32 x 8), bf16 and e4m3 (+ FP8 head),
#                                              # ZeRO-1, CUDA graphs, llm.q's binary beside each (~4 minutes)
#   bash benchmarks/two_gpu_matrix.sh scale15  # the same at 1.5B (B=16 x 16) (~8 minutes)
#   bash benchmarks/two_gpu_matrix.sh curves   # 50 steps of 0.5B on real text: 1 GPU (B=8 x 2 and, as the noise
#                                              # reference, B=16 x 1) vs 2 GPUs (B=8 x 1 each); ZeRO-2/3 rows
#   bash benchmarks/two_gpu_matrix.sh big      # Qwen2.5-7B (ZeRO-1, e4m3 Adam m) and 14B (ZeRO-3), e4m3 and bf16
# Logs, tables and curves go to $OUT. Every row is from scratch, T=1024, through Ray; tokens/s per GPU.
PART=${1:?"usage: two_gpu_matrix.sh scale05|scale15|curves|big"}
source benchmarks/device_lib.sh matrix-$PART.log smi-$PART.csv
left() { echo $(( $1 - ($(date +%s) - T0) )); }   # seconds left of a budget of $1 from the start
table() { PYTHONPATH=/tmp/site:$PWD timeout $(left 580) python3 benchmarks/speed_table.py --backends triton \
  --no-hf-baseline --gpus 1 2 --matmul-dtypes bf16 e4m3 --fp8-head --row-timeout-s 110 --log $OUT/speed_table.log "$@" \
  2>&1 | tail -2 | tee -a "$L"; }
case $PART in
scale05)
  table --models Qwen2.5-0.5B --triton-shape 32 8 8 2 --llmq-bin .anchors/llmq-bin --markdown-out $OUT/table.md
  cat $OUT/table.md >> "$L" ;;
scale15)
  table --models Qwen2.5-1.5B --triton-shape 16 16 6 2 --llmq-bin .anchors/llmq-bin --markdown-out $OUT/table.md
  cat $OUT/table.md >> "$L" ;;
curves)
  C="examples/train.py --model Qwen2.5-0.5B --from-scratch --train-file runs/shake/train-*.bin --eval-file runs/shake/eval.bin
   --seq-len 1024 --steps 50 --backend triton --learning-rate 6e-4 --lr-schedule cosine --warmup 10
   --eval-every-n-steps 0 --no-export --sample-tokens 0 --no-progress --seed 42"
  run g1 150 $C --gpus 1 --batch-size 8 --grad-accumulation 2 --out-dir $OUT/g1 --log-file $OUT/curve_g1.json
  run g1b 150 $C --gpus 1 --batch-size 16 --grad-accumulation 1 --out-dir $OUT/g1b --log-file $OUT/curve_g1b.json
  run g2 150 $C --gpus 2 --batch-size 8 --grad-accumulation 1 --out-dir $OUT/g2 --log-file $OUT/curve_g2.json
  PYTHONPATH=$PWD python3 benchmarks/compare_loss_curves.py $OUT/curve_g1.json $OUT/curve_g2.json \
    --reference $OUT/curve_g1b.json --plot $OUT/curves.png 2>&1 | tee -a "$L"
  A="benchmarks/bench_train.py --model Qwen2.5-0.5B --backend triton --batch-size 32 --grad-accumulation 1 --steps 12
   --warmup-steps 3 --opt-m-dtype bf16 --opt-v-dtype bf16 --gpus 2 --memory-table"
  for z in 1 2 3; do [ $(left 500) -gt 0 ] && run zero$z $(left 585) $A --zero-level $z; done ;;
big)
  S7="benchmarks/bench_train.py --model Qwen2.5-7B --gpus 2 --backend triton --seq-len 1024 --warmup-steps 2 --steps 4
   --lmhead-chunks 4 --model-dtype bf16 --master-dtype bf16 --opt-m-dtype e4m3 --opt-v-dtype bf16 --memory-table
   --batch-size 4 --grad-accumulation 32"
  run 7b_e4m3 115 $S7 --matmul-dtype e4m3 --lmhead-dtype e4m3
  run 7b_bf16 125 $S7
  S14="benchmarks/bench_train.py --model Qwen2.5-14B --gpus 2 --backend triton --seq-len 1024 --warmup-steps 1 --steps 3
   --lmhead-chunks 8 --model-dtype bf16 --master-dtype bf16 --opt-m-dtype e4m3 --opt-v-dtype bf16 --zero-level 3
   --recompute-ffn --batch-size 2 --grad-accumulation 32 --memory-table"
  run 14b_e4m3 150 $S14 --matmul-dtype e4m3
  [ $(left 430) -gt 0 ] && run 14b_bf16 $(left 585) $S14 ;;
*) echo "two_gpu_matrix.sh: unknown part '$PART'; choose scale05, scale15, curves or big" >&2; exit 2 ;;
esac
stop_smi 10
grep -E "^== |tokens/s|largest|within" "$L" | cut -c1-240
