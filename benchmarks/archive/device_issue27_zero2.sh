#!/usr/bin/env bash
# Issue 27, session 13 (nvidia-h100-x2, carry .whl): the new ZeRO-2 (only the gradient shard kept) against
# ZeRO-1 on 2 GPUs, Qwen2.5-1.5B bf16, B=16 x 4 micro-steps, no CUDA graphs (ZeRO-2 refuses them): tokens/s per
# GPU, peak memory per GPU and rank 0's memory table.
source benchmarks/device_lib.sh z2.log smi27.csv
for z in 1 2; do
  run z$z 150 benchmarks/bench_train.py --model Qwen2.5-1.5B --backend triton --batch-size 16 --grad-accumulation 4 \
    --seq-len 1024 --steps 6 --warmup-steps 2 --opt-m-dtype bf16 --opt-v-dtype bf16 --gpus 2 --zero-level $z \
    --memory-table --json $OUT/z$z.json
  python3 -c "import json; r=json.load(open('$OUT/z$z.json')); print('Z$z', r.get('tokens_per_s_per_gpu'), r.get('step_ms'), r.get('peak_memory_gib'))" 2>&1 | tee -a "$L"
done
stop_smi 10
grep -E "^Z|gradients|sum of tensors|peak memory|Error|error" "$L" | head -30
