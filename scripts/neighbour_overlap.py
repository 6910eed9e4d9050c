"""How much neighbouring tokens' slot lists overlap (issue: small heads, moonshot direction):
for groups of G consecutive tokens, the union of their valid slots against the sum, on the
bench workloads at T = 16384 and on the captures in data/captures/. CPU only, a minute or two:

    python scripts/neighbour_overlap.py --out data/bench/neighbour_overlap.csv

The workloads' top-k choices are synthetic (uniform random subsets), and so are the shipped
captures (their metadata says so): a real indexer's choices for neighbouring tokens may overlap
far more, so these ratios bound what a union-gathering kernel would save from above.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

from sparse_mla import workloads
from sparse_mla.capture import load_capture
from sparse_mla.lab.gather import neighbour_overlap

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = ("csa_h16_topk512", "csa_h16_topk1024", "hca_h16", "glm_h16_topk2048")
# The shipped captures (data/README.md), by name.
CAPTURES = (
    "csa_h16_topk512_t32_ctx4096",
    "csa_h8_topk512_t128_r2",
    "glm_h8_topk2048_t64",
    "hca_h16_t64_ctx8192",
)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=16384)
    args = ap.parse_args()
    rows = []

    def add(source, T, synthetic, idx, ptr, num_kv):
        for o in neighbour_overlap(idx, ptr, num_kv):
            rows.append(
                dict(
                    source=source,
                    T=T,
                    synthetic=synthetic,
                    group=o.group,
                    rows_sum=o.rows_sum,
                    rows_union=o.rows_union,
                    ratio=round(o.ratio, 4),
                    tiles_sum=o.tiles_sum,
                    tiles_union=o.tiles_union,
                    tile_ratio=round(o.tile_ratio, 4),
                )
            )
            print(source, o.group, f"{o.ratio:.3f}", f"{o.tile_ratio:.3f}", flush=True)

    for name in WORKLOADS:
        # H only shapes q: one head keeps memory small; the slot lists are the bench's.
        w = workloads.by_name(name, T=args.tokens, H=1, seed=1)
        add(name, args.tokens, "generated", w.kv_indices, w.kv_indptr, w.kv.shape[0])
    for name in CAPTURES:
        c = load_capture(ROOT / "data/captures" / f"{name}.safetensors")
        label = {True: "synthetic capture", False: "engine capture"}.get(c.synthetic, "unknown")
        add(c.name, c.kv_indptr.numel() - 1, label, c.kv_indices, c.kv_indptr, c.num_kv)
    with open(args.out, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
