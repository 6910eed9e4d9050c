"""Notebook 07's helpers: the sm90 warp-specialised sparse prefill (``gluon/hopper_ws.py``) drawn.

Everything the pictures show comes from one place each, so they cannot drift from the kernel:

- :data:`BARRIERS`: the kernel's barriers of both kinds (name, the ``hopper_ws`` constant and
  offset that give its index, who arrives, who waits): the mbarriers in slot order (the
  producer's hand-offs to the consumers and back), then the named (hardware) barriers on which
  the two consumers meet, by id (``NB_*``: the pair's row maxima, each consumer's P, the
  epilogue's partial sums). The tests check every entry against the kernel module's constants.
- :data:`PARTITIONS`: the three partitions in ``gl.warp_specialize`` order (the default
  partition first), with the names ``inspect`` gives their register counts.
- :data:`TIMELINE`: what each partition does per work item and per pair of KV tiles, with the
  barriers each step waits on and arrives at. :func:`schedule` plays it (a step starts when its
  partition is free and every barrier it waits on has all its arrivals), and
  :func:`timeline_figure` draws the result as swimlanes; the tests check the producer's gather
  order and the consumers' exchange order against the kernel's source (``inspect.getsource``:
  ``mbarrier.wait`` / arrivals, and the named barriers' ``_bar_sync`` / ``_bar_arrive``).
- :func:`smem_buffers` reads the kernel's ``allocate_shared_memory`` calls and sizes each buffer
  from the module's constants (BLOCK_H, BLOCK_K, HEAD_DIM, NUM_BARS; the named barriers take no
  shared memory); :func:`budget_figure` draws them and the partitions' registers against the
  SM's limits.
- :func:`bench_summary` / :func:`bench_figure` read the committed bench CSV (as
  ``lab/roofline.py`` does); :func:`read_steps` / :func:`steps_figure` read the probe log of
  each optimisation step.
"""

from __future__ import annotations

import ast
import csv
import inspect as pyinspect
import re
import statistics
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import FancyArrowPatch, Rectangle

from ..gluon import hopper_ws
from .roofline import provider_color

__all__ = [
    "BARRIERS",
    "MBARRIERS",
    "NAMED_BARRIERS",
    "PARTITIONS",
    "PROVIDERS",
    "REGISTER_FILE",
    "SMEM_LIMIT",
    "TIMELINE",
    "WORKLOADS",
    "Barrier",
    "Partition",
    "Step",
    "bench_figure",
    "bench_summary",
    "bench_table",
    "budget_figure",
    "budget_table",
    "buffers_figure",
    "gather_order",
    "kernel_gathers",
    "kernel_partitions",
    "partition_registers",
    "read_steps",
    "read_steps_csv",
    "read_variant_runs",
    "schedule",
    "smem_buffers",
    "source_events",
    "split_figure",
    "steps_figure",
    "table_events",
    "timeline_figure",
    "write_steps_csv",
]

REGISTER_FILE = 65536  # 32-bit registers per SM (sm90)
SMEM_LIMIT = 227 * 1024  # shared memory one block may use on sm90
PROVIDERS = ("default", "gluon", "triton", "flashmla", "aiter")
WORKLOADS = ("csa_h64_topk512", "csa_h128_topk1024")

PRODUCER, C0, C1 = "producer", "consumer 0", "consumer 1"
LANES = (PRODUCER, C0, C1)


# ----------------------------------------------------------------------------------------------
# The tables: partitions, barriers, the per-pair timeline
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Partition:
    """One partition of ``gl.warp_specialize``: its role, kernel function and inspect name."""

    name: str  # role in the pictures
    function: str  # the @gluon.jit function in hopper_ws that it runs
    inspect_name: str  # the name in inspect.Resources.partitions
    does: str


# In gl.warp_specialize order: the default partition first, then the workers.
PARTITIONS = (
    Partition(C0, "_consumer0", "default", "S of the even tiles; O[:, 0:256]"),
    Partition(
        C1,
        "_consumer1",
        "worker 0",
        "S of the odd tiles (a short last one over 16 slots); O[:, 256:512]",
    ),
    Partition(PRODUCER, "_producer", "worker 1", "cp.async gathers of Q and the KV halves"),
)


@dataclass(frozen=True)
class Barrier:
    """One barrier of the kernel, index ``hopper_ws.<const> + offset``: an mbarrier (``kind``
    "mbarrier", the index is its slot in the kernel's barrier array) or a named hardware
    barrier (``kind`` "named", the index is its id in ``bar.sync`` / ``bar.arrive``).

    A named barrier completes when all its threads arrived; ``bar.sync`` arrives *and* waits,
    ``bar.arrive`` only arrives. So every partition that waits on one also arrives at it, and a
    partition that arrives without waiting (``arrived_by`` but not ``waited_by``) uses
    ``bar.arrive``."""

    name: str
    const: str
    offset: int
    per: str  # "pair": completes once per pair of tiles; "item": once per work item
    arrived_by: tuple[str, ...]  # partitions that arrive (each once per phase)
    waited_by: tuple[str, ...]
    meaning: str
    kind: str = "mbarrier"  # "mbarrier" | "named"

    @property
    def id(self) -> int:
        """The mbarrier's slot or the named barrier's id."""
        return int(getattr(hopper_ws, self.const).value) + self.offset

    @property
    def slot(self) -> int:
        """The mbarrier's slot in the kernel's barrier array (named barriers have none)."""
        if self.kind != "mbarrier":
            raise ValueError(f"{self.name} is a named barrier: it has an id, not a slot")
        return self.id


def _half(buf: int, half: str) -> int:
    return 2 * buf + (0 if half == "L" else 1)


# The kernel's mbarriers in slot order (READY/FREE x = READY/FREE + 2 * buffer + half), then
# its named barriers in id order (NB_<name>).
# fmt: off
BARRIERS = (
    *(
        Barrier(f"READY {b}{h}", "READY", _half(b, h), "pair", (PRODUCER,), (C0 if b == 0 else C1,),
                f"half {b}{h} of KV buffer {b} has landed (the producer's 128 lanes, cp.async)")
        for b in (0, 1) for h in "LR"
    ),
    *(
        Barrier(f"FREE {b}{h}", "FREE", _half(b, h), "pair", (C0 if h == "L" else C1,),
                (PRODUCER,), f"the last reader of half {b}{h} is done with it")
        for b in (0, 1) for h in "LR"
    ),
    Barrier("Q_READY", "Q_READY", 0, "item", (PRODUCER,), (C0, C1), "Q of the work item landed"),
    Barrier("Q_FREE", "Q_FREE", 0, "item", (C0, C1), (PRODUCER,),
            "both consumers are past their last QK^T: Q may be overwritten"),
    Barrier("MAX", "NB_MAX", 0, "pair", (C0, C1), (C0, C1),
            "both consumers published the row max of their S tile (both bar.sync: they meet)",
            "named"),
    Barrier("P0", "NB_P0", 0, "pair", (C0, C1), (C1,),
            "consumer 0 stored P0 (bar.arrive, no wait); consumer 1 bar.syncs before its PV "
            "with P0", "named"),
    Barrier("P1", "NB_P1", 0, "pair", (C0, C1), (C0,),
            "consumer 1 stored P1 (bar.arrive, no wait); consumer 0 bar.syncs before its PV "
            "with P1", "named"),
    Barrier("L", "NB_L", 0, "item", (C0, C1), (C0, C1),
            "epilogue: both partial sums stored (both bar.sync: they meet)", "named"),
)
# fmt: on
MBARRIERS = tuple(b for b in BARRIERS if b.kind == "mbarrier")
NAMED_BARRIERS = tuple(b for b in BARRIERS if b.kind == "named")
_BY_NAME = {b.name: b for b in BARRIERS}


@dataclass(frozen=True)
class Step:
    """One thing a partition does. ``waits``: (barrier, pair offset) pairs (-1: the previous
    pair's / item's phase, which passes at once for the first; +1: the next pair's);
    ``arrives``: barriers it arrives at when done. ``when``: "item" (once, before the pairs),
    "pair" (every pair), "not_last", "last", "penultimate" (those pairs only), "end" (once,
    after the pairs). ``cost``: its length in the drawing (an order, not a measured time).

    A named barrier's ``bar.sync`` is drawn as an arrival at the end of one step and a wait at
    the start of the next: two consumers meet (MAX, L) where both have arrived."""

    lane: str
    label: str
    kind: str  # "copy" | "mma" | "softmax" | "exchange" | "sync"
    cost: float
    waits: tuple[tuple[str, int], ...] = ()
    arrives: tuple[str, ...] = ()
    when: str = "pair"
    gather: str | None = None  # the ring slot a producer copy fills ("0L", ...)
    ahead: int = 0  # works on the tiles of pair + ahead (consumer 0's next S0)


def _w(*names: str, d: int = 0) -> tuple[tuple[str, int], ...]:
    return tuple((n, d) for n in names)


# fmt: off
TIMELINE = (
    # producer warpgroup: Q once per item, then the four halves of a pair in the order the
    # consumers free them.
    Step(PRODUCER, "TMA Q [64, 512]", "copy", 2.0, _w("Q_FREE", d=-1), ("Q_READY",), "item"),
    Step(PRODUCER, "gather 0L", "copy", 1.5, _w("FREE 0L", d=-1), ("READY 0L",), gather="0L"),
    Step(PRODUCER, "gather 1R", "copy", 1.5, _w("FREE 1R", d=-1), ("READY 1R",), gather="1R"),
    Step(PRODUCER, "gather 0R", "copy", 1.5, _w("FREE 0R", d=-1), ("READY 0R",), gather="0R"),
    Step(PRODUCER, "gather 1L", "copy", 1.5, _w("FREE 1L", d=-1), ("READY 1L",), gather="1L"),
    # consumer 0 (default partition): even tiles, O[:, 0:256]. Its arrival at P1 is the one
    # its bar.sync on P1 makes before it waits (consumer 1's at P0 likewise).
    Step(C0, "S0 = Q_L K0L^T", "mma", 1.0, _w("Q_READY", "READY 0L"), (), "item"),
    Step(C0, "S0 += Q_R K0R^T", "mma", 1.0, _w("READY 0R"), (), "item"),
    Step(C0, "row max of S0; publish", "exchange", 0.6, (), ("MAX",)),
    Step(C0, "softmax with the pair's max; rescale O, l", "softmax", 1.2, _w("MAX")),
    Step(C0, "PV: O[:, 0:256] += P0 (regs) V0L; store P0", "mma", 2.0, (),
         ("P0", "FREE 0L", "P1")),
    Step(C0, "PV: O[:, 0:256] += P1 (smem) V1L", "mma", 2.0, _w("P1"), ("FREE 1L",)),
    Step(C0, "next S0 = Q_L K0L^T", "mma", 1.0, _w("READY 0L", d=1), (), "not_last", ahead=1),
    Step(C0, "next S0 += Q_R K0R^T", "mma", 1.0, _w("READY 0R", d=1), (), "not_last", ahead=1),
    Step(C0, "done with Q", "sync", 0.3, (), ("Q_FREE",), "penultimate"),
    Step(C0, "store l0", "exchange", 0.4, (), ("L",), "end"),
    Step(C0, "l = l0 + l1, sink; O[:, 0:256] out", "exchange", 1.4, _w("L"), (), "end"),
    # consumer 1: odd tiles, O[:, 256:512]
    Step(C1, "wait Q", "sync", 0.2, _w("Q_READY"), (), "item"),
    Step(C1, "S1 = Q_R K1R^T", "mma", 1.0, _w("READY 1R")),
    Step(C1, "S1 += Q_L K1L^T", "mma", 1.0, _w("READY 1L")),
    Step(C1, "done with Q", "sync", 0.3, (), ("Q_FREE",), "last"),
    Step(C1, "row max of S1; publish", "exchange", 0.6, (), ("MAX",)),
    Step(C1, "softmax with the pair's max; rescale O, l", "softmax", 1.2, _w("MAX")),
    Step(C1, "PV: O[:, 256:512] += P1 (regs) V1R; store P1", "mma", 2.0, (), ("P1", "P0")),
    Step(C1, "PV: O[:, 256:512] += P0 (smem) V0R", "mma", 2.0, _w("P0"),
         ("FREE 1R", "FREE 0R")),
    Step(C1, "store l1", "exchange", 0.4, (), ("L",), "end"),
    Step(C1, "l = l0 + l1, sink; O[:, 256:512] out", "exchange", 1.4, _w("L"), (), "end"),
)
# fmt: on


def gather_order(timeline: Sequence[Step] = TIMELINE) -> list[str]:
    """The ring slots the producer fills per pair, in the table's order (["0L", "1R", ...])."""
    return [s.gather for s in timeline if s.lane == PRODUCER and s.gather and s.when == "pair"]


def table_events(lane: str, timeline: Sequence[Step] = TIMELINE) -> list[tuple[str, str]]:
    """(op, barrier) in a partition's table order: its waits then its arrivals, step by step."""
    out: list[tuple[str, str]] = []
    for s in timeline:
        if s.lane == lane:
            out += [("wait", n) for n, _ in s.waits] + [("arrive", n) for n in s.arrives]
    return out


# ----------------------------------------------------------------------------------------------
# Playing the timeline
# ----------------------------------------------------------------------------------------------


@dataclass
class Placed:
    step: Step
    pair: int  # the pair it belongs to (0 for item/end steps)
    start: float
    end: float
    waited: list[tuple[str, int, float]] = field(default_factory=list)  # (barrier, key, time)


def _runs(step: Step, pair: int, pairs: int) -> bool:
    return {
        "pair": True,
        "not_last": pair < pairs - 1,
        "last": pair == pairs - 1,
        "penultimate": pair == pairs - 2,
    }[step.when]


def _lane_steps(lane: str, pairs: int, timeline: Sequence[Step]) -> list[tuple[Step, int]]:
    mine = [s for s in timeline if s.lane == lane]
    seq = [(s, 0) for s in mine if s.when == "item"]
    for p in range(pairs):
        seq += [(s, p) for s in mine if s.when not in ("item", "end") and _runs(s, p, pairs)]
    return seq + [(s, pairs - 1) for s in mine if s.when == "end"]


def schedule(pairs: int = 2, timeline: Sequence[Step] = TIMELINE) -> list[Placed]:
    """Play one work item of ``pairs`` pairs of tiles: each partition runs its steps in order;
    a step starts once its partition is free and every barrier it waits on has had all its
    arrivals for that phase. Raises RuntimeError if the table deadlocks."""
    if pairs < 1:
        raise ValueError(f"pairs must be >= 1, got {pairs}")
    todo = {lane: _lane_steps(lane, pairs, timeline) for lane in LANES}
    clock = dict.fromkeys(LANES, 0.0)
    arrivals: dict[tuple[str, int], list[float]] = {}
    placed: list[Placed] = []

    def key(name: str, pair: int, d: int = 0) -> int:
        return pair + d if _BY_NAME[name].per == "pair" else d

    progress = True
    while progress and any(todo.values()):
        progress = False
        for lane in LANES:
            while todo[lane]:
                step, p = todo[lane][0]
                times = []
                for name, d in step.waits:
                    k = key(name, p, d)
                    if k < 0:
                        continue  # a fresh barrier's previous phase counts as complete
                    got = arrivals.get((name, k), [])
                    if len(got) < len(_BY_NAME[name].arrived_by):
                        break
                    times.append((name, k, max(got)))
                else:
                    start = max([clock[lane]] + [t for _, _, t in times])
                    end = start + step.cost
                    placed.append(Placed(step, p, start, end, times))
                    for name in step.arrives:
                        arrivals.setdefault((name, key(name, p)), []).append(end)
                    clock[lane] = end
                    todo[lane].pop(0)
                    progress = True
                    continue
                break
    stuck = {lane: todo[lane][0][0].label for lane in LANES if todo[lane]}
    if stuck:
        raise RuntimeError(f"the timeline deadlocks: waiting forever at {stuck}")
    return placed


# ----------------------------------------------------------------------------------------------
# Figures of the pipeline
# ----------------------------------------------------------------------------------------------

_KIND_COLORS = {
    "copy": "#8fbc8f",
    "mma": "#6a9fd8",
    "softmax": "#f2a65a",
    "exchange": "#c39bd3",
    "sync": "#bbbbbb",
}
_PAIR_HATCH = ("", "//", "..", "xx")
_MBARRIER_COLOR = "#aa3333"
_NAMED_COLOR = "#1f5fa8"


def _arrow(ax, src, dst, color, *, rad=0.0, scale=8, lw=0.8, ls="-"):
    """An arrow from ``src`` to ``dst`` (data coordinates), curved by ``rad``."""
    ax.add_patch(
        FancyArrowPatch(src, dst, arrowstyle="-|>", mutation_scale=scale, lw=lw, ls=ls,
                        color=color, connectionstyle=f"arc3,rad={rad}")
    )  # fmt: skip


# The drawing's least box width (in step units): wide enough for a box's number at 7 points.
_MIN_DRAWN = 0.9


def timeline_figure(pairs: int = 2, *, arrows: bool = True) -> Figure:
    """Swimlanes of one work item of ``pairs`` pairs: a numbered box per step (colour = kind,
    hatching = pair) and an arrow from each arrival to the wait it releases (red: an mbarrier;
    blue dashed: a named barrier). The key under the lanes says, per partition and number,
    what the step does and which barriers it waits on. The x axis is the order of events
    (boxes are drawn at least wide enough for their number): a schedule, not measured time."""
    from dataclasses import replace as _replace

    drawn = tuple(_replace(st, cost=max(st.cost, _MIN_DRAWN)) for st in TIMELINE)
    placed = schedule(pairs, drawn)
    fig = Figure(figsize=(9.4, 2.0 + 0.55 * len(LANES) + 0.13 * (len(placed) / len(LANES) + 2)))
    gs = fig.add_gridspec(2, 1, height_ratios=[0.9 * len(LANES), 0.13 * (len(placed) / len(LANES)
                                                                          + 2)])  # fmt: skip
    ax = fig.add_subplot(gs[0])
    keyax = fig.add_subplot(gs[1])
    keyax.axis("off")
    row = {lane: len(LANES) - 1 - i for i, lane in enumerate(LANES)}
    ends = {}
    order = sorted(placed, key=lambda p: (p.start, row[p.step.lane] * -1))
    number = {id(p): i + 1 for i, p in enumerate(order)}
    keys: dict[str, list[str]] = {lane: [] for lane in LANES}
    for pl in order:
        y = row[pl.step.lane]
        ax.add_patch(
            Rectangle(
                (pl.start, y - 0.32), pl.end - pl.start, 0.64,
                facecolor=_KIND_COLORS[pl.step.kind], edgecolor="#333333", lw=0.6,
                hatch=_PAIR_HATCH[(pl.pair + pl.step.ahead) % len(_PAIR_HATCH)]
                if pl.step.when != "end" else "",
                zorder=2,
            )
        )  # fmt: skip
        n = number[id(pl)]
        ax.text((pl.start + pl.end) / 2, y, str(n), ha="center", va="center", fontsize=7,
                zorder=4, bbox={"boxstyle": "round,pad=0.12", "fc": "white", "ec": "none",
                                "alpha": 0.85})  # fmt: skip
        waits = ", ".join(name for name, _, _ in pl.waited)
        text = f"{n:>2} {pl.step.label}" + (f"  [waits {waits}]" if waits else "")
        keys[pl.step.lane].append("\n   ".join(textwrap.wrap(text, 44)))
        for name in pl.step.arrives:
            b = _BY_NAME[name]
            ends[(name, pl.pair if b.per == "pair" else 0, pl.step.lane)] = (pl.end, y)
    if arrows:
        for pl in placed:
            y = row[pl.step.lane]
            for name, k, _ in pl.waited:
                for src_lane in _BY_NAME[name].arrived_by:
                    src = ends.get((name, k, src_lane))
                    if src is None or src[1] == y:
                        continue
                    x0, y0 = src
                    y1 = y + (0.32 if y0 > y else -0.32)
                    y0 = y0 + (-0.32 if y0 > y else 0.32)
                    named = _BY_NAME[name].kind == "named"
                    color = _NAMED_COLOR if named else _MBARRIER_COLOR
                    _arrow(ax, (x0, y0), (pl.start, y1), color, rad=0.08, scale=7, lw=0.7,
                           ls="--" if named else "-")  # fmt: skip
    ax.set_yticks([row[lane] for lane in LANES], [_lane_label(lane) for lane in LANES],
                  fontsize=7)  # fmt: skip
    ax.set_xlim(0, max(p.end for p in placed) + 0.2)
    ax.set_ylim(-0.6, len(LANES) - 0.4)
    ax.set_xticks([])
    ax.set_xlabel("order of events, left to right (box widths are schematic, not time)",
                  fontsize=7)  # fmt: skip
    handles = [Rectangle((0, 0), 1, 1, facecolor=c, edgecolor="#333333", lw=0.6)
               for c in _KIND_COLORS.values()]  # fmt: skip
    handles += [Line2D([], [], color=_MBARRIER_COLOR, lw=1.2),
                Line2D([], [], color=_NAMED_COLOR, lw=1.2, ls="--")]  # fmt: skip
    labels = [*_KIND_COLORS, "mbarrier hand-off", "named barrier"]
    ax.legend(handles, labels, fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 1.0),
              ncol=len(labels), frameon=False, handlelength=1.4, columnspacing=0.9)  # fmt: skip
    fig.suptitle(f"one work item (64 heads of one token), {pairs} pairs of KV tiles; "
                 "hatching = pair", fontsize=9)  # fmt: skip
    for i, lane in enumerate(LANES):
        keyax.text(i / len(LANES), 1.0, f"{lane}\n" + "\n".join(keys[lane]), fontsize=7,
                   va="top", ha="left", family="monospace", transform=keyax.transAxes)  # fmt: skip
    fig.tight_layout()
    return fig


def _lane_label(lane: str) -> str:
    p = next(p for p in PARTITIONS if p.name == lane)
    return f"{lane}\n({p.inspect_name}, {p.function})"


def buffers_figure(resources: Any | None = None) -> Figure:
    """The three partitions and the shared-memory buffers they share: Q resident, the two KV
    tile buffers in halves (the four ring slots, numbered in the producer's gather order), the
    P buffers (each consumer's P for the other, then its output blocks on their way out by
    TMA); arrows show who writes and who reads each."""
    regs = partition_registers(resources) if resources is not None else {}
    bufs = {b.var: b for b in smem_buffers()}
    fig = Figure(figsize=(13, 6))
    ax = fig.add_subplot(1, 1, 1)
    ax.set_xlim(0, 13)
    ax.set_ylim(0, 7.4)
    ax.axis("off")
    part_y = {PRODUCER: 6.0, C0: 3.6, C1: 1.2}
    for p in PARTITIONS:
        y = part_y[p.name]
        extra = f"\n{regs[p.name][0]} warps x {regs[p.name][1]} regs" if p.name in regs else ""
        ax.add_patch(Rectangle((0.2, y - 0.55), 3.0, 1.1, fc="#f5f5f5", ec="#333333"))
        ax.text(
            1.7,
            y,
            f"{p.name} ({p.inspect_name})\n{p.does}{extra}",
            ha="center",
            va="center",
            fontsize=7.5,
        )
    half_cols = hopper_ws.HALF.value
    # Q, resident for the whole work item
    ax.add_patch(Rectangle((5.0, 6.0), 6.0, 0.8, fc="#dfe9f5", ec="#333333"))
    ax.text(
        8.0,
        6.4,
        f"Q [{hopper_ws.BLOCK_H.value}, {hopper_ws.HEAD_DIM.value}] resident "
        f"({_kib(bufs['q_smem'].nbytes)}), Q_READY / Q_FREE",
        ha="center",
        va="center",
        fontsize=8,
    )
    order = gather_order()
    slot_xy = {}
    for b, y in ((0, 4.2), (1, 2.6)):
        for h, x in (("L", 5.0), ("R", 8.0)):
            name = f"{b}{h}"
            slot_xy[name] = (x, y)
            reader = C0 if h == "L" else C1  # the consumer that owns O[:, those columns]
            ax.add_patch(Rectangle((x, y), 3.0, 1.0, fc="#e6f2e6", ec="#333333"))
            lo = 0 if h == "L" else half_cols
            ax.text(
                x + 1.5,
                y + 0.5,
                f"KV buf {b} half {h} = D[{lo}:{lo + half_cols}]\n"
                f"gather #{order.index(name) + 1} of a pair; READY {name} / FREE {name}\n"
                f"S of consumer {b}, PV of {reader}",
                ha="center",
                va="center",
                fontsize=7,
            )
    ax.text(11.1, 4.7, f"tile {0}: even\n(S by consumer 0)", fontsize=7, va="center")
    ax.text(11.1, 3.1, f"tile {1}: odd\n(S by consumer 1)", fontsize=7, va="center")
    out_block = hopper_ws.OUT_BLOCK.value
    for i, (name, x) in enumerate((("P0", 5.0), ("P1", 8.0))):
        ax.add_patch(Rectangle((x, 0.75), 3.0, 1.1, fc="#efe3f5", ec="#333333"))
        ax.text(
            x + 1.5,
            1.3,
            f"{name} [{hopper_ws.BLOCK_H.value}, {hopper_ws.BLOCK_K.value}] "
            f"({_kib(bufs[f'p{i}_smem'].nbytes)})\nwritten by consumer {i}, read by "
            f"consumer {1 - i};\nnamed barrier {name}. Epilogue: consumer {i}'s O half\n"
            f"out in {half_cols // out_block} blocks [{hopper_ws.BLOCK_H.value}, "
            f"{out_block}] through it (16-byte stores)",
            ha="center",
            va="center",
            fontsize=6.5,
        )
    named = ", ".join(f"{b.name} ({b.id})" for b in NAMED_BARRIERS)
    vecs = bufs["m0_smem"].nbytes + bufs["m1_smem"].nbytes
    ax.text(
        5.0,
        0.3,
        f"+ the row maxima m0, m1 ({_kib(vecs)}), the partial sums "
        f"({_kib(bufs['l_smem'].nbytes)}) and {hopper_ws.NUM_BARS.value} mbarriers "
        f"({bufs['bars'].nbytes} B);\nthe consumers meet on named barriers {named}: "
        "hardware, no shared memory",
        fontsize=7,
        va="center",
    )
    for i, name in enumerate(order):
        x, y = slot_xy[name]
        _arrow(ax, (3.2, 6.0), (x + 0.2 + 0.15 * i, y + 1.0), "#2e7d32", rad=-0.1)
    _arrow(ax, (3.2, 6.2), (5.0, 6.4), "#2e7d32")
    for lane, dst in ((C0, (5.0, 1.3)), (C1, (8.0, 1.1))):
        _arrow(ax, (3.2, part_y[lane]), dst, "#7b1fa2", rad=0.1)
    ax.set_title(
        "partitions and shared memory (green: cp.async by the producer; purple: P and "
        "output stores by the consumers)",
        fontsize=9,
    )
    fig.tight_layout()
    return fig


def split_figure(num_tiles: int = 8) -> Figure:
    """How the consumers split the work: S by tile (even -> consumer 0, odd -> consumer 1) and
    O by columns (consumer 0: D[0:256], consumer 1: D[256:512]), each with every tile's P."""
    bk, hd, half = hopper_ws.BLOCK_K.value, hopper_ws.HEAD_DIM.value, hopper_ws.HALF.value
    colors = {C0: "#6a9fd8", C1: "#f2a65a"}
    fig = Figure(figsize=(12, 3.2))
    ax1 = fig.add_subplot(1, 2, 1)
    for t in range(num_tiles):
        who = C0 if t % 2 == 0 else C1
        ax1.add_patch(
            Rectangle((t * bk, 0), bk, hopper_ws.BLOCK_H.value, fc=colors[who], ec="white")
        )
        ax1.text(
            t * bk + bk / 2,
            hopper_ws.BLOCK_H.value / 2,
            f"tile {t}\npair {t // 2}",
            ha="center",
            va="center",
            fontsize=7,
        )
    ax1.set_xlim(0, num_tiles * bk)
    ax1.set_ylim(hopper_ws.BLOCK_H.value, 0)
    ax1.set_xlabel(f"slots of the token ({bk} a tile)")
    ax1.set_ylabel("heads")
    ax1.set_title(
        f"S = Q K^T: [{hopper_ws.BLOCK_H.value}, {bk}] per tile, even tiles consumer "
        "0, odd tiles consumer 1",
        fontsize=8,
    )
    ax2 = fig.add_subplot(1, 2, 2)
    for who, lo in ((C0, 0), (C1, half)):
        ax2.add_patch(Rectangle((lo, 0), half, hopper_ws.BLOCK_H.value, fc=colors[who], ec="white"))
        ax2.text(
            lo + half / 2,
            hopper_ws.BLOCK_H.value / 2,
            f"{who}\nO[:, {lo}:{lo + half}] fp32\n+= P_own (regs) V + P_other (smem) V",
            ha="center",
            va="center",
            fontsize=7,
        )
    ax2.set_xlim(0, hd)
    ax2.set_ylim(hopper_ws.BLOCK_H.value, 0)
    ax2.set_xlabel("output columns D")
    ax2.set_title(
        f"O = P V: [{hopper_ws.BLOCK_H.value}, {half}] per consumer, every tile's P", fontsize=8
    )
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------------
# Consistency with the kernel's source
# ----------------------------------------------------------------------------------------------


def _fn_tree(name: str) -> ast.FunctionDef:
    fn = getattr(hopper_ws, name)
    src = textwrap.dedent(pyinspect.getsource(getattr(fn, "fn", fn)))
    tree = ast.parse(src)
    node = tree.body[0]
    assert isinstance(node, ast.FunctionDef), name
    return node


def _value(node: ast.expr) -> int:
    """An int expression of hopper_ws constants (``READY + 3``, ``HALF``, ``0``)."""
    names = {
        n.id: int(getattr(hopper_ws, n.id).value) for n in ast.walk(node) if isinstance(n, ast.Name)
    }
    return int(eval(compile(ast.Expression(node), "<hopper_ws>", "eval"), {}, names))


def _calls(fn: ast.FunctionDef) -> list[ast.Call]:
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call)]
    return sorted(calls, key=lambda c: (c.lineno, c.col_offset))


def _callee(c: ast.Call) -> str:
    return ast.unparse(c.func)


def _bar(node: ast.expr) -> int | None:
    """The slot of ``_bar(bars, <expr>)`` (the kernel's mbarrier by number), else None."""
    if isinstance(node, ast.Call) and _callee(node) == "_bar" and len(node.args) == 2:
        return _value(node.args[1])
    return None


def kernel_partitions() -> list[str]:
    """The partition functions of ``_prefill_ws_kernel`` in ``gl.warp_specialize`` order."""
    for c in _calls(_fn_tree("_prefill_ws_kernel")):
        if _callee(c) == "gl.warp_specialize":
            return [ast.unparse(t.elts[0]) for t in c.args[0].elts]
    raise RuntimeError("_prefill_ws_kernel has no gl.warp_specialize call")


def kernel_gathers() -> list[tuple[str, int, int]]:
    """(ring slot, FREE slot waited before it, READY slot arrived after it) of each
    ``_gather_half`` call in ``_producer``'s source, in source order."""
    events: list[tuple[str, Any]] = []
    for c in _calls(_fn_tree("_producer")):
        name = _callee(c)
        if name == "mbarrier.wait" and _bar(c.args[0]) is not None:
            events.append(("wait", _bar(c.args[0])))
        elif name == "cp.mbarrier_arrive" and _bar(c.args[0]) is not None:
            events.append(("arrive", _bar(c.args[0])))
        elif name == "_gather_half":
            dst = c.args[0]  # kv_smem.index(B).slice(COL0, HALF, dim=1)
            buf = _value(dst.func.value.args[0])
            col0 = _value(dst.args[0])
            if col0 != _value(c.args[4]):
                raise RuntimeError(f"gather into columns {col0} copies from {ast.unparse(c)}")
            events.append(("gather", f"{buf}{'L' if col0 == 0 else 'R'}"))
    out = []
    for i, (op, what) in enumerate(events):
        if op == "gather":
            before, after = events[i - 1], events[i + 1]
            if before[0] != "wait" or after[0] != "arrive":
                raise RuntimeError(f"gather {what} is not between a wait and an arrival")
            out.append((what, before[1], after[1]))
    return out


def source_events(function: str) -> list[tuple[str, str]]:
    """(op, barrier name) of one partition function in source order: ``mbarrier.wait`` and the
    arrivals (``_arrive``, ``cp.mbarrier_arrive``, ``mbarrier.expect``), the waits inside
    ``_qk`` / ``_qk_half`` (READY of the half or halves they read), the named
    barriers (``_bar_sync(NB_X)``: arrive at X, then wait on it; ``_bar_arrive(NB_X)``: arrive
    only) and, for a call of ``_epilogue``, ``_load_q``, ``_begin_item`` or ``_consumer1_pv``,
    the events of that function's own source."""
    by_slot = {b.slot: b.name for b in MBARRIERS}
    by_id = {b.id: b.name for b in NAMED_BARRIERS}
    out: list[tuple[str, str]] = []
    for c in _calls(_fn_tree(function)):
        name = _callee(c)
        if name == "mbarrier.wait" and _bar(c.args[0]) is not None:
            out.append(("wait", by_slot[_bar(c.args[0])]))
        elif (
            name in ("_arrive", "cp.mbarrier_arrive", "mbarrier.expect")
            and _bar(c.args[0]) is not None
        ):  # an expect is an arrival whose phase also waits for its TMA bytes
            out.append(("arrive", by_slot[_bar(c.args[0])]))
        elif name == "_qk":  # (q, kv, bars, first_half, ready0, ph)
            first, ready0 = _value(c.args[3]), _value(c.args[4])
            out += [("wait", by_slot[ready0 + first]), ("wait", by_slot[ready0 + 1 - first])]
        elif name == "_qk_half":  # (q, kv, bars, half, ready0, ph, s, use_acc)
            out.append(("wait", by_slot[_value(c.args[4]) + _value(c.args[3])]))
        elif name == "_bar_sync":  # (bar_id): bar.sync arrives, then waits
            bar = by_id[_value(c.args[0])]
            out += [("arrive", bar), ("wait", bar)]
        elif name == "_bar_arrive":  # (bar_id): bar.arrive, no wait
            out.append(("arrive", by_id[_value(c.args[0])]))
        elif name in ("_epilogue", "_load_q", "_begin_item", "_consumer1_pv"):
            out += source_events(name)
    return out


# ----------------------------------------------------------------------------------------------
# Register and shared-memory budget
# ----------------------------------------------------------------------------------------------

_BUFFER_NAMES = {
    "q_smem": "Q",
    "kv_smem": "KV tiles",
    "p0_smem": "P0 / out stage",
    "p1_smem": "P1 / out stage",
    "m0_smem": "row max 0",
    "m1_smem": "row max 1",
    "l_smem": "partial sums",
    "bars": "mbarriers",
}
_ELEM_BYTES = {"dtype": 2, "gl.float32": 4, "gl.int64": 8, "gl.int32": 4}


@dataclass(frozen=True)
class Buffer:
    name: str
    var: str
    shape: tuple[int, ...]
    elem_bytes: int

    @property
    def nbytes(self) -> int:
        n = self.elem_bytes
        for d in self.shape:
            n *= d
        return n


def smem_buffers(elem_bytes: int = 2) -> list[Buffer]:
    """The kernel's ``gl.allocate_shared_memory`` calls (from the source of ``_shared_state``,
    which ``_prefill_ws_kernel`` calls for its shared memory), shaped by hopper_ws's constants;
    ``elem_bytes`` for the q/kv dtype (2: bf16/fp16)."""
    out = []
    for node in ast.walk(_fn_tree("_shared_state")):
        if not isinstance(node, ast.Assign):
            continue
        # One allocation, or a tuple of allocations of one dtype (the mbarriers, one allocation
        # per role): counted as one buffer whose first dimension is the sum of theirs.
        calls = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
        if not all(isinstance(c, ast.Call) and _callee(c) == "gl.allocate_shared_memory"
                   for c in calls):  # fmt: skip
            continue
        var = ast.unparse(node.targets[0])
        dtype = ast.unparse(calls[0].args[0])
        size = elem_bytes if dtype == "dtype" else _ELEM_BYTES[dtype]
        shapes = [tuple(_value(d) for d in c.args[1].elts) for c in calls]
        dims = (sum(sh[0] for sh in shapes), *shapes[0][1:])
        out.append(Buffer(_BUFFER_NAMES.get(var, var), var, dims, size))
    return out


def partition_registers(resources: Any) -> dict[str, tuple[int, int]]:
    """{partition role: (warps, registers per thread)} from ``inspect.Resources.partitions``."""
    if not resources.partitions:
        raise ValueError("these resources have no partitions: not a warp-specialised kernel")
    got = {name: (w, r) for name, w, r in resources.partitions}
    return {p.name: got[p.inspect_name] for p in PARTITIONS}


def budget_table(resources: Any) -> list[list[Any]]:
    """Rows (what, bytes or registers, limit, fraction) of the register and shared budget."""
    regs = partition_registers(resources)
    rows: list[list[Any]] = []
    for name, (w, r) in regs.items():
        rows.append([f"registers: {name} ({w} warps x 32 x {r})", w * 32 * r, REGISTER_FILE, None])
    total = sum(w * 32 * r for w, r in regs.values())
    rows.append(["registers: all partitions", total, REGISTER_FILE, f"{total / REGISTER_FILE:.0%}"])
    bufs = smem_buffers()
    for b in bufs:
        rows.append([f"shared: {b.name} {list(b.shape)}", b.nbytes, SMEM_LIMIT, None])
    scratch = resources.shared_bytes - sum(b.nbytes for b in bufs)
    rows.append(["shared: compiler scratch (the rest)", scratch, SMEM_LIMIT, None])
    rows.append(
        [
            "shared: all",
            resources.shared_bytes,
            SMEM_LIMIT,
            f"{resources.shared_bytes / SMEM_LIMIT:.1%}",
        ]
    )
    return rows


def _kib(n: float) -> str:
    kib = n / 1024
    return f"{kib:.0f} KiB" if kib == int(kib) else f"{kib:.1f} KiB"


def budget_figure(resources: Any) -> Figure:
    """Registers per partition x threads against the 65,536-register file, and shared memory by
    buffer (the rest of ``shared_bytes`` is the compiler's scratch) against 227 KiB."""
    regs = partition_registers(resources)
    bufs = smem_buffers()
    fig = Figure(figsize=(12, 3.4))
    colors = {C0: "#6a9fd8", C1: "#f2a65a", PRODUCER: "#8fbc8f"}
    ax = fig.add_subplot(1, 2, 1)
    left = 0
    for name, (w, r) in regs.items():
        n = w * 32 * r
        ax.barh(0, n, left=left, color=colors[name], edgecolor="white")
        ax.text(
            left + n / 2,
            0,
            f"{name}\n{w * 32} thr x {r}\n= {n}",
            ha="center",
            va="center",
            fontsize=7,
        )
        left += n
    ax.axvline(REGISTER_FILE, color="#aa3333", ls="--")
    ax.text(
        REGISTER_FILE,
        0.45,
        f" register file {REGISTER_FILE}",
        color="#aa3333",
        fontsize=7,
        ha="right",
    )
    ax.set_xlim(0, REGISTER_FILE * 1.05)
    ax.set_yticks([])
    ax.set_xlabel("32-bit registers of the SM (setmaxnreg per partition)")
    ax.set_title(f"registers: {left} of {REGISTER_FILE} ({left / REGISTER_FILE:.0%})", fontsize=9)
    ax = fig.add_subplot(1, 2, 2)
    pieces = [(b.name, b.nbytes) for b in bufs]
    pieces.append(("scratch", resources.shared_bytes - sum(b.nbytes for b in bufs)))
    palette = (
        "#dfe9f5",
        "#8fbc8f",
        "#c39bd3",
        "#b58fc9",
        "#f2a65a",
        "#e8c07a",
        "#aa3333",
        "#7f7f7f",
        "#bbbbbb",
    )
    left = 0
    for i, (name, n) in enumerate(pieces):
        ax.barh(0, n, left=left, color=palette[i % len(palette)], edgecolor="white")
        if n > 16 * 1024:  # wide enough for a label
            label = textwrap.fill(name, 9)
            ax.text(left + n / 2, 0, f"{label}\n{_kib(n)}", ha="center", va="center", fontsize=6.5)
        left += n
    small = ", ".join(
        f"{name} {_kib(n) if n >= 1024 else f'{n} B'}" for name, n in pieces if n <= 16 * 1024
    )
    ax.axvline(SMEM_LIMIT, color="#aa3333", ls="--")
    ax.text(SMEM_LIMIT, 0.45, f" limit {_kib(SMEM_LIMIT)}", color="#aa3333", fontsize=7, ha="right")
    ax.set_xlim(0, SMEM_LIMIT * 1.05)
    ax.set_yticks([])
    ax.set_xlabel(textwrap.fill(f"bytes of shared memory (small: {small})", 95), fontsize=7)
    ax.set_title(f"shared memory: {_kib(resources.shared_bytes)} of {_kib(SMEM_LIMIT)}", fontsize=9)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------------
# Measured: the bench CSV and the step log
# ----------------------------------------------------------------------------------------------


def bench_summary(
    path: Path | str, run: str | None = None, workloads: Sequence[str] = WORKLOADS
) -> dict[str, Any]:
    """:func:`sparse_mla.bench.run_summary` of a bench CSV (the latest run unless ``run``),
    restricted to ``workloads``; each gets ``tflops`` per provider and ``matmul_tflops`` (the
    run's measured bf16 matmul rate)."""
    from .. import bench

    summary = bench.run_summary(bench.read_rows(path), run)
    missing = [w for w in workloads if w not in summary["workloads"]]
    if missing:
        raise ValueError(f"run {summary['run']} has no rows for {missing}")
    work = {}
    for name in workloads:
        w = dict(summary["workloads"][name])
        w["tflops"] = {p: w["flops"] / (t * 1e-3) / 1e12 for p, t in w["ms"].items()}
        w["matmul_tflops"] = (
            w["flops"] / (w["matmul_ms"] * 1e-3) / 1e12 if w.get("matmul_ms") else None
        )
        work[name] = w
    return {**summary, "workloads": work}


def bench_table(summary: Mapping[str, Any], providers: Sequence[str] = PROVIDERS) -> list[list]:
    """Rows (workload, provider, ms, TFLOP/s, fraction of the matmul ceiling, time / FlashMLA)."""
    rows = []
    for name, w in summary["workloads"].items():
        peer = w["ms"].get("flashmla")
        for p in providers:
            if p not in w["ms"]:
                continue
            ms, tf = w["ms"][p], w["tflops"][p]
            frac = f"{tf / w['matmul_tflops']:.0%}" if w["matmul_tflops"] else None
            rel = f"{ms / peer:.3f}" if peer else None
            rows.append([name, p, f"{ms:.3f}", f"{tf:.0f}", frac, rel])
    return rows


def bench_figure(summary: Mapping[str, Any], providers: Sequence[str] = PROVIDERS) -> Figure:
    """Per workload: ms (with the matmul floor) and TFLOP/s (with the run's matmul ceiling) of
    each provider, labelled with the fraction of the ceiling."""
    work = summary["workloads"]
    fig = Figure(figsize=(12, 6.4))
    for i, (name, w) in enumerate(work.items()):
        provs = [p for p in providers if p in w["ms"]]
        colors = [provider_color(p) for p in provs]
        ax = fig.add_subplot(2, len(work), i + 1)
        ax.bar(provs, [w["ms"][p] for p in provs], color=colors)
        for x, p in enumerate(provs):
            ax.text(x, w["ms"][p], f"{w['ms'][p]:.2f}", ha="center", va="bottom", fontsize=7)
        if w.get("matmul_ms"):
            ax.axhline(
                w["matmul_ms"],
                ls=":",
                color="#9467bd",
                label=f"matmul floor {w['matmul_ms']:.2f} ms",
            )
            ax.legend(fontsize=7)
        ax.set_ylabel("ms")
        ax.set_title(f"{name} (H={w['H']}, T={w['T']})", fontsize=9)
        ax = fig.add_subplot(2, len(work), len(work) + i + 1)
        ax.bar(provs, [w["tflops"][p] for p in provs], color=colors)
        mm = w.get("matmul_tflops")
        for x, p in enumerate(provs):
            frac = f"\n{w['tflops'][p] / mm:.0%}" if mm else ""
            ax.text(
                x,
                w["tflops"][p],
                f"{w['tflops'][p]:.0f}{frac}",
                ha="center",
                va="bottom",
                fontsize=7,
            )
        if mm:
            ax.axhline(mm, ls=":", color="#9467bd", label=f"bf16 matmul {mm:.0f} TFLOP/s")
            ax.set_ylim(0, mm * 1.2)
            ax.legend(fontsize=7, loc="upper right")
        ax.set_ylabel("TFLOP/s (label: fraction of the matmul ceiling)", fontsize=7)
    commit = (summary.get("commit") or "?")[:7]
    fig.suptitle(
        f"{summary.get('device')}, run {summary.get('run')} at {commit} (torch "
        f"{summary.get('torch')}, Triton {summary.get('triton')})",
        fontsize=9,
    )
    fig.tight_layout()
    return fig


@dataclass
class StepRun:
    """One measured run of the probe log: a step (and ablation variant) with its times."""

    step: int
    title: str
    variant: str | None
    ms: dict[str, dict[str, float]] = field(default_factory=dict)  # workload -> provider -> ms
    matmul_tflops: float | None = None

    @property
    def label(self) -> str:
        return f"{self.step}: {self.title}" + (f" [{self.variant}]" if self.variant else "")

    def ratio(self, workload: str, kernel: str = "gluon_ws", peer: str = "flashmla") -> float:
        return self.ms[workload][kernel] / self.ms[workload][peer]


_STEP = re.compile(r"^## step (\d+): (.*)$")
_VARIANT = re.compile(r"^### (.*)$")
_TIME = re.compile(r"^(H\d+ topk\d+) (\w+): ([\d.]+) ms\b")
_CEIL = re.compile(r"^matmul ceiling ([\d.]+) TFLOP/s")


def read_steps(path: Path | str) -> list[StepRun]:
    """The probe log's runs: per ``## step N: title`` (and each ``### variant`` under it), the
    ``<workload> <provider>: X ms`` lines and the matmul ceiling."""
    runs: list[StepRun] = []
    step: tuple[int, str] | None = None
    for line in Path(path).read_text().splitlines():
        if m := _STEP.match(line):
            step = (int(m.group(1)), m.group(2).strip())
            runs.append(StepRun(*step, None))
        elif (m := _VARIANT.match(line)) and step is not None:
            if runs and runs[-1].step == step[0] and not runs[-1].ms:
                runs.pop()  # the step's header run had no times of its own
            runs.append(StepRun(*step, m.group(1).strip()))
        elif (m := _TIME.match(line)) and runs:
            runs[-1].ms.setdefault(m.group(1), {})[m.group(2)] = float(m.group(3))
        elif (m := _CEIL.match(line)) and runs:
            runs[-1].matmul_tflops = float(m.group(1))
    return [r for r in runs if r.ms]


STEP_FIELDS = ("step", "title", "variant", "workload", "provider", "ms", "matmul_tflops")


def write_steps_csv(runs: list[StepRun], path: Path | str) -> None:
    """``runs`` as tidy CSV rows, one per (run, workload, provider): what notebook 07 reads
    (:func:`read_steps_csv`), written once from a probe's log by ``scripts/steps_csv.py``."""
    with Path(path).open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=STEP_FIELDS)
        w.writeheader()
        for r in runs:
            for workload, by_provider in r.ms.items():
                for provider, ms in by_provider.items():
                    w.writerow({
                        "step": r.step, "title": r.title, "variant": r.variant or "",
                        "workload": workload, "provider": provider, "ms": repr(ms),
                        "matmul_tflops": "" if r.matmul_tflops is None else repr(r.matmul_tflops),
                    })  # fmt: skip


def read_steps_csv(path: Path | str) -> list[StepRun]:
    """The runs of a :func:`write_steps_csv` file, in file order (a run is its consecutive
    rows with the same step, title and variant)."""
    runs: list[StepRun] = []
    with Path(path).open(newline="") as f:
        for row in csv.DictReader(f):
            key = (int(row["step"]), row["title"], row["variant"] or None)
            if not runs or (runs[-1].step, runs[-1].title, runs[-1].variant) != key:
                tf = row["matmul_tflops"]
                runs.append(StepRun(*key, matmul_tflops=float(tf) if tf else None))
            runs[-1].ms.setdefault(row["workload"], {})[row["provider"]] = float(row["ms"])
    return runs


_RUN = re.compile(r"^## run (\d+): (.*)$")
_ROUND = re.compile(r"^\w+ (H\d+ topk\d+) (\S+) round(\d+): ([\d.]+) ms\b")


def read_variant_runs(
    path: Path | str, kernel: str = "gluon_ws", peer: str = "flashmla"
) -> list[StepRun]:
    """The runs of ``experiments/ws_variants_probe.py``'s log (``## run N: what`` headers, then
    ``<kind> <workload> <variant> round<k>: X ms`` lines): one :class:`StepRun` per variant of
    each run (``variant`` its name, ``step`` the run's number), holding the median over the
    rounds of the variant (as ``kernel``) and of ``peer`` in the same run, so that
    :func:`steps_figure` plots variant / peer. Ablation variants (``abl_*``) are included;
    their outputs are not the operator's."""
    runs: list[StepRun] = []
    times: dict[str, dict[str, list[float]]] = {}
    title: tuple[int, str] | None = None
    ceiling: float | None = None

    def flush() -> None:
        if title is None:
            return
        medians = {w: {v: statistics.median(t) for v, t in vs.items()} for w, vs in times.items()}
        names = [v for v in dict.fromkeys(v for vs in times.values() for v in vs) if v != peer]
        for v in names:
            run = StepRun(title[0], title[1], v, matmul_tflops=ceiling)
            for w, m in medians.items():
                if v in m and peer in m:
                    run.ms[w] = {kernel: m[v], peer: m[peer]}
            if run.ms:
                runs.append(run)

    for line in Path(path).read_text().splitlines():
        if m := _RUN.match(line):
            flush()
            title, times, ceiling = (int(m.group(1)), m.group(2).strip()), {}, None
        elif (m := _ROUND.match(line)) and title is not None:
            times.setdefault(m.group(1), {}).setdefault(m.group(2), []).append(float(m.group(4)))
        elif (m := _CEIL.match(line)) and title is not None:
            ceiling = float(m.group(1))
    flush()
    return runs


def steps_figure(
    runs: Sequence[StepRun],
    kernel: str = "gluon_ws",
    peer: str = "flashmla",
    workloads: Sequence[str] | None = None,
) -> Figure:
    """Kernel time / peer time (same run) per step, one marker series per workload; 1.0 is
    the peer."""
    if not runs:
        raise ValueError("no step runs")
    names = workloads or sorted(
        {w for r in runs for w in r.ms}, key=lambda w: int(re.match(r"H(\d+)", w).group(1))
    )
    fig = Figure(figsize=(11, 0.42 * len(runs) + 1.6))
    ax = fig.add_subplot(1, 1, 1)
    ys = list(range(len(runs)))[::-1]
    markers = ("o", "s", "^", "D")
    for i, w in enumerate(names):
        pts = [
            (r.ratio(w, kernel, peer), y)
            for r, y in zip(runs, ys, strict=True)
            if kernel in r.ms.get(w, {}) and peer in r.ms.get(w, {})
        ]
        if not pts:
            continue
        ax.plot(
            [x for x, _ in pts],
            [y for _, y in pts],
            marker=markers[i % len(markers)],
            lw=0.8,
            label=f"{w}",
        )
        for x, y in pts:
            ax.annotate(
                f"{x:.2f}",
                (x, y),
                xytext=(-14 if i % 2 == 0 else 14, 6),
                textcoords="offset points",
                fontsize=6,
                ha="center",
            )
    ax.axvline(1.0, color=provider_color(peer), ls="--", label=f"{peer} (same run)")
    labels, seen = [], set()
    for r in runs:  # a step's later ablation variants name only the variant
        text = r.label if r.step not in seen else f"{r.step}: [{r.variant}]"
        seen.add(r.step)
        labels.append("\n".join(textwrap.wrap(text, 70)))
    ax.set_yticks(ys, labels, fontsize=7)
    ax.set_xlabel(f"{kernel} time / {peer} time, same run")
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("the warp-specialised kernel against FlashMLA, step by step", fontsize=9)
    fig.tight_layout()
    return fig
