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


def to_png(fig: Figure, dpi: int = 90) -> bytes:
    """PNG bytes of a figure (the figure is closed for further drawing by nothing; reuse ok)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    return buf.getvalue()


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


def error_figure(
    out: torch.Tensor,
    ref: torch.Tensor,
    baseline: torch.Tensor | None = None,
    *,
    title: str = "error against the fp32 reference",
) -> Figure:
    """Histogram of per-element relative error and relative L2 error per head.

    ``out``, ``ref`` (fp32 reference) and ``baseline`` (plain PyTorch in the kernel's dtype) are
    [T, H, D]; the baseline is drawn alongside, since the tolerance is 2x its error.
    """
    fig = Figure(figsize=(9, 2.8))
    ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    e = relative_errors(out, ref)
    floor = 1e-9
    ax1.hist(torch.log10(e.clamp_min(floor)).numpy(), bins=60, alpha=0.8, label="kernel")
    if baseline is not None:
        eb = relative_errors(baseline, ref)
        ax1.hist(torch.log10(eb.clamp_min(floor)).numpy(), bins=60, alpha=0.5,
                 label="torch same dtype")  # fmt: skip
        ax1.legend(fontsize=8)
    ax1.set_xlabel("log10 |out - ref| / rms(ref)")
    ax1.set_ylabel("elements")
    ax1.set_title("per-element relative error", fontsize=9)
    heads = per_head_rel_l2(out, ref)
    ax2.plot(heads.numpy(), "o-", ms=3, label="kernel")
    if baseline is not None:
        ax2.plot(per_head_rel_l2(baseline, ref).numpy(), "s--", ms=3, label="torch same dtype")
        ax2.legend(fontsize=8)
    ax2.set_yscale("log")
    ax2.set_xlabel("head")
    ax2.set_ylabel("relative L2 error")
    ax2.set_title("error per head", fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def show(fig: Figure) -> None:
    """Display a figure in the notebook as a PNG image (no pyplot backend needed)."""
    from IPython.display import Image, display

    display(Image(to_png(fig)))
