"""Shared drawing and HTML helpers for the workbook's panels.

Figures are ``matplotlib.figure.Figure`` objects built without pyplot (safe from a worker
thread); :func:`to_png` turns one into bytes for an ``ipywidgets.Image``. The HTML helpers
escape their input and give every element a ``sml-*`` class so tests and the browser test can
find them.
"""

from __future__ import annotations

import html
import io
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from matplotlib.figure import Figure

__all__ = [
    "error_figure",
    "html_table",
    "mix_figure",
    "occupancy_curve",
    "occupancy_figure",
    "pre_block",
    "relative_errors",
    "show",
    "to_png",
]

# Instruction kinds worth a bar (the rest of the mix is in the table/ISA).
MIX_KINDS = (
    "mfma", "mma", "wgmma", "global_load", "buffer_load", "async_copy", "lds_load", "shared_load",
    "lds_store", "shared_store", "exp2", "log2e_mul", "fma", "compare", "select", "branch",
    "spill_load", "spill_store",
)  # fmt: skip


# The widest image the workbook draws, in pixels: JupyterLab's output area at a 1280-pixel
# window (the narrowest the panels are laid out for) is about 900 px wide after its prompt.
MAX_WIDTH_PX = 860


def png_size(png: bytes) -> tuple[int, int]:
    """(width, height) in pixels of PNG bytes (from the IHDR chunk)."""
    png = bytes(png[:24])
    if png[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG")
    return int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")


def to_png(fig: Figure, dpi: int = 90, max_width_px: int | None = MAX_WIDTH_PX) -> bytes:
    """PNG bytes of a figure (tight bounding box: legends and titles outside the axes are
    kept), at most ``max_width_px`` wide (drawn again at a lower dpi when wider), so no figure
    runs past the output area."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    png = buf.getvalue()
    width = png_size(png)[0]
    if max_width_px and width > max_width_px:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=dpi * max_width_px / width * 0.995,
                    bbox_inches="tight")  # fmt: skip
        png = buf.getvalue()
    return png


def html_table(
    rows: Iterable[Sequence[Any]],
    header: Sequence[str] | None = None,
    *,
    cls: str = "sml-table",
    caption: str | None = None,
) -> str:
    """An escaped HTML table; None cells show as "-"."""

    def cell(v: Any, tag: str) -> str:
        text = "-" if v is None else str(v)
        return f"<{tag} style='text-align:left;padding:1px 8px'>{html.escape(text)}</{tag}>"

    parts = [f"<table class='{cls}' style='border-collapse:collapse;font-family:monospace'>"]
    if caption:
        parts.append(f"<caption style='text-align:left'>{html.escape(caption)}</caption>")
    if header:
        parts.append("<tr>" + "".join(cell(h, "th") for h in header) + "</tr>")
    for r in rows:
        parts.append("<tr>" + "".join(cell(v, "td") for v in r) + "</tr>")
    parts.append("</table>")
    return "".join(parts)


def pre_block(text: str, *, cls: str = "sml-pre", max_height: str = "22em") -> str:
    """Escaped text in a scrollable ``<pre>`` (max height, both scroll bars)."""
    style = (
        f"max-height:{max_height};overflow:auto;font-size:11px;line-height:1.25;"
        "border:1px solid #ccc;padding:4px;margin:0;white-space:pre"
    )
    return f"<pre class='{cls}' style='{style}'>{html.escape(text)}</pre>"


def mix_figure(
    mix: Mapping[str, int],
    baseline: Mapping[str, int] | None = None,
    *,
    title: str = "instruction mix (static counts)",
) -> Figure:
    """Horizontal bars of the instruction kinds present in ``mix`` (and the pinned baseline)."""
    kinds = [k for k in MIX_KINDS if k in mix and (mix[k] or (baseline or {}).get(k))]
    fig = Figure(figsize=(5.2, 0.28 * max(len(kinds), 4) + 0.8))
    ax = fig.add_subplot(1, 1, 1)
    ys = list(range(len(kinds)))
    if baseline is not None:
        ax.barh([y + 0.2 for y in ys], [baseline.get(k, 0) for k in kinds], height=0.4,
                color="#bbbbbb", label="pinned")  # fmt: skip
        ax.barh([y - 0.2 for y in ys], [mix[k] for k in kinds], height=0.4, color="#1f77b4",
                label="current")  # fmt: skip
        ax.legend(loc="lower right", fontsize=8)
    else:
        ax.barh(ys, [mix[k] for k in kinds], color="#1f77b4")
    ax.set_yticks(ys, kinds, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("instructions in the kernel body")
    ax.set_title(f"{title}; total {mix.get('total', '?')}", fontsize=9)
    fig.tight_layout()
    return fig


def relative_errors(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|out - ref| / rms(ref) per element, flattened (fp64); rms keeps near-zero refs sane."""
    out, ref = out.double(), ref.double()
    rms = ref.pow(2).mean().sqrt().clamp_min(1e-30)
    return ((out - ref).abs() / rms).flatten()


def per_head_rel_l2(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """[H] relative L2 error per head of [T, H, D] tensors (fp64)."""
    d = (out.double() - ref.double()).pow(2).sum(dim=(0, 2)).sqrt()
    n = ref.double().pow(2).sum(dim=(0, 2)).sqrt().clamp_min(1e-30)
    return d / n


def per_token_head_rel_l2(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """[T, H] relative L2 error of each (token, head) row of [T, H, D] tensors (fp64), relative
    to the whole reference's RMS row norm so an all-zero row (an empty token) stays finite."""
    d = (out.double() - ref.double()).pow(2).sum(dim=2).sqrt()
    n = ref.double().pow(2).sum(dim=2).mean().sqrt().clamp_min(1e-30)
    return d / n


def error_figure(
    out: torch.Tensor,
    ref: torch.Tensor,
    baseline: torch.Tensor | None = None,
    *,
    title: str = "error against the fp32 reference",
    factor: float = 2.0,
) -> Figure:
    """Histogram of per-element relative error, relative L2 error per head with the tolerance
    (``factor`` x the baseline's error) drawn, and a token x head heatmap.

    ``out``, ``ref`` (fp32 reference) and ``baseline`` (plain PyTorch in the kernel's dtype) are
    [T, H, D]; the baseline is drawn alongside, since the tolerance is 2x its error. The title
    should name the config the figure shows. Legends sit outside the data.
    """
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(11, 3.0))
    ax1, ax2, ax3 = (fig.add_subplot(1, 3, i) for i in (1, 2, 3))
    e = relative_errors(out, ref)
    floor = 1e-9
    bad = int((~torch.isfinite(e)).sum())  # NaN / inf (an unwritten tile): counted, not drawn
    ax1.hist(torch.log10(e[torch.isfinite(e)].clamp_min(floor)).numpy(), bins=60, alpha=0.8,
             label="kernel")  # fmt: skip
    if baseline is not None:
        eb = relative_errors(baseline, ref)
        ax1.hist(torch.log10(eb[torch.isfinite(eb)].clamp_min(floor)).numpy(), bins=60,
                 alpha=0.5, label="torch same dtype")  # fmt: skip
    ax1.set_xlabel("log10 |out - ref| / rms(ref)")
    ax1.set_ylabel("elements")
    bad_note = f"\n{bad} of {e.numel()} kernel elements NaN/inf (not drawn)" if bad else ""
    ax1.set_title("per-element relative error" + bad_note, fontsize=9,
                  color="#b00000" if bad else "black")  # fmt: skip
    heads = per_head_rel_l2(out, ref)
    xs = list(range(heads.numel()))
    ax2.plot(xs, heads.numpy(), "o-", ms=3, label="kernel")
    if baseline is not None:
        base = per_head_rel_l2(baseline, ref)
        ax2.plot(xs, base.numpy(), "s--", ms=3, label="torch same dtype")
        ax2.plot(xs, (factor * base).numpy(), ":", color="#b00000",
                 label=f"tolerance ({factor:g}x torch)")  # fmt: skip
    ax2.set_yscale("log")
    ax2.set_xlabel("head")
    ax2.set_ylabel("relative L2 error")
    ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.set_title("error per head", fontsize=9)
    grid = per_token_head_rel_l2(out, ref)
    im = ax3.imshow(torch.log10(grid.clamp_min(floor)).numpy(), aspect="auto",
                    interpolation="nearest", cmap="magma")  # fmt: skip
    ax3.set_xlabel("head")
    ax3.set_ylabel("token")
    ax3.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax3.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax3.set_title("log10 error per token x head", fontsize=9)
    fig.colorbar(im, ax=ax3, fraction=0.05)
    handles = [h for ax in (ax1, ax2) for h in ax.get_legend_handles_labels()[0]]
    labels = [lb for ax in (ax1, ax2) for lb in ax.get_legend_handles_labels()[1]]
    seen: dict[str, Any] = {}
    for h, lb in zip(handles, labels, strict=True):
        seen.setdefault(lb, h)
    if seen:  # one legend below the plots, off the data
        fig.legend(list(seen.values()), list(seen), loc="lower center", ncol=len(seen),
                   fontsize=8, frameon=False)  # fmt: skip
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


def occupancy_curve(target: str, num_warps: int = 4, agprs: int = 0) -> tuple[list, list]:
    """(registers, occupancy) points of the register-limited occupancy for a target's formula:
    AMD, unified VGPRs 1..512 -> waves per SIMD; NVIDIA, registers per thread 1..255 -> warps
    per SM for blocks of ``num_warps`` warps. ``agprs`` only shifts where the AMD kernel sits."""
    from .. import inspect as _inspect
    from ..targets import get_target

    t = get_target(target)
    if t.is_amd:
        xs = list(range(1, 513))
        return xs, [_inspect._cdna_waves_for_total(x) for x in xs]
    xs = list(range(1, 256))
    # Registers alone would allow more warps than an SM holds (64): the warp slots cap it.
    lim = [_inspect._nvidia_limits(x, 0, num_warps) for x in xs]
    return xs, [min(m["registers"], m["warps"]) for m in lim]


def occupancy_ceiling(target: str) -> int:
    """The most waves per SIMD (AMD) or warps per SM (NVIDIA) the target holds."""
    from .. import inspect as _inspect
    from ..targets import get_target

    return _inspect._CDNA_MAX_WAVES if get_target(target).is_amd else _inspect._NV_MAX_WARPS


def _register_point(res) -> tuple[int, int]:
    """(registers on the chart's x axis, register-limited occupancy) of a Resources."""
    if res.backend == "hip":
        return res.total_vgprs, res.limits["registers"]
    return res.registers, min(res.limits["registers"], res.limits.get("warps", 10**9))


def occupancy_figure(current, pinned=None, *, title: str | None = None) -> Figure:
    """The occupancy cliff: register-limited occupancy against registers for the target's
    formula (a step chart), the current kernel marked (and the pinned one); the kernel's own
    occupancy (with LDS / shared memory) is noted. ``current`` / ``pinned`` are CompileResults;
    the figure's ``marks`` attribute holds {label: (x, y)} of the marked points."""
    from matplotlib.ticker import MaxNLocator

    r = current.resources
    xs, ys = occupancy_curve(current.target.name, r.num_warps)
    fig = Figure(figsize=(5.2, 2.6))
    ax = fig.add_subplot(1, 1, 1)
    ax.step(xs, ys, where="post", color="#555555", lw=1.2, label="register limit")
    marks = {}
    for label, res, style in (("current", current, "o"), ("pinned", pinned, "s")):
        if res is None or res.target.backend != current.target.backend:
            continue
        x, y = _register_point(res.resources)
        marks[label] = (x, y)
        ax.plot([x], [y], style, ms=8, label=f"{label}: {x} regs, {y} "
                f"{res.target.occupancy_unit}", zorder=3)  # fmt: skip
    unit = current.target.occupancy_unit
    ax.set_xlabel("unified VGPRs (arch + AGPR)" if r.backend == "hip" else "registers / thread")
    ax.set_ylabel(unit)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(0, occupancy_ceiling(current.target.name) * 1.08)
    ax.set_title(title or f"occupancy cliff on {current.target.name} (kernel: {r.occupancy} "
                 f"{unit} with all limits)", fontsize=9)  # fmt: skip
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    fig.marks = marks
    return fig


def show(fig: Figure) -> None:
    """Display a figure in the notebook as a PNG image (no pyplot backend needed)."""
    from IPython.display import Image, display

    display(Image(to_png(fig)))
