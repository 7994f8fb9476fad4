#!/usr/bin/env bash
# Written in session 22 for the next session's 2-GPU lease (nvidia-h200-x2 with needs_h200: 14B at T=2 peaks
# above an H100's 80 GB; carry .whl, and runs/shake for mode 2).
#   bash benchmarks/archive/device_s23.sh 1   # the GPU test of --fp8-smooth-swiglu (tests/test_fp8_gpu.py -k
#       smooth: torch, triton, cupy), then issue 28's last row: Qwen2.5-14B e4m3 at 8k, ZeRO-3 vs T=2
#       (device_issue28_rows.sh c's pair: 3 timed steps, limits sized for 8k)
#   bash benchmarks/archive/device_s23.sh 3   # issue 28's two partial rows of session 22 again, whole: 14B bf16
#       8k (ZeRO-3 and T=2, 3 timed steps) and 14B e4m3 4k at T=2 (6 timed steps; its ZeRO-3 run is whole)
#   bash benchmarks/archive/device_s23.sh 2   # issue 25: the 4-seed loss check of --fp8-smooth-swiglu beside
#       bf16 (300 steps of Qwen2.5-0.5B on tiny-shakespeare, device_s21.sh 1's two lanes on one `ray start`
#       cluster, --cpus-per-worker 4), then 0.5B e4m3 timed with and without the flag (bench_train, one GPU)
source benchmarks/device_lib.sh s23_$1.log smi_s23_$1.csv
PYTHONPATH=/tmp/site python3 -m ray.scripts.scripts stop --force >> "$L" 2>&1  # a cluster left by a cut call
left() { echo $(( $1 - ($(date +%s) - T0) )); }
row14() {  # row14 NAME LIMIT ARGS...: one Qwen2.5-14B run (bench_train) cut after LIMIT seconds, if it fits
  n=$1; tmo=$2; shift 2
  [ $(left 585) -gt $tmo ] && run $n $tmo benchmarks/bench_train.py --model Qwen2.5-14B --gpus 2 --backend triton \
    --warmup-steps 2 --lmhead-chunks 8 --model-dtype bf16 --master-dtype bf16 --opt-m-dtype e4m3 --opt-v-dtype bf16 \
    --recompute-ffn --batch-size 1 "$@" --json "$OUT/$n.json" || echo "== $n skipped for time" | tee -a "$L"
}
if [ "$1" = 3 ]; then
  row14 14b_bf16_t8192_zero3 150 --seq-len 8192 --steps 5 --zero-level 3 --grad-accumulation 4
  row14 14b_bf16_t8192_tp2ga8 210 --seq-len 8192 --steps 5 --tensor-parallel 2 --grad-accumulation 8
  row14 14b_e4m3_t4096_tp2ga8 200 --seq-len 4096 --steps 8 --matmul-dtype e4m3 --tensor-parallel 2 --grad-accumulation 8
elif [ "$1" = 1 ]; then
  PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" \
    tests/test_fp8_gpu.py -k smooth 2>&1 | tail -8 | tee -a "$L"
  S14="benchmarks/bench_train.py --model Qwen2.5-14B --gpus 2 --backend triton --warmup-steps 2 --steps 5
   --lmhead-chunks 8 --model-dtype bf16 --master-dtype bf16 --opt-m-dtype e4m3 --opt-v-dtype bf16 --recompute-ffn
   --seq-len 8192 --batch-size 1 --matmul-dtype e4m3"
  for r in "zero3 140 --zero-level 3 --grad-accumulation 4" "tp2ga8 200 --tensor-parallel 2 --grad-accumulation 8"; do
    set -- $r; n=14b_e4m3_t8192_$1; tmo=$2; shift 2
    [ $(left 585) -gt $tmo ] && run $n $tmo $S14 "$@" --json "$OUT/$n.json" || echo "== $n skipped for time" | tee -a "$L"
  done
else
  PYTHONPATH=/tmp/site python3 -m ray.scripts.scripts start --head --num-gpus 2 --num-cpus 16 \
    --include-dashboard=false --disable-usage-stats >> "$L" 2>&1
  C="examples/train.py --model Qwen2.5-0.5B --from-scratch --train-file runs/shake/train-*.bin --eval-file runs/shake/eval.bin --batch-size 4 --seq-len 1024 --steps 300 --gpus 1 --backend triton --learning-rate 6e-4 --lr-schedule cosine --warmup 30 --eval-every-n-steps 50 --no-export --sample-tokens 0 --no-progress --cpus-per-worker 4"
  lane() {  # lane KIND FLAGS...: seeds 42-45 one after another, each run on one of the cluster's GPUs
    kind=$1; shift; L="$OUT/lane_$kind.log"
    for seed in 42 43 44 45; do
      if [ $(left 430) -lt 60 ]; then echo "== ${kind}_$seed skipped for time" | tee -a "$L"; continue; fi
      RAY_ADDRESS=auto run ${kind}_$seed $(left 430) $C --seed $seed "$@" --out-dir $OUT/${kind}_$seed \
        --log-file $OUT/conv_${kind}_$seed.json
    done
  }
  lane bf16 & A=$!; lane smooth --matmul-dtype e4m3 --fp8-smooth-swiglu & B=$!; wait $A $B  # not a bare wait
  PYTHONPATH=/tmp/site python3 -m ray.scripts.scripts stop >> "$L" 2>&1
  python3 benchmarks/conv_summary.py $OUT bf16 smooth | tee -a "$L"
  B05="benchmarks/bench_train.py --model Qwen2.5-0.5B --gpus 1 --backend triton --batch-size 32 --seq-len 1024
   --warmup-steps 5 --steps 25 --model-dtype bf16 --matmul-dtype e4m3"  # speed_table.py's 0.5B triton shape
  for r in "plain" "smooth --fp8-smooth-swiglu"; do
    set -- $r; n=05b_e4m3_$1; shift
    [ $(left 585) -gt 70 ] && run $n 70 $B05 "$@" --json "$OUT/$n.json" || echo "== $n skipped for time" | tee -a "$L"
  done
fi
stop_smi 10
grep -hE "^== |tokens/s|Error|error:|passed|failed|CONV|MEAN|out of memory" "$L" "$OUT"/lane_*.log 2>/dev/null | cut -c1-260
