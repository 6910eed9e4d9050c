"""The public entry's kernel choice: recorded kernel launched, config= forcing, CPU fallback."""

from __future__ import annotations

import ast
import csv
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import make_case, poisoned_like, runnable_everywhere

from sparse_mla import configs, dispatch, prefill, runtime, tune
from sparse_mla.reference import check_against_reference, sparse_mla_prefill_ref

ROOT = Path(__file__).resolve().parents[1]
TRITON_PROV = {"device": "test", "triton": "3.6.0", "date": "2026-11-30", "workload": "w",
               "time_ms": 1.0, "sweep_size": 1}  # fmt: skip
CHOICE_PROV = {"device": "test", "date": "2026-11-30", "source": "test",
               "times_ms": {"gluon_ws_small": 1.0, "triton": 2.0}}  # fmt: skip
FAKE = "gluon_ws_small"  # the Gluon kernel the CPU tests fake as runnable


def _write(root, arch, entries):
    path = configs.config_path(arch, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(entries))


def _entry(kernel=None, **launch):
    e = {"launch": {"BLOCK_H": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 2, **launch},
         "provenance": dict(TRITON_PROV)}  # fmt: skip
    if kernel is not None:
        e = {"kernel": kernel, **e}
    return e


class Spies:
    """Which registered kernel ran, and with which launch; the fake Gluon kernel (``FAKE``)
    writes the fp32 reference's result so the output check still means something."""

    def __init__(self, monkeypatch, *, gluon_runs: bool):
        self.calls: list[tuple[str, object]] = []
        triton = dispatch.KERNELS["triton"]
        gluon = dispatch.KERNELS[FAKE]

        def run_triton(*args):
            self.calls.append(("triton", args[-1]))
            return triton.run(*args)

        def run_gluon(q, kv, idx, indptr, scale, sink, out, launch):
            self.calls.append((FAKE, launch))
            ref = sparse_mla_prefill_ref(q, kv, idx, indptr, scale, attn_sink=sink)
            out.copy_(ref.to(out.dtype))
            return out

        monkeypatch.setitem(dispatch.KERNELS, "triton", replace(triton, run=run_triton))
        fake = replace(gluon, run=run_gluon)
        if gluon_runs:  # as on an sm90 GPU
            fake = replace(fake, unavailable=lambda call: None)
        monkeypatch.setitem(dispatch.KERNELS, FAKE, fake)

    @property
    def names(self):
        return [n for n, _ in self.calls]


def _run(case, **kw):
    out = poisoned_like(case.q)
    got = prefill.sparse_mla_prefill(*case.args(), attn_sink=case.attn_sink, out=out, **kw)
    assert got is out
    rep = check_against_reference(out, *case.args(), attn_sink=case.attn_sink)
    assert rep.ok, rep
    return out


@pytest.fixture
def sm90_root(tmp_path, monkeypatch):
    """A configs root where sm90 H16 D512 records the fake Gluon kernel (with a launch) and H8
    records none; calls read it as if on an sm90 GPU (the kernels still run on CPU tensors)."""
    gluon = {"name": FAKE, "launch": {"HEAD_GROUPS": 1}, "provenance": CHOICE_PROV}
    _write(tmp_path, "sm90", {"H16_D512": _entry(gluon), "H8_D512": _entry(BLOCK_K=32)})
    monkeypatch.setattr(prefill, "_arch_of", lambda q: "sm90")
    with configs.use_root(tmp_path):
        yield tmp_path


def test_recorded_kernel_is_the_one_launched(sm90_root, monkeypatch):
    from sparse_mla.gluon.launch import SmallWSConfig

    spies = Spies(monkeypatch, gluon_runs=True)
    _run(make_case(5, 16, 512, N=64, max_slots=40, seed=1))
    assert spies.names == [FAKE]
    assert spies.calls[0][1] == SmallWSConfig(HEAD_GROUPS=1)
    c = dispatch.choose(dispatch.Call("sm90", 16, 512, num_tokens=5))
    assert c.kernel == FAKE and c.reason.startswith("recorded H16_D512")
    # A shape without a recorded kernel runs the rule's kernel (the heads-on-N kernel at H8).
    _run(make_case(4, 8, 512, N=64, max_slots=40, seed=2))
    assert spies.names == [FAKE, FAKE]
    assert spies.calls[1][1] == SmallWSConfig(HEAD_GROUPS=1)
    c = dispatch.choose(dispatch.Call("sm90", 8, 512))
    assert c.kernel == FAKE and c.reason.startswith("rule for sm90 H=8")


def test_config_forces_the_kernel(sm90_root, monkeypatch):
    from sparse_mla.gluon.launch import SmallWSConfig

    spies = Spies(monkeypatch, gluon_runs=True)
    case = make_case(5, 16, 512, N=64, max_slots=40, seed=3)
    _run(case, config={"BLOCK_K": 32})
    _run(case, config=configs.PrefillConfig(BLOCK_K=16, num_warps=2))
    _run(case, config=dispatch.Choice("triton"))
    forced = SmallWSConfig(HEAD_GROUPS=2)
    _run(case, config=forced)
    _run(case, config=dispatch.Choice(FAKE, {"HEAD_GROUPS": 2}))
    assert spies.names == ["triton", "triton", "triton", FAKE, FAKE]
    assert spies.calls[0][1].BLOCK_K == 32 and spies.calls[1][1].num_warps == 2
    assert spies.calls[2][1] == configs.PrefillConfig(BLOCK_H=16, BLOCK_K=16, num_warps=4)
    assert spies.calls[3][1] is forced and spies.calls[4][1] == forced


def test_cpu_falls_back_to_triton(sm90_root, monkeypatch):
    # A Gluon kernel is recorded for H16, but CPU tensors cannot run it, nor the rule's
    # kernels: Triton runs (interpreter) with its tuned launch.
    spies = Spies(monkeypatch, gluon_runs=False)
    seen = []
    real = runtime.launch
    monkeypatch.setattr(runtime, "launch", lambda k, *a, **kw: seen.append(k) or real(k, *a, **kw))
    _run(make_case(5, 16, 512, N=64, max_slots=40, seed=4))
    assert spies.names == ["triton"] and seen == [prefill._sparse_mla_prefill_kernel]
    c = dispatch.choose(dispatch.Call("sm90", 16, 512, torch.bfloat16, torch.zeros(4, 512)))
    assert c.kernel == "triton" and f"{FAKE} recorded, but" in c.reason
    _run(make_case(4, 8, 512, N=64, max_slots=40, seed=2))
    assert spies.calls[-1][1] == configs.PrefillConfig(BLOCK_H=16, BLOCK_K=32, num_warps=4)
    # No GPU at all: no lookup, Triton's default launch.
    monkeypatch.setattr(prefill, "_arch_of", lambda q: None)
    _run(make_case(3, 16, 512, N=64, max_slots=40, seed=5))
    assert spies.names == ["triton", "triton", "triton"]
    assert spies.calls[-1][1] == prefill.default_config(16, 512)


def test_forced_kernel_that_cannot_run_is_rejected_before_out(sm90_root, monkeypatch):
    from sparse_mla.gluon.launch import GluonConfig

    spies = Spies(monkeypatch, gluon_runs=False)
    case = make_case(3, 16, 512, N=64, max_slots=40, seed=6)
    out = poisoned_like(case.q)
    with pytest.raises(ValueError, match="gluon_mma kernel cannot run"):
        prefill.sparse_mla_prefill(*case.args(), out=out, config=GluonConfig())
    for name in ("gluon_ws", FAKE, "gluon_wgmma"):
        with pytest.raises(ValueError, match=f"{name} kernel cannot run"):
            prefill.sparse_mla_prefill(*case.args(), out=out, config=dispatch.Choice(name))
    known = re.escape(str(sorted(dispatch.KERNELS)))
    with pytest.raises(ValueError, match=rf"^config: Choice\('cuda_magic'\).*{known}$"):
        prefill.sparse_mla_prefill(*case.args(), out=out, config=dispatch.Choice("cuda_magic"))
    with pytest.raises(TypeError, match="config must be"):
        prefill.sparse_mla_prefill(*case.args(), out=out, config=3)
    assert torch.isnan(out).all() and spies.names == []


def test_unregistered_recorded_kernel_names_the_file(tmp_path, monkeypatch):
    bad = {"name": "gluon_typo", "provenance": {**CHOICE_PROV, "times_ms": {"gluon_typo": 1.0}}}
    _write(tmp_path, "sm90", {"H16_D512": _entry(bad)})
    with pytest.raises(configs.ConfigFileError, match=r"gluon_typo.*not registered"):
        dispatch.choose(dispatch.Call("sm90", 16, 512), root=tmp_path)


@pytest.mark.parametrize(
    ("kernel", "match"),
    [
        ({"name": "gluon_ws",
          "provenance": {**CHOICE_PROV, "times_ms": {"gluon_ws": 3.0, "triton": 2.0}}},
         "'triton' was faster"),
        ({"name": "gluon_ws", "provenance": {**CHOICE_PROV, "times_ms": {"triton": 2.0}}},
         "include the chosen kernel"),
        ({"name": "triton", "launch": {"BLOCK_K": 16},
          "provenance": {**CHOICE_PROV, "times_ms": {"triton": 1.0}}}, "Triton's launch"),
        ({"name": "Gluon!", "provenance": CHOICE_PROV}, "name must be"),
        ({"name": FAKE, "provenance": {k: v for k, v in CHOICE_PROV.items() if k != "source"}},
         "missing key 'source'"),
        ({"name": FAKE, "launch": {"BLOCK_K": "64"}, "provenance": CHOICE_PROV},
         "ints/bools/null"),
        ({"name": FAKE, "tokens": [0, 0], "provenance": CHOICE_PROV}, "tokens must be"),
        ([{"name": FAKE, "tokens": [0, 100], "provenance": CHOICE_PROV},
          {"name": FAKE, "tokens": [200, None], "provenance": CHOICE_PROV}], "follow each other"),
        ([{"name": FAKE, "tokens": [0, 100], "provenance": CHOICE_PROV}], "end open"),
        ([{"name": FAKE, "provenance": CHOICE_PROV}], "needs its 'tokens'"),
        ([], "must not be empty"),
        ({"name": FAKE, "slots": [0, None], "provenance": CHOICE_PROV}, "no 'slots'"),
        ({"name": FAKE, "tokens": [0, None], "slots": [5, 1], "provenance": CHOICE_PROV},
         "slots must be"),
        ([{"name": FAKE, "tokens": [0, None], "slots": [0, 100], "provenance": CHOICE_PROV}],
         "one choice, so no 'slots'"),
        ([{"name": FAKE, "tokens": [0, None], "slots": [0, 100], "provenance": CHOICE_PROV},
          {"name": FAKE, "tokens": [0, None], "provenance": CHOICE_PROV}], "each need 'slots'"),
        ([{"name": FAKE, "tokens": [0, None], "slots": [0, 100], "provenance": CHOICE_PROV},
          {"name": FAKE, "tokens": [0, None], "slots": [120, None], "provenance": CHOICE_PROV}],
         "slots buckets must follow each other"),
        ([{"name": FAKE, "tokens": [0, None], "slots": [1, 100], "provenance": CHOICE_PROV},
          {"name": FAKE, "tokens": [0, None], "slots": [100, None], "provenance": CHOICE_PROV}],
         "slots buckets must start at 0"),
    ],
)  # fmt: skip
def test_kernel_object_is_validated(tmp_path, kernel, match):
    _write(tmp_path, "sm90", {"H16_D512": _entry(kernel)})
    with pytest.raises(configs.ConfigFileError, match=match):
        configs.entries("sm90", tmp_path)


def _bench_row(provider, H, ms, *, ts="2026-11-30T10:00:00+00:00", workload=None, ok=True,
               config=None, T=16384, nnz=None):  # fmt: skip
    triton_cfg = {"BLOCK_H": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2}
    gluon_cfg = {"BLOCK_H": 64, "BLOCK_K": 64, "num_warps": 8, "num_stages": 2,
                 "num_kv_splits": 1}  # fmt: skip
    cfg = config or (triton_cfg if provider == "triton" else gluon_cfg)
    return {"timestamp": ts, "device": "NVIDIA H200", "torch": "2.11", "triton": "3.6.0",
            "commit": "c0ffee", "workload": workload or f"csa_h{H}", "T": str(T), "H": str(H),
            "D": "512", "provider": provider, "config": json.dumps(cfg), "ok": str(ok),
            "ms": "" if ms is None else str(ms),
            "nnz": "" if nnz is None else str(nnz)}  # fmt: skip


def test_export_kernel_choice_then_dispatch(tmp_path, monkeypatch):
    staged = {"BLOCK_H": 64, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3, "num_kv_splits": 1}
    rows = [
        _bench_row("triton", 64, 6.5), _bench_row("gluon_wgmma", 64, 4.8, config=staged),
        _bench_row("default", 64, 1.0), _bench_row("flashmla", 64, 0.5),  # not candidates
        _bench_row("triton", 16, 2.4), _bench_row("gluon_wgmma", 16, 4.0),
        _bench_row("triton", 16, 7.2, workload="glm_h16"), _bench_row("gluon_wgmma", 16, 5.0,
                                                                       workload="glm_h16"),
        # an older run where Gluon lost at H64 is ignored (the latest run counts)
        _bench_row("triton", 64, 1.0, ts="2026-11-01T00:00:00+00:00"),
        _bench_row("gluon_wgmma", 64, 9.0, ts="2026-11-01T00:00:00+00:00"),
    ]  # fmt: skip
    diff = tune.export_kernel_choice(rows, "sm90", root=tmp_path, source="unit test")
    assert '"name": "gluon_wgmma"' in diff
    found = configs.entries("sm90", tmp_path)
    h64, h16 = found["H64_D512"], found["H16_D512"]
    # A launch other than the kernel's default is recorded (per-call keys left out)...
    assert h64.kernel.name == "gluon_wgmma" and h64.kernel.launch == {
        "BLOCK_H": 64, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}  # fmt: skip
    assert h64.kernel.tokens is None and len(h64.kernels) == 1  # one T measured: every T
    assert h64.kernel.provenance["times_ms"] == {"gluon_wgmma": 4.8, "triton": 6.5}
    assert h64.provenance["mode"] == "bench" and h64.launch.BLOCK_K == 32  # from the triton row
    # H16: times summed over both workloads (Gluon 4.0 + 5.0 against Triton 2.4 + 7.2).
    assert h16.kernel.name == "gluon_wgmma"
    # ... the default, as None: the entry runs the kernel's default itself, as the bench did.
    assert _bench_row("gluon_wgmma", 16, 1.0)["config"] == json.dumps(
        {**dispatch.KERNELS["gluon_wgmma"].to_dict(
            dispatch.KERNELS["gluon_wgmma"].resolve(None, dispatch.Call("sm90", 16, 512))),
         "num_kv_splits": 1})  # fmt: skip
    assert h16.kernel.launch is None
    assert h16.kernel.provenance["times_ms"] == {"gluon_wgmma": 9.0, "triton": 9.6}
    assert "csa_h16 T=16384 + glm_h16 T=16384" in h16.kernel.provenance["workload"]
    # A later sweep export of Triton's launch keeps the recorded kernel.
    row = {"target": "sm90", "H": 64, "D": 512, "BLOCK_H": 64, "BLOCK_K": 16, "num_warps": 8,
           "num_stages": 2, "status": "ok", "mode": "time", "time_ms": 5.0}  # fmt: skip
    tune.export([row], "sm90", root=tmp_path, provenance=TRITON_PROV)
    again = configs.entries("sm90", tmp_path)["H64_D512"]
    assert again.launch.BLOCK_K == 16 and again.kernel == h64.kernel
    c = dispatch.choose(dispatch.Call("sm90", 64, 512), root=tmp_path)
    assert (
        c.kernel == "gluon_wgmma" and c.launch.num_stages == 3 and "gluon_wgmma 4.8 ms" in c.reason
    )


def test_token_buckets():
    assert tune.token_buckets([16384]) == [(0, None)]
    assert tune.token_buckets([4096, 64, 1024, 256, 16384, 64]) == [
        (0, 128), (128, 512), (512, 2048), (2048, 8192), (8192, None)]  # fmt: skip
    # Neighbours whose geometric midpoint floors onto the lower one: each keeps its own value.
    assert tune.token_buckets([1, 2, 3]) == [(0, 2), (2, 3), (3, None)]
    assert tune.token_buckets([0, 640]) == [(0, 1), (1, None)]


def test_grid_export_records_a_choice_per_token_bucket(tmp_path):
    """A run over several T records one choice per T (its bucket); the dispatch then picks by
    the call's T, and a T between two measured ones takes the nearer (geometric) one."""
    mma = {"BLOCK_H": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 4, "num_kv_splits": 8}
    rows = []
    for T, ws, mma_ms in ((64, 0.05, 0.03), (1024, 0.2, 0.3), (16384, 1.7, 4.0)):
        rows += [
            _bench_row("triton", 16, 9.0, T=T),
            _bench_row(FAKE, 16, ws, T=T, config={"HEAD_GROUPS": 1}),
            _bench_row("gluon_mma", 16, mma_ms, T=T, config=mma),
        ]
    tune.export_kernel_choice(rows, "sm90", root=tmp_path, source="grid")
    e = configs.entries("sm90", tmp_path)["H16_D512"]
    assert [(c.name, c.tokens) for c in e.kernels] == [
        ("gluon_mma", (0, 256)), (FAKE, (256, 4096)), (FAKE, (4096, None))]  # fmt: skip
    assert e.kernels[0].launch is None  # gluon_mma's default at H16: recorded as the default
    assert e.kernels[0].provenance["workload"] == "csa_h16 T=64"
    text = configs.config_path("sm90", tmp_path).read_text()
    assert '"tokens": [' in text and configs.validate_file(configs.config_path("sm90", tmp_path))
    for T, name in ((1, "gluon_mma"), (255, "gluon_mma"), (256, FAKE), (5000, FAKE),
                    (10**6, FAKE), (None, FAKE)):  # fmt: skip
        c = configs.entries("sm90", tmp_path)["H16_D512"].kernel_for(T)
        assert c.name == name, (T, c)


def test_export_by_list_length_then_dispatch(tmp_path, monkeypatch):
    """Two runs taken together, the grid's short lists and a long request's steps (every list
    whole) at the same T, record a choice per list length where both were measured; the
    entry's choice then follows the call's slots per token (cached per bucket), and a call
    whose length is unknown takes the longest lists' choice."""
    runnable_everywhere(monkeypatch)
    mma = {"BLOCK_H": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 4, "num_kv_splits": 8}
    rows = []
    for ts, workload, slots, times in (
        ("2026-12-02T10:00:00+00:00", "csa_h16", (3, 40), ((0.008, 0.009), (0.010, 0.030))),
        ("2026-12-02T11:00:00+00:00", "csa_h16_ctx", (640, 640), ((0.020, 0.013), (0.021, 0.035))),
    ):  # fmt: skip
        for T, s, (ws, mma_ms) in zip((4, 64), slots, times, strict=True):
            rows += [_bench_row("triton", 16, 0.1, T=T, ts=ts, workload=workload, nnz=T * s),
                     _bench_row(FAKE, 16, ws, T=T, ts=ts, workload=workload, nnz=T * s,
                                config={"HEAD_GROUPS": 1}),
                     _bench_row("gluon_mma", 16, mma_ms, T=T, ts=ts, workload=workload,
                                nnz=T * s, config=mma)]  # fmt: skip
    runs = ["2026-12-02T10:00:00+00:00", "2026-12-02T11:00:00+00:00"]
    tune.export_kernel_choice(rows, "sm90", run=runs, root=tmp_path, source="grid + ctx")
    e = configs.entries("sm90", tmp_path)["H16_D512"]
    # At T = 64 both lengths chose the same kernel: one choice, its times summed.
    assert [(c.name, c.tokens, c.slots) for c in e.kernels] == [
        (FAKE, (0, 16), (0, 43)), ("gluon_mma", (0, 16), (43, None)),
        (FAKE, (16, None), None)]  # fmt: skip
    assert e.kernels[2].provenance["times_ms"][FAKE] == pytest.approx(0.031)
    assert e.kernels[2].provenance["workload"] == (
        "csa_h16 T=64 (40 slots/token) + csa_h16_ctx T=64 (640 slots/token) (times summed)"
    )
    assert e.kernels[2].provenance["run"] == " + ".join(runs)
    assert e.kernels[1].provenance["workload"] == "csa_h16_ctx T=4 (640 slots/token)"
    assert e.kernels[1].provenance["run"] == runs[1] and e.kernels[0].provenance["run"] == runs[0]
    assert '"slots": [' in configs.config_path("sm90", tmp_path).read_text()
    assert dispatch.slot_bounds("sm90", 16, 512, tmp_path) == (0, 43)
    for T, slots, name in ((4, 640, "gluon_mma"), (1, 43, "gluon_mma"), (4, 42, FAKE),
                           (4, 3, FAKE), (4, None, "gluon_mma"), (64, 640, FAKE),
                           (64, 1, FAKE)):  # fmt: skip
        nnz = None if slots is None else T * slots
        c = dispatch.choose(dispatch.Call("sm90", 16, 512, num_tokens=T, nnz=nnz), root=tmp_path)
        assert c.kernel == name, (T, slots, c)
    c = dispatch.choose(dispatch.Call("sm90", 16, 512, num_tokens=4, nnz=4 * 640), root=tmp_path)
    assert "T in [0, 16) slots/token in [43, inf)" in c.reason and "gluon_mma 0.013 ms" in c.reason
    line = dispatch.describe("sm90", 16, 512, tmp_path, num_tokens=4, slots_per_token=3)
    assert line.startswith(f"sm90 H=16 D=512 T=4 slots/token=3: {FAKE} (recorded")
    with pytest.raises(ValueError, match="needs num_tokens"):
        dispatch.describe("sm90", 16, 512, tmp_path, slots_per_token=3)
    # The entry's cached choice: one per (token bucket, slots bucket), in either order.
    monkeypatch.setenv("SPARSE_MLA_CONFIG_DIR", str(tmp_path))
    kv = torch.zeros(64, 512, dtype=torch.bfloat16)
    for T, nnz, name in ((4, 4 * 640, "gluon_mma"), (4, 12, FAKE), (5, 5 * 700, "gluon_mma"),
                         (4, 8, FAKE), (4, None, "gluon_mma"), (64, 64 * 640, FAKE)):  # fmt: skip
        got = dispatch.choose_cached("sm90", 16, 512, torch.bfloat16, kv, T, nnz)
        assert got.kernel == name, (T, nnz, got)
    # The same workload and T in both runs is a mistake, not a silent pick.
    twice = rows + [{**r, "timestamp": runs[1]} for r in rows if r["workload"] == "csa_h16"]
    with pytest.raises(ValueError, match="in two runs"):
        tune.kernel_choices(twice, run=runs)


def test_isa_default_follows_the_list_length(monkeypatch, capsys):
    """``isa --kernel default --tokens T --slots S`` compiles the kernel config=None picks for
    that list length (the shipped sm90 file splits H16 T = 4 by length); without --slots, the
    longest lists' kernel."""
    from sparse_mla import cli

    ran = []
    monkeypatch.setattr(cli, "_isa_kernel", lambda args, target: ran.append(args.kernel) or 0)
    base = ["isa", "--kernel", "default", "--target", "sm90", "--heads", "16", "--tokens", "4"]
    for extra in (["--slots", "640"], ["--slots", "3"], []):
        assert cli.main([*base, *extra]) == 0
    want = [dispatch.choose(dispatch.Call("sm90", 16, 512, num_tokens=4, nnz=4 * s)).kernel
            for s in (640, 3)]  # fmt: skip
    assert ran == [*want, want[0]] and want[0] != want[1], ran
    out = capsys.readouterr().out
    assert f"default: {want[0]} (recorded H16_D512 T in [2, 8) slots/token in [" in out
    assert cli.main(["isa", "--target", "sm90", "--heads", "16", "--slots", "3"]) == 2
    assert "--slots goes with --kernel default" in capsys.readouterr().err


def test_cli_exports_several_runs_and_says_which_kernel_by_list_length(
    tmp_path, monkeypatch, capsys
):  # fmt: skip
    from sparse_mla import cli

    runnable_everywhere(monkeypatch)
    files = []
    for ts, slots, ws, mma_ms in (("2026-12-02T10:00:00+00:00", 3, 0.008, 0.009),
                                  ("2026-12-02T11:00:00+00:00", 640, 0.020, 0.013)):  # fmt: skip
        rows = [_bench_row(p, 16, ms, T=4, ts=ts, workload=f"csa_h16_s{slots}", nnz=4 * slots,
                           config=cfg)
                for p, ms, cfg in (("triton", 0.1, None), (FAKE, ws, {"HEAD_GROUPS": 1}),
                                   ("gluon_mma", mma_ms, None))]  # fmt: skip
        path = tmp_path / f"run_{slots}.csv"
        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        files.append(str(path))
    root = tmp_path / "root"
    argv = ["export", *files, "--arch", "sm90", "--root", str(root), "--kernel-choice"]
    assert cli.main(argv) == 0, capsys.readouterr()
    e = configs.entries("sm90", root)["H16_D512"]
    assert [(c.name, c.tokens, c.slots) for c in e.kernels] == [
        (FAKE, (0, None), (0, 43)), ("gluon_mma", (0, None), (43, None))]  # fmt: skip
    assert e.kernels[0].provenance["source"] == " + ".join(files)
    capsys.readouterr()
    monkeypatch.setenv("SPARSE_MLA_CONFIG_DIR", str(root))
    argv = ["which", "--arch", "sm90", "--heads", "16", "--tokens", "4", "--slots", "3", "640"]
    assert cli.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split(": ")[1].split()[0] for ln in lines] == [FAKE, "gluon_mma"], lines
    assert lines[1].startswith("sm90 H=16 D=512 T=4 slots/token=640: gluon_mma (recorded")
    assert cli.main(["which", "--arch", "sm90", "--heads", "16", "--slots", "3"]) == 2
    assert "--slots goes with --tokens" in capsys.readouterr().err
    # --sms: the split count the chosen kernel runs with there (launch.call_splits)
    from sparse_mla.gluon import launch

    assert cli.main([*argv, "--sms", "132"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == f"  {FAKE} runs each list whole (no KV splits)", lines
    chosen = dispatch.choose(dispatch.Call.of_shape("sm90", 16, 512, num_tokens=4,
                                                    slots_per_token=640)).launch  # fmt: skip
    _, n = launch.call_splits("gluon_mma", chosen, 4, 16, 4 * 640, launch.get_target("sm90"), 132)
    assert n > 1 and lines[3] == (f"  gluon_mma splits each list {n} ways on 132 SMs, then "
                                  "combines (launch.split_plan)")  # fmt: skip
    # gluon_ws's split calls also say their build (L2_ROWS): T = 4 H128 on whole lists, the
    # shipped choice
    monkeypatch.delenv("SPARSE_MLA_CONFIG_DIR")
    call = dispatch.Call.of_shape("sm90", 128, 512, num_tokens=4, slots_per_token=1152)
    assert dispatch.choose(call).kernel == "gluon_ws"
    _, n = launch.call_splits("gluon_ws", dispatch.choose(call).launch, 4, 128, 4 * 1152,
                              launch.get_target("sm90"), 132)  # fmt: skip
    assert cli.main(["which", "--arch", "sm90", "--heads", "128", "--tokens", "4", "--slots",
                     "1152", "--sms", "132"]) == 0  # fmt: skip
    assert n > 1 and capsys.readouterr().out.splitlines()[1] == (
        f"  gluon_ws splits each list {n} ways on 132 SMs, its producer built with L2_ROWS "
        "(hopper_ws.l2_rows), then combines (launch.split_plan)")  # fmt: skip
    monkeypatch.setenv("SPARSE_MLA_CONFIG_DIR", str(root))
    assert cli.main(["which", "--arch", "sm90", "--heads", "16", "--tokens", "4",
                     "--sms", "132"]) == 2  # fmt: skip
    assert "--sms goes with --tokens and --slots" in capsys.readouterr().err
    # --table: the same choices, a row per token count and a column per list length
    argv = ["which", "--arch", "sm90", "--heads", "16", "--table", "--tokens", "4", "100",
            "--slots", "3", "640"]  # fmt: skip
    assert cli.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "sm90 H=16 D=512: the kernel config=None runs"
    assert [ln.split() for ln in lines[1:]] == [
        ["T", "\\", "slots/token", "3", "640"], ["4", FAKE, "gluon_mma"],
        ["100", FAKE, "gluon_mma"]]  # fmt: skip
    assert cli.main(["which", "--arch", "sm90", "--heads", "16", "--table", "-v"]) == 2
    assert "pick one" in capsys.readouterr().err
    assert cli.main(["export", *files, "--arch", "sm90", "--root", str(root)]) == 2
    assert "go with --kernel-choice" in capsys.readouterr().err
    # One file holding both runs: without --run only its latest is taken, and export says so
    both = tmp_path / "both.csv"
    with both.open("w", newline="") as f:
        f.write(Path(files[0]).read_text())
        f.write("".join(Path(files[1]).read_text().splitlines(keepends=True)[1:]))
    argv = ["export", str(both), "--arch", "sm90", "--root", str(root), "--kernel-choice",
            "--dry-run"]  # fmt: skip
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert "holds 2 runs; taking the latest, 2026-12-02T11:00:00+00:00" in err, err
    assert cli.main([*argv, "--run", "2026-12-02T10:00:00+00:00",
                     "--run", "2026-12-02T11:00:00+00:00"]) == 0  # fmt: skip
    assert "holds" not in capsys.readouterr().err


def test_rule_covers_every_grid_point_with_a_kernel_that_can_run_it():
    """On sm90, every (H, T) of the bench grid and the odd head counts get a Gluon kernel that
    says it can run the call; none of them falls to Triton; off sm90 the rule names nothing."""
    from sparse_mla.gluon import launch

    heads = [1, 2, 3, 4, 8, 12, 16, 17, 20, 24, 32, 33, 40, 48, 64, 65, 80, 96, 100, 112, 127, 128]
    for H in heads:
        for T in (1, 3, 64, 256, 1024, 4096, 16384):
            call = dispatch.Call("sm90", H, 512, torch.bfloat16, None, T, T * 640)
            names = dispatch.rule(call)
            assert names, H
            c = dispatch.choose(call, root=Path("/nonexistent"))
            assert c.kernel.startswith("gluon_ws"), (H, T, c)
            assert dispatch.KERNELS[c.kernel].unavailable(call) is None
            want = "gluon_ws_small" if H <= 32 or (H <= 64 and T < 128) else "gluon_ws"
            assert c.kernel == want, (H, T, c)
            tgt = launch.get_target("sm90")
            assert launch.why_not(c.kernel, c.launch, tgt, has_pe=False) is None
    assert dispatch.rule(dispatch.Call("gfx942", 16, 512)) == ()
    assert dispatch.choose(dispatch.Call("gfx942", 16, 512), root=Path("/x")).kernel == "triton"
    assert dispatch.choose(dispatch.Call(None, 64, 512)).kernel == "triton"


def test_describe_names_the_kernel_and_each_alternative():
    line = dispatch.describe("sm90", 20, 512, root=Path("/nonexistent"), num_tokens=1024)
    assert line.startswith("sm90 H=20 D=512 T=1024: gluon_ws_small (rule for sm90 H=20")
    text = dispatch.describe("sm90", 20, 512, root=Path("/nonexistent"), verbose=True)
    lines = text.splitlines()
    assert len(lines) == 1 + len(dispatch.KERNELS)
    assert any(ln.split()[:2] == ["gluon_ws_small", "runs"] for ln in lines[1:])
    assert any(ln.split()[:2] == ["triton", "can"] for ln in lines[1:])
    gfx = dispatch.describe("gfx942", 20, 512, root=Path("/nonexistent"), verbose=True)
    assert "gluon_ws " in gfx and "cannot: Gluon kernels have no gfx942" in gfx


def test_old_gluon_name_in_a_config_file_says_what_to_do(tmp_path):
    old = {"name": "gluon", "provenance": {**CHOICE_PROV, "times_ms": {"gluon": 1.0}}}
    _write(tmp_path, "sm90", {"H16_D512": _entry(old)})
    with pytest.raises(configs.ConfigFileError, match="four named kernels"):
        dispatch.choose(dispatch.Call("sm90", 16, 512), root=tmp_path)


def test_committed_sm90_choice_matches_the_grid_csv():
    """The sm90 kernel choices are the committed runs' (the grid's and the grids of long
    requests' steps, ``bench --grid --context``), recomputed here from the rows of the files
    and runs their provenance names; the rule and the recorded buckets send no grid point, at
    any list length, to Triton."""
    entries = configs.entries("sm90", configs.CONFIG_ROOT)
    recorded = {k: e.kernels for k, e in entries.items() if e.kernels}
    choices = [c for kernels in recorded.values() for c in kernels]
    sources = {c.provenance["source"] for c in choices}
    assert len(sources) == 1, sources
    source = sources.pop()
    rows = []
    for path in source.split(" + "):
        with (ROOT / path).open(newline="") as f:
            rows += list(csv.DictReader(f))
    runs = sorted({r for c in choices for r in c.provenance["run"].split(" + ")})
    again = tune.kernel_choices(rows, run=runs, source=source, arch="sm90")
    assert {configs.shape_key(H, D) for H, D in again} == set(recorded)
    for (H, D), picked in again.items():
        got = recorded[configs.shape_key(H, D)]
        assert [(c["name"], c["launch"], c["provenance"], c["tokens"], c["slots"])
                for c in picked] == [
            (k.name, k.launch, k.provenance, k.tokens, k.slots) for k in got
        ]  # fmt: skip
    for H in (1, 2, 3, 8, 16, 17, 20, 32, 33, 48, 64, 100, 128):
        for T in (1, 4, 64, 1024, 16384):
            for slots in (None, 1, 40, 640, 1152):
                nnz = None if slots is None else T * slots
                call = dispatch.Call("sm90", H, 512, num_tokens=T, nnz=nnz)
                assert dispatch.choose(call).kernel != "triton", (H, T, slots)


def test_recorded_choices_run_the_launch_the_bench_timed():
    """The entry runs each recorded sm90 choice with the launch its forced provider ran in the
    bench (``config=Choice(name)``: the kernel's default), the very object where the kernel's
    default is one, so a default that acts on the call acts on it too (``gluon_mma``'s trade
    of its head blocks for 16-head ones at small T). The device's first export by list length
    recorded the default's fields as a given launch: ``config=None`` then ran ``gluon_mma`` in
    64-head blocks at H 40-80, T = 1, 1.17-1.24x the forced kernel
    (``data/bench/nvidia-h200_list_length_verify_ca4e873.log``)."""
    from sparse_mla.gluon import launch as gluon_launch

    tgt = gluon_launch.get_target("sm90")
    checked = set()
    for key, e in configs.entries("sm90", configs.CONFIG_ROOT).items():
        H, D = configs.parse_shape_key(key)
        for c in e.kernels:
            T = c.tokens[0] if c.tokens else 16384
            slots = c.slots[0] if c.slots else 640
            call = dispatch.Call("sm90", H, D, num_tokens=max(T, 1), nnz=max(T, 1) * slots)
            got = dispatch.choose(call)
            forced = dispatch.choose(call, config=dispatch.Choice(c.name))
            assert (got.kernel, got.launch) == (c.name, forced.launch), (key, c.tokens, c.slots)
            if c.name == "gluon_mma":
                assert got.launch is gluon_launch.default_config(H, tgt), (key, c.tokens)
            checked.add(c.name)
    # gluon_wgmma has no recorded choice since the whole lists' export with gluon_ws's splits
    # (run 07:53:09): the split gluon_ws took its points (T = 8-32 at 96-128 heads)
    assert {"gluon_mma", "gluon_ws", "gluon_ws_small"} <= checked


def _package_imports(path: Path, *, module_level: bool = False) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in tree.body if module_level else ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level >= 1:
            mod = node.module or ""
            found |= {f"{mod}.{a.name}".strip(".") for a in node.names} if not mod else {mod}
    return found


def test_dependencies_run_one_way():
    pkg = ROOT / "sparse_mla"
    # configs imports nothing of the package when imported; reading a file asks the registry
    # whether a recorded kernel's own launch is one that kernel takes (one function).
    assert _package_imports(pkg / "configs.py", module_level=True) == set()
    assert _package_imports(pkg / "configs.py") == {"dispatch"}
    # dispatch imports configs and, at its end, the registrations; those import no kernel's
    # module at import (their callables import prefill / fp8_prefill on first use).
    assert _package_imports(pkg / "dispatch.py") == {"configs", "kernels"}
    regs = _package_imports(pkg / "kernels.py", module_level=True)
    assert regs.isdisjoint({"prefill", "fp8_prefill", "op", "bench", "tune", "inspect"}), regs
    assert {"configs", "dispatch"} <= _package_imports(pkg / "prefill.py")


@pytest.mark.gpu
@pytest.mark.parametrize("H", [8, 16, 20, 64, 100, 128])
@pytest.mark.parametrize("T, max_slots", [(3, 700), (3, 2400), (257, 700)])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_gpu_default_runs_the_chosen_kernel(H, T, max_slots, index_dtype, monkeypatch):
    """config=None runs the kernel choose() names for the call's head count, T and list length
    (at T = 3 both sides of the sm90 file's slot bounds: ~300 and ~600 slots a token)."""
    names = []
    for name, k in list(dispatch.KERNELS.items()):

        def run(*args, _k=k, _name=name):
            names.append(_name)
            return _k.run(*args)

        monkeypatch.setitem(dispatch.KERNELS, name, replace(k, run=run))
    case = make_case(T, H, 512, N=4000, max_slots=max_slots, device="cuda", seed=H,
                     index_dtype=index_dtype)  # fmt: skip
    _run(case)
    arch = runtime.arch()
    # The choice at this call's own list length (the entry's slots per token: nnz // T)
    nnz = case.kv_indices.numel()
    expected = dispatch.choose(dispatch.Call(arch, H, 512, num_tokens=T, nnz=nnz)).kernel
    if arch == "sm90":  # never Triton where a Gluon kernel can run
        assert expected.startswith("gluon_")
    assert names == [expected]


@pytest.mark.parametrize(
    "name", ["triton", "gluon_mma", "gluon_wgmma", "gluon_ws", "gluon_ws_small"]
)
def test_every_registered_kernel_cross_compiles_through_inspect(name):
    """Each kernel of the registry compiles for sm90 through one call of inspect, at a head
    count between the recorded ones; "default" compiles what the dispatch chooses there."""
    from sparse_mla import inspect

    assert name in dispatch.KERNELS
    got, res = inspect.compile_kernel(name, "sm90", num_heads=20, index_dtype="int64")
    assert got == name
    assert res.mix["wgmma"] + res.mix["mma"] > 0, res.mix
    assert res.resources.shared_bytes <= 227 * 1024
    if name.startswith("gluon_ws"):
        assert res.resources.spill_bytes == 0, res.resources
    chosen = dispatch.choose(dispatch.Call("sm90", 20, 512, num_tokens=64)).kernel
    assert inspect.compile_kernel("default", "sm90", num_heads=20, num_tokens=64)[0] == chosen


def test_compile_kernel_refuses_what_a_kernel_cannot_serve():
    from sparse_mla import inspect

    with pytest.raises(ValueError, match="gluon_ws cannot compile for gfx950"):
        inspect.compile_kernel("gluon_ws", "gfx950", num_heads=64)
    with pytest.raises(ValueError, match="not registered"):
        inspect.compile_kernel("gluon", "sm90")
    with pytest.raises(ValueError, match="takes no config"):
        inspect.compile_kernel("default", "sm90", config={"BLOCK_K": 32})


def test_recorded_kernel_that_cannot_run_falls_to_the_rule(tmp_path, monkeypatch):
    """A recorded kernel that cannot run the call hands it to the rule's next kernel, and the
    reason says why the recorded one was passed over."""
    ws = dispatch.KERNELS["gluon_ws"]
    monkeypatch.setitem(dispatch.KERNELS, "gluon_ws", replace(ws, unavailable=lambda c: "off"))
    rec = {"name": "gluon_ws", "provenance": {**CHOICE_PROV, "times_ms": {"gluon_ws": 1.0}}}
    _write(tmp_path, "sm90", {"H64_D512": _entry(rec)})
    c = dispatch.choose(dispatch.Call("sm90", 64, 512, num_tokens=4096), root=tmp_path)
    assert c.kernel == "gluon_wgmma", c
    assert "gluon_ws recorded, but off" in c.reason and c.reason.startswith("rule for sm90 H=64")


def test_ws_small_call_decision():
    """``gluon_ws`` takes the small-call order when each program's share of kv_indices is at
    most SMALL_IDS ids, never for an empty call."""
    from sparse_mla.gluon import hopper_ws

    n = hopper_ws.SMALL_IDS
    assert hopper_ws.small_call(n * 132, 132)
    assert not hopper_ws.small_call(n * 132 + 1, 132)
    assert hopper_ws.small_call(1, 1) and not hopper_ws.small_call(0, 132)
    # DSv4 CSA at H64 on 132 SMs: T=256 (about 200 slots a token) is small, T=16384 is not.
    assert hopper_ws.small_call(256 * 200, 132) and not hopper_ws.small_call(16384 * 600, 132)


def test_the_registry_is_whole_whichever_module_comes_first():
    """sparse_mla.kernels registers the package's kernels when dispatch is imported, whichever
    module a process imports first (the entry imports dispatch, which imports the
    registrations, whose callables import the entry lazily); the registry itself is a dict
    whose only overrides clear the choice cache (no import on read)."""
    import subprocess
    import sys

    from sparse_mla import fp8_prefill, kernels

    names = {
        "gluon_mma",
        "gluon_wgmma",
        "gluon_ws",
        "gluon_ws_small",
        "triton",
        "triton_fp8",
        "gluon_ws_small_fp8",
        "gluon_ws_fp8",
    }
    for first in ("sparse_mla.dispatch", "sparse_mla.prefill", "sparse_mla.fp8_prefill"):
        code = (f"import {first}, sys; from sparse_mla import dispatch; "
                "print(' '.join(sorted(dispatch.KERNELS)))")  # fmt: skip
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=300, cwd=ROOT)  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert set(r.stdout.split()) == names, (first, r.stdout)
    own = {n for n, v in vars(type(dispatch.KERNELS)).items() if callable(v)}
    assert own == {"__setitem__", "__delitem__"}, own
    assert kernels.FP8_NAME == fp8_prefill.NAME
    assert dispatch.kernel("triton").run.__name__ == "prefill._run_triton"
