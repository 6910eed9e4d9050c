"""The bench grid (``sparse-mla bench --grid``): its points, providers, rows, progress and CLI."""

from __future__ import annotations

import csv
import itertools
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from sparse_mla import bench, cli, dispatch, runtime
from sparse_mla import workloads as wl

GRID_H = (1, 2, 4, 8, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 112, 128)
GRID_T = (64, 256, 1024, 4096, 16384)


def _key(p):
    return (p.workload, p.T, p.H, p.topk)


def test_full_grid_points():
    points = bench.grid_points()
    assert len(points) == 83 == len({_key(p) for p in points})
    csa = [p for p in points if p.kind == "dsv4_csa"]
    glm = [p for p in points if p.kind == "glm_full_topk"]
    assert {(p.T, p.H) for p in csa} == set(itertools.product(GRID_T, GRID_H))
    # Top-k 1024 (V4-Pro) exactly from 96 heads, 512 below.
    for p in csa:
        assert p.topk == (1024 if p.H >= 96 else 512), p
        assert p.workload == f"csa_h{p.H}_topk{p.topk}"
    assert {(p.T, p.H, p.topk) for p in glm} == {(16384, h, 2048) for h in (16, 32, 64)}
    assert [p.workload for p in glm] == ["glm_h16_topk2048", "glm_h32_topk2048", "glm_h64_topk2048"]
    # T-major, short calls first; GLM after the CSA points.
    assert [p.T for p in csa] == sorted(p.T for p in csa)
    assert points[:2] == [bench.GridPoint("dsv4_csa", 64, 1, 512),
                          bench.GridPoint("dsv4_csa", 64, 2, 512)]  # fmt: skip
    assert points[-3:] == glm


def test_restricted_grid_points():
    pts = bench.grid_points([16, 128, 16], [16384])  # a repeated H counts once
    assert [_key(p) for p in pts] == [
        ("csa_h16_topk512", 16384, 16, 512),
        ("csa_h128_topk1024", 16384, 128, 1024),
        ("glm_h16_topk2048", 16384, 16, 2048),
    ]
    assert [p.workload for p in bench.grid_points([16, 128], [16384], glm=False)] == [
        "csa_h16_topk512",
        "csa_h128_topk1024",
    ]
    # GLM points only at its (H, T): none at T 64 or at H 8 / 96.
    pts = bench.grid_points([8, 96], [64, 16384])
    assert [(p.T, p.H, p.topk) for p in pts] == [(64, 8, 512), (64, 96, 1024), (16384, 8, 512),
                                                 (16384, 96, 1024)]  # fmt: skip
    for bad in ([0], [], [True], [2.0]):
        with pytest.raises(ValueError, match="heads"):
            bench.grid_points(bad, [64])
    with pytest.raises(ValueError, match="tokens"):
        bench.grid_points([8], [-1])
    with pytest.raises(ValueError, match="kind"):
        bench.GridPoint("dsv4_hca", 64, 8, 512)


def test_grid_point_builds_the_generators_workload():
    w = bench.GridPoint("dsv4_csa", 40, 96, 1024).build(D=64, seed=3)
    ref = wl.dsv4_csa(40, 96, topk=1024, D=64, seed=3)
    assert w.name == "csa_h96_topk1024_t40" and w.meta["topk"] == 1024
    for a, b in zip(w.args()[:4], ref.args()[:4], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(w.attn_sink, ref.attn_sink)  # sink on by default
    g = bench.GridPoint("glm_full_topk", 30, 16, 2048).build(D=64, sink=False)
    gref = wl.glm_full_topk(30, 16, topk=2048, D=64)
    assert g.name == "glm_h16_topk2048_t30" and g.attn_sink is None
    assert torch.equal(g.kv_indices, gref.kv_indices)
    assert bench.GridPoint("glm_full_topk", 30, 16, 2048).build(D=64).attn_sink is not None


def test_context_points_have_whole_lists():
    # A chunked-prefill / MTP step of a long request: every token's list is whole (top-k +
    # window), where the grid's own points (context 0) grow with the position.
    pts = bench.grid_points([8, 96], [4, 64], glm=False, context=8192)
    assert [(p.workload, p.T, p.context) for p in pts] == [
        ("csa_h8_topk512_ctx8192", 4, 8192), ("csa_h96_topk1024_ctx8192", 4, 8192),
        ("csa_h8_topk512_ctx8192", 64, 8192), ("csa_h96_topk1024_ctx8192", 64, 8192),
    ]  # fmt: skip
    w = pts[2].build(D=64, seed=5)
    ref = wl.dsv4_csa(64, 8, topk=512, context=8192, D=64, seed=5)
    assert w.name == "csa_h8_topk512_ctx8192_t64" and w.meta["context"] == 8192
    for a, b in zip(w.args()[:4], ref.args()[:4], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(w.kv_indptr.diff(), torch.full((64,), 512 + 128, dtype=w.kv_indptr.dtype))
    fresh = bench.GridPoint("dsv4_csa", 64, 8, 512).build(D=64, seed=5)
    assert fresh.kv_indices.numel() < 64 * 100  # the grid's own T = 64: short lists
    with pytest.raises(ValueError, match="glm=False"):
        bench.grid_points([16], [16384], context=8192)
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match="context"):
            bench.GridPoint("dsv4_csa", 64, 8, 512, bad)
    with pytest.raises(ValueError, match="no"):
        bench.GridPoint("glm_full_topk", 64, 16, 2048, 4096)


def test_grid_providers_are_the_registry_default_and_flashmla(monkeypatch):
    assert bench.grid_providers() == (
        *dispatch.KERNELS, "default", "default_dense", "default_dense_len", "flashmla",
    )  # fmt: skip
    # A kernel registered at run time is a provider of the next grid, under its name.
    monkeypatch.setitem(dispatch.KERNELS, "triton_copy",
                        replace(dispatch.KERNELS["triton"], name="triton_copy"))  # fmt: skip
    assert "triton_copy" in bench.grid_providers()
    assert "torch" not in bench.grid_providers() and "aiter" not in bench.grid_providers()


def test_flashmla_aliases_are_one_provider():
    got = bench._chosen_providers(["flashmla_pad128", "triton", "flashmla", "triton"], ())
    assert got == ["flashmla_pad128", "triton"]
    with pytest.raises(ValueError, match="unknown"):
        bench._chosen_providers(["gluon_nope"], ())


def test_budget_reps():
    assert bench.budget_reps(0.1, 40) == 200  # tiny calls stop at the cap
    assert bench.budget_reps(0.5, 40) == 80
    assert bench.budget_reps(25.0, 40) == 5  # long calls still get five samples
    assert bench.budget_reps(1.0, 40, min_reps=3, max_reps=10) == 10
    assert bench.budget_reps(0.0, 40) == bench.BUDGET_MAX_REPS
    assert bench.budget_reps(float("nan"), 40) == bench.BUDGET_MAX_REPS
    with pytest.raises(ValueError, match="budget_ms"):
        bench.budget_reps(1.0, 0)
    with pytest.raises(ValueError, match="min_reps"):
        bench.budget_reps(1.0, 10, min_reps=5, max_reps=4)


def test_run_grid_on_cpu_rows_and_progress(monkeypatch, tmp_path):
    # A kernel registered at run time gets rows; top-k follows H; one line per point.
    monkeypatch.setitem(dispatch.KERNELS, "triton_copy",
                        replace(dispatch.KERNELS["triton"], name="triton_copy"))  # fmt: skip
    out = tmp_path / "grid.csv"
    lines: list[str] = []
    rows = bench.run_grid(heads=[2, 96], tokens=[8], device="cpu", ceilings=False, quick=True,
                          providers=["triton", "triton_copy", "default", "default_dense",
                                     "default_dense_len", "flashmla"],
                          out_path=out, commit="c0ffee", log=lines.append, D=64)  # fmt: skip
    assert [(r["H"], r["topk"], r["provider"]) for r in rows] == [
        (2, 512, "triton"), (2, 512, "triton_copy"), (2, 512, "default"),
        (2, 512, "default_dense"), (2, 512, "default_dense_len"),
        (96, 1024, "triton"), (96, 1024, "triton_copy"), (96, 1024, "default"),
        (96, 1024, "default_dense"), (96, 1024, "default_dense_len"),
    ]  # fmt: skip
    # default_dense: config=None on FlashMLA's [T, K] ids (K the longest list rounded to 128).
    for r in rows:
        if r["provider"].startswith("default_dense"):
            cfg = r["config"]
            lens = " with lengths" if r["provider"] == "default_dense_len" else ""
            assert (cfg["kernel"], cfg["ids"]) == ("triton", f"dense [T, 128]{lens} as they are")
    stamp = rows[0]["timestamp"]
    for r in rows:
        assert r["ok"] is True and r["ms"] > 0 and r["T"] == 8 and r["commit"] == "c0ffee"
        assert r["timestamp"] == stamp and r["workload"] == f"csa_h{r['H']}_topk{r['topk']}"
    point_lines = [ln for ln in lines if ln.startswith("[")]
    assert len(point_lines) == 2
    assert point_lines[1].startswith("[2/2") and "csa_h96_topk1024 T=8:" in point_lines[1]
    for ln, H in zip(point_lines, (2, 96), strict=True):
        for r in (r for r in rows if r["H"] == H):
            assert f"{r['provider']} {r['ms']:.4g}" in ln
        assert "(triton)" in ln and "flashmla -" in ln  # default's kernel; FlashMLA needs sm90
    # FlashMLA's reason is logged once, not at every point.
    assert sum("flashmla: skipped" in ln for ln in lines) == 1
    with out.open(newline="") as f:
        saved = list(csv.DictReader(f))
    assert len(saved) == len(rows)
    for r in saved:
        for col in ("T", "H", "topk", "provider", "ms", "ok", "commit", "timestamp"):
            assert r[col] != "", (col, r)


def test_run_grid_shares_one_reference_per_point(monkeypatch):
    import sparse_mla.reference as reference

    calls = []
    real = reference.sparse_mla_prefill_ref
    monkeypatch.setattr(reference, "sparse_mla_prefill_ref",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))  # fmt: skip
    rows = bench.run_grid(heads=[2], tokens=[6], device="cpu", ceilings=False, quick=True,
                          providers=["triton", "default", "torch"], log=None, D=64)  # fmt: skip
    assert len(rows) == 3 and all(r["ok"] for r in rows)
    assert len(calls) == 2  # fp32 reference + same-dtype baseline, once for three providers


def test_run_grid_failures_are_rows_and_lines(monkeypatch):
    real = bench._provider

    def broken(name, w, device, peers=None):
        p = real(name, w, device, peers)
        if name != "torch":
            return p

        def wrong(out):
            p.run(out)
            out.mul_(2)
            return out

        return replace(p, run=wrong)

    monkeypatch.setattr(bench, "_provider", broken)
    lines: list[str] = []
    rows = bench.run_grid(heads=[2], tokens=[5], device="cpu", ceilings=False, quick=True,
                          providers=["triton", "torch"], log=lines.append, D=64)  # fmt: skip
    by = {r["provider"]: r for r in rows}
    assert by["triton"]["ok"] is True and by["torch"]["ok"] is False
    assert by["torch"].get("ms") is None and "tokens [0, 5)" in by["torch"]["note"]
    assert any("torch at csa_h2_topk512 T=5: FAIL" in ln for ln in lines)
    assert "torch FAIL" in next(ln for ln in lines if ln.startswith("[1/1"))


def test_run_grid_times_every_provider_into_one_buffer(monkeypatch):
    """A point's timed calls of the package's providers all write one output buffer (none timed
    on an allocation of its own), while each gate checks on outputs of its own."""
    real_provider, real_check = bench._provider, bench._check
    seen = {"timed": {}, "checked": {}}
    gate = [False]

    def watched(name, w, device, peers=None):
        p = real_provider(name, w, device, peers)

        def run(out):
            kind = "checked" if gate[0] else "timed"
            seen[kind].setdefault(name, set()).add(out.data_ptr())
            return p.run(out)

        return replace(p, run=run)

    def checking(*a, **k):
        gate[0] = True
        try:
            return real_check(*a, **k)
        finally:
            gate[0] = False

    monkeypatch.setattr(bench, "_provider", watched)
    monkeypatch.setattr(bench, "_check", checking)
    rows = bench.run_grid(heads=[2], tokens=[5], device="cpu", ceilings=False, quick=True,
                          providers=["triton", "default"], log=None, D=64)  # fmt: skip
    assert len(rows) == 2 and all(r["ok"] and r["ms"] for r in rows)
    timed, checked = seen["timed"], seen["checked"]
    assert set(timed) == set(checked) == {"triton", "default"}
    (shared,) = set().union(*timed.values())  # one buffer for every timed call
    assert all(shared not in ptrs for ptrs in checked.values())


def test_run_grid_time_limit_stops_before_the_next_point():
    lines: list[str] = []
    rows = bench.run_grid(heads=[2, 4], tokens=[4], device="cpu", ceilings=False,
                          providers=["triton"], time_limit_s=1e-9, log=lines.append)  # fmt: skip
    assert rows == []
    assert any("2 points not run" in ln and "csa_h4_topk512 T=4" in ln for ln in lines)
    with pytest.raises(ValueError, match="time_limit_s"):
        bench.run_grid(heads=[2], tokens=[4], device="cpu", time_limit_s=0, log=None)
    with pytest.raises(ValueError, match="budget_ms"):
        bench.run_grid(heads=[2], tokens=[4], device="cpu", budget_ms=0, log=None)


def test_point_summary_line():
    rows = [
        {"provider": "triton", "ok": True, "ms": 0.12345, "floor_ms": 0.05},
        {"provider": "default", "ok": True, "ms": 0.1, "config": {"kernel": "gluon_ws_small"}},
        {"provider": "flashmla_pad128", "ok": True, "ms": 2.5},
        {"provider": "gluon_mma", "ok": False, "note": "NaN"},
    ]
    line = bench._point_summary(rows, ["triton", "gluon_mma", "gluon_ws", "default", "flashmla"])
    assert line == ("triton 0.1235  gluon_mma FAIL  gluon_ws -  default 0.1 (gluon_ws_small)  "
                    "flashmla_pad128 2.5  | floor 0.05")  # fmt: skip


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def fake_gpu_grid(monkeypatch):
    """A GPU that is not there: the CLI's arguments to run_grid, captured."""
    got = {}
    monkeypatch.setattr(runtime, "has_gpu", lambda: True)
    monkeypatch.setattr(runtime, "device_name", lambda index=0: "NVIDIA H200")
    monkeypatch.setattr(bench, "run_grid", lambda **kw: got.update(kw) or [])
    monkeypatch.setattr(bench, "run_bench", lambda *a, **kw: pytest.fail("not a grid run"))
    return got


def test_cli_grid_defaults(fake_gpu_grid, capsys):
    assert cli.main(["bench", "--grid"]) == 0
    kw = fake_gpu_grid
    assert kw["heads"] == list(GRID_H) and kw["tokens"] == list(GRID_T) and kw["glm"] is True
    assert kw["providers"] is None and kw["budget_ms"] == bench.GRID_BUDGET_MS == 40
    assert kw["out_path"] == Path("data/bench/nvidia-h200_grid.csv")
    assert kw["device"] == torch.device("cuda") and kw["ceilings"] is True
    assert kw["time_limit_s"] is None and kw["check_tokens"] is None and kw["sink"] is True
    assert "0 rows appended to data/bench/nvidia-h200_grid.csv" in capsys.readouterr().out


def test_cli_grid_options(fake_gpu_grid, tmp_path):
    out = tmp_path / "g.csv"
    argv = ["bench", "--grid", "--heads", "8,16", "--heads", "96", "--tokens", "64,16384",
            "--no-glm", "--providers", "triton,default,flashmla", "--budget-ms", "20",
            "--time-limit", "420", "--quick", "--no-ceilings", "--out", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    kw = fake_gpu_grid
    assert kw["heads"] == [8, 16, 96] and kw["tokens"] == [64, 16384] and kw["glm"] is False
    assert kw["providers"] == ["triton", "default", "flashmla"] and kw["budget_ms"] == 20
    assert kw["time_limit_s"] == 420 and kw["quick"] and not kw["ceilings"]
    assert Path(kw["out_path"]) == out


def test_cli_grid_context(fake_gpu_grid, capsys):
    assert cli.main(["bench", "--grid", "--context", "65536", "--tokens", "4,64"]) == 0
    kw = fake_gpu_grid
    assert kw["context"] == 65536 and kw["glm"] is False and kw["tokens"] == [4, 64]
    assert kw["out_path"] == Path("data/bench/nvidia-h200_grid_ctx65536.csv")
    fake_gpu_grid.clear()
    assert cli.main(["bench", "--grid"]) == 0
    assert fake_gpu_grid["context"] == 0 and fake_gpu_grid["glm"] is True


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--grid", "--workloads", "csa_h8_topk512"], "exclude each other"),
        (["--context", "4096"], "--context goes with --grid"),
        (["--fp8", "--context", "4096"], "--context does not go with --fp8"),
        (["--grid", "--context", "-1"], "--context must be >= 0"),
        (["--grid", "--context", "4096", "--glm"], "--glm does not go with --context"),
        (["--heads", "8"], "--heads goes with --grid"),
        (["--no-glm"], "goes with --grid"),
        (["--time-limit", "60"], "goes with --grid"),
        (["--tokens", "64,256"], "several --tokens"),
        (["--grid", "--heads", "0,8"], "--heads must be >= 1"),
        (["--grid", "--tokens", "x"], "comma-separated integers"),
        (["--grid", "--budget-ms", "0"], "--budget-ms must be > 0"),
        (["--grid", "--time-limit", "-1"], "--time-limit must be > 0"),
    ],
)
def test_cli_grid_mistakes_exit_2(fake_gpu_grid, capsys, argv, message):
    assert cli.main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err
    assert fake_gpu_grid == {}  # nothing ran


def test_cli_cpu_grid_end_to_end(capsys, tmp_path):
    out = tmp_path / "cpu_grid.csv"
    rc = cli.main(["bench", "--cpu", "--grid", "--heads", "2", "--tokens", "4", "--quick",
                   "--providers", "triton,default", "--out", str(out)])  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "grid: 1 points x 2 providers" in text and "[1/1" in text
    with out.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["workload"], r["T"], r["H"], r["topk"], r["provider"], r["ok"]) for r in rows] == [
        ("csa_h2_topk512", "4", "2", "512", p, "True") for p in ("triton", "default")
    ]


@pytest.mark.gpu
def test_gpu_small_grid(tmp_path):
    # The GPU path end to end: workloads built on the device, budget timing, one reference per
    # point, every registered kernel that serves the point, default naming its kernel.
    out = tmp_path / "grid.csv"
    rows = bench.run_grid(heads=[8, 96], tokens=[64, 256], quick=True, budget_ms=5,
                          out_path=out, log=None)  # fmt: skip
    points = {(r["H"], r["T"]) for r in rows if r.get("workload")}
    assert points == {(8, 64), (96, 64), (8, 256), (96, 256)}
    work = [r for r in rows if r.get("workload")]
    assert all(r["ok"] and r["ms"] > 0 for r in work), [r for r in work if not r["ok"]]
    assert {r["topk"] for r in work if r["H"] == 96} == {1024}
    by = {(r["H"], r["T"], r["provider"]) for r in work}
    assert all((H, T, "default") in by for H, T in points)
    assert all(
        r["config"]["kernel"] in dispatch.KERNELS for r in work if r["provider"] == "default"
    )
    flash = {r["provider"] for r in work if r["provider"].startswith("flashmla")}
    assert flash <= {"flashmla_pad64", "flashmla_pad128"}
    assert any(r["provider"].startswith("ceiling:") for r in rows)
    assert len(bench.read_rows(out)) == len(rows)


@pytest.mark.gpu
def test_gpu_bench_records_the_split_launch_that_ran(tmp_path):
    # Whole lists at T = 4: gluon_mma's own 64-head launch would split, and trades for 16-head
    # blocks (launch.split_plan); gluon_wgmma keeps its blocks. The column records the split
    # count of the launch that ran and the traded blocks, and its launch fields stay the
    # kernel's own (what export --kernel-choice records).
    from sparse_mla.gluon import launch

    rows = bench.run_grid(heads=[64], tokens=[4], glm=False, context=65536, ceilings=False,
                          providers=["gluon_mma", "gluon_wgmma"], quick=True, budget_ms=5,
                          log=None)  # fmt: skip
    got = {r["provider"]: r for r in rows if r.get("workload")}
    assert all(r["ok"] for r in got.values())
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sm90 = launch.get_target("sm90")
    mma, wg = got["gluon_mma"], got["gluon_wgmma"]
    assert mma["config"]["BLOCK_H"] == 64 and mma["config"]["split_BLOCK_H"] == 16
    nnz = mma["nnz"]
    assert mma["config"]["num_kv_splits"] == launch.choose_num_splits(
        4, 64, nnz, launch.SPLIT_CONFIG, sms, 2
    )
    own = launch.resolve_launch("gluon_wgmma", None, 64, sm90)
    assert "split_BLOCK_H" not in wg["config"]
    assert wg["config"]["num_kv_splits"] == launch.choose_num_splits(4, 64, nnz, own, sms, 1) > 1


class _FakeDriver:
    """Triton's driver as time_budget uses it, on a fake clock: each flush takes 0.1 ms and
    each call of the timed function what the test says; events read the clock when recorded."""

    def __init__(self):
        self.clock = 0.0
        self.log: list[str] = []
        drv = self

        class Event:
            def __init__(self, enable_timing=False):
                self.t = None

            def record(self):
                self.t = drv.clock

            def elapsed_time(self, end):
                return end.t - self.t

        class Interface:
            pass

        Interface.Event = Event
        Interface.synchronize = staticmethod(lambda: drv.log.append("sync"))
        self.interface = Interface

    def get_device_interface(self):
        return self.interface

    def get_empty_cache_for_benchmark(self):
        return "l2"

    def clear_cache(self, cache):
        assert cache == "l2"
        self.log.append("flush")
        self.clock += 0.1


@pytest.mark.parametrize("call_ms, expect_calls", [(0.9, 40), (20.0, 5), (0.001, 200)])
def test_time_budget_on_a_fake_clock(monkeypatch, call_ms, expect_calls):
    drv = _FakeDriver()
    monkeypatch.setattr(bench, "_bench_driver", lambda: drv)
    times = iter([call_ms] * 2 + [call_ms * (1 + i % 3) for i in range(1000)])

    def fn():
        drv.log.append("call")
        drv.clock += next(times)

    ms = bench.time_budget(fn, 40.0)
    calls = drv.log.count("call")
    assert calls == 2 + expect_calls  # two to warm up and estimate (flush + call), then the budget
    assert expect_calls == bench.budget_reps(call_ms + 0.1, 40.0)
    # Every call follows a flush, and the flush is outside the timed window.
    assert drv.log.count("flush") == calls
    assert all(drv.log[i - 1] == "flush" for i, e in enumerate(drv.log) if e == "call")
    assert ms == pytest.approx(call_ms * 2)  # the median of call_ms x (1, 2, 3, 1, 2, 3, ...)


def test_time_interleaved_takes_turns_and_pools_the_calls(monkeypatch):
    drv = _FakeDriver()
    monkeypatch.setattr(bench, "_bench_driver", lambda: drv)
    order = []

    def make(name, call_ms):
        def fn():
            order.append(name)
            drv.log.append("call")
            drv.clock += call_ms

        return fn

    fns = [make("a", 1.0), make("b", 2.0), make("c", 4.0)]
    ms = bench.time_interleaved(fns, 40.0)
    assert ms == pytest.approx([1.0, 2.0, 4.0])
    # Each round times every function once, in turn, in the balanced orders of 3 (4 rounds):
    # abc, bca, cba, acb (a run of one function's calls may span two rounds: "a" ends round 3
    # and starts round 4).
    runs = [k for i, k in enumerate(order) if i == 0 or order[i - 1] != k]
    assert runs == ["a", "b", "c", "b", "c", "a", "c", "b", "a", "c", "b"]
    # Per function: 4 rounds of (2 warm-up calls + the calls that fit 10 ms, at least 5).
    for name, call_ms in (("a", 1.0), ("b", 2.0), ("c", 4.0)):
        per_round = bench.budget_reps(call_ms + 0.1, 10.0, min_reps=5, max_reps=50)
        assert order.count(name) == 4 * (2 + per_round)


def test_time_interleaved_is_fair_under_drift(monkeypatch):
    """The clocks fall as the run goes on (each call 0.5% slower than the one before): timed one
    after another, the second of two identical providers reads >10% slower; in turns (ABBA)
    within 2%."""
    drv = _FakeDriver()
    monkeypatch.setattr(bench, "_bench_driver", lambda: drv)
    calls = [0]

    def fn():
        calls[0] += 1
        drv.clock += 1.0 * (1.005 ** calls[0])

    first, second = bench.time_budget(fn, 40.0), bench.time_budget(fn, 40.0)
    assert second / first > 1.10
    calls[0] = 0
    a, b = bench.time_interleaved([fn, fn], 40.0, rounds=4)
    assert max(a, b) / min(a, b) < 1.02


@pytest.mark.parametrize("n", range(1, 12))
def test_balanced_orders_balance_places_and_predecessors(n):
    orders = bench.balanced_orders(n)
    m = n + n % 2
    assert len(orders) == m and all(sorted(o) == list(range(n)) for o in orders)
    # places: every item in every place once (even n), at most twice (odd n)
    for place in range(n):
        seen = [o[place] for o in orders]
        most = max(seen.count(i) for i in range(n))
        assert most == 1 if n % 2 == 0 else most <= 2
    # the item right before: every ordered pair of distinct items adjacent once (even n), at
    # least once and at most twice (odd n)
    pairs = [(o[k], o[k + 1]) for o in orders for k in range(n - 1)]
    for a in range(n):
        for b in range(n):
            if a != b:
                count = pairs.count((a, b))
                assert count == 1 if n % 2 == 0 else 1 <= count <= 2
    # the places add up alike (a drift linear in time moves every item alike)
    assert len({sum(o.index(i) for o in orders) for i in range(n)}) == 1
    with pytest.raises(ValueError):
        bench.balanced_orders(0)


def test_time_interleaved_is_fair_to_what_the_one_before_leaves(monkeypatch):
    """A hot provider slows the calls of the provider timed right after it (by 6%): two
    identical providers read alike wherever they sit, since each follows the hot one equally
    often. Forwards and backwards rounds (the grid's way until the tenth session) read the one
    placed right after the hot provider 3% slow (on the H200 a place in the grid's order read
    3-7% slow whoever sat in it, experiments/grid_order.py)."""
    drv = _FakeDriver()
    monkeypatch.setattr(bench, "_bench_driver", lambda: drv)
    state = {"last": None, "before": None}

    def provider(name, call_ms):
        def fn():
            if state["last"] != name:  # a new run of calls: remember whose run came before
                state["before"], state["last"] = state["last"], name
            drv.clock += call_ms * (1.06 if state["before"] == "hot" else 1.0)

        return fn

    names = ["hot", "a", "x", "y", "b", "z"]
    fns = [provider(n, ms) for n, ms in zip(names, [4.0, 1.0, 2.0, 3.0, 1.0, 2.5], strict=True)]
    ms = dict(zip(names, bench.time_interleaved(fns, 40.0), strict=True))
    assert ms["a"] == pytest.approx(ms["b"], rel=0.005)
    old = [list(range(6)), list(range(5, -1, -1))] * 2
    monkeypatch.setattr(bench, "balanced_orders", lambda n: old)
    state.update(last=None, before=None)
    ms = dict(zip(names, bench.time_interleaved(fns, 40.0), strict=True))
    assert ms["a"] / ms["b"] > 1.02


@pytest.mark.parametrize("bad", [{"rounds": 0}, {"rounds": 1.5}, {"min_reps": 0},
                                 {"max_reps": 1, "min_reps": 2}])  # fmt: skip
def test_time_interleaved_refuses_bad_arguments(bad):
    with pytest.raises(ValueError):
        bench.time_interleaved([lambda: None], 40.0, **bad)
    with pytest.raises(ValueError):
        bench.time_interleaved([lambda: None], 0.0)
