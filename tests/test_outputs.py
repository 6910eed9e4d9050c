"""Where the command line writes by default: runs/ (ignored by git), never data/, whose files
the tests and notebooks read; and the README's commands write only ignored paths."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from sparse_mla import cli, tune

ROOT = Path(__file__).resolve().parent.parent


def test_sweep_without_out_writes_under_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = ["sweep", "--target", "gfx950", "--heads", "8", "--grid", "kpack=2", "--no-progress"]
    assert cli.main(argv) == 1  # every row invalid (kpack=2 needs BLOCK_K >= 32): fast
    (path,) = (tmp_path / "runs" / "sweeps").glob("compile_gfx950_*.csv")
    assert f"rows saved to {path.relative_to(tmp_path)}" in capsys.readouterr().out
    assert [r["status"] for r in tune.load_rows(path)] == ["invalid"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]


def test_capture_without_out_writes_under_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = ["capture", "--workload", "csa_h8_topk512", "--tokens", "4", "--head-dim", "64",
            "--device", "cpu", "--kernel", "reference"]  # fmt: skip
    assert cli.main(argv) == 0
    (path,) = (tmp_path / "runs" / "captures").glob("*.safetensors")
    assert f"wrote {path.relative_to(tmp_path)}" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    return [ln.strip() for b in blocks for ln in b.splitlines() if "sparse-mla " in ln]


def test_readme_commands_write_only_ignored_paths():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    outs = [m.group(1) for c in _readme_commands() for m in re.finditer(r"--out\s+(\S+)", c)]
    assert len(outs) >= 2, _readme_commands()  # the sweep and capture examples at least
    for out in outs:
        rc = subprocess.run(["git", "check-ignore", "-q", "--no-index", out], cwd=ROOT).returncode
        assert rc == 0, f"README writes {out}, which git does not ignore"
    # export writes the user root (sparse_mla.configs), not the checkout: no --root in README.
    exports = [c for c in _readme_commands() if c.split()[:2] == ["sparse-mla", "export"]]
    assert exports and not any("--root" in c for c in exports)
