#!/bin/bash
# Issue 23 (profile view): on the H200, (1) the GPU test of the profile view, verbose, and (2) the
# raw Nsight Compute CSV pages of one small gluon_ws run, saved for comparison with what
# sparse_mla/profile.py parses (tests/test_profile.py holds the layouts it was written against).
# Run from the repository root:  OUT=/some/dir bash experiments/h23b_gpu_check.sh
# Writes under $OUT: pytest_profile.log; ncu_source.csv (--print-source cuda,sass: the view the
# parser reads), ncu_source_cuda.csv and ncu_source_sass.csv (the other views), ncu_raw.csv
# (the stall-reason group), ncu_version.txt, parsed.txt (what the parser made of them) and the
# report itself (ncu/profile.ncu-rep).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/h23b_gpu_check}
mkdir -p "$OUT/ncu"
NCU=${SPARSE_MLA_NCU:-$(command -v ncu)}
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; "$NCU" --version; } \
  > "$OUT/ncu_version.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  >> "$OUT/ncu_version.txt" 2>&1

# (1) the failing test, verbose, with its printed table
timeout 420 python3 -m pytest -v -s -p no:cacheprovider -m gpu tests/test_profile.py \
  -k warp_specialised -rfEs > "$OUT/pytest_profile.log" 2>&1
echo "pytest rc=$?" | tee -a "$OUT/pytest_profile.log"

# (2) one small gluon_ws run (H=64, T=256) under ncu through the package (the report and its
# pages are written to $OUT/ncu), then every source view and the raw page as ncu prints them.
timeout 300 python3 - "$OUT" <<'PY' > "$OUT/parsed.txt" 2>&1
import sys
from sparse_mla import profile as prof

out = sys.argv[1]
try:
    p = prof.profile("gluon_ws", 64, num_tokens=256, out_dir=f"{out}/ncu")
    print(f"parsed {len(p.lines)} lines, {len(p.stalls)} stall reasons")
    print(prof.profile_table(p, top=30))
except Exception as e:  # the report may still be there for the pages below
    print(f"profile failed: {type(e).__name__}: {e}")
PY
echo "profile rc=$?" >> "$OUT/parsed.txt"
REP="$OUT/ncu/profile.ncu-rep"
if [ -f "$REP" ]; then
  for view in cuda,sass cuda sass; do
    name=ncu_source_${view/,/_}.csv
    [ "$view" = cuda,sass ] && name=ncu_source.csv
    "$NCU" --import "$REP" --csv --print-units base --page source --print-source "$view" \
      > "$OUT/$name" 2> "$OUT/$name.err"
  done
  "$NCU" --import "$REP" --csv --print-units base --page raw \
    --metrics group:smsp__pcsamp_warp_stall_reasons > "$OUT/ncu_raw.csv" 2> "$OUT/ncu_raw.err"
  # what the parser makes of each saved page
  python3 - "$OUT" <<'PY' >> "$OUT/parsed.txt" 2>&1
import sys
from pathlib import Path
from sparse_mla import profile as prof

out = Path(sys.argv[1])
for f in ("ncu_source.csv", "ncu_source_cuda.csv", "ncu_source_sass.csv"):
    lines = prof.parse_source_csv((out / f).read_text())
    top = sorted(lines, key=lambda pl: -pl.samples())[:3]
    print(f"{f}: {len(lines)} lines; top: {[(pl.file, pl.line, pl.samples()) for pl in top]}")
print("ncu_raw.csv:", prof.parse_raw_csv((out / "ncu_raw.csv").read_text()))
PY
else
  echo "no report at $REP" >> "$OUT/parsed.txt"
fi
ls -la "$OUT" "$OUT/ncu"
