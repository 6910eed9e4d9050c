#!/usr/bin/env bash
# GPU check of branch h28fp8s (issue 25: why the FP8 producer is slow, and the staged variant).
# Run from the repository root on the H200 (about 3 minutes; the steps' timeouts add to 280 s):
#   OUT=dir [STEP=all|stage|ncu] bash experiments/h28fp8s_gpu_check.sh
# Logs under $OUT (default /tmp/h28fp8s):
#   stage: fp8_stage.log: experiments/fp8_stage.py's checks, then a table of do_bench medians
#     (two rounds): package / bf16 default / fp8_stage with 2 and 1 dequant warpgroups at
#     T=16384 H16 and H8 and T=1024 H16, and the ablations pkg_gather / stage2_gather /
#     pkg_noload / stage2_olddq at T=16384 H16;
#   ncu: ncu_profile.txt (sparse_mla.profile of gluon_ws_small_fp8 at H16 T=2048: warp-stall
#     samples per source line, so the producer's and the consumer's lines apart; the report and
#     its pages under ncu/), ncu_sections_<kernel>.csv (memory workload, scheduler, compute and
#     warp-state sections of gluon_ws_small_fp8 and of the bf16 gluon_ws_small, same point:
#     L1 wavefronts, shared-memory bank conflicts, issue slots and pipe utilization side by side);
#   gpu.log: the card's clocks and state before and after (read only).
set -u
OUT=${OUT:-/tmp/h28fp8s}
PY=${PY:-python3}
STEP=${STEP:-all}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p "$OUT/ncu"
t0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu \
  --format=csv > "$OUT/gpu.log" 2>&1
if [ "$STEP" = all ] || [ "$STEP" = stage ]; then
  timeout 140 $PY experiments/fp8_stage.py > "$OUT/fp8_stage.log" 2>&1
  echo "fp8_stage.py exit $? after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/fp8_stage.log"
  grep -E "FAIL|Error|error" "$OUT/fp8_stage.log" | head -n 20
  tail -n 32 "$OUT/fp8_stage.log"
fi
if [ "$STEP" = all ] || [ "$STEP" = ncu ]; then
  timeout 60 $PY - "$OUT" <<'PY' > "$OUT/ncu_profile.txt" 2>&1
import sys
from sparse_mla import profile as prof

p = prof.profile("gluon_ws_small_fp8", 16, num_tokens=2048, out_dir=f"{sys.argv[1]}/ncu")
print(f"parsed {len(p.lines)} lines, {len(p.stalls)} stall reasons")
print(prof.profile_table(p, top=40))
PY
  echo "ncu profile exit $? after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/ncu_profile.txt"
  timeout 80 $PY - "$OUT" <<'PY' >> "$OUT/ncu_profile.txt" 2>&1
import json, re, subprocess, sys
from sparse_mla import inspect as si, profile as prof, tune

out = sys.argv[1]
for kernel in ("gluon_ws_small_fp8", "gluon_ws_small"):
    launch = tune.base_launch(kernel, "local", 16, 512, num_tokens=2048)[0]
    _, res = si.compile_kernel(kernel, "local", num_heads=16, head_dim=512, config=launch)
    args = {"kernel": kernel, "launch": tune.launch_json(kernel, launch), "H": 16, "D": 512,
            "T": 2048}
    cmd = [prof.ncu_path(), "--target-processes", "all", "--kernel-name-base", "function",
           "--kernel-name", f"regex:^{re.escape(res.kernel_name)}$", "--launch-skip", "1",
           "--launch-count", "1", "--section", "MemoryWorkloadAnalysis_Tables", "--section",
           "MemoryWorkloadAnalysis", "--section", "SchedulerStats", "--section",
           "ComputeWorkloadAnalysis", "--section", "WarpStateStats", "--section",
           "SpeedOfLight", "--csv", "--page", "details", "--print-units", "base",
           sys.executable, "-m", "sparse_mla.profile", "--run", json.dumps(args)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=38)
    except subprocess.TimeoutExpired as e:
        print(kernel, "ncu timed out:", str(e)[-300:])
        continue
    with open(f"{out}/ncu_sections_{kernel}.csv", "w") as f:
        f.write(done.stdout + done.stderr)
    print(kernel, "ncu exit", done.returncode, len(done.stdout.splitlines()), "lines")
PY
  echo "ncu sections exit $? after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/ncu_profile.txt"
  head -n 60 "$OUT/ncu_profile.txt"
fi
nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv >> "$OUT/gpu.log" 2>&1
cat "$OUT/gpu.log"
echo "total $(( $(date +%s) - t0 )) s"
