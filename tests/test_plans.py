"""The op's plans (sparse_mla.op: a call whose layout was seen replays the launches the last
such call made) and the eager bypass of the op dispatcher (op.call): CPU only, with the
package's kernels compiled for sm90 and a stand-in driver that records each C launch (as in
test_fastlaunch.py). The GPU test (every kernel, replays bitwise equal to the full path and to
the fp32 reference) is tests/test_kernels_gpu.py-style, at the end of this file."""

from __future__ import annotations

import sys
from collections import defaultdict
from dataclasses import replace

import pytest
import torch
import triton
import triton.language as tl
from conftest import make_case, poisoned_like, runnable_everywhere
from torch.utils._python_dispatch import TorchDispatchMode

from sparse_mla import configs, dispatch, fastlaunch, op, prefill, runtime, validation
from sparse_mla.reference import check_against_reference
from sparse_mla.standin import sm90_driver, sm90_patches

DENSE = ["triton", "gluon_ws", "gluon_ws_small", "gluon_mma", "gluon_wgmma"]


def standin_setup(monkeypatch, kernels, names) -> list:
    """The stand-in sm90 world of the plan tests: Triton's driver a :func:`sm90_driver` that
    records each C launch (the returned list), ``kernels`` (jit functions) compiled anew, the
    launchers, TMA maps and plans the test's own, replays passing tensors (as the full path
    does, so launches compare argument by argument; their addresses as ints, the default, are
    ``test_replay_passes_addresses``'s), the sm90 dispatch on CPU tensors, and the registered
    kernels ``names`` let take CPU tensors."""

    calls: list = []
    monkeypatch.setattr(fastlaunch.driver, "_active", sm90_driver(calls))
    for jit_fn in kernels:
        monkeypatch.setattr(jit_fn, "device_caches", defaultdict(jit_fn.create_binder))
    monkeypatch.setattr(fastlaunch, "_LAUNCHERS", {})
    monkeypatch.setattr(fastlaunch, "_TMA_MAPS", {})
    monkeypatch.setattr(op, "_PLANS", {})
    monkeypatch.setattr(fastlaunch, "_POINTER_INTS", [False])
    for owner, attr, value in sm90_patches():
        monkeypatch.setattr(owner, attr, value)
    runnable_everywhere(monkeypatch, names)
    return calls


@pytest.fixture
def standin(monkeypatch):
    """Every dense kernel compiled for sm90 here, launched on a driver whose C launch records
    its arguments (returned list); the plans, launchers and TMA maps are the test's own."""
    from sparse_mla.gluon import algorithm, hopper_prefill, hopper_ws, hopper_ws_small

    kernels = (prefill._sparse_mla_prefill_kernel, algorithm._mla_fwd_kernel,
               algorithm._mla_reduce_kernel, hopper_prefill._prefill_wgmma_kernel,
               hopper_ws._prefill_ws_kernel, hopper_ws_small._prefill_ws_small_kernel)  # fmt: skip
    return standin_setup(monkeypatch, kernels, DENSE[1:])


def _fresh(case, seed):
    """Inputs of the same layout as ``case`` (shapes, strides, dtypes, 16-byte alignment) with
    new values at new addresses; kv_indptr equal (the same nnz), slots drawn anew."""
    g = torch.Generator().manual_seed(seed)
    N = case.kv.shape[0]
    q = torch.randn(case.q.shape, generator=g).to(case.q.dtype)
    kv = torch.randn(case.kv.shape, generator=g).to(case.kv.dtype)
    idx = torch.randint(-1, N + 1, case.kv_indices.shape, generator=g).to(case.kv_indices.dtype)
    sink = None if case.attn_sink is None else torch.randn(case.attn_sink.shape, generator=g)
    return q, kv, idx, case.kv_indptr.clone(), sink


def _comparable(call, inputs):
    """A recorded C launch without Triton's metadata and hooks (indices 10-12): an input
    tensor as its position in ``inputs`` (so its address is the call's own), any other tensor
    (scratch, a cached dummy) by layout."""
    keep = call[:10] + call[13:]
    out = []
    for a in keep:
        if isinstance(a, torch.Tensor):
            pos = [i for i, t in enumerate(inputs) if t is a]
            out.append(("input", pos[0]) if pos else (tuple(a.shape), a.stride(), a.dtype))
        else:
            out.append(a)
    return tuple(out)


def _full_path_launches(standin, run, inputs) -> list:
    """The launches ``run(*inputs)`` makes with plans off (the entry's full path)."""
    prev = op.set_plans_enabled(False)
    try:
        standin.clear()
        run(*inputs)
        return list(standin)
    finally:
        op.set_plans_enabled(prev)


def assert_root_and_clear_take_the_full_path(run, seen: list, tmp_path) -> None:
    """``run()`` of a planned layout (``seen`` counts the full path's calls): under another
    configs root it takes the full path once and records anew, the next calls replay; after
    ``fastlaunch.clear()`` the next call takes the full path and Triton's slow launch."""
    n = len(seen)
    with configs.use_root(tmp_path):
        run()
    assert len(seen) == n + 1  # another configs root: the full path, recorded anew
    run()
    assert len(seen) == n + 2
    run()
    n = len(seen)
    fastlaunch.clear()
    before = fastlaunch.stats()
    run()
    assert len(seen) == n + 1 and fastlaunch.stats()["slow"] > before["slow"]


def _plans():
    return [p for p in op._PLANS.values() if type(p) is op._Plan]


def assert_replay_passes_addresses(standin, run, plan_inputs, inputs) -> None:
    """The replay of a plan made from ``run(*plan_inputs)`` on ``inputs``, built with tensor
    arguments as their addresses (fastlaunch's default) and as the tensors (the standin
    fixtures' setting): the first gives the C launcher exactly the second's arguments with each
    tensor as its ``data_ptr()`` (what Triton's launcher reads of it), and no tensor."""
    got = {}
    for ints in (False, True):
        fastlaunch._POINTER_INTS[0] = ints
        op._PLANS.clear()
        for _ in range(3):
            run(*plan_inputs)
        assert len(_plans()) == 1
        standin.clear()
        before = fastlaunch.stats()
        run(*inputs)
        assert fastlaunch.stats()["slow"] == before["slow"]
        assert fastlaunch.stats()["fast"] - before["fast"] == _plans()[0].replay.launches
        got[ints] = list(standin)
    as_tensors, as_ints = got[False], got[True]
    assert as_tensors and len(as_ints) == len(as_tensors)
    for a, b in zip(as_tensors, as_ints, strict=True):
        assert any(isinstance(x, torch.Tensor) for x in a)
        assert not any(isinstance(x, torch.Tensor) for x in b)
        assert tuple(b) == tuple(x.data_ptr() if isinstance(x, torch.Tensor) else x for x in a)


@pytest.mark.parametrize("name", DENSE)
@pytest.mark.parametrize("T", [4, 37])
def test_replay_makes_the_launches_the_full_path_makes(standin, name, T):
    """A call of a known layout with new tensors replays its plan: the C launcher gets exactly
    what the full path (plans off: torch.ops -> validate -> choose -> the kernel's launch) gives
    it for the same tensors: grids, stream, kernels, every argument, the input tensors
    themselves, TMA encodings of their addresses."""
    c = make_case(T, 64, 512, N=300, max_slots=100, dtype=torch.bfloat16, seed=T)
    cfg = dispatch.Choice(name)

    def run(q, kv, idx, ptr, sink, out):
        prefill.sparse_mla_prefill(q, kv, idx, ptr, c.softmax_scale, attn_sink=sink, out=out,
                                   config=cfg, validate=False)  # fmt: skip

    first = (c.q, c.kv, c.kv_indices, c.kv_indptr, c.attn_sink, torch.empty_like(c.q))
    for _ in range(3):  # compile, first direct launch recorded, plan
        run(*first)
    assert len(_plans()) == 1
    for seed in (1, 2):
        inputs = (*_fresh(c, seed), torch.empty_like(c.q))
        standin.clear()
        before = fastlaunch.stats()
        run(*inputs)
        replayed = list(standin)
        standin.clear()
        run(*inputs)  # again at the same addresses (a TMA map kept by address is reused)
        assert [_comparable(x, inputs) for x in standin] == [
            _comparable(x, inputs) for x in replayed
        ]
        assert fastlaunch.stats()["slow"] == before["slow"]
        full = _full_path_launches(standin, run, inputs)
        assert replayed and len(replayed) == len(full)
        assert [_comparable(x, inputs) for x in replayed] == [_comparable(x, inputs) for x in full]
        # the plan set was cleared with the switch: it is built again
        for _ in range(2):
            run(*first)


def test_a_replay_rechecks_what_depends_on_more_than_the_layout(standin, tmp_path, monkeypatch):
    """With a plan: out overlapping an input, a bad kv_indptr (validate=True), a rewritten
    configs root, a cleared direct-launch cache, each take the full path (and raise by name)."""
    c = make_case(5, 16, 512, N=200, max_slots=40, dtype=torch.bfloat16, seed=3)
    real = op._IMPL[0]
    seen = []

    def spy(*a):
        seen.append(1)
        return real(*a)

    monkeypatch.setattr(op, "_IMPL", [spy])
    out = torch.empty_like(c.q)

    def run(q=c.q, kv=c.kv, ptr=c.kv_indptr, out=out, validate=False):
        prefill.sparse_mla_prefill(q, kv, c.kv_indices, ptr, c.softmax_scale,
                                   attn_sink=c.attn_sink, out=out, validate=validate)  # fmt: skip

    for _ in range(3):
        run()
    assert len(_plans()) == 1
    n = len(seen)
    run()
    run(validate=True)
    assert len(seen) == n  # replayed
    ptr = c.kv_indptr.clone()
    ptr[-1] = c.kv_indices.numel() + 1
    with pytest.raises(ValueError, match="past the end"):
        run(ptr=ptr, validate=True)
    # out inside kv's buffer, the same layout as before (16-byte aligned, same strides)
    T, H, D = c.q.shape
    N = c.kv.shape[0]
    big = torch.zeros((N + T * H) * D, dtype=c.kv.dtype)
    kv2 = big[: N * D].view(N, D)
    kv2.copy_(c.kv)
    run(kv=kv2)  # no overlap: a plan of this layout
    run(kv=kv2)
    out2 = big.view(N + T * H, D)[:N].view(-1)[: T * H * D].view(T, H, D)
    with pytest.raises(ValueError, match="out overlaps kv"):
        run(kv=kv2, out=out2)
    assert_root_and_clear_take_the_full_path(run, seen, tmp_path)


def _variants(c, out):
    """(what, inputs) each differing from ``c``'s call (into ``out``) in one thing a plan's key
    records: a shape, a stride, a dtype, an input not 16-byte aligned, the sink absent."""
    T, H, D = c.q.shape
    N = c.kv.shape[0]
    args = dict(q=c.q, kv=c.kv, idx=c.kv_indices, ptr=c.kv_indptr, sink=c.attn_sink, out=out)

    def unaligned(t):  # the same layout 2 bytes on
        buf = torch.empty(t.numel() + 8, dtype=t.dtype)[1:]
        return buf[: t.numel()].view(t.shape).copy_(t)

    def wide(t):  # rows twice as far apart
        return torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)[..., : t.shape[-1]]

    return [
        ("T", dict(args, q=torch.randn(T + 1, H, D).to(c.q.dtype),
                   out=torch.empty(T + 1, H, D, dtype=out.dtype),
                   ptr=torch.cat([c.kv_indptr, c.kv_indptr[-1:]]))),
        ("H", dict(args, q=c.q[:, : H // 2], out=out[:, : H // 2],
                   sink=None if c.attn_sink is None else c.attn_sink[: H // 2])),
        ("q strides", dict(args, q=c.q.transpose(0, 1).contiguous().transpose(0, 1))),
        ("kv strides", dict(args, kv=wide(c.kv).copy_(c.kv))),
        ("out strides", dict(args, out=wide(out))),
        ("N", dict(args, kv=c.kv[: N - 1])),
        ("nnz", dict(args, idx=torch.cat([c.kv_indices, c.kv_indices[:1]]))),
        ("q dtype", dict(args, q=c.q.half())),
        ("kv_indices dtype", dict(args, idx=c.kv_indices.long())),
        ("kv_indptr dtype", dict(args, ptr=c.kv_indptr.long())),
        *([("sink dtype", dict(args, sink=c.attn_sink.double())),
           ("no sink", dict(args, sink=None)),
           ("sink unaligned", dict(args, sink=unaligned(c.attn_sink)))]
          if c.attn_sink is not None else [("a sink", dict(args, sink=torch.randn(H)))]),
        ("q unaligned", dict(args, q=unaligned(c.q))),
        ("kv unaligned", dict(args, kv=unaligned(c.kv))),
        ("kv_indices unaligned", dict(args, idx=unaligned(c.kv_indices))),
        ("kv_indptr unaligned", dict(args, ptr=unaligned(c.kv_indptr))),
        ("out unaligned", dict(args, out=unaligned(out))),
        ("q needs a gradient", dict(args, q=c.q.clone().requires_grad_(True))),
        ("q on another device", dict(args, q=c.q.to("meta"))),
    ]  # fmt: skip


@pytest.mark.skipif(op._GUARDS is None, reason="this torch has no C++ tensor guard")
@pytest.mark.parametrize("sink", [True, False])
def test_the_last_plan_is_taken_only_where_its_key_would_be(standin, monkeypatch, sink):
    """The shortcut past the plan key (op._last: the last plan replayed or recorded, matched by
    its guard, the scale, config and sink flag and one OR of the addresses): the same layout on
    new tensors takes it; a call that differs in anything the key records (each shape, stride,
    dtype, 16-byte alignment, device, the sink's presence, the scale, the config) does not, and
    such a call still replays what the full path launches; plans recorded from unaligned inputs
    and a torch without the guard leave the shortcut out and still replay by key."""
    c = make_case(4, 16, 512, N=300, max_slots=100, dtype=torch.bfloat16, seed=31, sink=sink)
    out = torch.empty_like(c.q)
    scale = c.softmax_scale

    def run(q, kv, idx, ptr, sink, out, scale=scale, config=None):
        prefill.sparse_mla_prefill(q, kv, idx, ptr, scale, attn_sink=sink, out=out,
                                   config=config, validate=False)  # fmt: skip

    first = (c.q, c.kv, c.kv_indices, c.kv_indptr, c.attn_sink, out)
    for _ in range(3):
        run(*first)
    (p,) = _plans()
    assert op._PLANS[op._LAST] == (p,) and p.guard is not None

    def last(q, kv, idx, ptr, sink, out, head=None):  # the head as the call makes it
        head = head or (scale, None, None, sink is None, ptr is None, None)
        return op._last(op._LAST, q, kv, idx, ptr, sink, out, head)

    fresh = (*_fresh(c, 7), torch.empty_like(c.q))
    assert last(*first) is p and last(*fresh) is p
    assert last(*fresh, head=(scale * 2, None, None, not sink, False, None)) is None
    assert last(*fresh, head=(scale, None, None, not sink, False, 64)) is None  # a bound
    cfg = op.spec_of(dispatch.Choice("triton"))
    assert last(*fresh, head=(scale, cfg, None, not sink, False, None)) is None
    for what, v in _variants(c, out):
        assert last(v["q"], v["kv"], v["idx"], v["ptr"], v["sink"], v["out"]) is None, what
        if what != "q needs a gradient":  # (never planned: op._eager's gate; the guard's)
            key = op._plan_key(v["q"], v["kv"], v["idx"], v["ptr"], scale, v["sink"], v["out"],
                               None)  # fmt: skip
            assert key != op._plan_key(*first[:4], scale, c.attn_sink, out, None), what
    # a call that misses it: its own plan, whose launches are the full path's
    v = dict(_variants(c, out))["kv strides"]
    inputs = (v["q"], v["kv"], v["idx"], v["ptr"], v["sink"], v["out"])
    for _ in range(3):
        run(*inputs)
    assert len(_plans()) == 2 and op._PLANS[op._LAST][0] is not p
    standin.clear()
    run(*inputs)
    replayed = list(standin)
    full = _full_path_launches(standin, run, inputs)
    assert replayed and [_comparable(x, inputs) for x in replayed] == [
        _comparable(x, inputs) for x in full]  # fmt: skip
    # unaligned inputs: a plan with no guard, not the last; without the guard type: none either
    for what, patch in (("unaligned", None), ("no guard type", "_GUARDS")):
        op._PLANS.clear()
        if patch:
            monkeypatch.setattr(op, patch, None)
            inputs = first
        else:
            inputs = (dict(_variants(c, out))["q unaligned"]["q"], *first[1:])
        for _ in range(3):
            run(*inputs)
        (p,) = _plans()
        assert p.guard is None and op._LAST not in op._PLANS, what
        seen = fastlaunch.stats()["fast"]
        run(*inputs)
        assert fastlaunch.stats()["fast"] > seen, what  # replayed by key


def _dense_ids(T, K, N, seed, dtype=torch.int32):
    """[T, K] slot ids: valid ones, -1 and N (absent) mixed, a new draw per seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-1, N + 1, (T, K), generator=g).to(dtype)


@pytest.mark.parametrize("name", DENSE)
def test_dense_ids_replay_what_the_full_path_launches(standin, name):
    """Dense [T, K] ids (kv_indptr None) plan too: a plan's replay on new ids makes exactly the
    full path's launches, and the plan is the last plan. A kernel that reads them itself gets
    the ids also in kv_indptr's place; one that reads CSR only gets the ids as they are and a
    kept kv_indptr (validation._dense_launch_csr: no torch op once kept, so it plans too), whose
    entries 0..T are dense_as_csr's. A CSR call of the same lists is another key."""
    T, H, K, N = 4, 64, 96, 300
    g = torch.Generator().manual_seed(5)
    q = torch.randn(T, H, 512, generator=g).bfloat16()
    kv = torch.randn(N, 512, generator=g).bfloat16()
    sink = torch.randn(H, generator=g)
    cfg = dispatch.Choice(name)

    def run(q, kv, idx, ptr, sink, out):
        prefill.sparse_mla_prefill(q, kv, idx, ptr, 0.05, attn_sink=sink, out=out, config=cfg,
                                   validate=False)  # fmt: skip

    first = (q, kv, _dense_ids(T, K, N, 1), None, sink, torch.empty_like(q))
    for _ in range(4):  # compile, the kept kv_indptr made (a torch op: no plan), recorded
        run(*first)
    assert len(_plans()) == 1
    if not dispatch.kernel(name).dense_ids:
        kept = validation._DENSE_PTRS[(K, torch.int32, torch.device("cpu"))][-1]
        want = validation.dense_as_csr(first[2])[1]
        assert torch.equal(kept[: T + 1], want)
    head = (0.05, op.spec_of(cfg), None, False, True, None)
    for seed in (2, 3):
        inputs = (q.clone(), kv.clone(), _dense_ids(T, K, N, seed), None, sink.clone(),
                  torch.empty_like(q))  # fmt: skip
        if op._GUARDS is not None:
            assert op._last(op._LAST, *inputs, head) is _plans()[0]
        standin.clear()
        run(*inputs)
        replayed = list(standin)
        full = _full_path_launches(standin, run, inputs)
        assert replayed and [_comparable(x, inputs) for x in replayed] == [
            _comparable(x, inputs) for x in full]  # fmt: skip
        for _ in range(3):  # the switch cleared the plans: make this layout's again
            run(*first)
    csr = (first[2].flatten(), torch.arange(0, T * K + 1, K, dtype=torch.int32))
    assert op._plan_key(q, kv, *csr, 0.05, sink, first[5], head[1]) != op._plan_key(
        q, kv, first[2], None, 0.05, sink, first[5], head[1])  # fmt: skip
    if op._GUARDS is not None:
        assert op._last(op._LAST, q, kv, *csr, sink, first[5], (*head[:4], False, None)) is None


def test_the_op_is_seen_where_something_watches(standin):
    """The dispatcher is bypassed only where nothing could tell: a dispatch mode, a profiler,
    torch.compile and an input that needs a gradient see torch.ops.sparse_mla.prefill."""
    c = make_case(3, 16, 512, N=100, max_slots=20, dtype=torch.bfloat16, seed=4)
    out = torch.empty_like(c.q)

    def run(q=c.q):
        prefill.sparse_mla_prefill(q, c.kv, c.kv_indices, c.kv_indptr, c.softmax_scale,
                                   attn_sink=c.attn_sink, out=out, validate=False)  # fmt: skip

    for _ in range(3):
        run()

    ops = []

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Seen():
        run()
    assert ops == ["sparse_mla.prefill.default"]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    assert any("sparse_mla::prefill" in e.name for e in prof.events())
    q = c.q.clone().requires_grad_(True)
    ops.clear()
    with Seen():
        run(q)
    assert ops == ["sparse_mla.prefill.default"]


def test_interpreted_calls_make_no_plan(monkeypatch):
    """CPU tensors run in Triton's interpreter: no plan, the output as the reference says."""
    monkeypatch.setattr(op, "_PLANS", {})
    c = make_case(3, 4, 32, N=30, max_slots=10, seed=8)
    for _ in range(3):
        out = poisoned_like(c.q)
        prefill.sparse_mla_prefill(*c.args(), attn_sink=c.attn_sink, out=out)
        assert check_against_reference(out, *c.args(), attn_sink=c.attn_sink).ok
    assert op._PLANS == {}


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("H", [16, 128])
@pytest.mark.parametrize("T", [4, 300])
def test_gpu_replays_equal_the_full_path_every_kernel(H, T):
    """Every registered dense kernel that can run the call: the third call of a layout on fresh
    inputs (a plan's replay) equals the full path bit for bit and the fp32 reference."""
    op._PLANS.clear()
    c = make_case(T, H, 512, N=2000, max_slots=300, device="cuda", seed=H + T)
    for name in DENSE:
        call = dispatch.Call(runtime.arch(), H, 512, c.q.dtype, c.kv, T)
        if dispatch.kernel(name).unavailable(call):
            continue
        cfg = dispatch.Choice(name)
        for _ in range(3):
            prefill.sparse_mla_prefill(*c.args(), attn_sink=c.attn_sink,
                                       out=torch.empty_like(c.q), config=cfg)  # fmt: skip
        assert any(type(p) is op._Plan for p in op._PLANS.values()), name
        for seed in (1, 2):
            q, kv, idx, ptr, sink = (t.cuda() if t is not None else None
                                     for t in _fresh(c, seed))  # fmt: skip
            args = (q, kv, idx, ptr, c.softmax_scale)
            got = poisoned_like(q)
            head = (float(c.softmax_scale), op.spec_of(cfg), None, sink is None, False, None)
            # the replay is the last plan's, matched by its guard on these CUDA tensors
            assert op._GUARDS is None or op._last(op._LAST, q, kv, idx, ptr, sink, got, head)
            prefill.sparse_mla_prefill(*args, attn_sink=sink, out=got, config=cfg)
            prev = op.set_plans_enabled(False)
            try:
                want = poisoned_like(q)
                prefill.sparse_mla_prefill(*args, attn_sink=sink, out=want, config=cfg)
            finally:
                op.set_plans_enabled(prev)
            torch.cuda.synchronize()
            assert torch.equal(got, want), name
            rep = check_against_reference(got, *args, attn_sink=sink)
            assert rep.ok, (name, rep)
            for _ in range(2):  # the switch cleared the plans: make this layout's again
                prefill.sparse_mla_prefill(*c.args(), attn_sink=c.attn_sink,
                                           out=torch.empty_like(c.q), config=cfg)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("H", [16, 128])
@pytest.mark.parametrize("T", [4, 300])
def test_gpu_dense_ids_replays_equal_the_full_path(H, T):
    """Dense [T, K] ids: for config=None and every registered dense kernel (those that read
    CSR only get the ids as they are and a kept kv_indptr), a plan's replay on fresh ids and
    inputs (poisoned out) equals the full path bit for bit and the fp32 reference, and is taken
    as the last plan."""
    op._PLANS.clear()
    N, K = 2000, 300
    g = torch.Generator().manual_seed(H + T)
    q = torch.randn(T, H, 512, generator=g).bfloat16().cuda()
    kv = torch.randn(N, 512, generator=g).bfloat16().cuda()
    sink = torch.randn(H, generator=g).cuda()
    names = [None, *DENSE]
    for name in names:
        cfg = None if name is None else dispatch.Choice(name)
        if cfg is not None:
            call = dispatch.Call(runtime.arch(), H, 512, q.dtype, kv, T)
            if dispatch.kernel(name).unavailable(call):
                continue
        first = _dense_ids(T, K, N, 1).cuda()
        for _ in range(4):
            prefill.sparse_mla_prefill(q, kv, first, None, 0.05, attn_sink=sink,
                                       out=torch.empty_like(q), config=cfg)  # fmt: skip
        assert any(type(p) is op._Plan for p in op._PLANS.values()), name
        for seed in (2, 3):
            ids = _dense_ids(T, K, N, seed).cuda()
            q2, kv2 = torch.randn_like(q), torch.randn_like(kv)
            got = poisoned_like(q2)
            head = (0.05, None if cfg is None else op.spec_of(cfg), None, False, True, None)
            assert op._GUARDS is None or op._last(op._LAST, q2, kv2, ids, None, sink, got, head)
            prefill.sparse_mla_prefill(q2, kv2, ids, None, 0.05, attn_sink=sink, out=got,
                                       config=cfg)  # fmt: skip
            prev = op.set_plans_enabled(False)
            try:
                want = poisoned_like(q2)
                prefill.sparse_mla_prefill(q2, kv2, ids, None, 0.05, attn_sink=sink, out=want,
                                           config=cfg)  # fmt: skip
            finally:
                op.set_plans_enabled(prev)
            torch.cuda.synchronize()
            assert torch.equal(got, want), name
            idx, ptr = validation.dense_as_csr(ids)
            rep = check_against_reference(got, q2, kv2, idx, ptr, 0.05, attn_sink=sink)
            assert rep.ok, (name, rep)
            for _ in range(3):  # the switch cleared the plans: make this layout's again
                prefill.sparse_mla_prefill(q, kv, first, None, 0.05, attn_sink=sink,
                                           out=torch.empty_like(q), config=cfg)  # fmt: skip


@triton.jit
def _toy_store(x_ptr):
    tl.store(x_ptr, 1.0)


@pytest.mark.parametrize("extra", ["nothing", "kernel_grid"])
def test_a_kernel_launching_outside_the_direct_path_never_plans(standin, monkeypatch, extra):
    """A registered kernel whose run launches nothing the recording sees (here: no launch at
    all), or a Triton kernel through kernel[grid] beside its direct launch, gets no plan: its
    run is called on every call."""
    calls = []
    real = dispatch.KERNELS["triton"]
    flag = torch.zeros(1)

    def run(*a):
        calls.append(1)
        if extra == "kernel_grid":
            real.run(*a)
            with runtime.compiling():
                _toy_store[(1,)](flag)

    monkeypatch.setitem(dispatch.KERNELS, "triton", replace(real, run=run))
    c = make_case(3, 16, 512, N=100, max_slots=20, dtype=torch.bfloat16, seed=12)
    out = torch.empty_like(c.q)
    for i in range(8):
        prefill.sparse_mla_prefill(*c.args(), attn_sink=c.attn_sink, out=out, validate=False,
                                   config=dispatch.Choice("triton"))  # fmt: skip
        assert len(calls) == i + 1
    assert _plans() == []


def test_a_recording_in_another_thread_leaves_calls_unplanned_not_failing(standin):
    import threading

    c = make_case(3, 16, 512, N=100, max_slots=20, dtype=torch.bfloat16, seed=13)
    out = torch.empty_like(c.q)
    inside, leave = threading.Event(), threading.Event()

    def hold():
        with fastlaunch.recording():
            inside.set()
            leave.wait(30)

    th = threading.Thread(target=hold)
    th.start()
    try:
        assert inside.wait(30)
        for _ in range(4):
            prefill.sparse_mla_prefill(*c.args(), attn_sink=c.attn_sink, out=out,
                                       validate=False)  # fmt: skip
        assert _plans() == []
    finally:
        leave.set()
        th.join()
    for _ in range(2):
        prefill.sparse_mla_prefill(*c.args(), attn_sink=c.attn_sink, out=out, validate=False)
    assert len(_plans()) == 1


@pytest.mark.parametrize("name", ["gluon_ws", "gluon_mma"])
def test_a_plan_keeps_no_input_alive(standin, name):
    """A plan holds the layout, the launches and constant dummies, never the tensors of the
    call it was recorded from (nor their scratch)."""
    import gc
    import weakref

    c = make_case(4, 64, 512, N=300, max_slots=100, dtype=torch.bfloat16, seed=14)
    inputs = [c.q.clone(), c.kv.clone(), c.kv_indices.clone(), c.kv_indptr.clone(),
              c.attn_sink.clone(), torch.empty_like(c.q)]  # fmt: skip
    refs = [weakref.ref(t) for t in inputs]
    for _ in range(3):
        prefill.sparse_mla_prefill(*inputs[:4], c.softmax_scale, attn_sink=inputs[4],
                                   out=inputs[5], validate=False,
                                   config=dispatch.Choice(name))  # fmt: skip
    assert len(_plans()) == 1
    del inputs
    standin.clear()  # the recording driver's own references
    gc.collect()
    assert [r() is None for r in refs] == [True] * 6


@pytest.mark.parametrize("name", [*DENSE, "gluon_mma split", "gluon_wgmma split", "gluon_ws split"])
def test_replay_passes_addresses(standin, name):
    """A replay hands Triton's launcher each tensor argument as its address (no data_ptr()
    call and driver pointer query per tensor there): the same values the tensors give it, for
    every kernel, its TMA maps and the split kernels' lent partials included."""
    if name.endswith("split"):
        c, run = _split_case(name.split()[0], standin)
    else:
        c = make_case(4, 64, 512, N=300, max_slots=100, dtype=torch.bfloat16, seed=3)
        cfg = dispatch.Choice(name)

        def run(q, kv, idx, ptr, sink, out):
            prefill.sparse_mla_prefill(q, kv, idx, ptr, c.softmax_scale, attn_sink=sink,
                                       out=out, config=cfg, validate=False)  # fmt: skip

    first = (c.q, c.kv, c.kv_indices, c.kv_indptr, c.attn_sink, torch.empty_like(c.q))
    assert_replay_passes_addresses(standin, run, first, (*_fresh(c, 5), torch.empty_like(c.q)))


# ----------------------------------------------------------------------------------------------
# Scratch lent to replays (fastlaunch.Scratch): the KV splits' partials
# ----------------------------------------------------------------------------------------------


def _split_launches(name, H):
    """(launches, scratch tensors) of a split prefill call of ``name`` at H heads on sm90 with
    the kernel's own launch: the reduce fused into the split launch for 16-head blocks (fp32
    partials and int32 arrival counters; ``gluon_mma`` takes them for every split prefill call,
    ``launch.SPLIT_CONFIG``), else a second launch (the partials)."""
    from sparse_mla.gluon import launch

    if name == "gluon_ws":  # its splits, then the column-block reduce (the partials)
        return (2, 2)
    sm90 = launch.get_target("sm90")
    cfg = launch.SPLIT_CONFIG if name == "gluon_mma" else launch.resolve_launch(name, None, H, sm90)
    return (1, 3) if launch.fused_reduce(2, sm90, cfg.BLOCK_H) else (2, 2)


@pytest.mark.parametrize("H", [16, 32, 64, 128])
def test_gluon_mma_prefill_calls_that_split_take_16_head_blocks(standin, monkeypatch, H):
    """gluon_mma with its own launch: a prefill call that splits with the default head blocks
    (32/64 above 16 heads) runs 16-head blocks with the reduce fused (64-head defaults only
    with at most launch.SPLIT_TRADE_PROGRAMS 16-head programs: H64 at 4 rows, not H128); one
    that does not split, an explicit launch or an explicit split count keeps what it asked
    for."""
    from sparse_mla.gluon import launch

    got = []

    def fake(cfg, tgt, *args, splits, fused, **kw):
        got.append((cfg.BLOCK_H, splits, fused))

    monkeypatch.setattr(launch, "_launch_shared", fake)
    sm90 = launch.get_target("sm90")
    default = launch._default_mma(H, sm90)
    small = make_case(4, H, 512, N=2000, max_slots=700, dtype=torch.bfloat16, seed=40,
                      empty_rows=False)  # fmt: skip
    big = make_case(140, H, 512, N=300, max_slots=40, dtype=torch.bfloat16, seed=41)

    def run(c, **kw):
        got.clear()
        launch.mla_gluon(c.q, None, c.kv, None, c.kv_indices, c.kv_indptr, c.softmax_scale,
                         has_pe=False, attn_sink=c.attn_sink, kernel="gluon_mma", **kw)  # fmt: skip
        (one,) = got
        return one

    def trades(rows):  # launch.SPLIT_TRADE_PROGRAMS: 64-head defaults only for few programs
        few = rows * -(-H // 16) <= launch.SPLIT_TRADE_PROGRAMS
        return default.BLOCK_H <= 32 or few

    bh, splits, fused = run(small)
    assert bh == (16 if trades(4) else default.BLOCK_H) and splits > 1 and fused
    assert run(small, config=default) == (bh, splits, fused)  # the default, as dispatch gives it
    given = replace(default)  # the same fields, given by the caller: kept
    assert run(small, config=given)[0] == default.BLOCK_H
    # T=4: the default head blocks' combiners fit on the SMs, so those splits fuse too
    assert run(small, config=given)[2]
    assert run(small, num_kv_splits=3) == (default.BLOCK_H, 3, True)
    assert run(big) == (default.BLOCK_H, 1, False)
    assert run(small, config=default) == (bh, splits, fused)
    # 40 rows: each head-block size splits only where two splits of its programs fit the
    # program slots in one wave (launch.programs_per_sm: two 4-warp programs an SM, one
    # 8-warp one; on 132 SMs 16-head blocks up to H 48, the defaults up to H 64)
    mid = make_case(40, H, 512, N=2000, max_slots=700, dtype=torch.bfloat16, seed=42,
                    empty_rows=False)  # fmt: skip
    units = launch._num_compute_units(0)
    nnz = mid.kv_indices.numel()
    per16, per_def = (launch.programs_per_sm(c, sm90) for c in (launch.SPLIT_CONFIG, default))
    s16 = launch.choose_num_splits(40, H, nnz, launch.SPLIT_CONFIG, units, per16)
    s_def = launch.choose_num_splits(40, H, nnz, default, units, per_def)
    programs16, programs_def = 40 * -(-H // 16), 40 * -(-H // default.BLOCK_H)
    assert (s16 > 1) == (programs16 < units and units * per16 >= 2 * programs16)
    assert (s_def > 1) == (programs_def < units and units * per_def >= 2 * programs_def)
    groups = 40 * -(-H // default.BLOCK_H)
    fused_mid = launch.fused_reduce(s_def, sm90, default.BLOCK_H, groups, units)
    assert fused_mid == (launch.combiners(default.BLOCK_H) * groups <= units)
    want = (16, s16, True) if s16 > 1 and trades(40) else (default.BLOCK_H, s_def, fused_mid)
    assert run(mid) == want
    # through the public entry (dispatch resolves the launch to the default object)
    got.clear()
    prefill.sparse_mla_prefill(*small.args(), attn_sink=small.attn_sink, validate=False,
                               config=dispatch.Choice("gluon_mma"))  # fmt: skip
    assert got[-1] == (bh, splits, fused)


def _split_case(name, standin, seed=20, H=64):
    """A gluon_mma / gluon_wgmma / gluon_ws layout at T=4 that runs KV splits
    (:func:`_split_launches`; gluon_ws's rule wants lists of 6 pairs of tiles and more),
    planned; returns (case, run)."""
    c = make_case(4, H, 512, N=2000, max_slots=3000 if name == "gluon_ws" else 700,
                  dtype=torch.bfloat16, seed=seed, empty_rows=False)  # fmt: skip
    cfg = dispatch.Choice(name)

    def run(q, kv, idx, ptr, sink, out):
        prefill.sparse_mla_prefill(q, kv, idx, ptr, c.softmax_scale, attn_sink=sink, out=out,
                                   config=cfg, validate=False)  # fmt: skip

    for _ in range(3):
        run(c.q, c.kv, c.kv_indices, c.kv_indptr, c.attn_sink, torch.empty_like(c.q))
    (p,) = _plans()
    assert (
        p.replay.launches == _split_launches(name, H)[0] and type(p.scratch) is fastlaunch.Scratch
    )
    return c, run


_HELD: list = []  # the tensors _scratch_args saw, alive till the test ends (ids stay theirs)


def _scratch_args(calls, inputs):
    """The ids of the tensors the recorded launches got that are no input (the partials) and
    not a 1-element dummy; the tensors are held, so no later tensor reuses an id."""
    got = [a for call in calls for a in call if isinstance(a, torch.Tensor)
           and a.numel() > 1 and not any(a is t for t in inputs)]  # fmt: skip
    _HELD.extend(got)
    return {id(a) for a in got}


def _kept_ids():
    """The ids of the kept scratch tensors (held, as _scratch_args')."""
    got = [t for bufs in fastlaunch._SCRATCH.values() for t in bufs]
    _HELD.extend(got)
    return {id(t) for t in got}


@pytest.mark.parametrize(
    "name, H", [("gluon_mma", 64), ("gluon_wgmma", 64), ("gluon_mma", 16), ("gluon_ws", 64)]
)
def test_split_partials_are_lent_to_the_next_replay_on_the_stream(standin, monkeypatch, name, H):
    """A replay of a split layout takes the partials the last replay on the same stream and
    thread kept (no torch.empty), and its launches are still the full path's (the partials by
    layout); another stream or thread gets its own set."""
    import threading

    monkeypatch.setattr(fastlaunch, "_SCRATCH", {})
    monkeypatch.setattr(fastlaunch, "_SCRATCH_HELD", [0])
    monkeypatch.setattr(sys.modules[__name__], "_HELD", [])
    c, run = _split_case(name, standin, H=H)
    sets = []
    for seed in (1, 2, 3):
        inputs = (*_fresh(c, seed), torch.empty_like(c.q))
        standin.clear()
        run(*inputs)
        replayed = list(standin)
        sets.append(_scratch_args(replayed, inputs))
        # partial outputs, partial LSEs (and the fused reduce's arrival counters)
        assert len(sets[-1]) == _split_launches(name, H)[1]
        full = _full_path_launches(standin, run, inputs)
        assert [_comparable(x, inputs) for x in replayed] == [_comparable(x, inputs) for x in full]
        for _ in range(3):  # the switch cleared the plans (and the kept sets): plan again
            run(c.q, c.kv, c.kv_indices, c.kv_indptr, c.attn_sink, torch.empty_like(c.q))
    # with the plan kept: the same set every replay on this stream and thread
    inputs = (*_fresh(c, 4), torch.empty_like(c.q))
    got = []
    for _ in range(3):
        standin.clear()
        run(*inputs)
        got.append(_scratch_args(standin, inputs))
    assert got[0] == got[1] == got[2] and len(fastlaunch._SCRATCH) == 1
    # another stream: its own set (both kept)
    drv = fastlaunch.driver._active
    monkeypatch.setattr(drv, "get_current_stream", lambda device: 78)
    standin.clear()
    run(*inputs)
    other = _scratch_args(standin, inputs)
    assert other and not other & got[0] and len(fastlaunch._SCRATCH) == 2
    monkeypatch.setattr(drv, "get_current_stream", lambda device: 77)
    standin.clear()
    run(*inputs)
    assert _scratch_args(standin, inputs) == got[0]
    # another thread on the same stream: its own set too
    seen = []

    def in_thread():
        n = len(standin)
        run(*inputs)
        seen.append(_scratch_args(standin[n:], inputs))

    th = threading.Thread(target=in_thread)
    th.start()
    th.join()
    assert seen[0] and not seen[0] & got[0] and len(fastlaunch._SCRATCH) == 3


def test_zero_at_rest_scratch_is_made_with_zeros_and_lent_as_is(standin, monkeypatch):
    """The split kernels' arrival counters (fastlaunch.zeroed): a recorded call may make them
    (any other torch.zeros makes it not replayable); a replay without a kept set makes them
    with torch.zeros, one with a kept set lends them as they are (the kernel leaves them 0)."""
    w = op._Watch()
    with w:
        torch.zeros(3, dtype=torch.int32)
    assert w.other and not w.empties
    w = op._Watch()
    with w:
        fastlaunch.zeroed(5, torch.int32, torch.device("cpu"))
        torch.empty(2)
    assert not w.other and [z for *_, z in w.empties] == [True, False]

    monkeypatch.setattr(fastlaunch, "_SCRATCH", {})
    monkeypatch.setattr(fastlaunch, "_SCRATCH_HELD", [0])
    monkeypatch.setattr(sys.modules[__name__], "_HELD", [])
    c, run = _split_case("gluon_mma", standin, seed=23, H=16)
    fastlaunch.clear_scratch()
    inputs = (*_fresh(c, 6), torch.empty_like(c.q))

    def counters():
        standin.clear()
        run(*inputs)
        got = [a for call in standin for a in call if isinstance(a, torch.Tensor)
               and a.dtype == torch.int32 and a.numel() > 1
               and not any(a is t for t in inputs)]  # fmt: skip
        _HELD.extend(got)
        assert len(got) == 1
        return got[0]

    first = counters()  # no kept set: made with torch.zeros
    assert first.numel() == 5 and torch.all(first == 0)  # 4 rows x 1 head block, the ticket
    first.fill_(7)  # as if a launch had left them non-zero (a broken kernel)
    assert counters() is first and torch.all(first == 7)  # the kept set, lent as it is
    fastlaunch.clear_scratch()
    again = counters()
    assert again is not first and torch.all(again == 0)


def test_kept_partials_are_bounded_and_never_cross_a_graph_capture(standin, monkeypatch):
    """Past the byte budget a set is not kept (each replay makes its own); past the count of
    sets every kept set is dropped; inside a CUDA-graph capture a replay neither takes a kept
    set nor keeps its own."""
    monkeypatch.setattr(fastlaunch, "_SCRATCH", {})
    monkeypatch.setattr(fastlaunch, "_SCRATCH_HELD", [0])
    monkeypatch.setattr(sys.modules[__name__], "_HELD", [])
    c, run = _split_case("gluon_mma", standin, seed=21)
    (p,) = _plans()
    inputs = (*_fresh(c, 5), torch.empty_like(c.q))
    run(*inputs)
    assert len(fastlaunch._SCRATCH) == 1
    assert fastlaunch._SCRATCH_HELD[0] == p.scratch.nbytes > 0
    kept = _kept_ids()

    # a capture (faked: the plan's set made CUDA, the current stream capturing)
    monkeypatch.setattr(p.scratch, "cuda", True)
    monkeypatch.setattr(fastlaunch, "_capturing", lambda: True)
    standin.clear()
    run(*inputs)
    assert _scratch_args(standin, inputs).isdisjoint(kept)
    assert _kept_ids() == kept
    monkeypatch.setattr(fastlaunch, "_capturing", lambda: False)
    standin.clear()
    run(*inputs)
    assert _scratch_args(standin, inputs) == kept

    # one set at most: another stream's set replaces this one
    monkeypatch.setattr(fastlaunch, "_SCRATCH_SETS", 1)
    drv = fastlaunch.driver._active
    monkeypatch.setattr(drv, "get_current_stream", lambda device: 79)
    run(*inputs)
    assert len(fastlaunch._SCRATCH) == 1 and fastlaunch._SCRATCH_HELD[0] == p.scratch.nbytes
    assert not _kept_ids() & kept

    # a budget below the set: nothing kept, every replay makes its own
    monkeypatch.setattr(fastlaunch, "_SCRATCH_BYTES", p.scratch.nbytes - 1)
    fastlaunch.clear_scratch()
    standin.clear()
    run(*inputs)
    run(*inputs)
    assert fastlaunch._SCRATCH == {} and fastlaunch._SCRATCH_HELD[0] == 0


@pytest.mark.parametrize("name", ["gluon_ws", "gluon_mma", "gluon_wgmma"])
def test_generated_replay_guard_answers_as_the_loop(standin, name):
    """Replay.valid (straight-line code made per replay) says what Replay._valid (the loop over
    launches and constexpr globals) says, for each thing either checks changed in turn."""
    c = make_case(4, 64, 512, N=2000, max_slots=700, dtype=torch.bfloat16, seed=22,
                  empty_rows=False)  # fmt: skip
    for _ in range(3):
        prefill.sparse_mla_prefill(*c.args(), attn_sink=c.attn_sink, out=torch.empty_like(c.q),
                                   config=dispatch.Choice(name), validate=False)  # fmt: skip
    (p,) = _plans()
    r = p.replay
    assert r.valid() is True and r._valid() is True
    drv = fastlaunch.driver._active
    rt = triton.knobs.runtime
    hook = lambda metadata: None  # noqa: E731
    globs = [(n, x) for n, (_, e, _) in enumerate(r.checks) for x in e.globals]
    # gluon_wgmma's kernel reads constexpr globals (each guard is flipped below); for gluon_ws's
    # kernel Triton records none (its used_global_vals has been empty since its shared state
    # moved into hopper_ws._shared_state), nor for gluon_mma's since its reduce kernel (which
    # had some) became its fused epilogue, so only the other guards are flipped for those.
    assert globs or name in ("gluon_ws", "gluon_mma")

    def rebind(m, n, k):
        g, gname, val = r.checks[n][1].globals[k]
        m.setitem(g, gname, type(val)(val.value))  # equal, not the same object

    changes = [
        ("direct path off", lambda m: m.setattr(fastlaunch, "_ENABLED", [False])),
        ("epoch", lambda m: m.setattr(fastlaunch, "_EPOCH", [fastlaunch._EPOCH[0] + 1])),
        ("driver", lambda m: m.setattr(fastlaunch.driver, "_active", object())),
        ("enter hook", lambda m: m.setattr(rt, "launch_enter_hook", hook)),
        ("exit hook chain", lambda m: m.setattr(rt.launch_exit_hook, "calls", [hook])),
        ("instrumentation", lambda m: m.setattr(triton.knobs.compilation,
                                                "instrumentation_mode", "x")),
        ("device", lambda m: m.setattr(drv, "get_current_device", lambda: 1)),
        ("debug", lambda m: m.setattr(rt, "debug", True)),
    ]  # fmt: skip
    for n, (lau, _, _) in enumerate(r.checks):
        changes.append((f"pre-run hook {n}", lambda m, f=lau.fn: m.setattr(f, "pre_run_hooks",
                                                                         [hook])))  # fmt: skip
        changes.append((f"launcher {n}", lambda m, f=lau.fn: m.setitem(fastlaunch._LAUNCHERS,
                                                                     id(f), None)))  # fmt: skip
    for n in range(len(r.checks)):
        for k in range(len(r.checks[n][1].globals)):
            changes.append((f"global {n}.{k}", lambda m, n=n, k=k: rebind(m, n, k)))
    for what, change in changes:
        with pytest.MonkeyPatch.context() as m:
            change(m)
            assert (r.valid(), r._valid()) == (False, False), what
        assert r.valid() is True and r._valid() is True, what


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("name", ["gluon_mma", "gluon_wgmma", "gluon_ws"])
@pytest.mark.parametrize("H", [16, 64, 128])
def test_gpu_kept_partials_back_to_back_streams_and_graphs(name, H):
    """The KV splits' partials lent from replay to replay (fastlaunch.Scratch): five replays
    queued back to back with no sync (each on new inputs, into its own out), one on a side
    stream between them, and one captured in a CUDA graph then replayed: each equals the full
    path (plans off) bit for bit."""
    op._PLANS.clear()
    fastlaunch.clear_scratch()
    long = name == "gluon_ws"  # its rule splits lists of 6 pairs of tiles and more
    c = make_case(4, H, 512, N=4000, max_slots=3000 if long else 900, device="cuda",
                  seed=30 + H, empty_rows=False)  # fmt: skip
    cfg = dispatch.Choice(name)
    call = dispatch.Call(runtime.arch(), H, 512, c.q.dtype, c.kv, 4)
    if dispatch.kernel(name).unavailable(call):
        pytest.skip(f"{name} cannot run H={H}")

    def run(inp, out):
        q, kv, idx, ptr, sink = inp
        prefill.sparse_mla_prefill(q, kv, idx, ptr, c.softmax_scale, attn_sink=sink, out=out,
                                   config=cfg)  # fmt: skip

    first = (c.q, c.kv, c.kv_indices, c.kv_indptr, c.attn_sink)
    for _ in range(3):
        run(first, torch.empty_like(c.q))
    plans = _plans()
    assert len(plans) == 1 and plans[0].replay.launches == _split_launches(name, H)[0], (
        "no split plan"
    )
    inputs = [tuple(t.cuda() if t is not None else None for t in _fresh(c, s)) for s in range(7)]
    outs = [poisoned_like(c.q) for _ in inputs]
    side = torch.cuda.Stream()
    for k in range(5):  # queued back to back on the current stream, one on a side stream
        if k == 2:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                run(inputs[k], outs[k])
            torch.cuda.current_stream().wait_stream(side)
        else:
            run(inputs[k], outs[k])
    assert len(fastlaunch._SCRATCH) >= 1  # a set was kept
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run(inputs[5], outs[5])  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        run(inputs[6], outs[6])
    run(inputs[0], outs[0])  # an eager replay between capture and graph replay
    g.replay()
    torch.cuda.synchronize()
    prev = op.set_plans_enabled(False)
    try:
        for k in range(7):
            want = poisoned_like(c.q)
            run(inputs[k], want)
            torch.cuda.synchronize()
            assert torch.equal(outs[k], want), (name, H, k)
    finally:
        op.set_plans_enabled(prev)


@pytest.mark.parametrize("name", ["triton", "gluon_mma", "gluon_ws"])
def test_replays_call_the_c_launch_without_tritons_python_wrapper(standin, monkeypatch, name):
    """A replay calls the C launch of each kernel directly (CudaLauncher.__call__ with no
    scratch only forwards to it); the launches equal the full path's (the test above). A
    launcher that needs scratch, or is not Triton's CudaLauncher, keeps its own __call__."""
    from triton.backends.nvidia.driver import CudaLauncher

    c = make_case(4, 64, 512, N=2000, max_slots=700, dtype=torch.bfloat16, seed=23,
                  empty_rows=False)  # fmt: skip
    for _ in range(3):
        prefill.sparse_mla_prefill(*c.args(), attn_sink=c.attn_sink, out=torch.empty_like(c.q),
                                   config=dispatch.Choice(name), validate=False)  # fmt: skip
    (p,) = _plans()
    run = p.replay.checks[0][1].run
    wrapped = []
    real = type(run).__call__
    with pytest.MonkeyPatch.context() as m:
        m.setattr(type(run), "__call__", lambda self, *a: wrapped.append(1) or real(self, *a))
        standin.clear()
        prefill.sparse_mla_prefill(*c.args(), attn_sink=c.attn_sink, out=torch.empty_like(c.q),
                                   config=dispatch.Choice(name), validate=False)  # fmt: skip
    assert len(standin) == p.replay.launches and wrapped == []
    assert fastlaunch._raw_launch(run) is run.launch
    monkeypatch.setattr(run, "global_scratch_size", 64)
    assert fastlaunch._raw_launch(run) is None
    monkeypatch.setattr(run, "global_scratch_size", 0)
    monkeypatch.setattr(run, "profile_scratch_size", 64)
    assert fastlaunch._raw_launch(run) is None

    class Other(CudaLauncher):
        def __call__(self, *a):
            return super().__call__(*a)

    assert fastlaunch._raw_launch(Other.__new__(Other)) is None


def _launch_kwargs(monkeypatch) -> list:
    """(kernel, keyword dict) of every launch through fastlaunch from here on (then as ever)."""
    seen = []
    real = fastlaunch.Launcher.__call__

    def spy(self, grid, args, kwargs):
        seen.append((self.fn, dict(kwargs)))
        return real(self, grid, args, kwargs)

    monkeypatch.setattr(fastlaunch.Launcher, "__call__", spy)
    return seen


@pytest.mark.parametrize("scale", [0.05, 0.0, -0.05])
def test_gluon_ws_folds_only_a_positive_scale(standin, monkeypatch, scale):
    """gluon_ws's consumers take the row max before scaling only for a softmax scale > 0
    (max(s) x c = max(s x c) needs c > 0; -inf x 0 is NaN): the launch passes POS_SCALE then,
    and never to the kernels that lack it (gluon_ws_small). Plans off: every call launches."""
    from sparse_mla.gluon import hopper_ws

    seen = _launch_kwargs(monkeypatch)
    c = make_case(4, 64, 512, N=300, max_slots=100, dtype=torch.bfloat16, seed=3)
    prev = op.set_plans_enabled(False)
    try:
        for name in ("gluon_ws", "gluon_ws_small"):
            prefill.sparse_mla_prefill(c.q, c.kv, c.kv_indices, c.kv_indptr, scale,
                                       attn_sink=c.attn_sink, out=torch.empty_like(c.q),
                                       config=dispatch.Choice(name), validate=False)  # fmt: skip
    finally:
        op.set_plans_enabled(prev)
    ws = [kw for fn, kw in seen if fn is hopper_ws._prefill_ws_kernel]
    assert ws and all(kw.get("POS_SCALE", False) is (scale > 0) for kw in ws)
    assert len(ws) < len(seen)  # gluon_ws_small launched too
    assert all("POS_SCALE" not in kw for fn, kw in seen if fn is not hopper_ws._prefill_ws_kernel)
