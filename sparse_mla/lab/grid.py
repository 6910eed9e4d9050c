"""The H x T grid of a bench run (notebook 06): is ``config=None`` the kernel to use at every
shape an engine sends?

A grid run (``sparse-mla bench --grid``, written to ``data/bench/<device>_grid.csv``) benches
the CSA workloads at every head count an engine puts on one GPU and at every prompt chunk
length, each point with the package's kernels, ``default`` (what ``config=None`` runs, its
``config`` naming the kernel) and FlashMLA (``flashmla`` at H 64/128, ``flashmla_pad*`` with the
heads zero-padded). Everything here reads the rows of one run (:func:`grid_run`: the same rule
as :func:`sparse_mla.bench.run_summary`) and checks issue 22's goals at each point:

- ``default <= FlashMLA`` (:data:`GOAL_FLASHMLA`): a user loses nothing by calling the package
  instead of padding the heads for FlashMLA;
- ``default <= 1.05 x`` the fastest package kernel (:data:`GOAL_KERNEL`): the dispatch picks a
  kernel within 5% of the best one the package has at that shape (the summary also judges the
  choice by the forced rows alone, ``choice_vs_best``: the kernel ``default`` ran against the
  fastest, each timed forced, so a long call's spread between two rows of one kernel does not
  count against the rule);
- moonshot, ``default <= 0.75 x FlashMLA`` (:data:`GOAL_MOONSHOT`), judged only where FlashMLA
  pads most and the call is short: H <= 48 and T <= 256.

A point whose ``default`` row failed its check misses every goal (the moonshot inside its
region); a point with no ``default`` row is missing and judged on none.

- :func:`grid_table`: one tidy dict per (workload, T) with the times, ratios and goal flags;
- :func:`grid_heatmaps`: default / FlashMLA over H x T, which kernel default ran, default /
  fastest package kernel;
- :func:`grid_summary`: a few lines: points meeting each goal, the worst ratio and where.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from matplotlib.figure import Figure

from .._consts import NON_KERNEL_PROVIDERS

__all__ = [
    "GOAL_FLASHMLA",
    "GOAL_KERNEL",
    "GOAL_MOONSHOT",
    "MOONSHOT_MAX_H",
    "MOONSHOT_MAX_T",
    "TABLE_COLUMNS",
    "grid_heatmaps",
    "grid_run",
    "grid_summary",
    "grid_table",
    "is_package_kernel",
    "table_cells",
    "worst_points",
]

GOAL_FLASHMLA = 1.0  # default / FlashMLA at most this
GOAL_KERNEL = 1.05  # default / fastest package kernel at most this
GOAL_MOONSHOT = 0.75  # default / FlashMLA at most this, where judged:
MOONSHOT_MAX_H = 48
MOONSHOT_MAX_T = 256

# Providers that are not the package's kernels: the bench's others (by name; flashmla's padded
# variants and the ceilings by prefix).
_NOT_KERNEL_PREFIXES = ("flashmla", "ceiling:")

# The columns of :func:`table_cells` (keys of :func:`grid_table`'s points).
TABLE_COLUMNS = (
    "workload", "H", "T", "status", "default_ms", "default_kernel", "best_kernel",
    "best_kernel_ms", "flashmla", "flashmla_ms", "vs_flashmla", "vs_best_kernel",
    "meets_flashmla", "meets_kernel", "moonshot",
)  # fmt: skip


def is_package_kernel(provider: str | None) -> bool:
    """True for a package kernel's provider name: anything but the bench's other providers
    (:data:`sparse_mla._consts.NON_KERNEL_PROVIDERS`: ``default``, the dense-ids forms,
    ``torch``, ``flashmla*``, ``aiter``) and ``ceiling:*`` (the registry's names are never
    hard-coded)."""
    if not provider or provider in NON_KERNEL_PROVIDERS:
        return False
    return not provider.startswith(_NOT_KERNEL_PREFIXES)


def grid_run(rows: Sequence[Mapping[str, Any]], run: str | None = None) -> str:
    """The run (its ``timestamp``) the grid functions read: ``run`` when given, else the latest
    run with workload rows, as :func:`sparse_mla.bench.run_summary` picks it."""
    from ..bench import pick_run

    return pick_run(rows, run)


def _config(row: Mapping[str, Any]) -> dict[str, Any]:
    cfg = row.get("config")
    if isinstance(cfg, str):
        try:
            cfg = json.loads(cfg)
        except ValueError:
            return {}
    return dict(cfg) if isinstance(cfg, Mapping) else {}


def _timed(row: Mapping[str, Any]) -> float | None:
    """The row's ms when it passed its check and was timed (run_summary's rule), else None."""
    if row.get("ok") and row.get("ms"):
        return float(row["ms"])
    return None


def _in_moonshot(H: int, T: int) -> bool:
    return H <= MOONSHOT_MAX_H and T <= MOONSHOT_MAX_T


def grid_table(
    rows: Sequence[Mapping[str, Any]], run: str | None = None, *, family: str = "csa"
) -> list[dict[str, Any]]:
    """One run's grid, a dict per (workload, T) point, sorted by (H, T, topk).

    Args:
        rows: :func:`sparse_mla.bench.read_rows` rows, possibly of several runs.
        run: a run's ``timestamp`` (default: the latest, :func:`grid_run`).
        family: the workloads' name prefix (``"csa"``: ``csa_h{H}_topk{k}``; ``"glm"``).

    Returns:
        Points with keys ``workload``, ``H``, ``T``, ``topk``; ``status`` ("ok", "failed": the
        default row failed its check, "missing": no default row); ``default_ms``,
        ``default_kernel`` (its config's "kernel"), ``note`` (the default row's); ``kernels``
        ({package kernel: ms} of those timed), ``best_kernel``, ``best_kernel_ms`` (the fastest
        of them); ``flashmla`` (the provider: ``flashmla`` or ``flashmla_pad*``, the fastest
        where several ran), ``flashmla_ms``; ``vs_flashmla`` = default_ms / flashmla_ms,
        ``vs_best_kernel`` = default_ms / best_kernel_ms; and the goals, each True, False or
        None (not judged: a missing point, a comparator that did not run, the moonshot outside
        H <= 48 and T <= 256): ``meets_flashmla`` (vs_flashmla <= 1), ``meets_kernel``
        (vs_best_kernel <= 1.05), ``moonshot`` (vs_flashmla <= 0.75). A failed point is False
        on both goals, and on the moonshot inside its region.
    """
    run = grid_run(rows, run)
    prefix = f"{family}_"
    points: dict[tuple[str, int], dict[str, Any]] = {}
    for r in rows:
        if r.get("timestamp") != run or not str(r.get("workload") or "").startswith(prefix):
            continue
        if r.get("T") is None or r.get("H") is None:
            continue
        key = (r["workload"], int(r["T"]))
        p = points.setdefault(key, {"workload": key[0], "H": int(r["H"]), "T": key[1],
                                    "topk": r.get("topk"), "default": None, "kernels": {},
                                    "flashmla": {}})  # fmt: skip
        prov = r.get("provider") or ""
        ms = _timed(r)
        if prov == "default":
            p["default"] = r
        elif prov.startswith("flashmla"):
            if ms is not None:
                p["flashmla"][prov] = ms
        elif is_package_kernel(prov) and ms is not None:
            p["kernels"][prov] = ms
    return [_point(p) for p in sorted(points.values(), key=_order)]


def _order(p: Mapping[str, Any]) -> tuple:
    return (p["H"], p["T"], p.get("topk") or 0, p["workload"])


def _point(p: Mapping[str, Any]) -> dict[str, Any]:
    d = p["default"]
    H, T = p["H"], p["T"]
    kernels, peers = p["kernels"], p["flashmla"]
    best = min(kernels, key=kernels.get) if kernels else None
    fm = min(peers, key=peers.get) if peers else None
    out: dict[str, Any] = {
        "workload": p["workload"], "H": H, "T": T, "topk": p["topk"],
        "status": "missing", "default_ms": None, "default_kernel": None, "note": None,
        "kernels": dict(sorted(kernels.items(), key=lambda kv: kv[1])),
        "best_kernel": best, "best_kernel_ms": kernels.get(best),
        "flashmla": fm, "flashmla_ms": peers.get(fm),
        "vs_flashmla": None, "vs_best_kernel": None, "choice_vs_best": None,
        "meets_flashmla": None, "meets_kernel": None, "moonshot": None,
    }  # fmt: skip
    if d is None:
        return out
    ms = _timed(d)
    out.update(default_ms=ms, default_kernel=_config(d).get("kernel"), note=d.get("note"))
    moon = _in_moonshot(H, T)
    if ms is None:
        out.update(status="failed", meets_flashmla=False, meets_kernel=False)
        out["moonshot"] = False if moon else None
        return out
    out["status"] = "ok"
    if fm:
        out["vs_flashmla"] = ms / peers[fm]
        out["meets_flashmla"] = out["vs_flashmla"] <= GOAL_FLASHMLA
        if moon:
            out["moonshot"] = out["vs_flashmla"] <= GOAL_MOONSHOT
    if best:
        out["vs_best_kernel"] = ms / kernels[best]
        out["meets_kernel"] = out["vs_best_kernel"] <= GOAL_KERNEL
        ran = out["default_kernel"]
        if ran in kernels:  # the rule's choice, judged by the forced rows alone
            out["choice_vs_best"] = kernels[ran] / kernels[best]
    return out


# ----------------------------------------------------------------------------------------------
# Text
# ----------------------------------------------------------------------------------------------


def _where(p: Mapping[str, Any]) -> str:
    return f"H={p['H']} T={p['T']} ({p['workload']})"


def _goal_line(table: Sequence[Mapping[str, Any]], flag: str, ratio: str, text: str) -> str:
    judged = [p for p in table if p[flag] is not None]
    met = sum(bool(p[flag]) for p in judged)
    line = f"{text}: {met} of {len(judged)} points"
    timed = [p for p in judged if p[ratio] is not None]
    if timed:
        worst = max(timed, key=lambda p: p[ratio])
        line += f"; worst {worst[ratio]:.3f} at {_where(worst)}"
        if ratio == "vs_best_kernel":
            line += f": default ran {worst['default_kernel']}, fastest {worst['best_kernel']}"
        else:
            line += f" against {worst['flashmla']}"
    failed = sum(p["status"] == "failed" for p in judged)
    if failed:
        line += f" ({failed} failed)"
    return line


def grid_summary(
    rows: Sequence[Mapping[str, Any]], run: str | None = None, *, family: str = "csa"
) -> str:
    """A few lines on one run's grid (:func:`grid_table`): the points, and for each goal how many
    of the points judged on it meet it, with the worst ratio and where it is."""
    run = grid_run(rows, run)
    table = grid_table(rows, run, family=family)
    head = next((r for r in rows if r.get("timestamp") == run and r.get("workload")), {})
    commit = (head.get("commit") or "?")[:7]
    lines = [f"{head.get('device')}, run {run} at {commit}: {len(table)} {family} points, "
             f"H {_span(table, 'H')}, T {_span(table, 'T')}"]  # fmt: skip
    if not table:
        return lines[0]
    failed = [p for p in table if p["status"] == "failed"]
    missing = [p for p in table if p["status"] == "missing"]
    lines += [
        _goal_line(table, "meets_flashmla", "vs_flashmla", "default <= FlashMLA"),
        _goal_line(table, "meets_kernel", "vs_best_kernel",
                   f"default <= {GOAL_KERNEL:g} x fastest package kernel"),
        _goal_line(table, "moonshot", "vs_flashmla",
                   f"moonshot default <= {GOAL_MOONSHOT:g} x FlashMLA "
                   f"(H <= {MOONSHOT_MAX_H}, T <= {MOONSHOT_MAX_T})"),
    ]  # fmt: skip
    misses = [p for p in table if p["meets_flashmla"] is False]
    if misses:  # the choice's fault, or no package kernel there beats FlashMLA
        beatable = [p for p in misses
                    if p["best_kernel_ms"] is not None and p["flashmla_ms"] is not None
                    and p["best_kernel_ms"] <= p["flashmla_ms"]]  # fmt: skip
        line = (
            f"default misses the FlashMLA goal at {len(misses)} points: a package kernel is at "
            f"or under FlashMLA at {len(beatable)} of them (the choice's misses)"
        )
        if beatable:
            line += " (" + ", ".join(f"{_where(p)}: {p['best_kernel']}" for p in beatable) + ")"
        lines.append(line + f", at {len(misses) - len(beatable)} none (the kernels' gap)")
    chosen = [p for p in table if p["choice_vs_best"] is not None]
    if chosen:
        worst = max(chosen, key=lambda p: p["choice_vs_best"])
        met = sum(p["choice_vs_best"] <= GOAL_KERNEL for p in chosen)
        lines.append(
            f"the kernel default ran, its forced row <= {GOAL_KERNEL:g} x the fastest package "
            f"kernel's: {met} of {len(chosen)} points; worst {worst['choice_vs_best']:.3f} at "
            f"{_where(worst)}: ran {worst['default_kernel']}, fastest {worst['best_kernel']}"
        )
    if failed:
        lines.append("default failed its check at: " + ", ".join(_where(p) for p in failed))
    if missing:
        lines.append("no default row at: " + ", ".join(_where(p) for p in missing))
    kernels: dict[str, int] = {}
    for p in table:
        if p["default_kernel"]:
            kernels[p["default_kernel"]] = kernels.get(p["default_kernel"], 0) + 1
    if kernels:
        ran = sorted(kernels.items(), key=lambda kv: (-kv[1], kv[0]))
        lines.append("default ran: " + ", ".join(f"{k} at {n} points" for k, n in ran))
    return "\n".join(lines)


def _span(table: Sequence[Mapping[str, Any]], key: str) -> str:
    vals = sorted({p[key] for p in table})
    return f"{vals[0]}..{vals[-1]}" if vals else "-"


def worst_points(
    table: Sequence[Mapping[str, Any]], n: int = 10, *, by: str = "vs_flashmla"
) -> list[Mapping[str, Any]]:
    """The ``n`` worst points of :func:`grid_table` by ``by`` (a ratio key): failed points
    first, then the largest ratios; missing points and points without that ratio left out."""
    failed = [p for p in table if p["status"] == "failed"]
    timed = sorted((p for p in table if p[by] is not None), key=lambda p: -p[by])
    return [*failed, *timed][:n]


def table_cells(
    table: Sequence[Mapping[str, Any]], columns: Sequence[str] = TABLE_COLUMNS
) -> tuple[list[str], list[list[Any]]]:
    """(header, rows) of grid points for :func:`sparse_mla.lab.figures.html_table`: times to 4
    significant digits, ratios to 3 decimals, goal flags as yes / no / None (not judged)."""

    def fmt(col: str, v: Any) -> Any:
        if isinstance(v, bool):
            return "yes" if v else "no"
        if isinstance(v, float):
            return f"{v:.4g}" if col.endswith("_ms") else f"{v:.3f}"
        return v

    return list(columns), [[fmt(c, p.get(c)) for c in columns] for p in table]


# ----------------------------------------------------------------------------------------------
# Figure
# ----------------------------------------------------------------------------------------------

_RATIO_TICKS = (0.25, 0.33, 0.5, 0.67, 0.75, 0.9, 1.0, 1.11, 1.33, 1.5, 2.0, 3.0, 4.0)


def _cells(table: Sequence[Mapping[str, Any]]) -> tuple[list[int], list[int], dict]:
    """Head counts, token counts and one point per (H, T): where several workloads share a
    cell (two top-k at one H), the one furthest behind FlashMLA (failed first)."""
    heads = sorted({p["H"] for p in table})
    tokens = sorted({p["T"] for p in table})

    def badness(p):
        if p["status"] == "failed":
            return math.inf
        return p["vs_flashmla"] if p["vs_flashmla"] is not None else -math.inf

    cell: dict[tuple[int, int], Mapping[str, Any]] = {}
    for p in table:
        k = (p["H"], p["T"])
        if k not in cell or badness(p) > badness(cell[k]):
            cell[k] = p
    return heads, tokens, cell


def _ratio_panel(ax, fig, heads, tokens, cell, key: str, label: str, title: str, goal: float):
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.colors import LogNorm

    data = np.full((len(tokens), len(heads)), np.nan)
    for (H, T), p in cell.items():
        if p[key] is not None:
            data[tokens.index(T), heads.index(H)] = p[key]
    finite = data[np.isfinite(data)]
    span = float(np.max(np.abs(np.log(finite)))) if finite.size else 0.0
    m = min(4.0, max(1.25, math.exp(span) * 1.02))
    norm = LogNorm(vmin=1 / m, vmax=m)  # symmetric in log: 1.0 sits at the centre colour
    cmap = colormaps["RdBu_r"].with_extremes(bad="white")
    im = ax.imshow(np.ma.masked_invalid(data), cmap=cmap, norm=norm, origin="lower",
                   aspect="auto")  # fmt: skip
    for (H, T), p in cell.items():
        x, y = heads.index(H), tokens.index(T)
        if p["status"] == "failed":
            _failed_cell(ax, x, y)
        elif p[key] is not None:
            v = p[key]
            strong = abs(math.log(v)) > 0.6 * math.log(m)
            ax.text(x, y, f"{v:.2f}", ha="center", va="center", fontsize=7,
                    color="white" if strong else "black",
                    fontweight="bold" if v > goal else "normal")  # fmt: skip
    cb = fig.colorbar(im, ax=ax, pad=0.01)
    ticks = [t for t in _RATIO_TICKS if 1 / m <= t <= m]
    cb.set_ticks(ticks, labels=[f"{t:g}" for t in ticks])
    cb.minorticks_off()
    cb.ax.tick_params(labelsize=7)
    cb.set_label(label, fontsize=8)
    ax.set_title(title, fontsize=9)


def _failed_cell(ax, x: int, y: int) -> None:
    from matplotlib.patches import Rectangle

    ax.add_patch(Rectangle((x - 0.5, y - 0.5), 1, 1, facecolor="#dddddd", edgecolor="#777777",
                           hatch="xx", lw=0.5, label="_failed"))  # fmt: skip
    ax.text(x, y, "failed", ha="center", va="center", fontsize=6, color="#b00000")


def _axes_labels(ax, heads, tokens) -> None:
    ax.set_xticks(range(len(heads)), [str(h) for h in heads])
    ax.set_yticks(range(len(tokens)), [str(t) for t in tokens])
    ax.set_xlabel("query heads H (per GPU)")
    ax.set_ylabel("tokens T")
    ax.tick_params(labelsize=7)


def _moonshot_box(ax, heads, tokens) -> None:
    from matplotlib.patches import Rectangle

    nx = sum(h <= MOONSHOT_MAX_H for h in heads)
    ny = sum(t <= MOONSHOT_MAX_T for t in tokens)
    if nx and ny:  # the smallest H and T: a box from the lower-left corner
        ax.add_patch(Rectangle((-0.5, -0.5), nx, ny, fill=False, edgecolor="#222222", lw=1.4,
                               linestyle="--", label="moonshot region"))  # fmt: skip


def _kernel_panel(ax, heads, tokens, cell) -> None:
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    names = sorted({p["default_kernel"] for p in cell.values() if p["default_kernel"]})
    data = np.full((len(tokens), len(heads)), np.nan)
    for (H, T), p in cell.items():
        if p["default_kernel"]:
            data[tokens.index(T), heads.index(H)] = names.index(p["default_kernel"])
    base = colormaps["tab10" if len(names) <= 10 else "tab20"]
    colors = [base(i % base.N) for i in range(max(1, len(names)))]
    cmap = ListedColormap(colors).with_extremes(bad="white")
    ax.imshow(np.ma.masked_invalid(data), cmap=cmap, vmin=-0.5, vmax=len(colors) - 0.5,
              origin="lower", aspect="auto", interpolation="nearest")  # fmt: skip
    for (H, T), p in cell.items():
        if p["status"] == "failed":
            ax.text(heads.index(H), tokens.index(T), "failed", ha="center", va="center",
                    fontsize=6, color="#b00000", fontweight="bold")  # fmt: skip
    handles = [Patch(facecolor=colors[i], label=n) for i, n in enumerate(names)]
    if handles:
        ax.legend(handles=handles, title="kernel", loc="upper left", bbox_to_anchor=(1.01, 1.0),
                  fontsize=7, title_fontsize=7, frameon=False)  # fmt: skip
    ax.set_title("the kernel config=None ran (default's config 'kernel')", fontsize=9)


def grid_heatmaps(
    rows: Sequence[Mapping[str, Any]],
    run: str | None = None,
    *,
    family: str = "csa",
    vs_kernel: bool = True,
) -> Figure:
    """One run's grid over H (x) x T (y), blank where a point is missing:

    (a) default / FlashMLA (diverging around 1.0 on a log scale: blue is the package ahead,
    red behind; bold numbers miss the goal; the moonshot region boxed), (b) which kernel
    ``default`` ran, (c) with ``vs_kernel``, default / the fastest package kernel (goal 1.05).
    A point whose default failed is hatched and says "failed". Where two workloads share a
    cell (two top-k at one H), the cell shows the one furthest behind FlashMLA.
    """
    run = grid_run(rows, run)
    table = grid_table(rows, run, family=family)
    if not table:
        raise ValueError(f"run {run} has no {family}_* workload rows")
    heads, tokens, cell = _cells(table)
    n = 3 if vs_kernel else 2
    width = max(8.0, 0.62 * len(heads) + 3.5)
    height = n * (1.3 + 0.42 * len(tokens)) + 0.6
    fig = Figure(figsize=(width, height), layout="constrained")
    axes = fig.subplots(n, 1)
    ax = axes[0]
    title = ("(a) default / FlashMLA (heads zero-padded to 64 or 128): goal <= 1, "
             f"moonshot <= {GOAL_MOONSHOT:g} in the dashed box")  # fmt: skip
    _ratio_panel(ax, fig, heads, tokens, cell, "vs_flashmla", "default / FlashMLA", title,
                 GOAL_FLASHMLA)  # fmt: skip
    _axes_labels(ax, heads, tokens)
    _moonshot_box(ax, heads, tokens)
    _kernel_panel(axes[1], heads, tokens, cell)
    _axes_labels(axes[1], heads, tokens)
    axes[1].set_title("(b) " + axes[1].get_title(), fontsize=9)
    if vs_kernel:
        title = f"(c) default / fastest package kernel: goal <= {GOAL_KERNEL:g}"
        _ratio_panel(axes[2], fig, heads, tokens, cell, "vs_best_kernel",
                     "default / fastest kernel", title, GOAL_KERNEL)  # fmt: skip
        _axes_labels(axes[2], heads, tokens)
    head = next((r for r in rows if r.get("timestamp") == run and r.get("workload")), {})
    shared = len(cell) < len(table)
    fig.suptitle(f"{head.get('device')}, run {run} at {(head.get('commit') or '?')[:7]}: "
                 f"{family} workloads" + (", two top-k in a cell: the worse shown" if shared
                                          else ""), fontsize=9)  # fmt: skip
    return fig
