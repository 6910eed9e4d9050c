#!/bin/bash
# Issue 22 (small-T latency of gluon_ws): variants of hopper_ws.py against the package kernel
# and FlashMLA in one process on the H200 (experiments/ws_variants_probe.py, budget timer).
# Run from the repository root with .peers carried:  bash experiments/ws_lat_run.sh [variant ...]
# A variant <name> is the file experiments/ws_lat_<name>.py (gitignored); those of the two runs in
# data/bench/ws_lat_h200.log are rebuilt from their diffs against hopper_ws.py at b0e1c69:
#   patch -o experiments/ws_lat_<name>.py sparse_mla/gluon/hopper_ws.py \
#     < experiments/patches/ws_lat_variants/<name>.diff
# (orig: a plain copy). Environment: POINTS (T:H,...), ROUNDS, BASE (the variant compared with).
set -u
export PYTHONPATH=$PWD:$PWD/.peers FLASHMLA_BUILD_DIR=/tmp/flashmla_build PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
V=${*:-sink qepi qfirst qfirst0 all all0 abl_noepi abl_noq abl_nokv}
POINTS=${POINTS:-64:64,64:128,256:64,16384:128,16384:64}
specs="pkg"
for v in $V; do specs="$specs $v=experiments/ws_lat_$v.py"; done
t0=$(date +%s)
# Fill Triton's cache in parallel (one process per variant) while FlashMLA builds.
python3 -c "import flash_mla; flash_mla._build()" > /tmp/warm_flashmla.log 2>&1 &
for s in $specs; do
  python3 experiments/ws_variants_probe.py --warm-only "$s" > "/tmp/warm_${s%%=*}.log" 2>&1 &
done
wait
tail -n 2 /tmp/warm_*.log > "$OUT/warm.log"
echo "warm-up and FlashMLA build: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/warm.log"
python3 experiments/ws_variants_probe.py --points "$POINTS" --rounds "${ROUNDS:-9}" \
  --base "${BASE:-pkg}" --log "$OUT/ws_lat.log" --csv "$OUT/ws_lat.csv" $specs
echo "total: $(( $(date +%s) - t0 )) s"
