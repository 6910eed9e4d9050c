#!/usr/bin/env bash
# The GPU checks left open when a session's H200 time ran out, in one place, for the next run.
# (The seventh session's list ran on 389977b in the eighth: logs data/bench/*389977b*.) This is
# the eighth session's list. From the repository root, with `.peers` carried (step grid) and
# the workbook wheels as `.whl` (step workbook; the device README says how):
#   OUT=dir COMMIT=sha STEP=plans|workbook|fp8host|host|grid|all bash experiments/pending_gpu_checks.sh
# Each step writes under $OUT and is capped; `all` runs them in this order (about 9 minutes).
# Keep few files under $OUT: the device returns a limited number.
#   plans     tests/test_plans_fp8.py's GPU tests after their fresh-ids fix (ea8fa6c; the run
#             of c24f1b2 failed 2 cases on the test's own NaN slots)
#   workbook  notebook 03 (sweeping the shipped kernel) and 05 on the GPU with their digest
#   fp8host   experiments/h26d_gpu_check.sh: the FP8 entry's plans and host cost
#   host      host cost at H64 T=16384 (cut by the step limit in the run of c24f1b2)
#   grid      sparse-mla bench --grid with FlashMLA, at least 5 calls a round in turns
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MPLBACKEND=Agg
OUT=${OUT:-/tmp/pending_gpu_checks}
STEP=${STEP:-all}
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
mkdir -p "$OUT"
want() { [ "$STEP" = all ] || [ "$STEP" = "$1" ]; }
if want plans; then
  timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_plans_fp8.py \
    > "$OUT/plans_fp8.log" 2>&1
  echo "plans: rc=$?"; tail -n 3 "$OUT/plans_fp8.log"
fi
if want workbook; then
  if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl > /dev/null 2>&1
    export PYTHONPATH=$PWD:/tmp/site
  fi
  mkdir -p "$OUT/nb"
  timeout 200 python3 scripts/run_notebooks.py notebooks/03_sweep_and_export.ipynb \
    notebooks/05_gluon_mla.ipynb --out "$OUT/nb" > "$OUT/notebooks.log" 2>&1
  echo "workbook: rc=$?"; rm -f "$OUT"/nb/*.ipynb; tail -n 3 "$OUT/notebooks.log"
fi
if want fp8host; then
  OUT="$OUT/h26d" timeout 200 bash experiments/h26d_gpu_check.sh > /dev/null 2>&1
  echo "fp8host: rc=$?"
fi
if want host; then
  timeout 90 python3 scripts/host_cost.py --plans both --shapes 64x16384 > "$OUT/host_cost.log" 2>&1
  echo "host: rc=$?"; tail -n 14 "$OUT/host_cost.log"
fi
if want grid; then
  PYTHONPATH=$PWD:$PWD/.peers FLASHMLA_BUILD_DIR=/tmp/flashmla_build timeout 300 \
    python3 -m sparse_mla.cli bench --grid --time-limit 260 --commit "$COMMIT" \
    --out "$OUT/nvidia-h200_grid.csv" > "$OUT/nvidia-h200_grid_${COMMIT:0:7}.log" 2>&1
  echo "grid: rc=$?"; tail -n 5 "$OUT/nvidia-h200_grid_${COMMIT:0:7}.log"
fi
