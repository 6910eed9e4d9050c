"""The Triton sparse prefill against the fp32 reference (CPU interpreter; `-m gpu` on a GPU)."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import make_case, poisoned_like

from sparse_mla import PrefillConfig, sparse_mla_prefill
from sparse_mla.reference import check_against_reference

DTYPES = [torch.float16, torch.bfloat16]


def _run_and_check(case, config=None, **kw):
    out = poisoned_like(case.q)
    res = sparse_mla_prefill(*case.args(), attn_sink=case.attn_sink, out=out, config=config, **kw)
    assert res is out
    assert not torch.isnan(out).any(), "unwritten or NaN output elements"
    rep = check_against_reference(out, *case.args(), attn_sink=case.attn_sink)
    assert rep.ok, str(rep)
    return out


# dtype x H x D x sink x exp2, EVEN_HD automatic (on where valid).
MATRIX = list(
    itertools.product(DTYPES, [1, 8, 16, 20, 64], [64, 512], [False, True], [False, True])
)


@pytest.mark.parametrize(("dtype", "H", "D", "sink", "exp2"), MATRIX)
def test_matches_reference(dtype, H, D, sink, exp2):
    seed = hash((str(dtype), H, D, sink, exp2)) % 2**31
    case = make_case(5, H, D, N=150, max_slots=40, dtype=dtype, sink=sink, seed=seed)
    _run_and_check(case, config={"USE_EXP2": exp2})


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("H", "D", "block_h"), [(16, 512, 16), (64, 64, 32), (8, 64, 16)])
@pytest.mark.parametrize("even_hd", [False, True])
@pytest.mark.parametrize("exp2", [False, True])
def test_even_hd_and_exp2_flags(dtype, H, D, block_h, even_hd, exp2):
    case = make_case(4, H, D, N=120, max_slots=50, dtype=dtype, seed=H + D + even_hd)
    cfg = PrefillConfig(BLOCK_H=block_h, BLOCK_K=16, EVEN_HD=even_hd, USE_EXP2=exp2)
    if even_hd and H % block_h:
        with pytest.raises(ValueError, match="EVEN_HD"):
            sparse_mla_prefill(*case.args(), attn_sink=case.attn_sink, config=cfg)
        return
    _run_and_check(case, config=cfg)


def test_head_dim_576_accepted():
    # DSv4 MLA with the RoPE part appended: not a power of two, so EVEN_HD is off.
    case = make_case(3, 16, 576, N=64, max_slots=20, dtype=torch.bfloat16, seed=5)
    _run_and_check(case)


def test_even_hd_rejected_when_head_dim_is_not_block_d():
    case = make_case(2, 16, 576, N=32, max_slots=8, seed=1)
    with pytest.raises(ValueError, match="EVEN_HD"):
        sparse_mla_prefill(*case.args(), config={"EVEN_HD": True})


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_invalid_slots_and_poisoned_pool(index_dtype):
    # -1, N, 2^31-1, -2^31 and (int64) 2^31, 2^33+5, 2^62: all absent, never read.
    case = make_case(8, 16, 64, N=90, max_slots=60, index_dtype=index_dtype, seed=11)
    assert case.kv_indices.dtype == index_dtype
    n_bad = ((case.kv_indices < 0) | (case.kv_indices >= 90)).sum().item()
    assert n_bad > 0
    assert torch.isnan(case.kv.float()).any() or torch.isinf(case.kv.float()).any()
    _run_and_check(case)


def test_int64_indices_not_narrowed():
    # 2^32 + 3 would wrap to the valid slot 3 if narrowed to int32; it must stay absent.
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 16, 64, generator=g).half()
    kv = torch.randn(10, 64, generator=g).half()
    idx = torch.tensor([2**32 + 3, 1, 2**32 + 3], dtype=torch.int64)
    indptr = torch.tensor([0, 1, 3], dtype=torch.int64)
    out = sparse_mla_prefill(q, kv, idx, indptr, 0.125)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    alone = sparse_mla_prefill(q[1:], kv, idx[1:2], torch.tensor([0, 1]), 0.125)
    torch.testing.assert_close(out[1], alone[0], rtol=0, atol=0)


@pytest.mark.parametrize("sink", [False, True])
def test_empty_rows_are_zero(sink):
    # Fresh slots below may hit any row, so no row is poisoned here.
    case = make_case(6, 16, 64, N=50, max_slots=30, sink=sink, seed=21, poison_unused=False)
    # Token 1: no slots; token 2: only invalid slots.
    ptr = case.kv_indptr.clone()
    lens = (ptr[1:] - ptr[:-1]).tolist()
    lens[1] = 0
    lens[2] = 3
    ptr = torch.tensor([0, *list(itertools.accumulate(lens))], dtype=ptr.dtype)
    idx = torch.randint(0, 50, (int(ptr[-1]),), dtype=case.kv_indices.dtype)
    idx[int(ptr[2]) : int(ptr[3])] = -1
    case.kv_indptr, case.kv_indices = ptr, idx
    out = _run_and_check(case)
    assert torch.count_nonzero(out[1]) == 0 and torch.count_nonzero(out[2]) == 0


def test_empty_pool_and_no_tokens():
    q = torch.randn(3, 16, 64).bfloat16()
    kv = torch.empty(0, 64, dtype=torch.bfloat16)
    idx = torch.tensor([0, -1, 5], dtype=torch.int32)
    ptr = torch.tensor([0, 2, 2, 3], dtype=torch.int32)
    out = sparse_mla_prefill(q, kv, idx, ptr, 0.1, attn_sink=torch.randn(16), out=poisoned_like(q))
    assert torch.count_nonzero(out) == 0 and not torch.isnan(out).any()
    q0 = torch.empty(0, 16, 64, dtype=torch.bfloat16)
    out0 = sparse_mla_prefill(q0, torch.randn(4, 64).bfloat16(), idx[:0], ptr[:1], 0.1)
    assert out0.shape == (0, 16, 64)


def test_strided_q_out_and_3d_pool():
    case = make_case(5, 16, 64, N=80, max_slots=30, dtype=torch.float16, seed=8)
    # q and out with non-contiguous token/head strides, last dim contiguous.
    qbuf = torch.randn(5, 32, 96).half()
    qbuf[:, ::2, :64] = case.q
    q = qbuf[:, ::2, :64]
    obuf = torch.full((5, 16, 2, 64), float("nan"), dtype=torch.float16)
    out = obuf[:, :, 1, :]
    assert not q.is_contiguous() and not out.is_contiguous()
    kv3 = case.kv[:, None, :]  # [N, 1, D]
    res = sparse_mla_prefill(
        q, kv3, case.kv_indices, case.kv_indptr, case.softmax_scale,
        attn_sink=case.attn_sink, out=out,
    )  # fmt: skip
    assert res is out
    assert torch.isnan(obuf[:, :, 0, :]).all(), "wrote outside out's view"
    rep = check_against_reference(
        out, case.q, case.kv, case.kv_indices, case.kv_indptr, case.softmax_scale,
        attn_sink=case.attn_sink,
    )  # fmt: skip
    assert rep.ok, str(rep)


def test_out_buffer_matches_allocating_call_bit_for_bit():
    case = make_case(6, 16, 512, N=100, max_slots=40, seed=13)
    a = sparse_mla_prefill(*case.args(), attn_sink=case.attn_sink)
    buf = poisoned_like(case.q)
    b = sparse_mla_prefill(*case.args(), attn_sink=case.attn_sink, out=buf)
    assert b is buf
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))


# ----------------------------------------------------------------------------------------------
# Bad input: a clear exception naming the argument, and `out` untouched.
# ----------------------------------------------------------------------------------------------


def _good():
    q = torch.randn(3, 8, 64).bfloat16()
    kv = torch.randn(20, 64).bfloat16()
    idx = torch.tensor([1, 2, 3, -1], dtype=torch.int32)
    ptr = torch.tensor([0, 1, 3, 4], dtype=torch.int32)
    return dict(q=q, kv=kv, kv_indices=idx, kv_indptr=ptr, softmax_scale=0.125)


def _bad_cases():
    g = _good()
    q, kv = g["q"], g["kv"]
    cases = [
        ("q", dict(q=q.float()), TypeError),
        ("q", dict(q=q[..., :32].contiguous().float()), TypeError),
        ("kv dtype", dict(kv=kv.half()), TypeError),
        ("head dim", dict(kv=torch.randn(20, 32).bfloat16()), ValueError),
        ("kv_indptr", dict(kv_indptr=torch.tensor([0, 1, 4], dtype=torch.int32)), ValueError),
        ("kv_indices", dict(kv_indices=torch.tensor([1.0, 2.0, 3.0, 0.0])), TypeError),
        ("kv_indptr", dict(kv_indptr=torch.tensor([0.0, 1.0, 3.0, 4.0])), TypeError),
        ("attn_sink", dict(attn_sink=torch.randn(8).bfloat16()), TypeError),
        ("attn_sink", dict(attn_sink=torch.randn(7)), ValueError),
        ("out", dict(out_shape=(3, 8, 32)), ValueError),
        ("out", dict(out_dtype=torch.float16), TypeError),
        ("out", dict(out_stride=True), ValueError),
        ("softmax_scale", dict(softmax_scale=float("nan")), ValueError),
        ("softmax_scale", dict(softmax_scale="0.1"), TypeError),
        ("softmax_scale must be finite", dict(softmax_scale=10**400), ValueError),
        ("softmax_scale must be finite", dict(softmax_scale=-(10**5000)), ValueError),
        ("softmax_scale .* overflows fp32", dict(softmax_scale=10**39), ValueError),
    ]
    if hasattr(torch, "float8_e4m3fn"):
        cases.append(("fp8", dict(kv=kv.to(torch.float8_e4m3fn)), TypeError))
    return cases


@pytest.mark.parametrize(("needle", "change", "exc"), _bad_cases())
def test_bad_input_raises_and_leaves_out_untouched(needle, change, exc):
    args = _good()
    change = dict(change)
    shape = change.pop("out_shape", tuple(args["q"].shape))
    dtype = change.pop("out_dtype", args["q"].dtype)
    if change.pop("out_stride", False):
        out = torch.full((*shape[:-1], shape[-1] * 2), 7.0, dtype=dtype)[..., ::2]
    else:
        out = torch.full(shape, 7.0, dtype=dtype)
    sink = change.pop("attn_sink", None)
    args.update(change)
    before = out.clone()
    with pytest.raises(exc, match=needle):
        sparse_mla_prefill(**args, attn_sink=sink, out=out)
    assert torch.equal(out, before)


def test_device_mismatch_named():
    if not torch.cuda.is_available():
        pytest.skip("needs a second device type")
    args = _good()
    args["kv"] = args["kv"].cuda()
    with pytest.raises(ValueError, match="kv is on"):
        sparse_mla_prefill(**args)


def test_meta_tensors_are_refused_by_name():
    args = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in _good().items()}
    with pytest.raises(ValueError, match=r"q is on meta \(meta tensors hold no data\)"):
        sparse_mla_prefill(**args)


def test_bad_config_is_clear():
    args = _good()
    with pytest.raises(ValueError, match="BLOCK_K"):
        sparse_mla_prefill(**args, config={"BLOCK_K": 24})
    with pytest.raises(ValueError, match="unknown key"):
        sparse_mla_prefill(**args, config={"BLOCK_M": 16})


def _rejects(exc, needle, out=None, **change):
    args = {**_good(), **change}
    out = torch.full((3, 8, 64), 7.0, dtype=torch.bfloat16) if out is None else out
    before = out.clone()
    with pytest.raises(exc, match=needle):
        sparse_mla_prefill(**args, out=out)
    assert torch.equal(out, before), "out was written on a rejected call"


def test_kv_indptr_values_checked_on_cpu():
    i32 = torch.int32
    _rejects(ValueError, "non-decreasing", kv_indptr=torch.tensor([0, 3, 1, 4], dtype=i32))
    _rejects(
        ValueError, r"kv_indptr\[-1\] = 5 is past the end", kv_indptr=torch.tensor([0, 1, 3, 5])
    )
    _rejects(ValueError, r"kv_indptr\[0\] = -1", kv_indptr=torch.tensor([-1, 1, 3, 4]))
    _rejects(ValueError, "past the end", kv_indptr=torch.tensor([0, 1, 2**40, 2**40]))
    # A first entry above 0 is a window of kv_indices: valid, documented.
    g = _good()
    idx = torch.cat([torch.tensor([5, 6], dtype=torch.int32), g["kv_indices"]])
    shifted = sparse_mla_prefill(g["q"], g["kv"], idx, g["kv_indptr"] + 2, 0.125)
    torch.testing.assert_close(shifted, sparse_mla_prefill(**g), rtol=0, atol=0)


def test_validate_switch_for_gpu_tensors(monkeypatch):
    from sparse_mla import validation

    gpu = torch.device("cuda", 0)
    monkeypatch.delenv(validation.ENV_VALIDATE, raising=False)
    assert not validation._wants_value_check(None, gpu)  # no sync by default
    assert validation._wants_value_check(True, gpu)
    assert validation._wants_value_check(None, torch.device("cpu"))
    assert not validation._wants_value_check(False, torch.device("cpu"))
    monkeypatch.setenv(validation.ENV_VALIDATE, "1")
    assert validation._wants_value_check(None, gpu)


def test_strided_small_tensors_are_honoured():
    # A per-layer sink column, and every-other-entry index views, give the contiguous result.
    case = make_case(5, 16, 64, N=40, max_slots=20, seed=4)
    sinks = torch.full((16, 3), float("nan"))
    sinks[:, 1] = case.attn_sink
    idx = torch.full((2 * case.kv_indices.numel(),), -7, dtype=case.kv_indices.dtype)
    idx[::2] = case.kv_indices
    ptr = torch.full((2 * case.kv_indptr.numel(),), 10**6, dtype=case.kv_indptr.dtype)
    ptr[::2] = case.kv_indptr
    args = (case.q, case.kv, idx[::2], ptr[::2], case.softmax_scale)
    got = sparse_mla_prefill(*args, attn_sink=sinks[:, 1])
    want = sparse_mla_prefill(*case.args(), attn_sink=case.attn_sink)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # q with a strided last dim is copied; the result is the same.
    q2 = torch.empty(*case.q.shape[:2], 2 * case.q.shape[2], dtype=case.q.dtype)[..., ::2]
    q2.copy_(case.q)
    got = sparse_mla_prefill(q2, *case.args()[1:], attn_sink=case.attn_sink)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_other_new_rejections_name_the_argument():
    g = _good()
    kv_t = torch.randn(64, 20).bfloat16().t()  # [20, 64] with stride (1, 20)
    _rejects(ValueError, "kv must have a contiguous last dim", kv=kv_t)
    _rejects(ValueError, "softmax_scale .* overflows fp32", softmax_scale=3e38)
    q0 = torch.randn(3, 8, 0).bfloat16()
    with pytest.raises(ValueError, match="q head dim D must be >= 1"):
        sparse_mla_prefill(q0, torch.randn(20, 0).bfloat16(), g["kv_indices"], g["kv_indptr"], 1.0)
    # out overlapping itself, kv, the indices, or q other than as q itself.
    _rejects(ValueError, "overlapping", out=torch.zeros(3, 1, 64).bfloat16().expand(3, 8, 64))
    buf = torch.randn(40, 64).bfloat16()
    kv_in = buf[:20]
    out_on_kv = buf[16:40].view(3, 8, 64)
    _rejects(ValueError, "out overlaps kv", out=out_on_kv, kv=kv_in)
    big = torch.randn(4, 8, 64).bfloat16()
    _rejects(ValueError, "out overlaps q", out=big[1:], q=big[:3])


def test_out_may_be_q_itself():
    case = make_case(4, 16, 64, N=30, max_slots=20, seed=6)
    want = sparse_mla_prefill(*case.args(), attn_sink=case.attn_sink)
    q = case.q.clone()
    got = sparse_mla_prefill(q, *case.args()[1:], attn_sink=case.attn_sink, out=q)
    assert got is q
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"num_warps": 4.0}, "num_warps"),
        ({"num_warps": True}, "num_warps"),
        ({"USE_EXP2": "no"}, "USE_EXP2"),
        ({"PREFETCH_KV": 1}, "PREFETCH_KV"),
        ({"EVEN_HD": "yes"}, "EVEN_HD"),
        ({"BLOCK_K": 512}, "BLOCK_K"),
        ({"BLOCK_H": 16.0}, "BLOCK_H"),
        ({"num_stages": 100}, "num_stages"),
        ({"num_stages": 2.5}, "num_stages"),
        ({"kpack": 3}, "kpack"),
        ({"waves_per_eu": -1}, "waves_per_eu"),
    ],
)
def test_config_types_and_bounds(change, needle):
    out = torch.full((3, 8, 64), 7.0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=needle):
        sparse_mla_prefill(**_good(), out=out, config=change)
    assert (out == 7.0).all()


def test_tile_past_tritons_limit_is_a_config_error():
    q = torch.randn(1, 1, 8192).bfloat16()
    kv = torch.randn(4, 8192).bfloat16()
    idx, ptr = torch.tensor([0, 1]), torch.tensor([0, 2])
    with pytest.raises(ValueError, match="Triton's 1048576 elements"):
        sparse_mla_prefill(q, kv, idx, ptr, 0.01, config={"BLOCK_H": 256, "BLOCK_K": 16})


@pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")  # inf - inf
def test_empty_token_is_zero_for_every_sink():
    case = make_case(3, 16, 64, N=20, max_slots=6, seed=1)
    ptr = torch.zeros_like(case.kv_indptr)  # every token empty
    for value in (float("-inf"), float("inf"), float("nan"), -3e38, 3e38, -1e30, 0.0, 5.0):
        for exp2 in (True, False):
            sink = torch.full((16,), value)
            out = poisoned_like(case.q)
            sparse_mla_prefill(case.q, case.kv, case.kv_indices, ptr, case.softmax_scale,
                               attn_sink=sink, out=out, config={"USE_EXP2": exp2})  # fmt: skip
            assert (out == 0).all(), (value, exp2)


@pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")  # NaN - NaN
@pytest.mark.parametrize(("H", "exp2"), [(16, True), (20, False)])  # EVEN_HD on / off
def test_nan_sink_leaves_empty_tokens_zero_and_other_heads_exact(H, exp2):
    # Empty and non-empty tokens side by side, a sink that is NaN on some heads: the empty
    # tokens are zeros on every head (DESIGN.md section 2), the other heads match the reference.
    case = make_case(6, H, 64, N=30, max_slots=12, seed=3, empty_rows=False)
    lengths = (case.kv_indptr[1:] - case.kv_indptr[:-1]).clone()
    lengths[[1, 4]] = 0
    ptr = torch.zeros_like(case.kv_indptr)
    ptr[1:] = lengths.cumsum(0)
    idx = case.kv_indices[: int(ptr[-1])]
    sink = case.attn_sink.clone()
    nan_heads = [3, 9]
    sink[nan_heads] = float("nan")
    out = poisoned_like(case.q)
    sparse_mla_prefill(case.q, case.kv, idx, ptr, case.softmax_scale, attn_sink=sink, out=out,
                       config={"USE_EXP2": exp2})  # fmt: skip
    assert (out[[1, 4]] == 0).all()
    keep = [h for h in range(H) if h not in nan_heads]
    rep = check_against_reference(
        out[:, keep], case.q[:, keep], case.kv, idx, ptr, case.softmax_scale, attn_sink=sink[keep]
    )
    assert rep.ok, str(rep)


def test_amd_options_accepted_off_amd():
    case = make_case(2, 16, 64, N=40, max_slots=20, seed=2)
    _run_and_check(case, config={"kpack": 2, "waves_per_eu": 1, "BLOCK_K": 16})


# ----------------------------------------------------------------------------------------------
# GPU: the same checks natively, plus sizes the interpreter is too slow for.
# ----------------------------------------------------------------------------------------------

GPU_MATRIX = list(
    itertools.product(DTYPES, [1, 8, 16, 20, 64, 128], [64, 512, 576], [False, True], [False, True])
)


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "H", "D", "sink", "exp2"), GPU_MATRIX)
def test_gpu_matches_reference(dtype, H, D, sink, exp2):
    case = make_case(
        300, H, D, N=5000, max_slots=700, dtype=dtype, sink=sink, device="cuda",
        seed=H * D + sink, index_dtype=torch.int64 if exp2 else torch.int32,
    )  # fmt: skip
    _run_and_check(case, config={"USE_EXP2": exp2})


@pytest.mark.gpu
@pytest.mark.parametrize("even_hd", [False, True])
@pytest.mark.parametrize(
    ("block_h", "block_k", "warps", "stages"),
    [(16, 16, 1, 2), (16, 32, 4, 2), (32, 32, 4, 3), (64, 16, 8, 2)],
)
def test_gpu_launch_configs(even_hd, block_h, block_k, warps, stages):
    case = make_case(200, 64, 512, N=3000, max_slots=600, device="cuda", seed=block_h + block_k)
    cfg = PrefillConfig(block_h, block_k, warps, stages, EVEN_HD=even_hd)
    _run_and_check(case, config=cfg)


@pytest.mark.gpu
def test_gpu_pool_past_2gib_int64_offsets():
    # 5M rows x 512 x bf16 = 5 GiB: slot * 512 overflows int32 element offsets past row 4M.
    N, D = 5 * 1024 * 1024, 512
    pool = torch.empty(N, D, dtype=torch.bfloat16, device="cuda")
    pool.normal_()
    g = torch.Generator().manual_seed(0)
    T, H = 64, 16
    q = torch.randn(T, H, D, generator=g).bfloat16().cuda()
    lens = torch.randint(1, 300, (T,), generator=g)
    ptr = torch.zeros(T + 1, dtype=torch.int64)
    ptr[1:] = lens.cumsum(0)
    idx = torch.randint(N - 2**20, N, (int(ptr[-1]),), generator=g, dtype=torch.int64)
    idx[::7] = N  # invalid: one past the pool
    ptr, idx = ptr.cuda(), idx.cuda()
    sink = torch.randn(H, generator=g).cuda()
    out = sparse_mla_prefill(q, pool, idx, ptr, D**-0.5, attn_sink=sink, out=poisoned_like(q))
    rows = torch.unique(idx[idx < N])
    small = pool[rows]
    remap = torch.full((N + 1,), -1, dtype=torch.int64, device="cuda")
    remap[rows] = torch.arange(rows.numel(), device="cuda")
    idx_small = remap[idx]
    rep = check_against_reference(out, q, small, idx_small, ptr, D**-0.5, attn_sink=sink)
    assert rep.ok, str(rep)


@pytest.mark.gpu
def test_gpu_out_buffer_bit_for_bit_and_matches_cpu_interpreter():
    case = make_case(16, 16, 512, N=300, max_slots=100, seed=4)
    gpu = make_case(16, 16, 512, N=300, max_slots=100, seed=4, device="cuda")
    a = sparse_mla_prefill(*gpu.args(), attn_sink=gpu.attn_sink)
    b = sparse_mla_prefill(*gpu.args(), attn_sink=gpu.attn_sink, out=poisoned_like(gpu.q))
    assert torch.equal(a, b)
    cpu = sparse_mla_prefill(*case.args(), attn_sink=case.attn_sink)
    torch.testing.assert_close(a.cpu().float(), cpu.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("H", "D", "even_hd"), [(16, 512, True), (20, 64, False), (8, 576, False)])
def test_prefetch_kv(dtype, H, D, even_hd):
    case = make_case(5, H, D, N=100, max_slots=45, dtype=dtype, seed=H + D)
    _run_and_check(case, config=PrefillConfig(BLOCK_K=16, EVEN_HD=even_hd, PREFETCH_KV=True))


def test_compile_options_per_vendor():
    cfg = PrefillConfig(num_warps=8, num_stages=3, kpack=2, waves_per_eu=1, maxnreg=128)
    assert cfg.compile_options("cuda") == {"num_warps": 8, "num_stages": 3, "maxnreg": 128}
    assert cfg.compile_options("hip") == {
        "num_warps": 8, "num_stages": 3, "kpack": 2, "waves_per_eu": 1,
    }  # fmt: skip
    with pytest.raises(ValueError, match="maxnreg"):
        PrefillConfig(maxnreg=300).validate()


@pytest.mark.gpu
@pytest.mark.parametrize("H", [8, 16, 64, 128])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_gpu_tuned_launch_from_configs(H, index_dtype):
    # config=None: the launch comes from configs/<arch>/... when an entry exists.
    case = make_case(
        257, H, 512, N=4000, max_slots=700, device="cuda", seed=H, index_dtype=index_dtype
    )
    _run_and_check(case, config=None)
