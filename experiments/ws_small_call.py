"""``gluon_ws_small`` with and without its small-call order (the ids prefetched into L2), in turns.

Since abc70a7 the heads-on-N kernel takes ``SMALL`` as ``gluon_ws`` does (a program's share of
kv_indices asked of L2 before its first kv_indptr range load) when the launcher's
``hopper_ws.small_call`` says the call is small. Prediction: -0.1..-0.4 us at T = 64 and 256,
H <= 48 (the ids' load after kv_indptr becomes an L2 hit); T >= 1024 is not small and runs the
large-call kernel. Here, at the grid's small points (DSv4 CSA top-k 512 + window 128), both
orders of the same kernel (the module's ``small_call`` forced True / False around each call,
through ``mla_gluon``, which decides SMALL per call) and FlashMLA padded to 64 heads are
checked against the fp32 reference and timed in turns (``bench.time_interleaved``, balanced
orders, 8 rounds).

    PYTHONPATH=.:.peers python experiments/ws_small_call.py     # an H200; ~1 min
"""

from __future__ import annotations

import sys

import torch
from turns import add_flashmla

from sparse_mla import bench
from sparse_mla.gluon import hopper_ws, hopper_ws_small, mla_gluon

POINTS = [(T, H) for T in (64, 256) for H in (1, 8, 12, 16, 24, 32, 40, 48)]


def _order(small: bool):
    def fn(nnz, programs):
        return small and hopper_ws.small_call(nnz, programs)

    return fn


def point(T: int, H: int, dev: torch.device, peers: bench.Peers) -> str:
    w = bench.GridPoint("dsv4_csa", T, H, bench._grid_topk(H)).build(
        dev, seed=0, sink=True, big_buffer=True
    )
    q, kv, idx, indptr, scale = w.args()
    kv = kv[:, 0, :] if kv.dim() == 3 else kv
    refs = bench._References(w, 256)
    out = torch.empty_like(q)
    fns, names = [], []
    for small in (True, False):

        def run(o, small=small):
            hopper_ws_small.small_call = _order(small)
            return mla_gluon(q, None, kv, None, idx, indptr, scale, has_pe=False,
                             attn_sink=w.attn_sink, out=o, kernel="gluon_ws_small")  # fmt: skip

        ok, _rel, note = bench._check(run, w, 256, refs)
        if not ok:
            raise SystemExit(f"T={T} H={H} small={small}: wrong ({note})")
        fns.append(lambda run=run: run(out))
        names.append("small" if small else "large")
    add_flashmla(w, dev, peers, q, fns, names, refs=refs, out=out)
    ms = bench.time_interleaved(fns, 40.0, rounds=8)
    hopper_ws_small.small_call = hopper_ws.small_call
    us = dict(zip(names, (m * 1e3 for m in ms), strict=True))
    line = f"T={T:5d} H={H:3d} nnz={idx.numel():7d}: " + "  ".join(
        f"{n} {v:.2f} us" for n, v in us.items())  # fmt: skip
    line += f"  small-large {us['small'] - us['large']:+.2f} us"
    fl = next((v for n, v in us.items() if n.startswith("flashmla")), None)
    if fl:
        line += f"  small/flashmla {us['small'] / fl:.3f}"
    return line


def main() -> None:
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    peers = bench.Peers()
    pts = POINTS if len(sys.argv) < 2 else [tuple(map(int, a.split("x"))) for a in sys.argv[1:]]
    for T, H in pts:
        print(point(T, H, dev, peers), flush=True)


if __name__ == "__main__":
    main()
