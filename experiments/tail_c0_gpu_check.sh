#!/usr/bin/env bash
# GPU checks of consumer 0's short last PV in gluon_ws (thirteenth session): the last pair's PV
# with P1 in steps of 16 + 16 + 32 slots, only the first when the odd tile is short. Run from the
# repository root, with experiments/patches/ws_c0_short_pv.diff applied (`git apply`), on the
# H200 with .whl (pytest-xdist), .peers (FlashMLA) and .ab_base (the
# package before: `git archive <base> sparse_mla | tar -x -C .ab_base`) carried:
#   STEP=tests|ab OUT=dir bash experiments/tail_c0_gpu_check.sh
# tests: compute-sanitizer's memcheck over test_gpu_ws_short_last_tile (the first short-PV form
# read shared memory out of bounds, PERF_NOTES "No cliffs" step 8), then the GPU tests of every
# gluon_ws path and gluon_ws_fp8 (which shares the consumers). ab: gluon_ws, default and
# FlashMLA at H 64/96/128 x T 64/256/1024/16384 plus GLM, base and new, one process each.
set -u
OUT=${OUT:-/tmp/tail_c0}
STEP=${STEP:-tests}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FLASHMLA_BUILD_DIR=/tmp/flashmla_build
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/pytest_xdist-*.whl .whl/execnet-*.whl
t0=$(date +%s)
if [ "$STEP" = tests ]; then
  SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer | head -n 1)
  PYTHONPATH=$PWD:/tmp/site timeout 200 "$SAN" --tool memcheck --print-limit 5 python3 -m pytest \
    -q -p no:cacheprovider -m gpu tests/test_gluon.py -k short_last > "$OUT/sanitizer.log" 2>&1
  echo "sanitizer: rc $?, $(( $(date +%s) - t0 )) s" | tee -a "$OUT/sanitizer.log"
  grep -E "ERROR SUMMARY|passed|failed" "$OUT/sanitizer.log" | tail -n 3
  PYTHONPATH=$PWD:/tmp/site timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -n 12 \
    tests/test_kernels_gpu.py tests/test_fp8_prefill.py tests/test_dense_ids.py tests/test_gluon.py \
    -k "(gluon_ws and not small) or ws_knobs or small_call_order or short_last or ws_prefill" \
    > "$OUT/gpu_tests.log" 2>&1
  echo "tests: rc $?, $(( $(date +%s) - t0 )) s" | tee -a "$OUT/gpu_tests.log"
  tail -n 2 "$OUT/gpu_tests.log"
fi
if [ "$STEP" = ab ]; then
  for which in base new; do
    if [ $which = base ]; then D=$PWD/.ab_base; else D=$PWD; fi
    (cd "$D" && PYTHONPATH="$D:$OLDPWD/.peers" timeout 140 python3 -m sparse_mla.cli bench --grid \
      --tokens 64,256,1024,16384 --heads 64,96,128 --glm --providers gluon_ws,default,flashmla \
      --no-ceilings --out "$OUT/grid_${which}.csv" > "$OUT/grid_${which}.log" 2>&1)
    echo "grid $which: rc $?, $(( $(date +%s) - t0 )) s" | tee -a "$OUT/grid_${which}.log"
  done
fi
