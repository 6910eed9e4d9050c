"""The Triton prefill from the FP8 cache (``triton_fp8``) against the fp32 reference over the
dequantized rows (CPU interpreter), its dispatch, its errors and its cross-compiles."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import pytest
import torch
import triton
import triton.language as tl

from sparse_mla import FP8Cache, dispatch, runtime, sparse_mla_prefill
from sparse_mla import fp8 as F
from sparse_mla.fp8_prefill import _decode_e4m3fn, _decode_ue8m0
from sparse_mla.reference import check_against_reference


@dataclass
class FP8Case:
    q: torch.Tensor
    cache: FP8Cache
    kv_indices: torch.Tensor
    kv_indptr: torch.Tensor
    softmax_scale: float
    attn_sink: torch.Tensor | None

    def args(self):
        return self.q, self.cache, self.kv_indices, self.kv_indptr, self.softmax_scale


def make_fp8_case(T, H, *, num_blocks, block_size, max_slots=24, index_dtype=torch.int32,
                  sink=True, seed=0) -> FP8Case:  # fmt: skip
    """Ragged lists (some empty) with slots at block boundaries and invalid slots of every kind;
    the cache lives between two poisoned blocks of a larger buffer, and every slot no valid id
    references (and every pad byte) is 0xFF: NaN NoPE, NaN RoPE, NaN scale."""
    g = torch.Generator().manual_seed(seed)
    n = num_blocks * block_size
    rows = (torch.randn(n, 512, generator=g) * torch.exp2(torch.randn(n, 8, 1, generator=g))
            .repeat_interleave(64, dim=-1).flatten(1)[:, :512]).bfloat16()  # fmt: skip
    lengths = torch.randint(0, max_slots + 1, (T,), generator=g)
    if T > 1:
        lengths[torch.randint(0, T, (max(1, T // 4),), generator=g)] = 0
    indptr = torch.zeros(T + 1, dtype=torch.int64)
    indptr[1:] = lengths.cumsum(0)
    nnz = int(indptr[-1])
    idx = torch.randint(0, n, (nnz,), generator=g)
    edges = torch.tensor(
        sorted({0, n - 1} | {b * block_size + d for b in range(1, num_blocks) for d in (-1, 0)})
    )
    take = torch.rand(nnz, generator=g) < 0.3
    idx = torch.where(take, edges[torch.randint(0, len(edges), (nnz,), generator=g)], idx)
    bad = [-1, n, 2**31 - 1, -(2**31)]
    if index_dtype == torch.int64:
        bad += [2**31, 2**33 + 5, 2**62]
    where = torch.rand(nnz, generator=g) < 0.2
    idx = torch.where(
        where, torch.tensor(bad)[torch.randint(0, len(bad), (nnz,), generator=g)], idx
    ).to(index_dtype)

    data = F.quantize(rows, block_size).data
    bb = F.block_bytes(block_size)
    buf = torch.full(((num_blocks + 2) * bb,), 0xFF, dtype=torch.uint8)
    blocks = buf.view(num_blocks + 2, bb)[1 : 1 + num_blocks]
    blocks[:, : block_size * 584] = F.FP8Cache(data, block_size).as_bytes()
    blocks[:, block_size * 584 :] = 0xFF  # block padding
    # Views, not copies: the blocks' stride is the padded size.
    body = blocks[:, : block_size * 576].view(num_blocks, block_size, 576)
    scales = blocks[:, block_size * 576 : block_size * 584].view(num_blocks, block_size, 8)
    scales[..., 7] = 0xFF
    used = torch.zeros(n, dtype=torch.bool)
    v = idx.long()
    used[v[(v >= 0) & (v < n)]] = True
    unused = ~used.view(num_blocks, block_size)
    body[unused] = 0xFF
    scales[unused] = 0xFF
    view = blocks[:, : block_size * 584].view(torch.float8_e4m3fn)
    cache = FP8Cache(view.view(num_blocks, block_size, 1, 584), block_size)
    q = torch.randn(T, H, 512, generator=g).bfloat16()
    attn_sink = torch.randn(H, generator=g) * 2 if sink else None
    return FP8Case(q, cache, idx, indptr.to(index_dtype), 512**-0.5, attn_sink)


def _check(case: FP8Case, out=None, **kw) -> torch.Tensor:
    got = sparse_mla_prefill(*case.args(), attn_sink=case.attn_sink, out=out, **kw)
    if out is not None:
        assert got is out
    assert not torch.isnan(got).any(), "unwritten elements or a poisoned byte was read"
    rows = F.dequantize(case.cache)
    n = case.cache.num_slots
    v = case.kv_indices.long()
    unused = torch.ones(n, dtype=torch.bool)
    unused[v[(v >= 0) & (v < n)]] = False
    assert torch.isnan(rows[unused]).all(), "the unreferenced slots are poisoned"
    rep = check_against_reference(
        got, case.q, rows, case.kv_indices, case.kv_indptr, case.softmax_scale,
        attn_sink=case.attn_sink,
    )  # fmt: skip
    assert rep.ok, str(rep)
    empty = (case.kv_indptr[1:] == case.kv_indptr[:-1]).nonzero().flatten()
    assert torch.all(got[empty] == 0), "a token with no slot gets zeros"
    return got


@pytest.mark.parametrize(
    ("block_size", "num_blocks", "H", "sink", "index_dtype"),
    [
        (64, 3, 16, True, torch.int32),  # FlashMLA's block size
        (3, 9, 8, False, torch.int64),  # not a power of two
        (2, 11, 20, True, torch.int32),  # H % BLOCK_H != 0: masked heads
        (5, 6, 1, True, torch.int64),
    ],
)
def test_matches_reference(block_size, num_blocks, H, sink, index_dtype):
    case = make_fp8_case(5, H, num_blocks=num_blocks, block_size=block_size, sink=sink,
                         index_dtype=index_dtype, seed=block_size * 31 + H)  # fmt: skip
    _check(case, out=torch.full_like(case.q, float("nan")))


@pytest.mark.parametrize("use_exp2", [True, False])
def test_nan_sink_leaves_empty_tokens_zero(use_exp2):
    """A sink that is NaN on some heads: every empty token is zeros on every head (DESIGN.md
    section 2), as in the bf16 kernels; the heads with a finite sink match the reference."""
    case = make_fp8_case(12, 8, num_blocks=3, block_size=64, seed=5)
    empty = (case.kv_indptr[1:] == case.kv_indptr[:-1]).nonzero().flatten()
    assert empty.numel() > 0
    sink = case.attn_sink.clone()
    nan_heads = [0, 3, 7]
    sink[nan_heads] = float("nan")
    out = torch.full_like(case.q, float("nan"))
    sparse_mla_prefill(*case.args(), attn_sink=sink, out=out, config={"USE_EXP2": use_exp2})
    assert torch.all(out[empty] == 0), "an empty token with a NaN sink is not zeros"
    keep = [h for h in range(8) if h not in nan_heads]
    rep = check_against_reference(
        out[:, keep], case.q[:, keep], F.dequantize(case.cache), case.kv_indices,
        case.kv_indptr, case.softmax_scale, attn_sink=sink[keep],
    )  # fmt: skip
    assert rep.ok, str(rep)


@pytest.mark.parametrize("cfg", [{"USE_EXP2": False}, {"PREFETCH_KV": True, "BLOCK_K": 16}])
def test_launch_variants(cfg):
    case = make_fp8_case(4, 16, num_blocks=4, block_size=4, seed=7)
    _check(case, out=torch.full_like(case.q, float("nan")), config=cfg)


def test_allocating_call_equals_out_call_and_views_agree():
    case = make_fp8_case(4, 16, num_blocks=4, block_size=8, seed=3)
    first = _check(case)
    u8 = case.cache.data.view(torch.uint8)
    flat = case.cache.as_bytes()  # [num_blocks, bytes], the padded stride
    for data in (u8, flat, flat.view(torch.float8_e4m3fn)):
        c = FP8Case(case.q, FP8Cache(data, 8), *case.args()[2:], case.attn_sink)
        again = sparse_mla_prefill(*c.args(), attn_sink=c.attn_sink,
                                   out=torch.full_like(case.q, float("nan")))  # fmt: skip
        assert torch.equal(again.view(torch.int16), first.view(torch.int16))


def test_empty_calls():
    case = make_fp8_case(3, 16, num_blocks=2, block_size=4, seed=5)
    # T = 0
    q0 = case.q[:0]
    ptr0 = torch.zeros(1, dtype=case.kv_indptr.dtype)
    assert sparse_mla_prefill(q0, case.cache, case.kv_indices, ptr0, 0.1).shape == (0, 16, 512)
    # No blocks: every slot is invalid, every token zeros (with a sink too).
    none = FP8Cache(case.cache.data[:0], 4)
    out = torch.full_like(case.q, float("nan"))
    sparse_mla_prefill(case.q, none, *case.args()[2:], attn_sink=case.attn_sink, out=out)
    assert torch.all(out == 0)
    # Every token empty.
    ptr = torch.zeros_like(case.kv_indptr)
    out = torch.full_like(case.q, float("nan"))
    sparse_mla_prefill(case.q, case.cache, case.kv_indices, ptr, 0.1, attn_sink=case.attn_sink,
                       out=out)  # fmt: skip
    assert torch.all(out == 0)


def test_dispatch_chooses_the_fp8_kernel_and_the_others_refuse():
    case = make_fp8_case(2, 16, num_blocks=2, block_size=4, seed=1)
    call = dispatch.Call(None, 16, 512, torch.bfloat16, case.cache, kv_format=F.KV_FORMAT)
    assert dispatch.choose(call).kernel == "triton_fp8"
    assert dispatch.choose(call, config={"BLOCK_K": 16}).kernel == "triton_fp8"
    assert dispatch.choose(call, config=dispatch.Choice("triton_fp8")).kernel == "triton_fp8"
    for name, k in dispatch.KERNELS.items():
        if k.kv_format != F.KV_FORMAT:
            assert "not an FP8 KV cache" in k.why_not(call)
        elif name != "triton_fp8":  # an FP8 Gluon kernel: no GPU here
            assert "need a GPU" in k.why_not(call)
    sm90 = dispatch.Call("sm90", 16, 512, torch.bfloat16, kv_format=F.KV_FORMAT)
    assert dispatch.choose(sm90).kernel == "gluon_ws_small_fp8"
    assert dispatch.choose(replace(sm90, arch="gfx950")).kernel == "triton_fp8"
    with pytest.raises(ValueError, match="triton kernel cannot run this call: reads a dense"):
        sparse_mla_prefill(*case.args(), config=dispatch.Choice("triton"))
    dense = torch.randn(8, 512).bfloat16()
    bf16_call = dispatch.Call(None, 16, 512, torch.bfloat16, dense)
    assert dispatch.choose(bf16_call).kernel == "triton"
    assert "FP8" in dispatch.kernel("triton_fp8").why_not(bf16_call)
    assert "FP8" in dispatch.kernel("triton_fp8").unavailable(bf16_call)
    with pytest.raises(ValueError, match="triton_fp8 kernel cannot run this call"):
        sparse_mla_prefill(case.q, dense, case.kv_indices.clamp(0, 7), case.kv_indptr, 0.1,
                           config=dispatch.Choice("triton_fp8"))  # fmt: skip
    lines = dispatch.describe(None, 16, 512, kv_format=F.KV_FORMAT, verbose=True).splitlines()
    assert lines[0] == "CPU (interpreter) H=16 D=512: triton_fp8 (no tuned entry)"
    assert len(lines) == 1 + len(dispatch.KERNELS)


def test_raw_fp8_tensor_and_other_device_are_named():
    case = make_fp8_case(2, 16, num_blocks=2, block_size=4, seed=6)
    raw = case.cache.data[0, :, 0]  # [block_size, 584] float8_e4m3fn: not a dense pool
    with pytest.raises(TypeError, match=re.escape("as sparse_mla.FP8Cache(data, block_size)")):
        sparse_mla_prefill(case.q, raw, *case.args()[2:])
    with pytest.raises(ValueError, match="kv is on cpu but q is on meta"):
        sparse_mla_prefill(case.q.to("meta"), *case.args()[1:])


def _overlapping_out(case):
    first_block = case.cache.as_bytes()[0, : 2 * 16 * 512 * 2]  # contiguous bytes
    return first_block.view(torch.bfloat16).view(2, 16, 512)


@pytest.mark.parametrize(
    ("change", "exc", "needle"),
    [
        (lambda c: {"q": c.q.half()}, TypeError, "q must be bfloat16"),
        (lambda c: {"q": c.q.float()}, TypeError, "q must be bfloat16"),
        (lambda c: {"q": torch.zeros(2, 16, 576, dtype=torch.bfloat16)}, ValueError, "512"),
        (lambda c: {"kv_indices": c.kv_indices.float()}, TypeError, "kv_indices"),
        (lambda c: {"kv_indptr": c.kv_indptr[:-1]}, ValueError, "kv_indptr must have T\\+1"),
        (lambda c: {"kv_indptr": c.kv_indptr.flip(0)}, ValueError, "non-decreasing"),
        (lambda c: {"attn_sink": torch.zeros(3)}, ValueError, "attn_sink"),
        (lambda c: {"softmax_scale": float("nan")}, ValueError, "softmax_scale"),
        (lambda c: {"out": torch.zeros(2, 16, 512)}, TypeError, "out dtype"),
        (lambda c: {"out": _overlapping_out(c)}, ValueError, "out overlaps kv"),
        (lambda c: {"config": {"EVEN_HD": True, "BLOCK_H": 32}}, ValueError, "EVEN_HD"),
    ],
)
def test_bad_input_is_named_and_out_untouched(change, exc, needle):
    case = make_fp8_case(2, 16, num_blocks=2, block_size=64, seed=2)
    kw = dict(q=case.q, kv=case.cache, kv_indices=case.kv_indices, kv_indptr=case.kv_indptr,
              softmax_scale=case.softmax_scale, attn_sink=case.attn_sink,
              out=torch.full_like(case.q, float("nan")))  # fmt: skip
    kw.update(change(case))
    before = kw["out"].clone()
    snapshot = case.cache.as_bytes().clone()
    with pytest.raises(exc, match=needle):
        sparse_mla_prefill(**kw)
    assert torch.equal(kw["out"].view(torch.int16), before.view(torch.int16))
    assert torch.equal(case.cache.as_bytes(), snapshot)


@triton.jit
def _decode_all(b_ptr, out_ptr, scale_out_ptr):
    offs = tl.arange(0, 256)
    b = tl.load(b_ptr + offs)
    tl.store(out_ptr + offs, _decode_e4m3fn(b))
    tl.store(scale_out_ptr + offs, _decode_ue8m0(b))


def test_kernel_decode_of_every_byte():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = torch.empty(256)
    scales = torch.empty(256)
    runtime.launch(_decode_all, (1,), codes, got, scales, interpret=True)
    want = codes.view(torch.float8_e4m3fn).float()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    ok = ~torch.isnan(want)
    assert torch.equal(got[ok], want[ok])
    assert torch.equal(torch.signbit(got[ok]), torch.signbit(want[ok]))  # -0 stays -0
    e = torch.arange(1, 255)
    assert torch.equal(scales[1:255], torch.exp2(e.double() - 127).float())
    assert torch.isnan(scales[255])


@pytest.mark.parametrize("target", ["gfx942", "gfx950", "sm90"])
def test_cross_compiles_with_isa_and_registers(target):
    from sparse_mla import inspect as si

    name, res = si.compile_kernel("triton_fp8", target, num_heads=16)
    assert name == "triton_fp8" and res.kernel_name.startswith("_sparse_mla_prefill_fp8")
    rows = dict(res.resources.as_rows())
    if target.startswith("gfx"):
        assert rows["arch VGPRs"] > 0 and "mfma" in res.isa
        assert rows["scratch bytes"] == 0, "the default launch spills (fp8_prefill.default_config)"
        # The byte decode is integer arithmetic: no fp8 conversion (gfx942's would be FNUZ).
        assert "cvt_f32_fp8" not in res.isa and "cvt_pk_f32_fp8" not in res.isa
    else:
        assert rows["registers"] > 0 and "HMMA" in res.isa
        assert "e4m3" not in res.asm["ptx"]
    assert res.mix["global_load"] > 0


@pytest.mark.parametrize(
    ("H", "config", "dense"),
    [
        (16, None, False),  # two producers of 128 registers, one head group
        (32, None, False),  # two head groups, a 2-tile ring
        (16, {"PRODUCERS": 3, "PRODUCER_REGS": 112}, False),
        (16, {"PRODUCERS": 1, "PRODUCER_REGS": 256, "PIPELINE": True}, False),
        (16, None, 1),  # dense ids
        (32, None, 2),  # dense ids with the rows' lengths
        (16, {"PRODUCERS": 1, "PRODUCER_REGS": 256, "PIPELINE": True}, 2),
    ],
)
def test_gluon_fp8_kernel_cross_compiles_without_spills(H, config, dense):
    from sparse_mla import inspect as si
    from sparse_mla.gluon.launch_fp8 import FP8SmallConfig

    cfg = None if config is None else FP8SmallConfig(HEAD_GROUPS=1 if H <= 16 else 2, **config)
    if dense:  # the dense builds: the kernel's own compile_args (inspect compiles CSR launches)
        k = dispatch.kernel("gluon_ws_small_fp8")
        kernel, sig, consts, opts = k.compile_args("sm90", num_heads=H, config=cfg, dense=dense)
        assert consts["DENSE_IDS"] == (True if dense == 1 else 2)
        name, res = k.name, si.compile(kernel, si.get_target("sm90"), consts, opts, sig)
    else:
        name, res = si.compile_kernel("gluon_ws_small_fp8", "sm90", num_heads=H, config=cfg)
    rows = dict(res.resources.as_rows())
    assert name == "gluon_ws_small_fp8" and "HGMMA" in res.isa
    assert rows["local bytes"] == 0 and rows["stack bytes"] == 0, "the producer spills"
    # The dequantization: a byte permute and bf16x2 multiplies, no fp8 conversion instruction.
    assert "PRMT" in res.isa and "HMUL2.BF16" in res.isa and "e4m3" not in res.asm["ptx"]


def test_gluon_fp8_config_checks():
    from sparse_mla.gluon.launch_fp8 import FP8SmallConfig as C

    C().validate()
    C(HEAD_GROUPS=2).validate()
    for bad, needle in [
        (C(STAGES=4), "STAGES must be 2 or 3"),
        (C(HEAD_GROUPS=2, STAGES=3), "shared memory"),
        (C(PRODUCERS=4), "PRODUCERS must be 1, 2 or 3"),
        (C(PRODUCERS=3, PRODUCER_REGS=112, STAGES=2), "at least as many ring tiles"),
        (C(HEAD_GROUPS=2, PRODUCER_REGS=152), "it needs 240 at HEAD_GROUPS=2"),
        (C(PIPELINE=True), "PIPELINE needs PRODUCERS=1"),
        (C(PRODUCER_REGS=100), "multiple of 8"),
    ]:
        with pytest.raises(ValueError, match=needle):
            bad.validate()


# gluon_ws_fp8: gluon_ws's consumers fed by an FP8 producer (hopper_ws_fp8.py)


@pytest.mark.parametrize(("H", "ix", "ahead"), [(64, "int32", None), (128, "int64", 3)])
def test_gluon_ws_fp8_cross_compiles_without_spills(H, ix, ahead):
    """The default launch with int32 CSR ids (4 pieces ahead) and 3 ahead with int64 ids: the
    register split 224 / 192 / 88 (consumer 0, consumer 1, the producer), no local memory in
    any partition, gluon_ws's wgmmas, the dequantization without an fp8 conversion, Q and O by
    TMA and no cp.async (the producer stores from registers)."""
    from sparse_mla import inspect as si
    from sparse_mla.gluon.launch_fp8 import FP8WSConfig

    cfg = None if ahead is None else FP8WSConfig(AHEAD=ahead)
    name, res = si.compile_kernel("gluon_ws_fp8", "sm90", num_heads=H, index_dtype=ix,
                                  config=cfg)  # fmt: skip
    assert name == "gluon_ws_fp8" and res.kernel_name.startswith("_prefill_ws_fp8")
    assert res.resources.partitions == [("default", 4, 224), ("worker 0", 4, 192),
                                        ("worker 1", 4, 88)]  # fmt: skip
    rows = dict(res.resources.as_rows())
    assert rows["local bytes"] == 0 and rows["stack bytes"] == 0, rows
    assert si.partition_counts(res.isa, "STL") == {}  # no spill stores in any partition
    assert res.resources.shared_bytes <= 227 * 1024
    ptx = res.asm["ptx"]
    assert "HGMMA.64x64x16.F32.BF16" in res.isa and "HGMMA.64x256x16.F32.BF16" in res.isa
    assert "PRMT" in res.isa and "HMUL2.BF16" in res.isa and "e4m3" not in ptx
    assert "cp.async.bulk.tensor" in ptx and "cp.async.cg" not in ptx
    # The gather: 16-byte loads of the rows' chunks and 4-byte loads of a half's scales, no
    # one-byte scale loads.
    assert "ld.global.v4.b32" in ptx and "ld.global.u8" not in ptx and "ld.global.b8" not in ptx


def test_gluon_ws_fp8_config_checks_and_knobs():
    from sparse_mla.gluon import hopper_ws
    from sparse_mla.gluon.launch_fp8 import FP8WSConfig as C

    C().validate()
    assert (C().CONSUMER_REGS, C().PRODUCER_REGS, C().AHEAD) == (192, 88, 4)
    assert hopper_ws.register_split(192, 88) == (224, 192, 88)
    for bad, needle in [
        (C(AHEAD=0), "AHEAD must be an int in"),
        (C(AHEAD=9), "AHEAD must be an int in"),
        (C(AHEAD=True), "AHEAD must be an int in"),
        (C(PRODUCER_REGS=100), "multiple of 8"),
        (C(CONSUMER_REGS=True), "multiple of 8"),
        (C(PRODUCER_REGS=128), "consumer 0 would get 504 - 192 - 128 = 184"),
    ]:
        with pytest.raises(ValueError, match=needle):
            bad.validate()
    k = dispatch.kernel("gluon_ws_fp8")
    assert k.kv_format == F.KV_FORMAT and k.targets == ("sm90",) and k.dense_ids
    call = dispatch.Call("sm90", 64, 512, torch.bfloat16, kv_format=F.KV_FORMAT)
    for knob, values in k.knobs.items():  # every listed value is valid on the default launch
        for v in values:
            assert getattr(k.resolve({knob: v}, call), knob) == v
    with pytest.raises(ValueError, match="unknown field"):
        k.resolve({"STAGES": 2}, call)
    with pytest.raises(TypeError, match="FP8WSConfig or a dict"):
        k.resolve(3, call)


def test_gluon_ws_fp8_why_not_and_dispatch():
    """Where gluon_ws_fp8 cannot run, and the FP8 rule on sm90: the heads-on-N kernel up to 32
    heads and, below 128 tokens, up to 64; gluon_ws_fp8 above (H64 and H128 of a long prompt)."""
    from sparse_mla.gluon.launch_fp8 import FP8WSConfig

    k = dispatch.kernel("gluon_ws_fp8")
    sm90 = dispatch.Call("sm90", 64, 512, torch.bfloat16, kv_format=F.KV_FORMAT)
    assert k.why_not(sm90) is None
    for call, needle in [
        (replace(sm90, kv_format="dense"), "reads an FP8 KV cache (MODEL1 layout), not a dense"),
        (replace(sm90, arch=None), "need a GPU"),
        (replace(sm90, arch="gfx950"), "needs sm90"),
        (replace(sm90, arch="sm100"), "needs sm90"),
        (replace(sm90, head_dim=576), "needs head_dim 512"),
        (replace(sm90, dtype=torch.float16), "takes bf16 queries"),
    ]:
        assert needle in k.why_not(call), (call, k.why_not(call))
    case = make_fp8_case(2, 64, num_blocks=2, block_size=4, seed=1)
    assert "need a GPU" in k.why_not(replace(sm90, kv=case.cache))  # CPU tensors
    for H, T, want in [
        (64, None, "gluon_ws_fp8"),
        (64, 16384, "gluon_ws_fp8"),
        (128, 16384, "gluon_ws_fp8"),
        (128, 1024, "gluon_ws_fp8"),
        (128, 64, "gluon_ws_fp8"),
        (33, 128, "gluon_ws_fp8"),
        (64, 1024, "gluon_ws_fp8"),
        (64, 127, "gluon_ws_small_fp8"),
        (32, 16384, "gluon_ws_small_fp8"),
        (16, 16384, "gluon_ws_small_fp8"),
    ]:
        got = dispatch.choose(replace(sm90, num_heads=H, num_tokens=T))
        assert got.kernel == want, (H, T, got)
    forced = dispatch.choose(replace(sm90, num_heads=16), config=FP8WSConfig(AHEAD=2))
    assert forced.kernel == "gluon_ws_fp8" and forced.launch == FP8WSConfig(AHEAD=2)
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['AHEAD'\]"):  # a dict: Triton's
        dispatch.choose(sm90, config={"AHEAD": 2})
    line = dispatch.describe("sm90", 128, 512, num_tokens=16384, kv_format=F.KV_FORMAT)
    assert ": gluon_ws_fp8 (rule for sm90 H=128" in line


def _on(case: FP8Case, device, lead_bytes: int = 0) -> FP8Case:
    """The case on ``device``, its cache (poison included) copied to a byte offset past
    ``lead_bytes`` of a larger 0xFF buffer, the padded block stride kept."""
    bs, nb = case.cache.block_size, case.cache.num_blocks
    bb = F.block_bytes(bs)
    lead = -(-lead_bytes // bb) + 1
    buf = torch.full(((lead + nb + 1) * bb,), 0xFF, dtype=torch.uint8, device=device)
    blocks = buf.view(lead + nb + 1, bb)[lead : lead + nb, : bs * 584]
    blocks.copy_(case.cache.as_bytes())
    cache = FP8Cache(blocks.view(torch.float8_e4m3fn).view(nb, bs, 1, 584), bs)
    assert cache.data.data_ptr() - buf.data_ptr() >= lead_bytes and cache.block_stride == bb
    sink = None if case.attn_sink is None else case.attn_sink.to(device)
    return FP8Case(case.q.to(device), cache, case.kv_indices.to(device),
                   case.kv_indptr.to(device), case.softmax_scale, sink)  # fmt: skip


def test_cache_moved_inside_a_larger_buffer():
    case = make_fp8_case(3, 16, num_blocks=3, block_size=4, seed=8)
    moved = _on(case, "cpu", lead_bytes=10_000)
    a = _check(case)
    b = _check(moved, out=torch.full_like(case.q, float("nan")))
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))


# Every registered kernel that reads the FP8 cache and the default choice: the GPU tests run
# each (config=Choice(name)); a kernel the GPU cannot run is skipped with its reason.
FP8_KERNELS = sorted(n for n, k in dispatch.KERNELS.items() if k.kv_format == F.KV_FORMAT)


def _gpu_config(kernel):
    if kernel is None:
        return {}
    arch = runtime.arch(0)
    why = dispatch.kernel(kernel).why_not(
        dispatch.Call(arch, 16, 512, torch.bfloat16, kv_format=F.KV_FORMAT)
    )
    if why:
        pytest.skip(f"{kernel} on {arch}: {why}")
    return {"config": dispatch.Choice(kernel)}


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", [None, *FP8_KERNELS])
@pytest.mark.parametrize("H", [1, 8, 16, 17, 32, 64, 128])
@pytest.mark.parametrize("block_size", [2, 3, 64, 256])
def test_gpu_matches_reference(kernel, H, block_size):
    kw = _gpu_config(kernel)
    for index_dtype, sink in ((torch.int32, True), (torch.int64, False)):
        case = make_fp8_case(40, H, num_blocks=max(3, 1200 // block_size), block_size=block_size,
                             max_slots=300, index_dtype=index_dtype, sink=sink,
                             seed=7 * H + block_size)  # fmt: skip
        case = _on(case, "cuda")
        first = _check(case, out=torch.full_like(case.q, float("nan")), **kw)
        again = sparse_mla_prefill(*case.args(), attn_sink=case.attn_sink, **kw)
        assert torch.equal(first.view(torch.int16), again.view(torch.int16)), "bitwise repeats"


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", FP8_KERNELS)
@pytest.mark.parametrize("scale", [-0.05, 0.0])
def test_gpu_a_scale_of_zero_or_below(kernel, scale):
    # gluon_ws_fp8's consumers fold a positive scale into the exponent; other scales take
    # the path that scales the tile first (max(s) x c is not max(s x c) for c <= 0).
    kw = _gpu_config(kernel)
    for H in (16, 64, 128):
        case = make_fp8_case(40, H, num_blocks=20, block_size=64, max_slots=300, seed=H)
        _check(replace(_on(case, "cuda"), softmax_scale=scale),
               out=torch.full_like(case.q, float("nan"), device="cuda"), **kw)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", FP8_KERNELS)
def test_gpu_long_lists_and_a_cache_past_2gib(kernel):
    kw = _gpu_config(kernel)
    # T of 1-3 with long lists (decode-like calls), the cache starting past byte 2**31.
    for T in (1, 2, 3):
        case = make_fp8_case(T, 16, num_blocks=80, block_size=64, max_slots=4000,
                             index_dtype=torch.int64, seed=T)  # fmt: skip
        _check(_on(case, "cuda"), out=None, **kw)
    case = make_fp8_case(6, 64, num_blocks=8, block_size=64, max_slots=400, seed=9)
    _check(_on(case, "cuda", lead_bytes=2**31 + 4096), out=None, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", FP8_KERNELS)
def test_gpu_out_views_and_empty_tokens(kernel):
    """out= views with strided rows, 80 bytes (aligned) and 8 bytes (not: a buffer and a copy)
    into wider NaN-poisoned rows; at T = 33 each of gluon_ws_fp8's programs runs one item (its
    consumers store O themselves), at T = 300 items follow (O by TMA)."""
    kw = _gpu_config(kernel)
    for T, col in ((33, 40), (33, 4), (300, 40), (300, 4)):
        case = make_fp8_case(T, 20, num_blocks=40, block_size=64, max_slots=200, seed=5 + T)
        case = _on(case, "cuda")
        big = torch.full((T, 24, 600), float("nan"), dtype=torch.bfloat16, device="cuda")
        view = big[:, 2:22, col : col + 512]  # strided rows, offset columns
        _check(case, out=view, **kw)
        assert torch.isnan(big[:, :2]).all() and torch.isnan(big[:, 22:]).all(), "wrote outside"
        assert torch.isnan(big[..., :col]).all() and torch.isnan(big[..., col + 512 :]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", [None, *FP8_KERNELS])
@pytest.mark.parametrize("H", [16, 64, 128])
def test_gpu_dense_ids(kernel, H):
    """Dense [T, K] ids (kv_indptr None) with -1 padding and invalid ids: gluon_ws_fp8 reads
    them as they are (DENSE_IDS), the others get their CSR form; right against the reference."""
    kw = _gpu_config(kernel)
    case = make_fp8_case(37, H, num_blocks=20, block_size=64, max_slots=10, seed=H)
    g = torch.Generator().manual_seed(H)
    n = case.cache.num_slots
    v = case.kv_indices.long()
    used = v[(v >= 0) & (v < n)].unique()  # make_fp8_case poisons every other slot
    ids = used[torch.randint(0, used.numel(), (37, 150), generator=g)]
    ids[torch.rand(ids.shape, generator=g) < 0.2] = -1
    ids[torch.rand(ids.shape, generator=g) < 0.05] = n
    ids[3] = -1  # a token with no valid slot
    c = _on(case, "cuda")
    ids = ids.to(torch.int32).cuda()
    out = sparse_mla_prefill(c.q, c.cache, ids, None, c.softmax_scale, attn_sink=c.attn_sink,
                             **kw)  # fmt: skip
    assert not torch.isnan(out).any(), "a poisoned row was read"
    rows = F.dequantize(c.cache)
    rep = check_against_reference(out, c.q, rows, ids, None, c.softmax_scale,
                                  attn_sink=c.attn_sink)  # fmt: skip
    assert rep.ok, str(rep)
    assert torch.all(out[3] == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", [None, *FP8_KERNELS])
@pytest.mark.parametrize("H", [64, 128])
def test_gpu_large_calls(kernel, H):
    """A call whose slot lists exceed the small-call order's share (gluon_ws_fp8 then runs the
    order every long prefill runs: hopper_ws.small_call is False), odd tile counts and empty
    tokens included."""
    from sparse_mla.gluon import hopper_ws

    kw = _gpu_config(kernel)
    case = make_fp8_case(1200, H, num_blocks=64, block_size=64, max_slots=1000, seed=H + 1)
    assert not hopper_ws.small_call(case.kv_indices.numel(), 132)
    _check(_on(case, "cuda"), out=None, **kw)
