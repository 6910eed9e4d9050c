#!/bin/bash
# Issue 22, dense ids (branch h22d): the GPU checks for the lead to run on the H200, from the
# repository root (no peers needed). Two steps, each well under 3 minutes on a warm Triton cache
# (fresh machine: compiles of gluon_ws / gluon_ws_small with DENSE_IDS, ~15 s each, come first):
#   STEP=timing  same-process timing, gluon_ws CSR vs dense (experiments/h22d_dense_timing.py)
#   STEP=tests   the GPU tests of the dense form (tests/test_dense_ids.py, -m gpu)
#   (default: both, timing first). Everything lands under $OUT.
# Prediction (docs/PERF_NOTES.md, "Dense ids"): T=64, H128 gluon_ws -0.5..-0.8 us dense vs CSR
# (H64/H96 -0.3..-0.7), K=1152 padded rows +6..+12 us, T=16384 H128 K=1152 +5..+12%.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
STEP=${STEP:-all}
t0=$(date +%s)
if [ "$STEP" = all ] || [ "$STEP" = timing ]; then
  timeout 170 python3 experiments/h22d_dense_timing.py 2>&1 | tee "$OUT/h22d_timing_stdout.log"
  echo "timing: $(( $(date +%s) - t0 )) s"
fi
if [ "$STEP" = all ] || [ "$STEP" = tests ]; then
  timeout 170 python3 -m pytest -v -p no:cacheprovider -m gpu \
    "tests/test_dense_ids.py::test_gpu_dense_equals_equivalent_csr_bitwise" \
    "tests/test_dense_ids.py::test_gpu_default_on_dense_ids_and_out_views" \
    "tests/test_dense_ids.py::test_gpu_every_kernel_dense" \
    2>&1 | tee "$OUT/h22d_gpu_tests.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed"
  echo "tests: $(( $(date +%s) - t0 )) s"
fi
