"""``gluon_ws`` with its lists split (PERF_NOTES "No cliffs" step 19), measured on whole lists.

At each (T, H) of the whole-list buckets (context 65536: every list full, CSA top-k 512 +
window 128, top-k 1024 from 96 heads), in turns (8 rounds): ``gluon_ws`` unsplit
(``num_kv_splits=1``), ``gluon_ws`` with its rule's split count (``launch.ws_num_splits``), each
forced count of ``EXTRA`` that differs from both, ``config=None`` as shipped and FlashMLA
padded. Every call is checked against the fp32 reference first.

Prediction (step 19): the split call = the premise's pieces (``ws_split_premise.py``: T = 4 H64
13.0 us, T = 16 H64 16.5, T = 16 H128 22.9) + fp32 partials + the reduce launch (~4-6 us):
T = 4 H64 ~18 us (0.75-0.8 of FlashMLA), T = 16 H64 ~21-22 (~0.9), T = 16 H128 ~28-29 (~0.78);
no gain where the items already fill a quarter of the SMs.

    PYTHONPATH=.:.peers python experiments/ws_split.py [TxH ...]   # an H200
"""

from __future__ import annotations

import sys

import torch

from sparse_mla import bench, reference, runtime
from sparse_mla.gluon import launch, mla_gluon
from sparse_mla.prefill import sparse_mla_prefill

POINTS = [(T, H) for H in (40, 64, 96, 128) for T in (1, 2, 4, 8, 16, 32, 64)]
EXTRA = (2, 4)


def point(T: int, H: int, dev: torch.device, peers: bench.Peers) -> str:
    w = bench.GridPoint("dsv4_csa", T, H, bench._grid_topk(H), context=65536).build(
        dev, seed=0, sink=True, big_buffer=True
    )
    q, kv, idx, indptr, scale = w.args()
    kv2 = kv[:, 0, :] if kv.dim() == 3 else kv
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rule = launch.ws_num_splits(T, H, idx.numel(), sms)
    counts = dict.fromkeys([1, rule, *EXTRA])
    fns, names = [], []

    def gluon_ws(o, s):
        return mla_gluon(q, None, kv2, None, idx, indptr, scale, has_pe=False,
                         attn_sink=w.attn_sink, out=o, kernel="gluon_ws",
                         num_kv_splits=s)  # fmt: skip

    def default(o):
        return sparse_mla_prefill(q, kv, idx, indptr, scale, attn_sink=w.attn_sink, out=o)

    calls = {f"ws_x{s}": (lambda o, s=s: gluon_ws(o, s)) for s in counts}
    calls["default"] = default
    for name, run in calls.items():
        got = run(torch.full_like(q, float("nan")))
        rep = reference.check_against_reference(got, q, kv, idx, indptr, scale,
                                                attn_sink=w.attn_sink)  # fmt: skip
        if not rep.ok:
            return f"T={T:5d} H={H:3d}: {name} WRONG ({rep})"
        scratch = torch.empty_like(q)
        fns.append(lambda run=run, scratch=scratch: run(scratch))
        names.append(name)
    try:
        fm = bench._provider("flashmla", w, dev, peers)
        _res, timer = bench._check_and_time(fm, w, dev, 256, False, budget_ms=40.0, defer=True,
                                           out=torch.empty_like(q))  # fmt: skip
        if timer is not None:
            fns.append(timer)
            names.append(fm.name)
    except bench.Unavailable as e:
        print(f"  flashmla: {e}", flush=True)
    ms = bench.time_interleaved(fns, 40.0, rounds=8)
    us = dict(zip(names, (m * 1e3 for m in ms), strict=True))
    items = T * runtime.cdiv(H, 64)
    line = (f"T={T:5d} H={H:3d} ({items} items, rule x{rule}): "
            + "  ".join(f"{n} {v:.2f}" for n, v in us.items()) + " us")  # fmt: skip
    fl = next((v for n, v in us.items() if n.startswith("flashmla")), None)
    if fl:
        line += "  /flashmla: " + " ".join(
            f"{n} {v / fl:.3f}" for n, v in us.items() if not n.startswith("flashmla"))  # fmt: skip
    return line


def main() -> None:
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton "
          f"{runtime.triton_version()}", flush=True)  # fmt: skip
    peers = bench.Peers()
    pts = POINTS if len(sys.argv) < 2 else [tuple(map(int, a.split("x"))) for a in sys.argv[1:]]
    for T, H in pts:
        print(point(T, H, dev, peers), flush=True)


if __name__ == "__main__":
    main()
