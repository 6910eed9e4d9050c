"""The FP8-cache entry as a registered op (torch.ops.sparse_mla.prefill_fp8): opcheck on
representative FP8 samples, torch.compile(fullgraph=True) over a function that builds an
FP8Cache and calls sparse_mla_prefill (CPU: the interpreter runs triton_fp8), the same bits as
eager and correct against the fp32 reference over the dequantized rows."""

from __future__ import annotations

import pytest
import torch
from test_fp8_prefill import make_fp8_case
from torch.utils._python_dispatch import TorchDispatchMode

from sparse_mla import FP8Cache, op, sparse_mla_prefill
from sparse_mla import fp8 as F
from sparse_mla.configs import PrefillConfig
from sparse_mla.reference import check_against_reference

OP = torch.ops.sparse_mla.prefill_fp8.default


def _reference_ok(got, q, cache, idx, ptr, scale, sink) -> None:
    assert not torch.isnan(got).any()
    rep = check_against_reference(got, q, F.dequantize(cache), idx, ptr, scale, attn_sink=sink)
    assert rep.ok, str(rep)


def _poisoned(q):
    return torch.full_like(q, float("nan"))


@pytest.mark.parametrize(
    ("T", "H", "block_size", "num_blocks", "sink", "index_dtype", "as_u8", "config"),
    [
        (3, 16, 8, 3, True, torch.int32, False, None),  # FlashMLA's 4-D fp8 view
        (2, 8, 3, 5, False, torch.int64, True, None),  # [num_blocks, bytes] uint8, no sink
        (3, 20, 4, 2, True, torch.int64, False, PrefillConfig(BLOCK_H=16, BLOCK_K=16)),
        (0, 16, 4, 2, True, torch.int32, False, None),  # T = 0
        (2, 16, 4, 0, True, torch.int32, False, None),  # no blocks: every token zeros
    ],
)
def test_opcheck_fp8(T, H, block_size, num_blocks, sink, index_dtype, as_u8, config):
    case = make_fp8_case(max(T, 1), H, num_blocks=max(num_blocks, 1), block_size=block_size,
                         sink=sink, index_dtype=index_dtype, seed=T + H)  # fmt: skip
    q, ptr = case.q[:T], case.kv_indptr[: T + 1]
    data = case.cache.as_bytes() if as_u8 else case.cache.data
    data = data[:num_blocks]
    spec = None if config is None else op.config_spec(config)
    args = (q, data, block_size, case.kv_indices, ptr, case.softmax_scale, case.attn_sink)
    rest = (_poisoned(q), spec, None)
    if data.dtype == torch.uint8:
        torch.library.opcheck(OP, (*args, *rest))
    else:
        # opcheck's schema test compares inputs before and after with torch.allclose, which CPU
        # torch does not implement for float8_e4m3fn: that test on the same bytes as uint8
        # (what FP8Cache accepts too), every other test on the float8 tensor itself.
        u8 = (q, data.view(torch.uint8), *args[2:])
        torch.library.opcheck(OP, (*u8, *rest))
        utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
        torch.library.opcheck(OP, (*args, _poisoned(q), spec, None), test_utils=utils)
    out = _poisoned(q)
    OP(*args, out, spec, None)
    cache = FP8Cache(data, block_size)
    if num_blocks == 0:
        assert torch.all(out == 0)
    else:
        _reference_ok(out, q, cache, case.kv_indices, ptr, case.softmax_scale, case.attn_sink)
    want = sparse_mla_prefill(q, cache, case.kv_indices, ptr, case.softmax_scale,
                              attn_sink=case.attn_sink, config=config)  # fmt: skip
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))


def test_the_fp8_entry_goes_through_the_op():
    case = make_fp8_case(2, 16, num_blocks=2, block_size=4, seed=7)
    ops = []

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(str(func))
            return func(*args, **(kwargs or {}))

    out = _poisoned(case.q)
    with Seen():
        sparse_mla_prefill(*case.args(), attn_sink=case.attn_sink, out=out)
    assert ops == ["sparse_mla.prefill_fp8.default"]
    _reference_ok(out, case.q, case.cache, case.kv_indices, case.kv_indptr, case.softmax_scale,
                  case.attn_sink)  # fmt: skip


def _layer(q, data, idx, ptr, sink, block_size, scale):
    """What a model's attention layer does: its cache tensor wrapped as an FP8Cache."""
    o = sparse_mla_prefill(q * 0.5, FP8Cache(data, block_size), idx, ptr, scale, attn_sink=sink)
    return o.float() + 1.0


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_compile_fullgraph_fp8_equals_eager(index_dtype):
    """fullgraph=True over a function that builds an FP8Cache from its tensor and calls the
    entry: no graph break, the same bits as eager, correct against the fp32 reference; new
    inputs of the same shapes run the compiled graph again."""
    torch._dynamo.reset()
    case = make_fp8_case(3, 16, num_blocks=3, block_size=8, index_dtype=index_dtype, seed=21)
    bs, scale = case.cache.block_size, case.softmax_scale

    def f(q, data, idx, ptr, sink):
        return _layer(q, data, idx, ptr, sink, bs, scale)

    args = (case.q, case.cache.data, case.kv_indices, case.kv_indptr, case.attn_sink)
    eager = f(*args)
    explained = torch._dynamo.explain(f)(*args)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(f, fullgraph=True)
    got = compiled(*args)
    assert torch.equal(got, eager)
    q2 = (case.q * 0.5).to(case.q.dtype)
    _reference_ok((got - 1.0).to(case.q.dtype), q2, case.cache, case.kv_indices, case.kv_indptr,
                  scale, case.attn_sink)  # fmt: skip
    case2 = make_fp8_case(3, 16, num_blocks=3, block_size=8, index_dtype=index_dtype, seed=22)
    args2 = (case2.q, case2.cache.data, case2.kv_indices, case2.kv_indptr, case2.attn_sink)
    if case2.kv_indices.shape == case.kv_indices.shape:
        assert torch.equal(compiled(*args2), f(*args2))


def test_compile_fullgraph_fp8_cache_argument_out_and_config():
    """An FP8Cache passed into the compiled function, out= given, a forced launch config."""
    torch._dynamo.reset()
    case = make_fp8_case(2, 16, num_blocks=2, block_size=4, sink=False, seed=23)
    cfg = PrefillConfig(BLOCK_H=16, BLOCK_K=16, num_warps=4)

    def f(q, cache, idx, ptr, out):
        sparse_mla_prefill(q, cache, idx, ptr, case.softmax_scale, out=out, config=cfg)
        return out.float().sum(-1)

    out_e, out_c = _poisoned(case.q), _poisoned(case.q)
    a = (case.q, case.cache, case.kv_indices, case.kv_indptr)
    eager = f(*a, out_e)
    got = torch.compile(f, fullgraph=True)(*a, out_c)
    assert torch.equal(got, eager) and torch.equal(out_c.view(torch.int16), out_e.view(torch.int16))
    _reference_ok(out_c, case.q, case.cache, case.kv_indices, case.kv_indptr, case.softmax_scale,
                  None)  # fmt: skip


def test_compile_fp8_checks_run_in_the_op():
    """Under compile the cache's address check and validate=True's value check run when the
    graph runs (in the op's kernel, on the real tensors)."""
    torch._dynamo.reset()
    case = make_fp8_case(3, 16, num_blocks=2, block_size=4, seed=24)
    bs = case.cache.block_size

    def f(q, data, idx, ptr):
        return sparse_mla_prefill(q, FP8Cache(data, bs), idx, ptr, 0.1, validate=True) * 2

    g = torch.compile(f, fullgraph=True)
    a = (case.q, case.cache.data, case.kv_indices)
    assert torch.equal(g(*a, case.kv_indptr), f(*a, case.kv_indptr))
    bad = case.kv_indptr.clone()
    bad[1] = bad[-1] + 5
    with pytest.raises(ValueError, match="kv_indptr"):
        g(*a, bad)
    u8 = case.cache.as_bytes()
    odd = torch.empty(u8.numel() + 1, dtype=torch.uint8)[1:].view(u8.shape)
    odd.copy_(u8)
    with pytest.raises(ValueError, match="2-byte aligned"):
        g(case.q, odd, case.kv_indices, case.kv_indptr)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_gpu_compile_fp8_equals_eager(mode):
    """On the GPU: fullgraph=True (and CUDA graphs) over the FP8 layer; replays on new inputs
    equal eager bit for bit and the fp32 reference."""
    torch._dynamo.reset()
    case = make_fp8_case(64, 16, num_blocks=8, block_size=64, max_slots=300, seed=31)
    bs, scale = case.cache.block_size, case.softmax_scale

    def f(q, data, idx, ptr, sink):
        return _layer(q, data, idx, ptr, sink, bs, scale)

    compiled = torch.compile(f, fullgraph=True, mode=mode)
    for step in range(3):
        q = (case.q * (1 + step)).cuda()
        args = (q, case.cache.data.cuda(), case.kv_indices.cuda(), case.kv_indptr.cuda(),
                case.attn_sink.cuda())  # fmt: skip
        got = compiled(*args).clone()
        want = f(*args)
        torch.cuda.synchronize()
        assert torch.equal(got, want), step
        q2 = (q * 0.5).to(q.dtype)
        _reference_ok((got - 1.0).to(q.dtype), q2, FP8Cache(args[1], bs), *args[2:4], scale,
                      args[4])  # fmt: skip
