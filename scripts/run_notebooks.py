#!/usr/bin/env python3
"""Execute notebooks headless and keep what they printed.

    scripts/run_notebooks.py notebooks/03_sweep_and_export.ipynb --out runs/gpu   # venv active
    SPARSE_MLA_SMALL=1 .venv/bin/python scripts/run_notebooks.py notebooks/*.ipynb --out /tmp/nb

For each notebook: the executed copy (``<name>.ipynb``, outputs and all, under ``--out``; the
committed notebooks stay clean) and a Markdown digest (``digest.md``) with the machine, the
versions, each notebook's wall time, and every code cell's text output (streams, plain-text
results, and HTML tables reduced to text). Exits non-zero when any notebook fails; the digest
then holds the traceback. This is how the GPU branches of the workbook are run on a machine
without a browser.
"""

from __future__ import annotations

import argparse
import html
import os
import platform
import re
import sys
import time
from pathlib import Path


def _html_text(markup: str) -> str:
    """Rows of an HTML table (or any markup) as plain text: cells joined by ' | '."""
    markup = re.sub(r"(?is)<(script|style).*?</\1>", "", markup)
    markup = re.sub(r"(?i)</t[dh]>\s*<t[dh][^>]*>", " | ", markup)
    markup = re.sub(r"(?i)<br\s*/?>|</tr>|</div>|</p>", "\n", markup)
    text = html.unescape(re.sub(r"<[^>]+>", "", markup))
    return "\n".join(line.strip() for line in text.splitlines() if line.strip())


def terminal_text(text: str) -> str:
    """A stream as a terminal shows it: a carriage return rewrites its line, so a progress
    bar's many updates leave only their last state."""
    return "\n".join(line.rstrip("\r").rsplit("\r", 1)[-1] for line in text.split("\n"))


def cell_text(cell) -> str:
    """The text a code cell left behind (images are noted, not embedded)."""
    parts = []
    for out in cell.get("outputs", []):
        kind = out["output_type"]
        if kind == "stream":
            parts.append(terminal_text(out["text"]))
        elif kind == "error":
            parts.append("\n".join(re.sub(r"\x1b\[[0-9;]*m", "", t) for t in out["traceback"]))
        else:
            data = out.get("data", {})
            if "text/html" in data:
                parts.append(_html_text(data["text/html"]))
            elif "image/png" in data:
                parts.append("[figure]")
            elif "text/plain" in data:
                parts.append(data["text/plain"])
    return "\n".join(p.rstrip("\n") for p in parts if p.strip())


def environment_lines() -> list[str]:
    import torch
    import triton

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return [
        f"- machine: {platform.node()} ({platform.machine()}), GPU: {gpu}",
        f"- python {platform.python_version()}, torch {torch.__version__}, "
        f"triton {triton.__version__}",
        f"- SPARSE_MLA_SMALL={os.environ.get('SPARSE_MLA_SMALL', '')!r}",
        f"- date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
    ]


def run(paths: list[Path], out: Path, timeout: int) -> bool:
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    out.mkdir(parents=True, exist_ok=True)
    lines = ["# Executed notebooks", "", *environment_lines(), ""]
    ok_all = True
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        client = NotebookClient(
            nb, timeout=timeout, kernel_name="python3",
            resources={"metadata": {"path": str(path.resolve().parent)}},
        )  # fmt: skip
        t0 = time.perf_counter()
        try:
            client.execute()
            status = "ok"
        except CellExecutionError as exc:
            status, ok_all = f"FAILED: {str(exc).splitlines()[0] if str(exc) else exc!r}", False
        secs = time.perf_counter() - t0
        nbformat.write(nb, out / path.name)
        print(f"{path.name}: {status} in {secs:.1f} s", flush=True)
        lines += [f"## {path.name}: {status} ({secs:.1f} s)", ""]
        for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
            text = cell_text(cell)
            if text:
                lines += [f"### cell {i}", "", "```", text, "```", ""]
    (out / "digest.md").write_text("\n".join(lines))
    return ok_all


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebooks", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True, help="folder for executed copies")
    ap.add_argument("--timeout", type=int, default=1200, help="seconds per cell")
    args = ap.parse_args(argv)
    missing = [str(p) for p in args.notebooks if not p.is_file()]
    if missing:
        ap.error(f"no such notebook: {', '.join(missing)}")
    os.environ.setdefault("MPLBACKEND", "Agg")
    return 0 if run(args.notebooks, args.out, args.timeout) else 1


if __name__ == "__main__":
    sys.exit(main())
