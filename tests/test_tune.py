"""Sweeps (compile-only ranking, time-mode gate), CSV rows, and atomic export into configs/."""

from __future__ import annotations

import json
import multiprocessing as mp

import pytest
from conftest import make_case, poisoned_like

from sparse_mla import cli, configs, prefill, runtime, tune
from sparse_mla.reference import check_against_reference

PROV = {"device": "NVIDIA H200", "triton": "3.6.0", "workload": "test wl"}


def _row(H, D, time_ms, **launch):
    base = {"BLOCK_H": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2, "USE_EXP2": True}
    return {
        "target": "sm90", "H": H, "D": D, "mode": "time", "status": "ok", "time_ms": time_ms,
        "sweep_size": 4, "device": "NVIDIA H200", "triton": "3.6.0", "torch": "2.11.0",
        "date": "2026-11-29", "workload": "csa T=16384", **base, **launch,
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Grid and planning
# ---------------------------------------------------------------------------------------------


def test_grid_parsing_and_sampling():
    grid = tune.parse_grid(["BLOCK_K=16,32", "num_warps=1,2,4", "EVEN_HD=true,none"])
    assert grid == {"BLOCK_K": [16, 32], "num_warps": [1, 2, 4], "EVEN_HD": [True, None]}
    full = tune.expand_grid(grid)
    assert len(full) == 12 and {"BLOCK_K": 32, "num_warps": 4, "EVEN_HD": None} in full
    sub = tune.expand_grid(grid, sample=5, seed=3)
    assert len(sub) == 5 and all(c in full for c in sub)
    assert sub == tune.expand_grid(grid, sample=5, seed=3)
    assert sub != tune.expand_grid(grid, sample=5, seed=4)
    for bad in (["BLOCK_M=16"], ["BLOCK_K"], ["BLOCK_K=x"]):
        with pytest.raises(ValueError, match="grid"):
            tune.parse_grid(bad)


def test_invalid_configs_become_rows_not_crashes():
    rows = tune.sweep({"BLOCK_K": [8, 16], "kpack": [2]}, [(16, 512)], ["gfx950"], jobs=0)
    by = {r["BLOCK_K"]: r for r in rows}
    assert [r["status"] for r in rows] == ["invalid", "invalid"]
    assert "power of two" in by[8]["reason"]
    assert "kpack=2 is a gfx942 option" in by[16]["reason"]
    # On sm90 kpack is dropped (an AMD option); H=8 with BLOCK_H=16 cannot fold the head mask.
    grid = {"BLOCK_H": [16], "EVEN_HD": [True], "kpack": [1, 2]}
    rows = tune.sweep(grid, [(8, 512)], ["sm90"], jobs=0, progress=False)
    assert len(rows) == 1 and rows[0]["kpack"] is None
    assert rows[0]["status"] == "invalid" and "EVEN_HD" in rows[0]["reason"]
    assert rows[0]["rank"] is None


def test_compile_errors_become_rows(monkeypatch):
    from sparse_mla import inspect

    def broken(*a, **k):
        raise RuntimeError("PassManager::run failed\nout of registers")

    monkeypatch.setattr(inspect, "compile_prefill", broken)
    grid = {"BLOCK_H": [16, 64], "BLOCK_K": [16]}
    rows = tune.sweep(grid, [(16, 512)], ["gfx942"], jobs=0, progress=False)
    assert [r["status"] for r in rows] == ["error", "skipped"]
    assert rows[0]["reason"] == "RuntimeError: out of registers"
    assert "masked" in rows[1]["reason"]


def test_compile_sweep_ranks_spilling_config_last(tmp_path, capsys):
    # gfx942, D=512, a 16x16 tile: with 4 warps it fits the registers; with 1 warp (64 lanes
    # hold the whole tile) it spills to scratch. Two processes compile them in parallel.
    grid = {"BLOCK_H": [16], "BLOCK_K": [16], "num_warps": [1, 4], "kpack": [2]}
    rows = tune.sweep(grid, [(16, 512)], ["gfx942"], jobs=2, progress=True)
    grid_rows = {(r["BLOCK_H"], r["BLOCK_K"], r["num_warps"]): r for r in rows}
    spill, fits = grid_rows[16, 16, 1], grid_rows[16, 16, 4]
    assert spill["status"] == fits["status"] == "ok", (spill["reason"], fits["reason"])
    assert spill["spill_bytes"] > 0 and fits["spill_bytes"] == 0
    assert fits["rank"] < spill["rank"]
    ok = [r for r in rows if r["status"] == "ok"]
    assert [r["rank"] for r in ok] == list(range(1, len(ok) + 1))
    assert [r["spill_bytes"] > 0 for r in ok] == sorted(r["spill_bytes"] > 0 for r in ok)
    err = capsys.readouterr().err  # our own line, or tqdm's bar where tqdm is installed
    assert "sweep (compile)" in err and "2/2" in err
    best = tune.best_per_shape(rows)[("gfx942", 16, 512)]
    assert best["spill_bytes"] == 0 and best["rank"] == 1
    # CSV round trip keeps the types.
    path = tune.save_rows(rows, tmp_path / "sweeps" / "x.csv")
    back = tune.load_rows(path)
    assert [{k: r[k] for k in tune.COLUMNS} for r in back] == [
        {k: r[k] for k in tune.COLUMNS} for r in rows
    ]


# ---------------------------------------------------------------------------------------------
# Time mode (the GPU path; its worker runs on CPU tensors here with a stand-in timer)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("workload", [{"name": "dsv4_csa", "T": 24, "topk": 16, "window": 8}])
def test_time_job_gates_on_correctness(monkeypatch, workload):
    timed = []
    monkeypatch.setattr(tune, "_bench", lambda fn: timed.append(fn) or 0.5)
    job = {
        "target": "sm90", "H": 16, "D": 64, "dtype": "bf16", "_device": "cpu",
        "_params": {"BLOCK_H": 16, "BLOCK_K": 16, "USE_EXP2": False}, "_workload": workload,
    }  # fmt: skip
    row = tune._time_job(job)
    assert row["status"] == "ok", row["reason"]
    assert row["time_ms"] == 0.5 and row["rel_l2"] < 1e-2 and len(timed) == 1
    assert "csa" in row["workload"] and "T=24" in row["workload"]

    real = prefill.sparse_mla_prefill

    def off_by_a_bit(*args, out, **kw):
        real(*args, out=out, **kw)
        out[-1, 0, 0] += 1.0  # one wrong element in the checked tokens
        return out

    monkeypatch.setattr(prefill, "sparse_mla_prefill", off_by_a_bit)
    row = tune._time_job(job)
    assert row["status"] == "fail" and row["reason"].startswith("correctness")
    assert row.get("time_ms") is None and len(timed) == 1


def test_time_job_builtin_random_workload(monkeypatch):
    monkeypatch.setattr(tune, "_bench", lambda fn: 2.0)
    job = {
        "target": "sm90", "H": 8, "D": 64, "dtype": "fp16", "_device": "cpu",
        "_params": {"BLOCK_K": 32},
        "_workload": {"name": "random", "T": 6, "slots": 40, "pool": 50},
    }  # fmt: skip
    row = tune._time_job(job)
    assert row["status"] == "ok", row["reason"]
    assert row["workload"].startswith("random CSR T=6")


def test_time_mode_needs_a_gpu(monkeypatch):
    monkeypatch.setattr(runtime, "arch", lambda *a: None)
    with pytest.raises(RuntimeError, match="needs a GPU"):
        tune.sweep({"BLOCK_K": [16]}, [(16, 512)], ["sm90"], mode="time", progress=False)


@pytest.mark.gpu
def test_time_sweep_on_gpu(tmp_path):
    rows = tune.sweep(
        {"BLOCK_K": [16, 32]}, [(16, 512)], ["local"], mode="time",
        workload={"name": "dsv4_csa", "T": 1024}, progress=False,
    )  # fmt: skip
    assert [r["status"] for r in rows] == ["ok", "ok"], [r["reason"] for r in rows]
    assert rows[0]["time_ms"] <= rows[1]["time_ms"] and rows[0]["rank"] == 1
    for r in rows:  # resources of the launched kernel, as compile mode reports them
        assert r["registers"] > 0 and r["occupancy"] > 0 and r["spill_bytes"] == 0, r
        assert r["shared_bytes"] > 0
    diff = tune.export(tune.best_per_shape(rows).values(), rows[0]["target"], root=tmp_path)
    assert "H16_D512" in diff


# ---------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------


def test_export_into_empty_then_existing_file(tmp_path):
    path = configs.config_path("sm90", tmp_path)
    diff = tune.export([_row(16, 512, 1.2, BLOCK_K=64)], "sm90", root=tmp_path)
    assert path.exists() and "/dev/null" in diff and '+    "launch": {' in diff
    entry = configs.lookup_entry("sm90", 16, 512, root=tmp_path)
    assert entry.launch.BLOCK_K == 64
    assert entry.provenance["time_ms"] == 1.2 and entry.provenance["device"] == "NVIDIA H200"

    best = tune.best_per_shape(
        [_row(64, 512, 3.0, BLOCK_H=64), _row(64, 512, 2.5, BLOCK_H=32), _row(8, 512, 0.9)]
    )
    diff = tune.export(best, "sm90", root=tmp_path, provenance={"source": "test"})
    assert '+  "H64_D512": {' in diff and '+  "H8_D512": {' in diff
    assert not any(ln.startswith("-") and "H16" in ln for ln in diff.splitlines())
    data = json.loads(path.read_text())
    assert list(data) == ["H8_D512", "H16_D512", "H64_D512"]  # H16 kept, ordered by shape
    assert data["H64_D512"]["launch"]["BLOCK_H"] == 32  # the faster row
    assert data["H64_D512"]["provenance"]["source"] == "test"
    assert data["H16_D512"]["launch"]["BLOCK_K"] == 64

    before = path.read_text()
    assert tune.export([_row(8, 512, 0.1, BLOCK_K=16)], "sm90", root=tmp_path, dry_run=True)
    assert path.read_text() == before
    assert tune.export([_row(16, 512, 1.2, BLOCK_K=64)], "sm90", root=tmp_path) == ""
    with pytest.raises(ValueError, match="gfx942"):
        tune.export([{**_row(16, 512, 1.0), "target": "gfx942"}], "sm90", root=tmp_path)
    assert not list(path.parent.glob("*.tmp"))


def test_export_writes_through_a_symlinked_file(tmp_path):
    shared = tmp_path / "shared"
    tune.export([_row(16, 512, 1.0)], "sm90", root=shared)
    target = configs.config_path("sm90", shared)
    target.chmod(0o640)
    link = configs.config_path("sm90", tmp_path / "deploy")
    link.parent.mkdir(parents=True)
    link.symlink_to(target)
    diff = tune.export([_row(8, 512, 0.5, BLOCK_K=16)], "sm90", root=tmp_path / "deploy")
    assert str(target) in diff and '+  "H8_D512": {' in diff
    assert link.is_symlink() and link.resolve() == target  # still a link, to the same file
    assert set(json.loads(target.read_text())) == {"H8_D512", "H16_D512"}
    assert oct(target.stat().st_mode & 0o777) == oct(0o640)  # its mode kept
    assert configs.lookup("sm90", 8, 512, root=shared).BLOCK_K == 16


def test_export_refuses_read_only_and_dangling_files(tmp_path):
    import os

    tune.export([_row(16, 512, 1.0)], "sm90", root=tmp_path)
    path = configs.config_path("sm90", tmp_path)
    before = path.read_text()
    path.chmod(0o444)
    with pytest.raises(configs.ConfigFileError, match="read-only for this user") as err:
        tune.export([_row(8, 512, 0.5)], "sm90", root=tmp_path)
    assert str(path) in str(err.value)
    assert path.read_text() == before and path.stat().st_mode & 0o777 == 0o444
    if os.geteuid() == 0:  # another user's file without a write bit for us: refused, root too
        path.chmod(0o644)
        os.chown(path, 65534, 65534)
        with pytest.raises(configs.ConfigFileError, match="owner uid 65534"):
            tune.export([_row(8, 512, 0.5)], "sm90", root=tmp_path)
        assert path.read_text() == before and path.stat().st_uid == 65534
    link = configs.config_path("sm90", tmp_path / "dangling")
    link.parent.mkdir(parents=True)
    link.symlink_to(tmp_path / "gone.json")
    with pytest.raises(configs.ConfigFileError, match="symlink that leads to no file"):
        tune.export([_row(8, 512, 0.5)], "sm90", root=tmp_path / "dangling")
    assert link.is_symlink() and not (tmp_path / "gone.json").exists()


def test_export_of_a_deeply_nested_file_names_it(tmp_path):
    path = configs.config_path("sm90", tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(configs.ConfigFileError, match="nested too deeply") as err:
        tune.export([_row(8, 512, 0.5)], "sm90", root=tmp_path)
    assert str(path) in str(err.value)


def test_export_refuses_compile_only_winners_over_timed_entries(tmp_path):
    tune.export([_row(16, 512, 1.0)], "sm90", root=tmp_path)  # a timed entry
    path = configs.config_path("sm90", tmp_path)
    before = path.read_text()
    compiled = {**_row(16, 512, None, BLOCK_K=16), "mode": "compile", "spill_bytes": 0}
    with pytest.raises(ValueError, match=r"compile-only.*would replace timed entries"):
        tune.export([compiled], "sm90", root=tmp_path)
    assert path.read_text() == before
    # Said explicitly, it goes through (as --allow-compile-only does on the CLI).
    assert "H16_D512" in tune.export([compiled], "sm90", root=tmp_path, allow_compile_only=True)
    assert configs.lookup("sm90", 16, 512, root=tmp_path).BLOCK_K == 16
    # A compile-only winner for a shape with no entry is refused too, without the "timed" part.
    with pytest.raises(ValueError, match=r"\['H8_D512'\] were ranked by compile-only") as e:
        tune.export([{**compiled, "H": 8}], "sm90", root=tmp_path)
    assert "would replace" not in str(e.value)


def _tree(root):
    return sorted((str(p.relative_to(root)), p.stat().st_size) for p in root.rglob("*"))


def test_cli_export_dry_run_leaves_the_tree_untouched(tmp_path, capsys):
    timed = tmp_path / "timed.csv"
    tune.save_rows([_row(16, 512, 1.0, BLOCK_K=16)], timed)
    root = tmp_path / "cfg"
    # Into a root that does not exist yet: no folder, no lock file, no config file.
    before = _tree(tmp_path)
    argv = ["export", str(timed), "--arch", "sm90", "--root", str(root), "--dry-run"]
    assert cli.main(argv) == 0
    assert '+  "H16_D512": {' in capsys.readouterr().out
    assert _tree(tmp_path) == before and not root.exists()
    # Into an existing file: the file, its folder and the lock file stay as they were.
    tune.export([_row(8, 512, 0.5)], "sm90", root=root)
    lock = configs.config_path("sm90", root).with_suffix(".json.lock")
    lock.unlink(missing_ok=True)
    before = _tree(tmp_path)
    assert cli.main(argv) == 0
    assert _tree(tmp_path) == before


def test_export_refuses_invalid_entry_and_keeps_file(tmp_path):
    tune.export([_row(16, 512, 1.0)], "sm90", root=tmp_path)
    path = configs.config_path("sm90", tmp_path)
    before = path.read_text()
    with pytest.raises(configs.ConfigFileError, match="EVEN_HD"):
        tune.export([_row(8, 512, 1.0, EVEN_HD=True)], "sm90", root=tmp_path)
    assert path.read_text() == before


def _export_many(root, worker, n):
    for i in range(n):
        H = 16 * (worker * n + i + 1)
        tune.export([_row(H, 512, 1.0 + i)], "sm90", root=root, provenance=PROV)


def test_concurrent_exports_lose_nothing(tmp_path):
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_export_many, args=(tmp_path, w, 6)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * 4
    found = configs.entries("sm90", tmp_path)
    assert sorted(found) == sorted(f"H{16 * k}_D512" for k in range(1, 25))


def test_reload_launcher_uses_exported_entry(tmp_path, monkeypatch):
    # The launcher looks configs up only with an arch (GPU); pretend one, run in the interpreter.
    monkeypatch.setattr(configs, "CONFIG_ROOT", tmp_path)
    real_resolve = prefill.resolve_config
    monkeypatch.setattr(
        prefill, "resolve_config", lambda H, D, config, arch: real_resolve(H, D, config, "sm90")
    )
    seen = []
    real_launch = runtime.launch

    def spy(kernel, grid, *args, **kw):
        seen.append({**kw, "grid": grid})
        return real_launch(kernel, grid, *args, **kw)

    monkeypatch.setattr(runtime, "launch", spy)
    case = make_case(3, 16, 64, N=40, max_slots=20, seed=11)

    def run():
        out = poisoned_like(case.q)
        sparse_mla_out = prefill.sparse_mla_prefill(*case.args(), attn_sink=case.attn_sink, out=out)
        rep = check_against_reference(sparse_mla_out, *case.args(), attn_sink=case.attn_sink)
        assert rep.ok, rep
        return seen[-1]

    default = prefill.default_config(16, 64)
    assert run()["BLOCK_K"] == default.BLOCK_K == 32  # no file yet: default launch

    tune.export([_row(16, 64, 0.2, BLOCK_K=16, num_warps=2, USE_EXP2=False)], "sm90", root=tmp_path)
    kw = run()
    assert (kw["BLOCK_K"], kw["num_warps"], kw["USE_EXP2"], kw["EVEN_HD"]) == (16, 2, False, True)

    tune.export([_row(16, 64, 0.1, BLOCK_K=64, num_stages=3)], "sm90", root=tmp_path)
    kw = run()
    assert (kw["BLOCK_K"], kw["num_stages"], kw["USE_EXP2"]) == (64, 3, True)
    # config= still overrides the tuned entry.
    prefill.sparse_mla_prefill(*case.args(), attn_sink=case.attn_sink, config={"BLOCK_K": 128})
    assert seen[-1]["BLOCK_K"] == 128


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def test_cli_sweep_and_export(tmp_path, capsys):
    csv = tmp_path / "all_invalid.csv"
    argv = ["sweep", "--target", "gfx950", "--heads", "8,16", "--grid", "kpack=2"]
    assert cli.main([*argv, "--out", str(csv), "--no-progress"]) == 1
    rows = tune.load_rows(csv)
    assert [(r["H"], r["status"]) for r in rows] == [(8, "invalid"), (16, "invalid")]
    assert "2 invalid" in capsys.readouterr().out

    timed = tmp_path / "timed.csv"
    tune.save_rows([_row(16, 512, 2.0), _row(16, 512, 1.0, BLOCK_K=16)], timed)
    root = tmp_path / "cfg"
    assert cli.main(["export", str(timed), "--arch", "sm90", "--root", str(root)]) == 0
    assert f"+++ {configs.config_path('sm90', root)}" in capsys.readouterr().out
    assert configs.lookup("sm90", 16, 512, root=root).BLOCK_K == 16

    compiled = tmp_path / "compiled.csv"
    tune.save_rows([{**_row(8, 512, None), "mode": "compile", "spill_bytes": 0}], compiled)
    assert cli.main(["export", str(compiled), "--arch", "sm90", "--root", str(root)]) == 1
    assert "--allow-compile-only" in capsys.readouterr().err
    assert configs.lookup("sm90", 8, 512, root=root) is None


def test_a_config_ptxas_refuses_is_one_quiet_row(capsys):
    # maxnreg=128 cannot hold a [64, 512] fp32 accumulator in 4 warps: ptxas refuses, and
    # Triton 3.6 prints the whole PTX to stdout. The sweep keeps that out of its output and
    # gives ptxas's own message as the reason.
    rows = tune.sweep(
        {"BLOCK_H": [64], "BLOCK_K": [32], "num_warps": [4], "maxnreg": [128]},
        [(64, 512)], ["sm90"], mode="compile", jobs=0, progress=False,
    )  # fmt: skip
    (row,) = rows
    assert row["status"] == "error"
    assert (
        row["reason"].startswith("ptxas (stage cubin) failed: ptxas")
        and "registers" in row["reason"]
    )
    out = capsys.readouterr().out
    assert ".entry" not in out and "reproducer" not in out, out[:500]


class _StandInKernel:
    """A kernel whose warmup returns a token and whose launch must not happen."""

    def __init__(self, token):
        self.token, self.warmups = token, []

    def warmup(self, *args, grid, **kwargs):
        self.warmups.append((grid, args, kwargs))
        return self.token

    def __getitem__(self, grid):
        raise AssertionError("a compile-only call launched the kernel")


def test_compile_only_catches_both_launch_routes():
    # Every GPU launch of the package goes through fastlaunch's Launcher; runtime.launch is the
    # other route. Compile-only sees both (the time sweep's resource columns come from this),
    # launches neither and puts both back.
    from sparse_mla import fastlaunch, op

    direct, plain = _StandInKernel("direct"), _StandInKernel("plain")
    kw = fastlaunch.frozen(BLOCK=16)
    real_launch, real_call = runtime.launch, fastlaunch.Launcher.__call__

    def fn():
        assert not op.plans_enabled()  # a plan replay would bypass both routes
        runtime.launch(plain, (2,), 1, interpret=False, BLOCK=8)
        fastlaunch.launcher(direct)((3, 1), (5, 6), kw)

    assert tune._compile_only(fn) == "direct"
    assert plain.warmups == [((2,), (1,), {"BLOCK": 8})]
    assert direct.warmups == [((3, 1), (5, 6), {"BLOCK": 16})]
    assert runtime.launch is real_launch and fastlaunch.Launcher.__call__ is real_call
    assert op.plans_enabled()
    # A call that launches nothing compiles nothing.
    assert tune._compile_only(lambda: None) is None
