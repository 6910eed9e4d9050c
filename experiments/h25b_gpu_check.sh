#!/bin/bash
# Issue 25, FP8 bench rows (branch h25b): `sparse-mla bench --fp8` on the H200, FlashMLA on
# PYTHONPATH (from .peers/, carried to the device: ../shared/peers/README.md). One run, in the
# same process: fp8_default, every FP8 kernel (fp8_<name>), peer (a) flashmla*_fp8ws (torch
# gather-dequant of the referenced rows into a bf16 workspace + FlashMLA's bf16 sparse prefill,
# timed together) and peer (c) bf16_default_dequant, at CSA T=16384 x H 8/16/32/64/128 (top-k
# 1024 at H=128), then T=1024 and T=256 at H=16; every row checked against the fp32 reference
# over the dequantized rows before it is timed (40 ms budget per provider and point).
#
# Run from the repository root, with .peers in the device's carry and the commit passed in
# (the device's copy has no .git):
#   COMMIT=<sha> OUT=$OUT bash experiments/h25b_gpu_check.sh   (the sha of `git rev-parse HEAD` here)
# Writes under $OUT: nvidia-h200_fp8.csv (commit it as data/bench/nvidia-h200_fp8.csv) and
# nvidia-h200_fp8_<sha7>.log (commit it beside the CSV).
# Expected wall time: ~15 s ceilings + ~40 s FlashMLA build (fresh /tmp/flashmla_build) + the
# Gluon/Triton compiles + 7 points; no point starts after 130 s, the whole is killed at 175 s.
set -u
export PYTHONPATH=$PWD:$PWD/.peers FLASHMLA_BUILD_DIR=/tmp/flashmla_build PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/h25b_gpu_check}
COMMIT=${COMMIT:?"give COMMIT=<sha> (the device has no .git; a stale HEAD would label the rows)"}
mkdir -p "$OUT"
LOG="$OUT/nvidia-h200_fp8_${COMMIT:0:7}.log"
t0=$(date +%s)
{
  echo "# experiments/h25b_gpu_check.sh at commit $COMMIT"
  echo "# python3 -m sparse_mla.cli bench --fp8 --time-limit 130 --commit $COMMIT --out nvidia-h200_fp8.csv"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} > "$LOG" 2>&1
timeout 175 python3 -m sparse_mla.cli bench --fp8 --time-limit 130 --commit "$COMMIT" \
  --out "$OUT/nvidia-h200_fp8.csv" >> "$LOG" 2>&1
rc=$?
echo "bench --fp8 rc=$rc, wall $(( $(date +%s) - t0 )) s" >> "$LOG"
tail -n 25 "$LOG"
