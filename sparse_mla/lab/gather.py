"""Few heads (H <= 16) are a gather: achieved row-gather bandwidth of each kernel variant against
the gather ceilings measured in the same bench run (notebook 07, section 5).

Two committed sources, both read without a GPU:

- the bench CSV (:func:`sparse_mla.bench.run_summary`): the providers of one run (the package's
  Triton and Gluon kernels, FlashMLA with q padded to 64 heads, aiter) and the run's row-gather
  ceilings per pool size (random 1 KiB rows summed, L2-resident 4-16 MiB pools to HBM);
- the variant probe (``data/bench/ws_small_variants_h200.csv``, from
  ``experiments/ws_small_variants_probe.py``): the H <= 16 kernel before and after a change, and two
  ablations that bound it, the producer alone (``gather_only``) and the consumer alone
  (``math_only``).

:func:`neighbour_overlap` measures what a kernel serving G neighbouring tokens from the union of
their slot lists would save: the union of the lists of each group of G consecutive tokens
against their sum (valid slots only), and the 64-row tiles each way.

Bandwidth is gathered bytes (valid-or-not slots x 1 KiB, once per 16-head block) / time.
:data:`LIMITS` says what bounds each variant, and :func:`limits_table` prints it beside the
measured rate.
"""

from __future__ import annotations

import csv
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from matplotlib.figure import Figure

from .roofline import provider_color

__all__ = [
    "LIMITS",
    "Overlap",
    "Rate",
    "gather_figure",
    "limits_table",
    "neighbour_overlap",
    "rates",
    "read_variants",
]

# What limits each variant (rows in flight per SM, registers, shared memory), in words. The
# numbers come from the launch configs, the sm90 cross-compiles and the ablations.
LIMITS: dict[str, tuple[str, str]] = {
    "gather_only": (
        "H<=16 kernel, producer alone (ablation)",
        "3 tiles x 64 rows = 192 rows (192 KiB of shared memory) in flight per SM, 16-byte "
        "cp.async from one warpgroup: at the L2-resident gather ceiling",
    ),
    "gluon": (
        "H<=16 kernel (hopper_ws_small, default)",
        "the consumer warpgroup: per 64-row tile a 32-deep m64n16k16 chain for S^T, one "
        "cross-warp max, then 32 more for O^T, with nothing else in flight (it waits on each); "
        "the producer keeps up (gather_only is 1.4x faster)",
    ),
    "dl": (
        "H<=16 kernel, one reduction per tile",
        "as gluon (this variant became it): the denominator summed once per item",
    ),
    "base": (
        "H<=16 kernel before (two reductions)",
        "as gluon plus a second cross-warp reduction (the denominator) per tile",
    ),
    "math_only": (
        "H<=16 kernel, consumer alone (ablation)",
        "the consumer's chain with the ring handshakes but no gathers; slower than the whole "
        "kernel in this run, so the consumer bounds it (why it is slower alone is not measured)",
    ),
    "triton": (
        "package Triton (tuned)",
        "registers: maxnreg 128 gives 4 CTAs x 4 warps per SM; each CTA waits on its own "
        "32-row gather every tile (no async copy): about 128 rows in flight per SM",
    ),
    "flashmla_pad64": (
        "FlashMLA, q padded to 64 heads",
        "math for 64 heads per gathered row (75-88% padding): its H=64 kernel's time, bound by "
        "the tensor cores and the softmax, not by the gather",
    ),
    "aiter": (
        "aiter Triton (best of its grid)",
        "one program per (token, head block), synchronous gathers into registers",
    ),
    "default": ("config=None", "whichever kernel the dispatch records (see `gluon`/`triton`)"),
}

_POOL_BRACKET = (16 * 2**20, 64 * 2**20)  # the measured pools around the workloads' 20 MiB one


@dataclass(frozen=True)
class Rate:
    workload: str
    variant: str
    ms: float
    tbs: float  # gathered TB/s
    source: str  # "bench <commit>" or "probe <commit>"


def read_variants(path: Path | str) -> list[dict[str, str]]:
    """Rows of a variant-probe CSV (workload, variant, ms, gathered_gb, gather_tbs, ...)."""
    with Path(path).open(newline="") as f:
        rows = list(csv.DictReader(f))
    need = {"workload", "variant", "ms", "gathered_gb", "commit"}
    if rows and not need <= set(rows[0]):
        raise ValueError(f"{path}: a variant CSV needs the columns {sorted(need)}")
    return rows


def rates(
    summary: Mapping[str, Any],
    variants: Sequence[Mapping[str, str]] = (),
    *,
    max_heads: int = 16,
    providers: Sequence[str] = ("gluon", "triton", "flashmla_pad64", "aiter"),
) -> list[Rate]:
    """Achieved gather TB/s per (workload, variant): the bench run's ``providers`` at
    H <= ``max_heads``, then the probe's variants of the same workloads (the first row of a
    variant per workload when the probe timed it twice)."""
    out: list[Rate] = []
    commit = (summary.get("commit") or "")[:7]
    for name, w in summary["workloads"].items():
        if w["H"] > max_heads:
            continue
        for p in providers:
            if p in w["ms"]:
                ms = w["ms"][p]
                out.append(Rate(name, p, ms, w["bytes"] / (ms * 1e-3) / 1e12, f"bench {commit}"))
    names = {r.workload for r in out}
    seen = set()
    for row in variants:
        key = (row["workload"], row["variant"])
        if row["workload"] not in names or key in seen or row["variant"] in providers:
            continue
        seen.add(key)
        ms = float(row["ms"])
        gb = float(row["gathered_gb"])
        out.append(Rate(row["workload"], row["variant"], ms, gb / ms, f"probe {row['commit']}"))
    return out


def _ceilings(summary: Mapping[str, Any]) -> list[tuple[int, float]]:
    tbs = summary.get("gather_tbs") or {}
    return [(b, tbs[b]) for b in _POOL_BRACKET if b in tbs]


def limits_table(rs: Sequence[Rate], summary: Mapping[str, Any]) -> list[list[str]]:
    """Rows (workload, variant, ms, TB/s, fraction of the 16 MiB-pool ceiling, source, what
    limits it), fastest first per workload."""
    ceil = dict(_ceilings(summary)).get(_POOL_BRACKET[0])
    rows = []
    for name in dict.fromkeys(r.workload for r in rs):
        for r in sorted((r for r in rs if r.workload == name), key=lambda r: r.ms):
            label, why = LIMITS.get(r.variant, (r.variant, "-"))
            frac = f"{r.tbs / ceil:.0%}" if ceil else "-"
            rows.append([name, label, f"{r.ms:.3f}", f"{r.tbs:.2f}", frac, r.source, why])
    return rows


def gather_figure(rs: Sequence[Rate], summary: Mapping[str, Any]) -> Figure:
    """A panel per workload: achieved gather TB/s per variant (bars, fastest on top) against
    the run's row-gather ceilings at the 16 MiB and 64 MiB pools (the workloads' pools are
    about 20 MiB), each bar labelled with its ms and its fraction of the 16 MiB ceiling."""
    names = list(dict.fromkeys(r.workload for r in rs))
    if not names:
        raise ValueError("no H <= 16 rows to draw")
    ceilings = _ceilings(summary)
    top = max([r.tbs for r in rs] + [t for _, t in ceilings]) * 1.25
    most = max(sum(r.workload == n for r in rs) for n in names)
    fig = Figure(figsize=(5.0 * len(names), 0.42 * most + 1.8))
    axes = fig.subplots(1, len(names), squeeze=False)[0]
    for ax, name in zip(axes, names, strict=True):
        mine = sorted((r for r in rs if r.workload == name), key=lambda r: r.tbs)
        y = range(len(mine))
        ax.barh(list(y), [r.tbs for r in mine], color=[provider_color(r.variant) for r in mine])
        ref = ceilings[0][1] if ceilings else None
        for i, r in zip(y, mine, strict=True):
            frac = f", {r.tbs / ref:.0%}" if ref else ""
            ax.text(r.tbs, i, f" {r.tbs:.2f} TB/s ({r.ms:.2f} ms{frac})", va="center", fontsize=7)
        ax.set_yticks(list(y))
        ax.set_yticklabels([f"{r.variant} [{r.source.split()[0]}]" for r in mine], fontsize=7)
        for (pool, t), ls, yt in zip(ceilings, ("--", ":"), (len(mine) - 0.4, -1.1), strict=False):
            ax.axvline(t, color="#aa3333", ls=ls, lw=1)
            ax.text(t, yt, f"{pool >> 20} MiB pool: {t:.1f} TB/s ", color="#aa3333",
                    fontsize=6.5, ha="right")  # fmt: skip
        ax.set_ylim(-1.4, len(mine))
        ax.set_xlim(0, top)
        ax.set_xlabel("gathered KV rows, TB/s", fontsize=8)
        ax.set_title(name, fontsize=9)
    dev = summary.get("device") or "?"
    fig.suptitle(
        f"H <= 16 on {dev}: gather bandwidth against the same run's row-gather ceilings "
        f"(bench run {summary.get('run', '?')}; [probe] rows from the variant probe)",
        fontsize=8,
    )
    fig.tight_layout()
    return fig


@dataclass(frozen=True)
class Overlap:
    group: int  # G consecutive tokens per group
    rows_sum: int  # valid slots summed over the tokens (what per-token kernels gather)
    rows_union: int  # distinct valid slots per group, summed over the groups
    tiles_sum: int  # 64-row tiles per token, summed
    tiles_union: int  # 64-row tiles of each group's union, summed

    @property
    def ratio(self) -> float:
        """union / sum of gathered rows (1.0: neighbours share nothing)."""
        return self.rows_union / self.rows_sum if self.rows_sum else 1.0

    @property
    def tile_ratio(self) -> float:
        return self.tiles_union / self.tiles_sum if self.tiles_sum else 1.0


def neighbour_overlap(
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    num_kv: int,
    groups: Sequence[int] = (1, 2, 4, 8, 16),
    *,
    tile: int = 64,
) -> list[Overlap]:
    """For each G in ``groups``: how many rows G consecutive tokens gather if each gathers its own
    list (the sum) against once per group (the union of their valid slots, 0 <= s < num_kv).

    Groups are tokens [0, G), [G, 2G), ... of the CSR, across request boundaries (a kernel that
    groups neighbours would do the same unless told where requests start). Duplicates within
    one token's list count once in the union and every time in the sum, as a per-token kernel
    gathers them."""
    idx = kv_indices.detach().to("cpu", torch.int64)
    ptr = kv_indptr.detach().to("cpu", torch.int64)
    T = ptr.numel() - 1
    if T < 0 or (ptr[1:] < ptr[:-1]).any() or (T > 0 and int(ptr[-1]) > idx.numel()):
        raise ValueError("kv_indptr must be non-decreasing and end within kv_indices")
    lens = ptr[1:] - ptr[:-1]
    token = torch.repeat_interleave(torch.arange(T), lens)
    slots = idx[int(ptr[0]) : int(ptr[0]) + token.numel()] if T else idx[:0]
    valid = (slots >= 0) & (slots < num_kv)
    token, slots = token[valid], slots[valid]
    per_token = torch.bincount(token, minlength=T)
    out = []
    for g in groups:
        if g < 1:
            raise ValueError(f"group sizes must be >= 1, got {g}")
        grp = token // g
        keys = torch.unique(grp * (num_kv + 1) + slots)
        per_group = torch.bincount(keys // (num_kv + 1), minlength=(T + g - 1) // g)
        out.append(
            Overlap(
                group=g,
                rows_sum=int(per_token.sum()),
                rows_union=int(keys.numel()),
                tiles_sum=int(((per_token + tile - 1) // tile).sum()),
                tiles_union=int(((per_group + tile - 1) // tile).sum()),
            )
        )
    return out
