#!/usr/bin/env bash
# Issue 25's loss point for the 8-bit Adam first moment (session 12, nvidia-h100-x1; carry .whl and runs/shake):
# 300 steps of Qwen2.5-0.5B from scratch on tiny-shakespeare, the bf16 path against the same with
# --opt-m-dtype e4m3, four seeds, the setup of h100-2026-11-24.md section 36 (B=4, T=1024, lr 6e-4 cosine, warmup
# 30, eval every 50 steps). runs/shake: python -m llmq_ray.data_pipeline.tokenize --input tiny-shakespeare --out runs/shake
#   bash benchmarks/archive/device_issue25_conv.sh 42 43 44 45
# KIND / EXTRA (environment): the name and flags of the run compared with bf16 (default: m8, --opt-m-dtype e4m3;
# device_issue25_conv_head.sh sets fp8h, the FP8 block GEMMs and LM head); LOG: the log's name.
SEEDS="${*:-42 43 44 45}"
KIND=${KIND:-m8}; EXTRA=${EXTRA:---opt-m-dtype e4m3}
source benchmarks/device_lib.sh ${LOG:-conv25.log} smi25c.csv
C="examples/train.py --model Qwen2.5-0.5B --from-scratch --train-file runs/shake/train-*.bin --eval-file runs/shake/eval.bin --batch-size 4 --seq-len 1024 --steps 300 --gpus 1 --backend triton --learning-rate 6e-4 --lr-schedule cosine --warmup 30 --eval-every-n-steps 50 --no-export --sample-tokens 0 --no-progress"
for seed in $SEEDS; do
  for kind in bf16 $KIND; do
    if [ $(( $(date +%s) - T0 )) -gt 520 ]; then echo "== $kind $seed skipped for time" | tee -a "$L"; continue; fi
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
for kind in ("bf16", other):
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
for kind in ("bf16", other):
    got = [res[kind, s] for s in seeds if (kind, s) in res]
    if len(got) >= 2:
        tr, ev = [g[0] for g in got], [g[1][-1] for g in got]
        print(f"MEAN {kind} ({len(got)} seeds): train {S.mean(tr):.4f} (sd {S.stdev(tr):.3f}), final eval {S.mean(ev):.4f} "
              f"(sd {S.stdev(ev):.3f}, range {min(ev):.4f}-{max(ev):.4f})")
PY
