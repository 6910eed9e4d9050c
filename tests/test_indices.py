"""Index packing against pure-Python models (loops over lists), torch vs Triton, and the kernel."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparse_mla import indices as ix
from sparse_mla.prefill import sparse_mla_prefill
from sparse_mla.reference import error_report, sparse_mla_prefill_ref

IMPLS = ("torch", "triton")
INDEX_DTYPES = (torch.int32, torch.int64)
SLOW_OK = [HealthCheck.too_slow]
PROPS = settings(max_examples=100, deadline=None, suppress_health_check=SLOW_OK)
# Each example runs the prefill kernel in the interpreter: a few only.
KERNEL_PROPS = settings(max_examples=10, deadline=None, suppress_health_check=SLOW_OK)


# ----------------------------------------------------------------------------------------------
# Pure-Python models
# ----------------------------------------------------------------------------------------------


def model_dense_to_csr(rows, lengths, num_kv):
    def ok(v):
        return v >= 0 and (num_kv is None or v < num_kv)

    idx, ptr = [], [0]
    for t, row in enumerate(rows):
        if lengths is None:
            idx += [v for v in row if ok(v)]
        else:
            idx += [v if ok(v) else -1 for v in row[: lengths[t]]]
        ptr.append(len(idx))
    return idx, ptr


def model_positions(q_lens, seq_lens):
    return [L - q + i for q, L in zip(q_lens, seq_lens, strict=True) for i in range(q)]


def model_combined(topk_rows, q_lens, seq_lens, ratio, topk, window, M, C):
    """Per-request linear layout of DESIGN §4, written out position by position."""
    idx, ptr, lengths = [], [0], []
    t = 0
    for r, (q, L) in enumerate(zip(q_lens, seq_lens, strict=True)):
        s = L - q
        for i in range(q):
            p = s + i
            n_c = (p + 1) // ratio if topk is None else min((p + 1) // ratio, topk)
            row = []
            for j in range(n_c):
                local = j if topk_rows is None else topk_rows[t][j]
                row.append(r * M + local if 0 <= local < C else -1)
            n_w = min(p + 1, window)
            for x in range(p - n_w + 1, p + 1):
                # Window row k of request r holds position s - window + k.
                row.append(r * M + C + (x - (s - window)))
            idx += row
            lengths.append(len(row))
            ptr.append(len(idx))
            t += 1
    return idx, ptr, lengths


def model_block_table(local_rows, table, req, block_size):
    out = []
    for t, row in enumerate(local_rows):
        r = req[t]
        res = []
        for i in row:
            blk = i // block_size if i >= 0 else -1
            if i < 0 or blk >= len(table[r]) or table[r][blk] < 0:
                res.append(-1)
            else:
                res.append(table[r][blk] * block_size + i % block_size)
        out.append(res)
    return out


def csr_tensors(idx, ptr, dtype=torch.int64):
    return torch.tensor(idx, dtype=dtype), torch.tensor(ptr, dtype=torch.int64)


def assert_exact(got, want_values, want_dtype):
    assert got.dtype == want_dtype, (got.dtype, want_dtype)
    assert got.tolist() == want_values


# ----------------------------------------------------------------------------------------------
# dense_to_csr
# ----------------------------------------------------------------------------------------------


@st.composite
def dense_cases(draw):
    T = draw(st.integers(0, 6))
    W = draw(st.integers(0, 40))
    dtype = draw(st.sampled_from(INDEX_DTYPES))
    hi = 2**40 if dtype == torch.int64 else 2**31 - 1
    entry = st.one_of(st.just(-1), st.integers(-5, 60), st.integers(-(2**31), hi))
    rows = draw(st.lists(st.lists(entry, min_size=W, max_size=W), min_size=T, max_size=T))
    lengths = None
    if draw(st.booleans()):
        lengths = draw(
            st.lists(st.one_of(st.just(0), st.just(W), st.integers(0, W)), min_size=T, max_size=T)
        )
    num_kv = draw(st.one_of(st.none(), st.integers(0, 64)))
    return rows, W, dtype, lengths, num_kv, draw(st.booleans()), draw(st.booleans())


@PROPS
@given(dense_cases())
def test_dense_to_csr_matches_model(case):
    rows, W, dtype, lengths, num_kv, give_total, transposed = case
    T = len(rows)
    dense = torch.tensor(rows, dtype=dtype).reshape(T, W)
    if transposed:  # same values, non-unit strides
        dense = dense.t().contiguous().t()
    want_idx, want_ptr = model_dense_to_csr(rows, lengths, num_kv)
    lens = None if lengths is None else torch.tensor(lengths, dtype=torch.int32)
    total = want_ptr[-1] if give_total else None
    for impl in IMPLS:
        got_idx, got_ptr = ix.dense_to_csr(dense, lens, num_kv, total, impl=impl)
        assert_exact(got_idx, want_idx, dtype)
        # int32 offsets for int32 indices (T*W is small here), int64 for int64 indices.
        assert_exact(got_ptr, want_ptr, dtype)


def test_dense_to_csr_out_of_range_policy():
    dense = torch.tensor([[4, -1, 7, 2], [9, 0, -3, 5]], dtype=torch.int32)
    for impl in IMPLS:
        # Without lengths, invalid entries (negative or >= num_kv) are dropped.
        idx, ptr = ix.dense_to_csr(dense, num_kv=6, impl=impl)
        assert idx.tolist() == [4, 2, 0, 5] and ptr.tolist() == [0, 2, 4]
        # With lengths, positions are kept and invalid entries become exactly -1.
        idx, ptr = ix.dense_to_csr(dense, [3, 4], num_kv=6, impl=impl)
        assert idx.tolist() == [4, -1, -1, -1, 0, -1, 5] and ptr.tolist() == [0, 3, 7]
        idx, _ = ix.dense_to_csr(dense, [3, 4], impl=impl)
        assert idx.tolist() == [4, -1, 7, 9, 0, -1, 5]


@pytest.mark.parametrize("num_kv", [2**31 - 1, 2**31, 2**32 + 5, 2**33])
def test_dense_to_csr_int32_indices_with_a_pool_past_int32(num_kv):
    # Every non-negative int32 is a valid slot of a pool this large (torch's int32 compare
    # with such a num_kv would wrap); the torch and Triton paths agree with a plain model.
    dense = torch.tensor([[4, -1, 2**31 - 1], [-(2**31), 0, 7]], dtype=torch.int32)
    want = [v for row in dense.tolist() for v in row if 0 <= v < num_kv]
    for impl in IMPLS:
        idx, ptr = ix.dense_to_csr(dense, num_kv=num_kv, impl=impl)
        assert idx.tolist() == want and ptr.tolist() == [0, len(want) - 2, len(want)], impl
        idx, _ = ix.dense_to_csr(dense, [3, 3], num_kv=num_kv, impl=impl)
        assert idx.tolist() == [v if 0 <= v < num_kv else -1 for row in dense.tolist() for v in row]


def test_dense_to_csr_dtypes():
    dense = torch.tensor([[1, -1, 2]], dtype=torch.int32)
    for impl in IMPLS:
        idx, ptr = ix.dense_to_csr(dense, impl=impl, indptr_dtype=torch.int64)
        assert idx.dtype == torch.int32 and ptr.dtype == torch.int64
        idx, ptr = ix.dense_to_csr(dense.long(), impl=impl)
        assert idx.dtype == torch.int64 and ptr.dtype == torch.int64
    assert ix._auto_indptr_dtype(torch.int32, 2**31) == torch.int64
    assert ix._auto_indptr_dtype(torch.int32, 2**31 - 1) == torch.int32


def test_dense_to_csr_wrong_total_unchecked_stays_in_bounds():
    dense = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int64)
    # The no-sync path trusts total; too small must truncate, never write past the buffer.
    idx, ptr = ix.dense_to_csr(dense, total=4, impl="triton", validate=False)
    assert idx.tolist() == [1, 2, 3, 4] and ptr.tolist() == [0, 3, 6]
    with pytest.raises(ValueError, match="total=4"):
        ix.dense_to_csr(dense, total=4, impl="triton")
    with pytest.raises(ValueError, match="total=4"):
        ix.dense_to_csr(dense, total=4, impl="torch")


# ----------------------------------------------------------------------------------------------
# DSv4 builders
# ----------------------------------------------------------------------------------------------


@st.composite
def dsv4_cases(draw):
    B = draw(st.integers(1, 3))
    ratio = draw(st.sampled_from([1, 4, 128]))
    window = draw(st.sampled_from([0, 1, 3, 8, 128]))
    max_ctx = 300 if ratio == 128 else 40
    q_lens = draw(st.lists(st.integers(0, 4), min_size=B, max_size=B))
    ctx = draw(st.lists(st.one_of(st.just(0), st.integers(0, max_ctx)), min_size=B, max_size=B))
    seq_lens = [c + q for c, q in zip(ctx, q_lens, strict=True)]
    topk = draw(st.one_of(st.none(), st.integers(0, 12)))
    C = max(L // ratio for L in seq_lens) + draw(st.integers(0, 3))
    M = max(1, C + window + max(q_lens) + draw(st.integers(0, 3)))
    T = sum(q_lens)
    dtype = draw(st.sampled_from(INDEX_DTYPES))
    positions = model_positions(q_lens, seq_lens)
    need = max([(p + 1) // ratio for p in positions], default=0)
    W = (topk if topk is not None else need) + draw(st.integers(0, 2))
    entry = st.one_of(st.just(-1), st.integers(-3, C + 2))
    topk_rows = draw(st.lists(st.lists(entry, min_size=W, max_size=W), min_size=T, max_size=T))
    if draw(st.integers(0, 3)) == 0:
        topk_rows = None  # HCA: every compressed row
    return dict(
        q_lens=q_lens,
        seq_lens=seq_lens,
        ratio=ratio,
        window=window,
        topk=topk,
        C=C,
        M=M,
        W=W,
        dtype=dtype,
        topk_rows=topk_rows,
        give_total=draw(st.booleans()),
    )


def dsv4_tensors(c):
    qsl = torch.tensor([0, *torch.tensor(c["q_lens"]).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor(c["seq_lens"], dtype=torch.int32)
    topk_t = None
    if c["topk_rows"] is not None:
        T = sum(c["q_lens"])
        topk_t = torch.tensor(c["topk_rows"], dtype=c["dtype"]).reshape(T, c["W"])
    return qsl, seq, topk_t


def combined(c, topk_t, qsl, seq, impl, total=None):
    return ix.dsv4_combined_indices(
        topk_t,
        qsl,
        seq,
        ratio=c["ratio"],
        topk=c["topk"],
        window=c["window"],
        pool_block_rows=c["M"],
        num_compressed=c["C"],
        impl=impl,
        total=total,
        num_tokens=sum(c["q_lens"]),
    )


@PROPS
@given(dsv4_cases())
def test_dsv4_builders_match_model(c):
    qsl, seq, topk_t = dsv4_tensors(c)
    want_pos = model_positions(c["q_lens"], c["seq_lens"])
    assert ix.dsv4_positions(qsl, seq).tolist() == want_pos
    want_idx, want_ptr, want_len = model_combined(
        c["topk_rows"],
        c["q_lens"],
        c["seq_lens"],
        c["ratio"],
        c["topk"],
        c["window"],
        c["M"],
        c["C"],
    )
    lengths = ix.dsv4_token_lengths(
        torch.tensor(want_pos, dtype=torch.int64),
        ratio=c["ratio"],
        topk=c["topk"],
        window=c["window"],
    )
    assert lengths.tolist() == want_len
    dtype = c["dtype"] if topk_t is not None else torch.int64
    total = want_ptr[-1] if c["give_total"] else None
    for impl in IMPLS:
        got_idx, got_ptr = combined(c, topk_t, qsl, seq, impl, total)
        assert_exact(got_idx, want_idx, dtype)
        assert_exact(got_ptr, want_ptr, dtype)
        # Every slot is -1 or inside its request's block region (no spill into a neighbour).
        assert all(-1 <= s < len(c["q_lens"]) * c["M"] for s in got_idx.tolist())


@pytest.mark.parametrize("impl", IMPLS)
def test_invalid_topk_stays_invalid_after_rebasing(impl):
    # Regression (aiter's builder): a -1 top-k id of request 1 became the slot M - 1 = base - 1.
    M, C = 16, 4
    qsl = torch.tensor([0, 1, 2])
    seq = torch.tensor([12, 12])  # position 11: (11+1)//4 = 3 compressed ids per token
    topk_t = torch.tensor([[2, -1, 0], [-1, 1, -1]], dtype=torch.int32)
    idx, ptr = ix.dsv4_combined_indices(
        topk_t,
        qsl,
        seq,
        ratio=4,
        topk=3,
        window=2,
        pool_block_rows=M,
        num_compressed=C,
        impl=impl,
    )
    # Window rows of a request: C + window + (x - s) with s = 11, positions 10 and 11.
    assert idx.tolist() == [2, -1, 0, 5, 6, -1, M + 1, -1, M + 5, M + 6]
    assert ptr.tolist() == [0, 5, 10]
    assert M - 1 not in idx.tolist()
    # The same for the block-table mapping: -1 never becomes block * block_size - 1.
    table = torch.tensor([[3, 7]], dtype=torch.int32)
    slots = ix.global_topk_from_block_table(
        torch.tensor([[-1, 0, 5]], dtype=torch.int32), table, torch.tensor([0]), 4, impl=impl
    )
    assert slots.tolist() == [[-1, 12, 29]]


@st.composite
def block_table_cases(draw):
    B = draw(st.integers(1, 3))
    max_blocks = draw(st.integers(0, 4))
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    table = draw(
        st.lists(
            st.lists(st.integers(-1, 20), min_size=max_blocks, max_size=max_blocks),
            min_size=B,
            max_size=B,
        )
    )
    T = draw(st.integers(0, 5))
    K = draw(st.integers(0, 20))
    entry = st.one_of(st.just(-1), st.integers(-3, max_blocks * block_size + 3))
    local = draw(st.lists(st.lists(entry, min_size=K, max_size=K), min_size=T, max_size=T))
    req = draw(st.lists(st.integers(0, B - 1), min_size=T, max_size=T))
    dtypes = st.sampled_from(INDEX_DTYPES)
    return B, max_blocks, block_size, table, T, K, local, req, draw(dtypes), draw(dtypes)


@PROPS
@given(block_table_cases())
def test_global_topk_from_block_table_matches_model(case):
    B, max_blocks, block_size, table, T, K, local, req, dt_local, dt_table = case
    want = model_block_table(local, table, req, block_size)
    local_t = torch.tensor(local, dtype=dt_local).reshape(T, K)
    table_t = torch.tensor(table, dtype=dt_table).reshape(B, max_blocks)
    req_t = torch.tensor(req, dtype=torch.int32)
    # The same request ids as every other entry of a longer tensor: a strided view.
    req_strided = torch.full((2 * T + 1,), B + 5, dtype=torch.int32)[1::2]
    req_strided.copy_(req_t)
    for impl in IMPLS:
        for r in (req_t, req_strided):
            got = ix.global_topk_from_block_table(local_t, table_t, r, block_size, impl=impl)
            assert got.dtype == dt_local and tuple(got.shape) == (T, K)
            assert got.tolist() == want


def test_request_of_token_skips_empty_requests():
    qsl = torch.tensor([0, 2, 2, 2, 5])
    assert ix.request_of_token(qsl).tolist() == [0, 0, 3, 3, 3]
    assert ix.dsv4_positions(qsl, torch.tensor([7, 0, 4, 3])).tolist() == [5, 6, 0, 1, 2]


# ----------------------------------------------------------------------------------------------
# The packed lists through the kernel (CPU interpreter) vs the reference on the model's lists
# ----------------------------------------------------------------------------------------------

H, D = 16, 64


def run_kernel_vs_model(q, kv, kv_indices, kv_indptr, model_idx, model_ptr, sink):
    out = torch.full_like(q, float("nan"))  # an unwritten tile must fail
    sparse_mla_prefill(q, kv, kv_indices, kv_indptr, D**-0.5, attn_sink=sink, out=out)
    ref_idx, ref_ptr = csr_tensors(model_idx, model_ptr)
    ref = sparse_mla_prefill_ref(q, kv, ref_idx, ref_ptr, D**-0.5, attn_sink=sink)
    base = sparse_mla_prefill_ref(q, kv, ref_idx, ref_ptr, D**-0.5, attn_sink=sink, upcast=False)
    assert not out.isnan().any()
    report = error_report(out, ref, base)
    assert report.ok, str(report)


@KERNEL_PROPS
@given(
    T=st.integers(1, 4),
    W=st.integers(1, 40),
    N=st.integers(1, 48),
    use_lengths=st.booleans(),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from(INDEX_DTYPES),
)
def test_dense_packing_through_kernel(T, W, N, use_lengths, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    dense = torch.randint(-1, N + 3, (T, W), generator=gen).to(dtype)  # -1 and >= N included
    lengths = torch.randint(0, W + 1, (T,), generator=gen) if use_lengths else None
    rows = dense.tolist()
    lens = None if lengths is None else lengths.tolist()
    model_idx, model_ptr = model_dense_to_csr(rows, lens, N)
    q = torch.randn(T, H, D, generator=gen).half()
    kv = torch.randn(N, D, generator=gen).half()
    sink = torch.randn(H, generator=gen)
    kv_indices, kv_indptr = ix.dense_to_csr(dense, lengths, N, impl="triton")
    run_kernel_vs_model(q, kv, kv_indices, kv_indptr, model_idx, model_ptr, sink)


@KERNEL_PROPS
@given(c=dsv4_cases(), seed=st.integers(0, 2**16))
def test_dsv4_packing_through_kernel(c, seed):
    T = sum(c["q_lens"])
    if T == 0 or T > 6:
        return
    gen = torch.Generator().manual_seed(seed)
    qsl, seq, topk_t = dsv4_tensors(c)
    model_idx, model_ptr, _ = model_combined(
        c["topk_rows"],
        c["q_lens"],
        c["seq_lens"],
        c["ratio"],
        c["topk"],
        c["window"],
        c["M"],
        c["C"],
    )
    N = len(c["q_lens"]) * c["M"]
    kv = torch.randn(N, D, generator=gen).half()
    # Rows no valid slot references are NaN: reading one (a layout slip) would poison the output.
    used = torch.zeros(N, dtype=torch.bool)
    used[[s for s in model_idx if s >= 0]] = True
    kv[~used] = float("nan")
    q = torch.randn(T, H, D, generator=gen).half()
    kv_indices, kv_indptr = combined(c, topk_t, qsl, seq, "triton")
    run_kernel_vs_model(q, kv, kv_indices, kv_indptr, model_idx, model_ptr, None)


# ----------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------

I32 = torch.int32
DENSE = torch.tensor([[1, 2, -1], [3, -1, -1]], dtype=I32)
META = torch.device("meta")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (dict(indices=DENSE.float()), TypeError, "indices must be an int32 or int64"),
        (dict(indices=DENSE.short()), TypeError, "indices must be an int32 or int64"),
        (dict(indices=DENSE[0]), ValueError, "indices must be 2-D"),
        (dict(indices=[[1, 2]]), TypeError, "indices must be a tensor"),
        (dict(lengths=torch.tensor([1, 4])), ValueError, "lengths must be <= W=3"),
        (dict(lengths=torch.tensor([-1, 2])), ValueError, "lengths must be >= 0"),
        (dict(lengths=torch.tensor([1.0, 2.0])), TypeError, "lengths must be an integer"),
        (dict(lengths=torch.tensor([1, 2, 3])), ValueError, "one entry per row"),
        (dict(lengths=torch.tensor([1, 2], device=META)), ValueError, "devices must match"),
        (dict(num_kv=-1), ValueError, "num_kv must be >= 0"),
        (dict(num_kv=2.5), TypeError, "num_kv must be an int"),
        (dict(total=2), ValueError, "total=2"),
        (dict(indptr_dtype=torch.float32), TypeError, "indptr_dtype"),
    ],
)
def test_dense_to_csr_rejects(impl, kwargs, exc, match):
    args = dict(indices=DENSE) | kwargs
    with pytest.raises(exc, match=match):
        ix.dense_to_csr(**args, impl=impl)


def test_bad_impl():
    with pytest.raises(ValueError, match="impl must be"):
        ix.dense_to_csr(DENSE, impl="cuda")


def _dsv4_kwargs(**over):
    kw = dict(
        topk_indices=torch.tensor([[0, -1], [1, 2]], dtype=I32),
        query_start_loc=torch.tensor([0, 2]),
        seq_lens=torch.tensor([10]),
        ratio=4,
        topk=2,
        window=4,
        pool_block_rows=16,
        num_compressed=4,
    )
    kw.update(over)
    return kw


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("over", "exc", "match"),
    [
        (dict(topk_indices=torch.zeros(2, 2)), TypeError, "topk_indices must be an int32"),
        (dict(query_start_loc=torch.tensor([0, 1, 2])), ValueError, "B\\+1 = 2 entries"),
        (dict(query_start_loc=torch.tensor([0.0, 2.0])), TypeError, "query_start_loc must be"),
        (dict(query_start_loc=torch.tensor([0, 3])), ValueError, "number of tokens T=2"),
        (dict(query_start_loc=torch.tensor([1, 2])), ValueError, "query_start_loc\\[0\\]"),
        (dict(seq_lens=torch.tensor([1])), ValueError, "shorter than that request's query"),
        (dict(topk=3), ValueError, "topk=3 exceeds the width"),
        (dict(num_compressed=1), ValueError, "compressed rows but num_compressed=1"),
        (dict(pool_block_rows=9), ValueError, "more than pool_block_rows=9"),
        (dict(pool_block_rows=7), ValueError, "exceeds pool_block_rows=7"),
        (dict(ratio=0), ValueError, "ratio must be >= 1"),
        (dict(window=True), TypeError, "window must be an int"),
        (dict(seq_lens=torch.tensor([10], device=META)), ValueError, "devices must match"),
        (
            dict(
                query_start_loc=torch.tensor([0, 2], device=META),
                seq_lens=torch.tensor([10], device=META),
            ),
            ValueError,
            "devices must match",
        ),
        (
            dict(topk=None, topk_indices=torch.tensor([[0], [1]], dtype=I32)),
            ValueError,
            "needs 2 compressed ids \\(topk=None\\) but topk_indices has width W=1",
        ),
    ],
)
def test_dsv4_combined_rejects(impl, over, exc, match):
    kw = _dsv4_kwargs(**over)
    with pytest.raises(exc, match=match):
        ix.dsv4_combined_indices(**kw, impl=impl)


def test_dsv4_small_helpers_reject():
    with pytest.raises(TypeError, match="positions must be an integer"):
        ix.dsv4_token_lengths(torch.tensor([1.0]), ratio=4, topk=4, window=4)
    with pytest.raises(ValueError, match="topk must be >= 0"):
        ix.dsv4_token_lengths(torch.tensor([1]), ratio=4, topk=-1, window=4)
    with pytest.raises(ValueError, match="shorter than"):
        ix.dsv4_positions(torch.tensor([0, 3]), torch.tensor([2]))


@pytest.mark.parametrize("impl", IMPLS)
def test_global_topk_rejects(impl):
    local = torch.tensor([[0, 1]], dtype=I32)
    table = torch.tensor([[0, 1]], dtype=I32)
    req = torch.tensor([0])
    with pytest.raises(ValueError, match="req_of_token must be in \\[0, B=1\\)"):
        ix.global_topk_from_block_table(local, table, torch.tensor([1]), 4, impl=impl)
    with pytest.raises(ValueError, match="one entry per row"):
        ix.global_topk_from_block_table(local, table, torch.tensor([0, 0]), 4, impl=impl)
    with pytest.raises(TypeError, match="block_table must be an int32"):
        ix.global_topk_from_block_table(local, table.float(), req, 4, impl=impl)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        ix.global_topk_from_block_table(local, table, req, 0, impl=impl)
    with pytest.raises(ValueError, match="devices must match"):
        ix.global_topk_from_block_table(local, table.to(META), req, 4, impl=impl)
    with pytest.raises(ValueError, match="do not fit int32"):
        ix.global_topk_from_block_table(local, table * 2**30, req, 4, impl=impl)


# ----------------------------------------------------------------------------------------------
# The benchmark script (tiny, interpreter) and GPU checks
# ----------------------------------------------------------------------------------------------


def test_bench_script_runs_on_cpu(tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_indices.py"
    spec = importlib.util.spec_from_file_location("bench_indices", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.csv"
    args = ["--cpu", "--tokens", "12", "--reps", "1", "--out", str(out)]
    assert bench.main(args) == 0
    assert "packing (Triton, total given) / prefill" in capsys.readouterr().out
    header, row = out.read_text().splitlines()
    assert "packing_over_prefill" in header.split(",") and "cpu" in row


def _gpu_case(T=2048, ratio=4, topk=256, window=128):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q_lens = torch.tensor([T // 2, T // 4, T - T // 2 - T // 4])
    seq_lens = q_lens + torch.tensor([0, 3000, 777])
    qsl = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)])
    C = int((seq_lens // ratio).max())
    M = C + window + int(q_lens.max())
    ids = torch.randint(-1, C + 2, (T, topk), generator=gen, device="cuda", dtype=torch.int32)
    layout = dict(ratio=ratio, topk=topk, window=window, pool_block_rows=M, num_compressed=C)
    return ids, qsl.cuda(), seq_lens.cuda(), layout


@pytest.mark.gpu
def test_gpu_torch_and_triton_agree():
    ids, qsl, seq_lens, layout = _gpu_case()
    want = ix.dsv4_combined_indices(ids, qsl, seq_lens, **layout, impl="torch")
    got = ix.dsv4_combined_indices(ids, qsl, seq_lens, **layout, impl="triton")
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w)
    dense = ids.t().contiguous().t()
    lengths = torch.randint(0, ids.shape[1] + 1, (ids.shape[0],), device="cuda")
    for lens in (None, lengths):
        a = ix.dense_to_csr(dense, lens, 1000, impl="torch")
        b = ix.dense_to_csr(dense, lens, 1000, impl="triton")
        assert all(torch.equal(x, y) and x.dtype == y.dtype for x, y in zip(a, b, strict=True))
    table = torch.randint(-1, 5000, (3, 64), device="cuda", dtype=torch.int32)
    req = ix.request_of_token(qsl, num_tokens=ids.shape[0])
    a = ix.global_topk_from_block_table(ids, table, req, 64, impl="torch")
    b = ix.global_topk_from_block_table(ids, table, req, 64, impl="triton")
    assert torch.equal(a, b)


@pytest.mark.gpu
def test_gpu_triton_path_with_total_never_syncs():
    ids, qsl, seq_lens, layout = _gpu_case()
    nnz = ix.dsv4_combined_indices(ids, qsl, seq_lens, **layout)[0].numel()
    lengths = torch.full((ids.shape[0],), ids.shape[1], device="cuda")
    req = ix.request_of_token(qsl, num_tokens=ids.shape[0])
    table = torch.randint(0, 5000, (3, 64), device="cuda", dtype=torch.int32)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ix.dsv4_combined_indices(ids, qsl, seq_lens, **layout, impl="triton", total=nnz)
        ix.dense_to_csr(ids, lengths, total=ids.numel(), impl="triton")
        ix.global_topk_from_block_table(ids, table, req, 64, impl="triton")
    finally:
        torch.cuda.set_sync_debug_mode("default")
