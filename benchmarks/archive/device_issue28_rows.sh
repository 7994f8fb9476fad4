#!/usr/bin/env bash
# Issue 28, written in session 21 for the next 2-GPU lease (nvidia-h200-x2 with needs_h200: 14B at T=2 peaks
# above an H100's 80 GB; carry .whl): the rows still missing from the crossover table of
# benchmarks/results/h200x2-2026-11-27.md -- Qwen2.5-7B e4m3 and 14B bf16 / e4m3 at 4k and 8k, ZeRO-3 vs
# --tensor-parallel 2 at the same global batch (T=2 runs twice the micro-steps), the recipe of device_s21.sh.
#   bash benchmarks/archive/device_issue28_rows.sh a   # 7B e4m3 4k and 8k, then 7B bf16 8k again if it fits
#       (the one dip, 0.955, was a single pair)
#   bash benchmarks/archive/device_issue28_rows.sh b   # 14B bf16 4k and 8k
#   bash benchmarks/archive/device_issue28_rows.sh c   # 14B e4m3 4k and 8k
#   TESTS=1 bash benchmarks/archive/device_issue28_rows.sh a   # first the GPU tests of the tensor-parallel
#       engine (tests/test_tensor_parallel_gpu.py: the packed all-reduce of commit 8c25c29 never ran on GPUs) and
#       the FP8 monitor's saturated-share test (tests/test_fp8_gpu.py -k saturated), then the pairs that still fit
#   bash benchmarks/archive/device_issue28_rows.sh d   # 7B bf16 1k and e4m3 1k again: the rows of sessions 20-21
#       ran with 2L+1 separate all-reduces of the norm weights' gradients, packed into one since (commit 8c25c29)
# Each run's limit is a little above what session 21 saw (7B: ZeRO-3 66 s, T=2 90 s; 14B: 94 s and 149 s, set-up
# included); a pair starts only when both of its runs fit the call: a cut pair is worth nothing.
source benchmarks/device_lib.sh rows_$1.log smi_rows_$1.csv
PYTHONPATH=/tmp/site python3 -m ray.scripts.scripts stop --force >> "$L" 2>&1  # a cluster left by a cut call
left() { echo $(( 585 - ($(date +%s) - T0) )); }
COMMON="--gpus 2 --backend triton --model-dtype bf16 --master-dtype bf16 --opt-m-dtype e4m3 --opt-v-dtype bf16
 --recompute-ffn"
M7="--model Qwen2.5-7B --warmup-steps 3 --steps 8 --lmhead-chunks 4"; P7="100 120"
M14="--model Qwen2.5-14B --warmup-steps 2 --steps 8 --lmhead-chunks 8"; P14="110 170"  # 6 timed steps
pair() {  # pair NAME "ZERO3_S TP2_S" ARGS...: ZeRO-3 (GA 4) then T=2 (GA 8) with ARGS, each cut after its seconds
  local name=$1; z=${2% *}; t=${2#* }; shift 2
  if [ $(left) -lt $(( z + t )) ]; then echo "== $name skipped for time" | tee -a "$L"; return; fi
  run ${name}_zero3 $z benchmarks/bench_train.py $COMMON "$@" --zero-level 3 --grad-accumulation 4 \
    --json "$OUT/${name}_zero3.json"
  run ${name}_tp2ga8 $t benchmarks/bench_train.py $COMMON "$@" --tensor-parallel 2 --grad-accumulation 8 \
    --json "$OUT/${name}_tp2ga8.json"
}
if [ -n "$TESTS" ]; then
  PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -s \
    tests/test_tensor_parallel_gpu.py 2>&1 | tail -15 | tee -a "$L"
  PYTHONPATH=/tmp/site:$PWD timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" \
    tests/test_fp8_gpu.py -k saturated 2>&1 | tail -8 | tee -a "$L"
fi
K4="--seq-len 4096 --batch-size 1"; K8="--seq-len 8192 --batch-size 1"
case "$1" in
  a) pair 7b_e4m3_t4096 "$P7" $M7 $K4 --matmul-dtype e4m3
     pair 7b_e4m3_t8192 "$P7" $M7 $K8 --matmul-dtype e4m3
     pair 7b_bf16_t8192 "$P7" $M7 $K8 ;;
  b) pair 14b_bf16_t4096 "$P14" $M14 $K4
     pair 14b_bf16_t8192 "$P14" $M14 $K8 ;;
  c) pair 14b_e4m3_t4096 "$P14" $M14 $K4 --matmul-dtype e4m3
     pair 14b_e4m3_t8192 "140 180" $M14 $K8 --matmul-dtype e4m3 --steps 5 ;;  # 8k: 3 timed steps
  d) pair 7b_bf16_t1024 "$P7" $M7 --seq-len 1024 --batch-size 4
     pair 7b_e4m3_t1024 "$P7" $M7 --seq-len 1024 --batch-size 4 --matmul-dtype e4m3 ;;
  d1) pair 7b_bf16_t1024 "$P7" $M7 --seq-len 1024 --batch-size 4 ;;  # d's first pair alone
  *) echo "usage: $0 a | b | c | d"; exit 2 ;;
esac
stop_smi 10
grep -hE "^== |tokens/s|Error|error:|out of memory|passed|failed" "$L" | cut -c1-260
