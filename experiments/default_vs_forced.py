"""Is ``config=None`` slower than the same kernel forced by name at the grid's heavy points?

The grids of 389977b and 7dce362 read ``default`` 3-9% slower than ``gluon_ws`` forced at
T = 16384 with 80-128 heads (and GLM top-k 2048), though both run ``gluon_ws`` with the same
launch (PERF_NOTES, "Timing in turns"). Here, at two such points, four calls timed in turns
(:func:`sparse_mla.bench.time_interleaved`, 8 rounds): ``config=None`` and
``config=Choice("gluon_ws")``, each with the op's plans on and off. If the forced and default
rows agree within ~1% with both plan settings, the grid's gap was measurement; if the plans-on
default alone is slower, a replay launches differently; if both defaults are, the dispatch's
launch differs. Each call is checked against the fp32 reference first (NaN-poisoned output).

    python experiments/default_vs_forced.py      # an H200; ~30 s
    python experiments/default_vs_forced.py --points glm_full_topk:16384:32:2048 \
        dsv4_csa:64:128:1024
"""

from __future__ import annotations

import argparse

import torch

from sparse_mla import bench, dispatch, op
from sparse_mla.prefill import sparse_mla_prefill

POINTS = (("dsv4_csa", 16384, 112, 1024), ("dsv4_csa", 16384, 128, 1024),
          ("glm_full_topk", 16384, 64, 2048))  # fmt: skip


def point(kind: str, T: int, H: int, topk: int, dev: torch.device) -> str:
    w = bench.GridPoint(kind, T, H, topk).build(dev, seed=0, sink=True, big_buffer=True)
    q, kv, idx, indptr, scale = w.args()
    sink = w.attn_sink
    refs = bench._References(w, 256)
    fns, names = [], []
    for plans in (True, False):
        for cfg, label in ((None, "default"), (dispatch.Choice("gluon_ws"), "forced")):

            def run(o, cfg=cfg, plans=plans):
                op.set_plans_enabled(plans)
                return sparse_mla_prefill(q, kv, idx, indptr, scale, attn_sink=sink, out=o,
                                          config=cfg)  # fmt: skip

            ok, _rel, note = bench._check(run, w, 256, refs)
            if not ok:
                raise SystemExit(f"{label} plans={plans}: wrong ({note})")
            out = torch.empty_like(q)
            fns.append(lambda run=run, out=out: run(out))
            names.append(f"{label} plans={'on' if plans else 'off'}")
    ms = bench.time_interleaved(fns, 600.0, rounds=8)
    base = ms[1]
    return f"{kind} T={T} H={H} top-k {topk}: " + "  ".join(
        f"{n} {m:.4f} ({m / base:.3f})" for n, m in zip(names, ms, strict=True))  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--points", nargs="+", metavar="KIND:T:H:TOPK",
                   help="grid points (default: the three heavy ones above)")  # fmt: skip
    a = p.parse_args()
    points = POINTS
    if a.points:
        points = [(k, int(t), int(h), int(n)) for k, t, h, n in (x.split(":") for x in a.points)]
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    for kind, T, H, topk in points:
        print(point(kind, T, H, topk, dev), flush=True)
        torch.cuda.empty_cache()
    op.set_plans_enabled(True)


if __name__ == "__main__":
    main()
