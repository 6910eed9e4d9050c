"""Property-based tests of sparse MLA prefill against this file's own fp64 loop reference.

The reference below is written from DESIGN.md §2 alone, token by token in fp64, and shares
nothing with ``sparse_mla.reference``. Hypothesis draws the structure of a call (T, H, D, slot
lists, sentinels, sinks, dtypes, views, launch config) and a seed for the values; every call
runs on a pool whose unreferenced rows are NaN/Inf, with kv_indices framed by ids of such rows
and ``out`` poisoned with NaN. The CPU tests run in Triton's interpreter with a fixed seed and a
bounded number of examples; ``SPARSE_MLA_PROPERTY_SCALE=10`` runs ten times as many. The
``gpu`` tests run the same properties through the compiled Triton and Gluon kernels:

    python -m pytest tests/test_properties.py -m gpu -q
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from sparse_mla import dispatch
from sparse_mla.prefill import sparse_mla_prefill
from sparse_mla.reference import sparse_mla_prefill_ref

SCALE = float(os.environ.get("SPARSE_MLA_PROPERTY_SCALE", "1"))

# Sinks of +-inf and huge logits make the interpreter's numpy compute inf - inf on purpose.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")


def _settings(examples: int):
    return settings(
        max_examples=max(1, int(examples * SCALE)),
        derandomize=True,  # a fixed seed: CI sees the same examples every run
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# ----------------------------------------------------------------------------------------------
# The fp64 loop reference
# ----------------------------------------------------------------------------------------------


def loop_reference(q, kv, kv_indices, kv_indptr, scale, sink=None, *, clamp=False):
    """[T, H, D] fp64: token t attends to the valid slots of kv_indices[ptr[t]:ptr[t+1]]
    (0 <= s < N); softmax of (q·k) * scale with exp(sink_h) added to the denominator; a token
    with no valid slot is zeros. ``clamp``: the range as the kernels bound an unchecked
    kv_indptr, lo = clamp(ptr[t], 0, nnz), hi = clamp(ptr[t+1], lo, nnz).

    A loop over tokens, each token's heads and slots at once in fp64; the three sink cases are
    spelled out: +inf takes all the weight (zeros), -inf adds nothing, a finite one joins the
    max and the denominator."""
    kv = kv.reshape(kv.shape[0], kv.shape[-1]).double()
    q = q.double()
    T, H, D = q.shape
    N, nnz = kv.shape[0], kv_indices.numel()
    ptr = [int(v) for v in kv_indptr.tolist()]
    idx = torch.tensor([int(v) for v in kv_indices.tolist()], dtype=torch.int64)
    s = None if sink is None else sink.double()
    out = torch.zeros(T, H, D, dtype=torch.float64)
    for t in range(T):
        lo, hi = ptr[t], ptr[t + 1]
        if clamp:
            lo = min(max(lo, 0), nnz)
            hi = min(max(hi, lo), nnz)
        ids = idx[lo:hi]
        slots = ids[(ids >= 0) & (ids < N)]
        if slots.numel() == 0:
            continue
        rows = kv[slots]  # [L, D]
        logits = (q[t] @ rows.T) * scale  # [H, L]
        m = logits.max(dim=1).values  # [H]
        extra = torch.zeros(H, dtype=torch.float64)
        if s is not None:
            finite = torch.isfinite(s)
            m = torch.where(finite, torch.maximum(m, s), m)
            extra = torch.where(finite, torch.exp(s - m), extra)
        w = torch.exp(logits - m[:, None])  # [H, L]
        o = (w @ rows) / (w.sum(dim=1) + extra)[:, None]
        if s is not None:
            o = torch.where((s == math.inf)[:, None], torch.zeros_like(o), o)
        out[t] = o
    return out


# ----------------------------------------------------------------------------------------------
# Drawing a call
# ----------------------------------------------------------------------------------------------

SENTINELS_32 = [-1, "N", 2**31 - 1, -(2**31)]
SENTINELS_64 = [-1, "N", 2**31 - 1, 2**32 + 5, 2**33, -(2**40)]
SINK_CLASSES = ["none", "finite", "+inf", "-inf", "huge"]
EPS = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


@dataclass
class Spec:
    """The structure of one call; values come from ``seed``."""

    T: int
    H: int
    D: int
    n_ref: int  # pool rows valid slots may reference
    n_spare: int  # extra pool rows no slot references (NaN/Inf), used to frame kv_indices
    lengths: list[int]
    invalid_rate: float
    dup_rate: float
    first: int  # kv_indptr[0]: junk entries before the first token's list
    tail: int  # junk entries after the last token's list
    sink: str
    logit_scale: float  # multiplies D^-0.5
    dtype: torch.dtype
    index_dtype: torch.dtype
    indptr_dtype: torch.dtype
    q_view: str
    kv_view: str
    idx_strided: bool
    ptr_strided: bool
    sink_strided: bool
    out_view: str
    config: dict = field(default_factory=dict)
    seed: int = 0


@st.composite
def specs(draw, *, dims=(16, 64, 100, 512, 576), max_t=6, max_len=40, max_h=20):
    T = draw(st.integers(0, max_t))
    H = draw(st.integers(1, max_h))
    return Spec(
        T=T,
        H=H,
        D=draw(st.sampled_from(dims)),
        n_ref=draw(st.sampled_from([0, 1, 3, 17, 40])),
        n_spare=draw(st.sampled_from([0, 2])),
        lengths=draw(st.lists(st.integers(0, max_len), min_size=T, max_size=T)),
        invalid_rate=draw(st.sampled_from([0.0, 0.25, 0.6, 1.0])),
        dup_rate=draw(st.sampled_from([0.0, 0.5])),
        first=draw(st.integers(0, 3)),
        tail=draw(st.integers(0, 3)),
        sink=draw(st.sampled_from(SINK_CLASSES)),
        logit_scale=draw(st.sampled_from([1.0, 1.0, 8.0, 40.0])),
        dtype=draw(st.sampled_from([torch.bfloat16, torch.float16])),
        index_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        indptr_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        q_view=draw(st.sampled_from(["contiguous", "strided_heads", "head_major", "last_dim"])),
        kv_view=draw(st.sampled_from(["rows", "padded_rows", "3d"])),
        idx_strided=draw(st.booleans()),
        ptr_strided=draw(st.booleans()),
        sink_strided=draw(st.booleans()),
        out_view=draw(st.sampled_from(["none", "contiguous", "strided"])),
        config={
            "BLOCK_H": draw(st.sampled_from([16, 32])),
            "BLOCK_K": draw(st.sampled_from([16, 32])),
            "USE_EXP2": draw(st.booleans()),
            "PREFETCH_KV": draw(st.booleans()),
        },
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@dataclass
class Call:
    q: torch.Tensor
    kv: torch.Tensor
    kv_indices: torch.Tensor
    kv_indptr: torch.Tensor
    scale: float
    sink: torch.Tensor | None
    out: torch.Tensor | None  # the view passed as out=, NaN inside
    out_base: torch.Tensor | None  # its buffer: 7.0 outside the view
    spare: list[int]  # pool rows no slot references (poisoned)

    def args(self):
        return self.q, self.kv, self.kv_indices, self.kv_indptr, self.scale


def _framed_1d(values: torch.Tensor, strided: bool, fill: int) -> torch.Tensor:
    """``values`` as a view into a buffer filled with ``fill``: contiguous with 4 entries of
    ``fill`` on each side (passed to the kernel as is: a read past either end sees ``fill``),
    or every other entry (a strided view, which the entry copies)."""
    n = values.numel()
    if strided:
        view = torch.full((2 * n + 1,), fill, dtype=values.dtype)[1::2]
    else:
        view = torch.full((n + 8,), fill, dtype=values.dtype)[4 : 4 + n]
    view.copy_(values)
    return view


def build(spec: Spec, device: str = "cpu") -> Call:
    g = torch.Generator().manual_seed(spec.seed)
    T, H, D, dt = spec.T, spec.H, spec.D, spec.dtype
    N = spec.n_ref + spec.n_spare
    spare = list(range(spec.n_ref, N))

    # Slot lists: valid ids in [0, n_ref) (with duplicates), sentinels of every kind.
    sentinels = SENTINELS_64 if spec.index_dtype == torch.int64 else SENTINELS_32
    lists = []
    for length in spec.lengths:
        row = []
        for _ in range(length):
            u = float(torch.rand((), generator=g))
            if spec.n_ref == 0 or u < spec.invalid_rate:
                s = sentinels[int(torch.randint(len(sentinels), (), generator=g))]
                row.append(N if s == "N" else s)
            elif row and float(torch.rand((), generator=g)) < spec.dup_rate:
                row.append(row[int(torch.randint(len(row), (), generator=g))])
            else:
                row.append(int(torch.randint(spec.n_ref, (), generator=g)))
        lists.append(row)
    junk = spare[0] if spare else -1  # a misread of a junk entry reads a poisoned row
    flat = [junk] * spec.first + [s for row in lists for s in row] + [junk] * spec.tail
    ptr = [spec.first]
    for row in lists:
        ptr.append(ptr[-1] + len(row))
    kv_indices = _framed_1d(torch.tensor(flat, dtype=spec.index_dtype), spec.idx_strided, junk)
    kv_indptr = _framed_1d(torch.tensor(ptr, dtype=spec.indptr_dtype), spec.ptr_strided, 0)

    # Pool: referenced rows random, spare rows NaN / Inf, inside a NaN buffer.
    width = D + 8 if spec.kv_view == "padded_rows" else D
    buf = torch.full((N + 5, width), float("nan"))
    buf[2 : 2 + N, :D] = torch.randn(N, D, generator=g)
    for i, r in enumerate(spare):
        buf[2 + r, :D] = float("nan") if i % 2 == 0 else float("inf")
    kv = buf.to(dt)[2 : 2 + N, :D]
    if spec.kv_view == "3d":
        kv = kv.unsqueeze(1)

    q_vals = torch.randn(T, H, D, generator=g).to(dt)
    if spec.q_view == "strided_heads":
        q = torch.full((T, H + 2, D), float("nan"), dtype=dt)[:, 1 : H + 1]
    elif spec.q_view == "head_major":
        q = torch.empty(H, T, D, dtype=dt).transpose(0, 1)
    elif spec.q_view == "last_dim":
        q = torch.empty(T, H, 2 * D, dtype=dt)[..., ::2]
    else:
        q = torch.empty(T, H, D, dtype=dt)
    q.copy_(q_vals)

    sink = None
    if spec.sink != "none":
        if spec.sink == "finite":
            sink = torch.randn(H, generator=g) * 3
        elif spec.sink == "huge":
            choices = torch.tensor([1e30, -1e30, 3e38, -3e38, 2.0, -2.0])
            sink = choices[torch.randint(len(choices), (H,), generator=g)]
        else:
            sink = torch.full((H,), math.inf if spec.sink == "+inf" else -math.inf)
        if spec.sink_strided:
            sinks = torch.full((H, 3), float("nan"))
            sinks[:, 1] = sink
            sink = sinks[:, 1]  # a per-layer column: stride 3

    out = out_base = None
    if spec.out_view == "contiguous":
        out = out_base = torch.full((T, H, D), float("nan"), dtype=dt)
    elif spec.out_view == "strided":
        out_base = torch.full((T, H + 1, D + 4), 7.0, dtype=dt)
        out = out_base[:, :H, :D]
        out.fill_(float("nan"))

    if device != "cpu":
        # Keep the views: move the buffers, then take the same views on the device.
        kv_dev = buf.to(dt).to(device)[2 : 2 + N, :D]
        kv = kv_dev.unsqueeze(1) if spec.kv_view == "3d" else kv_dev
        q = q.to(device) if q.is_contiguous() else _same_view(q, device)
        kv_indices = _same_view(kv_indices, device)
        kv_indptr = _same_view(kv_indptr, device)
        sink = None if sink is None else _same_view(sink, device)
        if out_base is not None:
            out_base = out_base.to(device)
            out = out_base if spec.out_view == "contiguous" else out_base[:, :H, :D]
    scale = spec.logit_scale * D**-0.5
    return Call(q, kv, kv_indices, kv_indptr, scale, sink, out, out_base, spare)


def _same_view(t: torch.Tensor, device: str) -> torch.Tensor:
    """``t`` on ``device`` with the same strides (a copy of its whole storage, then the view)."""
    base = torch.empty(0, dtype=t.dtype)
    base.set_(t.untyped_storage())
    return base.to(device).as_strided(t.shape, t.stride(), t.storage_offset())


def _cpu(t):
    return None if t is None else t.detach().cpu()


def check_result(call: Call, out: torch.Tensor, *, clamp: bool = False) -> None:
    """The kernel's output against the fp64 loop reference, and ``out``'s buffer intact."""
    q, kv, idx, ptr, sink = map(_cpu, (call.q, call.kv, call.kv_indices, call.kv_indptr, call.sink))
    ref = loop_reference(q, kv, idx, ptr, call.scale, sink, clamp=clamp)
    got = _cpu(out).double()
    assert got.shape == ref.shape
    assert torch.isfinite(got).all(), "NaN/Inf reached the output (a poisoned row was read)"
    eps = EPS[q.dtype]
    kv2 = kv.reshape(kv.shape[0], kv.shape[-1]).double()
    finite_rows = kv2[torch.isfinite(kv2).all(1)]
    vmax = float(finite_rows.abs().max()) if finite_rows.numel() else 0.0
    # P is rounded to the input dtype before P V and the output is rounded once: at most
    # about eps * max|v| + eps/2 * |out|; a factor 4 of headroom, no more.
    tol = 4 * eps * vmax + 2 * eps * ref.abs()
    err = (got - ref).abs()
    bad = err > tol
    assert not bad.any(), (
        f"{int(bad.sum())} elements off; worst {float(err.max()):.3e} (tol at worst "
        f"{float(tol.flatten()[int(err.argmax())]):.3e})"
    )
    if call.out_base is not None and call.out is not None and call.out_base.shape != out.shape:
        base = _cpu(call.out_base).clone()
        base[:, : out.shape[1], : out.shape[2]] = 7.0
        assert (base == 7.0).all(), "the kernel wrote outside the out view"


# ----------------------------------------------------------------------------------------------
# CPU (Triton interpreter)
# ----------------------------------------------------------------------------------------------


@_settings(250)
@given(spec=specs())
def test_prefill_matches_the_fp64_loop_reference(spec):
    for name in ("D", "sink", "q_view", "out_view"):
        event(f"{name}={getattr(spec, name)}")  # shown by --hypothesis-show-statistics
    event(f"slots={sum(spec.lengths)}")
    call = build(spec)
    before = [t.clone() for t in (call.q, call.kv, call.kv_indices, call.kv_indptr)]
    out = sparse_mla_prefill(*call.args(), attn_sink=call.sink, out=call.out, config=spec.config)
    if call.out is not None:
        assert out is call.out
    check_result(call, out)
    for a, b in zip(before, (call.q, call.kv, call.kv_indices, call.kv_indptr), strict=True):
        assert ((a == b) | (a.isnan() & b.isnan())).all(), "an input was modified"


@_settings(150)
@given(spec=specs(dims=(16, 64, 100, 512, 576), max_t=8, max_len=40))
def test_package_reference_matches_the_fp64_loop_reference(spec):
    # sparse_mla.reference defines the operator for every other test: it must agree with this
    # independent loop on the same inputs, empty tokens and every sink class included.
    call = build(spec)
    ref = sparse_mla_prefill_ref(*call.args(), attn_sink=call.sink)
    assert torch.isfinite(ref).all()
    ours = loop_reference(call.q, call.kv, call.kv_indices, call.kv_indptr, call.scale, call.sink)
    torch.testing.assert_close(ref.double(), ours, rtol=1e-4, atol=1e-5)


def _indptr_ok(ptr: torch.Tensor, nnz: int) -> bool:
    steps = ptr[1:] - ptr[:-1]
    return bool(ptr[0] >= 0) and bool((steps >= 0).all()) and int(ptr[-1]) <= nnz


@st.composite
def bad_indptrs(draw, max_t=4, dims=(16, 64), max_h=20):
    """A valid-shaped call whose kv_indptr is broken: out of range, decreasing or wild."""
    spec = draw(specs(dims=dims, max_t=max_t, max_len=10, max_h=max_h))
    spec.T = max(spec.T, 1)
    spec.lengths = [*spec.lengths, 3][: spec.T]
    spec.indptr_dtype = torch.int64
    # Junk (ids of poisoned rows) only outside kv_indices, where no clamped range reaches.
    spec.first = spec.tail = 0
    spec.n_spare, spec.idx_strided = 2, False
    wild = st.sampled_from([-1, -5, -(2**40), 2**31 + 7, 2**40, 10**6, 0, 1, 3])
    edits = draw(st.lists(st.tuples(st.integers(0, spec.T), wild), min_size=1, max_size=3))
    return spec, edits


@_settings(60)
@given(case=bad_indptrs())
def test_a_bad_kv_indptr_is_rejected_or_clamped_never_read_out_of_bounds(case):
    spec, edits = case
    call = build(spec)
    ptr = call.kv_indptr.clone()
    for t, v in edits:
        ptr[t] = v
    valid = _indptr_ok(ptr, call.kv_indices.numel())
    out = torch.full_like(call.q, float("nan"), memory_format=torch.contiguous_format)
    args = (call.q, call.kv, call.kv_indices, ptr, call.scale)
    if not valid:
        with pytest.raises(ValueError, match="kv_indptr"):
            sparse_mla_prefill(*args, attn_sink=call.sink, out=out)
        assert out.isnan().all(), "out was written on a rejected call"
    # Unchecked, the kernel clamps every range into kv_indices (whose neighbours in memory
    # are ids of poisoned rows): the clamped semantics, and nothing non-finite.
    got = sparse_mla_prefill(*args, attn_sink=call.sink, out=out, validate=False)
    check_result(
        Call(call.q, call.kv, call.kv_indices, ptr, call.scale, call.sink, None, None, []),
        got,
        clamp=True,
    )


# ----------------------------------------------------------------------------------------------
# GPU: the same properties through the compiled Triton and Gluon kernels
# ----------------------------------------------------------------------------------------------


def _gluon(call: Call, **kw):
    from sparse_mla.gluon import mla_gluon

    return mla_gluon(
        call.q, None, call.kv, None, call.kv_indices, call.kv_indptr, call.scale,
        has_pe=False, attn_sink=call.sink, out=call.out, **kw,
    )  # fmt: skip


# Every registered kernel forced by name, the shared Gluon algorithm with KV splits, and
# config=None (the kernel the dispatch picks for the shape).
# The Gluon kernels are written for Hopper: sm90 only (conftest skips them on other GPUs).
GPU_KERNELS = [
    pytest.param(k, marks=pytest.mark.sm90) if k.startswith("gluon") else k
    for k in [
        *(n for n, k in dispatch.KERNELS.items() if k.kv_format == "dense"),
        "gluon_mma_splits",
        "default",
    ]
]


def _run_gpu(kernel: str, call: Call, spec: Spec, **kw):
    if kernel == "triton":
        return sparse_mla_prefill(
            *call.args(), attn_sink=call.sink, out=call.out, config=spec.config, **kw
        )
    if kernel == "default":  # config=None: the kernel configs/ records for the shape
        return sparse_mla_prefill(*call.args(), attn_sink=call.sink, out=call.out, **kw)
    if kernel == "gluon_mma_splits":
        return _gluon(call, kernel="gluon_mma", num_kv_splits=3, **kw)
    return sparse_mla_prefill(*call.args(), attn_sink=call.sink, out=call.out,
                              config=dispatch.Choice(kernel), **kw)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", GPU_KERNELS)
@_settings(150)
@given(spec=specs(max_t=24, max_len=300, max_h=130))
def test_gpu_prefill_matches_the_fp64_loop_reference(kernel, spec):
    if kernel.startswith("gluon"):
        spec.D = 512  # the Gluon kernel serves D = 512 only (rows of D + 8 stay 16-byte aligned)
    call = build(spec, device="cuda")
    out = _run_gpu(kernel, call, spec)
    torch.cuda.synchronize()
    check_result(call, out)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", GPU_KERNELS)
@_settings(60)
@given(case=bad_indptrs(max_t=30, dims=(64, 512), max_h=130))
def test_gpu_unchecked_bad_kv_indptr_is_clamped(kernel, case):
    spec, edits = case
    if kernel.startswith("gluon"):
        spec.D = 512
    call = build(spec, device="cuda")
    ptr = call.kv_indptr.clone()
    for t, v in edits:
        ptr[t] = v
    bad = Call(call.q, call.kv, call.kv_indices, ptr, call.scale, call.sink, None, None, [])
    out = _run_gpu(kernel, bad, spec, validate=False)
    torch.cuda.synchronize()
    check_result(bad, out, clamp=True)
    if not _indptr_ok(ptr, call.kv_indices.numel()):
        with pytest.raises(ValueError, match="kv_indptr"):  # checked when asked to
            _run_gpu(kernel, bad, spec, validate=True)
