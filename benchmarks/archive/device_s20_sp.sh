#!/usr/bin/env bash
# Issue 28, session 20, on nvidia-h100-x2 (carry .whl): sequence parallelism and the overlapped input-gradient
# reduce-scatters. `bash benchmarks/archive/device_s20_sp.sh 1`: the tensor-parallel GPU tests, then Qwen2.5-7B
# bf16 at 1k -- ZeRO-3, --tensor-parallel 2, and --tensor-parallel 2 --no-overlap-tensor-parallel side by side
# (as it ran: the overlap was on by default then; after these runs it became opt-in, --overlap-tensor-parallel).
# `... 2`: 7B bf16 at 1k and 8k and e4m3 at 1k, ZeRO-3 vs --tensor-parallel 2 at the same global batch
# (device_s19_tp.sh's recipe throughout). `... 3` (nvidia-h200-x2): Qwen2.5-14B bf16 at 1k, the same pair.
source benchmarks/device_lib.sh sp$1.log smi_sp$1.csv
S7="benchmarks/bench_train.py --model Qwen2.5-7B --gpus 2 --backend triton --warmup-steps 3 --steps 8
 --lmhead-chunks 4 --model-dtype bf16 --master-dtype bf16 --opt-m-dtype e4m3 --opt-v-dtype bf16 --recompute-ffn
 --grad-accumulation 4"
if [ "$1" = 3 ]; then  # on nvidia-h200-x2 (14B at T=2 did not fit an H100 before): 14B bf16 1k, same global batch
  S14="benchmarks/bench_train.py --model Qwen2.5-14B --gpus 2 --backend triton --warmup-steps 2 --steps 6
   --lmhead-chunks 8 --model-dtype bf16 --master-dtype bf16 --opt-m-dtype e4m3 --opt-v-dtype bf16 --recompute-ffn
   --grad-accumulation 4 --seq-len 1024 --batch-size 4"
  run 14b_zero3_t1024 230 $S14 --zero-level 3 --json "$OUT/14b_zero3_t1024.json"
  run 14b_tp2ga8_t1024 230 $S14 --tensor-parallel 2 --grad-accumulation 8 --json "$OUT/14b_tp2ga8_t1024.json"
elif [ "$1" = 1 ]; then
  PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -s \
    tests/test_tensor_parallel_gpu.py 2>&1 | tail -15 | tee -a "$L"
  K="--seq-len 1024 --batch-size 4"
  run 7b_tp2_t1024 150 $S7 $K --tensor-parallel 2 --json "$OUT/7b_tp2_t1024.json"
  run 7b_zero3_t1024 150 $S7 $K --zero-level 3 --json "$OUT/7b_zero3_t1024.json"
  run 7b_tp2serial_t1024 150 $S7 $K --tensor-parallel 2 --no-overlap-tensor-parallel --json "$OUT/7b_tp2serial_t1024.json"
else
  # the same global batch as ZeRO-3 on 2 GPUs (32k tokens per update at 1k, 64k at 8k): one data-parallel rank of
  # T=2 takes twice the micro-steps
  K="--seq-len 1024 --batch-size 4"
  run 7b_zero3_t1024 110 $S7 $K --zero-level 3 --json "$OUT/7b_zero3_t1024.json"
  run 7b_tp2ga8_t1024 110 $S7 $K --tensor-parallel 2 --grad-accumulation 8 --json "$OUT/7b_tp2ga8_t1024.json"
  K="--seq-len 8192 --batch-size 1"
  run 7b_tp2ga8_t8192 110 $S7 $K --tensor-parallel 2 --grad-accumulation 8 --json "$OUT/7b_tp2ga8_t8192.json"
  run 7b_zero3_t8192 110 $S7 $K --zero-level 3 --json "$OUT/7b_zero3_t8192.json"
  K="--seq-len 1024 --batch-size 4 --matmul-dtype e4m3"
  run 7b_tp2ga8_e4m3_t1024 110 $S7 $K --tensor-parallel 2 --grad-accumulation 8 --json "$OUT/7b_tp2ga8_e4m3_t1024.json"
  run 7b_zero3_e4m3_t1024 110 $S7 $K --zero-level 3 --json "$OUT/7b_zero3_e4m3_t1024.json"
fi
stop_smi 10
grep -E "^== |tokens/s|Error|error:|passed|failed" "$L" | cut -c1-260
