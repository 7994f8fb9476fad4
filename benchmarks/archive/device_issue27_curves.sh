#!/usr/bin/env bash
# Issue 27, for the next two-GPU lease (nvidia-h100-x2 / nvidia-h200-x2; carry .whl and runs/shake, the
# tiny-shakespeare tokens): the 1-vs-2-GPU loss curves, 50 steps of Qwen2.5-0.5B from scratch on real text with
# the same global batch (1 GPU: B=8 x 2 micro-steps; 2 GPUs: B=8 x 1 each), ZeRO-1, bf16; their per-step losses
# side by side and a plot ($OUT/curves27.png, matplotlib if installed). Then, with the time left: 0.5B e4m3 (+ FP8
# head) on 2 GPUs with the default communication, and 0.5B bf16 on 2 GPUs with ZeRO-2 and ZeRO-3.
source benchmarks/device_lib.sh curves27.log smi27c.csv
C="examples/train.py --model Qwen2.5-0.5B --from-scratch --train-file runs/shake/train-*.bin --eval-file runs/shake/eval.bin --batch-size 8 --seq-len 1024 --steps 50 --backend triton --learning-rate 6e-4 --lr-schedule cosine --warmup 10 --eval-every-n-steps 0 --no-export --sample-tokens 0 --no-progress --seed 42"
run g1 150 $C --gpus 1 --grad-accumulation 2 --out-dir $OUT/g1 --log-file $OUT/curve_g1.json
run g2 150 $C --gpus 2 --grad-accumulation 1 --out-dir $OUT/g2 --log-file $OUT/curve_g2.json
PYTHONPATH=$PWD python3 - "$OUT" <<'PY' | tee -a "$L"
import sys
from llmq_ray.observe.runlog import read_log
out = sys.argv[1]
curves = {g: [r["loss"] for r in read_log(f"{out}/curve_{g}.json") if r.get("log") == "step"] for g in ("g1", "g2")}
print("| step | 1 GPU | 2 GPUs | rel. diff |\n|---|---|---|---|")
for i, (a, b) in enumerate(zip(curves["g1"], curves["g2"])):
    if i % 5 == 0 or i == len(curves["g1"]) - 1:
        print(f"| {i} | {a:.4f} | {b:.4f} | {abs(a - b) / a:.2e} |")
print("largest relative difference:", max(abs(a - b) / a for a, b in zip(curves["g1"], curves["g2"])))
try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.plot(curves["g1"], label="1 GPU (B=8 x 2)")
    plt.plot(curves["g2"], "--", label="2 GPUs (B=8 x 1 each)")
    plt.xlabel("step"); plt.ylabel("train loss"); plt.legend(); plt.title("Qwen2.5-0.5B, tiny-shakespeare, ZeRO-1")
    plt.savefig(f"{out}/curves27.png", dpi=100)
except ImportError as exc:
    print("no plot:", exc)
PY
A="benchmarks/bench_train.py --model Qwen2.5-0.5B --backend triton --batch-size 32 --grad-accumulation 1 --steps 20 --warmup-steps 5 --opt-m-dtype bf16 --opt-v-dtype bf16 --gpus 2"
run e4m3_g2 100 $A --use-cuda-graphs --matmul-dtype e4m3 --lmhead-dtype e4m3
[ $(( $(date +%s) - T0 )) -lt 470 ] && run z2_g2 100 $A --zero-level 2
[ $(( $(date +%s) - T0 )) -lt 500 ] && run z3_g2 $(( 585 - ($(date +%s) - T0) )) $A --zero-level 3
stop_smi 10
grep -E "^== |tokens/s" "$L"
