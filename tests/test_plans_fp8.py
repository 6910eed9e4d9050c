"""The FP8 op's direct launches and plans (torch.ops.sparse_mla.prefill_fp8; sparse_mla.op):
CPU only, the FP8 kernels compiled for sm90 and a stand-in driver that records each C launch
(as in test_fastlaunch.py and test_plans.py). ``triton_fp8`` launches through
fastlaunch's direct path as the dense Triton kernel does; a call whose layout was seen replays
its plan, handing the C launcher what the full path hands it; every guard falls back to the
full path. The GPU test (replays bitwise equal to the full path and right against the fp32
reference) is at the end."""

from __future__ import annotations

import pytest
import torch
import triton
from test_fp8_prefill import make_fp8_case
from test_plans import (
    _full_path_launches,
    _launch_kwargs,
    assert_replay_passes_addresses,
    assert_root_and_clear_take_the_full_path,
    standin_setup,
)

from sparse_mla import FP8Cache, dispatch, fastlaunch, fp8_prefill, op, prefill, runtime
from sparse_mla import fp8 as F
from sparse_mla.reference import check_against_reference

FP8 = ["triton_fp8", "gluon_ws_small_fp8", "gluon_ws_fp8"]


@pytest.fixture
def standin(monkeypatch):
    """The FP8 kernels compiled for sm90 here, launched on a driver whose C launch records its
    arguments (returned list); the plans and launchers are the test's own."""
    from sparse_mla.gluon import hopper_fp8, hopper_ws_fp8

    kernels = (
        fp8_prefill._sparse_mla_prefill_fp8_kernel,
        hopper_fp8._prefill_ws_small_fp8_kernel,
        hopper_ws_fp8._prefill_ws_fp8_kernel,
    )
    # the two sm90 kernels refuse CPU tensors: allowed here
    return standin_setup(monkeypatch, kernels, ("gluon_ws_small_fp8", "gluon_ws_fp8"))


def _comparable(call, inputs):
    """A recorded C launch without Triton's metadata and hooks (indices 10-12): an input tensor
    as its position in ``inputs``; a tensor at an input's address (the cache's uint8 view) as
    that position and its layout; any other tensor (a cached dummy) by layout."""
    out = []
    for a in call[:10] + call[13:]:
        if isinstance(a, torch.Tensor):
            pos = [i for i, t in enumerate(inputs) if t is a]
            if pos:
                out.append(("input", pos[0]))
                continue
            at = [i for i, t in enumerate(inputs) if t is not None and t.numel()
                  and a.numel() and t.data_ptr() == a.data_ptr()]  # fmt: skip
            lay = (tuple(a.shape), a.stride(), a.dtype)
            out.append(("at input", at[0], *lay) if at else lay)
        else:
            out.append(a)
    return tuple(out)


def _plans():
    return [p for p in op._PLANS.values() if type(p) is op._Plan]


def _copy_cache(data: torch.Tensor) -> torch.Tensor:
    """``data`` (a view into a larger buffer) at a new address: a copy of its whole storage,
    viewed with the same offset, shape and strides (the same layout and 16-byte alignment)."""
    st = data.untyped_storage()
    buf = torch.empty(st.nbytes(), dtype=torch.uint8)
    buf.untyped_storage().copy_(st)
    return torch.as_strided(buf.view(data.dtype), data.shape, data.stride(), data.storage_offset())


def _fresh(c, seed):
    """Inputs of ``c``'s layout at new addresses with new values (kv_indptr equal)."""
    g = torch.Generator().manual_seed(seed)
    n = c.cache.num_slots
    q = torch.randn(c.q.shape, generator=g).bfloat16()
    # New ids over the slots the case's ids reference (make_fp8_case fills every other slot with
    # NaN bytes), and the two absent kinds (-1 and n).
    ids = c.kv_indices.long()
    live = ids[(ids >= 0) & (ids < n)].unique()
    pool = torch.cat([live, torch.tensor([-1, n])])
    pick = torch.randint(0, pool.numel(), c.kv_indices.shape, generator=g)
    idx = pool[pick].to(c.kv_indices.dtype)
    sink = None if c.attn_sink is None else torch.randn(c.attn_sink.shape, generator=g)
    data = _copy_cache(c.cache.data)
    return q, data, idx, c.kv_indptr.clone(), sink


def _call(q, data, idx, ptr, sink, out, *, block_size, scale, config=None, validate=False):
    prefill.sparse_mla_prefill(q, FP8Cache(data, block_size), idx, ptr, scale, attn_sink=sink,
                               out=out, config=config, validate=validate)  # fmt: skip


@pytest.mark.parametrize("name", FP8)
def test_direct_launch_makes_the_driver_call_triton_makes(standin, name):
    """The FP8 kernels' launches through fastlaunch: after the first, direct, and the C
    launcher gets what ``kernel[grid]`` gives it (grid, stream, function, packed metadata,
    every argument), bar Triton's launch metadata and empty hook chains. Plans off: each call
    takes the entry's full path."""
    c = make_fp8_case(4, 64, num_blocks=3, block_size=64, seed=1)
    out = torch.empty_like(c.q)
    inputs = (c.q, c.cache.data, c.kv_indices, c.kv_indptr, c.attn_sink, out)
    prev = op.set_plans_enabled(False)
    try:
        with fastlaunch.disabled():
            _call(*inputs, block_size=64, scale=c.softmax_scale, config=dispatch.Choice(name))
            slow = list(standin)
        assert len(slow) == 1
        _call(*inputs, block_size=64, scale=c.softmax_scale, config=dispatch.Choice(name))
        standin.clear()
        before = fastlaunch.stats()
        _call(*inputs, block_size=64, scale=c.softmax_scale, config=dispatch.Choice(name))
        fast = list(standin)
        after = fastlaunch.stats()
    finally:
        op.set_plans_enabled(prev)
    assert after["slow"] == before["slow"] and after["fast"] - before["fast"] == 1
    assert [_comparable(x, inputs) for x in fast] == [_comparable(x, inputs) for x in slow]
    assert all(type(h) is triton.knobs.HookChain and not h.calls for h in slow[0][11:13])
    assert fast[0][10:13] == (None, None, None)


@pytest.mark.parametrize("name", [None, *FP8])
def test_replay_passes_addresses(standin, name):
    """An FP8 replay hands Triton's launcher each tensor argument as its address: the values
    the tensors give it (test_plans.assert_replay_passes_addresses), for every FP8 kernel."""
    c = make_fp8_case(4, 64, num_blocks=5, block_size=64, max_slots=100, seed=6)
    cfg = None if name is None else dispatch.Choice(name)

    def run(*args):
        _call(*args, block_size=64, scale=c.softmax_scale, config=cfg)

    first = (c.q, c.cache.data, c.kv_indices, c.kv_indptr, c.attn_sink, torch.empty_like(c.q))
    assert_replay_passes_addresses(standin, run, first, (*_fresh(c, 7), torch.empty_like(c.q)))


@pytest.mark.parametrize("name", [None, *FP8])
@pytest.mark.parametrize("T", [4, 37])
def test_replay_makes_the_launches_the_full_path_makes(standin, name, T):
    """A call of a known layout with new tensors (a new cache at a new address included)
    replays its plan: the C launcher gets exactly what the full path (plans off: torch.ops ->
    FP8Cache -> the entry's checks -> choice -> launch) gives it for the same tensors."""
    c = make_fp8_case(T, 64, num_blocks=5, block_size=64, max_slots=100, seed=T)
    cfg = None if name is None else dispatch.Choice(name)
    first = (c.q, c.cache.data, c.kv_indices, c.kv_indptr, c.attn_sink, torch.empty_like(c.q))
    kw = dict(block_size=64, scale=c.softmax_scale, config=cfg)
    for _ in range(3):  # compile, first direct launch recorded, plan
        _call(*first, **kw)
    assert len(_plans()) == 1
    for seed in (1, 2):
        inputs = (*_fresh(c, seed), torch.empty_like(c.q))
        standin.clear()
        before = fastlaunch.stats()
        _call(*inputs, **kw)
        replayed = list(standin)
        assert fastlaunch.stats()["slow"] == before["slow"]
        full = _full_path_launches(standin, lambda *a: _call(*a, **kw), inputs)
        assert replayed and len(replayed) == len(full)
        assert [_comparable(x, inputs) for x in replayed] == [_comparable(x, inputs) for x in full]
        for x in replayed:  # q, then the cache's bytes as uint8 at the new cache's address
            got = _comparable(x, inputs)
            if got[10][0] == "tma":  # gluon_ws_fp8: a TMA descriptor of q (its shape, strides)
                assert got[10][1] == inputs[0].data_ptr(), got[10]
                cache = [a for a in got[11:] if type(a) is tuple and a[:2] == ("at input", 1)]
                assert cache and cache[0][-1] == torch.uint8, got[10:]
                continue
            assert got[10] == ("input", 0) and got[11][:2] == ("at input", 1), got[10:12]
            assert got[11][-1] == torch.uint8
        for _ in range(2):  # the switch cleared the plans: make this layout's again
            _call(*first, **kw)


def _full_path_spy(monkeypatch):
    """Counts the FP8 entry's checks (fp8_prefill._checked): every full-path call and every
    recording runs them once; a replay never does."""
    seen = []
    real = fp8_prefill._checked

    def spy(*a):
        seen.append(1)
        return real(*a)

    monkeypatch.setattr(fp8_prefill, "_checked", spy)
    return seen


def test_a_replay_rechecks_what_depends_on_more_than_the_layout(standin, tmp_path, monkeypatch):
    """With a plan: a bad kv_indptr with validate=True raises and launches nothing; a rewritten
    configs root and a cleared direct-launch cache take the full path."""
    c = make_fp8_case(5, 16, num_blocks=3, block_size=64, max_slots=40, seed=3)
    seen = _full_path_spy(monkeypatch)
    out = torch.empty_like(c.q)

    def run(ptr=c.kv_indptr, validate=False):
        _call(c.q, c.cache.data, c.kv_indices, ptr, c.attn_sink, out, block_size=64,
              scale=c.softmax_scale, validate=validate)  # fmt: skip

    for _ in range(3):
        run()
    assert len(_plans()) == 1
    n = len(seen)
    run()
    run(validate=True)
    assert len(seen) == n  # replayed
    ptr = c.kv_indptr.clone()
    ptr[-1] = c.kv_indices.numel() + 1
    out.fill_(float("nan"))
    standin.clear()
    with pytest.raises(ValueError, match="past the end"):
        run(ptr=ptr, validate=True)
    assert standin == [] and torch.isnan(out).all()
    run(ptr=ptr)  # not asked: the plan's launch (the kernel clamps), no check
    assert len(seen) == n and len(standin) == 1
    assert_root_and_clear_take_the_full_path(run, seen, tmp_path)


def test_out_overlapping_the_cache_takes_the_full_path(standin, monkeypatch):
    """A plan of a layout whose out lies past the cache in one buffer; then an out of the same
    layout and alignment inside the cache's bytes: the full path, which raises by name, with
    nothing launched and the cache's bytes untouched."""
    c = make_fp8_case(3, 16, num_blocks=2, block_size=64, max_slots=30, seed=5)
    seen = _full_path_spy(monkeypatch)
    d = c.cache.data
    T, H, D = c.q.shape
    nbytes = (d.shape[0] - 1) * d.stride(0) + d.shape[1] * 584
    apart = -(-nbytes // 16) * 16
    big = torch.zeros(apart + T * H * D * 2 + 16, dtype=torch.uint8)
    start = -big.data_ptr() % 16
    data = torch.as_strided(big.view(d.dtype), d.shape, d.stride(), start)
    data.copy_(d)

    def out_at(at):
        return big[start + at : start + at + T * H * D * 2].view(torch.bfloat16).view(T, H, D)

    def run(out):
        _call(c.q, data, c.kv_indices, c.kv_indptr, c.attn_sink, out, block_size=64,
              scale=c.softmax_scale)  # fmt: skip

    for _ in range(3):
        run(out_at(apart))
    assert len(_plans()) == 1
    n = len(seen)
    run(out_at(apart))
    assert len(seen) == n
    snapshot = big[start : start + nbytes].clone()
    standin.clear()
    with pytest.raises(ValueError, match="out overlaps kv"):
        run(out_at(64))
    assert len(seen) == n + 1 and standin == []
    assert torch.equal(big[start : start + nbytes], snapshot)


def test_a_cache_of_another_layout_takes_the_full_path(standin, monkeypatch):
    """The plan is keyed on the cache's layout and block size: the same bytes as a cache of
    fewer blocks, as [num_blocks, bytes] of the padded or the exact byte size, or with another
    block size (which FP8Cache refuses) each take the full path; the launches equal the full
    path's (plans off) and the outputs are right."""
    c = make_fp8_case(4, 16, num_blocks=4, block_size=64, max_slots=200, seed=7)
    seen = _full_path_spy(monkeypatch)
    d = c.cache.data

    def run(data, bs=64, plans=True):
        out = torch.full_like(c.q, float("nan"))
        prev = op.set_plans_enabled(plans) if not plans else None
        try:
            _call(c.q, data, c.kv_indices, c.kv_indptr, c.attn_sink, out, block_size=bs,
                  scale=c.softmax_scale)  # fmt: skip
        finally:
            if prev is not None:
                op.set_plans_enabled(prev)
        return out

    for _ in range(3):
        run(d)
    assert len(_plans()) == 1
    n = len(seen)
    run(d)
    assert len(seen) == n
    bb = F.block_bytes(64)
    flat = torch.as_strided(d.view(torch.uint8), (d.shape[0], bb), (d.stride(0), 1),
                            d.storage_offset())  # fmt: skip
    layouts = {
        "fewer blocks": d[:2],
        "padded bytes": flat,
        "exact bytes": flat[:, : 64 * 584],
    }
    for what, data in layouts.items():
        n = len(seen)
        standin.clear()
        got = run(data)
        planned = list(standin)
        assert len(seen) == n + 1, what  # the full path (recording), not the plan
        standin.clear()
        want = run(data, plans=False)
        inputs = (c.q, data, c.kv_indices, c.kv_indptr, c.attn_sink)
        assert planned and [_comparable(x, inputs) for x in planned] == [
            _comparable(x, inputs) for x in standin
        ], what
        slots = data.shape[0] * 64  # num_slots, an argument of the launch
        assert any(type(a) is int and a == slots for a in planned[0][13:]), what
        assert torch.isnan(got).all() and torch.isnan(want).all()  # the stand-in runs nothing
    op._PLANS.clear()
    for _ in range(3):
        run(flat)
    assert len(_plans()) == 1
    n = len(seen)
    out = torch.empty_like(c.q)
    args = (c.kv_indices, c.kv_indptr, c.softmax_scale, c.attn_sink, out)
    with pytest.raises(ValueError, match="fit neither block_size 32"):
        torch.ops.sparse_mla.prefill_fp8(c.q, flat, 32, *args)
    with pytest.raises(ValueError, match="block_size 63 does not match"):
        op._fp8_impl(c.q, d, 63, *args)
    assert len(seen) == n  # FP8Cache refused them before the entry's checks


@pytest.mark.skipif(op._GUARDS is None, reason="this torch has no C++ tensor guard")
def test_the_last_fp8_plan_is_its_ops_own(standin):
    """The FP8 op keeps its last plan apart from the dense op's (op._LAST_FP8): a recorded FP8
    plan is the shortcut for the same layout on new tensors and block size, not for another
    block size or cache layout, and a dense call never takes it."""
    c = make_fp8_case(4, 16, num_blocks=4, block_size=64, max_slots=200, seed=9)
    first = (c.q, c.cache.data, c.kv_indices, c.kv_indptr, c.attn_sink, torch.empty_like(c.q))
    for _ in range(3):
        _call(*first, block_size=64, scale=c.softmax_scale)
    (p,) = _plans()
    assert op._PLANS[op._LAST_FP8] == (p,) and op._LAST not in op._PLANS
    head = (c.softmax_scale, None, 64, False, False, None)
    fresh = (*_fresh(c, 3), torch.empty_like(c.q))
    assert op._last(op._LAST_FP8, *fresh, head) is p
    assert op._last(op._LAST_FP8, *fresh[:1], c.cache.data[:2], *fresh[2:], head) is None
    assert op._last(op._LAST_FP8, *fresh, (c.softmax_scale, None, 32, False, False)) is None
    assert op._last(op._LAST, *fresh, (c.softmax_scale, None, None, False, False)) is None


@pytest.mark.parametrize("name", [None, *FP8])
def test_dense_ids_plan_and_replay_the_full_paths_launches(standin, monkeypatch, name):
    """Dense [T, K] ids (kv_indptr None): the FP8 kernels read CSR, and the launch gives them
    the ids as they are with a kept kv_indptr (validation._dense_launch_csr), so after the first
    calls a plan replays them: on new ids no full path runs and the launches are exactly the
    full path's (plans off)."""
    c = make_fp8_case(3, 16, num_blocks=2, block_size=64, seed=9)
    seen = _full_path_spy(monkeypatch)
    cfg = None if name is None else dispatch.Choice(name)
    kw = dict(block_size=64, scale=c.softmax_scale, config=cfg)

    def ids(seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randint(-1, c.cache.num_slots + 1, (3, 20), generator=g, dtype=torch.int32)

    first = (c.q, c.cache.data, ids(1), None, c.attn_sink, torch.empty_like(c.q))
    for _ in range(4):
        _call(*first, **kw)
    assert len(_plans()) == 1
    for seed in (2, 3):
        inputs = (*_fresh(c, seed)[:2], ids(seed), None, c.attn_sink, torch.empty_like(c.q))
        n = len(seen)
        standin.clear()
        _call(*inputs, **kw)
        replayed = list(standin)
        assert len(seen) == n  # replayed: no full path
        full = _full_path_launches(standin, lambda *a: _call(*a, **kw), inputs)
        assert replayed and [_comparable(x, inputs) for x in replayed] == [
            _comparable(x, inputs) for x in full]  # fmt: skip
        for _ in range(3):  # the switch cleared the plans: make this layout's again
            _call(*first, **kw)


def test_interpreted_fp8_calls_make_no_plan(monkeypatch):
    """CPU tensors run triton_fp8 in Triton's interpreter: no plan, right outputs."""
    monkeypatch.setattr(op, "_PLANS", {})
    c = make_fp8_case(3, 16, num_blocks=2, block_size=8, max_slots=12, seed=10)
    for _ in range(3):
        out = torch.full_like(c.q, float("nan"))
        prefill.sparse_mla_prefill(*c.args(), attn_sink=c.attn_sink, out=out)
        rows = F.dequantize(c.cache)
        rep = check_against_reference(out, c.q, rows, c.kv_indices, c.kv_indptr,
                                      c.softmax_scale, attn_sink=c.attn_sink)  # fmt: skip
        assert rep.ok, str(rep)
    assert op._PLANS == {}


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("H", [16, 64])
@pytest.mark.parametrize("T", [4, 300])
def test_gpu_fp8_replays_equal_the_full_path(H, T):
    """Each FP8 kernel that can run the call, and config=None: the third call of a layout on
    fresh inputs (a plan's replay) equals the full path bit for bit and the fp32 reference."""
    op._PLANS.clear()
    c = make_fp8_case(T, H, num_blocks=40, block_size=64, max_slots=300, seed=H + T)

    def on(t):
        return None if t is None else t.to("cuda")

    first = [on(t) for t in (c.q, c.cache.data, c.kv_indices, c.kv_indptr, c.attn_sink)]
    call = dispatch.Call(runtime.arch(), H, 512, torch.bfloat16, FP8Cache(first[1], 64), T,
                         kv_format=F.KV_FORMAT)  # fmt: skip
    cfgs = [None] + [dispatch.Choice(n) for n in FP8 if not dispatch.kernel(n).unavailable(call)]
    for cfg in cfgs:
        for _ in range(3):
            _call(*first, torch.empty_like(first[0]), block_size=64, scale=c.softmax_scale,
                  config=cfg)  # fmt: skip
        assert any(type(p) is op._Plan for p in op._PLANS.values()), cfg
        for seed in (1, 2):
            q, data, idx, ptr, sink = (on(t) for t in _fresh(c, seed))
            got = torch.full_like(q, float("nan"))
            _call(q, data, idx, ptr, sink, got, block_size=64, scale=c.softmax_scale, config=cfg)
            prev = op.set_plans_enabled(False)
            try:
                want = torch.full_like(q, float("nan"))
                _call(q, data, idx, ptr, sink, want, block_size=64, scale=c.softmax_scale,
                      config=cfg)  # fmt: skip
            finally:
                op.set_plans_enabled(prev)
            torch.cuda.synchronize()
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), cfg
            rows = F.dequantize(FP8Cache(data, 64)).cpu()
            rep = check_against_reference(got.cpu(), q.cpu(), rows, idx.cpu(), ptr.cpu(),
                                          c.softmax_scale, attn_sink=sink.cpu())  # fmt: skip
            assert rep.ok, (cfg, rep)
            for _ in range(2):  # the switch cleared the plans: make this layout's again
                _call(*first, torch.empty_like(first[0]), block_size=64, scale=c.softmax_scale,
                      config=cfg)  # fmt: skip


@pytest.mark.parametrize("scale", [0.05, 0.0, -0.05])
def test_gluon_ws_fp8_folds_only_a_positive_scale(standin, monkeypatch, scale):
    """gluon_ws_fp8 shares gluon_ws's consumers: POS_SCALE in its launch exactly when the
    softmax scale is > 0."""
    from sparse_mla.gluon import hopper_ws_fp8

    seen = _launch_kwargs(monkeypatch)
    c = make_fp8_case(4, 64, num_blocks=3, block_size=64, seed=1)
    inputs = (c.q, c.cache.data, c.kv_indices, c.kv_indptr, c.attn_sink, torch.empty_like(c.q))
    prev = op.set_plans_enabled(False)
    try:
        _call(*inputs, block_size=64, scale=scale, config=dispatch.Choice("gluon_ws_fp8"))
    finally:
        op.set_plans_enabled(prev)
    ws = [kw for fn, kw in seen if fn is hopper_ws_fp8._prefill_ws_fp8_kernel]
    assert ws and all(kw.get("POS_SCALE", False) is (scale > 0) for kw in ws)
