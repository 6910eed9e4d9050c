"""The README's helper commands run as written: scripts with a shebang and the run bit, the
venv's Python rather than a bare python3, and `make test` able to skip the chromium install."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "name", ["run_notebooks.py", "gpu_workbook.sh", "ci_browser_setup.sh", "explorer_digest.py"]
)
def test_scripts_run_directly(name):
    path = ROOT / "scripts" / name
    assert path.read_text().startswith("#!/usr/bin/env "), f"{name}: no shebang"
    assert os.access(path, os.X_OK), f"{name}: no run bit"


def test_gpu_workbook_uses_the_chosen_python_not_a_bare_python3(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    bare = bin_dir / "python3"  # first on PATH: a call to it is recorded and fails
    bare.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/bare.log\nexit 1\n')
    chosen = tmp_path / "venv_python"
    chosen.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/chosen.log\nexit 0\n')
    for stub in (bare, chosen):
        stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": str(chosen)}
    res = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_workbook.sh"), str(tmp_path / "out"), "all"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert not (tmp_path / "bare.log").exists(), (tmp_path / "bare.log").read_text()
    calls = (tmp_path / "chosen.log").read_text().splitlines()
    assert [c.split()[0] for c in calls] == ["-c", "-m", "scripts/run_notebooks.py",
                                             "scripts/explorer_digest.py"], calls  # fmt: skip


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_test_can_skip_the_browser_install():
    def dry_run(*args):
        res = subprocess.run(["make", "-n", "test", *args], cwd=ROOT, capture_output=True,
                             text=True, timeout=60)  # fmt: skip
        assert res.returncode == 0, res.stderr
        return res.stdout

    assert "ci_browser_setup.sh" in dry_run()
    assert "ci_browser_setup.sh" not in dry_run("SKIP_BROWSER=1")


def test_license_is_an_spdx_string():
    # A TOML table is deprecated by setuptools (pip prints the warning on every install).
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "MIT"


DOCS = ["README.md", "data/README.md", "docs/PERF_NOTES.md", "experiments/README.md"]
_PATH = re.compile(r"`((?:scripts|experiments|data|docs|notebooks|sparse_mla|tests)/[^`\s]*)`")


@pytest.mark.parametrize("doc", DOCS)
def test_paths_the_docs_name_exist(doc):
    """A moved file leaves no stale path behind (placeholders and globs aside)."""
    named = {m for m in _PATH.findall((ROOT / doc).read_text()) if not re.search(r"[*{<]", m)}
    assert named
    missing = sorted(p for p in named if not (ROOT / p.rstrip("/")).exists())
    assert not missing, f"{doc} names paths that do not exist: {missing}"


def test_experiments_have_one_home():
    # Probes and kernel variants live in experiments/, each described in its README.
    scripts = {p.name for p in (ROOT / "scripts").iterdir()}
    assert not {n for n in scripts if "probe" in n or "variants" in n or n.startswith("ws_lat")}
    data = ROOT / "data"
    assert not [p for p in data.rglob("*") if p.suffix in (".patch", ".diff")]
    readme = (ROOT / "experiments" / "README.md").read_text()
    for path in (ROOT / "experiments").iterdir():
        if path.is_file() and path.name != "README.md":
            assert f"`{path.name}`" in readme, (
                f"experiments/README.md does not say what {path.name} is"
            )


def test_explorer_digest_says_it_needs_a_gpu(tmp_path, monkeypatch, capsys):
    import importlib.util

    from sparse_mla import runtime

    path = ROOT / "scripts" / "explorer_digest.py"
    spec = importlib.util.spec_from_file_location("explorer_digest", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(runtime, "has_gpu", lambda: False)
    assert mod.main(["--out", str(tmp_path / "d.md")]) == 2
    assert "no GPU" in capsys.readouterr().out
    assert not (tmp_path / "d.md").exists()


def _host_cost_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("host_cost", ROOT / "scripts" / "host_cost.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_host_cost_turns_time_every_provider_in_every_place():
    from sparse_mla.bench import balanced_orders

    mod = _host_cost_module()
    calls: list[int] = []
    fns = [lambda i=i: calls.append(i) for i in range(3)]
    times = mod.host_turns(fns, lambda: None, rounds=1, reps=2, warmup=1)
    orders = balanced_orders(3)  # 4 orders for 3 providers: one round rounds up to 4
    assert [len(t) for t in times] == [len(orders)] * 3
    assert all(t > 0 for ts in times for t in ts)
    timed = calls[3:]  # after one warm-up call each
    assert timed[::2] == timed[1::2]  # each window is 2 calls of one provider
    assert timed[::2] == [i for order in orders for i in order]


@pytest.mark.parametrize("ids", ["csr", "dense"])
def test_host_cost_turns_rows_on_cpu(ids):
    # In a process of its own: --cpu replaces the registered kernels' runs with no-ops.
    res = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "host_cost.py"), "--cpu", "--shapes", "4x2",
         "--kernels", "default,triton", "--turns", "2", "--validate", "false", "--ids", ids],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"ids {ids}," in res.stdout
    rows = [ln for ln in res.stdout.splitlines() if ln.startswith("H4 T2")]
    assert [r.split()[2] for r in rows] == ["default", "triton"], rows
    for r in rows:
        assert re.search(r"min +[\d.]+ +median +[\d.]+ +max +[\d.]+ +\(2 windows\)", r), r
        assert "replayed" in r


def test_clock_probe_anchors_apply_to_the_current_kernel():
    # experiments/ws_clk_now.py stamps the package's hopper_ws.py by anchored text edits: a
    # kernel change that moves an anchor must fail here, not on the GPU machine.
    sys.path.insert(0, str(ROOT / "experiments"))
    try:
        import ws_clk_now
    finally:
        sys.path.remove(str(ROOT / "experiments"))
    src = (ROOT / "sparse_mla" / "gluon" / "hopper_ws.py").read_text()
    stamped = ws_clk_now.stamped_source(src)  # SystemExit when an anchor is not found once
    slots = {int(m) for m in re.findall(r"_stamp\((\d+), ", stamped)}
    assert set(ws_clk_now.NAMES) <= slots, "a printed stamp is never written"
    # the entry stamps come before the partitions start, the producer's after
    assert stamped.index("_stamp(24, 0)") < stamped.index("gl.warp_specialize(")
    # --pairs: the steady-state stamps apply too and every one of them is written
    paired = ws_clk_now.stamped_source(src, pairs=True)
    slots = {int(m) for m in re.findall(r"_stamp\((\d+), ", paired)}
    assert set(ws_clk_now.PAIR_NAMES) <= slots, "a printed pair stamp is never written"
    assert not set(ws_clk_now.PAIR_NAMES) & set(ws_clk_now.NAMES), "two stamps share a slot"


def test_l2_hint_rewrite_builds_for_sm90():
    # experiments/ws_l2_256b.py adds L2 hints to gluon_ws's PTX by regular expressions: each
    # variant must change every row gather (and Q's TMA loads) and still assemble for sm90.
    from triton.backends.nvidia import compiler as nv

    from sparse_mla import inspect

    sys.path.insert(0, str(ROOT / "experiments"))
    try:
        import ws_l2_256b
    finally:
        sys.path.remove(str(ROOT / "experiments"))
    _, res = inspect.compile_kernel("gluon_ws", "sm90", num_heads=64, index_dtype="int32")
    ptx = res.asm["ptx"]
    gathers = ptx.count(ws_l2_256b.GATHER + " [")
    q_loads = ptx.count(ws_l2_256b.Q_LOAD + " [")
    assert gathers == 64 and q_loads >= 1, (gathers, q_loads)
    ptxas = nv.get_ptxas(90).path
    for variant in ("256B", "rows_last+q_first"):
        text, counts = ws_l2_256b.rewrite(ptx, ws_l2_256b.hints_of(variant))
        assert counts["gathers"] == gathers, (variant, counts)
        assert counts.get("q_loads", q_loads) == q_loads, (variant, counts)
        with tempfile.TemporaryDirectory() as d:
            src = Path(d) / "k.ptx"
            src.write_text(text)
            out = subprocess.run(
                [ptxas, "-arch=sm_90a", str(src), "-o", str(src.with_suffix(".cubin"))],
                capture_output=True, text=True,
            )  # fmt: skip
            assert out.returncode == 0, (variant, out.stderr[-2000:])
    with pytest.raises(SystemExit):
        ws_l2_256b.hints_of("rows_first")
