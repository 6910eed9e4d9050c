#!/usr/bin/env bash
# GPU checks of branch h26c (issue 26 leftovers: plans, the FP8 op, packing under compile).
# Run from the repository root on the H200 (about 2-3 minutes): bash experiments/h26c_gpu_check.sh
# Logs go to $OUT (default /tmp): gpu_tests.log, host_cost.log, host_cost_large.log.
set -u
OUT=${OUT:-/tmp}
PY=${PY:-python}
t0=$(date +%s)
# 1. The GPU tests this branch adds or whose path it changes (every call now replays plans).
$PY -m pytest -q -x -m gpu -p no:cacheprovider \
  tests/test_plans.py tests/test_op_fp8.py tests/test_indices_compile.py tests/test_op.py \
  tests/test_kernels_gpu.py::test_fast_launch_matches_triton 2>&1 | tail -n 30 > "$OUT/gpu_tests.log"
echo "tests: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/gpu_tests.log"
# 2. Host time per call (out= given, 200 back-to-back calls, median of 5 windows), plans off and
#    on in one process, every kernel at T=4, with the parts of a call.
$PY scripts/host_cost.py --plans both --parts --shapes 16x4,64x4,128x4 > "$OUT/host_cost.log" 2>&1
# 3. The large calls, config=None only (each window queues 200 real kernels).
$PY scripts/host_cost.py --plans both --kernels default --shapes 64x16384,16x16384 \
  > "$OUT/host_cost_large.log" 2>&1
echo "total: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/host_cost_large.log"
