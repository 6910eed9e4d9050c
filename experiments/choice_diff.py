"""Which measured points a re-export of the sm90 kernel choice moves, and what each move costs.

For every (workload, T, H) point in the committed sm90 bench CSVs (the grid, its context and
small-T runs, the list-length checks), the kernel ``config=None`` picks under the shipped file
of ``--before`` (a git revision) and under the working tree's, with the point's latest run's
forced time of each; a changed point whose new kernel was timed slower than its old one by more
than ``--tol`` is flagged. CPU only (no kernel runs). After ``pending_gpu_checks.sh STEP=t32``
or any export:

    python experiments/choice_diff.py --before HEAD
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

from sparse_mla import bench, configs, dispatch

ROOT = Path(__file__).resolve().parent.parent
FILE = "sm90/triton/attention/sparse_attention_dsv4/DEFAULT.json"
CSVS = ("grid", "grid_ctx65536", "grid_ctx1024", "grid_ctx256", "grid_ctx64", "grid_small_t",
        "grid_mid_t", "list_length_verify")  # fmt: skip


def latest_points(paths) -> dict[tuple, dict[str, float]]:
    """{(workload, T, H, nnz): {provider: ms}} from each point's latest run."""
    best: dict[tuple, tuple[str, dict[str, float]]] = {}
    for path in paths:
        for r in bench.read_rows(path):
            if not r.get("T") or not r.get("ms") or not r.get("nnz"):
                continue
            key = (r["workload"], int(r["T"]), int(r["H"]), int(r["nnz"]))
            ts = r["timestamp"]
            seen = best.get(key)
            if seen is None or ts > seen[0]:
                best[key] = seen = (ts, {})
            if ts == seen[0]:
                seen[1][r["provider"]] = float(r["ms"])
    return {k: v for k, (_, v) in best.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="HEAD", help="git revision of the file before (HEAD)")
    ap.add_argument("--tol", type=float, default=0.02, help="flag a move slower by more (0.02)")
    args = ap.parse_args()
    old = subprocess.run(["git", "show", f"{args.before}:sparse_mla/tuned/{FILE}"], cwd=ROOT,
                         check=True, capture_output=True, text=True).stdout  # fmt: skip
    paths = [p for n in CSVS if (p := ROOT / "data" / "bench" / f"nvidia-h200_{n}.csv").exists()]
    points = latest_points(paths)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / FILE).parent.mkdir(parents=True)
        (Path(tmp) / FILE).write_text(old)
        moved = flagged = 0
        for (w, T, H, nnz), times in sorted(points.items(), key=lambda kv: kv[0][1:]):
            call = dispatch.Call("sm90", H, 512, num_tokens=T, nnz=nnz)
            before = dispatch.choose(call, root=tmp).kernel
            after = dispatch.choose(call, root=configs.CONFIG_ROOT).kernel
            if before == after:
                continue
            moved += 1
            a, b = times.get(after), times.get(before)
            ratio = f"{a / b:.3f}" if a and b else "not timed"
            bad = bool(a and b and a / b > 1 + args.tol)
            flagged += bad
            print(f"{'SLOWER ' if bad else ''}{w} T={T} H={H} slots/token={nnz // T}: "
                  f"{before} ({b}) -> {after} ({a}), new / old {ratio}")  # fmt: skip
    print(f"{len(points)} points, {moved} moved, {flagged} to a kernel timed slower by more "
          f"than {args.tol:.0%}")  # fmt: skip


if __name__ == "__main__":
    main()
