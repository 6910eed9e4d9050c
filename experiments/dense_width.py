"""Dense ids of an engine's fixed width with their rows' lengths, on a short context.

An engine's top-k matrix is [T, K] with K its top-k + window whatever the context (FlashMLA's
``indices`` with ``topk_length``). Below the entry a split kernel's split count sees T x K ids,
not the lengths (no host sync), so a small call on a short context may split lists that its
CSR form would not. At each (T, H, context) this times, in turns (8 rounds), each checked
against the fp32 reference first: ``config=None`` on the CSR lists, on the dense ids padded to
the engine's width (top-k + 128) with ``kv_lengths``, without and with ``max_kv_length`` (the
longest list, as an engine knows it), on the same ids padded only to the longest list (rounded
up to 128, as the bench's dense providers pad), and FlashMLA padded.

    PYTHONPATH=.:.peers python experiments/dense_width.py [TxHxCONTEXT ...]   # an H200
"""

from __future__ import annotations

import torch
from turns import add_checked, add_flashmla, in_turns, main

from sparse_mla import bench, dispatch, validation
from sparse_mla.gluon import launch
from sparse_mla.prefill import sparse_mla_prefill

POINTS = [(T, H, c) for c in (256, 1024) for H in (16, 64, 128) for T in (1, 4, 16)]


def _padded(dense: torch.Tensor, width: int) -> torch.Tensor:
    out = torch.full((dense.shape[0], width), -1, dtype=dense.dtype, device=dense.device)
    out[:, : dense.shape[1]] = dense
    return out


def point(T: int, H: int, context: int, dev: torch.device, peers: bench.Peers) -> str:
    topk = bench._grid_topk(H)
    w = bench.GridPoint("dsv4_csa", T, H, topk, context=context).build(
        dev, seed=0, sink=True, big_buffer=True
    )
    q, kv, idx, indptr, scale = w.args()
    kv2 = kv[:, 0, :] if kv.dim() == 3 else kv
    tight, n = bench._dense_topk(idx, indptr, kv2.shape[0], 128)
    wide = _padded(tight, topk + 128)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    fns, names = [], []
    kernels = {}
    longest = int(n.max())
    for name, ids, ptr, lens, m in (
        ("csr", idx, indptr, None, None),
        (f"dense{wide.shape[1]}_len", wide, None, n, None),
        (f"dense{wide.shape[1]}_len_max", wide, None, n, longest),
        (f"dense{tight.shape[1]}_len", tight, None, n, None),
    ):
        # what the entry's choice and split count see
        nnz = validation.planned_nnz(ids, None if m is None else validation.length_bound(m, ids, n))
        k = dispatch.choose(dispatch.Call("sm90", H, q.shape[2], q.dtype, kv2, T, nnz)).kernel
        kernels[name] = k + (f" x{launch.ws_num_splits(T, H, nnz, sms)}" if k == "gluon_ws" else "")

        def run(o, ids=ids, ptr=ptr, lens=lens, m=m):
            return sparse_mla_prefill(q, kv, ids, ptr, scale, attn_sink=w.attn_sink, out=o,
                                      kv_lengths=lens, max_kv_length=m)  # fmt: skip

        bad = add_checked(name, run, (q, kv, idx, indptr, scale), w.attn_sink, fns, names)
        if bad:
            return f"T={T:5d} H={H:3d} ctx={context}: {name} WRONG ({bad})"
    add_flashmla(w, dev, peers, q, fns, names)
    head = f"T={T:5d} H={H:3d} ctx={context:5d} (lists <= {longest}) {kernels or ''}"
    return in_turns(head, fns, names, lambda n: True)


if __name__ == "__main__":
    main(point, POINTS)
