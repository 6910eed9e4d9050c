#!/usr/bin/env bash
# GPU checks of the twelfth session: the split kernels' combiner programs (one launch for
# 32/64-head split calls) and gluon_ws's short last tile (consumer 1's S and its own PV over
# 16 slots when the item's last odd tile holds at most 16). Run from the repository root
# on the H200 with .whl (pytest-xdist), .peers (FlashMLA, ../shared/peers/README.md) and
# .ab_base (the package before: `git archive 51341c0 sparse_mla | tar -x -C .ab_base`) carried:
#   bash experiments/combiners_tail_gpu_check.sh
# Logs under $OUT: gpu_tests.log, grid_new.csv / grid_base.csv (+ .log), split_config.log,
# host_cost.log.
set -u
OUT=${OUT:-/tmp/h30}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/pytest_xdist-*.whl .whl/execnet-*.whl
export PYTHONUNBUFFERED=1 FLASHMLA_BUILD_DIR=/tmp/flashmla_build
NEW="$PWD:$PWD/.peers:/tmp/site"
BASE="$PWD/.ab_base:$PWD/.peers:/tmp/site"
t0=$(date +%s)
# 0. FlashMLA's build (~40 s), once, outside every timed step.
PYTHONPATH=$NEW python3 -c "import flash_mla, torch; q = torch.zeros(1, 64, 512, dtype=torch.bfloat16, device='cuda'); kv = torch.zeros(1, 1, 512, dtype=torch.bfloat16, device='cuda'); i = torch.zeros(1, 1, 128, dtype=torch.int32, device='cuda'); flash_mla.flash_mla_sparse_fwd(q, kv, i, 1.0, 512)" > "$OUT/flashmla_build.log" 2>&1
echo "flashmla build: rc $?, $(( $(date +%s) - t0 )) s" | tee -a "$OUT/flashmla_build.log"
# 1. GPU tests: gluon_ws (CSR, dense ids, small-call order, knobs, fast launch, CUDA graph)
#    and gluon_ws_fp8 (its consumers are gluon_ws's) against the fp32 reference; the split
#    kernels (combiners and last arrival, counters zero at rest) and plans.
PYTHONPATH=$NEW timeout ${TEST_LIMIT:-240} python3 -m pytest -q -m gpu -p no:cacheprovider -n 12 \
  tests/test_kernels_gpu.py tests/test_fp8_prefill.py tests/test_dense_ids.py tests/test_gluon.py \
  tests/test_plans.py \
  -k "(gluon_ws and not small) or ws_knobs or small_call_order or short_last or mma or split or counter or plan" \
  > "$OUT/gpu_tests.log" 2>&1
echo "tests: rc $?, $(( $(date +%s) - t0 )) s" | tee -a "$OUT/gpu_tests.log"
# 2. The short last tile: gluon_ws, default and FlashMLA padded at the small-T grid points
#    where gluon_ws runs, base and new, one process each (base from .ab_base: `python -m`
#    puts the working directory first on sys.path, so each runs from its own tree).
for which in base new; do
  if [ $which = base ]; then D=$PWD/.ab_base; else D=$PWD; fi
  (cd "$D" && PYTHONPATH="$D:$OLDPWD/.peers" timeout 110 python3 -m sparse_mla.cli bench --grid \
    --tokens 64,256,1024 --heads 64,80,96,112,128 --no-glm --providers gluon_ws,default,flashmla \
    --no-ceilings --out "$OUT/grid_${which}.csv" > "$OUT/grid_${which}.log" 2>&1)
  echo "grid $which: rc $?, $(( $(date +%s) - t0 )) s" | tee -a "$OUT/grid_${which}.log"
done
# 3. gluon_mma's small prefill calls: 16-head blocks (last arrival) against its 64-head
#    blocks now fused by combiners, in turns.
PYTHONPATH=$NEW timeout 90 python3 experiments/fused_reduce.py --split-config \
  > "$OUT/split_config.log" 2>&1
echo "split config: rc $?, $(( $(date +%s) - t0 )) s" | tee -a "$OUT/split_config.log"
# 4. Host time a call: every kernel and FlashMLA at T = 4 (min of 11 windows) and T = 16384
#    (min of 5), wall clock, then this thread's CPU time.
for clock in wall cpu; do
  for sh in "16x4,64x4,128x4 11" "16x16384,64x16384 5"; do
    set -- $sh
    PYTHONPATH=$NEW timeout 100 python3 scripts/host_cost.py --shapes $1 --windows $2 \
      --stat min --clock $clock --kernels default,triton,gluon_mma,gluon_wgmma,gluon_ws,gluon_ws_small,flashmla \
      >> "$OUT/host_cost.log" 2>&1
    echo "host cost $clock $1: rc $?, $(( $(date +%s) - t0 )) s" | tee -a "$OUT/host_cost.log"
  done
done
