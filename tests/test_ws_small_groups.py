"""The sm90 few-heads kernel with one or two head groups (``hopper_ws_small.py``, issue 22).

CPU: ``_prefill_ws_small_kernel`` cross-compiles for sm90 at HEAD_GROUPS = 1 and 2 (16 or 32
heads on wgmma's N, one consumer warpgroup and one producer) within the register file, without
spills and within 227 KiB of shared memory; HEAD_GROUPS = 3 is refused.

GPU (``-m gpu``): launched as the launcher does (``kernel[grid](..., HEAD_GROUPS=g, num_warps=4,
num_stages=1)``, items = T * cdiv(H, 16 g), grid = min(items, SMs)) with g = cdiv(H, 16) at
H in {1, 8, 16} and {17, 20, 24, 31, 32}: ragged lists with absent slots of every kind (-1,
N, 2^31 - 1 or 2^40), duplicates, empty tokens and a token of only absent slots, NaN in every
unreferenced pool row, int32 and int64 ids, sink on and off, a NaN-poisoned output; checked
against the fp32 reference with the package's 2x error rule; repeat launches bitwise equal.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
import triton

from sparse_mla.reference import error_report, sparse_mla_prefill_ref

LOG2E = 1.4426950408889634
SMEM_LIMIT = 227 * 1024


def _compile_script():
    path = Path(__file__).resolve().parents[1] / "scripts" / "ws_small_groups_compile.py"
    spec = importlib.util.spec_from_file_location("ws_small_groups_compile", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_COMPILED: dict = {}


def _compiled(groups: int, index: str = "int64"):
    key = (groups, index)
    if key not in _COMPILED:
        script = _compile_script()
        ck = script.compile_groups(groups, index)
        _COMPILED[key] = (ck, script.report(ck))
    return _COMPILED[key]


# ----------------------------------------------------------------------------------------------
# CPU: cross-compilation
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("groups", [1, 2])
def test_sm90_compile_budget(groups):
    """Partitions: the consumer and the producer within 64 K registers, no spills; wgmma
    m64n{16 G}k16 (S^T: 512 / 16 k-steps; O^T: 8 row blocks x 4 k-steps); 16-byte cp.async
    gathers; Q + the ring + P^T within 227 KiB."""
    ck, rep = _compiled(groups)
    heads = 16 * groups
    assert ck.metadata.name == "_prefill_ws_small_kernel"
    assert ck.metadata.num_warps == 8
    parts = rep["partitions"]
    assert parts == [("default", 4, 256), ("worker 0", 4, 64)], parts
    assert rep["local (spill) bytes"] == 0 and rep["stack bytes"] == 0, rep
    assert rep["wgmma in PTX"] == {f"m64n{heads}k16": 512 // 16 + (512 // 64) * (64 // 16)}
    assert rep["HGMMA in SASS"] == 64
    assert set(rep["cp.async in PTX (by size)"]) == {"0x10"}, rep
    stages = 3 if groups == 1 else 2
    tile = 64 * 512 * 2
    explicit = heads * 512 * 2 + stages * tile + 64 * heads * 2 + 8 * 8
    assert explicit <= rep["shared bytes"] <= SMEM_LIMIT, rep
    # A third tile does not fit at two head groups (why the ring has two).
    if groups == 2:
        assert explicit + tile > SMEM_LIMIT


def test_sm90_head_groups_refused():
    script = _compile_script()
    with pytest.raises(Exception, match="HEAD_GROUPS must be 1 or 2"):
        script.compile_groups(3)


def test_kernel_signature_contract():
    """HEAD_GROUPS, STAGES, PRODUCER_REGS, DENSE_IDS and SMALL are the kernel's last
    parameters, constexprs defaulting to 1, None, None, False and False (a launch without them is
    the kernel as it was: CSR lists, 3 KV tiles at one head group, 2 at two, the module's
    PRODUCER_REGS, the large-call order); the dense-ids row length ``ids_per_row`` comes before
    them."""
    import inspect as pyinspect

    from sparse_mla.gluon.hopper_ws_small import _prefill_ws_small_kernel, ring_stages

    names = _prefill_ws_small_kernel.arg_names
    assert names[-7:] == [
        "num_items", "ids_per_row", "HEAD_GROUPS", "STAGES", "PRODUCER_REGS", "DENSE_IDS",
        "SMALL",
    ]  # fmt: skip
    params = pyinspect.signature(_prefill_ws_small_kernel.fn).parameters
    assert [params[n].default for n in names[-5:]] == [1, None, None, False, False]
    assert (ring_stages(1), ring_stages(2)) == (3, 2)
    assert (ring_stages(1, 2), ring_stages(2, 2)) == (2, 2)


# ----------------------------------------------------------------------------------------------
# GPU: numerics against the fp32 reference
# ----------------------------------------------------------------------------------------------


def _case(R, H, N, *, index_dtype, seed, max_len, dtype=torch.bfloat16):
    """Engine-style inputs: the pool a row-strided view inside a NaN-filled buffer, every pool
    row that no valid slot references NaN, ragged lists; token 0 empty, token 2 only absent
    slots, duplicates within token 7, ~10% absent slots of every kind elsewhere."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    lengths = torch.randint(0, max_len, (R,), generator=g)
    lengths[0] = 0
    lengths[2] = 5
    lengths[7] = max(lengths[7].item(), 8)
    indptr = torch.zeros(R + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(lengths, 0)
    nnz = int(indptr[-1])
    idx = torch.randint(0, N, (nnz,), generator=g, dtype=torch.int64)
    big = 2**40 if index_dtype == torch.int64 else 2**31 - 1
    bad = torch.rand(nnz, generator=g) < 0.1
    choices = torch.tensor([-1, N, big], dtype=torch.int64)
    idx[bad] = choices[torch.randint(0, 3, (int(bad.sum()),), generator=g)]
    idx[indptr[2] : indptr[3]] = torch.tensor([-1, N, big, -1, N])
    s, e = int(indptr[7]), int(indptr[8])
    idx[s + 1 : e : 2] = idx[s]
    pad = 64
    buf = torch.full((N + 2 * pad, 576), float("nan"), dtype=dtype)
    pool = torch.randn(N, 576, generator=g).to(dtype)
    used = torch.zeros(N, dtype=torch.bool)
    valid = (idx >= 0) & (idx < N)
    used[idx[valid]] = True
    pool[~used] = float("nan")
    buf[pad : pad + N] = pool
    kv = buf.to("cuda")[pad : pad + N, :512]  # row stride 576
    q = torch.randn(R, H, 512, generator=g).to(dtype).to("cuda")
    return q, kv, idx.to(index_dtype).to("cuda"), indptr.to(torch.int32).to("cuda")


def _launch_args(q, kv, idx, ptr, sink, out, scale, groups):
    """The launch contract's arguments, (args, constexprs, items): -inf sink logits when there
    is no sink, items = T * cdiv(H, 16 g), ids_per_row 0 (CSR lists)."""
    R, H, _ = q.shape
    sink_t = torch.full((H,), -math.inf, device=q.device) if sink is None else sink.contiguous()
    items = R * triton.cdiv(H, 16 * groups)
    args = (
        q, kv, idx, ptr, sink_t, out, q.stride(0), q.stride(1), kv.stride(0), out.stride(0),
        out.stride(1), H, kv.shape[0], idx.numel(), scale * LOG2E, items, 0,
    )  # fmt: skip
    return args, {"HEAD_GROUPS": groups}, items


def _launch(q, kv, idx, ptr, sink, out, scale, groups):
    """:func:`_launch_args` with grid = min(items, SMs), num_warps=4, num_stages=1."""
    from sparse_mla.gluon.hopper_ws_small import _prefill_ws_small_kernel

    args, constexprs, items = _launch_args(q, kv, idx, ptr, sink, out, scale, groups)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    grid = (min(items, sms),)
    _prefill_ws_small_kernel[grid](*args, **constexprs, num_warps=4, num_stages=1)


def test_launch_binds_every_parameter():
    """The GPU cases' launch gives every runtime parameter of the kernel, by position, and
    leaves the constexprs after HEAD_GROUPS at their defaults (a parameter added to the kernel
    and not here fails on the CPU, not only on the GPU)."""
    import inspect as pyinspect

    from sparse_mla.gluon.hopper_ws_small import _prefill_ws_small_kernel

    q = torch.randn(3, 8, 512, dtype=torch.bfloat16)
    kv = torch.randn(10, 512, dtype=torch.bfloat16)
    idx = torch.tensor([1, 2, 3], dtype=torch.int32)
    ptr = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    args, constexprs, _items = _launch_args(q, kv, idx, ptr, None, torch.empty_like(q), 0.1, 1)
    sig = pyinspect.signature(_prefill_ws_small_kernel.fn)
    bound = sig.bind(*args, **constexprs)  # TypeError on a missing or extra argument
    constexpr = [n for n, p in sig.parameters.items() if p.default is not p.empty]
    assert len(args) == len(sig.parameters) - len(constexpr), (len(args), constexpr)
    assert bound.arguments["ids_per_row"] == 0 and bound.arguments["num_items"] == 3


def _check(H, groups, with_sink, index_dtype, *, seed, max_len=700, R=300, dtype=torch.bfloat16):
    q, kv, idx, ptr = _case(R, H, 5000, index_dtype=index_dtype, seed=seed, max_len=max_len,
                            dtype=dtype)  # fmt: skip
    gen = torch.Generator().manual_seed(10_000 + seed)  # the sink as reproducible as the case
    sink = torch.randn(H, generator=gen).cuda() if with_sink else None
    scale = 512**-0.5
    outs = []
    for _ in range(2):
        out = torch.full(q.shape, float("nan"), dtype=dtype, device="cuda")
        _launch(q, kv, idx, ptr, sink, out, scale, groups)
        torch.cuda.synchronize()
        outs.append(out)
    out = outs[0]
    assert not torch.isnan(out).any(), "some output was not written (or NaN got through)"
    ref = sparse_mla_prefill_ref(q, kv, idx, ptr, scale, attn_sink=sink)
    base = sparse_mla_prefill_ref(q, kv, idx, ptr, scale, attn_sink=sink, upcast=False)
    rep = error_report(out.float(), ref, base.float())
    assert rep.ok, f"H={H} HEAD_GROUPS={groups}: {rep}"
    assert torch.all(out[0] == 0) and torch.all(out[2] == 0), "empty tokens must be zeros"
    assert torch.equal(outs[0], outs[1]), "repeat launches differ"


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("H", [1, 8, 16, 17, 20, 24, 31, 32])
@pytest.mark.parametrize("with_sink", [False, True])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_gpu_ws_small_groups_matches_reference(H, with_sink, index_dtype):
    """HEAD_GROUPS = cdiv(H, 16); 300 tokens (more items than SMs: every persistent program
    takes several and the ring's phases carry over), lists up to 700 slots."""
    _check(H, triton.cdiv(H, 16), with_sink, index_dtype, seed=7 * H + with_sink)


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("H", [16, 17, 32])
def test_gpu_ws_small_groups_long_lists(H):
    """Lists up to 2100 slots (GLM top-k 2048): 33 tiles an item through the ring."""
    _check(H, triton.cdiv(H, 16), True, torch.int64, seed=100 + H, max_len=2100, R=150)


@pytest.mark.gpu
@pytest.mark.sm90
def test_gpu_ws_small_groups_fp16_and_idle_group():
    """fp16 at H = 24; and HEAD_GROUPS = 2 at H = 8 (24 of the block's 32 heads past H:
    wasted work, still right)."""
    _check(24, 2, True, torch.int32, seed=5, dtype=torch.float16)
    _check(8, 2, False, torch.int32, seed=6)
