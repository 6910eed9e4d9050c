"""Measured stalls per source line: one launch of a registered kernel under Nsight Compute.

:func:`profile` runs ``python -m sparse_mla.profile --run ...`` (one warm-up call of
``sparse_mla_prefill(config=Choice(kernel, launch))`` on a DSv4 CSA workload, then the profiled
call) under ``ncu`` with the source counters (``--section SourceCounters --section
WarpStateStats``, the stall-reason sampling group, ``--import-source yes``), then reads the
report back twice as CSV: ``--page source --print-source cuda`` (per source line: warp-stall
samples and instructions issued; Triton and Gluon compile with line info, so the lines are
those of ``prefill.py`` / ``gluon/hopper_ws.py``) and ``--page raw`` (the kernel's stall
samples by reason). For a warp-specialised kernel the producer's and the consumers' lines are
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
    "unavailable",
]

NCU_ENV = "SPARSE_MLA_NCU"
# The kernel's stall samples by reason (Nsight Compute's metric group on sm70+).
STALL_GROUP = "group:smsp__pcsamp_warp_stall_reasons"
_STALL_RE = re.compile(r"smsp__pcsamp_warps_issue_stalled_(\w+?)(?:_not_issued)?$")


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


def _number(text: str) -> float | None:
    t = text.strip().replace(",", "")
    if t.endswith("%"):
        t = t[:-1]
    try:
        return float(t)
    except ValueError:
        return None


def _csv_rows(text: str) -> list[list[str]]:
    """The CSV part of ncu's output (its own ``==PROF==`` / ``==WARNING==`` lines dropped)."""
    body = "\n".join(ln for ln in text.splitlines() if ln.strip() and not ln.startswith("=="))
    return [r for r in csv.reader(io.StringIO(body)) if r]


def parse_source_csv(text: str, default_file: str = "") -> list[ProfileLine]:
    """Per source line counters from ``ncu --page source --csv --print-source cuda``.

    The header row names a line column (``#`` / ``Line``) and a ``Source`` column; a row of
    one cell naming a file (``File: path``, or a path ending in ``.py``) starts that file's
    lines. Every other column whose cells are numbers becomes a metric. Lines without any
    non-zero metric are dropped."""
    rows = _csv_rows(text)
    out: list[ProfileLine] = []
    header: list[str] | None = None
    file = default_file
    for r in rows:
        cells = [c.strip() for c in r]
        if len([c for c in cells if c]) == 1 and (
            cells[0].lower().startswith("file") or cells[0].endswith(".py")
        ):
            file = Path(cells[0].split(":", 1)[-1].strip() if ":" in cells[0] and not
                        cells[0].startswith("/") else cells[0]).name  # fmt: skip
            continue
        lower = [c.lower() for c in cells]
        if header is None or ("source" in lower and any(c in ("#", "line") for c in lower)):
            if "source" in lower:
                header = cells
            continue
        row = dict(zip(header, cells, strict=False))
        line_key = next((h for h in header if h.lower() in ("#", "line", "line number")), None)
        if line_key is None:
            continue
        n = _number(row.get(line_key, ""))
        if n is None:
            continue
        metrics = {}
        for h in header:
            if h in (line_key, "Source", "Address") or h.lower() in ("source", "address"):
                continue
            v = _number(row.get(h, ""))
            if v is not None:
                metrics[h] = v
        if not any(metrics.values()):
            continue
        out.append(ProfileLine(file, int(n), row.get("Source", "").strip(), metrics))
    return out


def parse_raw_csv(text: str) -> dict[str, float]:
    """The kernel's warp-stall samples by reason from ``ncu --page raw --csv`` (summed over
    the profiled launches), largest first; reasons with no sample are dropped."""
    rows = _csv_rows(text)
    if len(rows) < 2:
        return {}
    header = rows[0]
    data = [r for r in rows[1:] if len(r) == len(header) and _number(r[-1]) is not None]
    out: dict[str, float] = {}
    for i, name in enumerate(header):
        m = _STALL_RE.search(name.strip())
        if not m or name.strip().endswith("_not_issued"):
            continue
        total = sum(v for r in data if (v := _number(r[i])) is not None)
        if total:
            out[m.group(1)] = out.get(m.group(1), 0.0) + total
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


def profile(
    kernel: str,
    num_heads: int,
    head_dim: int = 512,
    *,
    launch: Any = None,
    num_tokens: int = 4096,
    ncu: str | None = None,
    timeout: float = 600.0,
    out_dir: str | os.PathLike | None = None,
) -> Profile:
    """Profile one launch of registered kernel ``kernel`` (its ``launch``; None: the one
    :func:`sparse_mla.tune.base_launch` gives) at H, D on a DSv4 CSA workload of
    ``num_tokens`` tokens; RuntimeError with the reason when it cannot run here."""
    from . import dispatch, tune
    from . import inspect as _inspect

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
    args = {"kernel": kernel, "launch": launch_dict, "H": num_heads, "D": head_dim,
            "T": num_tokens}  # fmt: skip
    script = [sys.executable, "-m", "sparse_mla.profile", "--run", json.dumps(args)]
    cmd = ncu_command(ncu, report, script, f"^{re.escape(res.kernel_name)}$")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
        str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH")])))  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode != 0 or not os.path.exists(report):
        tail = (done.stdout + done.stderr)[-2000:]
        raise RuntimeError(f"ncu failed (exit {done.returncode}): {tail}")

    def page(*extra: str) -> str:
        r = subprocess.run([ncu, "--import", report, "--csv", *extra], capture_output=True,
                           text=True, timeout=timeout)  # fmt: skip
        if r.returncode != 0:
            raise RuntimeError(f"ncu --import {' '.join(extra)} failed: {r.stderr[-1000:]}")
        return r.stdout

    lines = parse_source_csv(page("--page", "source", "--print-source", "cuda"))
    for pl in lines:
        if not pl.source:
            pl.source = linecache.getline(_source_path(pl.file), pl.line).strip()
    stalls = parse_raw_csv(page("--page", "raw", "--metrics", STALL_GROUP))
    shape = {"H": num_heads, "D": head_dim, "T": num_tokens}
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
    head = (f"{p.kernel} {p.launch} at H={p.shape['H']} D={p.shape['D']} T={p.shape['T']} "
            f"(Nsight Compute report {p.report})")  # fmt: skip
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
                 big_buffer=True)  # fmt: skip
    name = args["kernel"]
    k = dispatch.kernel(name)
    call = dispatch.Call(runtime.arch(), int(args["H"]), int(args["D"]))
    launch = k.resolve(dict(args["launch"]), call) if name != dispatch.FALLBACK else None
    config = dispatch.Choice(name, launch) if name != dispatch.FALLBACK else args["launch"]
    out = torch.empty_like(w.q)
    for _ in range(2):
        sparse_mla_prefill(*w.args(), **w.kwargs(), out=out, config=config)
    torch.cuda.synchronize()


if __name__ == "__main__":  # pragma: no cover (runs under ncu)
    if len(sys.argv) == 3 and sys.argv[1] == "--run":
        _run(json.loads(sys.argv[2]))
    else:
        sys.exit("usage: python -m sparse_mla.profile --run JSON")
