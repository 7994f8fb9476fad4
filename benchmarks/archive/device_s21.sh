#!/usr/bin/env bash
# Session 21 on nvidia-h200-x2 (needs_h200: 14B at T=2 needs more than an H100's 80 GB); carry .whl (and runs/shake
# for call 1).
#   bash benchmarks/archive/device_s21.sh 1   # issue 25: the 4-seed loss check of --fp8-delayed-swiglu-scale
#       beside bf16 in one lease (device_issue25_conv.sh's setup: 300 steps of Qwen2.5-0.5B on tiny-shakespeare,
#       B=4, T=1024, lr 6e-4 cosine), the two kinds as two lanes on the two GPUs of one Ray cluster (`ray start`,
#       each run asks one GPU); then issue 28's 7B bf16 pair at 4k (ZeRO-3 vs T=2 at the same global batch) if
#       both runs fit the call
#   bash benchmarks/archive/device_s21.sh 3   # the 7B 4k pair alone
# As they ran, but for `wait $A $B` (call 5 ran a bare `wait`, which waited for the nvidia-smi logger too, until
# the call's limit) -- and call 1 ran without --cpus-per-worker 4 and hung (see benchmarks/LOG.md).
#   bash benchmarks/archive/device_s21.sh 2   # issue 28: the tensor-parallel GPU tests (the overlap and FP8-head
#       variants were never run on GPUs), then Qwen2.5-14B e4m3 at 1k, ZeRO-3 vs T=2 (device_s20_sp.sh 3's recipe)
source benchmarks/device_lib.sh s21_$1.log smi_s21_$1.csv
# a cluster left running by a cut call would capture every later ray.init()
PYTHONPATH=/tmp/site python3 -m ray.scripts.scripts stop --force >> "$L" 2>&1
left() { echo $(( $1 - ($(date +%s) - T0) )); }
S7="benchmarks/bench_train.py --model Qwen2.5-7B --gpus 2 --backend triton --warmup-steps 3 --steps 8
 --lmhead-chunks 4 --model-dtype bf16 --master-dtype bf16 --opt-m-dtype e4m3 --opt-v-dtype bf16 --recompute-ffn
 --grad-accumulation 4"
pair4k() {  # issue 28: Qwen2.5-7B bf16 at 4k, ZeRO-3 vs T=2 at the same global batch (32k tokens per update)
  for r in "zero3 --zero-level 3" "tp2ga8 --tensor-parallel 2 --grad-accumulation 8"; do
    set -- $r; n=7b_$1_t4096; shift
    [ $(left 585) -gt 70 ] && run $n $(left 585) $S7 --seq-len 4096 --batch-size 1 "$@" --json "$OUT/$n.json" \
      || echo "== $n skipped for time" | tee -a "$L"
  done
}
if [ "$1" = 1 ]; then
  PYTHONPATH=/tmp/site python3 -m ray.scripts.scripts start --head --num-gpus 2 --num-cpus 16 \
    --include-dashboard=false --disable-usage-stats >> "$L" 2>&1
  C="examples/train.py --model Qwen2.5-0.5B --from-scratch --train-file runs/shake/train-*.bin --eval-file runs/shake/eval.bin --batch-size 4 --seq-len 1024 --steps 300 --gpus 1 --backend triton --learning-rate 6e-4 --lr-schedule cosine --warmup 30 --eval-every-n-steps 50 --no-export --sample-tokens 0 --no-progress --cpus-per-worker 4"
  lane() {  # lane KIND FLAGS...: seeds 42-45 one after another, each run on one of the cluster's GPUs
    kind=$1; shift; L="$OUT/lane_$kind.log"
    for seed in 42 43 44 45; do
      if [ $(left 470) -lt 60 ]; then echo "== ${kind}_$seed skipped for time" | tee -a "$L"; continue; fi
      RAY_ADDRESS=auto run ${kind}_$seed $(left 470) $C --seed $seed "$@" --out-dir $OUT/${kind}_$seed \
        --log-file $OUT/conv_${kind}_$seed.json
    done
  }
  # wait for the two lanes only (a bare `wait` also waits for the nvidia-smi logger: call 5 hung there)
  lane bf16 & A=$!; lane dly --matmul-dtype e4m3 --lmhead-dtype e4m3 --fp8-delayed-swiglu-scale & B=$!; wait $A $B
  PYTHONPATH=/tmp/site python3 -m ray.scripts.scripts stop >> "$L" 2>&1
  python3 benchmarks/conv_summary.py $OUT bf16 dly | tee -a "$L"
  [ $(left 585) -gt 210 ] && pair4k || echo "== the 7B 4k pair skipped for time (mode 3 runs it)" | tee -a "$L"
elif [ "$1" = 3 ]; then
  pair4k
else
  [ -z "$NO_TESTS" ] && PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -s \
    tests/test_tensor_parallel_gpu.py 2>&1 | tail -15 | tee -a "$L"
  S14="benchmarks/bench_train.py --model Qwen2.5-14B --gpus 2 --backend triton --warmup-steps 2 --steps 6
   --lmhead-chunks 8 --model-dtype bf16 --master-dtype bf16 --opt-m-dtype e4m3 --opt-v-dtype bf16 --recompute-ffn
   --grad-accumulation 4 --seq-len 1024 --batch-size 4 --matmul-dtype e4m3"
  for r in "zero3 --zero-level 3" "tp2ga8 --tensor-parallel 2 --grad-accumulation 8"; do
    set -- $r; n=14b_$1_e4m3_t1024; shift
    [ $(left 585) -gt 90 ] && run $n $(left 585) $S14 "$@" --json "$OUT/$n.json" || echo "== $n skipped for time" | tee -a "$L"
  done
fi
stop_smi 10
grep -hE "^== |tokens/s|Error|error:|passed|failed|CONV|MEAN" "$L" "$OUT"/lane_*.log 2>/dev/null | cut -c1-260
