"""Why `gluon_ws` trails FlashMLA at GLM H64 (full top-k 2048): both kernels under Nsight Compute.

The grid's one miss (PERF_NOTES, No cliffs, step 11): at T = 16384, GLM H64, `config=None`
(`gluon_ws`) reads 1.005-1.03 of FlashMLA over the last three grids, while at CSA H64 (607 slots
a token on average) it is at parity; a fit of t = a + b x slots puts `gluon_ws`'s cost a slot
5-8% above FlashMLA's and its fixed part below. This runs one GLM H64 point (`-T`, default 2048;
its causal lists average 1024 slots there, 1920 at T = 16384, so only T = 16384 is the grid's
point) with `gluon_ws` forced and with FlashMLA, each checked against the fp32 reference first,
then called once more each inside an NVTX range that `ncu` records (the parent process runs this
file under ncu with its sections: speed of light with the SM clock, compute workload, memory
tables, scheduler and warp-state statistics, launch and occupancy). `--clock-control none`
leaves the GPU its own clocks, so a power-bound kernel shows a lower SM frequency. Measured
(sixteenth session, `data/bench/glm_h64_ncu_h200/`): PERF_NOTES, No cliffs, step 11.

    PYTHONPATH=$PWD:$PWD/.peers python3 experiments/glm_h64_ncu.py -T 16384 --clock-control none

(`--run` is the profiled child.) FlashMLA comes from the peers' build (../shared/peers).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis",
            "MemoryWorkloadAnalysis_Tables", "SchedulerStats", "WarpStateStats",
            "LaunchStats", "Occupancy")  # fmt: skip


def child(T: int, H: int, topk: int) -> None:
    import torch

    from sparse_mla import bench, dispatch
    from sparse_mla.prefill import sparse_mla_prefill

    dev = torch.device("cuda")
    w = bench.GridPoint("glm_full_topk", T, H, topk).build(dev, seed=0, sink=True, big_buffer=True)
    q, kv, idx, indptr, scale = w.args()
    refs = bench._References(w, 256)

    def ours(o):
        return sparse_mla_prefill(q, kv, idx, indptr, scale, attn_sink=w.attn_sink, out=o,
                                  config=dispatch.Choice("gluon_ws"))  # fmt: skip

    fm = bench._flashmla(w, dev, bench.Peers().flash_mla())
    for name, run in (("gluon_ws", ours), (fm.name, fm.run)):
        ok, _rel, note = bench._check(run, w, 256, refs)
        print(f"{name}: {'ok' if ok else 'WRONG ' + note}", flush=True)
        if not ok:
            sys.exit(1)
    out = torch.empty_like(q)
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("profiled")
    ours(out)
    fm.timed()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/glm_ncu")
    ap.add_argument("-T", type=int, default=2048)
    ap.add_argument("-H", type=int, default=64)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument(
        "--clock-control",
        default="base",
        choices=("base", "none"),
        help="ncu's clock control: base (locked, its default) or none (the GPU's own "
        "boost and power management; the SM Frequency row then says what it ran at)",
    )
    ap.add_argument("--run", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.run:
        child(a.T, a.H, a.topk)
        return 0
    from sparse_mla import profile as prof

    os.makedirs(a.out, exist_ok=True)
    cmd = [prof.ncu_path(), "--target-processes", "all", "--nvtx", "--nvtx-include", "profiled/",
           "--print-units", "base", "--csv", "--page", "details",
           "--clock-control", a.clock_control]  # fmt: skip
    for s in SECTIONS:
        cmd += ["--section", s]
    cmd += [sys.executable, __file__, "--run", "-T", str(a.T), "-H", str(a.H),
            "--topk", str(a.topk)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    path = os.path.join(a.out, f"glm_h{a.H}_T{a.T}_clock_{a.clock_control}_sections.csv")
    with open(path, "w") as f:
        f.write(done.stdout)
    print(done.stderr[-3000:])
    print(json.dumps({"ncu_exit": done.returncode, "csv": path,
                      "lines": len(done.stdout.splitlines())}))  # fmt: skip
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
