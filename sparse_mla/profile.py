"""Measured stalls per source line: one launch of a registered kernel under Nsight Compute.

:func:`profile` runs ``python -m sparse_mla.profile --run ...`` (one warm-up call of
``sparse_mla_prefill(config=Choice(kernel, launch))`` on a DSv4 CSA workload, then the profiled
call) under ``ncu`` with the source counters (``--section SourceCounters --section
WarpStateStats``, the stall-reason sampling group, ``--import-source yes``), then reads the
report back as CSV in base units: ``--page source --print-source cuda,sass`` (per source line:
warp-stall samples and instructions executed; Triton and Gluon compile with line info, so the
lines are those of ``prefill.py`` / ``gluon/hopper_ws.py``; without line info the ``sass`` view,
per instruction) and ``--page raw`` (the kernel's stall samples by reason; else the source
page's per-reason columns summed). Each page is kept beside the report (``source.csv``,
``raw.csv``). For a warp-specialised kernel the producer's and the consumers' lines are
different, so "which partition waits, on what" has a measured answer.

Without ``ncu`` on PATH (or ``$SPARSE_MLA_NCU``) or without a GPU, :func:`unavailable` says so
and nothing runs. The CSV column names are Nsight Compute's; the parser keeps every numeric
column it finds (:class:`ProfileLine.metrics`), keyed by the header's text.
"""

from __future__ import annotations

import csv
import io
import json
import linecache
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "NCU_ENV",
    "Profile",
    "ProfileLine",
    "ncu_command",
    "ncu_path",
    "parse_raw_csv",
    "parse_source_csv",
    "profile",
    "profile_table",
    "stalls_by_launch",
    "stalls_of_lines",
    "unavailable",
]

NCU_ENV = "SPARSE_MLA_NCU"
# The kernel's stall samples by reason (Nsight Compute's metric group on sm70+).
STALL_GROUP = "group:smsp__pcsamp_warp_stall_reasons"
_STALL_RE = re.compile(r"smsp__pcsamp_warps_issue_stalled_(\w+?)(_not_issued)?(?:\.\w+)?$")


def ncu_path() -> str | None:
    """The ``ncu`` executable: ``$SPARSE_MLA_NCU``, else ``ncu`` on PATH (None: neither)."""
    env = os.environ.get(NCU_ENV)
    if env:
        return env if os.path.exists(env) else None
    return shutil.which("ncu")


def unavailable() -> str | None:
    """Why the profile view cannot run here (None: it can)."""
    from . import runtime

    if ncu_path() is None:
        return (
            "Nsight Compute (ncu) is not on PATH: the profile view needs it (set "
            f"${NCU_ENV} to its path); stall reasons per source line are measured, not "
            "cross-compiled"
        )
    if not runtime.has_gpu():
        return "no GPU here: Nsight Compute profiles a kernel running on this machine's GPU"
    return None


@dataclass
class ProfileLine:
    """One source line's measured counters (``metrics``: Nsight Compute column -> value)."""

    file: str
    line: int
    source: str
    metrics: dict[str, float] = field(default_factory=dict)

    def samples(self) -> float:
        """Its warp-stall samples (all samples), 0 when the column is absent."""
        return _pick(self.metrics, ("warp stall sampling (all", "stall sampling", "samples"))


@dataclass
class Profile:
    """A profiled launch: per source line counters, the kernel's stall samples by reason."""

    kernel: str
    launch: dict[str, Any]
    shape: dict[str, Any]
    lines: list[ProfileLine]
    stalls: dict[str, float]
    report: str  # the .ncu-rep file
    command: list[str]


def _pick(metrics: dict[str, float], keys: tuple[str, ...]) -> float:
    for k in keys:
        for name, v in metrics.items():
            if k in name.lower():
                return v
    return 0.0


# Thousands separators ncu may print (a comma, or a locale's space: NBSP, narrow NBSP, thin).
_THOUSANDS = re.compile(r"(?<=\d)[,\u00a0\u202f\u2009'](?=\d{3}(?:\D|$))")


def _number(text: str) -> float | None:
    """A CSV cell as a number: quotes, thousands separators and a trailing ``%`` dropped; None
    for an empty cell, ``-``, ``n/a`` or any text."""
    t = _THOUSANDS.sub("", text.strip().strip('"').strip())
    if t.endswith("%"):
        t = t[:-1].strip()
    if not t or t.lower() in ("-", "n/a", "nan"):
        return None
    try:
        return float(t)
    except ValueError:
        return None


def _csv_rows(text: str) -> list[list[str]]:
    """The CSV part of ncu's output (its own ``==PROF==`` / ``==WARNING==`` lines dropped)."""
    body = "\n".join(ln for ln in text.splitlines() if ln.strip() and not ln.startswith("=="))
    return [r for r in csv.reader(io.StringIO(body)) if any(c.strip() for c in r)]


# The source page's column names, as Nsight Compute versions spell them (lower case).
_LINE_COLS = ("line no", "line", "line number", "#", "# line")
_ADDRESS_COLS = ("address", "# address")
# Rows that name what follows ("File Path","/x/hopper_ws.py"; "Kernel Name","k"; ...).
_CONTEXT_ROWS = ("file path", "file", "kernel name", "function name")


def _header(cells: list[str]) -> dict[str, Any] | None:
    """The column positions of a source-page header row (None: not a header): the line number,
    the address and the Source columns (``cuda,sass`` has two: the source's, the SASS's)."""
    low = [c.strip().lower() for c in cells]
    sources = [i for i, c in enumerate(low) if c == "source"]
    line = next((i for i, c in enumerate(low) if c in _LINE_COLS), None)
    addr = next((i for i, c in enumerate(low) if c in _ADDRESS_COLS), None)
    if not sources or (line is None and addr is None):
        return None
    names = [c.strip() for c in cells]
    skip = {line, addr, *sources}
    return {"line": line, "addr": addr, "sources": sources, "names": names,
            "metrics": [i for i in range(len(names)) if i not in skip and names[i]]}  # fmt: skip


def _cell(row: list[str], i: int | None) -> str:
    return row[i].strip() if i is not None and i < len(row) else ""


def parse_source_csv(text: str, default_file: str = "") -> list[ProfileLine]:
    """Per source line counters from ``ncu --import R --csv --page source --print-source V``.

    Nsight Compute writes, per kernel and file, context rows (``"File Path","/x/hopper_ws.py"``,
    ``"Kernel Name","k"``, ``"Function Name","k"``; older: one cell ``File: path``), a header
    row, optionally a units row, then data rows. The header names a line column (``Line No``;
    ``#`` / ``Line`` in other versions) and/or an address column (``Address`` / ``# Address``)
    and one ``Source`` column, or two for ``cuda,sass`` (the source line's text, then the SASS
    text: taken by position). Views:

    - ``cuda``: one row per source line, its counters;
    - ``cuda,sass``: a source line's row (line number, no address; its counters are the sum of
      its instructions') followed by its instructions' rows (address, no line number); the
      line's own row is used, else the sum of its instructions' rows (never both);
    - ``sass``: one row per instruction, no line number: each becomes a line of file
      ``(sass)`` numbered by its address, its text as the source.

    Numbers may be quoted, with thousands separators or a ``%``; a units row, ``...`` rows
    (collapsed listing) and cells of ``-`` / ``n/a`` are skipped. Every other column whose
    cells are numbers becomes a metric, named by the header. Lines without a non-zero metric are
    dropped."""
    out: dict[tuple[str, int], ProfileLine] = {}
    from_sass: dict[tuple[str, int], dict[str, float]] = {}
    own: set[tuple[str, int]] = set()  # lines whose own row carried counters
    h: dict[str, Any] | None = None
    file, line = default_file, None
    for r in _csv_rows(text):
        cells = [c.strip() for c in r]
        first = cells[0].lower()
        filled = [c for c in cells if c]
        if first in _CONTEXT_ROWS and len(filled) <= 2:
            if first.startswith("file") and len(cells) > 1:
                file, line = Path(cells[1]).name, None
            continue
        if len(filled) == 1 and (first.startswith("file:") or cells[0].endswith(".py")):
            file, line = Path(cells[0].split(":", 1)[-1].strip() if first.startswith("file:")
                              else cells[0]).name, None  # fmt: skip
            continue
        hdr = _header(cells)
        if hdr is not None:
            h = hdr
            continue
        if h is None:
            continue
        n = _number(_cell(cells, h["line"]))
        addr = _cell(cells, h["addr"])
        metrics = {}
        for i in h["metrics"]:
            v = _number(_cell(cells, i))
            if v is not None:
                metrics[h["names"][i]] = v
        if n is not None and float(n).is_integer() and not addr.lower().startswith("0x"):
            line = int(n)
            key = (file, line)
            src = _cell(cells, h["sources"][0])
            pl = out.setdefault(key, ProfileLine(file, line, src, {}))
            pl.source = pl.source or src
            if metrics:
                pl.metrics = metrics
                own.add(key)
            continue
        if not addr.lower().startswith("0x"):
            continue  # a units row, a collapsed "..." row, or text
        sass = _cell(cells, h["sources"][-1])
        if h["line"] is None:  # the sass view: each instruction is a "line"
            key = ("(sass)", int(addr, 16))
            out[key] = ProfileLine("(sass)", key[1], sass, metrics)
            own.add(key)
            continue
        if line is None:
            continue
        acc = from_sass.setdefault((file, line), {})
        for k, v in metrics.items():
            acc[k] = acc.get(k, 0.0) + v
    for key, pl in out.items():
        if key not in own and key in from_sass:
            pl.metrics = from_sass[key]
    return [pl for pl in out.values() if any(pl.metrics.values())]


def stalls_of_lines(lines: list[ProfileLine]) -> dict[str, float]:
    """The kernel's stall samples by reason summed over the source page's per-reason columns
    (``smsp__pcsamp_warps_issue_stalled_<reason>``, or ``stall_<reason>`` in some versions;
    the ``_not_issued`` ones left out), largest first: the raw page's answer when that page
    gave none."""
    out: dict[str, float] = {}
    for pl in lines:
        for name, v in pl.metrics.items():
            reason = _stall_reason(name)
            if reason and v:
                out[reason] = out.get(reason, 0.0) + v
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _stall_reason(name: str) -> str | None:
    n = name.strip()
    m = _STALL_RE.search(n)
    if m:
        return None if m.group(2) else m.group(1)
    m = re.match(r"^stall_(\w+?)(_not_issued)?$", n, re.IGNORECASE)
    if m and not m.group(2):
        return m.group(1).lower()
    return None


def stalls_by_launch(text: str) -> list[tuple[str, dict[str, float]]]:
    """Each profiled launch's warp-stall samples by reason from ``ncu --page raw --csv``: (its
    kernel name, "" without that column; {reason: samples}), one per row of the header's width
    that carries samples (a units row carries none). The header is the first row naming a stall
    metric (``smsp__pcsamp_warps_issue_stalled_<reason>``, with or without a ``.sum``-like
    suffix); reasons with no sample are dropped."""
    rows = _csv_rows(text)
    at = next((i for i, r in enumerate(rows) if any(_stall_reason(c) for c in r)), None)
    if at is None:
        return []
    header = [c.strip() for c in rows[at]]
    cols = [(i, reason) for i, c in enumerate(header) if (reason := _stall_reason(c))]
    name_col = header.index("Kernel Name") if "Kernel Name" in header else None
    out: list[tuple[str, dict[str, float]]] = []
    for r in rows[at + 1 :]:
        if len(r) != len(header):
            continue
        counts: dict[str, float] = {}
        for i, reason in cols:
            v = _number(r[i])
            if v:
                counts[reason] = counts.get(reason, 0.0) + v
        if counts:
            out.append((r[name_col].strip() if name_col is not None else "", counts))
    return out


def parse_raw_csv(text: str) -> dict[str, float]:
    """The kernel's warp-stall samples by reason from ``ncu --page raw --csv``, summed over the
    profiled launches (:func:`stalls_by_launch`), largest first."""
    out: dict[str, float] = {}
    for _name, counts in stalls_by_launch(text):
        for reason, v in counts.items():
            out[reason] = out.get(reason, 0.0) + v
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def ncu_command(ncu: str, report: str, script: list[str], kernel_regex: str) -> list[str]:
    """The ncu command line that profiles the second matching launch of ``script``."""
    return [
        ncu, "--target-processes", "all", "--kernel-name-base", "function",
        "--kernel-name", f"regex:{kernel_regex}", "--launch-skip", "1", "--launch-count", "1",
        "--section", "SourceCounters", "--section", "WarpStateStats", "--metrics",
        STALL_GROUP, "--import-source", "yes", "--force-overwrite", "--export", report,
        *script,
    ]  # fmt: skip


def workload_error(context: int, topk: int | None) -> str | None:
    """Why :func:`profile` refuses a workload's ``context`` / ``topk`` (None: it takes them),
    for callers that check before they resolve a launch (``sparse-mla profile``)."""
    if context < 0 or (topk is not None and topk < 1):
        return f"context must be >= 0 and topk >= 1, got {context} and {topk}"
    return None


def profile(
    kernel: str,
    num_heads: int,
    head_dim: int = 512,
    *,
    launch: Any = None,
    num_tokens: int = 4096,
    context: int = 0,
    topk: int | None = None,
    ncu: str | None = None,
    timeout: float = 600.0,
    out_dir: str | os.PathLike | None = None,
) -> Profile:
    """Profile one launch of registered kernel ``kernel`` (its ``launch``; None: the one
    :func:`sparse_mla.tune.base_launch` gives) at H, D on a DSv4 CSA workload of
    ``num_tokens`` tokens (``context`` tokens cached before the call, as ``sparse-mla bench
    --grid --context`` builds it: from 4 x top-k on, every token's list is whole; ``topk``:
    the workload's top-k, None: the grid's, 1024 at 96 heads and more, else 512);
    RuntimeError with the reason when it cannot run here."""
    from . import dispatch, tune
    from . import inspect as _inspect

    bad = workload_error(context, topk)
    if bad:
        raise ValueError(bad)
    why = unavailable() if ncu is None else None
    if why:
        raise RuntimeError(why)
    ncu = ncu or ncu_path()
    if launch is None:
        launch = tune.base_launch(kernel, "local", num_heads, head_dim, num_tokens=num_tokens)[0]
    launch_dict = tune.launch_json(kernel, launch) if kernel != dispatch.FALLBACK else \
        launch.to_dict()  # fmt: skip
    _, res = _inspect.compile_kernel(kernel, "local", num_heads=num_heads, head_dim=head_dim,
                                     config=launch)  # fmt: skip
    folder = Path(out_dir or tempfile.mkdtemp(prefix="sparse_mla_ncu_"))
    folder.mkdir(parents=True, exist_ok=True)
    report = str(folder / "profile.ncu-rep")
    if topk is None:
        from .bench import _grid_topk

        topk = _grid_topk(num_heads)
    args = {"kernel": kernel, "launch": launch_dict, "H": num_heads, "D": head_dim,
            "T": num_tokens, "context": int(context), "topk": int(topk)}  # fmt: skip
    script = [sys.executable, "-m", "sparse_mla.profile", "--run", json.dumps(args)]
    cmd = ncu_command(ncu, report, script, f"^{re.escape(res.kernel_name)}$")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
        str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH")])))  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode != 0 or not os.path.exists(report):
        tail = (done.stdout + done.stderr)[-2000:]
        raise RuntimeError(f"ncu failed (exit {done.returncode}): {tail}")

    def page(name: str, *extra: str) -> str:
        """One page of the report as CSV (base units: no "K"/"M" scaling), kept beside the
        report as ``<name>.csv`` so a parse can be checked against what ncu wrote."""
        r = subprocess.run([ncu, "--import", report, "--csv", "--print-units", "base", *extra],
                           capture_output=True, text=True, timeout=timeout)  # fmt: skip
        if r.returncode != 0:
            raise RuntimeError(f"ncu --import {' '.join(extra)} failed: {r.stderr[-1000:]}")
        (folder / f"{name}.csv").write_text(r.stdout)
        return r.stdout

    # The source lines with their instructions (cuda,sass), else the instructions alone.
    lines = parse_source_csv(page("source", "--page", "source", "--print-source", "cuda,sass"))
    if not lines:
        lines = parse_source_csv(page("source_sass", "--page", "source", "--print-source", "sass"))
    for pl in lines:
        if not pl.source and pl.file != "(sass)":
            pl.source = linecache.getline(_source_path(pl.file), pl.line).strip()
    stalls = parse_raw_csv(page("raw", "--page", "raw", "--metrics", STALL_GROUP))
    stalls = stalls or stalls_of_lines(lines)
    shape = {"H": num_heads, "D": head_dim, "T": num_tokens, "context": int(context),
             "topk": int(topk)}  # fmt: skip
    return Profile(kernel, launch_dict, shape, lines, stalls, report, cmd)


def _source_path(name: str) -> str:
    here = Path(__file__).resolve().parent
    for p in (here / name, here / "gluon" / name):
        if p.exists():
            return str(p)
    return name


def profile_table(p: Profile, top: int = 20) -> str:
    """The profile as text: the kernel's stall reasons, then the source lines with the most
    warp-stall samples (their share of all samples and every counter ncu gave)."""
    from .inspect import _table

    total = sum(pl.samples() for pl in p.lines) or 1.0
    where = "".join(f" {k}={p.shape[k]}" for k in ("topk", "context") if p.shape.get(k))
    head = (f"{p.kernel} {p.launch} at H={p.shape['H']} D={p.shape['D']} T={p.shape['T']}"
            f"{where} (Nsight Compute report {p.report})")  # fmt: skip
    reasons = sum(p.stalls.values()) or 1.0
    shares = [[k, int(v), f"{100 * v / reasons:.1f}%"] for k, v in p.stalls.items()]
    parts = [head, "stall reasons (warp samples, whole kernel):",
             _table(["reason", "samples", "share"], shares)]  # fmt: skip
    lines = sorted(p.lines, key=lambda pl: -pl.samples())[:top]
    cols = sorted({k for pl in lines for k in pl.metrics})
    rows = [[f"{pl.file}:{pl.line}", f"{100 * pl.samples() / total:.1f}%",
             *[_fmt(pl.metrics.get(c)) for c in cols], pl.source[:60]] for pl in lines]  # fmt: skip
    parts += [f"source lines with the most stall samples (top {len(lines)}):",
              _table(["line", "share", *cols, "source"], rows)]  # fmt: skip
    return "\n".join(parts)


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.0f}" if float(v).is_integer() else f"{v:.3g}"


def _run(args: dict[str, Any]) -> None:
    """The profiled process: a warm-up call (compiles), then the call ncu records."""
    import torch

    from . import dispatch, runtime
    from .prefill import sparse_mla_prefill
    from .workloads import dsv4_csa

    w = dsv4_csa(int(args["T"]), int(args["H"]), D=int(args["D"]), device="cuda",
                 big_buffer=True, context=int(args.get("context", 0)),
                 topk=int(args.get("topk", 512)))  # fmt: skip
    name = args["kernel"]
    k = dispatch.kernel(name)
    call = dispatch.Call(runtime.arch(), int(args["H"]), int(args["D"]))
    launch = k.resolve(dict(args["launch"]), call) if name != dispatch.FALLBACK else None
    config = dispatch.Choice(name, launch) if name != dispatch.FALLBACK else args["launch"]
    q, kv, idx, indptr, scale = w.args()
    if k.kv_format == "fp8_model1":  # an FP8-cache kernel reads the pool quantized
        from .fp8 import quantize

        kv = quantize(kv, 64)
    out = torch.empty_like(q)
    for _ in range(2):
        sparse_mla_prefill(q, kv, idx, indptr, scale, **w.kwargs(), out=out, config=config)
    torch.cuda.synchronize()


if __name__ == "__main__":  # pragma: no cover (runs under ncu)
    if len(sys.argv) == 3 and sys.argv[1] == "--run":
        _run(json.loads(sys.argv[2]))
    else:
        sys.exit("usage: python -m sparse_mla.profile --run JSON")
