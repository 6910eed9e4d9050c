"""Nsight Compute on gluon_ws and FlashMLA at one grid point, side by side (PERF_NOTES "No
cliffs" step 21: on whole lists at T = 64 with 96-128 heads FlashMLA's tile is 6% shorter).

Builds the point as ``sparse-mla bench --grid`` does (default: whole lists, context 65536,
T = 64, H128, top-k 1024), checks each provider against the fp32 reference, then profiles one
call of each (after warm-up calls, inside an NVTX range of the provider's name) with ncu's
full section set and the warp-stall samples. Prints, per metric of the details page, the two
kernels' values side by side, and each kernel's stall reasons; writes the details and raw
pages as CSV under --out. Run from the repository root on the H200, FlashMLA from .peers:

    PYTHONPATH=.:.peers python3 experiments/tile_rate_ncu.py --out DIR

(``--child`` is the profiled process; ncu runs it.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

PROVIDERS = ("gluon_ws", "flashmla")


def child(args: dict) -> None:
    """The profiled process: each provider checked, warmed up, then one call in its range."""
    import torch

    from sparse_mla import bench

    device = torch.device("cuda")
    pt = bench.GridPoint("dsv4_csa", args["T"], args["H"], bench._grid_topk(args["H"]),
                         args["context"])  # fmt: skip
    w = pt.build(device, big_buffer=True)
    refs = bench._References(w, args["T"])  # every token checked
    for name in args["providers"]:
        p = bench._provider(name, w, device)
        out = torch.full_like(w.args()[0], float("nan"))
        ok, err, note = bench._check(p.run, w, args["T"], refs)
        print(f"{p.name}: check ok={ok} rel_l2={err:.3g} {note} config={p.config}", flush=True)
        if not ok:
            sys.exit(f"{p.name} failed the check: not profiled")
        timed = p.timed or (lambda p=p, out=out: p.run(out))
        for _ in range(3):
            timed()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push(name)
        timed()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()


def side_by_side(details: str) -> str:
    """The details page's metrics, one row each, a column per profiled kernel launch."""
    from sparse_mla import profile as prof

    rows = prof._csv_rows(details)
    if not rows:
        return "(no details rows)"
    head = [c.strip() for c in rows[0]]
    col = {n: head.index(n) for n in ("ID", "Kernel Name", "Section Name", "Metric Name",
                                       "Metric Unit", "Metric Value") if n in head}  # fmt: skip
    if len(col) < 6:
        return f"(unexpected header: {head})"
    kernels: dict[str, str] = {}
    table: dict[tuple[str, str, str], dict[str, str]] = {}
    last = max(col.values())
    for r in rows[1:]:
        # metric rows stop after the value (no rule columns); rule rows name no metric
        if len(r) <= last or not r[col["Metric Name"]].strip():
            continue
        kid = r[col["ID"]]
        kernels.setdefault(kid, r[col["Kernel Name"]][:40])
        key = (r[col["Section Name"]], r[col["Metric Name"]], r[col["Metric Unit"]])
        table.setdefault(key, {})[kid] = r[col["Metric Value"]]
    ids = list(kernels)
    lines = ["launches: " + "; ".join(f"{i}: {kernels[i]}" for i in ids)]
    for (section, metric, unit), vals in table.items():
        cells = "  ".join(f"{vals.get(i, '-'):>14}" for i in ids)
        lines.append(f"{section[:22]:<22} {metric[:44]:<44} {unit[:10]:<10} {cells}")
    return "\n".join(lines)


def stalls(raw: str) -> str:
    """Each launch's warp-stall samples by reason, largest first (the raw page's rows)."""
    from sparse_mla import profile as prof

    out = []
    for name, counts in prof.stalls_by_launch(raw):
        total = sum(counts.values())
        top = sorted(counts.items(), key=lambda kv: -kv[1])[:12]
        out.append(f"{name[:40] or '?'}: {int(total)} samples; " + ", ".join(
            f"{k} {100 * v / total:.1f}%" for k, v in top))  # fmt: skip
    return "\n".join(out) or "(no stall rows)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--T", type=int, default=64)
    ap.add_argument("--H", type=int, default=128)
    ap.add_argument("--context", type=int, default=65536)
    ap.add_argument("--providers", default=",".join(PROVIDERS))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(json.loads(a.child))
        return
    from sparse_mla import profile as prof

    ncu = prof.ncu_path()
    if ncu is None:
        sys.exit("no ncu: put it on PATH or set SPARSE_MLA_NCU")
    os.makedirs(a.out, exist_ok=True)
    providers = a.providers.split(",")
    spec = {"T": a.T, "H": a.H, "context": a.context, "providers": providers}
    report = os.path.join(a.out, "tile_rate")
    ranges = [x for n in providers for x in ("--nvtx-include", f"{n}/")]
    cmd = [ncu, "--target-processes", "all", "--nvtx", *ranges, "--set", "full", "--metrics",
           prof.STALL_GROUP, "--force-overwrite", "--export", report, sys.executable,
           os.path.abspath(__file__), "--out", a.out, "--child", json.dumps(spec)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    print(done.stdout[-3000:], done.stderr[-2000:], sep="\n")
    if done.returncode != 0:
        sys.exit(f"ncu exit {done.returncode}")
    pages = {}
    for page in ("details", "raw"):
        rep = report + ".ncu-rep"
        imp = [ncu, "--import", rep, "--csv", "--print-units", "base", "--page", page]
        r = subprocess.run(imp, capture_output=True, text=True, timeout=120)
        pages[page] = r.stdout
        with open(os.path.join(a.out, f"tile_rate_{page}.csv"), "w") as f:
            f.write(r.stdout)
    print(f"point: dsv4_csa T={a.T} H={a.H} context={a.context}")
    print(side_by_side(pages["details"]))
    print("\nwarp-stall samples:")
    print(stalls(pages["raw"]))


if __name__ == "__main__":
    main()
