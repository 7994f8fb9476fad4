#!/usr/bin/env bash
# Session 8, call 7 (nvidia-h100-x1; carry .whl and runs/shake), main at c648dd6: issue 6's convergence point
# on today's main (last measured 2026-11-22, before the FP8 SwiGLU backward, the atomic absmax and cuBLASLt's
# beta = 1 FP8 accumulation). 300 steps of Qwen2.5-0.5B from scratch on tiny-shakespeare, bf16 vs e4m3, two
# seeds, the setup of h100-2026-11-22.md: B=4, T=1024, lr 6e-4 cosine, warmup 30, eval every 50 steps.
# runs/shake: python -m llmq_ray.data_pipeline.tokenize --input tiny-shakespeare --out runs/shake
#   bash benchmarks/archive/device_session8f.sh 42 43     (call 7)
#   bash benchmarks/archive/device_session8f.sh 44 45     (call 8: two more seeds, after call 7's bf16 seed-to-seed spread of 4.8%)
SEEDS="${*:-42 43}"
source benchmarks/device_lib.sh "session8f_${SEEDS// /_}.log" "smi8f_${SEEDS// /_}.csv"
C="examples/train.py --model Qwen2.5-0.5B --from-scratch --train-file runs/shake/train-*.bin --eval-file runs/shake/eval.bin --batch-size 4 --seq-len 1024 --steps 300 --gpus 1 --backend triton --learning-rate 6e-4 --lr-schedule cosine --warmup 30 --eval-every-n-steps 50 --no-export --sample-tokens 0 --no-progress"
for seed in $SEEDS; do
  run bf16_$seed 140 $C --seed $seed --out-dir $OUT/bf16_$seed --log-file $OUT/conv_bf16_$seed.json
  run e4m3_$seed 140 $C --seed $seed --matmul-dtype e4m3 --out-dir $OUT/e4m3_$seed --log-file $OUT/conv_e4m3_$seed.json
done
stop_smi 10
grep -E "^== " "$L"
python3 - "$OUT" $SEEDS <<'PY'
import json, sys
out, seeds = sys.argv[1], [int(x) for x in sys.argv[2:]]
def summary(name):
    log = json.load(open(f"{out}/{name}.json"))
    steps = [r["loss"] for r in log if r.get("log") == "step"]
    evals = [r["loss"] for r in log if r.get("log") == "eval"]
    return len(steps), sum(steps[-20:]) / 20, evals
res = {}
for dtype in ("bf16", "e4m3"):
    for seed in seeds:
        try:
            res[dtype, seed] = n, tail, evals = summary(f"conv_{dtype}_{seed}")
            print(f"CONV {dtype} seed {seed}: {n} steps, mean train loss of the last 20 {tail:.4f}, eval "
                  + " / ".join(f"{e:.4f}" for e in evals))
        except Exception as exc:
            print(f"CONV {dtype} seed {seed}: failed: {exc}")
for seed in seeds:
    if ("bf16", seed) in res and ("e4m3", seed) in res:
        (_, a, ea), (_, b, eb) = res["bf16", seed], res["e4m3", seed]
        print(f"CONV seed {seed}: e4m3 vs bf16 train {100 * (b - a) / a:+.2f}%, final eval {100 * (eb[-1] - ea[-1]) / ea[-1]:+.2f}%")
if len(seeds) == 2 and all(("bf16", s) in res for s in seeds):
    (_, a, ea), (_, b, eb) = res["bf16", seeds[0]], res["bf16", seeds[1]]
    print(f"CONV bf16 seed {seeds[1]} vs {seeds[0]} (noise floor): train {100 * (b - a) / a:+.2f}%, final eval {100 * (eb[-1] - ea[-1]) / ea[-1]:+.2f}%")
PY
