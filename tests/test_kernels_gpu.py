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

from dataclasses import replace

import pytest
import torch
from conftest import make_case, poisoned_like

from sparse_mla import dispatch, runtime
from sparse_mla.prefill import sparse_mla_prefill
from sparse_mla.reference import check_against_reference

HEADS = [1, 2, 3, 4, 8, 12, 16, 17, 20, 24, 32, 33, 40, 48, 64, 65, 80, 96, 100, 112, 127, 128]
# The kernels of a dense pool (the FP8-cache kernels have their own tests).
NAMES = [n for n, k in dispatch.KERNELS.items() if k.kv_format == "dense"]


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
@pytest.mark.parametrize("scale", [-0.05, 0.0])
@pytest.mark.parametrize("name", NAMES)
def test_gpu_a_scale_of_zero_or_below(name, scale):
    # gluon_ws folds a positive softmax scale into the exponent (the row max before scaling);
    # a scale of 0 or below takes the path that scales the tile first. Every kernel is held to
    # the operator's semantics there too.
    for H in (16, 64, 100, 128):
        case = replace(make_case(200, H, 512, N=2000, max_slots=500, device="cuda", seed=H),
                       softmax_scale=scale)  # fmt: skip
        _runnable(name, H, case.kv)
        _check(name, case)


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
@pytest.mark.sm90
@pytest.mark.parametrize("name,H", [("gluon_ws", 64), ("gluon_ws", 100), ("gluon_ws", 128),
                                    ("gluon_ws_small", 8), ("gluon_ws_small", 16),
                                    ("gluon_ws_small", 32), ("gluon_ws_small", 48)])  # fmt: skip
def test_gpu_ws_small_call_order_is_the_same_math(name, H, monkeypatch):
    """``gluon_ws`` and ``gluon_ws_small`` issue a small call's loads in another order (the
    kernel module's ``small_call``, ``hopper_ws.small_call``: ids prefetched into L2, and for
    ``gluon_ws`` the first Q before the range loads): both orders, forced on the same call,
    match the reference and each other bit for bit (the consumers are the same code; only when
    the producer's loads go out differs)."""
    from sparse_mla.gluon import hopper_ws, hopper_ws_small

    module = {"gluon_ws": hopper_ws, "gluon_ws_small": hopper_ws_small}[name]
    case = make_case(300, H, 512, N=3000, max_slots=700, device="cuda", seed=H,
                     index_dtype=torch.int32, sink=True)  # fmt: skip
    _runnable(name, H, case.kv)
    outs = []
    for small in (True, False):
        monkeypatch.setattr(module, "small_call", lambda nnz, programs, s=small: s)
        outs.append(_check(name, case))
    assert torch.equal(outs[0], outs[1]), "small-call and large-call orders differ"


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize(
    "name,H,launch",
    [
        ("gluon_ws", 64, {"CONSUMER_REGS": 216, "PRODUCER_REGS": 56}),
        ("gluon_ws", 100, {"CONSUMER_REGS": 200, "PRODUCER_REGS": 24}),
        ("gluon_ws_small", 16, {"STAGES": 2, "PRODUCER_REGS": 32}),
        ("gluon_ws_small", 32, {"HEAD_GROUPS": 2, "PRODUCER_REGS": 24}),
    ],
)
def test_gpu_ws_knobs(name, H, launch):
    """The warp-specialised kernels at launches other than their defaults (the knobs a sweep
    varies): the same reference check and bitwise repeats."""
    from sparse_mla.gluon import mla_gluon

    case = make_case(300, H, 512, N=3000, max_slots=700, device="cuda", seed=H + 11,
                     index_dtype=torch.int64, sink=True)  # fmt: skip
    _runnable(name, H, case.kv)
    outs = []
    for _ in range(2):
        out = poisoned_like(case.q)
        mla_gluon(case.q, None, case.kv, None, case.kv_indices, case.kv_indptr,
                  case.softmax_scale, has_pe=False, attn_sink=case.attn_sink, out=out,
                  kernel=name, config=launch)  # fmt: skip
        rep = check_against_reference(out, *case.args(), attn_sink=case.attn_sink)
        assert rep.ok, f"{name} {launch}: {rep}"
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


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


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("kernel", ["gluon_mma", "gluon_wgmma", "gluon_ws"])
def test_gpu_nan_sink_with_kv_splits_leaves_empty_tokens_zero(kernel):
    """The same through the split-KV path (partials, then the reduce kernel's sink)."""
    from sparse_mla.gluon import mla_gluon

    H = 64
    case = make_case(120, H, 512, N=3000, max_slots=300, device="cuda", seed=5)
    empty = (case.kv_indptr[1:] == case.kv_indptr[:-1]).nonzero().flatten()
    assert empty.numel() > 0
    sink = case.attn_sink.clone()
    nan_heads = [0, 31, 63]
    sink[nan_heads] = float("nan")
    out = poisoned_like(case.q)
    mla_gluon(case.q, None, case.kv, None, case.kv_indices, case.kv_indptr, case.softmax_scale,
              has_pe=False, attn_sink=sink, out=out, num_kv_splits=3, kernel=kernel)  # fmt: skip
    assert torch.all(out[empty] == 0), f"{kernel}: an empty token with a NaN sink is not zeros"
    keep = [h for h in range(H) if h not in nan_heads]
    args = (case.kv, case.kv_indices, case.kv_indptr, case.softmax_scale)
    rep = check_against_reference(out[:, keep], case.q[:, keep], *args, attn_sink=sink[keep])
    assert rep.ok, f"{kernel}: {rep}"


def _clone(case, **change):
    """The same call on fresh buffers (other data_ptrs, same shapes); ``sink_offset``: the sink
    one element into a larger buffer (its pointer no longer 16-byte aligned); ``dtype``: q and
    the pool cast."""
    dt = change.get("dtype", case.q.dtype)
    sink = case.attn_sink
    if change.get("sink_offset"):
        buf = torch.empty(sink.numel() + 1, dtype=sink.dtype, device=sink.device)
        buf[1:].copy_(sink)
        sink = buf[1:]
    elif sink is not None:
        sink = sink.clone()
    return type(case)(case.q.to(dt).clone(), case.kv.to(dt).clone(), case.kv_indices.clone(),
                      case.kv_indptr.clone(), case.softmax_scale, sink)  # fmt: skip


def _run(name, case):
    out = poisoned_like(case.q)
    sparse_mla_prefill(*case.args(), attn_sink=case.attn_sink, out=out,
                       config=dispatch.Choice(name))  # fmt: skip
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("T", [4, 300])
@pytest.mark.parametrize("H", [16, 64, 100])
@pytest.mark.parametrize("name", NAMES)
def test_fast_launch_matches_triton(name, H, T):
    """Every kernel through the direct launch (sparse_mla.fastlaunch) on fresh inputs: bitwise
    equal to kernel[grid]'s launch, right against the fp32 reference; a changed dtype or
    pointer alignment takes kernel[grid] once, then the direct path again."""
    from sparse_mla import fastlaunch

    base = make_case(T, H, 512, N=3000, max_slots=600, device="cuda", seed=H + T)
    _runnable(name, H, base.kv)
    # Entries are per process: an earlier test in this worker may have made the changed
    # calls' keys already (another T, the same kernel and H), and then no call here would
    # have to take kernel[grid].
    fastlaunch.clear()
    for change in ({}, {"sink_offset": True}, {"dtype": torch.float16}):
        case = _clone(base, **change)
        with fastlaunch.disabled():
            want = _run(name, case)
        rep = check_against_reference(want, *case.args(), attn_sink=case.attn_sink)
        assert rep.ok, f"{name} {change}: {rep}"
        first = fastlaunch.stats()
        got = _run(name, _clone(base, **change))  # a new key (or not): either path
        torch.cuda.synchronize()
        assert torch.equal(got, want), f"{name} {change}: first launch differs"
        for _ in range(2):
            before = fastlaunch.stats()
            got = _run(name, _clone(base, **change))
            torch.cuda.synchronize()
            after = fastlaunch.stats()
            assert after["slow"] == before["slow"], f"{name} {change}: not direct"
            assert after["fast"] > before["fast"]
            assert torch.equal(got, want), f"{name} {change}: direct launch differs"
        if change:  # a new specialisation went through kernel[grid] on its first call
            assert fastlaunch.stats()["slow"] > first["slow"], f"{name} {change}: no fallback"


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_fast_launch_under_cuda_graph_capture(name):
    """A captured call (direct launches: warmed first) replays on new inputs as eager does."""
    from sparse_mla import fastlaunch

    case = make_case(4, 64, 512, N=3000, max_slots=600, device="cuda", seed=7)
    _runnable(name, 64, case.kv)
    static = _clone(case)
    out = poisoned_like(case.q)
    args = dict(attn_sink=static.attn_sink, out=out, config=dispatch.Choice(name))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            sparse_mla_prefill(*static.args(), **args)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    before = fastlaunch.stats()
    with torch.cuda.graph(g):
        sparse_mla_prefill(*static.args(), **args)
    assert fastlaunch.stats()["fast"] > before["fast"]
    fresh = make_case(4, 64, 512, N=3000, max_slots=600, device="cuda", seed=7)
    fresh.q.copy_(torch.randn_like(fresh.q))
    static.q.copy_(fresh.q)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    with fastlaunch.disabled():
        want = _run(name, fresh)
    assert torch.equal(out, want)
