"""The bench summary and its figures, from a small CSV written by the bench's own writer."""

from __future__ import annotations

import pytest

from sparse_mla import bench
from sparse_mla.lab import figures, roofline

RUN = "2026-11-30T10:00:00+00:00"
OLD = "2026-11-01T10:00:00+00:00"
COMMON = {"device": "NVIDIA H200", "torch": "2.11", "triton": "3.6.0", "commit": "c0ffee" * 6}
MATMUL_TFLOPS, GATHER_TBS = 800.0, 6.0


def _rows(ts=RUN):
    out = [
        {**COMMON, "timestamp": ts, "provider": "ceiling:matmul_bf16", "ok": True,
         "tflops": MATMUL_TFLOPS, "config": {"M": 8192}},
        {**COMMON, "timestamp": ts, "provider": "ceiling:gather_64MiB", "ok": True,
         "gather_tbs": GATHER_TBS, "config": {"pool_bytes": 64 << 20}},
        {**COMMON, "timestamp": ts, "provider": "ceiling:gather_1GiB", "ok": True,
         "gather_tbs": 4.0, "config": {"pool_bytes": 1 << 30}},
    ]  # fmt: skip
    for name, H, nnz, times in (
        ("csa_h16_topk512", 16, 10_000_000, {"triton": 2.4, "gluon": 4.0, "flashmla_pad64": 2.41}),
        ("csa_h128_topk1024", 128, 16_000_000, {"gluon": 14.4, "flashmla": 8.2, "aiter": 24.1}),
    ):
        flops, nbytes = bench.work_model(nnz, H, 512)
        floor = max(flops / (MATMUL_TFLOPS * 1e12), nbytes / (GATHER_TBS * 1e12)) * 1e3
        base = {**COMMON, "timestamp": ts, "workload": name, "T": 16384, "H": H, "D": 512,
                "topk": 512, "nnz": nnz, "floor_ms": floor, "pool_bytes": 20 << 20}  # fmt: skip
        for prov, ms in times.items():
            out.append({**base, "provider": prov, "ok": True, "ms": ms, "config": {"x": 1}})
        out.append({**base, "provider": "torch", "ok": False, "note": "wrong"})
    return out


@pytest.fixture
def csv_path(tmp_path):
    path = tmp_path / "bench.csv"
    bench.append_rows(path, _rows(OLD))
    bench.append_rows(path, _rows(RUN))
    return path


def test_run_summary_floors_and_times(csv_path):
    s = bench.run_summary(bench.read_rows(csv_path))
    assert s["run"] == RUN and s["device"] == "NVIDIA H200"
    w16, w128 = s["workloads"]["csa_h16_topk512"], s["workloads"]["csa_h128_topk1024"]
    # H16: gathered bytes at the 64 MiB pool's rate (the smallest measured pool >= 20 MiB).
    assert w16["gather_ms"] == pytest.approx(10_000_000 * 1024 / (GATHER_TBS * 1e12) * 1e3)
    assert w16["matmul_ms"] == pytest.approx(4 * 10_000_000 * 16 * 512 / 800e12 * 1e3)
    # floor_ms went through the CSV, which keeps 6 significant digits.
    assert w16["floor_ms"] == pytest.approx(max(w16["gather_ms"], w16["matmul_ms"]), rel=1e-5)
    assert w128["floor_ms"] == pytest.approx(w128["matmul_ms"], rel=1e-5)
    assert w128["matmul_ms"] > w128["gather_ms"]
    assert w16["ms"] == {"triton": 2.4, "gluon": 4.0, "flashmla_pad64": 2.41}
    assert w128["failed"] == ["torch"] and "torch" not in w128["ms"]
    assert bench.run_summary(bench.read_rows(csv_path), OLD)["run"] == OLD
    with pytest.raises(ValueError, match="no run"):
        bench.run_summary(bench.read_rows(csv_path), "1999-01-01")


def test_figures_render_from_the_csv(csv_path):
    s = bench.run_summary(bench.read_rows(csv_path))
    fig = roofline.floors_figure(s)
    axes = fig.get_axes()
    assert len(axes) == 2
    by_title = {ax.get_title().split()[0]: ax for ax in axes}
    ax = by_title["csa_h128_topk1024"]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["aiter", "gluon", "flashmla"]  # slowest at the bottom, fastest on top
    assert [round(p.get_width(), 3) for p in ax.patches] == [24.1, 14.4, 8.2]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(t.startswith("matmul floor") for t in legend)
    assert "failed the check: torch" in ax.get_xlabel()
    assert figures.to_png(fig)[:4] == b"\x89PNG"
    roof = roofline.roofline_figure(s)
    pts = roof.get_axes()[0].collections
    assert len(pts) == 6  # one point per (workload, provider that passed)
    assert figures.to_png(roof)[:4] == b"\x89PNG"
    header, rows = roofline.summary_table(s)
    assert header[0] == "workload" and header[-1] == "fastest"
    assert [r[-1] for r in rows] == ["triton", "flashmla"]
    md = roofline.summary_markdown(s).splitlines()
    assert md[0] == "| " + " | ".join(header) + " |" and len(md) == 2 + len(rows)
    assert md[3].startswith("| csa_h128_topk1024 | -") and md[3].endswith("| flashmla |")


def test_committed_h200_csv_renders():
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "data" / "bench" / "nvidia-h200.csv"
    s = bench.run_summary(bench.read_rows(path))
    assert len(s["workloads"]) >= 5
    assert figures.to_png(roofline.floors_figure(s))[:4] == b"\x89PNG"
    assert figures.to_png(roofline.roofline_figure(s))[:4] == b"\x89PNG"


def _text_boxes(fig):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig).draw()
    texts = [t for ax in fig.axes for t in ax.texts if t.get_text().strip()]
    texts += [fig._suptitle] + [t for t in fig.texts if t.get_text().strip()]
    texts = list({id(t): t for t in texts}.values())
    return [(t.get_text(), t.get_window_extent()) for t in texts]


def test_roofline_labels_do_not_overlap_and_default_stays_visible(tmp_path):
    # A run with several workloads per head count and `default` equal to a kernel's time.
    rows = _rows()
    extra = []
    for r in rows:
        if r.get("provider") == "gluon":
            extra.append({**r, "provider": "default"})  # the dispatch ran gluon there
            extra.append({**r, "provider": "gluon", "workload": r["workload"] + "_b",
                          "ms": r["ms"] * 1.1})  # fmt: skip
    path = tmp_path / "b.csv"
    bench.append_rows(path, rows + extra)
    summary = bench.run_summary(bench.read_rows(path))
    fig = roofline.roofline_figure(summary)
    boxes = _text_boxes(fig)
    for (ta, a), (tb, b) in __import__("itertools").combinations(boxes, 2):
        assert not a.overlaps(b), (ta, tb)
    ax = fig.axes[0]
    rings = [c for c in ax.collections if c.get_label() == "default"]
    assert rings and (rings[0].get_facecolors().size == 0 or rings[0].get_facecolors()[0][3] == 0)
    assert figures.png_size(figures.to_png(fig))[0] <= figures.MAX_WIDTH_PX
    # The conclusion: per workload, from that workload's own times (never summed).
    lines = roofline.roofline_conclusion(summary)
    assert len(lines) == len(summary["workloads"])
    for name, w in summary["workloads"].items():
        line = next(ln for ln in lines if ln.startswith(name + " "))
        best = min(w["ms"], key=w["ms"].get)
        assert f"{best} {w['ms'][best]:.3f} ms" in line
        assert f"{w['floor_ms'] / w['ms'][best]:.0%} of its floor" in line
