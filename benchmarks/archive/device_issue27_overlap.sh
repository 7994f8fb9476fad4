#!/usr/bin/env bash
# (Ran at 0c45ac7, when both overlaps were on by default and --no-overlap-grad-reduce existed; since then they are
# one opt-in flag, --overlap-comm.)
# Issue 27, session 14 (nvidia-h100-x2 / nvidia-h200-x2; carry .whl and .anchors, an ignored folder holding
# llmq-bin/): ZeRO-1 with the gradient reduce in the last backward and the per-unit weight gather beside the next
# forward. First the GPU tests (two-GPU bit-identity of the overlaps, eager and in CUDA graphs; one-GPU graphs
# replay); then, only if they pass, the scaling table of MODEL: ours on 1 and 2 GPUs (ZeRO-1, CUDA graphs), bf16
# and e4m3 (+ FP8 head), llm.q's binary on 1 and 2 GPUs beside them; then our 2-GPU rows with both overlaps off.
#   bash benchmarks/archive/device_issue27_overlap.sh Qwen2.5-0.5B [TESTS]
MODEL=${1:-Qwen2.5-0.5B}
source benchmarks/device_lib.sh overlap27.log smi27o.csv
nvidia-smi topo -m | head -4 | tee -a "$L"
if [ "${2:-}" = TESTS ]; then
  PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE -s \
    -o faulthandler_timeout=190 -m "gpu or not gpu" tests/test_two_gpus.py >> "$L" 2>&1
  rc=$?; echo "gpu tests rc=$rc" | tee -a "$L"; grep -E "passed|failed|max \|dw\|" "$L" | tail -6
  [ $rc = 0 ] || exit 1
fi
echo "== speed table $MODEL $(( $(date +%s) - T0 ))s" | tee -a "$L"
PYTHONPATH=/tmp/site:$PWD timeout $(( 560 - ($(date +%s) - T0) )) python3 benchmarks/speed_table.py --models $MODEL \
  --backends triton --matmul-dtypes bf16 e4m3 --fp8-head --gpus 1 2 --llmq-bin .anchors/llmq-bin --no-hf-baseline \
  --row-timeout-s 100 --log $OUT/speed_table.log --json-out $OUT/table-$MODEL.json \
  --markdown-out $OUT/table-$MODEL.md 2>&1 | tail -3 | tee -a "$L"
stop_smi 10
cat $OUT/table-$MODEL.md | tee -a "$L"
# A/B in the same lease: 2 GPUs with both overlaps off (the communication of session 13: one reduce-scatter at the
# update, one all-gather after it), bf16 at the table's shape, CUDA graphs.
if [ $(( $(date +%s) - T0 )) -lt 480 ]; then
  B=$(python3 -c "import sys; sys.path.insert(0,'benchmarks'); from speed_table import ROW_SHAPES as R; print(*R['$MODEL']['triton'])")
  set -- $B
  run ab-off $(( 585 - ($(date +%s) - T0) )) benchmarks/bench_train.py --model $MODEL --backend triton --batch-size $1 \
    --grad-accumulation $2 --steps $3 --warmup-steps $4 --opt-m-dtype bf16 --opt-v-dtype bf16 --gpus 2 \
    --use-cuda-graphs --no-overlap-update --no-overlap-grad-reduce
  grep -E "tokens/s|peak" "$L" | tail -3
fi
