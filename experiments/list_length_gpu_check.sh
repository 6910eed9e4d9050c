#!/usr/bin/env bash
# Issue 22, list lengths (nineteenth session): the kernel choice by slots per token, on the H200.
# 1. The small-T points the first runs of the session left out (grid heads 2, 12, 20, 40, 80,
#    112): long requests' steps (--context 65536, every list whole), middling ones (--context
#    1024, 384 slots a token) and whole short prompts (the grid's own workload at T 1-16),
#    appended to the committed CSVs.
# 2. export --kernel-choice of every run together (the grid of 391741a and every run of the
#    context and small-T files) into the shipped sm90 file, copied to $OUT.
# 3. config=None with those choices against the kernels and FlashMLA padded, at long and
#    middling lists and at whole short prompts, T 1-16 (where the choice moved).
# From the repository root, .peers carried: OUT=dir COMMIT=sha bash experiments/list_length_gpu_check.sh
# MISSING (step 1's heads) and LISTS (step 1's parts, any of long middling short) pick what step 1
# measures (MIDDLING_RUNS: one middling run per "heads:tokens" entry); VERIFY_* pick step 3's
# points. The twentieth session ran MISSING=4,24,48,96 LISTS="middling short" (their long lists
# were measured in the first run, 14:39:34) and VERIFY_HEADS with those heads added: its
# middling run was cut at 60 s after three points, the rest measured in a second call
# (LISTS=middling MIDDLING_RUNS="4,24,48,96:4,16 96:1").
# Ran at ca4e873; its first run left 17 files under $OUT and the device returned 8 (the
# context-65536 and small-T rows and the export were lost and measured again). Keep $OUT to a
# few files: the step logs go into one. Run again, step 1 appends the same points to the
# committed CSVs a second time, and the export refuses points measured in two runs: name the
# runs to take with --run.
set -u
export PYTHONPATH=$PWD:$PWD/.peers FLASHMLA_BUILD_DIR=/tmp/flashmla_build PYTHONUNBUFFERED=1
C=${COMMIT:?"give COMMIT=<sha> (the device has no .git)"}
D=data/bench/nvidia-h200
MISSING=${MISSING:-2,12,20,40,80,112}
LISTS=${LISTS:-long middling short}
MIDDLING_RUNS=${MIDDLING_RUNS:-$MISSING:1,4,16}
VERIFY_HEADS=${VERIFY_HEADS:-1,2,8,12,16,20,32,40,64,80,112,128}
VERIFY_MID_HEADS=${VERIFY_MID_HEADS:-1,16,64,128}
VERIFY_SHORT_HEADS=${VERIFY_SHORT_HEADS:-1,16,64,128}
VERIFY_SHORT_TOKENS=${VERIFY_SHORT_TOKENS:-4,64}
B="python3 -m sparse_mla.cli bench --grid --no-ceilings --commit $C"
t0=$(date +%s)
: > "$OUT/steps_$C.log"
case " $LISTS " in *" long "*)
  $B --context 65536 --heads $MISSING --tokens 1,4,16,64 --time-limit 130 --out ${D}_grid_ctx65536.csv \
    >> "$OUT/steps_$C.log" 2>&1 ;;
esac
case " $LISTS " in *" middling "*)
  for run in $MIDDLING_RUNS; do
    $B --context 1024 --heads ${run%%:*} --tokens ${run#*:} --time-limit 150 \
      --out ${D}_grid_ctx1024.csv >> "$OUT/steps_$C.log" 2>&1
  done ;;
esac
case " $LISTS " in *" short "*)
  $B --no-glm --heads $MISSING --tokens 1,4,16 --time-limit 60 --out ${D}_grid_small_t.csv \
    >> "$OUT/steps_$C.log" 2>&1 ;;
esac
echo "step 1 done at $(( $(date +%s) - t0 )) s"
FILES="${D}_grid.csv ${D}_grid_ctx65536.csv ${D}_grid_ctx64.csv ${D}_grid_ctx256.csv ${D}_grid_ctx1024.csv ${D}_grid_small_t.csv"
RUNS=$(python3 - $FILES <<'EOF'
import csv, sys
main, *rest = sys.argv[1:]
runs = ["2026-12-02T12:41:51+00:00"]  # the grid of 391741a (the README's table)
for path in rest:
    with open(path, newline="") as f:
        runs += sorted({r["timestamp"] for r in csv.DictReader(f) if r.get("timestamp")})
print(" ".join(f"--run {r}" for r in runs))
EOF
)
echo "export runs: $RUNS"
python3 -m sparse_mla.cli export $FILES --arch sm90 --root sparse_mla/tuned --kernel-choice $RUNS \
  > /dev/null 2>> "$OUT/steps_$C.log"
echo "export rc $?"
cp sparse_mla/tuned/sm90/triton/attention/sparse_attention_dsv4/DEFAULT.json "$OUT/sm90_DEFAULT.json"
cp ${D}_grid_ctx65536.csv ${D}_grid_ctx1024.csv ${D}_grid_small_t.csv "$OUT/"
echo "step 2 done at $(( $(date +%s) - t0 )) s"
P=gluon_mma,gluon_wgmma,gluon_ws,gluon_ws_small,default,flashmla
$B --context 65536 --heads $VERIFY_HEADS --tokens 1,4,16 --providers $P \
  --time-limit 120 --out "$OUT/verify.csv" > "$OUT/verify_$C.log" 2>&1
$B --context 1024 --heads $VERIFY_MID_HEADS --tokens 1,4,16 --providers $P --time-limit 120 \
  --out "$OUT/verify.csv" >> "$OUT/verify_$C.log" 2>&1
$B --no-glm --heads $VERIFY_SHORT_HEADS --tokens $VERIFY_SHORT_TOKENS --providers $P --time-limit 120 \
  --out "$OUT/verify.csv" >> "$OUT/verify_$C.log" 2>&1
echo "step 3 done at $(( $(date +%s) - t0 )) s"
