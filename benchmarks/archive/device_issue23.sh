#!/usr/bin/env bash
# Issue 23 acceptance on one GPU: the commit before the restructuring (2f3a145, exported untracked into
# runs/anchor with `git archive 2f3a145 | tar -x -C runs/anchor`) against this tree, in one lease.
# Carry: .whl (the Ray wheels, benchmarks/README.md), runs/anchor, runs/shake
# (`python -m llmq_ray.data_pipeline.tokenize --input tiny-shakespeare --out runs/shake`).
#   bash benchmarks/archive/device_issue23.sh tests   # the GPU suite on this tree, then the 300-step loss check
#   bash benchmarks/archive/device_issue23.sh speed [0.5B|1.5B]  # bf16 and e4m3, old and new alternating
#   bash benchmarks/archive/device_issue23.sh speed repeat       # 0.5B bf16, three more pairs
#   (GPU=1 before "speed": the GPU suite first)
# Loss check: Qwen2.5-0.5B from scratch on tiny-shakespeare, triton, --deterministic-attention, B=4, T=1024,
# 300 steps; the per-step losses of the two trees must be the same floats.
# Speed rows: benchmarks/speed_table.py's triton rows (CUDA graphs, bf16 Adam states, ZeRO-1, through Ray).
source benchmarks/device_lib.sh issue23-$1$2.log smi23-$1$2.csv
if [ "$1" = tests ]; then
  run gpu_tests 360 -m pytest -m gpu -p no:cacheprovider -q -rfE tests/
  A="--model Qwen2.5-0.5B --backend triton --train-file runs/shake/train-*.bin --eval-file runs/shake/eval.bin
     --batch-size 4 --seq-len 1024 --steps 300 --eval-every-n-steps 0 --no-export --no-progress --sample-tokens 0
     --deterministic-attention"
  run_in runs/anchor loss_old 200 runs/anchor/examples/train.py $A --out-dir /tmp/loss_old
  run loss_new 200 examples/train.py $A --out-dir /tmp/loss_new
  python3 - <<'PY' | tee -a "$L"
import json
def steps(path):
    text = open(path).read()
    try:
        recs = json.loads(text)
    except json.JSONDecodeError:
        recs = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [(r["step"], r["loss"]) for r in recs if r.get("log") == "step"]
import glob
old = steps(glob.glob("/tmp/loss_old/log.json*")[0]); new = steps(glob.glob("/tmp/loss_new/log.json*")[0])
same = sum(a == b for a, b in zip(old, new))
diff = [(a[0], a[1], b[1]) for a, b in zip(old, new) if a != b]
print(f"LOSS steps old {len(old)} new {len(new)} identical {same}; first diffs {diff[:3]}; "
      f"last old {old[-1]} new {new[-1]}")
PY
fi
if [ "$1" = speed ]; then
  [ -n "$GPU" ] && run gpu_tests 400 -m pytest -m gpu -p no:cacheprovider -q -rfE tests/
  mkdir -p $OUT/speed
  row() { tree=$1; model=$2; dtype=$3; b=$4; g=$5; steps=$6; warm=$7; extra=""
    [ "$dtype" = e4m3 ] && extra="--matmul-dtype e4m3"
    script=benchmarks/bench_train.py; [ "$tree" = runs/anchor ] && script=runs/anchor/benchmarks/bench_train.py
    tag=new-$model-$dtype; [ "$tree" = runs/anchor ] && tag=old-$model-$dtype
    run_in $tree $tag 240 $script --device cuda --backend triton --model $model --batch-size $b \
      --grad-accumulation $g --seq-len 1024 --steps $steps --warmup-steps $warm --opt-m-dtype bf16 \
      --opt-v-dtype bf16 --gpus 1 $extra --use-cuda-graphs --json $OUT/speed/$tag.json; }
  if [ "$2" = repeat ]; then  # 0.5B bf16 three more times each, alternating which tree goes first
    for i in 1 2 3; do
      if [ $((i % 2)) = 1 ]; then row . Qwen2.5-0.5B bf16 32 1 25 5; row runs/anchor Qwen2.5-0.5B bf16 32 1 25 5
      else row runs/anchor Qwen2.5-0.5B bf16 32 1 25 5; row . Qwen2.5-0.5B bf16 32 1 25 5; fi
      mv $OUT/speed/new-Qwen2.5-0.5B-bf16.json $OUT/speed/new-Qwen2.5-0.5B-bf16-r$i.json
      mv $OUT/speed/old-Qwen2.5-0.5B-bf16.json $OUT/speed/old-Qwen2.5-0.5B-bf16-r$i.json
    done
  fi
  [ "$2" = 1.5B ] || [ "$2" = repeat ] || for dtype in bf16 e4m3; do
    row runs/anchor Qwen2.5-0.5B $dtype 32 1 25 5; row . Qwen2.5-0.5B $dtype 32 1 25 5
  done
  [ "$2" = 0.5B ] || [ "$2" = repeat ] || for dtype in bf16 e4m3; do
    row . Qwen2.5-1.5B $dtype 16 16 6 2; row runs/anchor Qwen2.5-1.5B $dtype 16 16 6 2
  done
  python3 - <<'PY' | tee -a "$L"
import json, glob, os
rec = {}
for f in glob.glob(os.environ["OUT"] + "/speed/*.json"):
    tree, rest = os.path.basename(f)[:-5].split("-", 1)
    r = json.load(open(f))
    rec[(rest, tree)] = r
print("| model, dtype | 2f3a145 tokens/s | new main tokens/s | new / old | peak GiB old / new |")
for key in sorted({k[0] for k in rec}):
    o, n = rec.get((key, "old")), rec.get((key, "new"))
    def tps(r): return r["tokens_per_s_per_gpu"] if r else float("nan")
    def mem(r): return r.get("peak_memory_gib", float("nan")) if r else float("nan")
    print(f"| {key} | {tps(o):,.0f} | {tps(n):,.0f} | {tps(n) / tps(o):.4f} | {mem(o):.2f} / {mem(n):.2f} |")
PY
fi
stop_smi 10
grep -E "passed|failed|^FAILED|^ERROR" "$L" | cut -c1-200 | tail -20
grep -E "^== |^LOSS|^\|" "$L"
