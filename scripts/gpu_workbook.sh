#!/usr/bin/env bash
# The workbook's GPU side, on a machine with a GPU and no browser:
#   1. the lab and notebook tests (their `gpu` tests included; notebooks at small sizes, where
#      their GPU branches run: timed sweep, GPU replay, Hopper run, the panel on 'local'), and
#      issue 23's: each kernel in the explorer, a timed Gluon sweep exported, the ncu profile,
#   2. notebooks 02-05 at full size through scripts/run_notebooks.py (executed copies and a
#      digest of their outputs under OUTDIR/full),
#   3. the explorer on this GPU once per kernel it offers (compiled, checked against fp32,
#      timed): scripts/explorer_digest.py, OUTDIR/explorer_digest.md.
# Usage: scripts/gpu_workbook.sh OUTDIR [tests|notebooks|explorer|all]   (needs ipywidgets, nbclient,
# ipykernel importable; the repository root on PYTHONPATH or the package installed)
# Python: $PYTHON if set, else the checkout's .venv/bin/python (what `make` builds), else python3.
set -uo pipefail
out=${1:?usage: scripts/gpu_workbook.sh OUTDIR [tests|notebooks|explorer|all]}
what=${2:-all}
root=$(cd "$(dirname "$0")/.." && pwd)
if [[ -z ${PYTHON:-} ]]; then
  if [[ -x $root/.venv/bin/python ]]; then PYTHON=$root/.venv/bin/python; else PYTHON=python3; fi
fi
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg
echo "python $PYTHON"
"$PYTHON" -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")' | tee "$out/env.txt"
echo "commit ${SPARSE_MLA_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}" | tee -a "$out/env.txt"
rc=0
if [[ $what == tests || $what == all ]]; then
  # issue 23: every registered kernel in the explorer, timed Gluon sweeps, the ncu profile view
  "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_lab.py tests/test_notebooks.py \
    tests/test_lab_kernels.py tests/test_kernels_tuning.py tests/test_profile.py \
    2>&1 | tee "$out/lab_notebook_tests.log" || rc=1
fi
if [[ $what == notebooks || $what == all ]]; then
  env -u SPARSE_MLA_SMALL "$PYTHON" scripts/run_notebooks.py notebooks/0[2-5]_*.ipynb \
    --out "$out/full" 2>&1 | tee "$out/run_notebooks.log" || rc=1
fi
if [[ $what == explorer || $what == all ]]; then
  "$PYTHON" scripts/explorer_digest.py --out "$out/explorer_digest.md" \
    2>&1 | tee "$out/explorer_digest.log" || rc=1
fi
exit $rc
