"""Per-phase clock stamps of one gluon_ws item (each program's first item) at small T.

The variant ``patches/ws_small_call/clk.diff`` (hopper_ws.py at 19799b9 plus ``_stamp`` calls:
%clock64 per partition at each phase, %globaltimer at start/end to convert cycles to us) writes
DBG[program, slot]; this prints the median phase times over programs and 30 L2-flushed runs
(data/bench/ws_clk_h200.log). The stamps themselves add ~1 us to a call (the variant's time is
printed beside the package kernel's). Run from the repository root on the H200:

    git show 19799b9:sparse_mla/gluon/hopper_ws.py > /tmp/base.py
    patch -o runs/ws_clk.py /tmp/base.py < experiments/patches/ws_small_call/clk.diff
    PYTHONPATH=.:.peers python3 experiments/ws_clk_probe.py runs/ws_clk.py
"""

from __future__ import annotations

import os
import statistics
import sys

import torch
from triton.experimental.gluon import language as gl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ws_variants_probe as vp

from sparse_mla import bench

NAMES = {
    0: "P start", 1: "P range back", 2: "P slots0 back", 3: "P pair0 issued",
    4: "P item issued", 5: "P copies landed", 8: "C0 start", 9: "C0 Q ready", 10: "C0 S0 done",
    11: "C0 NB_MAX0", 12: "C0 PVs done", 13: "C0 NB_L", 14: "C0 stores issued", 15: "C0 end",
    16: "C1 start", 17: "C1 Q ready", 18: "C1 S1 done", 19: "C1 end",
}  # fmt: skip
PROGRAMS = 132  # the H200's SMs


def phases(rows, progs, ghz, names=None):
    """Median / p10 / p90 us after the producer's start, per stamp (``names``: slot -> name in
    the order to print; default this probe's slots in order)."""
    for slot, name in (names or dict(sorted(NAMES.items()))).items():
        vals = sorted(
            float(d[p, slot] - d[p, 0]) / ghz / 1e3
            for d in rows
            for p in range(progs)
            if d[p, slot] and d[p, 0]
        )
        if vals:
            med, p10, p90 = (
                statistics.median(vals),
                vals[len(vals) // 10],
                vals[9 * len(vals) // 10],
            )
            print(f"  {name:18s} median {med:6.2f} us  p10 {p10:6.2f}  p90 {p90:6.2f}")


def main():
    mod = vp.load_variant("clk", sys.argv[1] if len(sys.argv) > 1 else "runs/ws_clk.py")
    buf = torch.zeros(PROGRAMS * 32, dtype=torch.int64, device="cuda")
    mod.DBG = gl.constexpr(buf.data_ptr())  # before the first compile
    call = vp.variant_call(mod._prefill_ws_kernel, vp.package_launch(True))
    pkg = vp.variant_call(vp._prefill_ws_kernel)
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    for T, H in [(64, 64), (64, 128), (256, 64)]:
        w, _ = vp.point_workload(T, H)
        out = torch.full_like(w.q, float("nan"))
        call(w, out=out)
        torch.cuda.synchronize()
        rep = vp.check_against_reference(out, *w.args(), attn_sink=w.attn_sink)
        print(f"T{T} H{H} check: {rep.ok}")
        rows = []
        for _ in range(30):
            flush.zero_()
            buf.zero_()
            torch.cuda.synchronize()
            call(w, out=out)
            torch.cuda.synchronize()
            rows.append(buf.view(PROGRAMS, 32).cpu())
        t_clk = statistics.median(
            bench.time_budget(lambda w=w, out=out: call(w, out=out), 40.0) for _ in range(5)
        )
        t_pkg = statistics.median(
            bench.time_budget(lambda w=w, out=out: pkg(w, out=out), 40.0) for _ in range(5)
        )
        progs = min(T * ((H + 63) // 64), PROGRAMS)
        # cycles per ns: consumer 0's clock64 against its globaltimer, start to end
        ghz = statistics.median(
            float(d[p, 15] - d[p, 8]) / float(d[p, 21] - d[p, 20])
            for d in rows
            for p in range(progs)
            if d[p, 21] > d[p, 20]
        )
        print(
            f"T{T} H{H}: programs {progs}; clk variant {t_clk * 1e3:.2f} us, pkg "
            f"{t_pkg * 1e3:.2f} us; clock {ghz:.3f} GHz"
        )
        starts = [int(rows[-1][p, 6]) for p in range(progs)]
        skew = (max(starts) - min(starts)) / 1e3
        print(f"  launch skew (producer start globaltimer): {skew:.2f} us")
        phases(rows, progs, ghz)


if __name__ == "__main__":
    main()
