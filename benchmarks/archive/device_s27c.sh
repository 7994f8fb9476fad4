#!/usr/bin/env bash
# Session 27 call C, one H200: benchmarks/classifier_l2.py (per-lane running max/sum, one program per SM, pass 2
# backwards) against the production classifier at 32,768 x 151,936 bf16, and at 8,192 rows. Ran at 2ea6c57; the
# script was removed after it (no gain: benchmarks/LOG.md, session 27 call C); `git show 2ea6c57:benchmarks/classifier_l2.py`.
source benchmarks/device_lib.sh s27c.log smi_s27c.csv
run l2_32k 150 benchmarks/classifier_l2.py
run l2_8k 100 benchmarks/classifier_l2.py --rows 8192
stop_smi 10
grep -hE "^== |^prod|^programs|Error" "$L" | cut -c1-200
