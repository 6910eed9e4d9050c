"""Every notebook runs top to bottom, headless, at small sizes; notebooks are committed clean."""

from __future__ import annotations

import json
import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
NAMES = [p.name for p in NOTEBOOKS]


def test_notebooks_exist():
    assert len(NOTEBOOKS) >= 2, NAMES
    for prefix in ("01_", "02_"):
        assert any(n.startswith(prefix) for n in NAMES), f"missing notebook {prefix}*: {NAMES}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=NAMES)
def test_committed_without_outputs(path):
    raw = json.loads(path.read_text())
    ids = [c.get("id") for c in raw["cells"]]
    # nbformat 4.5 wants a unique id per cell (it warns, and will refuse, on reading without)
    missing = [i for i, x in enumerate(ids) if not x]
    assert not missing, f"{path.name}: cells {missing} have no id"
    assert len(set(ids)) == len(ids), f"{path.name}: cell ids repeat"
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        assert cell.outputs == [], f"{path.name} cell {i} has outputs: strip them"
        assert cell.execution_count is None, f"{path.name} cell {i} has an execution count"
    assert "widgets" not in nb.metadata, f"{path.name} carries saved widget state"
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{path.name} needs exactly one cell tagged 'parameters'"
    assert "small_mode()" in tagged[0].source, f"{path.name}: parameters must read small_mode()"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=NAMES)
def test_thin_drivers(path):
    """Nothing is defined only in a notebook: functions and classes live in sparse_mla.lab."""
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        for line in cell.source.splitlines():
            assert not line.startswith(("def ", "class ", "async def ")), (
                f"{path.name} cell {i} defines {line.split('(')[0]!r}: move it into sparse_mla.lab"
            )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=NAMES)
def test_notebook_runs(path, tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSE_MLA_SMALL", "1")
    # A private Jupyter runtime dir keeps parallel runs' connection files apart.
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=240,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
        allow_errors=False,
    )
    client.execute()  # raises CellExecutionError on the first error cell
    errors = [
        o for c in nb.cells if c.cell_type == "code" for o in c.outputs
        if o.output_type == "error"
    ]  # fmt: skip
    assert not errors, errors
    ran = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in ran), "a code cell did not run"
    assert os.environ["SPARSE_MLA_SMALL"] == "1"


def _load_runner():
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "scripts" / "run_notebooks.py"
    spec = importlib.util.spec_from_file_location("run_notebooks", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_run_notebooks_script_keeps_outputs_and_reports_failures(tmp_path, monkeypatch):
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    runner = _load_runner()
    cells = [
        "print('hello', 6 * 7)",
        "import sys\nfor i in range(3):\n    sys.stderr.write(f'\\rbar {i}/2')\n"
        "sys.stderr.write('\\n')",
        "from IPython.display import HTML\n"
        "HTML('<table><tr><th>a</th><th>b</th></tr><tr><td>1</td><td>&lt;2</td></tr></table>')",
    ]
    good = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    bad = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell("print('before')"),
               nbformat.v4.new_code_cell("raise ValueError('planted failure')")]
    )  # fmt: skip
    nbformat.write(good, tmp_path / "good.ipynb")
    nbformat.write(bad, tmp_path / "bad.ipynb")
    out = tmp_path / "out"
    assert runner.main([str(tmp_path / "good.ipynb"), "--out", str(out), "--timeout", "120"]) == 0
    digest = (out / "digest.md").read_text()
    assert "good.ipynb: ok" in digest and "hello 42" in digest and "a | b" in digest
    assert "1 | <2" in digest
    assert "bar 2/2" in digest and "bar 0/2" not in digest and "\r" not in digest
    executed = nbformat.read(out / "good.ipynb", as_version=4)
    assert executed.cells[0].outputs, "the executed copy keeps its outputs"
    assert nbformat.read(tmp_path / "good.ipynb", as_version=4).cells[0].outputs == []

    rc = runner.main([str(tmp_path / "bad.ipynb"), "--out", str(out), "--timeout", "120"])
    digest = (out / "digest.md").read_text()
    assert rc == 1 and "bad.ipynb: FAILED" in digest
    assert "planted failure" in digest and "before" in digest
    with pytest.raises(SystemExit):
        runner.main([str(tmp_path / "missing.ipynb"), "--out", str(out)])
