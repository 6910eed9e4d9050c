"""Every notebook runs top to bottom, headless, at small sizes; notebooks are committed clean."""

from __future__ import annotations

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
