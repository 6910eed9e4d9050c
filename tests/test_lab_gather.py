"""The H <= 16 gather-bandwidth view (sparse_mla/lab/gather.py) on the committed CSVs."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparse_mla import bench
from sparse_mla.lab import gather

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "data/bench/nvidia-h200.csv"
VARIANTS = ROOT / "data/bench/ws_small_variants_h200.csv"


@pytest.fixture(scope="module")
def summary():
    return bench.run_summary(bench.read_rows(BENCH))


def test_rates_are_gathered_bytes_over_time(summary):
    rs = gather.rates(summary, gather.read_variants(VARIANTS))
    work = summary["workloads"]
    assert {r.workload for r in rs} == {n for n, w in work.items() if w["H"] <= 16}
    for r in rs:
        if r.source.startswith("bench"):
            ms = work[r.workload]["ms"][r.variant]
            assert r.ms == ms
            assert r.tbs == pytest.approx(work[r.workload]["bytes"] / (ms * 1e-3) / 1e12)
    # The probe's rows: ms x TB/s in the CSV is the gathered volume (10.2 GB CSA, 32.2 GB GLM).
    for row in gather.read_variants(VARIANTS):
        assert float(row["ms"]) * float(row["gather_tbs"]) == pytest.approx(
            float(row["gathered_gb"]), rel=0.01
        )
        assert float(row["gathered_gb"]) == pytest.approx(
            work[row["workload"]]["bytes"] / 1e9, rel=1e-3
        )
    # A variant the probe timed twice is drawn once; bench providers are not overridden.
    keys = [(r.workload, r.variant) for r in rs]
    assert len(keys) == len(set(keys))
    probe = {r.variant for r in rs if r.source.startswith("probe")}
    assert {"gather_only", "math_only", "base", "dl"} <= probe and "gluon" not in probe


def test_run_summary_carries_the_gather_ceilings(summary):
    tbs = summary["gather_tbs"]
    assert 16 * 2**20 in tbs and 64 * 2**20 in tbs
    # L2-resident pools gather faster than HBM-sized ones.
    assert tbs[16 * 2**20] > tbs[max(tbs)]


def test_limits_table_orders_by_time_and_names_every_variant(summary):
    rs = gather.rates(summary, gather.read_variants(VARIANTS))
    rows = gather.limits_table(rs, summary)
    assert len(rows) == len(rs)
    for name in {r.workload for r in rs}:
        ms = [float(row[2]) for row in rows if row[0] == name]
        assert ms == sorted(ms)
    assert all(row[6] != "-" for row in rows), "a variant without a LIMITS entry"
    ceil = summary["gather_tbs"][16 * 2**20]
    row = next(row for row in rows if row[1].startswith("H<=16 kernel (hopper_ws_small"))
    assert row[4] == f"{float(row[3]) / ceil:.0%}"


def test_gather_figure_draws_one_panel_per_workload(summary):
    rs = gather.rates(summary, gather.read_variants(VARIANTS))
    fig = gather.gather_figure(rs, summary)
    axes = fig.get_axes()
    assert len(axes) == len({r.workload for r in rs})
    bars = sum(len(ax.patches) for ax in axes)
    assert bars == len(rs)
    with pytest.raises(ValueError, match="no H <= 16"):
        gather.gather_figure([], summary)


def test_read_variants_rejects_a_foreign_csv(tmp_path):
    bad = tmp_path / "x.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="columns"):
        gather.read_variants(bad)
