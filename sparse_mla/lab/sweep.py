"""Notebook 03's figures and helpers: sweep heatmaps, winner tables and a scratch config root.

The sweep itself is :func:`sparse_mla.tune.sweep` (rows, one per target x shape x config), the
winners :func:`sparse_mla.tune.best_per_shape`, the export :func:`sparse_mla.tune.export`.
:func:`heatmaps` draws one metric per panel over two launch parameters; :func:`scratch_config_root`
points the launcher's config lookup at a temporary copy of the shipped configs so a notebook
(or a test) can export and reload without touching the repository's files.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from .figures import html_table

__all__ = [
    "export_and_reload",
    "heatmaps",
    "metric_label",
    "rows_html",
    "scratch_config_root",
    "shipped_kernel",
]

METRIC_LABELS = {
    "time_ms": "time (ms, lower is better)",
    "registers": "registers (VGPRs / per thread)",
    "occupancy": "occupancy (waves/SIMD or warps/SM)",
    "spill_bytes": "spill bytes",
}


def metric_label(metric: str, target: str) -> str:
    """A heatmap's title for ``metric`` on ``target``: AMD counts VGPRs and waves per SIMD,
    NVIDIA registers per thread and warps per SM."""
    from ..targets import get_target

    amd = get_target(target).is_amd
    if metric == "registers":
        return "unified VGPRs" if amd else "registers / thread"
    if metric == "occupancy":
        return "occupancy (waves/SIMD)" if amd else "occupancy (warps/SM)"
    return METRIC_LABELS.get(metric, metric)


def _ms(value: Any) -> str:
    """A provenance time for a sentence ("not measured" when it is null)."""
    return f"{value:.3f} ms" if isinstance(value, (int, float)) else "time not recorded"


def _best(rows: list[Mapping[str, Any]], metric: str) -> Mapping[str, Any] | None:
    # Several configs share a cell when the grid has more axes than the plot: show the best.
    if not rows:
        return None
    pick = max if metric == "occupancy" else min
    return pick(rows, key=lambda r: float(r[metric]))


_SHORT = {"num_warps": "w", "num_stages": "s", "maxnreg": "maxnreg ", "kpack": "kpack ",
          "waves_per_eu": "wpe ", "EVEN_HD": "EVEN_HD ", "USE_EXP2": "exp2 ",
          "PREFETCH_KV": "prefetch "}  # fmt: skip


def heatmaps(
    rows: Iterable[Mapping[str, Any]],
    *,
    target: str,
    H: int,
    D: int,
    x: str = "BLOCK_K",
    y: str = "BLOCK_H",
    metrics: Sequence[str] = ("time_ms", "registers", "occupancy"),
) -> Figure:
    """One heatmap per metric over (``y``, ``x``) for ``target`` and shape (H, D); cells hold
    the best value over the grid's other axes and name that config's values on the axes that
    vary (e.g. ``w4 s2``); configs that did not run are blank. A metric with no value
    anywhere (time in a compile-only sweep) gets no panel: the title says it was not measured."""
    sel = [r for r in rows if r.get("target") == target and r.get("H") == H and r.get("D") == D]
    if not sel:
        raise ValueError(f"no rows for target={target!r} H={H} D={D}")
    absent = [m for m in metrics if all(r.get(m) is None for r in sel)]
    metrics = [m for m in metrics if m not in absent] or list(metrics[:1])
    xs = sorted({r[x] for r in sel if r.get(x) is not None})
    ys = sorted({r[y] for r in sel if r.get(y) is not None})
    # The grid's other axes that vary: each cell names its best config's values on them.
    others = [k for k in _SHORT if k not in (x, y) and len({repr(r.get(k)) for r in sel}) > 1]
    # Room for a cell's label (its value and the other axes' values) at 7-point type.
    cell_w = 0.75 + 0.5 * len(others)
    fig = Figure(figsize=(max(3.6, cell_w * len(xs) + 1.6) * len(metrics),
                          0.9 + 0.62 * max(len(ys), 2)))  # fmt: skip
    for i, metric in enumerate(metrics):
        ax = fig.add_subplot(1, len(metrics), i + 1)
        grid = [[math.nan] * len(xs) for _ in ys]
        which = [[""] * len(xs) for _ in ys]
        for yi, yv in enumerate(ys):
            for xi, xv in enumerate(xs):
                cell = [r for r in sel
                        if r.get(x) == xv and r.get(y) == yv and r.get("status") == "ok"
                        and r.get(metric) is not None]  # fmt: skip
                best = _best(cell, metric)
                if best is not None:
                    grid[yi][xi] = float(best[metric])
                    which[yi][xi] = " ".join(f"{_SHORT[k]}{best.get(k)}" for k in others)
        if all(math.isnan(v) for row in grid for v in row):
            ax.text(0.5, 0.5, f"no {metric}\n(compile-only sweep:\nno GPU here)",
                    ha="center", va="center", transform=ax.transAxes)  # fmt: skip
            ax.set_xticks([])
            ax.set_yticks([])
        else:
            cmap = "viridis" if metric == "occupancy" else "viridis_r"
            im = ax.imshow(grid, cmap=cmap, aspect="auto")
            fig.colorbar(im, ax=ax, fraction=0.046)
            for yi in range(len(ys)):
                for xi in range(len(xs)):
                    v = grid[yi][xi]
                    text = "-" if math.isnan(v) else (f"{v:.3g}" if metric == "time_ms" else
                                                      f"{v:.0f}")  # fmt: skip
                    if which[yi][xi]:
                        text += "\n" + which[yi][xi]
                    ax.text(
                        xi,
                        yi,
                        text,
                        ha="center",
                        va="center",
                        fontsize=7,
                        bbox={"facecolor": "white", "alpha": 0.7, "pad": 1, "lw": 0},
                    )
            ax.set_xticks(range(len(xs)), [str(v) for v in xs])
            ax.set_yticks(range(len(ys)), [str(v) for v in ys])
            ax.set_xlabel(x)
            ax.set_ylabel(y)
        ax.set_title(metric_label(metric, target), fontsize=9)
    note = f" ({', '.join(absent)}: not measured, compile-only sweep)" if absent else ""
    fig.suptitle(f"{target}, H={H}, D={D}{note}", fontsize=10)
    fig.tight_layout()
    return fig


def rows_html(rows: Iterable[Mapping[str, Any]], columns: Sequence[str]) -> str:
    """An HTML table of selected columns of sweep rows."""
    return html_table([[r.get(c) for c in columns] for r in rows], list(columns),
                      cls="sml-sweep-table")  # fmt: skip


@contextlib.contextmanager
def scratch_config_root(copy_existing: bool = True):
    """A temporary config root (a copy of the shipped sparse_mla/tuned/ when ``copy_existing``)
    that the launcher's lookup uses inside the block (this thread only, not the user root); no
    file outside it is written. Yields the root.

    Uses :func:`sparse_mla.configs.use_root`, which the launcher's lookup and export honour."""
    from .. import configs

    original = configs.CONFIG_ROOT
    tmp = Path(tempfile.mkdtemp(prefix="sparse_mla_configs_"))
    root = tmp / "configs"
    if copy_existing and Path(original).is_dir():
        shutil.copytree(original, root, ignore=shutil.ignore_patterns("*.lock"))
    else:
        root.mkdir()
    try:
        with configs.use_root(root):
            yield root
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def export_and_reload(best: Mapping[tuple, Mapping[str, Any]], root) -> list[str]:
    """Notebook 03's export step for Triton winners (``tune.best_per_shape`` rows) into config
    ``root``: compile-only candidates are refused, then exported only where they replace no
    timed entry; each shape then says what the launcher uses (the exported launch, or the
    timed entry it keeps, its time or "time not recorded"). Returns the lines to print;
    AssertionError if the launcher does not use an exported launch."""
    from .. import configs, prefill, tune
    from .. import inspect as _inspect

    out: list[str] = []
    kept = set()  # shapes whose timed entry a compile-only candidate must not replace
    for target in sorted({k[0] for k in best}):
        winners = {k: r for k, r in best.items() if k[0] == target}
        try:
            out.append(tune.export(list(winners.values()), target, root=root))
        except ValueError as e:  # compile-only candidates: refused, as the CLI refuses them
            out.append(f"refused: {e}")
            for k in winners:
                old = configs.lookup_entry(*k)
                if old is not None and old.provenance.get("mode") == "time":
                    kept.add(k)
            rest = [r for k, r in winners.items() if k not in kept]
            if rest:
                out.append(tune.export(rest, target, root=root, allow_compile_only=True))
    for (target, H, D), row in best.items():
        if (target, H, D) in kept:
            timed = configs.lookup_entry(target, H, D)
            p = timed.provenance
            out.append(f"{target} H={H} D={D}: keeps its timed entry {timed.launch.to_dict()} "
                       f"({_ms(p.get('time_ms'))} on {p.get('device')})")  # fmt: skip
            continue
        entry = configs.lookup(target, H, D)  # the launcher's own lookup (the given root)
        used = prefill.resolve_config(H, D, None, target)
        compiled = _inspect.compile_prefill(target, None, num_heads=H, head_dim=D)
        assert entry == used
        assert (used.BLOCK_H, used.BLOCK_K, used.num_warps) == (
            row["BLOCK_H"], row["BLOCK_K"], row["num_warps"])  # fmt: skip
        assert compiled.constexprs["BLOCK_K"] == row["BLOCK_K"]
        assert compiled.options["num_warps"] == row["num_warps"]
        out.append(f"{target} H={H} D={D}: the launcher now uses {used.to_dict()}")
        out.append(f"  compiled with it: {compiled.resources.occupancy} "
                   f"{compiled.target.occupancy_unit}, {compiled.resources.spill_bytes} "
                   "spill bytes")  # fmt: skip
    return out


def shipped_kernel(
    arch: str, num_heads: int, head_dim: int = 512, num_tokens=None, slots_per_token=None
) -> str:
    """The kernel ``sparse_mla_prefill(config=None)`` runs on ``arch`` at (H, D[, T[, slots per
    token]]): the lists' total length // T picks the recorded list-length bucket (None: the
    longest lists'), as :func:`sparse_mla.dispatch.describe` reads it."""
    from .. import dispatch

    call = dispatch.Call.of_shape(arch, num_heads, head_dim, num_tokens=num_tokens,
                                  slots_per_token=slots_per_token)  # fmt: skip
    return dispatch.choose(call).kernel
