"""The public entry's kernel choice: recorded kernel launched, config= forcing, CPU fallback."""

from __future__ import annotations

import ast
import csv
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import make_case, poisoned_like

from sparse_mla import configs, dispatch, prefill, runtime, tune
from sparse_mla.reference import check_against_reference, sparse_mla_prefill_ref

ROOT = Path(__file__).resolve().parents[1]
TRITON_PROV = {"device": "test", "triton": "3.6.0", "date": "2026-11-30", "workload": "w",
               "time_ms": 1.0, "sweep_size": 1}  # fmt: skip
CHOICE_PROV = {"device": "test", "date": "2026-11-30", "source": "test",
               "times_ms": {"gluon": 1.0, "triton": 2.0}}  # fmt: skip


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
    """Which registered kernel ran, and with which launch; the fake Gluon writes the fp32
    reference's result so the output check still means something."""

    def __init__(self, monkeypatch, *, gluon_runs: bool):
        self.calls: list[tuple[str, object]] = []
        triton = dispatch.KERNELS["triton"]
        gluon = dispatch.KERNELS["gluon"]

        def run_triton(*args):
            self.calls.append(("triton", args[-1]))
            return triton.run(*args)

        def run_gluon(q, kv, idx, indptr, scale, sink, out, launch):
            self.calls.append(("gluon", launch))
            ref = sparse_mla_prefill_ref(q, kv, idx, indptr, scale, attn_sink=sink)
            out.copy_(ref.to(out.dtype))
            return out

        monkeypatch.setitem(dispatch.KERNELS, "triton", replace(triton, run=run_triton))
        fake = replace(gluon, run=run_gluon)
        if gluon_runs:  # as on an sm90 GPU
            fake = replace(fake, unavailable=lambda call: None)
        monkeypatch.setitem(dispatch.KERNELS, "gluon", fake)

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
    """A configs root where sm90 H16 D512 records Gluon (with a launch) and H8 records none;
    calls read it as if on an sm90 GPU (the kernels still run on CPU tensors)."""
    gluon = {"name": "gluon", "launch": {"BLOCK_H": 16, "BLOCK_K": 64, "num_warps": 4},
             "provenance": CHOICE_PROV}  # fmt: skip
    _write(tmp_path, "sm90", {"H16_D512": _entry(gluon), "H8_D512": _entry(BLOCK_K=32)})
    monkeypatch.setattr(prefill, "_arch_of", lambda q: "sm90")
    with configs.use_root(tmp_path):
        yield tmp_path


def test_recorded_kernel_is_the_one_launched(sm90_root, monkeypatch):
    from sparse_mla.gluon.launch import GluonConfig

    spies = Spies(monkeypatch, gluon_runs=True)
    _run(make_case(5, 16, 512, N=64, max_slots=40, seed=1))
    assert spies.names == ["gluon"]
    assert spies.calls[0][1] == GluonConfig(BLOCK_H=16, BLOCK_K=64, num_warps=4)
    # A shape without a recorded kernel runs Triton with its tuned launch.
    _run(make_case(4, 8, 512, N=64, max_slots=40, seed=2))
    assert spies.names == ["gluon", "triton"]
    assert spies.calls[1][1] == configs.PrefillConfig(BLOCK_H=16, BLOCK_K=32, num_warps=4)


def test_config_forces_the_kernel(sm90_root, monkeypatch):
    from sparse_mla.gluon.launch import GluonConfig

    spies = Spies(monkeypatch, gluon_runs=True)
    case = make_case(5, 16, 512, N=64, max_slots=40, seed=3)
    _run(case, config={"BLOCK_K": 32})
    _run(case, config=configs.PrefillConfig(BLOCK_K=16, num_warps=2))
    _run(case, config=dispatch.Choice("triton"))
    forced = GluonConfig(BLOCK_H=32, BLOCK_K=32, num_warps=4)
    _run(case, config=forced)
    assert spies.names == ["triton", "triton", "triton", "gluon"]
    assert spies.calls[0][1].BLOCK_K == 32 and spies.calls[1][1].num_warps == 2
    assert spies.calls[2][1] == configs.PrefillConfig(BLOCK_H=16, BLOCK_K=16, num_warps=4)
    assert spies.calls[3][1] is forced


def test_cpu_falls_back_to_triton(sm90_root, monkeypatch):
    # Gluon is recorded for H16, but CPU tensors cannot run it: Triton runs (interpreter).
    spies = Spies(monkeypatch, gluon_runs=False)
    seen = []
    real = runtime.launch
    monkeypatch.setattr(runtime, "launch", lambda k, *a, **kw: seen.append(k) or real(k, *a, **kw))
    _run(make_case(5, 16, 512, N=64, max_slots=40, seed=4))
    assert spies.names == ["triton"] and seen == [prefill._sparse_mla_prefill_kernel]
    c = dispatch.choose(dispatch.Call("sm90", 16, 512, torch.bfloat16, torch.zeros(4, 512)))
    assert c.kernel == "triton" and "gluon recorded, but" in c.reason
    # No GPU at all: no lookup, Triton's default launch.
    monkeypatch.setattr(prefill, "_arch_of", lambda q: None)
    _run(make_case(3, 16, 512, N=64, max_slots=40, seed=5))
    assert spies.names == ["triton", "triton"]
    assert spies.calls[-1][1] == prefill.default_config(16, 512)


def test_forced_kernel_that_cannot_run_is_rejected_before_out(sm90_root, monkeypatch):
    from sparse_mla.gluon.launch import GluonConfig

    spies = Spies(monkeypatch, gluon_runs=False)
    case = make_case(3, 16, 512, N=64, max_slots=40, seed=6)
    out = poisoned_like(case.q)
    with pytest.raises(ValueError, match="gluon kernel cannot run"):
        prefill.sparse_mla_prefill(*case.args(), out=out, config=GluonConfig())
    with pytest.raises(ValueError, match="gluon kernel cannot run"):
        prefill.sparse_mla_prefill(*case.args(), out=out, config=dispatch.Choice("gluon"))
    with pytest.raises(ValueError, match="not registered"):
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
        ({"name": "gluon",
          "provenance": {**CHOICE_PROV, "times_ms": {"gluon": 3.0, "triton": 2.0}}},
         "'triton' was faster"),
        ({"name": "gluon", "provenance": {**CHOICE_PROV, "times_ms": {"triton": 2.0}}},
         "include the chosen kernel"),
        ({"name": "triton", "launch": {"BLOCK_K": 16},
          "provenance": {**CHOICE_PROV, "times_ms": {"triton": 1.0}}}, "Triton's launch"),
        ({"name": "Gluon!", "provenance": CHOICE_PROV}, "name must be"),
        ({"name": "gluon", "provenance": {k: v for k, v in CHOICE_PROV.items() if k != "source"}},
         "missing key 'source'"),
        ({"name": "gluon", "launch": {"BLOCK_K": "64"}, "provenance": CHOICE_PROV},
         "ints/bools/null"),
    ],
)  # fmt: skip
def test_kernel_object_is_validated(tmp_path, kernel, match):
    _write(tmp_path, "sm90", {"H16_D512": _entry(kernel)})
    with pytest.raises(configs.ConfigFileError, match=match):
        configs.entries("sm90", tmp_path)


def _bench_row(provider, H, ms, *, ts="2026-11-30T10:00:00+00:00", workload=None, ok=True,
               config=None):  # fmt: skip
    triton_cfg = {"BLOCK_H": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2}
    gluon_cfg = {"BLOCK_H": 64, "BLOCK_K": 64, "num_warps": 8, "num_stages": 2,
                 "num_kv_splits": 1}  # fmt: skip
    cfg = config or (triton_cfg if provider == "triton" else gluon_cfg)
    return {"timestamp": ts, "device": "NVIDIA H200", "torch": "2.11", "triton": "3.6.0",
            "commit": "c0ffee", "workload": workload or f"csa_h{H}", "T": "16384", "H": str(H),
            "D": "512", "provider": provider, "config": json.dumps(cfg), "ok": str(ok),
            "ms": "" if ms is None else str(ms)}  # fmt: skip


def test_export_kernel_choice_then_dispatch(tmp_path, monkeypatch):
    rows = [
        _bench_row("triton", 64, 6.5), _bench_row("gluon", 64, 4.8),
        _bench_row("default", 64, 1.0), _bench_row("flashmla", 64, 0.5),  # not candidates
        _bench_row("triton", 16, 2.4), _bench_row("gluon", 16, 4.0),
        _bench_row("triton", 16, 7.2, workload="glm_h16"), _bench_row("gluon", 16, 5.0,
                                                                       workload="glm_h16"),
        # an older run where Gluon lost at H64 is ignored (the latest run counts)
        _bench_row("triton", 64, 1.0, ts="2026-11-01T00:00:00+00:00"),
        _bench_row("gluon", 64, 9.0, ts="2026-11-01T00:00:00+00:00"),
    ]  # fmt: skip
    diff = tune.export_kernel_choice(rows, "sm90", root=tmp_path, source="unit test")
    assert '"name": "gluon"' in diff
    found = configs.entries("sm90", tmp_path)
    h64, h16 = found["H64_D512"], found["H16_D512"]
    assert h64.kernel.name == "gluon" and h64.kernel.launch == {
        "BLOCK_H": 64, "BLOCK_K": 64, "num_warps": 8, "num_stages": 2}  # fmt: skip
    assert h64.kernel.provenance["times_ms"] == {"gluon": 4.8, "triton": 6.5}
    assert h64.provenance["mode"] == "bench" and h64.launch.BLOCK_K == 32  # from the triton row
    # H16: times summed over both workloads (Gluon 4.0 + 5.0 against Triton 2.4 + 7.2).
    assert h16.kernel.name == "gluon"
    assert h16.kernel.provenance["times_ms"] == {"gluon": 9.0, "triton": 9.6}
    assert "csa_h16 T=16384 + glm_h16 T=16384" in h16.kernel.provenance["workload"]
    # A later sweep export of Triton's launch keeps the recorded kernel.
    row = {"target": "sm90", "H": 64, "D": 512, "BLOCK_H": 64, "BLOCK_K": 16, "num_warps": 8,
           "num_stages": 2, "status": "ok", "mode": "time", "time_ms": 5.0}  # fmt: skip
    tune.export([row], "sm90", root=tmp_path, provenance=TRITON_PROV)
    again = configs.entries("sm90", tmp_path)["H64_D512"]
    assert again.launch.BLOCK_K == 16 and again.kernel == h64.kernel
    c = dispatch.choose(dispatch.Call("sm90", 64, 512), root=tmp_path)
    assert c.kernel == "gluon" and c.launch.BLOCK_K == 64 and "gluon 4.8 ms" in c.reason


def test_committed_sm90_choice_matches_the_bench_csv():
    # config=None runs Gluon (the warp-specialised kernels) at H 8/16/64/128 on sm90, as the
    # committed H200 run says;
    # the recorded provenance is that run's rows, recomputed here.
    with (ROOT / "data/bench/nvidia-h200.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    entries = configs.entries("sm90", configs.CONFIG_ROOT)
    recorded = {k: e.kernel for k, e in entries.items() if e.kernel is not None}
    assert {k: c.name for k, c in recorded.items()} == {
        "H8_D512": "gluon",
        "H16_D512": "gluon",
        "H64_D512": "gluon",
        "H128_D512": "gluon",
    }
    run = recorded["H64_D512"].provenance["run"]
    again = tune.kernel_choices(rows, run=run, source=recorded["H64_D512"].provenance["source"])
    for (H, D), c in again.items():
        k = recorded[configs.shape_key(H, D)]
        assert (c["name"], c["launch"], c["provenance"]) == (k.name, k.launch, k.provenance)
    for H, name in ((8, "gluon"), (16, "gluon"), (32, "triton"), (64, "gluon"), (128, "gluon")):
        assert dispatch.choose(dispatch.Call("sm90", H, 512)).kernel == name


def _package_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level >= 1:
            mod = node.module or ""
            found |= {f"{mod}.{a.name}".strip(".") for a in node.names} if not mod else {mod}
    return found


def test_dependencies_run_one_way():
    pkg = ROOT / "sparse_mla"
    assert _package_imports(pkg / "configs.py") == set()
    assert _package_imports(pkg / "dispatch.py") == {"configs"}
    assert {"configs", "dispatch"} <= _package_imports(pkg / "prefill.py")


@pytest.mark.gpu
@pytest.mark.parametrize("H", [8, 16, 64, 128])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_gpu_default_runs_the_recorded_kernel(H, index_dtype, monkeypatch):
    names = []
    for name, k in list(dispatch.KERNELS.items()):

        def run(*args, _k=k, _name=name):
            names.append(_name)
            return _k.run(*args)

        monkeypatch.setitem(dispatch.KERNELS, name, replace(k, run=run))
    case = make_case(257, H, 512, N=4000, max_slots=700, device="cuda", seed=H,
                     index_dtype=index_dtype)  # fmt: skip
    _run(case)
    arch = runtime.arch()
    expected = dispatch.choose(dispatch.Call(arch, H, 512)).kernel
    if arch == "sm90":  # the committed choice: the warp-specialised Gluon kernels
        assert expected == "gluon"
    assert names == [expected]
