#!/usr/bin/env bash
# GPU checks of branch h26d (issue 26: the FP8-cache entry's direct launch and plans).
# Run from the repository root on the H200 (about 2-3 minutes): bash experiments/h26d_gpu_check.sh
# Logs go to $OUT (default /tmp): gpu_tests.log, host_cost_fp8.log, host_cost_fp8_large.log,
# gpu_tests_fp8_prefill.log.
set -u
OUT=${OUT:-/tmp}
mkdir -p "$OUT"
PY=${PY:-python}
t0=$(date +%s)
# 1. The GPU tests this branch adds (FP8 replays == full path, bitwise, and the fp32 reference)
#    and the FP8 op's compile tests (its kernel now plans).
$PY -m pytest -q -x -m gpu -p no:cacheprovider tests/test_plans_fp8.py tests/test_op_fp8.py \
  2>&1 | tail -n 30 > "$OUT/gpu_tests.log"
echo "tests: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/gpu_tests.log"
# 2. Host time per call of the FP8 entry (out= given, 200 back-to-back calls, median of 5
#    windows), plans off and on in one process, config=None and each FP8 kernel at T=4, with
#    the parts of a call.
$PY scripts/host_cost.py --fp8 --plans both --parts --shapes 16x4,64x4,128x4 \
  > "$OUT/host_cost_fp8.log" 2>&1
# 3. The large calls, config=None only (gluon_ws_small_fp8: ~2.4 ms a call at T=16384).
$PY scripts/host_cost.py --fp8 --plans both --kernels default --shapes 64x16384,16x16384 \
  > "$OUT/host_cost_fp8_large.log" 2>&1
echo "host cost: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/host_cost_fp8_large.log"
# 4. triton_fp8's launch path changed (direct launches): the FP8 kernels' GPU tests against
#    the fp32 reference (88 cases; cut at 100 s, the log says how far it got).
timeout 100 $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_fp8_prefill.py \
  2>&1 | tail -n 30 > "$OUT/gpu_tests_fp8_prefill.log"
echo "total: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/gpu_tests_fp8_prefill.log"
