"""The CPU path's two fixes, each by itself, and the interpreter shim's isolation."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from sparse_mla import runtime
from sparse_mla.prefill import PrefillConfig, _mma, _round_to, launch_constexprs


@triton.jit
def _dot_kernel(A, B, C, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, FIX: tl.constexpr):
    offs_m = tl.arange(0, M)
    offs_n = tl.arange(0, N)
    offs_k = tl.arange(0, K)
    a = tl.load(A + offs_m[:, None] * K + offs_k[None, :])  # [M, K]
    b = tl.load(B + offs_k[:, None] * N + offs_n[None, :])  # [K, N]
    c = _mma(a, b, tl.zeros([M, N], dtype=tl.float32), FIX)
    tl.store(C + offs_m[:, None] * N + offs_n[None, :], c)


@triton.jit
def _cast_kernel(X, Y, N: tl.constexpr, FIX: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Y + offs, _round_to(tl.load(X + offs), tl.bfloat16, FIX))


def _dot(a, b, fix):
    c = torch.full((a.shape[0], b.shape[1]), float("nan"))
    runtime.launch(_dot_kernel, (1,), a, b, c, M=a.shape[0], N=b.shape[1], K=a.shape[1],
                   FIX=fix, interpret=True)  # fmt: skip
    return c


def test_interpreted_bf16_dot_matches_torch():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(16, 64, generator=g).bfloat16()
    b = torch.randn(64, 32, generator=g).bfloat16()
    expected = a.float() @ b.float()  # bf16 products are exact in fp32; fp32 accumulation
    torch.testing.assert_close(_dot(a, b, True), expected, rtol=1e-6, atol=1e-5)


def test_interpreted_bf16_dot_is_wrong_without_the_fix():
    # Documents why the fix exists: Triton 3.6's interpreter multiplies bf16 bit patterns.
    g = torch.Generator().manual_seed(1)
    a = torch.randn(16, 16, generator=g).bfloat16()
    b = torch.randn(16, 16, generator=g).bfloat16()
    err = (_dot(a, b, False) - a.float() @ b.float()).abs().max().item()
    assert err > 1e3, f"interpreter bf16 dot now looks right (err {err}); drop INTERP_BF16?"


def test_interpreted_fp16_dot_needs_no_fix():
    g = torch.Generator().manual_seed(2)
    a = torch.randn(16, 32, generator=g).half()
    b = torch.randn(32, 16, generator=g).half()
    torch.testing.assert_close(_dot(a, b, False), a.float() @ b.float(), rtol=1e-3, atol=1e-3)


def test_interpreted_bf16_cast_rounds_to_nearest_even():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4096, generator=g) * 10
    # Exact ties (the low 16 bits 0x8000) exercise the even rule.
    ties = (torch.randint(-(2**15), 2**15, (256,), generator=g).to(torch.int32) << 16) | 0x8000
    x = torch.cat([x, ties.view(torch.float32)])
    # Normal numbers only: the interpreter flushes fp32 subnormals, a GPU does not need them here.
    x = x[torch.isfinite(x) & (x.abs() >= torch.finfo(torch.float32).tiny)]
    for fix, expect_equal in ((True, True), (False, False)):
        y = torch.empty(x.numel(), dtype=torch.bfloat16)
        n = triton.next_power_of_2(x.numel())
        xp = torch.cat([x, torch.zeros(n - x.numel())])
        yp = torch.empty(n, dtype=torch.bfloat16)
        runtime.launch(_cast_kernel, (1,), xp, yp, N=n, FIX=fix, interpret=True)
        y = yp[: x.numel()]
        same = torch.equal(y.view(torch.int16), x.bfloat16().view(torch.int16))
        assert same == expect_equal, f"FIX={fix}"


def _compile_prefill_ttir(interp_bf16: bool) -> str:
    from sparse_mla.prefill import _sparse_mla_prefill_kernel

    cx = launch_constexprs(16, 512, torch.bfloat16, PrefillConfig(), has_sink=True)
    cx["INTERP_BF16"] = interp_bf16
    sig = {
        "q_ptr": "*bf16", "kv_ptr": "*bf16", "idx_ptr": "*i32", "indptr_ptr": "*i32",
        "sink_ptr": "*fp32", "out_ptr": "*bf16", "stride_qt": "i64", "stride_qh": "i64",
        "stride_kvn": "i64", "stride_ot": "i64", "stride_oh": "i64", "num_heads": "i32",
        "head_dim": "i32", "num_kv": "i32", "nnz": "i32", "qk_scale": "fp32",
    }  # fmt: skip
    sig.update({k: "constexpr" for k in cx})
    src = ASTSource(fn=_sparse_mla_prefill_kernel, signature=sig, constexprs=cx)
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    return ck.asm["ttir"]


def test_gpu_path_compiles_without_the_cpu_fix():
    # An interpreted launch first: the shim must leave the language unpatched afterwards.
    a = torch.randn(16, 16).bfloat16()
    _dot(a, a, True)
    assert (
        launch_constexprs(16, 512, torch.bfloat16, PrefillConfig(), has_sink=True)["INTERP_BF16"]
        is False
    )
    ttir = _compile_prefill_ttir(False)
    dots = [line for line in ttir.splitlines() if "tt.dot" in line]
    assert dots and all("bf16" in line for line in dots), dots
    assert "-65536" not in ttir and "4294901760" not in ttir  # the rounding mask is absent
    fixed = _compile_prefill_ttir(True)
    assert any("tt.dot" in ln and "f32" in ln and "bf16" not in ln for ln in fixed.splitlines())


def test_gluon_compiles_after_an_interpreted_launch():
    # Run in a fresh process: Gluon must not be imported before the interpreted launch there.
    import subprocess
    import sys

    code = (
        "import torch, sys\n"
        "sys.path.insert(0, 'tests')\n"
        "assert 'triton.experimental.gluon' not in sys.modules\n"
        "import test_inspect, test_runtime\n"
        "test_runtime.test_interpreted_fp16_dot_needs_no_fix()\n"
        "k = test_inspect._gluon_kernel()\n"
        "test_inspect.test_gluon_kernel_compiles_with_the_targets_warp_size(k, 'sm90')\n"
        "print('ok', True)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "ok True" in res.stdout, res.stderr[-2000:]


@triton.jit
def _loop_kernel(N_PTR, X, Y, BLOCK: tl.constexpr):
    # A loop bound loaded through a pointer: the interpreter turns it into an int with
    # __index__ on a 1-element array of rank 1 (numpy >= 2.3 refuses int() on that).
    n = tl.load(N_PTR)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(0, n, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        acc += tl.load(X + offs, mask=offs < n, other=0.0)
    tl.store(Y + tl.arange(0, BLOCK), acc)


def test_interpreted_range_over_a_loaded_bound_with_any_numpy():
    import warnings

    x = torch.randn(37)
    y = torch.full((8,), float("nan"))
    n = torch.tensor([37], dtype=torch.int32)
    with warnings.catch_warnings():
        # numpy 2.2 only warns where 2.3+ raises: make the warning an error so the test fails
        # on every numpy version if the shim stops taking the element.
        warnings.simplefilter("error", DeprecationWarning)
        runtime.launch(_loop_kernel, (1,), n, x, y, BLOCK=8, interpret=True)
    expect = torch.nn.functional.pad(x, (0, 3)).view(-1, 8).sum(0)
    torch.testing.assert_close(y, expect)
    # The patch is undone after the launch: Triton's own __index__ is back outside it.
    assert not hasattr(tl.core.tensor, "__index__") or (
        tl.core.tensor.__index__ is not runtime._tensor_index
    )


# ----------------------------------------------------------------------------------------------
# Threads: interpreting on one thread while compiling on another
# ----------------------------------------------------------------------------------------------


@triton.jit
def _scaled_copy(X, Y, SCALE: tl.constexpr):
    offs = tl.arange(0, 16)
    tl.store(Y + offs, tl.load(X + offs) * SCALE)


def test_interpret_and_compile_on_two_threads(tmp_path, monkeypatch):
    # The interpreter patches triton.language process-wide while a kernel runs; a compile on
    # another thread at that moment builds the interpreter's objects into IR and fails. Both
    # hold runtime's lock, so the compiles below (Triton for sm90 and gfx950, Gluon for sm90)
    # wait for the interpreted launch in progress, and the interpreted results stay right.
    import threading

    from sparse_mla import inspect as si
    from sparse_mla.gluon import compile_for

    si.clear_cache()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compile for real, not from disk
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4096, generator=g)
    expect = x.view(-1, 16).sum(0)
    started, done = threading.Event(), threading.Event()
    failures: list[str] = []
    runs = [0]

    def interpret():
        while not done.is_set():
            y = torch.full((16,), float("nan"))
            try:
                runtime.launch(_loop_kernel, (1,), torch.tensor([4096]), x, y, BLOCK=16,
                               interpret=True)  # fmt: skip
            except Exception as e:  # reported by the main thread
                failures.append(f"interpreted launch: {e!r}"[:400])
                return
            if not torch.allclose(y, expect, rtol=1e-5, atol=1e-4):
                failures.append(f"interpreted launch gave {y} instead of {expect}")
                return
            runs[0] += 1
            started.set()

    worker = threading.Thread(target=interpret, daemon=True)
    worker.start()
    try:
        assert started.wait(120), failures
        sig = {"X": "*fp32", "Y": "*fp32"}
        for i, target in enumerate(["sm90", "gfx950", "sm90"]):
            res = si.compile(_scaled_copy, target, {"SCALE": 2.0 + i}, None, sig)
            assert res.isa, target
        assert compile_for("prefill", "sm90", num_heads=16).asm["ptx"]
        interpreted_during = runs[0]
    finally:
        done.set()
        worker.join(120)
    assert not failures, failures
    assert interpreted_during >= 1


class _Item:
    def __init__(self, *markers):
        self.markers = set(markers)
        self.keywords = {"sm90"}  # as a test parametrized over targets has: not a marker
        self.skips = []

    def get_closest_marker(self, name):
        return name if name in self.markers else None

    def add_marker(self, mark):
        self.skips.append(mark.kwargs["reason"])


@pytest.mark.parametrize(
    ("gpu", "capability", "skipped"),
    [
        (False, None, {"cpu": False, "gpu": True, "sm90": True}),
        (True, (8, 0), {"cpu": False, "gpu": False, "sm90": True}),  # an A100
        (True, (9, 0), {"cpu": False, "gpu": False, "sm90": False}),  # an H100/H200
    ],
)
def test_gpu_tests_are_gated_by_arch_once_in_conftest(monkeypatch, gpu, capability, skipped):
    import conftest

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch.version, "hip", None)
    items = {"cpu": _Item(), "gpu": _Item("gpu"), "sm90": _Item("gpu", "sm90")}
    conftest.pytest_collection_modifyitems(None, list(items.values()))
    assert {k: bool(v.skips) for k, v in items.items()} == skipped
    # ROCm reports its GPUs through torch.cuda too: an MI300 is not sm90.
    monkeypatch.setattr(torch.version, "hip", "6.2")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    mi300 = _Item("gpu", "sm90")
    if gpu:
        conftest.pytest_collection_modifyitems(None, [mi300])
        assert mi300.skips == ["needs an sm90 (Hopper) GPU"]
