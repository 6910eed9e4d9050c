"""The premise of a split ``gluon_ws`` (PERF_NOTES "No cliffs" step 18), measured before writing it.

On whole lists at small T the package's kernels and FlashMLA run one item (a token's 64-head
block) as a chain of ~8.6 us plus ~1.5 us a 64-slot tile, and at H64 T <= 64 leave SMs idle
(64 items on 132 SMs at T = 64). A split of each token's list over S programs, combined on
chip, would run S x the items at 1/S of the tiles. This probe times the first half of that
with the kernel as it is: ``gluon_ws`` on the call whose rows are the S pieces of each token's
list (q repeated S times, the same kv_indices, a new kv_indptr cut at whole tiles), against the
unsplit call and FlashMLA padded, in turns. No combine: the time is the split kernel's lower
bound, the combine's budget is what is left under FlashMLA. Each call is checked against the
fp32 reference (the split call is a valid call of its own: 2T rows, shorter lists).

Prediction (step 18's model): T = 64 H64 27 -> ~16-19 us at S = 2 (128 items), T = 16 H64
(16 items) 25 -> ~12-15 us at S = 4, T = 16 H128 (32 items) 38 -> ~17-21 us at S = 4;
T = 64 H128 (128 items already) no gain at S = 2 (two waves).

    PYTHONPATH=.:.peers python experiments/ws_split_premise.py [TxHxS ...]   # an H200; ~1 min
"""

from __future__ import annotations

import torch
from turns import add_checked, add_flashmla, in_turns, main

from sparse_mla import bench, runtime
from sparse_mla.gluon import mla_gluon

POINTS = [(64, 64, 2), (16, 64, 4), (16, 64, 8), (16, 128, 4), (64, 128, 2), (4, 64, 8)]
TILE = 64  # gluon_ws's slots a tile: pieces are cut at whole tiles


def split_rows(indptr: torch.Tensor, pieces: int) -> torch.Tensor:
    """kv_indptr of the call whose row t * pieces + j is piece j of token t's list (whole
    tiles, the last piece the rest; pieces past a short list are empty)."""
    lo, hi = indptr[:-1].long(), indptr[1:].long()
    per = (hi - lo + pieces - 1) // pieces
    per = (per + TILE - 1) // TILE * TILE
    j = torch.arange(pieces, device=indptr.device)
    starts = torch.minimum(lo[:, None] + j[None, :] * per[:, None], hi[:, None])
    return torch.cat([starts.reshape(-1), hi[-1:]]).to(indptr.dtype)


def point(T: int, H: int, S: int, dev: torch.device, peers: bench.Peers) -> str:
    w = bench.GridPoint("dsv4_csa", T, H, bench._grid_topk(H), context=65536).build(
        dev, seed=0, sink=True, big_buffer=True
    )
    q, kv, idx, indptr, scale = w.args()
    kv = kv[:, 0, :] if kv.dim() == 3 else kv
    q_s = q.repeat_interleave(S, dim=0)
    indptr_s = split_rows(indptr, S)
    calls = {
        "ws": (q, indptr),
        f"ws_rows_x{S}": (q_s, indptr_s),
    }
    fns, names = [], []
    for name, (qq, ptr) in calls.items():

        def run(o, qq=qq, ptr=ptr):
            return mla_gluon(qq, None, kv, None, idx, ptr, scale, has_pe=False,
                             attn_sink=w.attn_sink, out=o, kernel="gluon_ws")  # fmt: skip

        bad = add_checked(name, run, (qq, kv, idx, ptr, scale), w.attn_sink, fns, names)
        if bad:
            return f"T={T:5d} H={H:3d} S={S}: {name} WRONG ({bad})"
    fns.append(lambda: q.repeat_interleave(S, dim=0))
    names.append("q_repeat")
    add_flashmla(w, dev, peers, q, fns, names)
    items = T * runtime.cdiv(H, 64)
    head = f"T={T:5d} H={H:3d} S={S} ({items} -> {items * S} items)"
    return in_turns(head, fns, names, lambda n: n.startswith("ws"))


if __name__ == "__main__":
    main(point, POINTS)
