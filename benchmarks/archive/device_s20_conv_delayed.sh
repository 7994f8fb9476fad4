#!/usr/bin/env bash
# Issue 25, session 20 (nvidia-h100-x1; carry .whl and runs/shake): the loss check of --fp8-delayed-swiglu-scale,
# device_issue25_conv.sh's setup (300 steps of Qwen2.5-0.5B on tiny-shakespeare, B=4, T=1024, lr 6e-4 cosine),
# e4m3 blocks + FP8 head with the delayed SwiGLU scale, seeds 42-45 -- the delayed runs only (what device time was
# left): the bf16 and current-scaling runs of the same seeds are session 13's (h100-2026-11-26.md, lease C call 4).
#   bash benchmarks/archive/device_s20_conv_delayed.sh 42 43 44 45
SEEDS="${*:-42 43 44 45}"
KIND=dly; EXTRA="--matmul-dtype e4m3 --lmhead-dtype e4m3 --fp8-delayed-swiglu-scale"
source benchmarks/device_lib.sh conv20d.log smi20c.csv
C="examples/train.py --model Qwen2.5-0.5B --from-scratch --train-file runs/shake/train-*.bin --eval-file runs/shake/eval.bin --batch-size 4 --seq-len 1024 --steps 300 --gpus 1 --backend triton --learning-rate 6e-4 --lr-schedule cosine --warmup 30 --eval-every-n-steps 50 --no-export --sample-tokens 0 --no-progress"
for seed in $SEEDS; do
  for kind in $KIND; do
    if [ $(( $(date +%s) - T0 )) -gt 200 ]; then echo "== $kind $seed skipped for time" | tee -a "$L"; continue; fi
    extra=""; [ $kind = $KIND ] && extra="$EXTRA"
    run ${kind}_$seed 100 $C --seed $seed $extra --out-dir $OUT/${kind}_$seed --log-file $OUT/conv_${kind}_$seed.json
  done
done
stop_smi 10
PYTHONPATH=$PWD python3 - "$OUT" $KIND $SEEDS <<'PY' | tee -a "$L"
import statistics as S, sys
from llmq_ray.observe.runlog import read_log
out, other, seeds = sys.argv[1], sys.argv[2], [int(x) for x in sys.argv[3:]]
res = {}
for kind in (other,):
    for seed in seeds:
        try:
            log = read_log(f"{out}/conv_{kind}_{seed}.json")
        except Exception as exc:
            print(f"CONV {kind} {seed}: no log ({exc})"); continue
        steps = [r["loss"] for r in log if r.get("log") == "step"]
        evals = [r["loss"] for r in log if r.get("log") == "eval"]
        if len(steps) < 300 or not evals:
            print(f"CONV {kind} {seed}: incomplete ({len(steps)} steps)"); continue
        res[kind, seed] = (sum(steps[-20:]) / 20, evals)
        print(f"CONV {kind} {seed}: train (last 20) {res[kind, seed][0]:.4f}, eval " + " / ".join(f"{e:.4f}" for e in evals))
for kind in (other,):
    got = [res[kind, s] for s in seeds if (kind, s) in res]
    if len(got) >= 2:
        tr, ev = [g[0] for g in got], [g[1][-1] for g in got]
        print(f"MEAN {kind} ({len(got)} seeds): train {S.mean(tr):.4f} (sd {S.stdev(tr):.3f}), final eval {S.mean(ev):.4f} "
              f"(sd {S.stdev(ev):.3f}, range {min(ev):.4f}-{max(ev):.4f})")
PY
