"""Every registered kernel, forced by name, against the fp32 reference on the GPU (``-m gpu``).

Each kernel of :data:`sparse_mla.dispatch.KERNELS` that says it can run on the local GPU runs
through ``sparse_mla_prefill(config=Choice(name))`` at every head count of the bench grid and
the odd ones between its regions (3, 17, 33, 65, 100, 127), on inputs that hide nothing:
ragged and empty slot lists, absent slots of every kind (-1, N, 2**31 - 1, -2**31 and, with
int64 ids, 2**33 + 5, 2**62, -2**40), duplicates, NaN/Inf in every pool row no valid slot
references, int32 and int64 ids, sink on and off, a NaN-poisoned output; repeats must be
bitwise identical. Then the corners: T of 1-3 with 9,000-slot lists (decode-like calls), a pool
view starting past element 2**31 of its buffer, and ``out=`` views inside larger buffers.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_case, poisoned_like

from sparse_mla import dispatch, runtime
from sparse_mla.prefill import sparse_mla_prefill
from sparse_mla.reference import check_against_reference

HEADS = [1, 2, 3, 4, 8, 12, 16, 17, 20, 24, 32, 33, 40, 48, 64, 65, 80, 96, 100, 112, 127, 128]
NAMES = list(dispatch.KERNELS)


def _runnable(name: str, H: int, kv: torch.Tensor) -> None:
    """Skip a kernel that says it cannot run on this GPU (e.g. an sm90 kernel on gfx942); on
    sm90 every registered kernel must run every head count."""
    call = dispatch.Call(runtime.arch(), H, 512, torch.bfloat16, kv)
    why = dispatch.kernel(name).unavailable(call)
    if why and runtime.arch() == "sm90":
        pytest.fail(f"{name} refuses H={H} on sm90: {why}")
    if why:
        pytest.skip(f"{name}: {why}")


def _check(name, case, out=None):
    out = poisoned_like(case.q) if out is None else out
    got = sparse_mla_prefill(*case.args(), attn_sink=case.attn_sink, out=out,
                             config=dispatch.Choice(name))  # fmt: skip
    assert got is out
    rep = check_against_reference(out, *case.args(), attn_sink=case.attn_sink)
    assert rep.ok, f"{name}: {rep}"
    empty = (case.kv_indptr[1:] == case.kv_indptr[:-1]).nonzero().flatten()
    assert torch.all(out[empty] == 0), "empty tokens must be zeros"
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("H", HEADS)
@pytest.mark.parametrize("name", NAMES)
def test_gpu_every_kernel_every_head_count(name, H):
    for index_dtype, sink, seed in ((torch.int32, True, 2 * H), (torch.int64, False, 2 * H + 1)):
        case = make_case(300, H, 512, N=3000, max_slots=700, device="cuda", seed=seed,
                         index_dtype=index_dtype, sink=sink)  # fmt: skip
        _runnable(name, H, case.kv)
        ptr = case.kv_indptr
        s, e = int(ptr[7]), int(ptr[8])
        if e - s >= 4:
            case.kv_indices[s + 1 : e : 2] = case.kv_indices[s]  # duplicates within one list
        out = _check(name, case)
        again = _check(name, case)
        assert torch.equal(out, again), f"{name} H={H}: repeat calls differ"


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 3])
@pytest.mark.parametrize("H", [1, 16, 20, 64, 128])
@pytest.mark.parametrize("name", NAMES)
def test_gpu_few_tokens_long_lists(name, H, T):
    case = make_case(T, H, 512, N=20000, max_slots=9000, device="cuda", seed=T * 131 + H,
                     index_dtype=torch.int64, empty_rows=False)  # fmt: skip
    _runnable(name, H, case.kv)
    lens = case.kv_indptr[1:] - case.kv_indptr[:-1]
    if int(lens.max()) < 4000:  # the draw is random: make one list long for sure
        case = make_case(T, H, 512, N=20000, max_slots=9000, device="cuda", seed=T * 131 + H + 1,
                         index_dtype=torch.int64, empty_rows=False)  # fmt: skip
    _check(name, case)


@pytest.fixture(scope="module")
def big_pool():
    """A [2000, 512] bf16 pool view starting past element 2**31 of a NaN-filled buffer (64-bit
    row offsets), half of its rows used and the rest NaN."""
    g = torch.Generator(device="cuda").manual_seed(3)
    N = 2000
    off = 2**31 + 4096
    buf = torch.full((off + N * 512,), float("nan"), dtype=torch.bfloat16, device="cuda")
    kv = buf[off:].view(N, 512)
    used = torch.randperm(N, generator=g, device="cuda")[: N // 2]
    kv[used] = torch.randn(used.numel(), 512, generator=g, device="cuda").to(torch.bfloat16)
    yield kv, used
    del buf
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("H", [8, 20, 64, 100])
@pytest.mark.parametrize("name", NAMES)
def test_gpu_pool_past_2_31_and_out_views(name, H, big_pool):
    """The pool view past element 2**31, q a view that is not 16-byte aligned, and ``out=``
    views 128 and 8 bytes into larger rows: nothing outside the views is written."""
    from conftest import Case

    kv, used = big_pool
    _runnable(name, H, kv)
    g = torch.Generator(device="cuda").manual_seed(H)
    T = 70
    lens = torch.randint(0, 400, (T,), generator=g, device="cuda")
    lens[4] = 0
    ptr = torch.zeros(T + 1, dtype=torch.int64, device="cuda")
    ptr[1:] = lens.cumsum(0)
    nnz = int(ptr[-1])
    idx = used[torch.randint(0, used.numel(), (nnz,), generator=g, device="cuda")]
    bad = torch.rand(nnz, generator=g, device="cuda") < 0.1
    idx = torch.where(bad, torch.full_like(idx, -(2**40)), idx)
    qb = torch.randn(T, H, 520, generator=g, device="cuda").to(torch.bfloat16)
    sink = torch.randn(H, generator=g, device="cuda")
    case = Case(qb[..., 4:516], kv, idx, ptr, 512**-0.5, sink)
    for lead in (64, 4):
        ob = torch.full((T, H, 640), float("nan"), dtype=torch.bfloat16, device="cuda")
        out = ob[..., lead : lead + 512]
        _check(name, case, out)
        assert torch.isnan(ob[..., :lead]).all() and torch.isnan(ob[..., lead + 512 :]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("H", [8, 20, 64, 100])
@pytest.mark.parametrize("name", NAMES)
def test_gpu_nan_sink_leaves_empty_tokens_zero(name, H):
    """A sink that is NaN on some heads: every empty token is zeros on every head (DESIGN.md
    section 2), and the heads with a finite sink match the reference."""
    case = make_case(120, H, 512, N=3000, max_slots=300, device="cuda", seed=7 * H)
    _runnable(name, H, case.kv)
    empty = (case.kv_indptr[1:] == case.kv_indptr[:-1]).nonzero().flatten()
    assert empty.numel() > 0
    sink = case.attn_sink.clone()
    nan_heads = [0, H // 2, H - 1]
    sink[nan_heads] = float("nan")
    out = poisoned_like(case.q)
    sparse_mla_prefill(*case.args(), attn_sink=sink, out=out, config=dispatch.Choice(name))
    assert torch.all(out[empty] == 0), f"{name}: an empty token with a NaN sink is not zeros"
    keep = [h for h in range(H) if h not in nan_heads]
    args = (case.kv, case.kv_indices, case.kv_indptr, case.softmax_scale)
    rep = check_against_reference(out[:, keep], case.q[:, keep], *args, attn_sink=sink[keep])
    assert rep.ok, f"{name}: {rep}"
