"""Notebook 05's helpers: pictures of the Gluon kernel's layouts and its compiled modes.

A Gluon distributed layout says which lane of which warp holds which element of a tile, in
which register. Triton turns every layout into a *linear layout*: bases for register, lane and
warp bits, whose XOR gives an element's coordinates. :func:`ownership` evaluates those bases
for every (register, lane, warp) and :func:`layout_figure` draws the tile coloured by warp with
each element's lane number, so the MFMA (gfx950) and mma.sync (Hopper) layouts the kernel uses
can be compared at a glance. :func:`compile_kernels` cross-compiles every registered kernel the
explorer offers for a target (:func:`sparse_mla.lab.explorer.kernels_for`: the Gluon kernels and
the Triton ones) at the launch it runs there, and :func:`modes_table` tabulates their resources
side by side; :func:`compile_modes` does the same for the shared Gluon algorithm's decode and
prefill modes. The knobs of one kernel are explored with notebook 02's panel
(:class:`sparse_mla.lab.explorer.ExplorerPanel`, opened with ``kernel=``).
"""

from __future__ import annotations

from typing import Any

import torch
from matplotlib.figure import Figure

__all__ = [
    "compile_kernels", "compile_modes", "kernel_layouts", "layout_figure", "modes_table",
    "ownership",
]  # fmt: skip


def _builder():
    from triton._C.libtriton import gluon_ir, ir

    ctx = ir.context()
    ir.load_dialects(ctx)
    builder = gluon_ir.GluonOpBuilder(ctx)
    builder._ctx = ctx  # keep the context alive as long as the builder
    return builder


def ownership(layout, shape: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Who owns each element of a [M, N] tile in ``layout`` (a Gluon distributed layout).

    Returns {"lane", "warp", "reg"}: [M, N] int tensors (-1 where nothing maps, which does not
    happen for a layout that covers the tile) plus "copies": [M, N] how many (lane, warp, reg)
    triples hold the element (> 1 when a small tile is broadcast over more threads)."""
    M, N = shape
    b = _builder()
    ll = b.to_linear_layout(layout._to_ir(b), [M, N])
    lane = torch.full((M, N), -1, dtype=torch.int64)
    warp = torch.full((M, N), -1, dtype=torch.int64)
    reg = torch.full((M, N), -1, dtype=torch.int64)
    copies = torch.zeros((M, N), dtype=torch.int64)

    def coord(bases, index):
        r = c = 0
        for bit, (br, bc) in enumerate(bases):
            if index >> bit & 1:
                r ^= br
                c ^= bc
        return r, c

    for w in range(1 << len(ll.warp_bases)):
        wr, wc = coord(ll.warp_bases, w)
        for ln in range(1 << len(ll.lane_bases)):
            lr, lc = coord(ll.lane_bases, ln)
            for rg in range(1 << len(ll.reg_bases)):
                rr, rc = coord(ll.reg_bases, rg)
                i, j = wr ^ lr ^ rr, wc ^ lc ^ rc
                if copies[i, j] == 0:
                    lane[i, j], warp[i, j], reg[i, j] = ln, w, rg
                copies[i, j] += 1
    return {"lane": lane, "warp": warp, "reg": reg, "copies": copies}


def layout_figure(layout, shape: tuple[int, int], *, title: str = "", ax=None) -> Figure:
    """The tile coloured by owning warp, each element labelled with its lane (and the
    register index of lane 0's elements underlined by a dot). When the layout covers more than
    ``shape`` (more warps than the tile needs), the title says how many copies each element has."""
    own = ownership(layout, shape)
    M, N = shape
    fig = None
    if ax is None:
        fig = Figure(figsize=(max(6.0, 0.28 * N), max(2.4, 0.28 * M + 0.8)))
        ax = fig.add_subplot(1, 1, 1)
    ax.imshow(own["warp"].numpy(), cmap="Pastel1", aspect="auto", interpolation="nearest",
              vmin=0, vmax=8)  # fmt: skip
    fs = 7 if N <= 32 else 5.5
    for i in range(M):
        for j in range(N):
            ax.text(j, i, str(int(own["lane"][i, j])), ha="center", va="center", fontsize=fs)
    lane0 = (own["lane"] == 0).nonzero().tolist()
    ax.plot([j for _, j in lane0], [i + 0.3 for i, _ in lane0], "k.", ms=2)
    ax.set_xticks(range(0, N, 8))
    ax.set_yticks(range(0, M, 4))
    ax.set_xlabel("column (N)")
    ax.set_ylabel("row (M)")
    held = int(own["copies"].max())
    note = f"\neach element is held by {held} (warp, lane, register)s: the layout is wider than " \
        "the tile, so warps repeat it; colour = the first holder" if held > 1 else ""  # fmt: skip
    ax.set_title((title or str(layout)) + note, fontsize=8)
    if fig is not None:
        fig.tight_layout()
        return fig
    return ax.figure


def kernel_layouts(target: str, num_heads: int = 16) -> dict[str, Any]:
    """The layouts the Gluon MLA kernel compiles with for ``target`` (the default config for
    ``num_heads``): MMA_QK (the [BLOCK_H, BLOCK_K] scores), MMA_PV (the [BLOCK_H, 512]
    output), GATHER (the row gather) and SMEM, plus the config."""
    from ..gluon import default_config
    from ..gluon.launch import get_target, kernel_constexprs

    t = get_target(target)
    cfg = default_config(num_heads, t)
    c = kernel_constexprs(cfg, t, has_pe=False, has_sink=True, num_splits=1, write_lse=False,
                          use_buffer=True)  # fmt: skip
    return {"config": cfg, "warp_size": t.warp_size,
            **{k: c[k] for k in ("MMA_QK", "MMA_PV", "GATHER", "SMEM")}}  # fmt: skip


def compile_modes(target: str, num_heads: int = 16, modes=("decode", "prefill")) -> dict:
    """{mode: CompileResult} of the Gluon kernel cross-compiled for ``target``."""
    from .. import inspect

    return {m: inspect.compile_gluon(m, target, num_heads=num_heads) for m in modes}


def compile_kernels(
    target: str, num_heads: int = 16, head_dim: int = 512
) -> tuple[dict[str, Any], dict[str, str]]:
    """Cross-compile every kernel the explorer offers for ``target`` at (H, D), each with the
    launch it runs there (:func:`sparse_mla.tune.base_launch`: the tuned or recorded one, else
    its default). Returns ({kernel: CompileResult}, {kernel: why it was not compiled}); a
    kernel that cannot take the shape or whose compile fails is in the second dict."""
    from .. import dispatch, tune
    from .. import inspect as si
    from .explorer import kernels_for

    done: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    for name in kernels_for(target):
        k = dispatch.kernel(name)
        arch = si.get_target(target).name
        why = k.unavailable(dispatch.Call(arch, num_heads, head_dim, kv_format=k.kv_format))
        if why:
            skipped[name] = why
            continue
        try:
            launch, _ = tune.base_launch(name, target, num_heads, head_dim)
            done[name] = si.compile_kernel(
                name, target, num_heads=num_heads, head_dim=head_dim, config=launch
            )[1]
        except Exception as e:  # a kernel that does not compile here is a row to show
            skipped[name] = si.failure_reason(e)
    return done, skipped


def modes_table(results: dict) -> list[list[Any]]:
    """Rows [resource, <column>...] over the compiles' resource rows and key mix counts (the
    columns: modes of :func:`compile_modes` or kernels of :func:`compile_kernels`)."""
    modes = list(results)
    rows = [dict(results[m].resources.as_rows()) for m in modes]
    table = [[k, *[r.get(k) for r in rows]] for k in rows[0]]
    for kind in ("mfma", "mma", "wgmma", "buffer_load", "global_load", "async_copy", "exp2",
                 "total"):  # fmt: skip
        vals = [results[m].mix.get(kind) for m in modes]
        if any(vals):
            table.append([f"instr: {kind}", *vals])
    return table
