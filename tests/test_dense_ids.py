"""Dense slot ids: ``sparse_mla_prefill(q, kv, kv_indices [T, K], None, scale)`` (issue 22).

Token t's list is row t of kv_indices; any id outside [0, N) is absent, as in CSR. CPU cases run
the Triton kernel in the interpreter (it reads the dense form itself, ``DENSE_IDS``) and, through
a spy kernel that reads CSR only, the entry's device-side conversion; every input is fresh and
random (ragged rows by -1 padding and absent ids of every kind, all-absent rows, duplicates,
NaN/Inf in every pool row no valid id references, a NaN-poisoned output). The reference is the
fp32 one on the dense form, and the dense reference is itself checked against the CSR reference
of lists built row by row in plain Python. GPU cases (``gpu``; the Gluon kernels ``sm90``): every
registered kernel on the dense form, and dense == the equivalent CSR bit for bit for the
kernels that read the dense form themselves.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from conftest import poisoned_like

from sparse_mla import dispatch, runtime, validation
from sparse_mla.prefill import sparse_mla_prefill
from sparse_mla.reference import check_against_reference, sparse_mla_prefill_ref


@dataclasses.dataclass
class DenseCase:
    q: torch.Tensor
    kv: torch.Tensor
    ids: torch.Tensor  # [T, K]
    softmax_scale: float
    attn_sink: torch.Tensor | None

    def args(self):
        return self.q, self.kv, self.ids, None, self.softmax_scale


def make_dense_case(T, H, D, K, *, N=60, dtype=torch.bfloat16, index_dtype=torch.int32,
                    sink=True, seed=0, device="cpu") -> DenseCase:  # fmt: skip
    """Random dense ids [T, K]: each row a random number of valid ids (duplicates forced in
    some rows) then -1 padding, absent ids of every kind sprinkled anywhere, a quarter of the rows
    all absent; the pool inside a NaN buffer, every unreferenced row NaN or Inf."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g).to(dtype)
    ids = torch.randint(0, max(N, 1), (T, K), generator=g, dtype=torch.int64)
    if T and K:
        lengths = torch.randint(0, K + 1, (T,), generator=g)
        ids[torch.arange(K)[None, :] >= lengths[:, None]] = -1  # ragged: -1 padded tails
        ids[torch.randint(0, T, (max(1, T // 4),), generator=g)] = -1  # all-absent rows
        dup = torch.randint(0, T, (max(1, T // 3),), generator=g)
        ids[dup, 1::2] = torch.where(ids[dup, 1::2] >= 0, ids[dup, :1], ids[dup, 1::2])
        bad = [-1, N, N + 7, 2**31 - 1, -(2**31)]
        if index_dtype == torch.int64:
            bad += [2**31, 2**33 + 5, 2**62, -(2**40)]
        where = torch.rand(T, K, generator=g) < 0.15
        pick = torch.randint(0, len(bad), (T, K), generator=g)
        ids = torch.where(where, torch.tensor(bad)[pick], ids)
        # Rows whose first and last ids are valid: the ends of a row are read.
        full = torch.randint(0, T, (max(1, T // 3),), generator=g)
        ids[full, 0] = torch.randint(0, max(N, 1), (full.numel(),), generator=g)
        ids[full, -1] = torch.randint(0, max(N, 1), (full.numel(),), generator=g)
    if N == 0:
        ids.fill_(-1)
    ids = ids.to(index_dtype)
    buf = torch.full((N + 16, D), float("nan"))
    buf[7 : 7 + N] = torch.randn(N, D, generator=g)
    used = torch.zeros(N, dtype=torch.bool)
    v = ids.long()
    used[v[(v >= 0) & (v < N)]] = True
    for i, r in enumerate((~used).nonzero().flatten().tolist()):
        buf[7 + r] = float("nan") if i % 2 == 0 else float("inf")
    kv = buf.to(dtype).to(device)[7 : 7 + N]
    attn_sink = (torch.randn(H, generator=g) * 2).to(device) if sink else None
    return DenseCase(q.to(device), kv, ids.to(device), D**-0.5, attn_sink)


def csr_by_rows(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same lists as CSR, built row by row in plain Python (independent of the package)."""
    flat, ptr = [], [0]
    for row in ids.tolist():
        flat += row
        ptr.append(len(flat))
    return (torch.tensor(flat, dtype=ids.dtype, device=ids.device),
            torch.tensor(ptr, dtype=ids.dtype, device=ids.device))  # fmt: skip


def _check(case: DenseCase, out=None, **kw) -> torch.Tensor:
    out = poisoned_like(case.q) if out is None else out
    got = sparse_mla_prefill(*case.args(), attn_sink=case.attn_sink, out=out, **kw)
    assert got is out
    rep = check_against_reference(out, *case.args(), attn_sink=case.attn_sink)
    assert rep.ok, rep
    N = case.kv.shape[0]
    empty = (~((case.ids >= 0) & (case.ids < N))).all(dim=1)
    assert torch.all(out[empty] == 0), "a token with no valid id gets zeros"
    return out


# ----------------------------------------------------------------------------------------------
# CPU (interpreter)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_dense_reference_equals_csr_reference_of_the_same_lists(index_dtype):
    case = make_dense_case(9, 4, 32, 13, index_dtype=index_dtype, seed=3)
    idx, ptr = csr_by_rows(case.ids)
    dense = sparse_mla_prefill_ref(*case.args(), attn_sink=case.attn_sink)
    csr = sparse_mla_prefill_ref(case.q, case.kv, idx, ptr, case.softmax_scale,
                                 attn_sink=case.attn_sink)  # fmt: skip
    assert not torch.isnan(dense).any()
    torch.testing.assert_close(dense, csr, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("T", "H", "D", "K", "dtype", "index_dtype", "sink"),
    [
        (7, 4, 32, 40, torch.bfloat16, torch.int32, True),
        (5, 16, 64, 33, torch.float16, torch.int64, False),
        (6, 3, 32, 1, torch.bfloat16, torch.int64, True),  # K = 1; H not a power of two
        (4, 8, 16, 70, torch.float16, torch.int32, True),  # several tiles a row
    ],
)
def test_dense_matches_reference(T, H, D, K, dtype, index_dtype, sink):
    case = make_dense_case(T, H, D, K, dtype=dtype, index_dtype=index_dtype, sink=sink,
                           seed=T * 31 + K)  # fmt: skip
    _check(case)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_dense_equals_equivalent_csr_bitwise_triton(index_dtype):
    case = make_dense_case(8, 16, 32, 45, index_dtype=index_dtype, seed=5)
    dense = _check(case)
    idx, ptr = csr_by_rows(case.ids)
    csr = sparse_mla_prefill(case.q, case.kv, idx, ptr, case.softmax_scale,
                             attn_sink=case.attn_sink)  # fmt: skip
    assert torch.equal(dense, csr)


def test_dense_out_views_and_strided_ids():
    case = make_dense_case(5, 8, 32, 21, seed=9)
    want = _check(case)
    T, H, D = case.q.shape
    big = torch.full((T + 2, 2 * H, D), float("nan"), dtype=case.q.dtype)
    view = big[1 : T + 1, 3 : 3 + H]  # out= a view inside a larger buffer
    got = sparse_mla_prefill(*case.args(), attn_sink=case.attn_sink, out=view)
    assert got is view and torch.equal(view, want)
    assert torch.isnan(big[0]).all() and torch.isnan(big[:, :3]).all(), "wrote outside out"
    # Ids of other strides (a column slice of a wider top-k buffer; a transposed view) are
    # copied to contiguous first: the same result.
    wide = torch.full((T, 64), 5, dtype=case.ids.dtype)
    wide[:, :21] = case.ids
    got = sparse_mla_prefill(case.q, case.kv, wide[:, :21], None, case.softmax_scale,
                             attn_sink=case.attn_sink)  # fmt: skip
    assert torch.equal(got, want)
    tr = case.ids.t().contiguous().t()
    assert not tr.is_contiguous()
    got = sparse_mla_prefill(case.q, case.kv, tr, None, case.softmax_scale,
                             attn_sink=case.attn_sink)  # fmt: skip
    assert torch.equal(got, want)


@pytest.mark.parametrize("sink", [True, False])
def test_dense_empty_forms(sink):
    case = make_dense_case(4, 4, 32, 9, sink=sink, seed=2)
    s = case.attn_sink
    # Every row all absent, K = 0, an empty pool: zeros, written over a poisoned out.
    for ids, kv in (
        (torch.full_like(case.ids, -1), case.kv),
        (case.ids[:, :0], case.kv),
        (case.ids, case.kv[:0]),
    ):
        out = poisoned_like(case.q)
        sparse_mla_prefill(case.q, kv, ids, None, case.softmax_scale, attn_sink=s, out=out)
        assert torch.equal(out, torch.zeros_like(out))
    # T = 0.
    q0 = case.q[:0]
    got = sparse_mla_prefill(q0, case.kv, case.ids[:0], None, case.softmax_scale, attn_sink=s)
    assert got.shape == q0.shape


def test_dense_nan_output_never_survives_and_validate_true():
    case = make_dense_case(6, 4, 32, 17, seed=12)
    out = _check(case, validate=True)  # no kv_indptr: nothing to check, and no error
    assert not torch.isnan(out).any()


def _good_dense():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 4, 32, generator=g).bfloat16()
    kv = torch.randn(10, 32, generator=g).bfloat16()
    ids = torch.tensor([[1, 2, -1], [3, -1, -1], [9, 0, 4]], dtype=torch.int32)
    return q, kv, ids


@pytest.mark.parametrize(
    ("change", "exc", "needle"),
    [
        (lambda q, kv, ids: (q, kv, ids, torch.tensor([0, 3, 6, 9])), ValueError,
         r"kv_indices is 2-D .* \(the dense \[T, K\] form\) but a kv_indptr was given"),
        (lambda q, kv, ids: (q, kv, ids.flatten(), None), ValueError,
         "kv_indptr is None, so kv_indices must be the dense"),
        (lambda q, kv, ids: (q, kv, ids[:2], None), ValueError, "must have T = 3 rows"),
        (lambda q, kv, ids: (q, kv, ids.float(), None), TypeError, "kv_indices must be int32"),
        (lambda q, kv, ids: (q, kv, ids[None], None), ValueError,
         r"kv_indices must be a 1-D tensor with kv_indptr, or a \[T, K\] tensor"),
        (lambda q, kv, ids: (q, kv, ids.to(torch.int16), None), TypeError, "int32 or int64"),
    ],
)  # fmt: skip
def test_dense_bad_input_is_named_and_out_untouched(change, exc, needle):
    q, kv, ids = _good_dense()
    out = torch.full_like(q, 7.0)
    args = change(q, kv, ids)
    for _ in range(2):  # the second call may take the known-layout path: the same answer
        with pytest.raises(exc, match=needle):
            sparse_mla_prefill(*args, 0.125, out=out)
        assert torch.equal(out, torch.full_like(q, 7.0))


def test_dense_scale_is_required_and_out_overlapping_ids_is_refused():
    q, kv, ids = _good_dense()
    with pytest.raises(TypeError, match="softmax_scale is required"):
        sparse_mla_prefill(q, kv, ids)
    sparse_mla_prefill(q, kv, ids, None, 0.125)  # records the layout
    buf = torch.zeros(q.numel() * 2, dtype=torch.bfloat16)
    out = buf[: q.numel()].view(q.shape)
    ids_on_out = buf.view(torch.int32)[: ids.numel()].view(ids.shape)
    ids_on_out.copy_(ids)
    for _ in range(2):
        with pytest.raises(ValueError, match="out overlaps kv_indices"):
            sparse_mla_prefill(q, kv, ids_on_out, None, 0.125, out=out)


def test_dense_as_csr():
    ids = torch.arange(12, dtype=torch.int32).view(4, 3)
    flat, ptr = validation.dense_as_csr(ids)
    assert torch.equal(flat, ids.flatten()) and flat.data_ptr() == ids.data_ptr()
    assert ptr.dtype == torch.int32 and ptr.tolist() == [0, 3, 6, 9, 12]
    flat, ptr = validation.dense_as_csr(ids[:, :0].contiguous())
    assert flat.numel() == 0 and ptr.tolist() == [0] * 5
    flat, ptr = validation.dense_as_csr(ids.to(torch.int64))
    assert ptr.dtype == torch.int64
    # T x K past int32: int64 offsets (a meta tensor: no memory).
    big = torch.empty(2**16, 2**15 + 1, dtype=torch.int32, device="meta")
    assert validation.dense_as_csr(big)[1].dtype == torch.int64


def test_dense_launch_csr_keeps_one_kv_indptr_and_never_frees_it(monkeypatch):
    """validation._dense_launch_csr: the ids as they are and a kv_indptr whose entries 0..T are
    dense_as_csr's, kept per (K, dtype, device) and reused by calls with fewer tokens (the same
    tensor: no torch op); more tokens add a longer one (at least twice) beside the kept ones,
    which stay alive; int32 offsets stop where they would pass 2^31; K = 0 gives zeros."""
    monkeypatch.setattr(validation, "_DENSE_PTRS", {})
    cpu = torch.device("cpu")
    ids = torch.randint(-1, 50, (6, 5), dtype=torch.int32)
    got, ptr = validation._dense_launch_csr(ids)
    assert got is ids and ptr.dtype == torch.int32
    assert torch.equal(ptr[:7], validation.dense_as_csr(ids)[1])
    small = torch.randint(-1, 50, (2, 5), dtype=torch.int32)
    assert validation._dense_launch_csr(small)[1] is ptr  # kept, reused
    bigger = torch.randint(-1, 50, (9, 5), dtype=torch.int32)
    _, ptr2 = validation._dense_launch_csr(bigger)
    assert ptr2.numel() >= 14 and torch.equal(ptr2[:10], validation.dense_as_csr(bigger)[1])
    assert validation._DENSE_PTRS[(5, torch.int32, cpu)] == [ptr, ptr2]  # both alive
    assert validation._dense_launch_csr(ids)[1] is ptr2
    _, p64 = validation._dense_launch_csr(ids.long())  # another dtype: its own
    assert p64.dtype == torch.int64 and torch.equal(p64[:7], torch.arange(7) * 5)
    _, p0 = validation._dense_launch_csr(ids[:, :0].contiguous())
    assert p0.numel() >= 7 and not p0.any()
    wide = torch.randint(-1, 50, (6, 8), dtype=torch.int32)
    view, _ = validation._dense_launch_csr(wide[:, :5])  # not contiguous: made so
    assert view.is_contiguous() and torch.equal(view, wide[:, :5])
    # int32 offsets never overflow: doubling a kept one stops at (2^31 - 1) // K + 1 entries
    # (meta tensors: no memory; 2000 x 2^20 ids still take int32 offsets)
    meta = torch.device("meta")
    K = 2**20
    validation._DENSE_PTRS[(K, torch.int32, meta)] = [torch.empty(1500, dtype=torch.int32,
                                                                  device=meta)]  # fmt: skip
    _, cap = validation._dense_launch_csr(torch.empty(2000, K, dtype=torch.int32, device=meta))
    assert cap.dtype == torch.int32 and cap.numel() == (2**31 - 1) // K + 1 >= 2001


@pytest.fixture
def csr_only_spy():
    """A kernel that reads CSR only (``dense_ids`` False) and runs the Triton kernel: the entry
    must hand it the CSR form of dense ids."""
    seen = []
    base = dispatch.kernel("triton")

    def run(q, kv, kv_indices, kv_indptr, *rest):
        seen.append((kv_indices, kv_indptr))
        return base.run(q, kv, kv_indices, kv_indptr, *rest)

    dispatch.register(dataclasses.replace(base, name="csr_only_spy", run=run, dense_ids=False,
                                          config_type=None))  # fmt: skip
    yield seen
    del dispatch.KERNELS["csr_only_spy"]


def test_dense_to_a_kernel_that_reads_csr_only(csr_only_spy):
    case = make_dense_case(5, 4, 32, 11, index_dtype=torch.int64, seed=8)
    want = _check(case, config=dispatch.Choice("triton"))
    got = _check(case, config=dispatch.Choice("csr_only_spy"))
    (idx, ptr), = csr_only_spy  # fmt: skip
    # the ids as they are (the kernel reads their address and numel, the flattened view's) and
    # a kept kv_indptr whose entries 0..T are the CSR offsets (validation._dense_launch_csr)
    assert idx is case.ids and idx.is_contiguous()
    assert ptr.dtype == torch.int64 and ptr[:6].tolist() == [11 * t for t in range(6)]
    assert torch.equal(got, want)


def test_registry_says_which_kernels_read_dense_ids():
    assert dispatch.kernel("triton").dense_ids
    assert dispatch.kernel("gluon_ws").dense_ids and dispatch.kernel("gluon_ws_small").dense_ids
    assert not dispatch.kernel("gluon_mma").dense_ids
    assert not dispatch.kernel("gluon_wgmma").dense_ids
    assert not dispatch.kernel("triton_fp8").dense_ids
    assert dispatch.kernel("gluon_ws_fp8").dense_ids
    assert dispatch.kernel("gluon_ws_small_fp8").dense_ids


def test_dense_fp8_cache_through_the_entry():
    from test_fp8_prefill import make_fp8_case

    from sparse_mla import fp8

    c = make_fp8_case(5, 8, num_blocks=3, block_size=4, max_slots=9, seed=4)
    ptr = c.kv_indptr.tolist()
    K = max(b - a for a, b in itertools.pairwise(ptr)) + 3
    ids = torch.full((5, K), -1, dtype=c.kv_indices.dtype)
    for t in range(5):  # the same lists, -1 padded to K
        row = c.kv_indices[ptr[t] : ptr[t + 1]]
        ids[t, : row.numel()] = row
    out = poisoned_like(c.q)
    got = sparse_mla_prefill(c.q, c.cache, ids, None, c.softmax_scale, attn_sink=c.attn_sink,
                             out=out)  # fmt: skip
    assert got is out and not torch.isnan(out).any()
    rows = fp8.dequantize(c.cache)
    rep = check_against_reference(out, c.q, rows, ids, None, c.softmax_scale,
                                  attn_sink=c.attn_sink)  # fmt: skip
    assert rep.ok, rep
    csr = sparse_mla_prefill(*c.args(), attn_sink=c.attn_sink)
    assert torch.equal(out, csr)


def test_dense_under_torch_compile_fullgraph():
    case = make_dense_case(4, 4, 32, 10, seed=21)

    def f(q, kv, ids, sink):
        return sparse_mla_prefill(q * 0.5, kv, ids, None, 32**-0.5, attn_sink=sink).float() + 1

    eager = f(case.q, case.kv, case.ids, case.attn_sink)
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    got = compiled(case.q, case.kv, case.ids, case.attn_sink)
    assert torch.equal(got, eager)
    ref = sparse_mla_prefill_ref(case.q * 0.5, case.kv, case.ids, None, 32**-0.5,
                                 attn_sink=case.attn_sink)  # fmt: skip
    assert (got - 1 - ref).abs().max() < 0.05
    op = torch.ops.sparse_mla.prefill.default
    out = poisoned_like(case.q)
    torch.library.opcheck(op, (*case.args(), case.attn_sink, out, None, None))


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------

NAMES = [n for n, k in dispatch.KERNELS.items() if k.kv_format == "dense"]


def _runnable(name: str, H: int, kv: torch.Tensor) -> None:
    call = dispatch.Call(runtime.arch(), H, 512, torch.bfloat16, kv)
    why = dispatch.kernel(name).unavailable(call)
    if why and runtime.arch() == "sm90":
        pytest.fail(f"{name} refuses H={H} on sm90: {why}")
    if why:
        pytest.skip(f"{name}: {why}")


@pytest.mark.gpu
@pytest.mark.parametrize("H", [16, 20, 64, 100, 128])
@pytest.mark.parametrize("name", NAMES)
def test_gpu_every_kernel_dense(name, H):
    # T = 150: at least one program per SM, so no kernel splits its lists (few compiles).
    for T, K, index_dtype, sink in ((150, 200, torch.int32, True), (150, 130, torch.int64, False)):
        case = make_dense_case(T, H, 512, K, N=3000, index_dtype=index_dtype, sink=sink,
                               seed=H * 7 + T, device="cuda")  # fmt: skip
        _runnable(name, H, case.kv)
        out = _check(case, config=dispatch.Choice(name))
        again = _check(case, config=dispatch.Choice(name))
        assert torch.equal(out, again), f"{name} H={H}: repeat calls differ"


# (kernel, H, T, K) of the bitwise cases of the kernels that read dense ids (test_dense_lengths
# takes them too)
BITWISE_CASES = [
    ("gluon_ws", 64, 40, 640),  # a small call (SMALL): the small-call order
    ("gluon_ws", 128, 64, 1152),
    ("gluon_ws", 100, 700, 640),  # a large call: the steady-state order, clipped heads
    ("gluon_ws_small", 16, 50, 640),
    ("gluon_ws_small", 32, 500, 640),  # two head groups
    ("gluon_ws_small", 5, 20, 1),
    ("triton", 64, 30, 640),
]


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize(("name", "H", "T", "K"), BITWISE_CASES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_gpu_dense_equals_equivalent_csr_bitwise(name, H, T, K, index_dtype):
    case = make_dense_case(T, H, 512, K, N=4000, index_dtype=index_dtype, seed=T + H + K,
                           device="cuda")  # fmt: skip
    assert dispatch.kernel(name).dense_ids
    dense = _check(case, config=dispatch.Choice(name))
    idx, ptr = csr_by_rows(case.ids)
    csr = poisoned_like(case.q)
    sparse_mla_prefill(case.q, case.kv, idx, ptr, case.softmax_scale, attn_sink=case.attn_sink,
                       out=csr, config=dispatch.Choice(name))  # fmt: skip
    assert torch.equal(dense, csr), f"{name}: dense and CSR differ"


@pytest.mark.gpu
@pytest.mark.sm90
def test_gpu_default_on_dense_ids_and_out_views():
    case = make_dense_case(64, 128, 512, 256, N=3000, seed=77, device="cuda")
    out = _check(case)  # config=None
    big = torch.full((66, 130, 512), float("nan"), dtype=case.q.dtype, device="cuda")
    view = big[1:65, 1:129]  # not TMA-addressable rows for gluon_ws: its copy path
    got = sparse_mla_prefill(*case.args(), attn_sink=case.attn_sink, out=view)
    assert torch.equal(got, out) and torch.isnan(big[0]).all()
