"""Figures of a benchmark run (notebook 06): every provider's time against the same-run floors.

Both read :func:`sparse_mla.bench.run_summary` of rows from a bench CSV (the committed
``data/bench/<device>.csv`` or a fresh run), so they draw on a machine without a GPU:

- :func:`floors_figure`: one panel per workload, a bar per provider (the package's kernels,
  ``default``, PyTorch, the peers), with the run's gather floor (gathered bytes / measured row
  gather rate) and matmul floor (FLOPs / measured bf16 matmul rate) as lines, and each bar's
  fraction of the floor: who is closest to the limit, at a glance;
- :func:`roofline_figure`: the classic roofline (FLOP per gathered byte against TFLOP/s) with
  the measured matmul roof and the gather roofs, one point per (workload, provider).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from matplotlib.figure import Figure

__all__ = [
    "PEERS",
    "floors_figure",
    "provider_color",
    "roofline_conclusion",
    "roofline_figure",
    "summary_markdown",
    "summary_table",
]

# Peers are drawn in warm colours, the package's kernels in cool ones, PyTorch in grey.
PEERS = ("flashmla", "flashmla_pad64", "flashmla_pad128", "aiter")
_COLORS = {
    "flashmla": "#d62728", "flashmla_pad64": "#ff7f0e", "flashmla_pad128": "#ffbb78",
    "aiter": "#bcbd22", "torch": "#7f7f7f", "triton": "#1f77b4", "gluon": "#17becf",
    "gluon_ws": "#17becf", "gluon_ws_small": "#9edae5", "gluon_wgmma": "#393b79",
    "gluon_mma": "#6b6ecf", "default": "#2ca02c",
}  # fmt: skip
_OTHERS = ("#9467bd", "#8c564b", "#e377c2", "#aec7e8")


def provider_color(name: str) -> str:
    """A fixed colour per provider (a kernel added later gets one of the spare colours)."""
    if name in _COLORS:
        return _COLORS[name]
    return _OTHERS[sum(map(ord, name)) % len(_OTHERS)]


def _ordered(workloads: Mapping[str, Any]) -> list[str]:
    return sorted(workloads, key=lambda n: (workloads[n]["H"], workloads[n]["topk"] or 0, n))


def floors_figure(summary: Mapping[str, Any], *, cols: int = 3) -> Figure:
    """A panel per workload: each provider's time (bars, fastest on top) against the gather
    and matmul floors measured in the same run; labels give ms and the fraction of the floor."""
    work = summary["workloads"]
    names = _ordered(work)
    if not names:
        raise ValueError("the summary has no workloads")
    cols = max(1, min(cols, len(names)))
    rows = math.ceil(len(names) / cols)
    fig = Figure(figsize=(5.2 * cols, 0.45 * _most_providers(work) * rows + 1.6 * rows))
    for i, name in enumerate(names):
        ax = fig.add_subplot(rows, cols, i + 1)
        w = work[name]
        ms = sorted(w["ms"].items(), key=lambda kv: kv[1], reverse=True)
        labels = [p for p, _ in ms]
        ax.barh(range(len(ms)), [t for _, t in ms], color=[provider_color(p) for p in labels])
        ax.set_yticks(range(len(ms)), labels)
        floor = w.get("floor_ms")
        for t, (_, v) in enumerate(ms):
            frac = f" ({floor / v:.0%} of floor)" if floor else ""
            ax.text(v, t, f" {v:.2f} ms{frac}", va="center", fontsize=7)
        for key, style, color, text in (("gather_ms", "--", "#2ca02c", "gather floor"),
                                        ("matmul_ms", ":", "#9467bd", "matmul floor")):  # fmt: skip
            if w.get(key):
                ax.axvline(w[key], linestyle=style, color=color, label=f"{text} {w[key]:.2f} ms")
        if w["failed"]:
            ax.set_xlabel("ms   (failed the check: " + ", ".join(w["failed"]) + ")", fontsize=7)
        else:
            ax.set_xlabel("ms")
        top = max([t for _, t in ms] + [w.get("gather_ms") or 0, w.get("matmul_ms") or 0])
        ax.set_xlim(0, top * 1.55)
        ax.set_title(f"{name}  (H={w['H']}, T={w['T']})", fontsize=9)
        ax.legend(fontsize=7, loc="upper right")  # beside the fastest (shortest, top) bar
    fig.suptitle(_caption(summary), fontsize=9)
    fig.tight_layout()
    return fig


def roofline_figure(summary: Mapping[str, Any]) -> Figure:
    """FLOP per gathered byte against TFLOP/s: the run's matmul roof, its gather roofs (one per
    gather rate the workloads' floors used) and a point per (workload, provider)."""
    work = summary["workloads"]
    fig = Figure(figsize=(7.5, 5))
    ax = fig.add_subplot(1, 1, 1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    xs = [w["flops"] / w["bytes"] for w in work.values() if w["bytes"]]
    if not xs:
        raise ValueError("the summary has no workloads")
    lo, hi = min(xs) / 2, max(xs) * 2
    roofs = {}
    for w in work.values():
        if w.get("matmul_ms"):
            roofs["matmul"] = w["flops"] / (w["matmul_ms"] * 1e-3) / 1e12
        if w.get("gather_ms"):
            rate = w["bytes"] / (w["gather_ms"] * 1e-3) / 1e12  # TB/s
            roofs.setdefault(f"gather {rate:.2f} TB/s", rate)
    mm = roofs.pop("matmul", None)
    for j, (label, rate) in enumerate(sorted(roofs.items(), key=lambda kv: -kv[1])):
        top = mm if mm else rate * hi
        knee = min(hi, top / rate)
        ax.plot([lo, knee], [rate * lo, rate * knee], "--", color="#2ca02c", lw=1)
        # The fastest roof's label above its line, the others below theirs: never on each other.
        ax.text(lo, rate * lo, " " + label, fontsize=7, va="bottom" if j == 0 else "top",
                color="#2ca02c")  # fmt: skip
    if mm:
        ax.axhline(mm, linestyle=":", color="#9467bd", lw=1)
        ax.text(lo, mm, f" bf16 matmul {mm:.0f} TFLOP/s", fontsize=7, va="bottom", color="#9467bd")
    seen = set()
    ymin, ymax = math.inf, mm or 0.0
    # Workloads sharing a column (same H) get their labels one above the other, numbered;
    # the names are in a key under the plot, so no label overlaps another or the title.
    keys = []
    column: dict[float, int] = {}
    for i, name in enumerate(_ordered(work), 1):
        w = work[name]
        x = w["flops"] / w["bytes"]
        ys = []
        # `default` is the kernel the dispatch picked: a ring over that kernel's own point.
        for prov, t in sorted(w["ms"].items(), key=lambda kv: kv[0] == "default"):
            ys.append(w["flops"] / (t * 1e-3) / 1e12)
            ring = prov == "default"
            ax.scatter([x], [ys[-1]], s=90 if ring else 28, zorder=4 if ring else 3,
                       facecolors="none" if ring else provider_color(prov),
                       edgecolors=provider_color(prov), linewidths=1.6 if ring else 0.5,
                       label=prov if prov not in seen else None)  # fmt: skip
            seen.add(prov)
        if ys:
            k = column.get(round(x, 6), 0)
            column[round(x, 6)] = k + 1
            ax.annotate(str(i), (x, min(ys)), fontsize=7, ha="center", va="top",
                        xytext=(0, -6 - 9 * k), textcoords="offset points")  # fmt: skip
            ymin, ymax = min(ymin, min(ys)), max(ymax, max(ys))
            keys.append(f"{i}: {name}")
    ax.set_xlim(lo, hi)
    if math.isfinite(ymin):
        ax.set_ylim(ymin / (2.5 + 0.6 * max(column.values(), default=1)), ymax * 2.2)
    ax.set_xlabel("FLOP per gathered byte")
    ax.set_ylabel("TFLOP/s")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False,
              title="provider (ring: default)", title_fontsize=7)  # fmt: skip
    fig.suptitle(_caption(summary), fontsize=9)
    per_row = 3
    lines = ["   ".join(keys[j : j + per_row]) for j in range(0, len(keys), per_row)]
    fig.text(0.01, 0.01, "\n".join(lines), fontsize=7, va="bottom", family="monospace")
    fig.tight_layout(rect=(0, 0.03 + 0.035 * len(lines), 1, 0.95))
    return fig


def roofline_conclusion(summary: Mapping[str, Any]) -> list[str]:
    """One sentence per workload: the fastest provider, the fraction of the same-run floor it
    reaches, which roof binds (gather or matmul) and how far ``default`` is from the fastest
    (each number from that workload's own row, never summed over workloads)."""
    out = []
    for name in _ordered(summary["workloads"]):
        w = summary["workloads"][name]
        if not w["ms"]:
            continue
        best = min(w["ms"], key=w["ms"].get)
        t = w["ms"][best]
        g, m = w.get("gather_ms") or 0.0, w.get("matmul_ms") or 0.0
        bound = "gather (bandwidth)" if g >= m else "matmul (compute)"
        floor = w.get("floor_ms") or max(g, m)
        frac = f"{floor / t:.0%} of its floor" if floor else "no floor measured"
        line = f"{name} (H={w['H']}, T={w['T']}): {best} {t:.3f} ms, {frac}; {bound}-bound"
        d = w["ms"].get("default")
        if d is not None and best != "default":
            line += f"; default {d:.3f} ms ({d / t:.2f}x the fastest)"
        out.append(line)
    return out


def summary_table(summary: Mapping[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """(header, rows): ms per workload and provider, the floors, the best provider."""
    work = summary["workloads"]
    provs: list[str] = []
    for w in work.values():
        provs += [p for p in w["ms"] if p not in provs]
    header = ["workload", *provs, "gather floor", "matmul floor", "fastest"]
    rows = []
    for name in _ordered(work):
        w = work[name]
        cells = [f"{w['ms'][p]:.2f}" if p in w["ms"] else None for p in provs]
        best = min(w["ms"], key=w["ms"].get) if w["ms"] else None
        floors = [f"{w[k]:.2f}" if w.get(k) else None for k in ("gather_ms", "matmul_ms")]
        rows.append([name, *cells, *floors, best])
    return header, rows


def summary_markdown(summary: Mapping[str, Any]) -> str:
    """:func:`summary_table` as a markdown table (for the README's performance table)."""
    header, rows = summary_table(summary)
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join("-" if v is None else str(v) for v in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _most_providers(work: Mapping[str, Any]) -> int:
    return max([len(w["ms"]) for w in work.values()] + [1])


def _caption(summary: Mapping[str, Any]) -> str:
    commit = (summary.get("commit") or "?")[:7]
    return (f"{summary.get('device')}, run {summary.get('run')} at {commit} "
            f"(torch {summary.get('torch')}, Triton {summary.get('triton')})")  # fmt: skip
