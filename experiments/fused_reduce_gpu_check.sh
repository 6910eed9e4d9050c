#!/usr/bin/env bash
# GPU checks of the split kernels' fused reduce (issue 26: one launch a call for gluon_mma and
# gluon_wgmma). Run from the repository root on the H200 with .whl (pytest-xdist) and .ab_base
# (the package before the change: `git archive <base> sparse_mla | tar -x -C .ab_base`) carried:
#   bash experiments/fused_reduce_gpu_check.sh
# Logs go to $OUT: gpu_tests.log, fused_reduce.log, host_cost_ab.log.
set -u
OUT=${OUT:-/tmp/fused}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/pytest_xdist-*.whl .whl/execnet-*.whl && export PYTHONPATH=/tmp/site
export PYTHONUNBUFFERED=1
NEW="$PWD:/tmp/site"
t0=$(date +%s)
# 1. GPU tests of every path the change touches: the split-capable kernels against the fp32
#    reference (splits 1/3, decode splits 4/auto), the counters reused across calls (zero at
#    rest), plans (kept sets back to back, side stream, CUDA graph), and every registered
#    kernel's GPU tests that run gluon_mma / gluon_wgmma.
PYTHONPATH=$NEW timeout ${TEST_LIMIT:-420} python3 -m pytest -v -m gpu -p no:cacheprovider -n 12 \
  ${TESTS:-tests/test_gluon.py tests/test_plans.py tests/test_kernels_gpu.py tests/test_dense_ids.py
  tests/test_properties.py tests/test_dispatch.py} -k "${TEST_K:-not ws or mma}" \
  > "$OUT/gpu_tests.log" 2>&1
echo "tests: rc $?, $(( $(date +%s) - t0 )) s" | tee -a "$OUT/gpu_tests.log"
# 2. GPU time: fused against two launches, in turns, at small T.
PYTHONPATH=$NEW timeout 150 python3 experiments/fused_reduce.py > "$OUT/fused_reduce.log" 2>&1
echo "fused_reduce: rc $?, $(( $(date +%s) - t0 )) s" | tee -a "$OUT/fused_reduce.log"
[ -n "${SKIP_HOST:-}" ] && exit 0
# 3. Host time a call, base (two launches) and new (one), alternating processes, the split
#    kernels and config=None at T=4, smallest and median of 11 windows of 200 calls.
for rep in $(seq 1 ${HOST_REPS:-3}); do
  for which in ${HOST_WHICH:-base new}; do
    if [ $which = base ]; then P="$PWD/.ab_base:/tmp/site"; else P=$NEW; fi
    for stat in min median; do
      echo "== $which rep $rep stat $stat" >> "$OUT/host_cost_ab.log"
      PYTHONPATH=$P timeout 60 python3 scripts/host_cost.py --kernels default,gluon_mma,gluon_wgmma \
        --shapes 16x4,64x4,128x4 --windows 11 --stat $stat >> "$OUT/host_cost_ab.log" 2>&1
    done
  done
done
echo "host cost: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/host_cost_ab.log"
