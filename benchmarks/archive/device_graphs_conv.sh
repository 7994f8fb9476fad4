#!/usr/bin/env bash
# One device call (1 GPU; carry .whl and runs/shake): CUDA graphs (identical to eager? faster?) and issue 6's
# FP8 convergence check at B=4: bf16 with two seeds (the noise floor) against e4m3 with the same two seeds,
# 300 steps of Qwen2.5-0.5B from scratch on tiny-shakespeare, eval every 50 steps.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/test_cuda_graphs.py > "$OUT/pytest_graphs.log" 2>&1; grep -E "eager-vs|passed|failed|Error" "$OUT/pytest_graphs.log" | cut -c1-250
run() { name=$1; shift; timeout 150 python3 "$@" > "$OUT/$name.log" 2>&1; grep RESULT "$OUT/$name.log" || tail -3 "$OUT/$name.log"; }
E="benchmarks/engine_step.py --model Qwen2.5-0.5B --backend triton"
run bf16_b16 $E --batch-size 16
run bf16_b16_graphs $E --batch-size 16 --cuda-graphs
run e4m3_b16 $E --batch-size 16 --matmul-dtype e4m3
run e4m3_b16_graphs $E --batch-size 16 --matmul-dtype e4m3 --cuda-graphs
run e4m3_b32_graphs $E --batch-size 32 --steps 5 --matmul-dtype e4m3 --cuda-graphs
COMMON="--model Qwen2.5-0.5B --from-scratch --train-file runs/shake/train-*.bin --eval-file runs/shake/eval.bin --batch-size 4 --seq-len 1024 --steps 300 --gpus 1 --backend triton --model-dtype bf16 --eval-every-n-steps 50 --no-export --sample-tokens 0 --no-progress"
for cfg in "bf16 42" "bf16 43" "e4m3 42" "e4m3 43"; do
  set -- $cfg; extra=""; [ "$1" = e4m3 ] && extra="--matmul-dtype e4m3"
  timeout 110 python3 examples/train.py $COMMON $extra --seed $2 --out-dir "$OUT/conv_$1_$2" --log-file "$OUT/conv_$1_$2.json" > "$OUT/conv_$1_$2.log" 2>&1 || tail -3 "$OUT/conv_$1_$2.log"
done
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
rows = {}
for name in ("bf16_42", "bf16_43", "e4m3_42", "e4m3_43"):
    try:
        log = json.load(open(f"{out}/conv_{name}.json"))
    except Exception as exc:
        print(name, "failed:", exc); continue
    steps = [r["loss"] for r in log if r.get("log") == "step"]
    evals = [(r.get("step"), round(r["loss"], 4)) for r in log if r.get("log") == "eval"]
    rows[name] = (sum(steps[-20:]) / 20, evals[-1][1] if evals else float("nan"))
    print(f"{name}: steps {len(steps)} last-20 train {rows[name][0]:.4f} evals {evals}")
for seed in ("42", "43"):
    if f"bf16_{seed}" in rows and f"e4m3_{seed}" in rows:
        (a, ea), (b, eb) = rows[f"bf16_{seed}"], rows[f"e4m3_{seed}"]
        print(f"seed {seed}: e4m3 vs bf16 train {(b - a) / a:+.2%} eval {(eb - ea) / ea:+.2%}")
if "bf16_42" in rows and "bf16_43" in rows:
    (a, ea), (b, eb) = rows["bf16_42"], rows["bf16_43"]
    print(f"noise floor bf16 seed 43 vs 42: train {(b - a) / a:+.2%} eval {(eb - ea) / ea:+.2%}")
PY
