"""The direct launch path (sparse_mla.fastlaunch): its key against Triton's own binder and
specialisation, its fallbacks, that it keeps no tensor alive; CPU only, with stand-ins for the
driver and the compiled kernel. The GPU test (every registered kernel through the path, bitwise
equal to kernel[grid]) is tests/test_kernels_gpu.py::test_fast_launch_matches_triton."""

from __future__ import annotations

import gc
import weakref
from collections import defaultdict

import pytest
import torch
import triton
import triton.language as tl
from conftest import make_case, poisoned_like, runnable_everywhere
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import create_function_from_signature

from sparse_mla import fastlaunch, standin
from sparse_mla.reference import check_against_reference

G_SCALE = tl.constexpr(2)


@triton.jit(do_not_specialize=["n_ds"])
def _toy(x_ptr, y_ptr, n, n_ds, scale, flag, BLOCK: tl.constexpr, MODE: tl.constexpr = 3):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, v * scale * G_SCALE + n_ds + flag + MODE, mask=offs < n)


class _Driver:
    """Stand-in for triton.runtime.driver.active: device 0, stream 1234."""

    def __init__(self):
        self.device = 0

    def get_current_device(self):
        return self.device

    def get_current_stream(self, device):
        return 1234 + device


class _Compiled:
    """Stand-in for a CompiledKernel: its launcher records every call."""

    def __init__(self, specialization, options):
        self.specialization = specialization
        self.options = options
        self.function = object()
        self.packed_metadata = ("packed", id(self))
        self.calls = []
        self.metadata = type("M", (), {"tensordesc_meta": None})()

    def run(self, *a):
        self.calls.append(a)


class _Fn:
    """A real @triton.jit function's parameters and Triton's own binder, with kernel[grid]
    replaced by: bind (the generated dynamic_func), key as run() keys, 'compile' once per key,
    launch the stand-in launcher with the bound arguments, as JITFunction.run does."""

    def __init__(self, jit_fn):
        self.real = jit_fn
        self.params = jit_fn.params
        self.pre_run_hooks = []
        self.debug = False
        self.binder = create_function_from_signature(jit_fn.signature, jit_fn.params, BaseBackend)
        self.device_caches = {0: ({}, {}, None, BaseBackend, self.binder)}
        # As Triton keeps it: a copy of the constexpr, equal to the global, not the same object.
        self.used_global_vals = {("G_SCALE", id(globals())): (tl.constexpr(2), globals())}
        self.cache = {}
        self.slow_calls = 0

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.slow_calls += 1
            bound, spec, options = self.binder(*args, **kwargs)
            key = (tuple(spec), str(options))
            k = self.cache.get(key)
            if k is None:
                k = self.cache[key] = _Compiled(spec, options)
            g = tuple(grid) + (1,) * (3 - len(grid))
            k.run(*g, 1234, k.function, k.packed_metadata, None, None, None, *bound.values())
            return k

        return run


@pytest.fixture
def env(monkeypatch):
    drv = _Driver()
    monkeypatch.setattr(fastlaunch.driver, "_active", drv)  # driver.active is then drv
    fn = _Fn(_toy)
    fastlaunch.set_enabled(True)
    yield fn, fastlaunch.Launcher(fn), drv
    fastlaunch.set_enabled(True)


def _args(dtype=torch.float32, offset=0, n=64, n_ds=7, scale=0.5, flag=True):
    x = torch.zeros(256, dtype=dtype)[offset:]
    y = torch.zeros(256, dtype=dtype)[offset:]
    return (x, y, n, n_ds, scale, flag)


KW = fastlaunch.frozen(BLOCK=32, num_warps=4)


def _last(fn):
    (k,) = {id(k): k for k in fn.cache.values()}.values() if len(fn.cache) == 1 else (None,)
    return k


def test_second_call_is_direct_and_identical(env):
    fn, launch, _ = env
    launch((2,), _args(), KW)
    assert fn.slow_calls == 1
    k = _last(fn)
    for _ in range(2):  # fresh tensors: other data_ptrs, same dtype and alignment
        a = _args(n=128, n_ds=9, scale=0.25, flag=False)
        launch((4, 2), a, KW)
        assert fn.slow_calls == 1
        # What kernel[grid] would pass for the same call, through Triton's own binder.
        bound, spec, _ = fn.binder(*a, **KW)
        assert tuple(spec) == tuple(k.specialization)
        assert k.calls[-1] == (4, 2, 1, 1234, k.function, k.packed_metadata, None, None, None,
                               *bound.values())  # fmt: skip


@pytest.mark.parametrize(
    "change",
    [
        dict(dtype=torch.float16),  # dtype
        dict(offset=1),  # data_ptr % 16 != 0
        dict(n=65),  # n % 16 != 0
        dict(n=1),  # n == 1 (a constexpr for Triton)
        dict(n=2**31),  # i64
        dict(flag=3),  # bool -> int
    ],
)
def test_a_changed_specialisation_takes_kernel_grid(env, change):
    fn, launch, _ = env
    launch((1,), _args(), KW)
    launch((1,), _args(), KW)
    assert fn.slow_calls == 1
    a = _args(**change)
    launch((1,), a, KW)
    assert fn.slow_calls == 2, "a new specialisation must go through kernel[grid]"
    assert len(fn.cache) == 2
    launch((1,), _args(**change), KW)  # now it has its own entry
    assert fn.slow_calls == 2
    assert len(fn.cache) == 2


def test_values_triton_does_not_specialise_on_stay_direct(env):
    fn, launch, _ = env
    launch((1,), _args(), KW)
    # n_ds is do_not_specialize, scale a float: any value; n 64 -> 4096 stays %16 and i32.
    launch((1,), _args(n=4096, n_ds=17, scale=3.0), KW)
    launch((1,), _args(n_ds=1), KW)
    assert fn.slow_calls == 1


def test_key_is_at_least_as_fine_as_triton(env):
    """Whenever two calls share the launcher's key, Triton's binder specialises them alike."""
    fn, launch, _ = env
    cases = [
        _args(dtype=dt, offset=off, n=n, n_ds=nd, scale=s, flag=f)
        for dt in (torch.float32, torch.float16, torch.bfloat16, torch.int32)
        for off in (0, 1, 8)
        for n in (0, 1, 16, 17, 2**31 - 16, 2**31, -16)
        for nd in (1, 16)
        for s in (0.5, 2)
        for f in (True, False)
    ]
    seen = {}
    gen = launch._generate_key(cases[0], BaseBackend)
    for a in cases:
        key = launch._key(a, fastlaunch.native_specialize_impl, BaseBackend)
        assert gen(a) == key  # the generated key is the same tuple
        _, spec, _ = fn.binder(*a, **KW)
        assert seen.setdefault(key, tuple(spec)) == tuple(spec), a
    assert len(seen) > 50
    # An argument of another type than the generated key was made for: the generic key.
    assert gen((1.0, *cases[0][1:])) is None
    assert launch._key((1.0, *cases[0][1:]), fastlaunch.native_specialize_impl, BaseBackend)


def test_other_kwargs_device_or_debug_take_kernel_grid(env):
    fn, launch, drv = env
    launch((1,), _args(), KW)
    launch((1,), _args(), fastlaunch.frozen(BLOCK=64, num_warps=4))
    assert fn.slow_calls == 2
    launch((1,), _args(), dict(KW))  # equal but not the cached dict: keyed by identity
    assert fn.slow_calls == 3
    drv.device = 1
    fn.device_caches[1] = fn.device_caches[0]
    launch((1,), _args(), KW)
    assert fn.slow_calls == 4
    drv.device = 0
    fn.debug = True
    launch((1,), _args(), KW)
    assert fn.slow_calls == 5


def test_keyword_runtime_argument_never_direct(env):
    fn, launch, _ = env
    a = _args()
    kw = fastlaunch.frozen(flag=True, BLOCK=32)
    launch((1,), a[:5], kw)
    launch((1,), a[:5], kw)
    assert fn.slow_calls == 2


def test_hooks_switch_and_globals_take_kernel_grid(env, monkeypatch):
    fn, launch, _ = env
    launch((1,), _args(), KW)
    launch((1,), _args(), KW)
    assert fn.slow_calls == 1
    fastlaunch.set_enabled(False)
    launch((1,), _args(), KW)
    assert fn.slow_calls == 2
    fastlaunch.set_enabled(True)
    fn.pre_run_hooks.append(lambda *a, **k: None)
    launch((1,), _args(), KW)
    assert fn.slow_calls == 3
    fn.pre_run_hooks.clear()
    hook = lambda metadata: None  # noqa: E731
    for name in ("launch_enter_hook", "launch_exit_hook"):
        chain = getattr(triton.knobs.runtime, name)
        chain.add(hook)
        try:
            launch((1,), _args(), KW)
        finally:
            chain.remove(hook)
        launch((1,), _args(), KW)  # an empty chain again: direct
    assert fn.slow_calls == 5
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda *a: None)
    launch((1,), _args(), KW)
    assert fn.slow_calls == 6
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", None)
    launch((1,), _args(), KW)
    assert fn.slow_calls == 6
    monkeypatch.setitem(globals(), "G_SCALE", tl.constexpr(3))  # Triton's check must run
    launch((1,), _args(), KW)
    launch((1,), _args(), KW)  # (Triton would raise; the stand-in does not) never direct
    assert fn.slow_calls == 8
    monkeypatch.setitem(globals(), "G_SCALE", tl.constexpr(2))  # equal again, another object
    launch((1,), _args(), KW)
    assert fn.slow_calls == 9
    launch((1,), _args(), KW)  # a new entry with the new object
    assert fn.slow_calls == 9


def test_no_tensor_kept_alive(env):
    fn, launch, _ = env
    a = _args()
    refs = [weakref.ref(a[0]), weakref.ref(a[1])]
    launch((1,), a, KW)
    b = _args()
    refs += [weakref.ref(b[0]), weakref.ref(b[1])]
    launch((1,), b, KW)
    for k in fn.cache.values():
        k.calls.clear()  # the stand-in's own record of arguments
    del a, b
    gc.collect()
    assert all(r() is None for r in refs)


# ----------------------------------------------------------------------------------------------
# TMA descriptors
# ----------------------------------------------------------------------------------------------


def _layout():
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for([1, 16, 64], gl.bfloat16)


class _Map:
    """Stand-in for PyCUtensorMap."""


def test_tma_map_cache_encodes_once_per_address_and_keeps_no_tensor():
    fastlaunch._TMA_MAPS.clear()
    lay = _layout()
    encoded = []

    def encode(desc, meta):
        encoded.append((desc.base.data_ptr(), tuple(desc.shape), tuple(desc.strides)))
        return [_Map(), *desc.shape, *desc.strides]

    meta = {"swizzle": 3, "block_size": [1, 16, 64]}
    mk = ("m",)
    q = torch.zeros(4, 16, 512, dtype=torch.bfloat16)
    r1 = fastlaunch._tma_map(fastlaunch.TmaArg(q, (1, 16, 64), lay), meta, mk, encode)
    r2 = fastlaunch._tma_map(fastlaunch.TmaArg(q, (1, 16, 64), lay), meta, mk, encode)
    assert r1 is r2 and len(encoded) == 1
    assert r1[1:] == (4, 16, 512, 16 * 512, 512, 1)
    q2 = torch.zeros(4, 16, 512, dtype=torch.bfloat16)
    fastlaunch._tma_map(fastlaunch.TmaArg(q2, (1, 16, 64), lay), meta, mk, encode)
    assert len(encoded) == 2
    fastlaunch._tma_map(fastlaunch.TmaArg(q[:2], (1, 16, 64), lay), meta, mk, encode)
    assert len(encoded) == 3  # other shape, same address
    refs = [weakref.ref(q), weakref.ref(q2)]
    del q, q2
    gc.collect()
    assert all(r() is None for r in refs)


def test_tma_descriptor_checks_still_run_on_a_miss():
    fastlaunch._TMA_MAPS.clear()
    bad = torch.zeros(4 * 16 * 512 + 1, dtype=torch.bfloat16)[1:].view(4, 16, 512)  # 2-byte off
    with pytest.raises(AssertionError, match="16-byte aligned"):
        fastlaunch._tma_map(fastlaunch.TmaArg(bad, (1, 16, 64), _layout()), {}, (),
                            lambda d, m: [d])  # fmt: skip


class _TmaRun:
    """Stand-in for CudaLauncher with a descriptor argument: its ``launch`` is the wrapper
    that Triton's wrap_handle_tensordesc returns, closing over the raw launcher."""

    global_scratch_size = 0
    profile_scratch_size = 0
    launch_cooperative_grid = False
    launch_pdl = False

    def __init__(self):
        self.raw_calls = []

        def launcher(*args):
            self.raw_calls.append(args)

        def inner(*args):
            return launcher(*args)

        self.launch = inner

    def __call__(self, *a):
        raise AssertionError("the direct TMA path calls the raw launcher")


def test_tma_launch_passes_encoded_maps(env):
    fn, _, _ = env
    fastlaunch._TMA_MAPS.clear()
    encoded = []

    def encode(desc, meta):
        encoded.append(desc)
        return [("map", desc.base.data_ptr()), *desc.shape, *desc.strides]

    launch = fastlaunch.Launcher(fn, encode_tma=encode)
    run = _TmaRun()
    meta = [{"swizzle": 3, "block_size": [1, 16, 64]}]

    def slow(grid):
        def go(*args, **kwargs):
            from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

            assert isinstance(args[0], TensorDescriptor)  # kernel[grid] gets the real one
            k = _Compiled((), "")
            k.run = run
            k.metadata.tensordesc_meta = meta
            return k

        return go

    fn.__class__ = type("_FnTma", (_Fn,), {"__getitem__": lambda self, g: slow(g)})
    lay = _layout()
    q = torch.zeros(4, 16, 512, dtype=torch.bfloat16)
    y = torch.zeros(64)
    args = (fastlaunch.TmaArg(q, (1, 16, 64), lay), y, 64, 7, 0.5, True)
    launch((3,), args, KW)
    assert not run.raw_calls and not encoded
    launch((3,), args, KW)
    launch((3,), (fastlaunch.TmaArg(q, (1, 16, 64), lay), y, 64, 7, 0.5, True), KW)
    assert len(run.raw_calls) == 2 and len(encoded) == 1  # one encoding for the same buffer
    c = run.raw_calls[-1]
    assert c[:4] == (3, 1, 1, 1234)
    assert c[5:13] == (False, False, None, None, c[9], None, None, None)
    assert c[13:] == (("map", q.data_ptr()), 4, 16, 512, 8192, 512, 1, y, 64, 7, 0.5, True, 32, 3)


# ----------------------------------------------------------------------------------------------
# The interpreter path does not go through it
# ----------------------------------------------------------------------------------------------


def test_interpreter_path_unchanged():
    from sparse_mla import sparse_mla_prefill

    before = fastlaunch.stats()
    c = make_case(3, 16, 64, N=60, max_slots=20, dtype=torch.float16)
    out = poisoned_like(c.q)
    sparse_mla_prefill(*c.args(), attn_sink=c.attn_sink, out=out)
    assert fastlaunch.stats() == before
    rep = check_against_reference(out, *c.args(), attn_sink=c.attn_sink)
    assert rep.ok, rep


# ----------------------------------------------------------------------------------------------
# The package's real kernels, compiled for sm90 on this CPU, against a no-op driver
# ----------------------------------------------------------------------------------------------


def _comparable(call):
    """A recorded launch without its metadata and hooks (indices 10-12); tensors by layout."""
    keep = call[:10] + call[13:]
    return tuple(
        (tuple(a.shape), a.stride(), a.dtype) if isinstance(a, torch.Tensor) else a for a in keep
    )


@pytest.mark.parametrize(
    "name", ["triton", "gluon_ws", "gluon_ws_small", "gluon_mma", "gluon_wgmma"]
)
def test_direct_launch_makes_the_driver_call_triton_makes(name, monkeypatch):
    """Each dense kernel of the package, compiled for sm90 here, launched through Triton's
    kernel[grid] and through the direct path: the C launcher gets the same arguments (grid,
    stream, function, packed metadata, every kernel argument, TMA encodings), bar Triton's
    launch metadata and its two empty hook chains, which the direct path passes as None."""

    from sparse_mla import dispatch, prefill
    from sparse_mla.gluon import algorithm, hopper_prefill, hopper_ws, hopper_ws_small

    calls = []
    monkeypatch.setattr(fastlaunch.driver, "_active", standin.sm90_driver(calls))
    # Nothing made with the stand-in driver may outlive the test (a GPU test later in the same
    # process would get its recording launcher): Triton's per-device caches of each kernel, the
    # launchers and the TMA maps are the test's own.
    kernels = (prefill._sparse_mla_prefill_kernel, algorithm._mla_fwd_kernel,
               algorithm._mla_reduce_kernel, hopper_prefill._prefill_wgmma_kernel,
               hopper_ws._prefill_ws_kernel, hopper_ws_small._prefill_ws_small_kernel)  # fmt: skip
    for jit_fn in kernels:
        monkeypatch.setattr(jit_fn, "device_caches", defaultdict(jit_fn.create_binder))
    monkeypatch.setattr(fastlaunch, "_LAUNCHERS", {})
    monkeypatch.setattr(fastlaunch, "_TMA_MAPS", {})
    for owner, attr, value in standin.sm90_patches():
        monkeypatch.setattr(owner, attr, value)
    runnable_everywhere(monkeypatch, [name])
    # T=4 at H=64: gluon_mma / gluon_wgmma run KV splits (the reduce fused on sm90).
    c = make_case(4, 64, 512, N=300, max_slots=100, dtype=torch.bfloat16)
    out = torch.empty_like(c.q)

    def run():
        prefill.sparse_mla_prefill(*c.args(), attn_sink=c.attn_sink, out=out, validate=False,
                                   config=dispatch.Choice(name))  # fmt: skip

    with fastlaunch.disabled():
        run()
        slow = list(calls)
    assert slow, "no launch recorded"
    run()  # the first launch of each key: kernel[grid], kept
    calls.clear()
    before = fastlaunch.stats()
    run()
    fast = list(calls)
    after = fastlaunch.stats()
    assert after["slow"] == before["slow"] and after["fast"] - before["fast"] == len(slow)
    assert [_comparable(x) for x in fast] == [_comparable(x) for x in slow]
    for x in slow:
        assert all(type(h) is triton.knobs.HookChain and not h.calls for h in x[11:13])
    assert all(x[10:13] == (None, None, None) for x in fast)
    if name == "gluon_ws":  # q by TMA: an encoded map, not a descriptor, reaches the launch
        assert sum(isinstance(a, tuple) and a[:1] == ("tma",) for a in fast[0]) == 1
