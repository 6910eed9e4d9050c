"""Notebook 07's helpers (sparse_mla/lab/pipeline.py): the tables against the kernel's source,
the budget against the compiled kernel, the readers against the committed CSV and log."""

from __future__ import annotations

import functools
import itertools
from pathlib import Path

import pytest

from sparse_mla import bench
from sparse_mla.gluon import hopper_ws
from sparse_mla.lab import figures
from sparse_mla.lab import pipeline as pl

DATA = Path(__file__).resolve().parent.parent / "data" / "bench"
CSV = DATA / "nvidia-h200.csv"
LOG = DATA / "ws_probe_steps_h200.log"


@functools.cache
def _resources():
    from sparse_mla import inspect

    return inspect.compile_gluon("prefill", "sm90", "gluon_ws", num_heads=128).resources


# ------------------------------------------------------------------------------------------------
# The tables against the kernel
# ------------------------------------------------------------------------------------------------


def test_barrier_table_is_the_kernels_barriers():
    for b in pl.BARRIERS:
        const = getattr(hopper_ws, b.const, None)
        assert const is not None, f"{b.const} is not a constant of hopper_ws"
        assert isinstance(const.value, int), b
        assert b.kind in ("mbarrier", "named"), b
    assert pl.BARRIERS == pl.MBARRIERS + pl.NAMED_BARRIERS, "mbarriers first, then named"
    # The mbarriers: one entry per slot of the kernel's array, in slot order.
    slots = [b.slot for b in pl.MBARRIERS]
    assert slots == list(range(hopper_ws.NUM_BARS.value)), "one entry per slot, in slot order"
    for b in pl.MBARRIERS:
        if b.const in ("READY", "FREE"):  # <READY|FREE> <buffer><half>: + 2 * buffer + half
            buf, half = int(b.name.split()[1][0]), b.name.split()[1][1]
            assert b.offset == 2 * buf + "LR".index(half), b
        else:
            assert b.name == b.const and b.offset == 0, b
    # The named barriers: NB_<name>, every NB_ constant of the kernel, in id order.
    kernel_named = sorted(
        (getattr(hopper_ws, n).value, n) for n in dir(hopper_ws) if n.startswith("NB_")
    )
    assert [b.const for b in pl.NAMED_BARRIERS] == [n for _, n in kernel_named]
    ids = [b.id for b in pl.NAMED_BARRIERS]
    assert len(set(ids)) == len(ids), "named barrier ids are distinct"
    # Triton's own warp-specialisation code uses named barriers 0-3; the hardware has 16.
    assert all(4 <= i < 16 for i in ids), ids
    for b in pl.NAMED_BARRIERS:
        assert b.const == f"NB_{b.name}" and b.offset == 0, b
        # bar.sync arrives as well as waits: every waiter is also an arriver.
        assert set(b.waited_by) <= set(b.arrived_by), b
        with pytest.raises(ValueError, match="named barrier"):
            _ = b.slot
    names = {p.name for p in pl.PARTITIONS}
    assert all(set(b.arrived_by) | set(b.waited_by) <= names for b in pl.BARRIERS)


def test_partitions_in_warp_specialize_order():
    assert [p.function for p in pl.PARTITIONS] == pl.kernel_partitions()
    assert [p.inspect_name for p in pl.PARTITIONS] == ["default"] + [
        f"worker {i}" for i in range(len(pl.PARTITIONS) - 1)
    ]


def test_producer_gather_order_is_the_kernels():
    """The table's gathers, in order, are the ``_gather_half`` calls of ``_producer``; each is
    preceded by a wait on its half's FREE barrier and followed by an arrival on its READY."""
    gathers = pl.kernel_gathers()
    assert [g for g, _, _ in gathers] == pl.gather_order()
    by_name = {b.name: b.slot for b in pl.MBARRIERS}
    for half, free, ready in gathers:
        assert free == by_name[f"FREE {half}"] and ready == by_name[f"READY {half}"], half
    # The table itself: each gather waits on FREE of its half and arrives on its READY.
    for s in pl.TIMELINE:
        if s.gather:
            assert s.waits == ((f"FREE {s.gather}", -1),) and s.arrives == (f"READY {s.gather}",)


@pytest.mark.parametrize("part", pl.PARTITIONS, ids=lambda p: p.name)
def test_each_partition_waits_and_arrives_where_the_kernel_does(part):
    src = pl.source_events(part.function)
    table = pl.table_events(part.name)
    assert set(table) == set(src), (sorted(set(table) - set(src)), sorted(set(src) - set(table)))
    for op, name in src:  # and the barrier table says so
        b = next(b for b in pl.BARRIERS if b.name == name)
        assert part.name in (b.arrived_by if op == "arrive" else b.waited_by), (op, name)

    def order(events, keep):
        out = []
        for e in events:
            if keep(e) and e not in out:
                out.append(e)
        return out

    # The exchange between the consumers (MAX, P0, P1) and the release of the halves happen in
    # the table's order.
    exchange = lambda e: e[1] in ("MAX", "P0", "P1")  # noqa: E731
    frees = lambda e: e[1].startswith("FREE") and e[0] == "arrive"  # noqa: E731
    for keep in (exchange, frees):
        assert order(table, keep) == order(src, keep)


def test_schedule_plays_without_deadlock_and_respects_barriers():
    for pairs in (1, 2, 3):
        placed = pl.schedule(pairs)
        gathers = [p for p in placed if p.step.gather]
        assert len(gathers) == 4 * pairs
        for p in placed:
            for _name, _key, t in p.waited:
                assert p.start >= t
        for lane in pl.LANES:
            mine = sorted((p for p in placed if p.step.lane == lane), key=lambda p: p.start)
            assert all(a.end <= b.start + 1e-9 for a, b in itertools.pairwise(mine))
    # A table whose consumer waits on a barrier nobody arrives at deadlocks.
    broken = (*pl.TIMELINE, pl.Step(pl.C1, "bad", "sync", 1.0, (("P0", 1),), (), "last"))
    with pytest.raises(RuntimeError, match="deadlocks"):
        pl.schedule(2, broken)


# ------------------------------------------------------------------------------------------------
# The budget
# ------------------------------------------------------------------------------------------------


def test_smem_buffers_from_the_kernel_constants():
    bufs = {b.var: b for b in pl.smem_buffers()}
    bh, bk, hd = hopper_ws.BLOCK_H.value, hopper_ws.BLOCK_K.value, hopper_ws.HEAD_DIM.value
    assert bufs["q_smem"].nbytes == bh * hd * 2
    assert bufs["kv_smem"].nbytes == 2 * bk * hd * 2
    assert bufs["p0_smem"].nbytes == bufs["p1_smem"].nbytes == bh * bk * 2
    assert bufs["m0_smem"].nbytes == bufs["m1_smem"].nbytes == bh * 4
    assert bufs["l_smem"].nbytes == 4 * bh * 4
    assert bufs["bars"].nbytes == hopper_ws.NUM_BARS.value * 8


def test_budget_adds_up_against_the_sm():
    res = _resources()
    regs = pl.partition_registers(res)
    assert set(regs) == {p.name for p in pl.PARTITIONS}
    total = sum(w * 32 * r for w, r in regs.values())
    assert total <= pl.REGISTER_FILE
    assert regs[pl.PRODUCER][1] < min(regs[pl.C0][1], regs[pl.C1][1])
    buffers = sum(b.nbytes for b in pl.smem_buffers())
    assert buffers <= res.shared_bytes <= pl.SMEM_LIMIT
    rows = {r[0]: r[1] for r in pl.budget_table(res)}
    assert rows["registers: all partitions"] == total
    assert rows["shared: all"] == res.shared_bytes
    shared_parts = [v for k, v in rows.items() if k.startswith("shared:") and k != "shared: all"]
    assert sum(shared_parts) == res.shared_bytes and min(shared_parts) >= 0
    for fig in (pl.budget_figure(res), pl.buffers_figure(res)):
        assert figures.to_png(fig)[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="partitions"):
        pl.partition_registers(type(res)(backend="cuda", arch=90, num_warps=4, occupancy=1,
                                         spill_bytes=0))  # fmt: skip


# ------------------------------------------------------------------------------------------------
# Figures and the measured data
# ------------------------------------------------------------------------------------------------


def test_pipeline_figures_render():
    fig = pl.timeline_figure(2)
    key = " ".join(" ".join(t.get_text().split()) for ax in fig.get_axes() for t in ax.texts)
    for name in ("MAX", "P0", "P1", "Q_READY", "L", "FREE 0L", "READY 1R"):
        assert f"waits {name}" in key or f", {name}" in key, name  # the key names each wait
    assert figures.to_png(fig)[:4] == b"\x89PNG"
    assert figures.to_png(pl.split_figure())[:4] == b"\x89PNG"
    assert figures.to_png(pl.buffers_figure())[:4] == b"\x89PNG"


def test_bench_summary_takes_the_latest_run_and_both_workloads(tmp_path):
    rows = bench.read_rows(CSV)
    latest = max(r["timestamp"] for r in rows if r.get("workload"))
    s = pl.bench_summary(CSV)
    assert s["run"] == latest
    assert list(s["workloads"]) == list(pl.WORKLOADS)
    mine = [r for r in rows if r["timestamp"] == latest]
    assert s["commit"] == mine[0]["commit"] and s["device"] == mine[0]["device"]
    for name, w in s["workloads"].items():
        assert w["H"] >= 64
        for p in pl.PROVIDERS:
            row = next(r for r in mine if r.get("workload") == name and r["provider"] == p)
            assert w["ms"][p] == pytest.approx(row["ms"])
            assert w["tflops"][p] == pytest.approx(row["tflops"], rel=1e-3)
        assert 0 < max(w["tflops"].values()) < w["matmul_tflops"]
    table = pl.bench_table(s)
    assert len(table) == len(pl.WORKLOADS) * len(pl.PROVIDERS)
    assert all(r[5] == "1.000" for r in table if r[1] == "flashmla")
    assert figures.to_png(pl.bench_figure(s))[:4] == b"\x89PNG"
    # An older run is picked when named, and a run missing a workload says so.
    older = sorted({r["timestamp"] for r in rows if r.get("workload")})[0]
    if older != latest:
        assert pl.bench_summary(CSV, older)["run"] == older
    with pytest.raises(ValueError, match="no rows"):
        pl.bench_summary(CSV, workloads=("csa_h64_topk512", "no_such_workload"))


def test_read_steps_parses_every_step_of_the_log(tmp_path):
    runs = pl.read_steps(LOG)
    text = LOG.read_text()
    steps = [int(line.split()[2].rstrip(":")) for line in text.splitlines()
             if line.startswith("## step ")]  # fmt: skip
    assert sorted({r.step for r in runs}) == steps
    assert len(runs) == text.count("flashmla: ") // 2  # one H64 and one H128 line per run
    for r in runs:
        assert r.ratio("H64 topk512") > 0.5 and r.matmul_tflops
    assert runs[0].ratio("H64 topk512") > runs[-1].ratio("H64 topk512")
    log = tmp_path / "steps.log"
    log.write_text(
        "## step 1: a\nmatmul ceiling 700 TFLOP/s\n"
        "H64 topk512 gluon_ws: 3.000 ms 400 TFLOP/s\nH64 topk512 flashmla: 2.000 ms x\n"
        "## step 2: b\n### V=1\nH64 topk512 gluon_ws: 2.2 ms\nH64 topk512 flashmla: 2.0 ms\n"
        "### V=0\nH64 topk512 gluon_ws: 2.1 ms\nH64 topk512 flashmla: 2.0 ms\n"
    )
    small = pl.read_steps(log)
    assert [(r.step, r.variant) for r in small] == [(1, None), (2, "V=1"), (2, "V=0")]
    assert [round(r.ratio("H64 topk512"), 3) for r in small] == [1.5, 1.1, 1.05]
    assert small[0].matmul_tflops == 700.0
    fig = pl.steps_figure(runs)
    labels = [t.get_text() for t in fig.get_axes()[0].get_yticklabels()]
    assert len(labels) == len(runs) and labels[0].startswith("1: first version")
    assert figures.to_png(fig)[:4] == b"\x89PNG"


VARIANT_LOG = DATA / "ws_variants_h200.log"


def test_read_variant_runs_medians_against_the_log(tmp_path):
    runs = pl.read_variant_runs(VARIANT_LOG)
    text = VARIANT_LOG.read_text()
    headers = [line for line in text.splitlines() if line.startswith("## run ")]
    assert sorted({r.step for r in runs}) == list(range(1, len(headers) + 1))
    assert all(r.variant != "flashmla" and r.matmul_tflops for r in runs)
    # One entry recomputed by hand from the log's lines: run 2, rdv, H64.
    section = text.split("## run 2:")[1].split("## run 3:")[0]

    def rounds(name):
        return sorted(float(line.split(": ")[1].split()[0]) for line in section.splitlines()
                      if line.startswith(f"csa H64 topk512 {name} round"))  # fmt: skip

    mine, peer = rounds("rdv"), rounds("flashmla")
    assert len(mine) == len(peer) == 3
    r = next(r for r in runs if r.step == 2 and r.variant == "rdv")
    assert r.ms["H64 topk512"] == {"gluon_ws": mine[1], "flashmla": peer[1]}
    log = tmp_path / "v.log"
    log.write_text(
        "## run 1: a\nmatmul ceiling 700 TFLOP/s\n"
        "csa H64 topk512 x round0: 3.0 ms\ncsa H64 topk512 flashmla round0: 2.0 ms\n"
        "csa H64 topk512 x round1: 1.0 ms\ncsa H64 topk512 flashmla round1: 2.0 ms\n"
        "csa H64 topk512 x round2: 2.0 ms\ncsa H64 topk512 flashmla round2: 4.0 ms\n"
        "csa H128 topk1024 x round0: 5.0 ms\n"  # no peer for H128: left out
        "## run 2: b\ncsa H64 topk512 y round0: 1.5 ms\ncsa H64 topk512 flashmla round0: 3.0 ms\n"
    )
    small = pl.read_variant_runs(log)
    assert [(r.step, r.variant, r.matmul_tflops) for r in small] == [(1, "x", 700.0),
                                                                     (2, "y", None)]  # fmt: skip
    assert small[0].ms == {"H64 topk512": {"gluon_ws": 2.0, "flashmla": 2.0}}
    assert small[1].ratio("H64 topk512") == 0.5
    assert figures.to_png(pl.steps_figure(runs))[:4] == b"\x89PNG"


def test_timeline_is_readable_at_the_output_width():
    """Issue 23, defect 10: text at least 7 px once drawn within the output width, each
    step's number inside its box, and no time axis (the x axis is the order of events)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.patches import Rectangle

    fig = pl.timeline_figure(2)
    png = figures.to_png(fig)
    px_per_point = figures.png_size(png)[0] / (fig.get_figwidth() * 72) * 1.02
    FigureCanvasAgg(fig).draw()
    texts = [t for ax in fig.get_axes() for t in ax.texts] + [fig._suptitle]
    assert min(t.get_fontsize() for t in texts) * px_per_point >= 7
    ax = fig.get_axes()[0]
    assert list(ax.get_xticks()) == [] and "not time" in ax.get_xlabel()
    boxes = [p.get_window_extent() for p in ax.patches if isinstance(p, Rectangle)]
    numbers = [t for t in ax.texts if t.get_text().isdigit()]
    assert len(numbers) == len(pl.schedule(2))
    for t in numbers:
        b = t.get_window_extent()
        assert any(r.x0 - 1 <= b.x0 and b.x1 <= r.x1 + 1 and r.y0 - 1 <= b.y0 and b.y1 <= r.y1 + 1
                   for r in boxes), t.get_text()  # fmt: skip


@pytest.mark.parametrize(
    "log,csv_name,read",
    [
        (LOG, "ws_probe_steps_h200.csv", pl.read_steps),
        (VARIANT_LOG, "ws_variants_steps_h200.csv", pl.read_variant_runs),
    ],
)
def test_the_step_csvs_notebook_07_reads_hold_what_their_logs_say(log, csv_name, read, tmp_path):
    """Notebook 07 reads the step tables as CSV (scripts/steps_csv.py writes them from the
    probes' logs): the committed CSV gives back every run of its log, times and ceilings
    included, and a write / read round trip is exact."""
    from_log = read(log)
    assert from_log
    assert pl.read_steps_csv(DATA / csv_name) == from_log, f"{csv_name} is stale: rerun steps_csv"
    again = tmp_path / csv_name
    pl.write_steps_csv(from_log, again)
    assert pl.read_steps_csv(again) == from_log
    nb = (DATA.parent.parent / "notebooks" / "07_warp_specialized_prefill.ipynb").read_text()
    assert csv_name in nb and "read_steps(" not in nb and "read_variant_runs(" not in nb


def test_the_partitions_name_their_barrier_slots():
    """hopper_ws's partitions write a barrier slot by its name (READY_1R, FREE_0L, ...), never
    as READY / FREE + a number by hand; the names are the slots the table above documents."""
    import ast
    import inspect as pyinspect

    tree = ast.parse(pyinspect.getsource(hopper_ws))
    by_hand = [
        ast.unparse(n) for n in ast.walk(tree)
        if isinstance(n, ast.BinOp) and isinstance(n.left, ast.Name)
        and n.left.id in ("READY", "FREE") and isinstance(n.right, ast.Constant)
    ]  # fmt: skip
    assert not by_hand, f"barrier slots written by hand: {by_hand}"
    for base in ("READY", "FREE"):
        for buf in (0, 1):
            for half, hl in enumerate("LR"):
                slot = getattr(hopper_ws, f"{base}_{buf}{hl}").value
                assert slot == getattr(hopper_ws, base).value + 2 * buf + half
