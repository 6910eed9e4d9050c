"""The package as an engine installs it: a wheel in a fresh venv finds the shipped tuned configs.

The wheel is built offline from a copy of the sources (``--no-build-isolation`` with this venv's
setuptools, so the checkout gets no build/ folder) and installed ``--no-deps`` into a new venv
that sees this venv's site-packages through a ``.pth`` line (torch and triton without a
download) but not the checkout: an editable install's finder is not loaded that way, and the
command runs outside the checkout without PYTHONPATH.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "sparse_mla" / "tuned"
OP = Path("triton/attention/sparse_attention_dsv4/DEFAULT.json")


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
    assert res.returncode == 0, f"{cmd}\n{res.stdout}\n{res.stderr}"
    return res


def _recorded_kernel(arch: str, key: str) -> str:
    """The kernel the shipped file records for ``key``'s largest token bucket."""
    entry = json.loads((SHIPPED / arch / OP).read_text())[key]
    choices = entry["kernel"] if isinstance(entry["kernel"], list) else [entry["kernel"]]
    (last,) = [c for c in choices if c.get("tokens") is None or c["tokens"][1] is None]
    return last["name"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(python of a fresh venv with the wheel installed, the pip build log)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(
        ROOT / "sparse_mla", src / "sparse_mla",
        ignore=shutil.ignore_patterns("__pycache__", "*.lock"),
    )  # fmt: skip
    build = _run(
        [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation",
         "--no-index", "-w", str(tmp / "dist"), str(src)],
    )  # fmt: skip
    (wheel,) = (tmp / "dist").glob("sparse_mla-*.whl")
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    purelib = _run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
    ).stdout.strip()
    outer = {*site.getsitepackages(), sysconfig.get_paths()["purelib"]}
    (Path(purelib) / "_outer_site.pth").write_text("".join(f"{p}\n" for p in sorted(outer)))
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
          "--no-index", str(wheel)])  # fmt: skip
    return python, build.stdout + build.stderr


def _in_venv(python: Path, code: str, cwd: Path, **env) -> str:
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return _run([str(python), "-c", code], cwd=cwd, env={**clean, **env}).stdout


@pytest.mark.slow
def test_wheel_in_a_fresh_venv_runs_the_recorded_kernel(installed, tmp_path):
    python, build_log = installed
    user = tmp_path / "user"
    user.mkdir()
    out = _in_venv(
        python,
        "import sparse_mla\nfrom sparse_mla import configs, dispatch\n"
        "print(sparse_mla.__file__)\nprint(configs.CONFIG_ROOT)\n"
        "print(dispatch.describe('sm90', 64, 512))",
        tmp_path,
        SPARSE_MLA_CONFIG_DIR=str(user),
    ).splitlines()
    package, root, line = out[-3:]
    venv = python.parent.parent
    assert Path(package).is_relative_to(venv) and Path(root).is_relative_to(venv), out
    assert Path(root, "sm90", OP).is_file()
    name = _recorded_kernel("sm90", "H64_D512")
    assert f": {name} (recorded H64_D512" in line, line
    assert "no tuned entry" not in line
    # pip's build raised no deprecation (e.g. `project.license` as a table).
    assert "deprecated" not in build_log, build_log


@pytest.mark.slow
def test_wheel_reads_the_user_directory_over_the_shipped_files(installed, tmp_path):
    """An engine's own tuned file, named by SPARSE_MLA_CONFIG_DIR, wins for its shape in every
    thread; other shapes keep the shipped entries."""
    python, _ = installed
    user = tmp_path / "user"
    shipped = json.loads((SHIPPED / "sm90" / OP).read_text())
    entry = dict(shipped["H64_D512"])
    entry["kernel"] = {
        "name": "gluon_wgmma",
        "provenance": {"device": "test", "date": "2026-12-01", "source": "test",
                       "times_ms": {"gluon_wgmma": 1.0, "gluon_ws": 2.0}},
    }  # fmt: skip
    path = user / "sm90" / OP
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"H64_D512": entry}))
    code = (
        "import threading\nfrom sparse_mla import dispatch\nseen = []\n"
        "t = threading.Thread(target=lambda: seen.append(dispatch.describe('sm90', 64, 512)))\n"
        "t.start(); t.join()\nprint(seen[0])\nprint(dispatch.describe('sm90', 16, 512))"
    )
    threaded, other = _in_venv(python, code, tmp_path, SPARSE_MLA_CONFIG_DIR=str(user)).split("\n")[
        -3:-1
    ]
    assert ": gluon_wgmma (recorded H64_D512" in threaded, threaded
    assert f": {_recorded_kernel('sm90', 'H16_D512')} (recorded H16_D512" in other, other
