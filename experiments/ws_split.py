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

``WS_SPLIT_CONTEXT`` (default 65536) sets the context (1024: the middling lists, about 384
slots a token), ``WS_SPLIT_EXTRA`` the forced counts (default "2,4").
"""

from __future__ import annotations

import os

import torch
from turns import add_checked, add_flashmla, in_turns, main

from sparse_mla import bench, runtime
from sparse_mla.gluon import launch, mla_gluon
from sparse_mla.prefill import sparse_mla_prefill

POINTS = [(T, H) for H in (40, 64, 96, 128) for T in (1, 2, 4, 8, 16, 32, 64)]
EXTRA = tuple(int(x) for x in os.environ.get("WS_SPLIT_EXTRA", "2,4").split(","))
CONTEXT = int(os.environ.get("WS_SPLIT_CONTEXT", "65536"))


def point(T: int, H: int, dev: torch.device, peers: bench.Peers) -> str:
    w = bench.GridPoint("dsv4_csa", T, H, bench._grid_topk(H), context=CONTEXT).build(
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
        bad = add_checked(name, run, (q, kv, idx, indptr, scale), w.attn_sink, fns, names)
        if bad:
            return f"T={T:5d} H={H:3d}: {name} WRONG ({bad})"
    add_flashmla(w, dev, peers, q, fns, names)
    items = T * runtime.cdiv(H, 64)
    return in_turns(f"T={T:5d} H={H:3d} ({items} items, rule x{rule})", fns, names, lambda n: True)


if __name__ == "__main__":
    main(point, POINTS)
