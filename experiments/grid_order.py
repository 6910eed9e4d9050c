"""Does a provider's place in the grid's round order move its time at the heavy points?

The grid of e4e0d12 (providers sharing one output buffer) still read ``default`` 3-8% slower
than ``gluon_ws`` forced at every T = 16384 point from 64 heads (H96 7.58 / 7.02 ms), both
running the same kernel with the same launch, while a standalone comparison of the two alone
found no gap (PERF_NOTES, "Timing in turns"). Here the grid's own prepared providers at such a
point (``bench._provider`` + ``bench._check_and_time``, checked against the fp32 reference,
one shared output buffer) are timed with ``bench.time_interleaved`` in several arrangements:

- ``grid``: the grid's order;
- ``swapped``: ``gluon_ws`` and ``default`` trade places;
- ``twice``: the grid's order with a second ``gluon_ws`` timer (the same callable) placed
  right after ``default``;
- ``pair``: ``gluon_ws`` and ``default`` alone.

If the slower one is whichever sits in ``default``'s place (and the second ``gluon_ws`` reads
like ``default``), the gap is the order, not the call.

The rounds run forwards then backwards, as ``time_interleaved`` did when this ran (tenth
session, ``data/bench/grid_order_h200.log``); since then the bench uses balanced orders
(``bench.balanced_orders``), and this script pins the old ones to measure what they did.

    PYTHONPATH=.:.peers python experiments/grid_order.py     # an H200; ~1-2 min
"""

from __future__ import annotations

import sys

import torch

from sparse_mla import bench

POINTS = ((16384, 96), (16384, 64), (16384, 128))


def _forwards_backwards(n: int) -> list[list[int]]:
    """The rounds' orders before balanced ones: forwards, then backwards."""
    return [list(range(n)), list(range(n - 1, -1, -1))]


def point(T: int, H: int, dev: torch.device, peers: bench.Peers) -> None:
    w = bench.GridPoint("dsv4_csa", T, H, bench._grid_topk(H)).build(
        dev, seed=0, sink=True, big_buffer=True
    )
    refs = bench._References(w, 256)
    out = torch.empty_like(w.q)
    timers: dict[str, object] = {}
    for prov in bench.grid_providers():
        try:
            prepared = bench._provider(prov, w, dev, peers)
            res, fn = bench._check_and_time(prepared, w, dev, 256, False, refs=refs,
                                            budget_ms=40.0, defer=True, out=out)  # fmt: skip
        except bench.Unavailable:
            continue
        if fn is None:
            print(f"  {prov}: failed its check ({res.get('note')})", flush=True)
            continue
        timers[prepared.name] = fn
    order = list(timers)
    i, j = order.index("gluon_ws"), order.index("default")
    swapped = list(order)
    swapped[i], swapped[j] = swapped[j], swapped[i]
    twice = [*order[: j + 1], "gluon_ws#2", *order[j + 1 :]]
    timers["gluon_ws#2"] = timers["gluon_ws"]
    arrangements = [
        ("grid", order),
        ("swapped", swapped),
        ("twice", twice),
        ("pair", ["gluon_ws", "default"]),
        ("grid", order),
        ("swapped", swapped),
    ]
    print(f"T={T} H={H}: order {order}", flush=True)
    for label, names in arrangements:
        ms = dict(zip(names, bench.time_interleaved([timers[n] for n in names], 40.0),
                      strict=True))  # fmt: skip
        extra = f"  gluon_ws#2 {ms['gluon_ws#2']:.4f}" if "gluon_ws#2" in ms else ""
        print(f"  {label:8s} gluon_ws {ms['gluon_ws']:.4f}  default {ms['default']:.4f}  "
              f"default/gluon_ws {ms['default'] / ms['gluon_ws']:.3f}{extra}  "
              + "  ".join(f"{n} {m:.3f}" for n, m in ms.items()
                          if n not in ("gluon_ws", "default", "gluon_ws#2")),
              flush=True)  # fmt: skip
    del w, refs, out, timers
    torch.cuda.empty_cache()


def main() -> None:
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    peers = bench.Peers()
    bench.balanced_orders = _forwards_backwards  # this script's rounds (module docstring)
    for T, H in POINTS if len(sys.argv) < 2 else [tuple(map(int, a.split("x"))) for a in
                                                  sys.argv[1:]]:  # fmt: skip
        point(T, H, dev, peers)


if __name__ == "__main__":
    main()
