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


def test_neighbour_overlap_counts_unions_of_valid_slots():
    import torch

    N = 10
    # token 0: 1 2 3 (+ an absent -1), token 1: 2 3 4, token 2: 4 4 (a duplicate), token 3: empty,
    # token 4: 9 and N (absent).
    lists = [[1, 2, 3, -1], [2, 3, 4], [4, 4], [], [9, N]]
    idx = torch.tensor([s for li in lists for s in li])
    ptr = torch.tensor([0, 4, 7, 9, 9, 11])
    by_g = {o.group: o for o in gather.neighbour_overlap(idx, ptr, N, (1, 2, 4, 8), tile=2)}
    assert all(o.rows_sum == 9 for o in by_g.values())  # valid slots, duplicates counted
    # G=1: each token's distinct slots: 3 + 3 + 1 + 0 + 1.
    assert by_g[1].rows_union == 8
    # G=2: {1,2,3,4}, {4}, {9} -> 6; G=4: {1,2,3,4}, {9} -> 5; G=8: {1,2,3,4,9} -> 5.
    assert (by_g[2].rows_union, by_g[4].rows_union, by_g[8].rows_union) == (6, 5, 5)
    assert by_g[8].ratio == pytest.approx(5 / 9)
    # Tiles of 2 rows: per token ceil(3/2)+ceil(3/2)+ceil(2/2)+0+ceil(1/2) = 6; G=2: 2+1+1.
    assert by_g[1].tiles_sum == 6 and by_g[2].tiles_union == 4
    with pytest.raises(ValueError, match="non-decreasing"):
        gather.neighbour_overlap(idx, torch.tensor([0, 4, 3, 9, 9, 11]), N)
    with pytest.raises(ValueError, match=">= 1"):
        gather.neighbour_overlap(idx, ptr, N, (0,))


def test_committed_overlap_csv_matches_the_function_on_a_capture():
    import csv

    from sparse_mla.capture import load_capture

    with (ROOT / "data/bench/neighbour_overlap.csv").open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["source"] == "glm_h8_topk2048_t64"]
    c = load_capture(ROOT / "data/captures/glm_h8_topk2048_t64.safetensors")
    got = gather.neighbour_overlap(c.kv_indices, c.kv_indptr, c.num_kv)
    assert [(int(r["group"]), int(r["rows_union"])) for r in rows] == [
        (o.group, o.rows_union) for o in got
    ]
