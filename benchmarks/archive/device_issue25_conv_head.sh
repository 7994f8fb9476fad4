#!/usr/bin/env bash
# Issue 25's loss point for the FP8 LM head (session 13, nvidia-h100-x1; carry .whl and runs/shake): the four-seed
# check of device_issue25_conv.sh with --matmul-dtype e4m3 --lmhead-dtype e4m3 (FP8 block GEMMs and LM head)
# against bf16.
#   bash benchmarks/archive/device_issue25_conv_head.sh 42 43 44 45
KIND=fp8h EXTRA="--matmul-dtype e4m3 --lmhead-dtype e4m3" LOG=conv25h.log \
  exec bash benchmarks/archive/device_issue25_conv.sh "$@"
