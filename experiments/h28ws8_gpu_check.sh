#!/usr/bin/env bash
# GPU checks of branch h28ws8 (issue 25: gluon_ws_fp8, the heads-on-M kernel fed by an FP8
# producer). Run from the repository root on the H200 (at most 4 minutes):
#   OUT=/some/dir bash experiments/h28ws8_gpu_check.sh
# Logs in $OUT (default /tmp/h28ws8): ws_fp8_probe.log (gluon_ws_fp8 vs gluon_ws_small_fp8 vs
# the bf16 gluon_ws at H64/H128, T = 16384 and 1024, each launch checked against the fp32
# reference before it is timed), gpu_tests_fp8.log (the GPU tests of every registered FP8
# kernel and config=None), gpu_tests_plans_fp8.log (their plans' replays).
set -u
OUT=${OUT:-/tmp/h28ws8}
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
t0=$(date +%s)
# 1. Timing, same process: bf16 gluon_ws on the dequantized pool, gluon_ws_small_fp8,
#    gluon_ws_fp8 (its default, 4 pieces ahead, and AHEAD 1 / 2 / 3 / 5) and
#    config=None on the cache; every launch checked against the reference first.
timeout 150 $PY experiments/ws_fp8_probe.py > "$OUT/ws_fp8_probe.log" 2>&1
echo "rc=$? probe: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/ws_fp8_probe.log"
cat "$OUT/ws_fp8_probe.log"
XDIST=""
if $PY -c "import xdist" 2>/dev/null; then XDIST="-n 8"; fi
# 2. The FP8 kernels against the fp32 reference (H 1-128, block sizes 2/3/64/256, int32/int64,
#    dense ids, large calls, out= views, a cache past 2 GiB); cut at 70 s (the log says how far
#    it got).
timeout 70 $PY -m pytest -q -m gpu -p no:cacheprovider $XDIST tests/test_fp8_prefill.py \
  > "$OUT/gpu_tests_fp8.log" 2>&1
echo "rc=$? fp8 tests: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/gpu_tests_fp8.log"
tail -n 5 "$OUT/gpu_tests_fp8.log"
# 3. Their plans: replays bitwise equal to the full path and right against the reference.
timeout 20 $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_plans_fp8.py \
  > "$OUT/gpu_tests_plans_fp8.log" 2>&1
echo "rc=$? plan tests: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/gpu_tests_plans_fp8.log"
tail -n 5 "$OUT/gpu_tests_plans_fp8.log"
