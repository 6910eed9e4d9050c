"""Notebook 01's teaching helpers: one token's sparse attention, dense then tile by tile.

Everything here is fp64 PyTorch on one token and one head, small enough to print: a token's slot
list is gathered from the pool, its logits go through a softmax (dense, then online BLOCK_K
slots at a time exactly as the kernel's loop does), the sink joins as a virtual column, and the
base-2 variant shows where log2(e) goes. The figures are ``matplotlib.figure.Figure`` objects;
:func:`tile_stepper` wraps the online-softmax figure in a slider.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from matplotlib.figure import Figure

from .. import _consts
from .figures import to_png

__all__ = [
    "LOG2E",
    "DenseResult",
    "TileStep",
    "Token",
    "dense_attention",
    "dense_figure",
    "exp_vs_exp2",
    "invalid_and_empty_batch",
    "make_token",
    "online_figure",
    "online_softmax",
    "sink_figure",
    "tile_stepper",
]

LOG2E = _consts.LOG2E


@dataclass(frozen=True)
class Token:
    """One query token and head: ``q`` [D], the pool ``kv`` [N, D] (K and V are the same row),
    its slot list ``slots`` [L] (may hold invalid ids), ``scale`` and an optional ``sink``."""

    q: torch.Tensor
    kv: torch.Tensor
    slots: torch.Tensor
    scale: float
    sink: float | None = None

    @property
    def valid(self) -> torch.Tensor:
        """[L] bool: 0 <= slot < N."""
        return (self.slots >= 0) & (self.slots < self.kv.shape[0])


def make_token(
    num_slots: int = 48,
    pool: int = 96,
    head_dim: int = 64,
    *,
    num_invalid: int = 5,
    sink: float | None = 1.5,
    seed: int = 0,
) -> Token:
    """A random token: ``num_slots`` slot ids into a ``pool``-row pool, ``num_invalid`` of them
    replaced by invalid ids (-1 or N). The logits get a spread so the running max moves."""
    if num_slots < 1 or pool < 1 or head_dim < 1:
        raise ValueError("num_slots, pool and head_dim must be >= 1")
    if not 0 <= num_invalid <= num_slots:
        raise ValueError(f"num_invalid must be in [0, num_slots], got {num_invalid}")
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(head_dim, generator=g, dtype=torch.float64)
    kv = torch.randn(pool, head_dim, generator=g, dtype=torch.float64)
    slots = torch.randint(0, pool, (num_slots,), generator=g)
    # Rows increasingly aligned with q at a third and two thirds of the list, so the running
    # max jumps mid-way (distinct rows, so no other slot inherits the boost).
    hot_pos = [num_slots // 3, (2 * num_slots) // 3]
    hot_rows = torch.randperm(pool, generator=g)[: len(hot_pos)]
    for boost, pos, row in zip((0.2, 0.35), hot_pos, hot_rows.tolist(), strict=True):
        kv[row] += boost * q
        slots[pos] = row
    others = torch.tensor([i for i in range(num_slots) if i not in hot_pos], dtype=torch.long)
    order = torch.cat([others[torch.randperm(others.numel(), generator=g)],
                       torch.tensor(hot_pos, dtype=torch.long)])  # fmt: skip
    bad = order[:num_invalid]
    slots[bad] = torch.tensor([-1, pool])[torch.arange(bad.numel()) % 2]
    return Token(q=q, kv=kv, slots=slots, scale=head_dim**-0.5, sink=sink)


@dataclass(frozen=True)
class DenseResult:
    """The whole softmax at once: logits and probabilities over the token's slots ([L]; invalid
    slots have logit -inf and probability 0), the sink's probability, output [D] and the
    log-sum-exp (natural log, sink included)."""

    logits: torch.Tensor
    p: torch.Tensor
    p_sink: float
    out: torch.Tensor
    lse: float


def dense_attention(tok: Token, *, with_sink: bool = True) -> DenseResult:
    """Gather the valid rows, softmax over their logits (plus the sink column), weight the rows."""
    valid = tok.valid
    logits = torch.full(tok.slots.shape, -math.inf, dtype=torch.float64)
    rows = tok.kv[tok.slots[valid]]  # [L_valid, D]: the gather
    logits[valid] = (rows @ tok.q) * tok.scale
    sink = tok.sink if with_sink else None
    cols = logits
    if sink is not None:
        cols = torch.cat([logits, torch.tensor([sink], dtype=torch.float64)])
    if not torch.isfinite(cols).any():  # no valid slot and no sink: the kernel stores zeros
        zeros = torch.zeros_like(logits)
        return DenseResult(logits, zeros, 0.0, torch.zeros_like(tok.q), -math.inf)
    m = cols.max()
    e = torch.exp(cols - m)
    denom = e.sum()
    p_all = e / denom
    p = p_all[: logits.numel()]
    p_sink = float(p_all[-1]) if sink is not None else 0.0
    out = p[valid] @ rows if valid.any() else torch.zeros_like(tok.q)
    return DenseResult(logits, p, p_sink, out, float(m + torch.log(denom)))


@dataclass(frozen=True)
class TileStep:
    """State of the online softmax after one tile (or after the sink, ``tile == -1``).

    ``m_i`` running max, ``l_i`` denominator relative to ``m_i`` (natural-log units: the
    log-sum-exp so far is ``m_i + log(l_i)``), ``out`` the normalised output so far
    (acc / l_i), ``err`` its relative L2 distance to the dense result."""

    tile: int
    start: int
    stop: int
    m_i: float
    l_i: float
    out: torch.Tensor = field(repr=False)
    err: float

    @property
    def lse(self) -> float:
        return -math.inf if self.l_i == 0 else self.m_i + math.log(self.l_i)


def online_softmax(
    tok: Token, block_k: int = 8, *, use_exp2: bool = False, with_sink: bool = True
) -> list[TileStep]:
    """The kernel's loop on one head: for each BLOCK_K tile, mask invalid slots to -inf, update
    the running max m_i, rescale the denominator l_i and accumulator acc by alpha =
    exp(m_old - m_new), add this tile's terms. The sink joins after the last tile.

    With ``use_exp2`` the logits are pre-multiplied by log2(e) (folded into the scale) and
    exp2 replaces exp; ``m_i`` is then reported back in natural-log units so both variants plot
    the same curves."""
    if block_k < 1:
        raise ValueError(f"block_k must be >= 1, got {block_k}")
    dense = dense_attention(tok, with_sink=with_sink)
    c = LOG2E if use_exp2 else 1.0  # logits in base-2 units under exp2
    qk_scale = tok.scale * c

    def _exp(x):
        return torch.exp2(x) if use_exp2 else torch.exp(x)

    m_i, l_i = -math.inf, 0.0
    acc = torch.zeros_like(tok.q)
    steps: list[TileStep] = []

    def snapshot(tile, start, stop):
        out = acc / l_i if l_i > 0 else torch.zeros_like(acc)
        ref = dense.out
        den = float(ref.norm()) or 1.0
        err = float((out - ref).norm()) / den
        steps.append(TileStep(tile, start, stop, m_i / c, l_i, out.clone(), err))

    L = tok.slots.numel()
    for tile, k0 in enumerate(range(0, L, block_k)):
        slots = tok.slots[k0 : k0 + block_k]
        valid = (slots >= 0) & (slots < tok.kv.shape[0])  # [BLOCK_K]
        rows = torch.zeros(slots.numel(), tok.q.numel(), dtype=torch.float64)
        rows[valid] = tok.kv[slots[valid]]  # masked gather: invalid rows are never read
        qk = (rows @ tok.q) * qk_scale
        qk = torch.where(valid, qk, torch.tensor(-math.inf, dtype=torch.float64))
        m_new = max(m_i, float(qk.max()))
        m_shift = 0.0 if m_new == -math.inf else m_new  # keep exp(-inf - -inf) out of the sums
        alpha = math.exp(m_i - m_shift) if not use_exp2 else 2.0 ** (m_i - m_shift)
        p = _exp(qk - m_shift)
        l_i = l_i * alpha + float(p.sum())
        acc = acc * alpha + p @ rows
        m_i = m_new
        snapshot(tile, k0, min(k0 + block_k, L))
    if with_sink and tok.sink is not None:
        sink = tok.sink * c
        m_fin = max(m_i, sink)
        alpha = math.exp(m_i - m_fin) if not use_exp2 else 2.0 ** (m_i - m_fin)
        l_i = l_i * alpha + (math.exp(sink - m_fin) if not use_exp2 else 2.0 ** (sink - m_fin))
        acc = acc * alpha  # the sink's value vector is zero: only the denominator grows
        m_i = m_fin
        snapshot(-1, L, L)
    return steps


def dense_figure(tok: Token) -> Figure:
    """Logits and probabilities of every slot (invalid slots marked), sink included."""
    d = dense_attention(tok)
    fig = Figure(figsize=(9, 2.8))
    ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    x = torch.arange(tok.slots.numel())
    valid = tok.valid
    ax1.plot(x[valid].numpy(), d.logits[valid].numpy(), "o", ms=3, label="valid slot")
    ax1.plot(x[~valid].numpy(), [0.0] * int((~valid).sum()), "rx", label="invalid slot (no logit)")
    if tok.sink is not None:
        ax1.axhline(tok.sink, color="k", ls=":", label="sink logit")
    ax1.set_xlabel("position in the token's slot list")
    ax1.set_ylabel("logit (q·k × scale)")
    ax1.legend(fontsize=7)
    ax2.bar(x.numpy(), d.p.numpy(), width=0.8)
    ax2.set_xlabel("position in the token's slot list")
    ax2.set_ylabel("softmax probability")
    ax2.set_title(f"sink takes {d.p_sink:.3f} of the mass", fontsize=9)
    fig.tight_layout()
    return fig


def online_figure(tok: Token, steps: list[TileStep], upto: int | None = None) -> Figure:
    """Three panels for the first ``upto`` tiles (all by default): logits coloured by tile with
    the running max, the running log-sum-exp against the dense one, and the output's error."""
    dense = dense_attention(tok)
    tiles = [s for s in steps if s.tile >= 0]
    n = len(steps) if upto is None else max(1, min(upto, len(steps)))
    shown = steps[:n]
    fig = Figure(figsize=(11, 3.0))
    ax1, ax2, ax3 = (fig.add_subplot(1, 3, i) for i in (1, 2, 3))
    logits = dense.logits
    for s in tiles:
        xs = torch.arange(s.start, s.stop)
        ys = logits[s.start : s.stop]
        fin = torch.isfinite(ys)
        seen = s.tile < n and s in shown
        ax1.plot(
            xs[fin].numpy(),
            ys[fin].numpy(),
            "o",
            ms=3,
            color=f"C{s.tile % 10}",
            alpha=1.0 if seen else 0.15,
        )
    seen_tiles = [s for s in shown if s.tile >= 0]
    ax1.hlines([s.m_i for s in seen_tiles], [s.start - 0.5 for s in seen_tiles],
               [s.stop - 0.5 for s in seen_tiles], color="k",
               label="m_i after the tile")  # fmt: skip
    ax1.set_xlabel("slot position (colour = tile)")
    ax1.set_ylabel("logit")
    ax1.set_title("running max m_i", fontsize=9)
    ax1.legend(fontsize=7)
    idx = list(range(len(shown)))
    labels = [str(s.tile) if s.tile >= 0 else "sink" for s in shown]
    ax2.plot(idx, [s.lse for s in shown], "o-", ms=4, label="m_i + log l_i")
    ax2.axhline(dense.lse, color="k", ls=":", label="dense log-sum-exp")
    ax2.set_xticks(idx, labels, fontsize=7)
    ax2.set_xlabel("after tile")
    ax2.set_title("denominator (as log-sum-exp)", fontsize=9)
    ax2.legend(fontsize=7)
    ax3.semilogy(idx, [max(s.err, 1e-17) for s in shown], "o-", ms=4)
    ax3.set_xticks(idx, labels, fontsize=7)
    ax3.set_xlabel("after tile")
    ax3.set_title("‖acc/l_i − dense output‖ / ‖dense output‖", fontsize=9)
    for ax in (ax2, ax3):
        ax.set_xlim(-0.5, len(steps) - 0.5)
    # Fixed limits, so the slider moves the curves and not the axes.
    lses = [s.lse for s in steps if math.isfinite(s.lse)] + [dense.lse]
    ax2.set_ylim(min(lses) - 0.3, max(lses) + 0.3)
    ax3.set_ylim(1e-17, 3.0)
    fig.tight_layout()
    return fig


def tile_stepper(tok: Token, block_k: int = 8, *, use_exp2: bool = False):
    """A slider over tiles and the :func:`online_figure` up to the chosen tile (an ipywidgets
    VBox; ``.slider`` and ``.image`` are its parts)."""
    import ipywidgets as widgets

    steps = online_softmax(tok, block_k, use_exp2=use_exp2)
    slider = widgets.IntSlider(
        value=1, min=1, max=len(steps), step=1, description="tiles seen",
        continuous_update=False,
    )  # fmt: skip
    image = widgets.Image(format="png", value=to_png(online_figure(tok, steps, 1)))
    info = widgets.HTML()

    def show(_=None):
        s = steps[slider.value - 1]
        image.value = to_png(online_figure(tok, steps, slider.value))
        what = "the sink" if s.tile < 0 else f"tile {s.tile} (slots {s.start}..{s.stop - 1})"
        info.value = (
            f"after {what}: m_i = {s.m_i:.4f}, l_i = {s.l_i:.4f}, "
            f"output error vs dense = {s.err:.2e}"
        )

    slider.observe(show, names="value")
    show()
    box = widgets.VBox([slider, info, image])
    box.slider, box.image, box.info, box.steps = slider, image, info, steps
    return box


def sink_figure(tok: Token) -> Figure:
    """Probabilities with the sink as one more column (value vector zero), and the output's
    norm with and without it: the sink only scales the output down."""
    with_s = dense_attention(tok, with_sink=True)
    without = dense_attention(tok, with_sink=False)
    fig = Figure(figsize=(9, 2.6))
    ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    n = tok.slots.numel()
    ax1.bar(range(n), with_s.p.numpy(), color="C0", label="slots")
    ax1.bar([n + 1], [with_s.p_sink], color="C3", label="sink (virtual column)")
    ax1.set_xlabel("slot position; the sink sits after the last slot")
    ax1.set_ylabel("probability")
    ax1.legend(fontsize=7)
    ratio = (with_s.out / without.out).mean().item() if without.out.abs().sum() else float("nan")
    ax2.plot(without.out[:32].numpy(), label="no sink")
    ax2.plot(with_s.out[:32].numpy(), label="with sink")
    ax2.set_title(f"output dims 0..31: scaled by {ratio:.3f} = 1 − p_sink", fontsize=9)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    return fig


def exp_vs_exp2(tok: Token, block_k: int = 8) -> dict[str, float]:
    """Run the online softmax with exp and with exp2 (scale and sink times log2(e)) and report
    the folded constants and how far the two outputs are apart (fp64: rounding only)."""
    a = online_softmax(tok, block_k, use_exp2=False)[-1]
    b = online_softmax(tok, block_k, use_exp2=True)[-1]
    return {
        "softmax_scale": tok.scale,
        "qk_scale under USE_EXP2 (scale * log2 e)": tok.scale * LOG2E,
        "sink under USE_EXP2 (sink * log2 e)": (tok.sink or 0.0) * LOG2E,
        "max |out_exp - out_exp2|": float((a.out - b.out).abs().max()),
        "lse (exp)": a.lse,
        "lse (exp2, back in natural log)": b.lse,
    }


def invalid_and_empty_batch(
    num_heads: int = 16, head_dim: int = 64, *, dtype=torch.bfloat16, seed: int = 0
) -> dict:
    """Three tokens for the real kernel: a normal one, one whose slot list mixes invalid ids
    (-1, N, 2**31-1) with valid ones, and one with only invalid ids (an empty row). Every pool
    row that no valid slot references is NaN, so a stray read would show in the output.

    Returns the kernel's positional operands and sink as a dict (q, kv, kv_indices, kv_indptr,
    softmax_scale, attn_sink)."""
    g = torch.Generator().manual_seed(seed)
    N = 40
    kv = torch.randn(N, head_dim, generator=g)
    lists = [
        list(range(0, 12)),
        [12, -1, 13, N, 14, 2**31 - 1, 15, 16],
        [-1, N, 2**31 - 1],
    ]
    used = {s for lst in lists for s in lst if 0 <= s < N}
    for r in range(N):
        if r not in used:
            kv[r] = float("nan")
    indptr = torch.tensor([0, *torch.tensor([len(x) for x in lists]).cumsum(0).tolist()])
    return {
        "q": torch.randn(len(lists), num_heads, head_dim, generator=g).to(dtype),
        "kv": kv.to(dtype),
        "kv_indices": torch.tensor([s for lst in lists for s in lst], dtype=torch.int32),
        "kv_indptr": indptr.to(torch.int32),
        "softmax_scale": head_dim**-0.5,
        "attn_sink": torch.randn(num_heads, generator=g),
    }
