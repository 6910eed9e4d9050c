"""Dense slot ids with their rows' lengths: ``sparse_mla_prefill(q, kv, ids [T, K], None, scale,
kv_lengths=n)`` (issue 22: an engine's top-k with FlashMLA's ``topk_length``).

Token t's list is ``ids[t, :n[t]]``; ids past a row's length are never read. Every case puts
valid ids of poisoned pool rows (NaN or Inf) past the lengths, so a kernel that reads one leaves
NaN in the output; inside the lengths: ragged rows, absent ids of every kind, duplicates, rows
with no valid id, lengths 0 and K. The reference is the fp32 one with ``kv_lengths``, itself
checked against the CSR reference of the lists cut row by row in plain Python. CPU cases run
the Triton kernel in the interpreter (it reads the lengths itself, ``DENSE_IDS`` = 2) and,
through a spy kernel that reads CSR only, the entry's packing of the lists
(``validation.dense_lengths_csr``). GPU cases (``gpu``; the Gluon kernels ``sm90``): every
registered kernel with lengths, lengths == the cut CSR lists bit for bit for the kernels that
read dense ids, long lists at T = 1-3, plans and CUDA graphs replayed with new lengths, the FP8
cache.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from conftest import poisoned_like
from test_dense_ids import BITWISE_CASES
from test_fp8_prefill import FP8_KERNELS
from test_kernels_gpu import NAMES, _runnable

from sparse_mla import dispatch, validation
from sparse_mla.prefill import sparse_mla_prefill
from sparse_mla.reference import check_against_reference, sparse_mla_prefill_ref


@dataclasses.dataclass
class LengthsCase:
    q: torch.Tensor
    kv: torch.Tensor
    ids: torch.Tensor  # [T, K]
    lengths: torch.Tensor  # [T]
    softmax_scale: float
    attn_sink: torch.Tensor | None

    def args(self):
        return self.q, self.kv, self.ids, None, self.softmax_scale

    def kw(self):
        return {"attn_sink": self.attn_sink, "kv_lengths": self.lengths}


def make_lengths_case(T, H, D, K, *, N=60, P=6, dtype=torch.bfloat16, index_dtype=torch.int32,
                      length_dtype=torch.int32, sink=True, seed=0, first_length=None,
                      device="cpu") -> LengthsCase:  # fmt: skip
    """The pool: N rows, then P poison rows (NaN, Inf) that are valid slots. Inside each row's
    length: random ids of the first N rows, absent ids of every kind, duplicates, some rows all
    absent; past it: ids of the poison rows and absent ids. Lengths random in [0, K], some 0,
    some K (``first_length``: row 0's); every one of the first N rows no id inside a length
    references is poisoned too. A test may shorten lengths (never lengthen them: past each one
    lie poisoned rows)."""
    g = torch.Generator().manual_seed(seed)
    M = N + P
    q = torch.randn(T, H, D, generator=g).to(dtype)
    ids = torch.randint(0, max(N, 1), (T, K), generator=g, dtype=torch.int64)
    n = torch.randint(0, K + 1, (T,), generator=g)
    if T:
        n[torch.randint(0, T, (max(1, T // 5),), generator=g)] = 0
        n[torch.randint(0, T, (max(1, T // 4),), generator=g)] = K
        if first_length is not None:
            n[0] = first_length
    if T and K:
        dup = torch.randint(0, T, (max(1, T // 3),), generator=g)
        ids[dup, 1::2] = ids[dup, :1]
        bad = [-1, M, M + 7, 2**31 - 1, -(2**31)]
        if index_dtype == torch.int64:
            bad += [2**31, 2**33 + 5, 2**62, -(2**40)]
        where = torch.rand(T, K, generator=g) < 0.15
        pick = torch.randint(0, len(bad), (T, K), generator=g)
        ids = torch.where(where, torch.tensor(bad)[pick], ids)
        ids[torch.randint(0, T, (max(1, T // 6),), generator=g)] = -1  # rows all absent
        past = torch.arange(K)[None, :] >= n[:, None]
        poison = torch.randint(N, M, (T, K), generator=g)
        poison = torch.where(torch.rand(T, K, generator=g) < 0.2, -1, poison)
        ids = torch.where(past, poison, ids)
    ids = ids.to(index_dtype)
    buf = torch.full((M + 16, D), float("nan"))
    buf[7 : 7 + N] = torch.randn(N, D, generator=g)
    buf[7 + N + 1 : 7 + M : 2] = float("inf")
    used = torch.zeros(M, dtype=torch.bool)
    inside = torch.arange(K)[None, :] < n[:, None]
    v = ids.long()
    used[v[inside & (v >= 0) & (v < M)]] = True
    assert not used[N:].any()
    for i, r in enumerate((~used[:N]).nonzero().flatten().tolist()):
        buf[7 + r] = float("nan") if i % 2 == 0 else float("inf")
    kv = buf.to(dtype).to(device)[7 : 7 + M]
    attn_sink = (torch.randn(H, generator=g) * 2).to(device) if sink else None
    return LengthsCase(q.to(device), kv, ids.to(device), n.to(length_dtype).to(device), D**-0.5,
                       attn_sink)  # fmt: skip


def cut_rows(ids: torch.Tensor, lengths: torch.Tensor):
    """The CSR form of rows cut to their lengths, built in plain Python."""
    pairs = zip(ids.tolist(), lengths.tolist(), strict=True)
    rows = [row[: max(0, min(int(k), len(row)))] for row, k in pairs]
    flat = [x for r in rows for x in r]
    ptr = [0]
    for r in rows:
        ptr.append(ptr[-1] + len(r))
    return (torch.tensor(flat, dtype=ids.dtype, device=ids.device),
            torch.tensor(ptr, dtype=ids.dtype, device=ids.device))  # fmt: skip


def _check(case: LengthsCase, out=None, **kw) -> torch.Tensor:
    out = poisoned_like(case.q) if out is None else out
    got = sparse_mla_prefill(*case.args(), **case.kw(), out=out, **kw)
    assert got is out
    assert not torch.isnan(out).any(), "an id past a row's length was read (or out unwritten)"
    rep = check_against_reference(out, *case.args(), **case.kw())
    assert rep.ok, rep
    N = case.kv.shape[0]
    K = case.ids.shape[1]
    inside = torch.arange(K, device=case.ids.device)[None, :] < case.lengths[:, None]
    empty = ~(inside & (case.ids >= 0) & (case.ids < N)).any(dim=1)
    assert torch.all(out[empty] == 0), "a token with no valid id in its length gets zeros"
    return out


# ----------------------------------------------------------------------------------------------
# CPU (interpreter)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_lengths_reference_equals_csr_reference_of_cut_lists(index_dtype):
    case = make_lengths_case(11, 4, 32, 13, index_dtype=index_dtype, seed=3)
    idx, ptr = cut_rows(case.ids, case.lengths)
    dense = sparse_mla_prefill_ref(*case.args(), **case.kw())
    csr = sparse_mla_prefill_ref(case.q, case.kv, idx, ptr, case.softmax_scale,
                                 attn_sink=case.attn_sink)  # fmt: skip
    assert not torch.isnan(dense).any()
    torch.testing.assert_close(dense, csr, rtol=0, atol=0)
    # ... and differs from the rows walked to their ends (poison past the lengths)
    full = sparse_mla_prefill_ref(*case.args(), attn_sink=case.attn_sink)
    assert torch.isnan(full).any()


@pytest.mark.parametrize(
    ("T", "H", "D", "K", "dtype", "index_dtype", "length_dtype", "sink"),
    [
        (7, 4, 32, 40, torch.bfloat16, torch.int32, torch.int32, True),
        (5, 16, 64, 33, torch.float16, torch.int64, torch.int32, False),
        (6, 3, 32, 1, torch.bfloat16, torch.int64, torch.int64, True),  # K = 1; odd H
        (4, 8, 16, 70, torch.float16, torch.int32, torch.int64, True),  # several tiles a row
    ],
)
def test_lengths_match_reference(T, H, D, K, dtype, index_dtype, length_dtype, sink):
    case = make_lengths_case(T, H, D, K, dtype=dtype, index_dtype=index_dtype,
                             length_dtype=length_dtype, sink=sink, seed=T * 31 + K)  # fmt: skip
    _check(case)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_lengths_equal_cut_csr_bitwise_triton(index_dtype):
    case = make_lengths_case(8, 16, 32, 45, index_dtype=index_dtype, seed=5)
    dense = _check(case)
    idx, ptr = cut_rows(case.ids, case.lengths)
    csr = sparse_mla_prefill(case.q, case.kv, idx, ptr, case.softmax_scale,
                             attn_sink=case.attn_sink)  # fmt: skip
    assert torch.equal(dense, csr)


def test_dense_lengths_csr_packs_the_cut_lists():
    g = torch.Generator().manual_seed(4)
    for T, K, dt in ((9, 7, torch.int32), (5, 1, torch.int64), (6, 0, torch.int32)):
        ids = torch.randint(-2, 30, (T, K), generator=g, dtype=dt)
        n = torch.randint(-3, K + 4, (T,), generator=g)  # out of range: clamped to [0, K]
        flat, ptr = validation.dense_lengths_csr(ids, n)
        want_idx, want_ptr = cut_rows(ids, n)
        assert ptr.dtype == dt and flat.dtype == dt and flat.numel() == T * K
        assert torch.equal(ptr, want_ptr.to(dt))
        assert torch.equal(flat[: int(ptr[-1])], want_idx)
    flat, ptr = validation.dense_lengths_csr(torch.empty(0, 5, dtype=torch.int32),
                                             torch.empty(0, dtype=torch.int32))  # fmt: skip
    assert flat.numel() == 0 and ptr.tolist() == [0]


def test_dense_form_tells_the_launch_forms_apart():
    """Below the entry a 2-D kv_indices with [T] lengths is dense with lengths; with a kv_indptr
    of T + 1 entries or more (the CSR view of dense rows made for CSR-only kernels) it is CSR."""
    ids = torch.zeros(4, 3, dtype=torch.int32)
    assert validation.dense_form(ids.flatten(), torch.arange(5)) == 0
    assert validation.dense_form(ids, None) == 1
    assert validation.dense_form(ids, torch.ones(4, dtype=torch.int32)) == 2
    assert validation.dense_form(*validation.dense_as_csr(ids)) == 0
    assert validation.dense_form(*validation._dense_launch_csr(ids)) == 0
    assert validation.dense_form(ids[:0], torch.zeros(0, dtype=torch.int32)) == 2
    assert validation.dense_form(*validation._dense_launch_csr(ids[:0].contiguous())) == 0


@pytest.fixture
def csr_only_spy():
    """A kernel that reads CSR only (``dense_ids`` False) and runs the Triton kernel."""
    seen = []
    base = dispatch.kernel("triton")

    def run(q, kv, kv_indices, kv_indptr, *rest):
        seen.append((kv_indices, kv_indptr))
        return base.run(q, kv, kv_indices, kv_indptr, *rest)

    dispatch.register(dataclasses.replace(base, name="csr_only_spy_len", run=run,
                                          dense_ids=False, config_type=None))  # fmt: skip
    yield seen
    del dispatch.KERNELS["csr_only_spy_len"]


def test_lengths_to_a_kernel_that_reads_csr_only(csr_only_spy):
    case = make_lengths_case(9, 4, 32, 11, index_dtype=torch.int64, seed=8)
    want = _check(case, config=dispatch.Choice("triton"))
    got = _check(case, config=dispatch.Choice("csr_only_spy_len"))
    ((idx, ptr),) = csr_only_spy
    assert idx.dim() == 1 and ptr.dtype == torch.int64
    cut_idx, cut_ptr = cut_rows(case.ids, case.lengths)
    assert torch.equal(ptr, cut_ptr) and torch.equal(idx[: int(ptr[-1])], cut_idx)
    assert torch.equal(got, want)


def _good():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 4, 32, generator=g).bfloat16()
    kv = torch.randn(10, 32, generator=g).bfloat16()
    ids = torch.tensor([[1, 2, -1], [3, -1, -1], [9, 0, 4]], dtype=torch.int32)
    n = torch.tensor([2, 1, 3], dtype=torch.int32)
    return q, kv, ids, n


@pytest.mark.parametrize(
    ("change", "exc", "needle"),
    [
        (lambda q, kv, ids, n: ((q, kv, ids, torch.tensor([0, 3, 6, 9])), n), ValueError,
         "kv_lengths goes with the dense form .* but a kv_indptr was given too"),
        (lambda q, kv, ids, n: ((q, kv, ids.flatten(), torch.tensor([0, 3, 6, 9])), n),
         ValueError, "kv_lengths goes with the dense form"),
        (lambda q, kv, ids, n: ((q, kv, ids.flatten(), None), n), ValueError,
         r"kv_lengths goes with dense \[T, K\] kv_indices, got .* shape \(9,\)"),
        (lambda q, kv, ids, n: ((q, kv, ids, None), n[:2]), ValueError,
         "kv_lengths must have T = 3 entries"),
        (lambda q, kv, ids, n: ((q, kv, ids, None), n[None]), ValueError,
         "kv_lengths must be a 1-D tensor"),
        (lambda q, kv, ids, n: ((q, kv, ids, None), n.float()), TypeError,
         "kv_lengths must be int32 or int64"),
        (lambda q, kv, ids, n: ((q, kv, ids, None), [2, 1, 3]), ValueError,
         "kv_lengths must be a 1-D tensor, got list"),
        (lambda q, kv, ids, n: ((q, kv, ids, None), torch.tensor([2, -1, 3])), ValueError,
         r"kv_lengths\[1\] = -1 is outside \[0, K = 3\]"),
        (lambda q, kv, ids, n: ((q, kv, ids, None), torch.tensor([2, 1, 4])), ValueError,
         r"kv_lengths\[2\] = 4 is outside \[0, K = 3\]"),
    ],
)  # fmt: skip
def test_lengths_bad_input_is_named_and_out_untouched(change, exc, needle):
    q, kv, ids, n = _good()
    out = torch.full_like(q, 7.0)
    args, lengths = change(q, kv, ids, n)
    for _ in range(2):  # the second call may take the known-layout path: the same answer
        with pytest.raises(exc, match=needle):
            sparse_mla_prefill(*args, 0.125, out=out, kv_lengths=lengths)
        assert torch.equal(out, torch.full_like(q, 7.0))


def test_lengths_values_checked_on_request_and_clamped_unchecked():
    case = make_lengths_case(6, 4, 32, 9, seed=14)
    want = _check(case)
    wild = case.lengths.clone()
    wild[case.lengths == 0] = -5
    wild[case.lengths == 9] = 9 + 7  # a length past K is K, below 0 is 0
    assert not torch.equal(wild, case.lengths)
    with pytest.raises(ValueError, match="is outside"):
        sparse_mla_prefill(*case.args(), attn_sink=case.attn_sink, kv_lengths=wild)
    out = poisoned_like(case.q)
    sparse_mla_prefill(*case.args(), attn_sink=case.attn_sink, kv_lengths=wild, out=out,
                       validate=False)  # fmt: skip
    assert torch.equal(out, want)


@pytest.mark.parametrize("sink", [True, False])
def test_lengths_empty_forms(sink):
    case = make_lengths_case(5, 4, 32, 9, sink=sink, seed=2)
    s = case.attn_sink
    zeros = torch.zeros_like(case.lengths)
    # Every length 0; K = 0; an empty pool: zeros over a poisoned out.
    for ids, kv, n in (
        (case.ids, case.kv, zeros),
        (case.ids[:, :0], case.kv, zeros),
        (case.ids, case.kv[:0], case.lengths),
    ):
        out = poisoned_like(case.q)
        sparse_mla_prefill(case.q, kv, ids, None, case.softmax_scale, attn_sink=s, out=out,
                           kv_lengths=n)  # fmt: skip
        assert torch.equal(out, torch.zeros_like(out))
    got = sparse_mla_prefill(case.q[:0], case.kv, case.ids[:0], None, case.softmax_scale,
                             attn_sink=s, kv_lengths=case.lengths[:0])  # fmt: skip
    assert got.shape == case.q[:0].shape


def test_lengths_fp8_cache_through_the_entry():
    from test_fp8_prefill import make_fp8_case

    from sparse_mla import fp8

    c = make_fp8_case(6, 8, num_blocks=3, block_size=4, max_slots=9, seed=4)
    n_slots = c.cache.num_slots
    ptr = c.kv_indptr.tolist()
    v = c.kv_indices.long()
    used = torch.zeros(n_slots, dtype=torch.bool)
    used[v[(v >= 0) & (v < n_slots)]] = True
    poison = (~used).nonzero().flatten()  # make_fp8_case's 0xFF slots
    assert poison.numel()
    lens = [b - a for a, b in itertools.pairwise(ptr)]
    K = max(lens) + 4
    g = torch.Generator().manual_seed(2)
    ids = poison[torch.randint(0, poison.numel(), (6, K), generator=g)].to(c.kv_indices.dtype)
    for t in range(6):  # each CSR list, then poisoned slots past its length
        ids[t, : lens[t]] = c.kv_indices[ptr[t] : ptr[t + 1]]
    n = torch.tensor(lens, dtype=torch.int32)
    out = poisoned_like(c.q)
    got = sparse_mla_prefill(c.q, c.cache, ids, None, c.softmax_scale, attn_sink=c.attn_sink,
                             out=out, kv_lengths=n)  # fmt: skip
    assert got is out and not torch.isnan(out).any()
    rows = fp8.dequantize(c.cache)
    rep = check_against_reference(out, c.q, rows, ids, None, c.softmax_scale,
                                  attn_sink=c.attn_sink, kv_lengths=n)  # fmt: skip
    assert rep.ok, rep
    csr = sparse_mla_prefill(*c.args(), attn_sink=c.attn_sink)
    assert torch.equal(out, csr)


def test_lengths_under_torch_compile_fullgraph():
    case = make_lengths_case(4, 4, 32, 10, seed=21)

    def f(q, kv, ids, n, sink):
        return sparse_mla_prefill(q * 0.5, kv, ids, None, 32**-0.5, attn_sink=sink,
                                  kv_lengths=n).float() + 1  # fmt: skip

    eager = f(case.q, case.kv, case.ids, case.lengths, case.attn_sink)
    assert not torch.isnan(eager).any()
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    got = compiled(case.q, case.kv, case.ids, case.lengths, case.attn_sink)
    assert torch.equal(got, eager)
    ref = sparse_mla_prefill_ref(case.q * 0.5, case.kv, case.ids, None, 32**-0.5,
                                 attn_sink=case.attn_sink, kv_lengths=case.lengths)  # fmt: skip
    assert (got - 1 - ref).abs().max() < 0.05
    op = torch.ops.sparse_mla.prefill.default  # the lengths travel in kv_indptr's place
    out = poisoned_like(case.q)
    args = (case.q, case.kv, case.ids, case.lengths, case.softmax_scale, case.attn_sink, out)
    torch.library.opcheck(op, (*args, None, None))


@pytest.mark.parametrize("name", ["gluon_ws", "gluon_ws_small"])
def test_lengths_builds_cross_compile_with_one_more_load(name):
    """The sm90 kernels that read dense ids build with ``DENSE_IDS`` = 2 (the row's length,
    one load an item) without spills; the dense build without lengths has no such load."""
    import re

    from sparse_mla import inspect
    from sparse_mla.gluon import launch

    loads = r"ld\.global(?:\.[a-z0-9]+)*\.b32"
    with_len = launch.compile_for("prefill", "sm90", name, dense=2)
    plain = launch.compile_for("prefill", "sm90", name, dense=True)
    assert inspect.resources_of(with_len, "sm90").spill_bytes == 0
    n_len = len(re.findall(loads, with_len.asm["ptx"]))
    n_plain = len(re.findall(loads, plain.asm["ptx"]))
    assert n_len > n_plain, (n_len, n_plain)


@pytest.mark.parametrize(("name", "H"), [("triton", 16), ("gluon_ws", 64),
                                       ("gluon_ws_small_fp8", 16)])  # fmt: skip
def test_inspect_compiles_each_ids_form(name, H):
    """``inspect.compile_kernel(dense=...)`` (``sparse-mla isa --ids``) builds the form a launch
    reads: the lengths build loads each row's length, the dense build no kv_indptr, so the
    three builds' global 32-bit loads differ; a kernel that reads CSR only refuses the dense
    forms by name."""
    import re

    from sparse_mla import inspect

    loads = r"ld\.global(?:\.[a-z0-9]+)*\.b32"
    counts = {}
    for form in ("csr", "dense", "lengths"):
        _, res = inspect.compile_kernel(name, "sm90", num_heads=H, dense=form)
        counts[form] = len(re.findall(loads, res.asm["ptx"]))
    assert counts["lengths"] > counts["dense"], counts
    assert counts["csr"] != counts["dense"], counts
    with pytest.raises(ValueError, match="gluon_mma reads CSR lists only"):
        inspect.compile_kernel("gluon_mma", "sm90", num_heads=16, dense=1)
    with pytest.raises(ValueError, match="dense"):
        inspect.compile_kernel(name, "sm90", num_heads=H, dense="rows")


def test_isa_cli_prints_a_lengths_build(capsys):
    from sparse_mla.cli import main

    args = ["isa", "--target", "sm90", "--kernel", "gluon_ws_small", "--heads", "16"]
    assert main([*args, "--ids", "lengths"]) == 0
    text = capsys.readouterr().out
    assert "kernel: gluon_ws_small" in text
    assert main([*args, "--ids", "lengths", "--asm", "ttgir"]) == 0
    with_len = capsys.readouterr().out
    assert main([*args, "--asm", "ttgir"]) == 0
    csr = capsys.readouterr().out
    assert with_len != csr


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("H", [16, 20, 64, 100, 128])
@pytest.mark.parametrize("name", NAMES)
def test_gpu_every_kernel_lengths(name, H):
    for T, K, index_dtype, length_dtype, sink in (
        (150, 200, torch.int32, torch.int32, True),
        (150, 130, torch.int64, torch.int64, False),
        (9, 700, torch.int32, torch.int64, True),  # few tokens: split / small-call orders
    ):
        case = make_lengths_case(T, H, 512, K, N=3000, index_dtype=index_dtype,
                                 length_dtype=length_dtype, sink=sink, seed=H * 7 + T,
                                 device="cuda")  # fmt: skip
        _runnable(name, H, case.kv)
        out = _check(case, config=dispatch.Choice(name))
        again = _check(case, config=dispatch.Choice(name))
        assert torch.equal(out, again), f"{name} H={H}: repeat calls differ"


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize(("name", "H", "T", "K"), BITWISE_CASES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_gpu_lengths_equal_cut_csr_bitwise(name, H, T, K, index_dtype):
    case = make_lengths_case(T, H, 512, K, N=4000, index_dtype=index_dtype, seed=T + H + K,
                             device="cuda")  # fmt: skip
    assert dispatch.kernel(name).dense_ids
    dense = _check(case, config=dispatch.Choice(name))
    idx, ptr = cut_rows(case.ids, case.lengths)
    # kv_indices padded to T x K entries past kv_indptr[T] (never read): the split rule reads
    # nnz, so both calls cut their lists into the same pieces
    idx = torch.cat([idx, idx.new_full((T * K - idx.numel(),), -1)])
    csr = poisoned_like(case.q)
    sparse_mla_prefill(case.q, case.kv, idx, ptr, case.softmax_scale, attn_sink=case.attn_sink,
                       out=csr, config=dispatch.Choice(name))  # fmt: skip
    assert torch.equal(dense, csr), f"{name}: dense with lengths and the cut CSR lists differ"


@pytest.mark.gpu
@pytest.mark.parametrize("name", [None, *NAMES])
@pytest.mark.parametrize("H", [8, 64, 128])
def test_gpu_lengths_long_lists_few_tokens(name, H):
    """T of 1-3 with 9,000-slot rows (lengths up to 9,000): the split schedules."""
    for T in (1, 2, 3):  # row 0 cut inside its last tile
        case = make_lengths_case(T, H, 512, 9000, N=20000, seed=T * 100 + H, device="cuda",
                                 first_length=9000 - 37)  # fmt: skip
        if name is not None:
            _runnable(name, H, case.kv)
        _check(case, **({} if name is None else {"config": dispatch.Choice(name)}))


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("H", [16, 128])
def test_gpu_default_replays_with_new_lengths_and_under_cuda_graphs(H):
    """config=None: a repeated layout replays its plan, and a CUDA graph its launch; new lengths
    (values and tensors) must be read by both."""
    case = make_lengths_case(64, H, 512, 640, N=3000, seed=H, device="cuda")

    def shorter():  # new lengths, each at most the case's (past those lie poisoned rows)
        frac = torch.rand(64, device="cuda")
        return (case.lengths.float() * frac).to(torch.int32)

    for i in range(4):  # new length tensors every call, same layout: the plan's replay
        n = shorter()
        n[i] = 0
        _check(dataclasses.replace(case, lengths=n))
    n = case.lengths.clone()
    out = poisoned_like(case.q)
    sparse_mla_prefill(*case.args(), attn_sink=case.attn_sink, kv_lengths=n, out=out)  # warm
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sparse_mla_prefill(*case.args(), attn_sink=case.attn_sink, kv_lengths=n, out=out)
    for i in range(3):
        n.copy_(shorter())
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = dataclasses.replace(case, lengths=n.clone())
        assert not torch.isnan(out).any()
        rep = check_against_reference(out, *want.args(), **want.kw())
        assert rep.ok, f"graph replay {i}: {rep}"


def _fp8_ids_past_lengths(case, K, *, seed, empty, full, out_of_range=False):
    """Dense ids [T, K] into ``case``'s FP8 cache with their rows' lengths [T] (CPU tensors)
    and the mask of the entries past each length. Inside a length: random slots the case's
    lists use, 20% absent (-1) and, with ``out_of_range``, 5% the first slot past the cache;
    past it: the case's poisoned slots (0xFF: NaN if read). Row ``empty`` has length 0, row
    ``full`` length K."""
    n_slots = case.cache.num_slots
    v = case.kv_indices.long()
    used = torch.zeros(n_slots, dtype=torch.bool)
    used[v[(v >= 0) & (v < n_slots)]] = True
    good, poison = used.nonzero().flatten(), (~used).nonzero().flatten()
    T = case.q.shape[0]
    g = torch.Generator().manual_seed(seed)
    ids = good[torch.randint(0, good.numel(), (T, K), generator=g)]
    ids[torch.rand(ids.shape, generator=g) < 0.2] = -1
    if out_of_range:
        ids[torch.rand(ids.shape, generator=g) < 0.05] = n_slots
    n = torch.randint(0, K + 1, (T,), generator=g)
    n[empty] = 0
    n[full] = K
    past = torch.arange(K)[None, :] >= n[:, None]
    ids = torch.where(past, poison[torch.randint(0, poison.numel(), ids.shape, generator=g)], ids)
    return ids, n, past


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", [None, *FP8_KERNELS])
@pytest.mark.parametrize("H", [16, 64, 128])
def test_gpu_fp8_lengths(kernel, H):
    """The FP8 cache with dense ids and lengths: poisoned slots past every length."""
    from test_fp8_prefill import _gpu_config, _on, make_fp8_case

    from sparse_mla import fp8

    kw = _gpu_config(kernel)
    case = make_fp8_case(37, H, num_blocks=20, block_size=64, max_slots=10, seed=H)
    ids, n, _ = _fp8_ids_past_lengths(case, 300, seed=H, empty=3, full=5)
    c = _on(case, "cuda")
    ids, n = ids.to(torch.int32).cuda(), n.to(torch.int32).cuda()
    out = poisoned_like(c.q)
    sparse_mla_prefill(c.q, c.cache, ids, None, c.softmax_scale, attn_sink=c.attn_sink, out=out,
                       kv_lengths=n, **kw)  # fmt: skip
    assert not torch.isnan(out).any(), "a poisoned slot past a length was read"
    rep = check_against_reference(out, c.q, fp8.dequantize(c.cache), ids, None, c.softmax_scale,
                                  attn_sink=c.attn_sink, kv_lengths=n)  # fmt: skip
    assert rep.ok, str(rep)
    assert torch.all(out[3] == 0)


def test_mla_gluon_takes_kv_lengths_and_names_bad_ones():
    """``mla_gluon`` (the Gluon entry) takes the same dense form: its checks run before it
    needs a GPU, so on CPU tensors a good call gets as far as that RuntimeError."""
    from sparse_mla.gluon.launch import mla_gluon

    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 4, 512, generator=g).bfloat16()
    kv = torch.randn(10, 512, generator=g).bfloat16()
    ids = torch.tensor([[1, 2, -1], [3, -1, -1], [9, 0, 4]], dtype=torch.int32)
    n = torch.tensor([2, 1, 3], dtype=torch.int32)
    kw = {"has_pe": False}
    with pytest.raises(ValueError, match="but a kv_indptr was given too"):
        mla_gluon(q, None, kv, None, ids, torch.tensor([0, 3, 6, 9]), 0.1, kv_lengths=n, **kw)
    with pytest.raises(ValueError, match="kv_lengths must have T = 3 entries"):
        mla_gluon(q, None, kv, None, ids, None, 0.1, kv_lengths=n[:2], **kw)
    with pytest.raises(ValueError, match=r"kv_lengths\[0\] = 4 is outside"):
        mla_gluon(q, None, kv, None, ids, None, 0.1, kv_lengths=n + 2, validate=True, **kw)
    with pytest.raises(RuntimeError, match="needs a GPU"):
        mla_gluon(q, None, kv, None, ids, None, 0.1, kv_lengths=n, **kw)
    with pytest.raises(ValueError, match="max_kv_length bounds the rows' kv_lengths"):
        mla_gluon(q, None, kv, None, ids, None, 0.1, max_kv_length=2, **kw)
    with pytest.raises(ValueError, match="max_kv_length must be >= 0"):
        mla_gluon(q, None, kv, None, ids, None, 0.1, kv_lengths=n, max_kv_length=-2, **kw)
    with pytest.raises(RuntimeError, match="needs a GPU"):
        mla_gluon(q, None, kv, None, ids, None, 0.1, kv_lengths=n, max_kv_length=2, **kw)


FP8_DENSE_CASES = [  # (kernel, H, T, launch): the FP8 kernels that read dense ids themselves
    ("gluon_ws_small_fp8", 16, 37, None),
    ("gluon_ws_small_fp8", 32, 400, None),  # two head groups, several items a program
    ("gluon_ws_small_fp8", 8, 300, {"PRODUCERS": 3, "PRODUCER_REGS": 112}),
    ("gluon_ws_small_fp8", 16, 300, {"PRODUCERS": 1, "PRODUCER_REGS": 256, "PIPELINE": True}),
    ("gluon_ws_fp8", 64, 37, None),
    ("gluon_ws_fp8", 100, 400, None),
]


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize(("name", "H", "T", "launch"), FP8_DENSE_CASES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_gpu_fp8_dense_forms_equal_their_csr_bitwise(name, H, T, launch, index_dtype):
    """The FP8 kernels that read dense ids (with and without the rows' lengths) give bit for
    bit what they give on the same lists as CSR; both right against the reference, and no
    poisoned slot past a length is read."""
    from test_fp8_prefill import _on, make_fp8_case

    from sparse_mla import fp8

    assert dispatch.kernel(name).dense_ids
    case = make_fp8_case(T, H, num_blocks=20, block_size=64, max_slots=10, seed=T + H)
    ids, n, past = _fp8_ids_past_lengths(case, 200, seed=T * H, empty=1, full=2,
                                         out_of_range=True)  # fmt: skip
    c = _on(case, "cuda")
    ids, n = ids.to(index_dtype).cuda(), n.to(torch.int32).cuda()
    choice = dispatch.Choice(name, launch)
    rows = fp8.dequantize(c.cache)

    def run(i, p, **kw):
        out = poisoned_like(c.q)
        sparse_mla_prefill(c.q, c.cache, i, p, c.softmax_scale, attn_sink=c.attn_sink, out=out,
                           config=choice, **kw)  # fmt: skip
        return out

    with_len = run(ids, None, kv_lengths=n)
    assert not torch.isnan(with_len).any(), "a poisoned slot past a length was read"
    rep = check_against_reference(with_len, c.q, rows, ids, None, c.softmax_scale,
                                  attn_sink=c.attn_sink, kv_lengths=n)  # fmt: skip
    assert rep.ok, str(rep)
    idx, ptr = validation.dense_lengths_csr(ids.contiguous(), n)
    assert torch.equal(with_len, run(idx, ptr)), f"{name}: dense with lengths and CSR differ"
    # without lengths: every row whole (the poisoned ids made absent first)
    whole = torch.where(past.cuda(), torch.full_like(ids, -1), ids)
    dense = run(whole, None)
    rep = check_against_reference(dense, c.q, rows, whole, None, c.softmax_scale,
                                  attn_sink=c.attn_sink)  # fmt: skip
    assert rep.ok, str(rep)
    T_, K_ = whole.shape
    flat_ptr = torch.arange(0, T_ * K_ + 1, K_, dtype=index_dtype, device="cuda")
    assert torch.equal(dense, run(whole.reshape(-1), flat_ptr)), f"{name}: dense and CSR differ"


# ----------------------------------------------------------------------------------------------
# max_kv_length: the caller's bound on the lengths, for the kernel choice and split count only
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("m", "form", "exc", "needle"),
    [
        (True, "lengths", TypeError, "max_kv_length must be an int or None, got bool"),
        (2.0, "lengths", TypeError, "max_kv_length must be an int or None, got float"),
        ("3", "lengths", TypeError, "max_kv_length must be an int or None, got str"),
        (-1, "lengths", ValueError, "max_kv_length must be >= 0, got -1"),
        (3, "dense", ValueError, "max_kv_length bounds the rows' kv_lengths"),
        (3, "csr", ValueError, "max_kv_length bounds the rows' kv_lengths"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("fp8_cache", [False, True])
def test_max_kv_length_bad_input_is_named_and_out_untouched(m, form, exc, needle, fp8_cache):
    q, kv, ids, n = _good()
    if fp8_cache:
        from sparse_mla import fp8

        q = torch.randn(3, 4, 512, generator=torch.Generator().manual_seed(5)).bfloat16()
        kv = fp8.quantize(torch.randn(10, 512).bfloat16(), block_size=4)
    args = {
        "lengths": (ids, None, n),
        "dense": (ids, None, None),
        "csr": (ids.flatten(), torch.tensor([0, 3, 6, 9]), None),
    }[form]
    out = torch.full_like(q, 7.0)
    for _ in range(2):
        with pytest.raises(exc, match=needle):
            sparse_mla_prefill(q, kv, args[0], args[1], 0.125, out=out, kv_lengths=args[2],
                               max_kv_length=m)  # fmt: skip
        assert torch.equal(out, torch.full_like(q, 7.0))


def test_length_bound_rounds_up_to_whole_tiles_at_most_k():
    import numpy as np

    ids = torch.zeros(3, 1152, dtype=torch.int32)
    n = torch.zeros(3, dtype=torch.int32)
    got = [validation.length_bound(m, ids, n) for m in (0, 1, 64, 65, 193, 1100, 1153, 10**9)]
    assert got == [0, 64, 64, 128, 256, 1152, 1152, 1152]
    assert validation.length_bound(np.int64(200), ids, n) == 256  # an integer scalar of numpy
    assert validation.length_bound(None, ids, n) is None
    assert validation.planned_nnz(ids, 256) == 3 * 256
    assert validation.planned_nnz(ids, None) == 3 * 1152


@pytest.mark.parametrize("m", [0, 3, 9, 10**6])
def test_max_kv_length_never_changes_what_is_read(m):
    """A bound below some lengths (0, 3), at K and past it: every list is still read to its
    length, so the result is the same bit for bit (the interpreter runs one kernel here)."""
    case = make_lengths_case(6, 4, 32, 9, seed=31)
    assert int(case.lengths.max()) == 9 and int(case.lengths.min()) == 0
    want = _check(case)
    assert torch.equal(_check(case, max_kv_length=m), want)


def test_max_kv_length_fp8_cache_reads_every_length():
    from test_fp8_prefill import make_fp8_case

    from sparse_mla import fp8

    c = make_fp8_case(6, 8, num_blocks=3, block_size=4, max_slots=9, seed=4)
    ids, n, _ = _fp8_ids_past_lengths(c, 12, seed=3, empty=1, full=2)
    ids = ids.to(c.kv_indices.dtype)
    outs = []
    for m in (None, 0, 12):
        out = poisoned_like(c.q)
        sparse_mla_prefill(c.q, c.cache, ids, None, c.softmax_scale, attn_sink=c.attn_sink,
                           out=out, kv_lengths=n, max_kv_length=m)  # fmt: skip
        assert not torch.isnan(out).any(), "a poisoned slot past a length was read"
        outs.append(out)
    rep = check_against_reference(outs[0], c.q, fp8.dequantize(c.cache), ids, None,
                                  c.softmax_scale, attn_sink=c.attn_sink, kv_lengths=n)  # fmt: skip
    assert rep.ok, rep
    assert torch.equal(outs[1], outs[0]) and torch.equal(outs[2], outs[0])


@pytest.mark.parametrize("fp8_cache", [False, True])
def test_max_kv_length_is_what_the_choice_sees(monkeypatch, fp8_cache):
    """The entry's kernel choice is asked about T x the rounded bound (not T x K), and the
    kernel's launch gets it as ``nnz`` for its split count; without a bound, T x K."""
    from sparse_mla import fp8_prefill, prefill

    seen = []
    if fp8_cache:
        from test_fp8_prefill import make_fp8_case

        c = make_fp8_case(6, 8, num_blocks=3, block_size=4, max_slots=9, seed=4)
        ids, n, _ = _fp8_ids_past_lengths(c, 200, seed=3, empty=1, full=2)
        q, kv, scale = c.q, c.cache, c.softmax_scale
        real = fp8_prefill.dispatch.choose

        def spy(call, **kw):
            seen.append(call.nnz)
            return real(call, **kw)

        monkeypatch.setattr(fp8_prefill.dispatch, "choose", spy)
    else:
        case = make_lengths_case(6, 4, 32, 200, seed=8)
        q, kv, ids, n, scale = case.q, case.kv, case.ids, case.lengths, case.softmax_scale
        real = prefill.dispatch.choose_cached

        def spy(*a, **kw):
            seen.append(a[6])  # (arch, H, D, dtype, kv, T, nnz)
            return real(*a, **kw)

        monkeypatch.setattr(prefill.dispatch, "choose_cached", spy)
        triton = dispatch.kernel("triton")
        runs = []

        def run(*a, **kw):
            runs.append(kw.get("nnz"))
            return triton.run(*a, **kw)

        monkeypatch.setitem(dispatch.KERNELS, "triton", dataclasses.replace(triton, run=run))
    for m, want in ((None, 6 * 200), (70, 6 * 128), (0, 0), (500, 6 * 200)):
        seen.clear()
        sparse_mla_prefill(q, kv, ids, None, scale, kv_lengths=n, max_kv_length=m)
        assert seen == [want], (m, seen)
    if not fp8_cache:
        assert runs == [None, 6 * 128, 0, 6 * 200]


def test_max_kv_length_plans_a_short_context_as_its_csr_form():
    """What experiments/dense_width.py measured (PERF_NOTES step 38): an engine's fixed-width
    top-k (K = top-k + 128) on a short context, lists of at most ~200 slots, at small T. With
    the bound, the sm90 choice and ``gluon_ws``'s split count are those of the same lists as
    CSR (their true total), at every such point."""
    from sparse_mla import bench
    from sparse_mla.gluon import launch

    ids = torch.zeros(1, 1, dtype=torch.int32)
    for T, H, longest in itertools.product((1, 4, 16), (16, 64, 128), (192, 196)):
        K = bench._grid_topk(H) + 128
        bound = validation.length_bound(longest, ids.expand(T, K), torch.zeros(T))
        plans = []
        for nnz in (T * (longest - 3), validation.planned_nnz(ids.expand(T, K), bound)):
            call = dispatch.Call("sm90", H, 512, torch.bfloat16, None, T, nnz)
            k = dispatch.choose(call).kernel
            plans.append((k, launch.ws_num_splits(T, H, nnz, 132) if k == "gluon_ws" else 1))
        assert plans[1] == plans[0], (T, H, longest, plans)


def test_max_kv_length_keys_the_plan():
    """Two calls of one layout with different bounds may launch differently: the op's plan key
    (and the last-plan shortcut's head) holds the bound."""
    from sparse_mla import op

    case = make_lengths_case(4, 4, 32, 9, seed=2)
    out = poisoned_like(case.q)
    key = [op._plan_key(case.q, case.kv, case.ids, case.lengths, 0.1, None, out, None, b)
           for b in (None, 64, 128)]  # fmt: skip
    assert len(set(key)) == 3


def test_max_kv_length_through_the_op_and_torch_compile():
    case = make_lengths_case(4, 4, 32, 10, seed=21)

    def f(q, kv, ids, n, m):
        return sparse_mla_prefill(q, kv, ids, None, 32**-0.5, attn_sink=case.attn_sink,
                                  kv_lengths=n, max_kv_length=m)  # fmt: skip

    eager = f(case.q, case.kv, case.ids, case.lengths, 3)
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    for m in (3, 7, 64):  # an int the graph takes (no recompile needed to stay right)
        assert torch.equal(compiled(case.q, case.kv, case.ids, case.lengths, m), eager)
    op = torch.ops.sparse_mla.prefill.default
    out = poisoned_like(case.q)
    args = (case.q, case.kv, case.ids, case.lengths, case.softmax_scale, case.attn_sink, out)
    torch.library.opcheck(op, (*args, None, None, 64))


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize(("T", "H"), [(1, 128), (4, 128), (4, 64), (16, 16)])
def test_gpu_max_kv_length_plans_short_lists_as_short(T, H):
    """An engine's fixed-width top-k (K = top-k + 128) on a short context: lengths of at most
    200 (poisoned rows past them). Without a bound ``gluon_ws`` splits the lists as K long (its
    launch and the reduce's); with it the call plans as the lists' CSR form does (one launch:
    no split at these points). Both right, alternately on one layout (the plans replayed), and
    a bound below the lengths right too; ``mla_gluon``'s ``gluon_ws`` alike."""
    from sparse_mla import bench, fastlaunch, op

    K = bench._grid_topk(H) + 128
    case = make_lengths_case(T, H, 512, K, N=3000, seed=T + H, device="cuda")
    n = (case.lengths.float() * 200 / K).to(torch.int32)  # shorter: poisoned rows lie past
    n[0] = 200
    case = dataclasses.replace(case, lengths=n)
    prev = op.set_plans_enabled(False)  # every call takes the full path: its launches counted
    try:
        counts = {}
        for m in (None, 200):
            _check(case, max_kv_length=m)  # compiled first (a first launch records twice)
            with fastlaunch.recording() as launches:
                _check(case, max_kv_length=m)
            counts[m] = len(launches)
    finally:
        op.set_plans_enabled(prev)
    assert counts[200] == 1 and counts[None] == 2, counts  # the split's launch and its reduce
    csr = dispatch.Call("sm90", H, 512, torch.bfloat16, None, T, int(n.sum()))
    k = dispatch.choose(csr).kernel
    from sparse_mla.gluon import launch

    assert k != "gluon_ws" or launch.ws_num_splits(T, H, int(n.sum()), 132) == 1
    for m in (None, 200, None, 200, 64, 0):  # plans recorded, then replayed, per bound
        _check(case, max_kv_length=m)
    from sparse_mla.gluon.launch import mla_gluon

    def gluon_ws(m):  # the Gluon entry, gluon_ws forced: its split count takes the bound too
        out = poisoned_like(case.q)
        got = mla_gluon(case.q, None, case.kv, None, case.ids, None, case.softmax_scale,
                        has_pe=False, attn_sink=case.attn_sink, out=out, kernel="gluon_ws",
                        kv_lengths=n, max_kv_length=m)  # fmt: skip
        assert got is out and not torch.isnan(out).any()
        rep = check_against_reference(out, *case.args(), **case.kw())
        assert rep.ok, rep

    for m, want in ((None, 2), (200, 1), (0, 1)):
        gluon_ws(m)
        with fastlaunch.recording() as launches:
            gluon_ws(m)
        assert len(launches) == want, (m, launches)


# ------------------------------------------------------------------------------------------------
# The choice with lengths: no kernel that would need the lists packed (PERF_NOTES step 41)
# ------------------------------------------------------------------------------------------------

GRID_HEADS = (1, 2, 4, 8, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 112, 128)


def test_choice_with_lengths_takes_a_kernel_that_reads_them():
    """Over the sm90 grid's heads, token counts of MTP steps to whole prompts and list lengths
    of short prompts to GLM's, dense ids with lengths never get a kernel that reads CSR only
    (it would get the lists packed by ~10 torch ops: 3.7x the call at T = 1, one head); where
    the CSR choice reads dense ids itself the choice is the same; where it does not (gluon_mma,
    recorded at one head and T <= 16) gluon_ws stands in, saying why; config= still runs the
    kernel it names."""
    moved = []
    for H, T, S in itertools.product(GRID_HEADS, (1, 2, 4, 8, 16, 32, 64, 256, 1024, 16384),
                                     (8, 384, 640, 1152, 2048)):  # fmt: skip
        csr = dispatch.choose(dispatch.Call.of_shape("sm90", H, 512, num_tokens=T,
                                                     slots_per_token=S))  # fmt: skip
        dense = dispatch.choose(
            dispatch.Call.of_shape(
                "sm90", H, 512, num_tokens=T, slots_per_token=S, dense_lengths=True
            )
        )
        assert dispatch.kernel(dense.kernel).dense_ids, (H, T, S, dense)
        if dispatch.kernel(csr.kernel).dense_ids:
            assert dense == csr, (H, T, S)
        else:
            moved.append((H, T, S))
            assert dense.kernel == dispatch.DENSE_STAND_IN[csr.kernel], (H, T, S, dense)
            assert f"in place of the recorded {csr.kernel}, which reads CSR only" in dense.reason
    assert moved and {H for H, _, _ in moved} == {1}, moved  # the shipped choice's only ones
    line = dispatch.describe("sm90", 1, 512, num_tokens=1, slots_per_token=640,
                             dense_lengths=True)  # fmt: skip
    assert "(dense ids with lengths): gluon_ws (in place of the recorded gluon_mma" in line
    call = dispatch.Call.of_shape("sm90", 1, 512, num_tokens=1, dense_lengths=True)
    assert dispatch.choose(call, config=dispatch.Choice("gluon_mma")).kernel == "gluon_mma"


def test_which_table_with_lengths(capsys):
    """``sparse-mla which --table --lengths``: the table for dense ids with their rows' lengths,
    cell by cell the choice :func:`dispatch.choose` makes for such a call (no CSR-only kernel)."""
    from sparse_mla.cli import main

    tokens, slots = (1, 4, 16, 64), (8, 384, 640, 1152)
    assert main(["which", "--arch", "sm90", "--heads", "1", "--table", "--lengths",
                 "--tokens", *map(str, tokens), "--slots", *map(str, slots)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "dense ids with their rows' lengths" in out
    rows = [line.split() for line in out.splitlines()[2:]]
    assert [int(r[0]) for r in rows] == list(tokens)
    for r, T in zip(rows, tokens, strict=True):
        for cell, S in zip(r[1:], slots, strict=True):
            call = dispatch.Call.of_shape("sm90", 1, 512, num_tokens=T, slots_per_token=S,
                                          dense_lengths=True)  # fmt: skip
            assert cell == dispatch.choose(call).kernel and dispatch.kernel(cell).dense_ids
    plain = dispatch.choice_table("sm90", 1, 512, tokens, slots)
    assert "gluon_mma" in plain and "gluon_mma" not in out  # the shipped CSR choice at one head


def test_entries_tell_the_choice_the_lists_form(monkeypatch):
    """Both entries pass the lists' form to the choice: dense ids with lengths as such, CSR and
    dense ids without lengths not (their CSR form costs no torch op)."""
    from sparse_mla import fp8_prefill, prefill
    from sparse_mla.fp8 import quantize

    seen = []  # (on CPU the entry's cached lookup asks dispatch.choose each call)
    choose = dispatch.choose
    monkeypatch.setattr(
        dispatch, "choose", lambda call, **kw: seen.append(call.dense_lengths) or choose(call, **kw)
    )
    c = make_lengths_case(3, 2, 512, 5, N=8, P=2)
    sparse_mla_prefill(*c.args(), **c.kw())
    sparse_mla_prefill(*c.args(), attn_sink=c.attn_sink)  # dense ids, no lengths
    assert seen == [True, False]
    assert prefill.dispatch is dispatch and fp8_prefill.dispatch is dispatch
    seen.clear()
    cache = quantize(torch.randn(64, 512, dtype=torch.bfloat16), 64)
    ids = torch.randint(0, 64, (3, 5), dtype=torch.int32)
    q = torch.randn(3, 2, 512, dtype=torch.bfloat16)
    sparse_mla_prefill(q, cache, ids, None, 0.1, kv_lengths=torch.tensor([5, 0, 2]))
    sparse_mla_prefill(q, cache, ids, None, 0.1)
    assert seen == [True, False]
