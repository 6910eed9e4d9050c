"""The FP8 KV cache's bench run (notebook 06, section 7): bytes gathered per slot and achieved
TB/s, bf16 vs FP8, per head count, from the rows of ``sparse-mla bench --fp8``.

A run of :func:`sparse_mla.bench.run_fp8` (committed as ``data/bench/nvidia-h200_fp8.csv``) has,
per point, ``fp8_default`` (config=None on the cache; its config names the kernel),
``fp8_<kernel>`` for each FP8 kernel, peer (a) ``flashmla*_fp8ws`` (gather-dequant into a bf16
workspace + FlashMLA, timed together), peer (b) ``flashmla*_fp8decode`` (FlashMLA's sparse FP8
decode kernel over the prefill tokens; in runs since the ninth session) and peer (c)
``bf16_default_dequant`` (the package's bf16 default on the dequantized pool). Every row's
config has ``slot_bytes``: the bytes its kernel gathers per valid (token, slot) pair (584 from
the FP8 cache, 1024 from bf16 rows); ``gather_tbs`` is nnz x slot_bytes / ms.

- :func:`fp8_table`: one dict per point of a run, with each provider's time, TB/s, bytes per
  slot (peer (a)'s including its workspace's write and read, spread over the slots), and
  issue 25's goals at T = 16384;
- :func:`fp8_figure`: (a) bytes per slot, (b) TB/s of rows, (c) ``fp8_default`` against the
  peers, per head count;
- :func:`fp8_summary`: a line per point.

Nothing here needs a GPU: it reads rows (:func:`sparse_mla.bench.read_rows`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from matplotlib.figure import Figure

__all__ = [
    "GOAL_T",
    "fp8_figure",
    "fp8_run",
    "fp8_summary",
    "fp8_table",
    "goals",
    "is_fp8_row",
]

GOAL_T = 16384  # issue 25's goals are stated at this T


def is_fp8_row(row: Mapping[str, Any]) -> bool:
    """A workload row of an FP8 run: ``fp8_*``, ``bf16_default_dequant``, ``*_fp8ws`` or
    ``*_fp8decode``."""
    p = row.get("provider") or ""
    return bool(row.get("workload")) and (
        p.startswith("fp8_") or p == "bf16_default_dequant" or p.endswith(_PEERS)
    )


# Peers (a) and (b) by their rows' suffix (whatever their head padding) -> their key in a
# point of fp8_table (``peer_a``: the row name, ``peer_a_ms``, ``vs_peer_a``).
_PEER_KEYS = {"_fp8ws": "peer_a", "_fp8decode": "peer_b"}
_PEERS = tuple(_PEER_KEYS)


def _peer_label(name: str) -> str:
    """A provider's series label: a peer under one label whatever its padding."""
    for suffix in _PEERS:
        if name.endswith(suffix):
            return f"flashmla*{suffix}"
    return name


def fp8_run(rows: Sequence[Mapping[str, Any]], run: str | None = None) -> str | None:
    """The run (``timestamp``) to read: ``run`` (ValueError when it has no FP8 rows), else
    the latest run with FP8 rows; None when there is none."""
    runs = sorted({r["timestamp"] for r in rows if is_fp8_row(r) and r.get("timestamp")})
    if run is not None:
        if run not in runs:
            raise ValueError(f"no FP8 rows in run {run!r}; runs with FP8 rows: {runs}")
        return run
    return runs[-1] if runs else None


def goals(H: int, T: int) -> dict[str, float]:
    """Issue 25's goals for ``fp8_default`` at (H, T), as ratios of times (at most): vs peer
    (a) 0.6 at H <= 32 and 1.0 at H 64/128; vs the package's bf16 kernel 0.7 at H <= 16.
    Only at T = :data:`GOAL_T` (none elsewhere)."""
    if T != GOAL_T:
        return {}
    out = {"vs_peer_a": 0.6 if H <= 32 else 1.0}
    if H <= 16:
        out["vs_bf16"] = 0.7
    return out


def _cfg(row: Mapping[str, Any]) -> Mapping[str, Any]:
    cfg = row.get("config")
    return cfg if isinstance(cfg, Mapping) else {}


def _slot_bytes(row: Mapping[str, Any]) -> float | None:
    """Bytes moved per valid slot: the kernel's gather (``slot_bytes``), plus, for peer (a),
    its workspace's fill (584 read + 1024 written a row) and nothing else, spread over nnz."""
    cfg = _cfg(row)
    b = cfg.get("slot_bytes")
    if b is None:
        return None
    ws = cfg.get("workspace_rows")
    if ws and row.get("nnz"):
        b = b + ws * (584 + 1024) / row["nnz"]
    return float(b)


def fp8_table(rows: Sequence[Mapping[str, Any]], run: str | None = None) -> list[dict[str, Any]]:
    """One dict per point of the run (its order): ``workload``, ``T``, ``H``, ``topk``,
    ``nnz``, ``providers`` ({row name: {"ms", "gather_tbs", "slot_bytes", "kernel", "ok",
    "note"}}), ``default_kernel``, ``default_ms``, ``peer_a`` (its row name) and
    ``peer_a_ms``, ``bf16_ms``, ``vs_peer_a`` / ``vs_bf16`` (``fp8_default``'s time over
    theirs), ``goals`` (:func:`goals`) and ``meets`` ({goal: bool}). Empty when the rows hold
    no FP8 run."""
    run = fp8_run(rows, run)
    if run is None:
        return []
    points: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        if r.get("timestamp") != run or not is_fp8_row(r):
            continue
        key = (r["workload"], r.get("T"), r.get("H"))
        pt = points.setdefault(key, {
            "workload": r["workload"], "T": r.get("T"), "H": r.get("H"), "topk": r.get("topk"),
            "nnz": r.get("nnz"), "providers": {},
        })  # fmt: skip
        timed = bool(r.get("ok")) and r.get("ms") is not None
        pt["providers"][r["provider"]] = {
            "ms": r.get("ms") if timed else None,
            "gather_tbs": r.get("gather_tbs") if timed else None,
            "slot_bytes": _slot_bytes(r),
            "kernel": _cfg(r).get("kernel"),
            "ok": bool(r.get("ok")),
            "note": r.get("note"),
        }
    out = []
    for pt in points.values():
        provs = pt["providers"]
        d = provs.get("fp8_default", {})
        pt["default_kernel"] = d.get("kernel")
        pt["default_ms"] = d.get("ms")
        for suffix, key in _PEER_KEYS.items():
            peer = next((n for n in provs if n.endswith(suffix)), None)
            pt[key] = peer
            pt[f"{key}_ms"] = provs[peer]["ms"] if peer else None
        pt["bf16_ms"] = provs.get("bf16_default_dequant", {}).get("ms")
        for key, other in (("vs_peer_a", pt["peer_a_ms"]), ("vs_peer_b", pt["peer_b_ms"]),
                           ("vs_bf16", pt["bf16_ms"])):  # fmt: skip
            pt[key] = pt["default_ms"] / other if pt["default_ms"] and other else None
        pt["goals"] = goals(pt["H"], pt["T"])
        pt["meets"] = {k: (pt[k] is not None and pt[k] <= g) for k, g in pt["goals"].items()}
        out.append(pt)
    return out


def _series(table: Sequence[Mapping[str, Any]]) -> list[str]:
    """Providers drawn, in a fixed order: fp8_default, the FP8 kernels, the two peers (peer
    (a) under one label whatever its padding)."""
    names: list[str] = []
    for pt in table:
        for n in pt["providers"]:
            label = _peer_label(n)
            if label not in names:
                names.append(label)

    def rank(n: str) -> tuple:
        if n == "fp8_default":
            return (0, n)
        if n.startswith("fp8_"):
            return (1, n)
        return (2 if n.startswith("flashmla*") else 3, n)

    return sorted(names, key=rank)


def _get(pt: Mapping[str, Any], label: str) -> Mapping[str, Any] | None:
    key = _PEER_KEYS.get(label.removeprefix("flashmla*"))  # a peer's label: flashmla*<suffix>
    if key is not None:
        return pt["providers"].get(pt[key]) if pt[key] else None
    return pt["providers"].get(label)


_COLORS = {"fp8_default": "#d62728", "flashmla*_fp8ws": "#1f77b4",
           "flashmla*_fp8decode": "#17becf", "bf16_default_dequant": "#7f7f7f"}  # fmt: skip
_OTHER = ("#ff9896", "#ffbb78", "#e377c2", "#bcbd22")


def _color(label: str, i: int) -> str:
    return _COLORS.get(label, _OTHER[i % len(_OTHER)])


def fp8_figure(rows: Sequence[Mapping[str, Any]], run: str | None = None, *,
               T: int = GOAL_T) -> Figure:  # fmt: skip
    """Three panels over the head counts of the run's points at ``T`` tokens: (a) bytes moved
    per valid slot (the kernel's gather; peer (a) with its workspace), (b) achieved TB/s of
    rows (``gather_tbs``) and, if the run has them, the row-gather ceilings as dashed lines,
    (c) ``fp8_default``'s time over peer (a)'s and over the bf16 default's, with the goals.
    A provider checked but not timed is marked "n/t", one that failed "FAIL".
    ValueError when the run has no FP8 point at ``T``."""
    table = [pt for pt in fp8_table(rows, run) if pt["T"] == T]
    if not table:
        raise ValueError(f"no FP8 rows at T={T} in the run")
    table.sort(key=lambda pt: pt["H"])
    labels = _series(table)
    heads = [pt["H"] for pt in table]
    x = list(range(len(table)))
    width = 0.8 / max(1, len(labels))
    fig = Figure(figsize=(max(7.5, 1.6 * len(table) + 3), 10))
    ax_b, ax_t, ax_r = (fig.add_subplot(3, 1, i) for i in (1, 2, 3))
    for j, label in enumerate(labels):
        off = [xi + (j - (len(labels) - 1) / 2) * width for xi in x]
        cells = [_get(pt, label) for pt in table]
        color = _color(label, j)
        b = [c["slot_bytes"] if c and c["slot_bytes"] is not None else 0.0 for c in cells]
        bars = ax_b.bar(off, b, width, color=color, label=label)
        for rect, v in zip(bars, b, strict=True):
            if v:
                ax_b.text(rect.get_x() + rect.get_width() / 2, v, f"{v:.0f}", ha="center",
                          va="bottom", fontsize=6)  # fmt: skip
        tbs = [c["gather_tbs"] if c and c["gather_tbs"] else 0.0 for c in cells]
        bars = ax_t.bar(off, tbs, width, color=color, label=label)
        for rect, v, c in zip(bars, tbs, cells, strict=True):
            text = f"{v:.2f}" if v else ("" if c is None else ("n/t" if c["ok"] else "FAIL"))
            ax_t.text(rect.get_x() + rect.get_width() / 2, v, text, ha="center", va="bottom",
                      fontsize=6)  # fmt: skip
    ax_b.set_ylabel("bytes per valid slot")
    ax_b.set_title("(a) bytes gathered per (token, slot): FP8 cache 584 (576 + 8 scale bytes), "
                   "bf16 rows 1024", fontsize=9)  # fmt: skip
    ax_t.set_ylabel("TB/s of rows")
    ax_t.set_title("(b) achieved TB/s of rows (gather_tbs = nnz x bytes a slot / time)",
                   fontsize=9)  # fmt: skip
    for ceiling in _gather_ceilings(rows, fp8_run(rows, run)):
        ax_t.axhline(ceiling[1], linestyle="--", color="#2ca02c", linewidth=0.8)
        ax_t.text(len(x) - 0.5, ceiling[1], f" gather ceiling {ceiling[0]}", fontsize=6,
                  va="bottom", ha="right", color="#2ca02c")  # fmt: skip
    for ax in (ax_b, ax_t):
        ax.set_xticks(x, [f"H={h}" for h in heads])
        ax.legend(fontsize=7, ncol=min(4, len(labels)), loc="upper left")
        ax.set_ylim(0, ax.get_ylim()[1] * 1.25)
    ratios = (("vs_peer_a", "fp8_default / peer (a) flashmla*_fp8ws"),
              ("vs_bf16", "fp8_default / bf16_default_dequant"))  # fmt: skip
    for j, (key, label) in enumerate(ratios):
        vals = [pt[key] if pt[key] is not None else math.nan for pt in table]
        off = [xi + (j - 0.5) * 0.35 for xi in x]
        bars = ax_r.bar(off, [0 if math.isnan(v) else v for v in vals], 0.35,
                        color=("#1f77b4", "#7f7f7f")[j], label=label)  # fmt: skip
        for rect, v, pt in zip(bars, vals, table, strict=True):
            if not math.isnan(v):
                ax_r.text(rect.get_x() + rect.get_width() / 2, v, f"{v:.2f}", ha="center",
                          va="bottom", fontsize=7)  # fmt: skip
            g = pt["goals"].get(key)
            if g is not None:
                ax_r.hlines(g, rect.get_x(), rect.get_x() + rect.get_width(), colors="k",
                            linestyles="--", linewidth=1.2)  # fmt: skip
    ax_r.axhline(1.0, color="k", linewidth=0.5)
    ax_r.set_xticks(x, [f"H={pt['H']}\n{pt['default_kernel'] or '-'}" for pt in table],
                    fontsize=7)  # fmt: skip
    ax_r.set_ylabel("time ratio (lower is better)")
    ax_r.set_title("(c) fp8_default against the peers; dashes: issue 25's goals", fontsize=9)
    ax_r.legend(fontsize=7, loc="upper left")
    ax_r.set_ylim(0, max([1.3] + [pt[k] * 1.2 for pt in table for k in ("vs_peer_a", "vs_bf16")
                                  if pt[k] is not None]))  # fmt: skip
    first = next((r for r in rows if r.get("timestamp") == fp8_run(rows, run) and is_fp8_row(r)),
                 {})  # fmt: skip
    fig.suptitle(f"FP8 KV cache vs bf16 rows, T={T}: {first.get('device')}, run "
                 f"{first.get('timestamp')}, commit {str(first.get('commit'))[:10]}",
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    return fig


def _gather_ceilings(rows, run) -> list[tuple[str, float]]:
    """(pool size label, TB/s) of the run's row-gather ceilings."""
    out = []
    for r in rows:
        p = r.get("provider") or ""
        if r.get("timestamp") == run and p.startswith("ceiling:gather_") and r.get("gather_tbs"):
            out.append((p[len("ceiling:gather_") :], float(r["gather_tbs"])))
    return out


def fp8_summary(rows: Sequence[Mapping[str, Any]], run: str | None = None) -> list[str]:
    """A line per point: ``fp8_default``'s kernel, time and TB/s, its ratio to each peer and
    the goals met or missed (``["no FP8 rows"]`` when there are none)."""
    table = fp8_table(rows, run)
    if not table:
        return ["no FP8 rows"]
    lines = []
    for pt in table:
        head = f"{pt['workload']} T={pt['T']}: "
        d = pt["providers"].get("fp8_default")
        if not d or d["ms"] is None:
            lines.append(head + "fp8_default " + ("FAIL" if d and not d["ok"] else "missing"))
            continue
        text = f"fp8_default {d['ms']:.4g} ms ({d['kernel']}"
        text += f", {d['gather_tbs']:.2f} TB/s of FP8 rows)" if d["gather_tbs"] else ")"
        peers = [("vs_peer_a", pt["peer_a"] or "peer (a)")]
        if pt["peer_b"]:  # runs before the ninth session have no peer (b)
            peers.append(("vs_peer_b", pt["peer_b"]))
        for key, name in (*peers, ("vs_bf16", "bf16_default_dequant")):
            if pt[key] is None:
                text += f"; no {name} time"
                continue
            text += f"; {pt[key]:.2f}x {name}"
            if key in pt["goals"]:
                met = "met" if pt["meets"][key] else "MISSED"
                text += f" (goal <= {pt['goals'][key]:g}: {met})"
        lines.append(head + text)
    return lines
