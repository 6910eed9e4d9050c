#!/usr/bin/env bash
# GPU check of branch h29fp8c (issue 25: the FP8 kernel whose consumer dequantizes K itself).
# Run from the repository root on the H200 (a few minutes; the steps' timeouts add to 570 s):
#   OUT=dir [STEP=all|consumer|pipe|ncu] bash experiments/h29fp8c_gpu_check.sh
# Logs under $OUT (default /tmp/h29fp8c):
#   consumer: consumer.log: experiments/fp8_consumer.py's checks and do_bench medians (two
#     rounds) of the package FP8 and bf16 kernels, the kernel, STORES=7, ONE_MUL and the
#     STORES=0 ablation at T=16384 H16 and H8;
#   pipe: pipe.log: the same for PIPE and PIPE with ONE_MUL, in a process of their own (a fault
#     there cannot take the other numbers with it);
#   ncu: ncu_consumer.csv: Nsight Compute's memory workload, scheduler, warp-state and
#     speed-of-light sections of k_consumer at T=2048 H16 (shared-memory wavefronts and bank
#     conflicts, issue slots), to set beside pending_gpu_checks.sh's for the package kernels;
#   gpu.log: the card's clocks and state before and after (read only).
set -u
OUT=${OUT:-/tmp/h29fp8c}
PY=${PY:-python3}
STEP=${STEP:-all}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p "$OUT"
t0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu \
  --format=csv > "$OUT/gpu.log" 2>&1
if [ "$STEP" = all ] || [ "$STEP" = consumer ]; then
  timeout 330 $PY experiments/fp8_consumer.py fp8_consumer fp8_consumer_st7 fp8_consumer_1mul \
    fp8_consumer_nostore > "$OUT/consumer.log" 2>&1
  echo "fp8_consumer.py exit $? after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/consumer.log"
  grep -E "FAIL|Error|error" "$OUT/consumer.log" | head -n 20
  tail -n 20 "$OUT/consumer.log"
fi
if [ "$STEP" = all ] || [ "$STEP" = pipe ]; then
  timeout 170 $PY experiments/fp8_consumer.py fp8_consumer_pipe fp8_consumer_pipe_1mul \
    > "$OUT/pipe.log" 2>&1
  echo "fp8_consumer.py (PIPE) exit $? after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/pipe.log"
  grep -E "FAIL|Error|error" "$OUT/pipe.log" | head -n 20
  tail -n 12 "$OUT/pipe.log"
fi
if [ "$STEP" = all ] || [ "$STEP" = ncu ]; then
  NCU=$($PY -c "from sparse_mla import profile as p; print(p.ncu_path() or '')")
  if [ -z "$NCU" ]; then
    echo "no ncu" | tee "$OUT/ncu_consumer.csv"
  else
    timeout 70 "$NCU" --target-processes all --kernel-name regex:k_consumer --launch-skip 1 \
      --launch-count 1 --section MemoryWorkloadAnalysis_Tables --section MemoryWorkloadAnalysis \
      --section SchedulerStats --section WarpStateStats --section SpeedOfLight --csv \
      --page details --print-units base $PY - > "$OUT/ncu_consumer.csv" 2>&1 <<'PY'
import sys

sys.path.insert(0, "experiments")
import torch  # noqa: E402

import fp8_consumer as M  # noqa: E402
from sparse_mla import fp8 as F, workloads as W  # noqa: E402

w = W.dsv4_csa(2048, 16, topk=512, device="cuda", seed=1)
cache = F.quantize(w.kv.reshape(w.kv.shape[0], -1), 64)
out = torch.empty_like(w.q)
for _ in range(2):
    M.run(w, cache, out)
torch.cuda.synchronize()
PY
    echo "ncu exit $? after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/ncu_consumer.csv"
    grep -iE "shared|bank|issue|Duration" "$OUT/ncu_consumer.csv" | head -n 30
  fi
fi
nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv >> "$OUT/gpu.log" 2>&1
cat "$OUT/gpu.log"
echo "total $(( $(date +%s) - t0 )) s"
