#!/usr/bin/env python3
"""Write the tidy CSV forms of the warp-specialised kernel's step logs, which notebook 07 reads
(``sparse_mla.lab.pipeline.read_steps_csv``): ``data/bench/ws_probe_steps_h200.csv`` from
``ws_probe_steps_h200.log`` and ``ws_variants_steps_h200.csv`` from ``ws_variants_h200.log``.
Run once after a probe appends to a log; ``tests/test_lab_pipeline.py`` checks that each CSV
holds exactly what its log says.

    python scripts/steps_csv.py [--bench data/bench]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from sparse_mla.lab import pipeline as pl

PAIRS = (
    ("ws_probe_steps_h200.log", "ws_probe_steps_h200.csv", pl.read_steps),
    ("ws_variants_h200.log", "ws_variants_steps_h200.csv", pl.read_variant_runs),
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--bench", type=Path, default=Path(__file__).resolve().parents[1] / "data" / "bench"
    )
    a = ap.parse_args()
    for log, out, read in PAIRS:
        runs = read(a.bench / log)
        pl.write_steps_csv(runs, a.bench / out)
        print(f"{a.bench / out}: {len(runs)} runs from {log}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
