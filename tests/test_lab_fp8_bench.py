"""The workbook's FP8 bench figure (notebook 06, section 7) on CPU, from CSVs a test writes: a
synthetic run with known numbers, an empty or bf16-only CSV, and a real CPU run's rows."""

from __future__ import annotations

import pytest
from matplotlib.figure import Figure

from sparse_mla import bench
from sparse_mla.lab import fp8_bench as fb

T = 16384
NNZ = 1_000_000
WS = 20_000  # peer (a)'s workspace rows
OLD, NEW = "2026-01-01T00:00:00+00:00", "2026-02-01T00:00:00+00:00"


def _row(run, provider, H, ms, *, T=T, slot=584, ok=True, note=None, kernel=None, **cfg):
    timed = ok and ms is not None
    config = {"slot_bytes": slot, **cfg}
    if kernel:
        config["kernel"] = kernel
    return {
        "timestamp": run, "device": "NVIDIA H200", "torch": "2.11", "triton": "3.6",
        "commit": "a" * 40, "workload": f"csa_h{H}_topk512", "T": T, "H": H, "D": 512,
        "topk": 512, "nnz": NNZ, "provider": provider, "config": config, "ok": ok,
        "rel_l2": 1e-3, "ms": ms if timed else None,
        "gather_tbs": NNZ * slot / (ms * 1e-3) / 1e12 if timed else None, "note": note,
    }  # fmt: skip


# fp8_default / peer (a) / bf16 times (ms) per H: H=8 meets 0.6 vs peer (a) and 0.7 vs bf16;
# H=64 misses 1.0 vs peer (a); H=128's peer (a) failed its check.
TIMES = {8: (1.0, 2.0, 1.5), 64: (2.6, 2.5, 2.3), 128: (7.0, None, 7.2)}


def _synthetic_rows():
    rows = [_row(OLD, "fp8_default", 8, 9.0, kernel="triton_fp8")]  # an older run
    rows.append({"timestamp": NEW, "provider": "ceiling:gather_64MiB", "ok": True,
                 "gather_tbs": 6.0, "config": {"pool_bytes": 64 << 20}})  # fmt: skip
    for H, (d, a, b) in TIMES.items():
        peer = "flashmla_pad64_fp8ws" if H < 64 else "flashmla_fp8ws"
        rows += [
            _row(NEW, "fp8_default", H, d, kernel="gluon_ws_small_fp8"),
            _row(NEW, "fp8_gluon_ws_small_fp8", H, d * 1.01, kernel="gluon_ws_small_fp8"),
            _row(NEW, peer, H, a if a else 1.0, slot=1024, ok=a is not None,
                 note=None if a else "tokens [0, 128): wrong", workspace_rows=WS),
            _row(NEW, "bf16_default_dequant", H, b, slot=1024, kernel="gluon_ws"),
            _row(NEW, "fp8_triton_fp8", H, None, kernel="triton_fp8",
                 note="not timed: one call took 40 ms, more than 10x the fastest"),
        ]  # fmt: skip
    rows.append(_row(NEW, "fp8_default", 16, 0.02, T=256, kernel="gluon_ws_small_fp8"))
    return rows


@pytest.fixture
def csv_rows(tmp_path):
    path = tmp_path / "nvidia-h200_fp8.csv"
    bench.append_rows(path, _synthetic_rows())
    return bench.read_rows(path)


def test_table_reads_the_latest_run_and_judges_the_goals(csv_rows):
    assert fb.fp8_run(csv_rows) == NEW
    table = fb.fp8_table(csv_rows)
    assert [(p["T"], p["H"]) for p in table] == [(T, 8), (T, 64), (T, 128), (256, 16)]
    by = {(p["T"], p["H"]): p for p in table}
    h8, h64, h128 = by[(T, 8)], by[(T, 64)], by[(T, 128)]
    assert h8["peer_a"] == "flashmla_pad64_fp8ws" and h64["peer_a"] == "flashmla_fp8ws"
    assert h8["vs_peer_a"] == pytest.approx(0.5) and h8["vs_bf16"] == pytest.approx(1 / 1.5)
    assert h8["goals"] == {"vs_peer_a": 0.6, "vs_bf16": 0.7}
    assert h8["meets"] == {"vs_peer_a": True, "vs_bf16": True}
    assert h64["goals"] == {"vs_peer_a": 1.0} and h64["meets"] == {"vs_peer_a": False}
    assert h128["peer_a_ms"] is None and h128["vs_peer_a"] is None
    assert h128["meets"] == {"vs_peer_a": False}  # no time to compare: not met
    assert by[(256, 16)]["goals"] == {}  # the goals are stated at T=16384 only
    provs = h8["providers"]
    assert provs["fp8_default"]["slot_bytes"] == 584
    assert provs["bf16_default_dequant"]["slot_bytes"] == 1024
    # peer (a): its workspace's fill (584 read + 1024 written a row) spread over the slots
    assert provs["flashmla_pad64_fp8ws"]["slot_bytes"] == pytest.approx(1024 + WS * 1608 / NNZ)
    assert provs["fp8_triton_fp8"]["ms"] is None and provs["fp8_triton_fp8"]["ok"]
    assert provs["fp8_default"]["gather_tbs"] == pytest.approx(NNZ * 584 / 1e-3 / 1e12)
    assert fb.fp8_table(csv_rows, OLD)[0]["default_ms"] == 9.0
    with pytest.raises(ValueError, match="no FP8 rows in run"):
        fb.fp8_table(csv_rows, "2030-01-01")


def _bars(ax):
    return [round(p.get_height(), 6) for p in ax.patches]


def test_figure_draws_bytes_and_tbs_per_head_count(csv_rows):
    fig = fb.fp8_figure(csv_rows)
    assert isinstance(fig, Figure)
    ax_b, ax_t, ax_r = fig.axes[:3]
    assert [t.get_text() for t in ax_b.get_xticklabels()] == ["H=8", "H=64", "H=128"]
    # (a) bytes a slot: 584 for each FP8 kernel, 1024 for bf16, 1024 + workspace for peer (a)
    heights = _bars(ax_b)
    assert heights.count(584) == 3 * 3  # fp8_default, fp8_gluon_ws_small_fp8, fp8_triton_fp8
    assert heights.count(1024) == 3 and heights.count(round(1024 + WS * 1608 / NNZ, 6)) == 3
    # (b) TB/s: each timed provider's gather_tbs; untimed and failed ones at 0 with a mark
    tbs = _bars(ax_t)
    assert round(NNZ * 584 / 1e-3 / 1e12, 6) in tbs  # fp8_default at H=8: 0.584 TB/s
    assert round(NNZ * 1024 / 2e-3 / 1e12, 6) in tbs  # peer (a) at H=8
    texts = [t.get_text() for t in ax_t.texts]
    assert texts.count("n/t") == 3 and texts.count("FAIL") == 1
    assert any("gather ceiling 64MiB" in t for t in texts)
    # (c) fp8_default / peer (a) and / bf16, per H
    ratios = _bars(ax_r)
    assert round(0.5, 6) in ratios and round(2.6 / 2.5, 6) in ratios
    assert "gluon_ws_small_fp8" in ax_r.get_xticklabels()[0].get_text()
    assert f"NVIDIA H200, run {NEW}, commit aaaaaaaaaa" in fig._suptitle.get_text()
    with pytest.raises(ValueError, match="T=4096"):
        fb.fp8_figure(csv_rows, T=4096)


def test_summary_lines(csv_rows):
    lines = fb.fp8_summary(csv_rows)
    assert len(lines) == 4
    assert "0.50x flashmla_pad64_fp8ws (goal <= 0.6: met)" in lines[0]
    assert "(goal <= 1: MISSED)" in lines[1]
    assert "no flashmla_fp8ws time" in lines[2]
    assert "goal" not in lines[3]  # T=256


def test_no_fp8_rows_is_handled(tmp_path):
    assert fb.fp8_table([]) == [] and fb.fp8_run([]) is None
    assert fb.fp8_summary([]) == ["no FP8 rows"]
    with pytest.raises(ValueError, match="no FP8 rows"):
        fb.fp8_figure([])
    # a bf16 bench CSV (no FP8 providers) holds no FP8 run
    path = tmp_path / "bf16.csv"
    bf16 = [_row(NEW, p, 8, 1.0, slot=1024) for p in ("default", "gluon_ws", "flashmla_pad64")]
    bench.append_rows(path, bf16)
    assert fb.fp8_table(bench.read_rows(path)) == []


def test_a_cpu_run_draws(tmp_path):
    # The rows the bench writes (CPU: fp8_default, bf16_default_dequant, the Triton FP8 kernel)
    # are the ones the figure reads.
    path = tmp_path / "fp8.csv"
    bench.run_fp8(heads=[8], tokens=[8], device="cpu", quick=True, ceilings=False,
                  providers=["fp8_default", "bf16_default_dequant"], out_path=path,
                  log=None)  # fmt: skip
    rows = bench.read_rows(path)
    (pt,) = fb.fp8_table(rows)
    assert pt["default_kernel"] == "triton_fp8" and pt["vs_bf16"] > 0
    assert pt["providers"]["fp8_default"]["slot_bytes"] == 584
    fig = fb.fp8_figure(rows, T=8)
    assert sorted(set(_bars(fig.axes[0]))) == [584, 1024]


def test_peer_b_rows_are_read_and_ratioed(tmp_path):
    # A run with peer (b) (FlashMLA's sparse FP8 decode over the prefill tokens): its rows are
    # FP8 rows, drawn under one label, and fp8_default's ratio to it is in the table and lines.
    rows = [
        _row(NEW, "fp8_default", 8, 1.0, kernel="gluon_ws_small_fp8"),
        _row(NEW, "flashmla_pad64_fp8ws", 8, 2.0, slot=1024, workspace_rows=WS),
        _row(NEW, "flashmla_pad64_fp8decode", 8, 4.0),
        _row(NEW, "bf16_default_dequant", 8, 1.5, slot=1024, kernel="gluon_ws_small"),
    ]
    path = tmp_path / "fp8.csv"
    bench.append_rows(path, rows)
    got = bench.read_rows(path)
    assert all(fb.is_fp8_row(r) for r in got)
    (pt,) = fb.fp8_table(got)
    assert pt["peer_b"] == "flashmla_pad64_fp8decode" and pt["peer_b_ms"] == 4.0
    assert pt["vs_peer_b"] == pytest.approx(0.25) and pt["vs_peer_a"] == pytest.approx(0.5)
    (line,) = fb.fp8_summary(got)
    assert "0.25x flashmla_pad64_fp8decode" in line and "0.50x flashmla_pad64_fp8ws" in line
    assert isinstance(fb.fp8_figure(got), Figure)
    # a run without peer (b) says nothing of it
    (old,) = fb.fp8_summary([r for r in got if not r["provider"].endswith("_fp8decode")])
    assert "fp8decode" not in old and "peer (b)" not in old
