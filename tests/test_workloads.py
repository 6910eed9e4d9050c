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


# ---------------------------------------------------------------------------------------------
# The whole-prompt structure at bench sizes, checked with tensor ops (no per-token loop)
# ---------------------------------------------------------------------------------------------


def _dense(w):
    """[T, L] slot lists padded with -2 (never a slot, never the -1 padding) and lengths [T]."""
    ptr = w.kv_indptr.long()
    lengths = ptr[1:] - ptr[:-1]
    L = int(lengths.max())
    col = torch.arange(L)
    inside = col[None, :] < lengths[:, None]
    pos = torch.where(inside, ptr[:-1, None] + col[None, :], 0)
    return torch.where(inside, w.kv_indices.long()[pos], -2), lengths


@pytest.mark.parametrize("T,topk", [(2600, 512), (4500, 1024)])
def test_csa_whole_prompt_structure(T, topk):
    # Past 4 * topk tokens the cap binds: the lists are a stratified sample, in random order.
    w = wl.dsv4_csa(T, 1, D=16, topk=topk, seed=1)
    ratio, window = 4, 128
    C = w.meta["num_compressed"]
    p = torch.arange(T)
    visible = (p + 1) // ratio
    n_c = visible.clamp(max=topk)
    n_w = (p + 1).clamp(max=window)
    dense, lengths = _dense(w)
    assert torch.equal(lengths, n_c + n_w) and w.valid_slots == int((n_c + n_w).sum())
    col = torch.arange(dense.shape[1])
    is_c = col[None, :] < n_c[:, None]
    is_w = (col[None, :] >= n_c[:, None]) & (col[None, :] < lengths[:, None])
    # Window: positions p - n_w + 1 .. p, oldest first, at slot C + window + position.
    expect_w = C + window + (p - n_w + 1)[:, None] + (col[None, :] - n_c[:, None])
    assert torch.equal(dense[is_w], expect_w[is_w])
    # Compressed: ids among the visible rows, sorted they fall one into each of n_c strata.
    comp = torch.where(is_c, dense, torch.iinfo(torch.int64).max).sort(dim=1).values
    k = torch.arange(topk)
    comp = comp[:, :topk]
    ok = k[None, :] >= n_c[:, None]
    lo = k[None, :] * visible[:, None] // n_c.clamp(min=1)[:, None]
    hi = (k[None, :] + 1) * visible[:, None] // n_c.clamp(min=1)[:, None]
    assert bool((ok | ((comp >= lo) & (comp < hi))).all())
    few = visible <= topk  # every visible row, in order
    assert torch.equal(comp[few][~ok[few]], k[None, :].expand(T, -1)[few][~ok[few]])
    capped = ~few
    assert int(capped.sum()) > 0
    # Shuffled: the capped lists are not in ascending order (as an indexer returns them).
    unsorted = (dense[capped, 1:topk] < dense[capped, : topk - 1]).any(dim=1)
    assert bool(unsorted.all())
    # Uniform within the strata: the mean offset in its stratum is about one half.
    width = (hi - lo)[capped].double()
    frac = ((comp[capped] - lo[capped]).double() + 0.5) / width
    assert abs(float(frac.mean()) - 0.5) < 0.01


def test_glm_whole_prompt_structure():
    T, topk, bs = 3000, 2048, 64
    w = wl.glm_full_topk(T, 1, D=16, topk=topk, block_size=bs, seed=2)
    table = torch.tensor(w.meta["block_table"][0])
    # Invert the block table: pool slot -> prompt position.
    position_of = torch.full((w.kv.shape[0],), -1, dtype=torch.int64)
    slots = (table[:, None] * bs + torch.arange(bs)[None, :]).flatten()
    position_of[slots] = torch.arange(slots.numel())
    dense, lengths = _dense(w)
    p = torch.arange(T)
    assert torch.equal(lengths, (p + 1).clamp(max=topk))
    inside = dense >= 0
    assert bool((inside == (torch.arange(dense.shape[1])[None, :] < lengths[:, None])).all())
    pos = torch.where(inside, position_of[dense.clamp(min=0)], -1)
    assert bool((pos[inside] >= 0).all())
    assert bool((pos <= p[:, None]).all())  # causal
    sorted_pos = pos.sort(dim=1).values
    distinct = (sorted_pos[:, 1:] != sorted_pos[:, :-1]) | (sorted_pos[:, 1:] < 0)
    assert bool(distinct.all())
    full = p + 1 <= topk  # every earlier position, once
    k = torch.arange(dense.shape[1])
    expect = torch.where(k[None, :] < lengths[:, None], k[None, :], -1)
    assert torch.equal(sorted_pos[full], expect[full].sort(dim=1).values)
