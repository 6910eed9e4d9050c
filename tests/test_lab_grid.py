"""The H x T grid of a bench run (lab.grid, notebook 06 section 6), from synthetic rows."""

from __future__ import annotations

import math
from pathlib import Path

import nbformat
import pytest
from matplotlib.figure import Figure

from sparse_mla import bench
from sparse_mla.lab import figures, grid

RUN = "2026-12-02T10:00:00+00:00"
OLD = "2026-12-01T10:00:00+00:00"
COMMON = {"device": "NVIDIA H200", "torch": "2.11", "triton": "3.6.0", "commit": "feedbeef" * 5}
FAIL = None  # a provider's time: it ran and failed its check

# (H, T): ({provider: ms or FAIL}, the kernel default ran). Kernels have arbitrary names; torch
# and aiter are fastest everywhere and must never count as package kernels.
POINTS = {
    (4, 64): ({"default": 0.6, "zz_a": 0.6, "kern_b": 0.9, "flashmla_pad64": 1.0}, "zz_a"),
    (4, 256): ({"default": 0.8, "kern_b": 0.8, "zz_a": 0.7, "flashmla_pad64": 1.0}, "kern_b"),
    (4, 1024): ({"default": 0.5, "zz_a": 0.5, "flashmla_pad64": 1.0}, "zz_a"),  # T > 256
    (4, 4096): ({"zz_a": 5.0, "flashmla_pad64": 4.0}, None),  # no default row: missing
    # two FlashMLA paddings: the faster counts; default exactly 1.05 x the fastest kernel
    (48, 64): ({"default": 1.05, "zz_a": 1.0, "flashmla_pad64": 1.4, "flashmla_pad128": 1.2},
               "zz_a"),
    (48, 256): ({"default": 0.75, "zz_a": 0.74, "flashmla_pad64": 1.0}, "zz_a"),  # moonshot edge
    # (48, 4096): no rows at all
    (64, 64): ({"default": 1.1, "kern_b": 1.1, "zz_a": 1.5, "flashmla": 1.0}, "kern_b"),
    (64, 4096): ({"default": 2.0, "kern_b": 2.0, "flashmla": FAIL}, "kern_b"),
    (96, 256): ({"default": FAIL, "zz_a": 1.0, "flashmla_pad128": 1.5}, "zz_a"),
    (1, 64): ({"default": FAIL, "kern_b": 0.5, "flashmla_pad64": 1.0}, "kern_b"),
}  # fmt: skip
# (meets_flashmla, meets_kernel, moonshot, status) per point
EXPECTED = {
    (4, 64): (True, True, True, "ok"),
    (4, 256): (True, False, False, "ok"),
    (4, 1024): (True, True, None, "ok"),
    (4, 4096): (None, None, None, "missing"),
    (48, 64): (True, True, False, "ok"),
    (48, 256): (True, True, True, "ok"),
    (64, 64): (False, True, None, "ok"),
    (64, 4096): (None, True, None, "ok"),
    (96, 256): (False, False, None, "failed"),
    (1, 64): (False, False, False, "failed"),
}


def _rows(ts: str = RUN, points=POINTS) -> list[dict]:
    out = [
        {**COMMON, "timestamp": ts, "provider": "ceiling:matmul_bf16", "ok": True,
         "tflops": 700.0, "config": {"M": 8192}},
        {**COMMON, "timestamp": ts, "provider": "ceiling:gather_64MiB", "ok": True,
         "gather_tbs": 6.0, "config": {"pool_bytes": 64 << 20}},
    ]  # fmt: skip
    for (H, T), (times, kernel) in points.items():
        base = {**COMMON, "timestamp": ts, "workload": f"csa_h{H}_topk512", "T": T, "H": H,
                "D": 512, "topk": 512, "nnz": T * 640, "pool_bytes": 20 << 20}  # fmt: skip
        for prov, ms in {**times, "torch": 0.01, "aiter": 0.01}.items():
            row = {**base, "provider": prov, "config": {"x": 1}}
            if prov == "default":
                row["config"] = {"kernel": kernel, "BLOCK_K": 64}
            if ms is FAIL:  # a time on a failed row (the bench writes none) never counts
                row.update(ok=False, ms=0.001, note="rel_l2 3e-2 above the tolerance")
            else:
                row.update(ok=True, ms=ms)
            out.append(row)
    glm = {**COMMON, "timestamp": ts, "workload": "glm_h16_topk2048", "T": 16384, "H": 16,
           "D": 512, "topk": 2048, "nnz": 16384 * 2048, "pool_bytes": 1 << 30}  # fmt: skip
    out += [{**glm, "provider": "default", "ok": True, "ms": 3.0, "config": {"kernel": "zz_a"}},
            {**glm, "provider": "flashmla_pad64", "ok": True, "ms": 2.0, "config": {}}]  # fmt: skip
    return out


@pytest.fixture
def rows(tmp_path):
    """Two runs through the bench's own CSV writer and reader (the old one slower everywhere)."""
    old = {k: ({p: (2 * v if v else v) for p, v in t.items()}, kern) for k, (t, kern) in
           POINTS.items()}  # fmt: skip
    path = tmp_path / "grid.csv"
    bench.append_rows(path, _rows(OLD, old))
    bench.append_rows(path, _rows(RUN))
    return bench.read_rows(path)


def _by_cell(table):
    return {(p["H"], p["T"]): p for p in table}


def test_package_kernels_are_whatever_is_not_a_peer_or_baseline():
    for name in ("triton", "gluon_ws_small", "zz_a", "kern_b"):
        assert grid.is_package_kernel(name), name
    for name in ("default", "torch", "aiter", "flashmla", "flashmla_pad64", "flashmla_pad128",
                 "ceiling:matmul_bf16", "", None):  # fmt: skip
        assert not grid.is_package_kernel(name), name


def test_run_is_the_one_run_summary_picks(rows):
    assert grid.grid_run(rows) == RUN == bench.run_summary(rows)["run"]
    assert grid.grid_run(rows, OLD) == OLD
    with pytest.raises(ValueError, match="no run"):
        grid.grid_table(rows, "1999-01-01")
    with pytest.raises(ValueError, match="no workload rows"):
        grid.grid_run([r for r in rows if not r.get("workload")])


def test_table_values(rows):
    table = grid.grid_table(rows)
    cells = _by_cell(table)
    assert set(cells) == set(POINTS)  # (48, 4096) had no rows; the GLM point is not CSA
    assert [(p["H"], p["T"]) for p in table] == sorted(POINTS)
    p = cells[(4, 256)]
    assert p["workload"] == "csa_h4_topk512" and p["topk"] == 512
    assert p["default_ms"] == 0.8 and p["default_kernel"] == "kern_b"
    assert p["best_kernel"] == "zz_a" and p["best_kernel_ms"] == 0.7  # not torch, aiter, default
    assert p["kernels"] == {"zz_a": 0.7, "kern_b": 0.8}
    assert p["flashmla"] == "flashmla_pad64" and p["flashmla_ms"] == 1.0
    assert p["vs_flashmla"] == pytest.approx(0.8)
    assert p["vs_best_kernel"] == pytest.approx(0.8 / 0.7)
    p = cells[(48, 64)]  # the faster of two paddings
    assert p["flashmla"] == "flashmla_pad128" and p["vs_flashmla"] == pytest.approx(1.05 / 1.2)
    p = cells[(64, 4096)]  # FlashMLA failed its check: nothing to compare with
    assert p["flashmla"] is None and p["vs_flashmla"] is None and p["vs_best_kernel"] == 1.0
    old = _by_cell(grid.grid_table(rows, OLD))
    assert old[(4, 256)]["default_ms"] == 1.6 and old[(4, 256)]["best_kernel_ms"] == 1.4


@pytest.mark.parametrize("cell", sorted(EXPECTED), ids=lambda c: f"H{c[0]}_T{c[1]}")
def test_goal_flags(rows, cell):
    p = _by_cell(grid.grid_table(rows))[cell]
    got = (p["meets_flashmla"], p["meets_kernel"], p["moonshot"], p["status"])
    assert got == EXPECTED[cell]


def test_failed_and_missing_points(rows):
    cells = _by_cell(grid.grid_table(rows))
    failed = cells[(96, 256)]
    assert failed["status"] == "failed" and failed["default_ms"] is None
    assert failed["default_kernel"] == "zz_a" and "tolerance" in failed["note"]
    assert failed["vs_flashmla"] is None and failed["flashmla_ms"] == 1.5
    missing = cells[(4, 4096)]
    assert missing["default_ms"] is None and missing["default_kernel"] is None
    assert missing["best_kernel"] == "zz_a" and missing["flashmla_ms"] == 4.0


def test_family_selects_other_workloads(rows):
    (p,) = grid.grid_table(rows, family="glm")
    assert (p["workload"], p["H"], p["T"]) == ("glm_h16_topk2048", 16, 16384)
    assert p["vs_flashmla"] == pytest.approx(1.5) and p["meets_flashmla"] is False
    assert p["best_kernel"] is None and p["meets_kernel"] is None


def test_summary_counts_and_worst(rows):
    text = grid.grid_summary(rows)
    lines = text.splitlines()
    assert RUN in lines[0] and "feedbee" in lines[0] and "10 csa points" in lines[0]
    assert lines[1].startswith("default <= FlashMLA: 5 of 8 points; worst 1.100 at H=64 T=64 ")
    assert lines[1].endswith("(2 failed)")
    assert lines[2].startswith("default <= 1.05 x fastest package kernel: 6 of 9 points; "
                               "worst 1.143 at H=4 T=256")  # fmt: skip
    assert "default ran kern_b, fastest zz_a" in lines[2]
    assert "moonshot" in lines[3] and ": 2 of 5 points; worst 0.875 at H=48 T=64" in lines[3]
    assert any(ln.startswith("default failed its check at: H=1 T=64") and "H=96 T=256" in ln
               for ln in lines)  # fmt: skip
    assert any(ln.startswith("no default row at: H=4 T=4096") for ln in lines)
    assert "default ran: zz_a at 5 points, kern_b at 4 points" in lines
    # the misses (failed defaults included) split by whether a package kernel beats FlashMLA:
    # at H=96 T=256 and H=1 T=64 one does (zz_a 1.0 against 1.5, kern_b 0.5 against 1.0), at
    # H=64 T=64 none (kern_b 1.1 against 1.0)
    miss = next(ln for ln in lines if ln.startswith("default misses the FlashMLA goal"))
    assert miss.startswith("default misses the FlashMLA goal at 3 points: a package kernel is "
                           "at or under FlashMLA at 2 of them")  # fmt: skip
    assert (
        "H=96 T=256 (csa_h96_topk512): zz_a" in miss and "H=1 T=64 (csa_h1_topk512): kern_b" in miss
    )
    assert miss.endswith(", at 1 none (the kernels' gap)")
    # the choice judged by the forced rows: kern_b at H=4 T=256 (0.8 against zz_a's 0.7); at
    # H=48 T=64 default read 1.05 but the kernel it ran, forced, is the fastest (1.0)
    choice = next(ln for ln in lines if ln.startswith("the kernel default ran"))
    assert ": 6 of 7 points; worst 1.143 at H=4 T=256" in choice
    assert choice.endswith("ran kern_b, fastest zz_a")
    by = _by_cell(grid.grid_table(rows))
    assert by[(48, 64)]["choice_vs_best"] == 1.0 and by[(96, 256)]["choice_vs_best"] is None
    assert "2026-12-01" in grid.grid_summary(rows, OLD).splitlines()[0]


def test_worst_points_and_cells(rows):
    table = grid.grid_table(rows)
    worst = grid.worst_points(table, 4)
    assert [(p["H"], p["T"]) for p in worst] == [(1, 64), (96, 256), (64, 64), (48, 64)]
    by_kernel = grid.worst_points(table, 3, by="vs_best_kernel")
    assert [(p["H"], p["T"]) for p in by_kernel] == [(1, 64), (96, 256), (4, 256)]
    header, cells = grid.table_cells(worst)
    assert header == list(grid.TABLE_COLUMNS)
    row = dict(zip(header, cells[2], strict=True))
    assert row["vs_flashmla"] == "1.100" and row["default_ms"] == "1.1"
    assert row["meets_flashmla"] == "no" and row["meets_kernel"] == "yes"
    assert row["moonshot"] is None
    assert "failed" in figures.html_table(cells, header)


def _panels(fig):
    """The heatmap axes (the ones with an image and an x label), top to bottom."""
    return [ax for ax in fig.get_axes() if ax.images and ax.get_xlabel()]


def test_heatmaps(rows):
    fig = grid.grid_heatmaps(rows)
    assert isinstance(fig, Figure)
    panels = _panels(fig)
    assert [ax.get_title()[:3] for ax in panels] == ["(a)", "(b)", "(c)"]
    heads, tokens = ["1", "4", "48", "64", "96"], ["64", "256", "1024", "4096"]
    for ax in panels:
        assert ax.get_xlabel() == "query heads H (per GPU)" and ax.get_ylabel() == "tokens T"
        assert [t.get_text() for t in ax.get_xticklabels()] == heads
        assert [t.get_text() for t in ax.get_yticklabels()] == tokens
        bottom, top = ax.get_ylim()
        assert bottom < top  # T grows upward
    a, b, c = (ax.images[0].get_array() for ax in panels)
    # rows are T (64, 256, 1024, 4096), columns H (1, 4, 48, 64, 96)
    assert a[1, 1] == pytest.approx(0.8) and a[0, 3] == pytest.approx(1.1)
    assert c[1, 1] == pytest.approx(0.8 / 0.7) and c[0, 2] == pytest.approx(1.05)
    for x, y in ((2, 3), (1, 3), (4, 1), (0, 0), (3, 3)):  # no rows, no default, failed x2, no FM
        assert a.mask[y, x], (x, y)
    assert not a.mask[1, 2] and a[2, 1] == pytest.approx(0.5)
    texts = {t.get_text() for t in panels[0].texts}
    assert {"0.80", "1.10", "0.60"} <= texts and "failed" in texts
    norm = panels[0].images[0].norm
    assert math.isclose(norm.vmin * norm.vmax, 1.0)  # centred at 1.0 on the log scale
    legend = panels[1].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["kern_b", "zz_a"]
    assert b[1, 1] == 0 and b[0, 2] == 1 and b.mask[3, 1]  # kern_b, zz_a, no default row
    assert b[1, 4] == 1  # a failed default still names the kernel it ran
    assert any(p.get_label() == "moonshot region" for p in panels[0].patches)
    assert figures.to_png(fig)[:4] == b"\x89PNG"
    assert [ax.get_title()[:3] for ax in _panels(grid.grid_heatmaps(rows, vs_kernel=False))] == [
        "(a)", "(b)"]  # fmt: skip
    old = _panels(grid.grid_heatmaps(rows, OLD))[0].images[0].get_array()
    assert old[1, 1] == pytest.approx(0.8)  # both times doubled: same ratio, from the old run
    assert OLD in grid.grid_heatmaps(rows, OLD).get_suptitle()
    assert RUN in fig.get_suptitle()


def test_heatmaps_need_points(rows):
    with pytest.raises(ValueError, match="no hca_"):
        grid.grid_heatmaps(rows, family="hca")


# ----------------------------------------------------------------------------------------------
# Notebook 06's section, both branches, without a kernel
# ----------------------------------------------------------------------------------------------

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "06_peers_and_roofline.ipynb"


def _section(grid_csv):
    """Run notebook 06's parameters, imports and grid section with GRID_CSV set; returns the
    namespace, the figures shown and the HTML displayed."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    start = next(i for i, c in enumerate(nb.cells) if "Every shape an engine sends" in c.source)
    # The section runs to the next level-2 heading (section 7, the FP8 figure, has its own).
    end = next((i for i, c in enumerate(nb.cells) if i > start and c.cell_type == "markdown"
                and c.source.lstrip().startswith("## ")), len(nb.cells))  # fmt: skip
    section = [c for c in nb.cells[start:end] if c.cell_type == "code"]
    assert section, "notebook 06 lost its grid section"
    ns: dict = {}
    exec(code[0].source, ns)  # parameters
    assert ns["GRID_CSV"].name == "nvidia-h200_grid.csv"
    ns["GRID_CSV"] = grid_csv
    exec(code[1].source, ns)  # imports
    shown, displayed = [], []
    ns["show"], ns["display"] = shown.append, displayed.append
    for c in section:
        exec(c.source, ns)
    return ns, shown, displayed


def test_notebook_section_draws_a_grid_csv(tmp_path, capsys):
    path = tmp_path / "grid.csv"
    bench.append_rows(path, _rows(OLD))
    bench.append_rows(path, _rows(RUN))
    _, shown, displayed = _section(path)
    out = capsys.readouterr().out
    assert "default <= FlashMLA: 5 of 8 points" in out and "1 glm points" in out
    assert len(shown) == 1 and len(_panels(shown[0])) == 3
    html = "".join(h.data for h in displayed)
    assert "the 10 worst points by default / FlashMLA" in html and "csa_h64_topk512" in html


def test_notebook_section_skips_without_the_csv(tmp_path, capsys):
    ns, shown, displayed = _section(tmp_path / "absent.csv")
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "does not exist" in out[0]
    assert ns["grid_rows"] is None and not shown and not displayed
