"""Index packing under torch.compile(fullgraph=True) on CPU: the builders that take ``total``
(and global_topk_from_block_table) are registered ops while Dynamo traces (sparse_mla.indices,
module docstring): no graph break, the same bits as eager, the pure-Python models' values, the
value checks at run time; and a whole pack-then-attend step compiled as one graph."""

from __future__ import annotations

import pytest
import torch
from conftest import poisoned_like
from test_indices import model_block_table, model_combined, model_dense_to_csr, model_positions

from sparse_mla import indices as ix
from sparse_mla.prefill import sparse_mla_prefill
from sparse_mla.reference import check_against_reference

IMPLS = ("torch", "triton")


def _compiled_equals_eager(f, *args):
    """f compiled with fullgraph=True: no graph break, outputs equal to eager (values and
    dtypes); returns them."""
    torch._dynamo.reset()
    explained = torch._dynamo.explain(f)(*args)
    assert explained.graph_break_count == 0, explained.break_reasons
    eager = f(*args)
    got = torch.compile(f, fullgraph=True)(*args)
    assert len(got) == len(eager)
    for g, e in zip(got, eager, strict=True):
        assert g.dtype == e.dtype and torch.equal(g, e)
    return got


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("use_lengths", [False, True])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_dense_to_csr_compiles(impl, use_lengths, dtype):
    g = torch.Generator().manual_seed(int(use_lengths) + 2 * (dtype == torch.int64))
    T, W, N = 7, 9, 30
    rows = torch.randint(-3, N + 4, (T, W), generator=g).to(dtype)
    rows = rows.t().contiguous().t()  # any strides
    lengths = torch.randint(0, W + 1, (T,), generator=g) if use_lengths else None
    want_idx, want_ptr = model_dense_to_csr(
        rows.tolist(), None if lengths is None else lengths.tolist(), N
    )
    total = len(want_idx)

    def f(rows, lengths):
        return ix.dense_to_csr(rows, lengths, N, total, impl=impl)

    idx, ptr = _compiled_equals_eager(f, rows, lengths)
    assert idx.tolist() == want_idx and ptr.tolist() == want_ptr and idx.dtype == dtype


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("hca", [False, True])
def test_dsv4_combined_indices_compiles(impl, hca):
    g = torch.Generator().manual_seed(5 + hca)
    q_lens, ctx = [3, 0, 5], [9, 2, 30]
    seq_lens = [c + q for c, q in zip(ctx, q_lens, strict=True)]
    ratio, window = 4, 8
    topk = None if hca else 6
    C = max(L // ratio for L in seq_lens) + 1
    M = C + window + max(q_lens) + 2
    T = sum(q_lens)
    W = 6 if not hca else C
    rows = torch.randint(-2, C + 2, (T, W), generator=g, dtype=torch.int32)
    qsl = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    want_idx, want_ptr, _ = model_combined(None if hca else rows.tolist(), q_lens, seq_lens,
                                           ratio, topk, window, M, C)  # fmt: skip
    total = len(want_idx)

    def f(rows, qsl, seq):
        return ix.dsv4_combined_indices(
            None if hca else rows, qsl, seq, ratio=ratio, topk=topk, window=window,
            pool_block_rows=M, num_compressed=C, impl=impl, total=total, num_tokens=T,
        )  # fmt: skip

    idx, ptr = _compiled_equals_eager(f, rows, qsl, seq)
    assert idx.tolist() == want_idx and ptr.tolist() == want_ptr


@pytest.mark.parametrize("impl", IMPLS)
def test_global_topk_from_block_table_compiles(impl):
    g = torch.Generator().manual_seed(9)
    T, K, B, blocks, bs = 6, 5, 3, 4, 8
    local = torch.randint(-1, blocks * bs + 3, (T, K), generator=g, dtype=torch.int64)
    table = torch.randint(-1, 50, (B, blocks), generator=g, dtype=torch.int32)
    req = torch.tensor([0, 0, 1, 2, 2, 2])

    def f(local, table, req):
        return (ix.global_topk_from_block_table(local, table, req, bs, impl=impl),)

    (got,) = _compiled_equals_eager(f, local, table, req)
    assert got.tolist() == model_block_table(local.tolist(), table.tolist(), req.tolist(), bs)


def test_plain_torch_helpers_compile_with_num_tokens():
    """request_of_token, dsv4_positions (validate=False: its value checks read tensors) and
    dsv4_token_lengths are plain torch code: they trace as such."""
    qsl = torch.tensor([0, 2, 2, 7])
    seq = torch.tensor([5, 1, 20])

    def f(qsl, seq):
        req = ix.request_of_token(qsl, num_tokens=7)
        pos = ix.dsv4_positions(qsl, seq, num_tokens=7, validate=False)
        return req, pos, ix.dsv4_token_lengths(pos, ratio=4, topk=3, window=4)

    req, pos, _ = _compiled_equals_eager(f, qsl, seq)
    assert req.tolist() == [0, 0, 2, 2, 2, 2, 2]
    assert pos.tolist() == model_positions([2, 0, 5], [5, 1, 20])


def test_value_checks_run_when_the_graph_runs():
    """validate=True under compile: a wrong total is found by the op's kernel on the real
    tensors (not at trace time), as in eager mode."""
    rows = torch.tensor([[0, 1, -1], [2, -1, -1]], dtype=torch.int32)

    def f(rows, total):
        return ix.dense_to_csr(rows, None, 10, total, validate=True)

    torch._dynamo.reset()
    g = torch.compile(f, fullgraph=True)
    assert g(rows, 3)[0].tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="total=4 but the packed lists hold 3 entries"):
        g(rows, 4)


@pytest.mark.parametrize("impl", IMPLS)
def test_opcheck_packing_ops(impl):
    rows = torch.tensor([[0, 5, -1, 2], [-1, -1, 3, 9]], dtype=torch.int64)
    lengths = torch.tensor([3, 4])
    torch.library.opcheck(torch.ops.sparse_mla.dense_to_csr.default,
                          (rows, lengths, 8, 7, impl, torch.int32, None))  # fmt: skip
    torch.library.opcheck(torch.ops.sparse_mla.dense_to_csr.default,
                          (rows, None, 8, 4, impl, torch.int64, True))  # fmt: skip
    qsl = torch.tensor([0, 2, 5], dtype=torch.int32)
    seq = torch.tensor([6, 9], dtype=torch.int32)
    ids = torch.randint(-1, 4, (5, 2), generator=torch.Generator().manual_seed(1))
    layout = dict(ratio=4, topk=2, window=3, pool_block_rows=12, num_compressed=3)
    total = ix.dsv4_combined_indices(ids, qsl, seq, **layout, impl="torch")[0].numel()
    torch.library.opcheck(
        torch.ops.sparse_mla.dsv4_combined_indices.default,
        (ids, qsl, seq, 4, 2, 3, 12, 3, impl, total, 5, torch.int64, torch.int32, None),
    )
    table = torch.tensor([[3, -1], [0, 7]], dtype=torch.int32)
    req = torch.tensor([0, 1])
    torch.library.opcheck(torch.ops.sparse_mla.global_topk_from_block_table.default,
                          (rows, table, req, 4, impl, torch.int64, None))  # fmt: skip


def test_pack_and_attend_compile_as_one_graph():
    """An engine's step: positions, the DSv4 lists (total given), the attention (Triton in the
    interpreter), all in one fullgraph-compiled function; equal to eager and to the reference."""
    g = torch.Generator().manual_seed(3)
    q_lens, ctx = [2, 3], [5, 11]
    seq_lens = [c + q for c, q in zip(ctx, q_lens, strict=True)]
    ratio, topk, window = 4, 2, 4
    C = max(L // ratio for L in seq_lens)
    M = C + window + max(q_lens)
    T, H, D = sum(q_lens), 4, 32
    qsl = torch.tensor([0, 2, 5])
    seq = torch.tensor(seq_lens)
    rows = torch.randint(-1, C, (T, topk), generator=g, dtype=torch.int32)
    kv = torch.randn(len(seq_lens) * M, D, generator=g).to(torch.bfloat16)
    q = torch.randn(T, H, D, generator=g).to(torch.bfloat16)
    sink = torch.randn(H, generator=g)
    total = len(model_combined(rows.tolist(), q_lens, seq_lens, ratio, topk, window, M, C)[0])

    def step(q, kv, rows, qsl, seq, sink):
        idx, ptr = ix.dsv4_combined_indices(
            rows, qsl, seq, ratio=ratio, topk=topk, window=window, pool_block_rows=M,
            num_compressed=C, total=total, num_tokens=T,
        )  # fmt: skip
        out = sparse_mla_prefill(q, kv, idx, ptr, D**-0.5, attn_sink=sink)
        return out, idx, ptr

    out, idx, ptr = _compiled_equals_eager(step, q, kv, rows, qsl, seq, sink)
    assert not torch.isnan(poisoned_like(q).copy_(out)).any()
    rep = check_against_reference(out, q, kv, idx, ptr, D**-0.5, attn_sink=sink)
    assert rep.ok, rep


@pytest.mark.gpu
def test_gpu_packing_compiles_and_never_syncs():
    """On the GPU the compiled builders (Triton path, total given) equal eager and the graph
    runs without a host sync."""
    g = torch.Generator(device="cuda").manual_seed(0)
    T, topk, ratio, window = 512, 64, 4, 128
    qsl = torch.tensor([0, 200, 512], device="cuda")
    seq = torch.tensor([900, 312], device="cuda")
    C, M = 225, 225 + 128 + 312
    ids = torch.randint(-1, C + 2, (T, topk), generator=g, device="cuda", dtype=torch.int32)
    layout = dict(ratio=ratio, topk=topk, window=window, pool_block_rows=M, num_compressed=C)
    total = ix.dsv4_combined_indices(ids, qsl, seq, **layout)[0].numel()

    def f(ids, qsl, seq):
        return ix.dsv4_combined_indices(ids, qsl, seq, **layout, total=total, num_tokens=T)

    got = _compiled_equals_eager(f, ids, qsl, seq)
    compiled = torch.compile(f, fullgraph=True)
    compiled(ids, qsl, seq)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = compiled(ids, qsl, seq)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.equal(a, b) for a, b in zip(again, got, strict=True))
