"""Workload generators: DSv4 length formulas, pool layouts, seeds, big buffer, the registry."""

from __future__ import annotations

import pytest
import torch

from sparse_mla import workloads as wl
from sparse_mla.prefill import sparse_mla_prefill
from sparse_mla.reference import check_against_reference


def _lists(w):
    ptr = w.kv_indptr.long().tolist()
    idx = w.kv_indices.long()
    return [idx[ptr[t] : ptr[t + 1]] for t in range(len(ptr) - 1)]


def _positions(q_lens, context):
    return [context + i for n in q_lens for i in range(n)]


def _requests(q_lens):
    return [r for r, n in enumerate(q_lens) for _ in range(n)]


@pytest.mark.parametrize(
    "T,num_requests,context,topk,ratio,window",
    [
        (50, 3, 0, 4, 4, 16),  # small top-k cap reached inside the prompt
        (40, 2, 100, 8, 4, 16),  # chunk after a context: cap reached from the first token
        (33, 1, 0, 512, 4, 128),  # DSv4 sizes, cap never reached
    ],
)
def test_csa_lengths_and_layout_follow_the_dsv4_formulas(
    T, num_requests, context, topk, ratio, window
):
    w = wl.dsv4_csa(T, 8, D=64, topk=topk, ratio=ratio, window=window,
                    num_requests=num_requests, context=context, seed=3)  # fmt: skip
    m = w.meta
    q_lens = wl._split(T, num_requests)
    M, C = m["pool_block_rows"], m["num_compressed"]
    assert w.kv.shape[0] == M * num_requests == m["pool_rows"]
    assert C + window + max(q_lens) <= M and (context + max(q_lens)) // ratio <= C
    lists = _lists(w)
    for t, (p, r) in enumerate(zip(_positions(q_lens, context), _requests(q_lens), strict=True)):
        n_c = min((p + 1) // ratio, topk)
        n_w = min(p + 1, window)
        assert lists[t].numel() == n_c + n_w, (t, p)
        comp, win = lists[t][:n_c] - r * M, lists[t][n_c:] - r * M
        # Compressed: distinct rows among the (p+1)//ratio visible ones of the request's block.
        assert comp.unique().numel() == n_c
        assert bool(((comp >= 0) & (comp < (p + 1) // ratio)).all())
        if (p + 1) // ratio <= topk:
            assert sorted(comp.tolist()) == list(range(n_c))
        # Window: positions p-n_w+1..p, oldest first, at C + window + (x - first position).
        expect = [C + window + (x - context) for x in range(p - n_w + 1, p + 1)]
        assert win.tolist() == expect
    assert m["nnz"] == w.kv_indices.numel() == sum(x.numel() for x in lists)


def test_hca_sees_every_compressed_row():
    T, ctx = 20, 300
    w = wl.dsv4_hca(T, 16, D=64, window=16, context=ctx, num_requests=2)
    assert w.meta["ratio"] == 128 and w.meta["topk"] is None and w.meta["kind"] == "dsv4_hca"
    q_lens = wl._split(T, 2)
    M = w.meta["pool_block_rows"]
    lists = _lists(w)
    for t, (p, r) in enumerate(zip(_positions(q_lens, ctx), _requests(q_lens), strict=True)):
        n_c = (p + 1) // 128
        assert lists[t].numel() == n_c + min(p + 1, 16)
        assert (lists[t][:n_c] - r * M).tolist() == list(range(n_c))
    with pytest.raises(TypeError, match="topk"):
        wl.dsv4_hca(8, 8, topk=4)


@pytest.mark.parametrize("topk,num_requests", [(64, 2), (5, 1)])
def test_glm_full_topk_over_the_prompt(topk, num_requests):
    T, bs = 40, 8
    w = wl.glm_full_topk(T, 8, D=64, topk=topk, num_requests=num_requests, block_size=bs)
    q_lens = wl._split(T, num_requests)
    # Invert the block table: pool slot -> (request, position).
    owner = {}
    for r, blocks in enumerate(w.meta["block_table"]):
        for j, b in enumerate(blocks):
            for k in range(bs):
                owner[b * bs + k] = (r, j * bs + k)
    assert len(owner) == w.kv.shape[0]  # the blocks tile the pool exactly once
    lists = _lists(w)
    for t, (p, r) in enumerate(zip(_positions(q_lens, 0), _requests(q_lens), strict=True)):
        seen = [owner[s] for s in lists[t].tolist()]
        assert len(seen) == min(p + 1, topk) == len(set(seen))
        assert all(rr == r and x <= p for rr, x in seen)  # its own request, causal
        if p + 1 <= topk:
            assert sorted(x for _, x in seen) == list(range(p + 1))


def test_flashmla_uniform():
    w = wl.flashmla_uniform(16, 8, slots=32, pool=500, D=64, invalid_frac=0.25, seed=1)
    assert torch.equal(w.kv_indptr.long(), torch.arange(17) * 32)
    idx = w.kv_indices.long()
    assert bool(((idx == -1) | ((idx >= 0) & (idx < 500))).all())
    assert 0.1 < float((idx == -1).float().mean()) < 0.4
    assert w.kv.shape == (500, 64)


def test_seeded_and_dtypes():
    a = wl.dsv4_csa(24, 8, D=64, topk=4, seed=5)
    b = wl.dsv4_csa(24, 8, D=64, topk=4, seed=5)
    c = wl.dsv4_csa(24, 8, D=64, topk=4, seed=6)
    for x, y in zip(a.args()[:4], b.args()[:4], strict=True):
        assert torch.equal(x, y)
    assert torch.equal(a.attn_sink, b.attn_sink)
    assert not torch.equal(a.q, c.q) and not torch.equal(a.kv_indices, c.kv_indices)
    w = wl.dsv4_csa(8, 8, D=64, dtype=torch.float16, index_dtype=torch.int64, sink=False)
    assert w.q.dtype == w.kv.dtype == torch.float16 and w.attn_sink is None
    assert w.kv_indices.dtype == w.kv_indptr.dtype == torch.int64
    assert w.softmax_scale == 64**-0.5


def test_big_buffer_places_the_pool_past_2_gib():
    w = wl.dsv4_csa(8, 8, D=64, big_buffer=True)
    assert w.meta["big_buffer"] is True
    assert w.kv.untyped_storage().nbytes() > 2**31
    assert w.kv.storage_offset() * w.kv.element_size() >= 2**31
    assert torch.isfinite(w.kv.float()).all()


def test_workload_feeds_the_kernel():
    w = wl.by_name("csa_h16_topk512", T=10, D=64, num_requests=2, seed=2)
    out = torch.full_like(w.q, float("nan"))
    sparse_mla_prefill(*w.args(), **w.kwargs(), out=out)
    assert check_against_reference(out, *w.args(), **w.kwargs()).ok
    assert w.flops() == 4 * 16 * 64 * w.valid_slots > 0


def test_registry():
    names = wl.standard_names()
    for required in ("csa_h16_topk512", "csa_h128_topk1024", "glm_h16_topk2048", "hca_h64"):
        assert required in names
    for name in names:
        w = wl.by_name(name, T=6, D=16)
        assert w.q.shape[:2] == (6, wl.WORKLOADS[name][1]["H"]) and w.meta["T"] == 6
        assert name in w.name
    assert wl.by_name("csa_h16_topk512", T=4, H=8, D=16).name == "csa_h8_topk512_t4"
    with pytest.raises(ValueError, match="unknown workload"):
        wl.by_name("nope")


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="T must"):
        wl.dsv4_csa(-1, 8)
    with pytest.raises(ValueError, match="H must"):
        wl.glm_full_topk(4, 0)
    with pytest.raises(TypeError, match="dtype"):
        wl.dsv4_csa(4, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match="topk"):
        wl.dsv4_csa(4, 8, topk=0)
    with pytest.raises(ValueError, match="num_requests"):
        wl.dsv4_csa(4, 8, num_requests=5)
