#!/usr/bin/env bash
# GPU check of branch h28fp8s (issue 25: why the FP8 producer is slow, and the staged variant).
# Run from the repository root on the H200 (about 2 minutes; cut at 210 s):
#   OUT=dir bash experiments/h28fp8s_gpu_check.sh
# Logs under $OUT: fp8_stage.log (checks, then a table of do_bench medians, two rounds:
# package / bf16 default / fp8_stage with 2 and 1 dequant warpgroups at T=16384 H16 and H8 and
# T=1024 H16, and the ablations pkg_gather / stage2_gather / pkg_noload at T=16384 H16), gpu.log
# (the card's clocks and state, read only), and the last lines of each on stdout.
set -u
OUT=${OUT:-/tmp/h28fp8s}
PY=${PY:-python3}
mkdir -p "$OUT"
t0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu \
  --format=csv > "$OUT/gpu.log" 2>&1
PYTHONPATH=. timeout 210 $PY experiments/fp8_stage.py > "$OUT/fp8_stage.log" 2>&1
echo "fp8_stage.py exit $? after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/fp8_stage.log"
nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv >> "$OUT/gpu.log" 2>&1
grep -E "FAIL|Error|error" "$OUT/fp8_stage.log" | head -n 20
tail -n 30 "$OUT/fp8_stage.log"
cat "$OUT/gpu.log"
