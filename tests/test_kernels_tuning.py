"""Every registered kernel through the tuning tools: `kernels`, `isa --kernel`, `sweep
--kernel`, export of another kernel's launch read back by the dispatch (issue 23).

The per-(kernel, target) test compiles each kernel's base launch and one other value of one
knob (two compiles; the in-memory cache serves the `isa` and the sweep's shared point)."""

from __future__ import annotations

import json

import pytest

from sparse_mla import configs, dispatch, tune
from sparse_mla.cli import main

PAIRS = [(name, t) for name in dispatch.KERNELS for t in tune.kernel_targets(name)]


def _heads(name: str) -> int:
    # A shape every kernel serves at its default (gluon_ws: 64 heads on wgmma's M).
    return 64 if name in ("gluon_ws", "gluon_wgmma", "gluon_ws_fp8") else 16


def test_kernels_json_lists_the_registry(capsys):
    assert main(["kernels", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [k["name"] for k in listed] == list(dispatch.KERNELS)
    for k in listed:
        reg = dispatch.KERNELS[k["name"]]
        assert k["knobs"] == {f: list(v) for f, v in reg.knobs.items()}
        assert k["targets"] and set(k["targets"]) <= {"sm90", "sm100", "gfx942", "gfx950"}
        assert k["summary"] == reg.summary
        assert k["kv_format"] == reg.kv_format and k["dense_ids"] is reg.dense_ids
    assert main(["kernels"]) == 0
    text = capsys.readouterr().out
    for name, reg in dispatch.KERNELS.items():
        assert f"{name}  [" in text
        block = text.split(f"{name}  [", 1)[1].split("\n")[2]  # the "reads:" line
        want = "as they are" if reg.dense_ids else "packs dense ids to CSR"
        assert block.startswith("  reads: ") and want in block, (name, block)


def _two_points(name: str, target: str, H: int) -> dict[str, list]:
    """The base launch's value of the first knob plus another allowed value that the kernel
    takes at (target, H) (empty grid: the kernel has no knob yet)."""
    base, _ = tune.base_launch(name, target, H)
    for knob, allowed in dispatch.kernel(name).knobs.items():
        if name == "triton" and knob == "BLOCK_H":
            continue  # a head block past H=16 is a "skipped" row (all its extra rows masked)
        now = getattr(base, knob)
        for v in allowed:
            if v == now:
                continue
            try:
                tune.kernel_launch(name, target, H, knobs={knob: v}, base=base)
            except ValueError:
                continue
            return {knob: [now, v]}
    return {}


@pytest.mark.parametrize("name,target", PAIRS, ids=[f"{n}-{t}" for n, t in PAIRS])
def test_isa_by_line_and_sweep_for_every_kernel_and_target(name, target, capsys, tmp_path):
    H = _heads(name)
    rc = main(["isa", "--kernel", name, "--target", target, "--heads", str(H), "--by-line"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "registers" in out or "VGPRs" in out or "arch VGPRs" in out
    assert "instructions by kernel source line" in out
    grid = _two_points(name, target, H)
    argv = ["sweep", "--kernel", name, "--target", target, "--heads", str(H), "--jobs", "0",
            "--no-progress", "--out", str(tmp_path / "s.csv")]  # fmt: skip
    for knob, values in grid.items():
        argv += ["--grid", f"{knob}={','.join(str(v).lower() for v in values)}"]
    assert main(argv) == 0, capsys.readouterr()
    rows = tune.load_rows(tmp_path / "s.csv")
    want = max(1, len(next(iter(grid.values()), [])))
    assert len(rows) == want
    assert all(r["status"] == "ok" and r["kernel"] == name for r in rows), rows
    assert sorted(r["rank"] for r in rows) == list(range(1, want + 1))
    assert all(r["registers"] and r["occupancy"] is not None for r in rows)
    if grid:
        knob, values = next(iter(grid.items()))
        assert sorted(str(r["launch"][knob]) for r in rows) == sorted(str(v) for v in values)


def test_a_refused_launch_says_why_before_compiling(capsys, tmp_path, monkeypatch):
    from sparse_mla import inspect as si

    def no_compile(*a, **k):
        raise AssertionError("compiled a launch the kernel refuses")

    monkeypatch.setattr(si, "compile", no_compile)
    rc = main(["isa", "--kernel", "gluon_wgmma", "--target", "sm90", "--heads", "64",
               "--set", "num_stages=4"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 1 and "shared memory" in err and "num_stages" in err
    rc = main(["isa", "--kernel", "gluon_ws_small", "--target", "sm90", "--set", "NOPE=1"])
    assert rc == 2 and "has no such knob" in capsys.readouterr().err
    rows = tune.sweep_kernel("gluon_ws_small", {"HEAD_GROUPS": [3]}, [(16, 512)], "sm90",
                             jobs=0, progress=False)  # fmt: skip
    assert rows[0]["status"] == "invalid" and "HEAD_GROUPS" in rows[0]["reason"]
    with pytest.raises(ValueError, match="does not compile for gfx942"):
        tune.sweep_kernel("gluon_ws", {}, [(64, 512)], "gfx942", jobs=0, progress=False)


def _timed_row(name: str, launch: dict, H: int, T: int | None = None) -> dict:
    """A time-mode row as `sweep_kernel` writes it on a GPU (the export under test reads it)."""
    return {"kernel": name, "target": "sm90", "H": H, "D": 512, "mode": "time", "status": "ok",
            "time_ms": 0.25, "launch": json.dumps(launch), "device": "NVIDIA H200",
            "date": "2026-12-01", "triton": "3.6.0", "torch": "2.11", "T": T,
            "workload": "dsv4_csa T=4096"}  # fmt: skip


def test_export_a_gluon_launch_and_the_dispatch_runs_it(tmp_path):
    root = tmp_path / "cfg"
    # A shape without an entry: the choice serves every T, Triton's default stands beside it.
    diff = tune.export([_timed_row("gluon_ws_small", {"HEAD_GROUPS": 2}, 24)], "sm90", root=root)
    assert "gluon_ws_small" in diff
    for T in (1, 64, 100000, None):
        c = dispatch.choose(dispatch.Call("sm90", 24, 512, num_tokens=T), root=root)
        assert c.kernel == "gluon_ws_small" and c.launch.HEAD_GROUPS == 2, c
        assert c.reason.startswith("recorded")
    entry = configs.lookup_entry("sm90", 24, 512, root)
    assert entry.provenance["mode"] == "default"
    # A shape whose entry records token buckets: only the bucket holding T changes (each of its
    # choices where it is split by list length, their slots kept: the shipped H64 entry's first
    # bucket is).
    shipped = configs.lookup_entry("sm90", 64, 512)
    assert shipped is not None and len(shipped.kernels) > 1
    (root / "sm90").mkdir(parents=True, exist_ok=True)
    path = configs.config_path("sm90", root)
    data = json.loads(path.read_text())
    data["H64_D512"] = shipped.to_json()
    path.write_text(configs.dump_entries(data))
    first = shipped.kernels[0]
    T = first.tokens[0] + 1
    tune.export([_timed_row("gluon_ws", {}, 64, T)], "sm90", root=root)
    got = configs.lookup_entry("sm90", 64, 512, root)
    inside = [c for c in shipped.kernels if c.tokens == first.tokens]
    assert len(inside) > 1 and {c.slots for c in inside} != {None}
    assert [(c.name, c.tokens, c.slots) for c in got.kernels[: len(inside)]] == [
        ("gluon_ws", c.tokens, c.slots) for c in inside
    ]
    assert got.kernels[len(inside) :] == shipped.kernels[len(inside) :]
    assert dispatch.choose(dispatch.Call("sm90", 64, 512, num_tokens=T), root=root).kernel == (
        "gluon_ws"
    )


def test_export_refuses_a_compile_only_kernel_row(tmp_path):
    row = _timed_row("gluon_ws_small", {"HEAD_GROUPS": 1}, 16) | {"mode": "compile"}
    with pytest.raises(ValueError, match="no measured time"):
        tune.export([row], "sm90", root=tmp_path)
    assert not configs.config_path("sm90", tmp_path).exists()


def test_cli_export_of_a_gluon_sweep_csv(tmp_path, capsys):
    csv = tmp_path / "rows.csv"
    tune.save_rows([_timed_row("gluon_ws_small", {"HEAD_GROUPS": 1}, 8) | {"rank": 1}], csv)
    assert main(["export", str(csv), "--arch", "sm90", "--root", str(tmp_path / "r")]) == 0
    c = dispatch.choose(dispatch.Call("sm90", 8, 512), root=tmp_path / "r")
    assert (c.kernel, c.launch.HEAD_GROUPS) == ("gluon_ws_small", 1)


def test_progress_goes_to_stdout_in_jupyter(monkeypatch, capsys):
    monkeypatch.setattr(tune, "_in_jupyter", lambda: True)
    monkeypatch.setitem(__import__("sys").modules, "tqdm", None)  # the plain line
    bar = tune._Progress(2, "sweep", True)
    bar.update("ok")
    bar.update("invalid")
    bar.close()
    got = capsys.readouterr()
    assert "2/2 (1 not ok)" in got.out and got.err == ""
    monkeypatch.setattr(tune, "_in_jupyter", lambda: False)
    tune._Progress(1, "sweep", True).update("ok")
    assert "1/1" in capsys.readouterr().err


@pytest.mark.gpu
def test_time_sweep_of_a_gluon_kernel_with_the_error_check(tmp_path):
    from sparse_mla import runtime

    if runtime.arch() != "sm90":
        pytest.skip("the Gluon warp-specialised kernels run on sm90")
    name = "gluon_ws_small"
    knob, values = next(iter(dispatch.kernel(name).knobs.items()))
    rows = tune.sweep_kernel(
        name, {knob: list(values)}, [(16, 512)], "local", mode="time", jobs=0, progress=False,
        workload={"name": "random", "T": 512, "slots": 640, "pool": 8192},
    )  # fmt: skip
    ok = [r for r in rows if r["status"] == "ok"]
    assert ok, rows
    for r in ok:
        assert r["time_ms"] > 0 and r["rel_l2"] is not None and r["rel_l2"] < 2e-2
    tune.save_rows(rows, tmp_path / "t.csv")
    best = tune.best_per_shape(tune.load_rows(tmp_path / "t.csv"))
    tune.export(best.values(), "sm90", root=tmp_path / "r")
    c = dispatch.choose(dispatch.Call("sm90", 16, 512, num_tokens=512), root=tmp_path / "r")
    win = min(ok, key=lambda r: r["time_ms"])
    assert c.kernel == name and getattr(c.launch, knob) == win[knob]


# The time path of sweep_kernel, on CPU: a registered stand-in kernel runs the Triton kernel in
# the interpreter (a Gluon kernel has no interpreter) or writes a wrong result; do_bench is
# replaced by a counter (it needs a GPU). The real thing: the gpu-marked test above.
def _stand_in(name: str, wrong: bool):
    from dataclasses import dataclass

    from sparse_mla import prefill

    @dataclass(frozen=True)
    class StandInConfig:
        BLOCK_K: int = 32

        def validate(self):
            if self.BLOCK_K not in (16, 32):
                raise ValueError(f"config: BLOCK_K must be 16 or 32, got {self.BLOCK_K}")

    def resolve(launch, call):
        cfg = StandInConfig(**launch) if isinstance(launch, dict) else (launch or StandInConfig())
        cfg.validate()
        return cfg

    def run(q, kv2, idx, indptr, scale, sink, out, cfg):
        launch = prefill.PrefillConfig(BLOCK_H=16, BLOCK_K=cfg.BLOCK_K, num_warps=4)
        prefill._run_triton(q, kv2, idx, indptr, scale, sink, out, launch)
        if wrong:
            out.mul_(1.5)

    return dispatch.Kernel(name, run=run, resolve=resolve, unavailable=lambda call: None,
                           to_dict=lambda c: {"BLOCK_K": c.BLOCK_K}, targets=("sm90",),
                           knobs={"BLOCK_K": (16, 32)})  # fmt: skip


@pytest.mark.parametrize("wrong", [False, True], ids=["right", "wrong"])
def test_time_job_of_another_kernel_checks_then_times(monkeypatch, wrong):
    name = "stand_in_wrong" if wrong else "stand_in"
    monkeypatch.setitem(dispatch.KERNELS, name, _stand_in(name, wrong))
    timed = []
    monkeypatch.setattr(tune, "_bench", lambda fn: timed.append(fn) or 0.5)
    launch = tune.kernel_launch(name, "sm90", 16, 512, {"BLOCK_K": 16})
    job = {"target": "sm90", "H": 16, "D": 512, "dtype": "bf16", "_kernel": name,
           "_launch": launch, "_device": "cpu",
           "_workload": {"name": "random", "T": 2, "slots": 24, "pool": 64, "seed": 3}}  # fmt: skip
    try:
        row = tune._time_job(job)
    finally:
        tune._WORKER["workloads"].clear()
    assert row["T"] == 2 and row["rel_l2"] is not None
    if wrong:
        assert row["status"] == "fail" and "correctness" in row["reason"] and not timed
    else:
        assert row["status"] == "ok", row
        assert row["time_ms"] == 0.5 and len(timed) == 1 and row["rel_l2"] < 2e-2
