"""The README's helper commands run as written: scripts with a shebang and the run bit, the
venv's Python rather than a bare python3, and `make test` able to skip the chromium install."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", ["run_notebooks.py", "gpu_workbook.sh", "ci_browser_setup.sh"])
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
    assert [c.split()[0] for c in calls] == ["-c", "-m", "scripts/run_notebooks.py"], calls


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
