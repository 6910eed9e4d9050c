"""Which kernel should ``config=None`` run at small T with 33-64 heads, now that ``gluon_ws``
writes O by its consumers' own stores (PERF_NOTES "No cliffs" step 46)?

The recorded choice runs ``gluon_ws_small`` (heads on N, two 32-head items a token) at T = 64
with 33-64 heads at every list length, measured when ``gluon_ws`` (one 64-head item a token)
was 1-2% slower there. The grid run after step 46 (bfcf013) reads ``gluon_ws`` 0.7-1.2% faster
at T = 64 H 40 / 48 / 64 on short lists: one run's place noise or a real change. Here, at each
point, ``config=None`` and both kernels forced, timed in turns
(:func:`sparse_mla.bench.time_interleaved`, 8 rounds), each checked against the fp32 reference
first (``turns.add_checked``: NaN-poisoned output); ratios against ``config=None``.

    python experiments/small_t_choice.py                  # an H200; ~2 minutes
    python experiments/small_t_choice.py --points 64:64:512 ctx65536:64:64:512
"""

from __future__ import annotations

import argparse
import itertools

import torch
from turns import add_checked
from ws_bars_ab import parse_point

from sparse_mla import bench, dispatch
from sparse_mla.prefill import sparse_mla_prefill

KERNELS = ("gluon_ws", "gluon_ws_small")


def default_points() -> list[str]:
    """T 48 / 64 / 96 x H 40 / 48 / 64 on short (the grid's), middling and whole lists."""
    lists, tokens, heads = ("", "ctx1024:", "ctx65536:"), (48, 64, 96), (40, 48, 64)
    return [f"{c}{T}:{H}:512" for c, T, H in itertools.product(lists, tokens, heads)]


def point(kind, T, H, topk, context, dev) -> str:
    w = bench.GridPoint(kind, T, H, topk, context).build(dev, seed=0, sink=True, big_buffer=True)
    args = w.args()
    fns, names = [], []
    for cfg, label in ((None, "default"), *((dispatch.Choice(k), k) for k in KERNELS)):

        def run(o, cfg=cfg):
            return sparse_mla_prefill(*args, attn_sink=w.attn_sink, out=o, config=cfg)

        wrong = add_checked(label, run, args, w.attn_sink, fns, names)
        if wrong:
            raise SystemExit(f"{label} at {kind} T={T} H={H}: wrong ({wrong})")
    ms = bench.time_interleaved(fns, 400.0, rounds=8)
    where = f" context {context}" if context else ""
    return f"{kind} T={T} H={H} top-k {topk}{where}: " + "  ".join(
        f"{n} {m * 1e3:.2f} us ({m / ms[0]:.3f})" for n, m in zip(names, ms, strict=True)
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--points", nargs="+", metavar="[ctx<N>:]T:H:TOPK",
                   help="default: T 48/64/96 x H 40/48/64, three list lengths")  # fmt: skip
    a = p.parse_args()
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    for spec in a.points or default_points():
        print(point(*parse_point(spec), dev), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
