#!/bin/bash
# Issue 22 (small-call order of gluon_ws): variants against the package kernel and FlashMLA in
# one process on the H200 (experiments/ws_variants_probe.py, budget timer, interleaved rounds).
# Run from the repository root with .peers carried. A variant is a copy of hopper_ws.py at
# 19799b9 with one of patches/ws_small_call/<name>.diff applied:
#   git show 19799b9:sparse_mla/gluon/hopper_ws.py > /tmp/base.py
#   patch -o runs/ws_<name>.py /tmp/base.py < experiments/patches/ws_small_call/<name>.diff
#   SPECS="<name>=runs/ws_<name>.py ..." POINTS=64:64,64:128,256:64 bash experiments/ws_small_call_run.sh
# (qh needs the variant's own launch hook, in its diff; old = 19799b9's kernel with a launch hook
# that drops small_call: the "old" of data/bench/ws_small_call_h200.log, run 6.)
set -u
export PYTHONPATH=$PWD:$PWD/.peers FLASHMLA_BUILD_DIR=/tmp/flashmla_build PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
specs="pkg ${SPECS:-}"
t0=$(date +%s)
python3 -c "import flash_mla; flash_mla._build()" > "$OUT/warm_flashmla.log" 2>&1 &
for s in $specs; do
  python3 experiments/ws_variants_probe.py --warm-only "$s" > "$OUT/warm_${s%%=*}.log" 2>&1 &
done
wait
echo "warm: $(( $(date +%s) - t0 )) s"
python3 experiments/ws_variants_probe.py --points "${POINTS:-64:64,64:128,256:64,16384:128}" \
  --rounds "${ROUNDS:-9}" --base pkg --log "$OUT/ws_lat.log" --csv "$OUT/ws_lat.csv" $specs
echo "total: $(( $(date +%s) - t0 )) s"
