#!/usr/bin/env bash
# Issue 28, call A on nvidia-h100-x2 (carry .whl): tensor parallelism on two GPUs.
#   bash benchmarks/archive/device_s19_tp.sh [SEQS]      (SEQS: "1024 4096" by default)
# 1) the GPU tests of tensor parallelism (T=1 bit for bit on one GPU; T=2 on two vs one, Triton, bf16);
# 2) Qwen2.5-7B from scratch through Ray, random tokens, bf16, 8-bit optimizer state (bf16 weights as the record,
#    e4m3 m, bf16 v), --recompute-ffn, --lmhead-chunks 4: ZeRO-3 over 2 GPUs against --tensor-parallel 2 with the same
#    micro-batch (B x T tokens) and grad-accumulation 4: tokens/s per GPU and peak memory at each sequence length.
source benchmarks/device_lib.sh tp.log smi_tp.csv
PYTHONPATH=/tmp/site:$PWD timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -s \
  tests/test_tensor_parallel_gpu.py 2>&1 | tail -15 | tee -a "$L"
S7="benchmarks/bench_train.py --model Qwen2.5-7B --gpus 2 --backend triton --warmup-steps 3 --steps 8
 --lmhead-chunks 4 --model-dtype bf16 --master-dtype bf16 --opt-m-dtype e4m3 --opt-v-dtype bf16 --recompute-ffn
 --grad-accumulation 4"
for T in ${1:-1024 4096}; do
  B=$(( T >= 4096 ? 1 : 4096 / T ))
  run 7b_zero3_t$T 150 $S7 --seq-len $T --batch-size $B --zero-level 3 --json "$OUT/7b_zero3_t$T.json"
  run 7b_tp2_t$T 150 $S7 --seq-len $T --batch-size $B --tensor-parallel 2 --json "$OUT/7b_tp2_t$T.json"
done
stop_smi 10
grep -E "^== |tokens/s|Error|error:|passed|failed" "$L" | cut -c1-260
