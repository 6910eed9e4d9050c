"""Triton sparse MLA prefill straight from the FP8 KV cache (MODEL1 layout): kernel -> launcher
-> validated entry -> registry entry ``triton_fp8``.

The kernel is :mod:`sparse_mla.prefill`'s Triton kernel (one program per token and head block,
online softmax, sink, CSR) with one change: the KV load. Per slot it gathers the token's 576
bytes of [NoPE | RoPE] and its 8 scale bytes (:mod:`sparse_mla.fp8` has the layout) and builds
the 512-wide bf16 row in registers, as a [BLOCK_K, 8, 64] tile: chunks 0-6 are the NoPE tiles
(e4m3fn bytes x their ue8m0 scale), chunk 7 is the RoPE part (bf16 as stored). The row is then
exactly :func:`sparse_mla.fp8.dequantize`'s, so S = Q K^T and P V see the same bf16 operands as
the bf16 kernel on the dequantized pool, and the same error rule holds.

FP8 decode, and what gfx942 needs. The cache holds OCP e4m3fn bytes (bias 7, no infinities,
0x7F/0xFF are NaN, largest 448). gfx950 and Hopper convert that format natively, but gfx942
(MI300) has only the FNUZ variant e4m3fnuz (bias 8, 0x80 is the only NaN, no negative zero),
whose instructions would decode every OCP byte wrong by a factor of two (and 0x80, OCP's -0,
as NaN). So the kernel decodes the byte in integer arithmetic, the same code on every target:
sign, exponent and mantissa go into fp32 bits ((e + 120) << 23 | m << 20) for normals,
m x 2^-9 for subnormals, NaN for 0x7F/0xFF; the ue8m0 scale byte E becomes fp32 bits E << 23.
It costs a few integer ALU ops per byte and no conversion instruction; it never produces an
fp32 denormal (products of normals >= 2^-22), so a flush-to-zero mode cannot change it, and it
runs unchanged in Triton's CPU interpreter. The alternative, bitcasting the bytes to
``tl.float8e4nv`` and casting, would use the native converts on sm90 and gfx950 (two values per
instruction) and, on gfx942, the software emulation Triton 3.6's AMD backend supplies for OCP
fp8 before CDNA4 (``HIPOptions.supported_fp8_dtypes``); it is not chosen here because the one
integer path is the same code on every target and in the interpreter, and spells out the NaN
bytes. Whether the native convert is faster on a GPU is not measured yet.

Why a module of its own: the kernel differs from the bf16 one only in ``_load_fp8_tile``, but
:mod:`sparse_mla.prefill` is shared by other work in progress; this keeps the FP8 path's
change to the public entry to one branch and to the dispatch to a pool-format field. Folding
both kernels behind a constexpr load strategy is a later, mechanical step.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
import triton
import triton.language as tl

from . import dispatch, fastlaunch, runtime
from .configs import PrefillConfig
from .fp8 import D_NOPE, HEAD_DIM, KV_FORMAT, NUM_TILES, ROW_BYTES, TILE, FP8Cache
from .prefill import (
    _LOG2E,
    _csr_for,
    _fold_sink,
    _mma,
    _no_sink,
    _round_to,
    _softmax_tile,
    resolve_config,
)  # fmt: skip
from .prefill import default_config as prefill_default_config
from .validation import (
    _shares_memory,
    _slot_lists,
    dense_form,
    length_bound,
    planned_nnz,
    validate_inputs,
)

__all__ = ["NAME", "compile_args", "default_config", "sparse_mla_prefill_fp8"]

NAME = "triton_fp8"
_CHUNKS = HEAD_DIM // TILE  # 8: seven NoPE tiles and the RoPE part
# The kernel spells the layout as literals: 576-byte rows (448 NoPE bytes, then 64 bf16), 8
# scale bytes a token, 8 chunks of 64 values a row.
assert NUM_TILES == _CHUNKS - 1 and D_NOPE == NUM_TILES * TILE and ROW_BYTES == 576


@triton.jit
def _decode_e4m3fn(b):
    """OCP e4m3fn bytes (uint8) -> fp32, in integer arithmetic (portable; see module doc)."""
    b = b.to(tl.uint32)
    e = (b >> 3) & 0xF
    m = b & 0x7
    sign = (b >> 7) << 31
    normal = (sign | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125  # m x 2^-9, then the sign bit (-0 stays -0)
    sub = (sub.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    x = tl.where(e == 0, sub, normal)
    return tl.where((b & 0x7F) == 0x7F, float("nan"), x)


@triton.jit
def _decode_ue8m0(e):
    """ue8m0 scale bytes (uint8) -> fp32 2^(E - 127); 255 is NaN, 0 (never written) is 0."""
    e = e.to(tl.uint32)
    x = (e << 23).to(tl.float32, bitcast=True)
    return tl.where(e == 255, float("nan"), x)


@triton.jit
def _load_fp8_tile(
    cache_ptr, idx_ptr, offs_s, end, num_slots, block_size, stride_block, BLOCK_K: tl.constexpr
):
    """Slot ids at positions offs_s [BLOCK_K] and their dequantized rows [BLOCK_K, 512] (bf16);
    invalid slots -> 0 and their bytes are never read."""
    in_row = offs_s < end
    slot = tl.load(idx_ptr + offs_s, mask=in_row, other=-1).to(tl.int64)
    valid = in_row & (slot >= 0) & (slot < num_slots)  # [BLOCK_K]
    slot = tl.where(valid, slot, 0)
    blk = slot // block_size
    tok = slot - blk * block_size
    row = blk * stride_block + tok * 576  # [BLOCK_K] byte offset of [NoPE | RoPE]
    scl = blk * stride_block + block_size * 576 + tok * 8  # [BLOCK_K] byte offset of scales
    offs_c = tl.arange(0, 8)  # chunk: 0-6 NoPE tiles, 7 RoPE
    offs_j = tl.arange(0, 64)
    is_nope = offs_c < 7
    nope_ptrs = cache_ptr + row[:, None, None] + offs_c[None, :, None] * 64 + offs_j[None, None, :]
    nope = tl.load(nope_ptrs, mask=valid[:, None, None] & is_nope[None, :, None], other=0)
    scale = tl.load(
        cache_ptr + scl[:, None] + offs_c[None, :], mask=valid[:, None] & is_nope[None, :], other=0
    )  # [BLOCK_K, 8] uint8
    rope_ptrs = (cache_ptr + row + 448).to(tl.pointer_type(tl.bfloat16))  # [BLOCK_K]
    rope = tl.load(rope_ptrs[:, None] + offs_j[None, :], mask=valid[:, None], other=0.0)
    x = _decode_e4m3fn(nope) * _decode_ue8m0(scale)[:, :, None]  # [BLOCK_K, 8, 64]
    x = tl.where(is_nope[None, :, None], x, rope.to(tl.float32)[:, None, :])
    x = tl.where(valid[:, None, None], x, 0.0)
    kv = tl.reshape(x, (BLOCK_K, 512)).to(tl.bfloat16)  # exact: 4 significant bits x 2^k
    return kv, valid


@triton.jit(do_not_specialize=["nnz"])
def _sparse_mla_prefill_fp8_kernel(
    q_ptr,  # [T, H, 512] bf16
    cache_ptr,  # [num_blocks, block bytes] uint8, MODEL1 layout
    idx_ptr,  # [nnz] int32 | int64
    indptr_ptr,  # [T + 1]
    sink_ptr,  # [H] fp32 (unused without HAS_SINK)
    out_ptr,  # [T, H, 512] bf16
    stride_qt,
    stride_qh,
    stride_block,  # bytes from one block to the next
    stride_ot,
    stride_oh,
    num_heads,
    block_size,
    num_slots,  # num_blocks x block_size: slot s is valid iff 0 <= s < num_slots
    nnz,
    qk_scale,  # softmax_scale, times log2(e) under USE_EXP2
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_SINK: tl.constexpr,
    EVEN_HD: tl.constexpr,  # H % BLOCK_H == 0 (the head dim is always 512 = BLOCK_D)
    USE_EXP2: tl.constexpr,
    PREFETCH_KV: tl.constexpr,
    INTERP_BF16: tl.constexpr,
):
    pid_t = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1)

    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    offs_d = tl.arange(0, 512)  # [BLOCK_D]
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]

    q_ptrs = q_ptr + pid_t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :]
    if EVEN_HD:
        q = tl.load(q_ptrs)  # [BLOCK_H, 512]
    else:
        mask_h = offs_h[:, None] < num_heads
        q = tl.load(q_ptrs, mask=mask_h, other=0.0)

    # Clamped as in the bf16 kernel: no kv_indptr, checked or not, reads outside kv_indices.
    start = tl.load(indptr_ptr + pid_t).to(tl.int64)
    end = tl.load(indptr_ptr + pid_t + 1).to(tl.int64)
    start = tl.minimum(tl.maximum(start, 0), nnz)
    end = tl.minimum(tl.maximum(end, start), nnz)
    num_k = (end - start).to(tl.int32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, 512], dtype=tl.float32)

    if PREFETCH_KV:
        kv_next, valid_next = _load_fp8_tile(
            cache_ptr, idx_ptr, start + offs_k, end, num_slots, block_size, stride_block, BLOCK_K
        )
    for k0 in range(0, num_k, BLOCK_K):
        if PREFETCH_KV:
            kv, valid = kv_next, valid_next
            kv_next, valid_next = _load_fp8_tile(
                cache_ptr, idx_ptr, start + (k0 + BLOCK_K) + offs_k, end, num_slots, block_size,
                stride_block, BLOCK_K,
            )  # fmt: skip
        else:
            kv, valid = _load_fp8_tile(
                cache_ptr, idx_ptr, start + k0 + offs_k, end, num_slots, block_size, stride_block,
                BLOCK_K,
            )  # fmt: skip

        qk = tl.zeros([BLOCK_H, BLOCK_K], dtype=tl.float32)
        qk = _mma(q, tl.trans(kv), qk, INTERP_BF16) * qk_scale  # [BLOCK_H, BLOCK_K]
        qk = tl.where(valid[None, :], qk, float("-inf"))

        p, alpha, l_i, m_i = _softmax_tile(qk, m_i, l_i, USE_EXP2)
        acc = acc * alpha[:, None]
        acc = _mma(_round_to(p, tl.bfloat16, INTERP_BF16), kv, acc, INTERP_BF16)  # [BLOCK_H, 512]

    if HAS_SINK:
        acc, l_i = _fold_sink(acc, m_i, l_i, sink_ptr, offs_h, num_heads, EVEN_HD, USE_EXP2)
    # A token with no valid slot has acc == 0; keep it 0 (not 0/0) with or without a sink.
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = _round_to(acc / l_safe[:, None], tl.bfloat16, INTERP_BF16)

    out_ptrs = out_ptr + pid_t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    if EVEN_HD:
        tl.store(out_ptrs, o)
    else:
        tl.store(out_ptrs, o, mask=offs_h[:, None] < num_heads)


# ----------------------------------------------------------------------------------------------
# Launcher and entry
# ----------------------------------------------------------------------------------------------


def _even_hd(cfg: PrefillConfig, num_heads: int) -> bool:
    return num_heads % cfg.BLOCK_H == 0 if cfg.EVEN_HD is None else cfg.EVEN_HD


def _constexprs(cfg: PrefillConfig, num_heads: int, *, has_sink: bool, interp_bf16: bool):
    return {
        "BLOCK_H": cfg.BLOCK_H,
        "BLOCK_K": cfg.BLOCK_K,
        "HAS_SINK": has_sink,
        "EVEN_HD": _even_hd(cfg, num_heads),
        "USE_EXP2": cfg.USE_EXP2,
        "PREFETCH_KV": cfg.PREFETCH_KV,
        "INTERP_BF16": interp_bf16,
    }


def _run(q, cache: FP8Cache, kv_indices, kv_indptr, softmax_scale, attn_sink, out, cfg,
         nnz=None):  # fmt: skip
    """Launch on validated inputs (T > 0, at least one block): compiled, through the direct
    path (:mod:`sparse_mla.fastlaunch`, as the bf16 Triton kernel), or interpreted. ``nnz``
    plans nothing here (one program per token and head block)."""
    T, H, _ = q.shape
    interpret = runtime.runs_interpreted(q)
    has_sink = attn_sink is not None
    sink = attn_sink if has_sink else _no_sink(q.device)
    qk_scale = float(softmax_scale) * (_LOG2E if cfg.USE_EXP2 else 1.0)
    kw = _launch_kwargs(cfg, H, has_sink, interpret)
    grid = (T, runtime.cdiv(H, cfg.BLOCK_H))
    (qs0, qs1, _), (os0, os1, _) = q.stride(), out.stride()
    args = (q, cache.kernel_bytes(), kv_indices, kv_indptr, sink, out, qs0, qs1,
            cache.block_stride, os0, os1, H, cache.block_size, cache.num_slots,
            kv_indices.numel(), qk_scale)  # fmt: skip
    if interpret:
        runtime.launch(_sparse_mla_prefill_fp8_kernel, grid, *args, interpret=True, **kw)
    else:  # kw is _launch_kwargs' cached dict: the direct launch keys on its identity
        fastlaunch.launcher(_sparse_mla_prefill_fp8_kernel)(grid, args, kw)
    return out


@functools.lru_cache(maxsize=1024)
def _launch_kwargs(cfg: PrefillConfig, H: int, has_sink: bool, interpret: bool) -> dict:
    """The constexprs and options of a launch (cached: they depend on no tensor; never
    changed after)."""
    options = cfg.compile_options("hip" if not interpret and runtime.is_amd() else "cuda")
    return {**_constexprs(cfg, H, has_sink=has_sink, interp_bf16=interpret), **options}


def default_config(num_heads: int) -> PrefillConfig:
    """The launch without ``config=``: the bf16 kernel's default with BLOCK_K = 16.

    The dequantized [BLOCK_K, 8, 64] fp32 tile and its byte decode cost registers the bf16
    kernel does not spend. Cross-compiled at H=16 (compile only, nothing timed): BLOCK_K 32
    spills on sm90 (384 stack bytes at 255 registers) and needs 256 VGPRs + 183 AGPRs on
    gfx942; BLOCK_K 16 compiles without scratch on gfx942 (256 + 65) and with 16 stack bytes on
    sm90. configs/ entries are the bf16 kernel's and are not read.
    """
    return replace(prefill_default_config(num_heads, HEAD_DIM), BLOCK_K=16)


def _resolve(launch, call: dispatch.Call) -> PrefillConfig:
    """The launch (None: :func:`default_config`), checked against the call's heads."""
    if launch is None:
        launch = default_config(call.num_heads)
    cfg = resolve_config(call.num_heads, HEAD_DIM, launch, None)
    if cfg.EVEN_HD and call.num_heads % cfg.BLOCK_H:
        raise ValueError(
            f"config: EVEN_HD needs H % BLOCK_H == 0; got H={call.num_heads}, BLOCK_H={cfg.BLOCK_H}"
        )
    return cfg


def _unavailable(call: dispatch.Call) -> str | None:
    if call.kv_format != KV_FORMAT:
        return "reads an FP8 KV cache (sparse_mla.FP8Cache, MODEL1 layout), not a dense pool"
    if call.head_dim != HEAD_DIM:
        return f"needs head_dim {HEAD_DIM} (448 NoPE + 64 RoPE), got {call.head_dim}"
    if call.dtype is not None and call.dtype != torch.bfloat16:
        return f"takes bf16 queries, got {call.dtype}"
    return None


def compile_args(target: str, *, num_heads: int = 16, config=None, index_dtype=torch.int32,
                 has_sink: bool = True, **_ignored):  # fmt: skip
    """(kernel, signature, constexprs, options) to cross-compile the kernel for ``target`` as a
    launch at ``num_heads`` would (:func:`sparse_mla.inspect.compile_kernel`)."""
    from .targets import get_target

    t = get_target(target)
    cfg = _resolve(config, dispatch.Call(t.name, num_heads, HEAD_DIM, kv_format=KV_FORMAT))
    ix = "*i64" if index_dtype == torch.int64 else "*i32"
    sig = {
        "q_ptr": "*bf16",
        "cache_ptr": "*u8",
        "idx_ptr": ix,
        "indptr_ptr": ix,
        "sink_ptr": "*fp32",
        "out_ptr": "*bf16",
        "stride_qt": "i32",
        "stride_qh": "i32",
        "stride_block": "i64",
        "stride_ot": "i32",
        "stride_oh": "i32",
        "num_heads": "i32",
        "block_size": "i32",
        "num_slots": "i64",
        "nnz": "i32",
        "qk_scale": "fp32",
    }
    consts = _constexprs(cfg, num_heads, has_sink=has_sink, interp_bf16=False)
    return _sparse_mla_prefill_fp8_kernel, sig, consts, cfg.compile_options(t.backend)


def sparse_mla_prefill_fp8(
    q, cache: FP8Cache, kv_indices, kv_indptr, softmax_scale, *, attn_sink=None, out=None,
    config=None, validate=None, kv_lengths=None, max_kv_length=None,
):  # fmt: skip
    """:func:`sparse_mla.sparse_mla_prefill` with ``kv`` an :class:`~sparse_mla.fp8.FP8Cache`.

    Args:
        q: [T, H, 512] bf16 (448 NoPE + 64 RoPE).
        cache: the FP8 cache; slot s is valid iff 0 <= s < num_blocks x block_size.
        the rest: as :func:`sparse_mla.sparse_mla_prefill` (CSR, or dense [T, K] ids with
            ``kv_indptr=None`` and optionally their rows' ``kv_lengths`` and its bound
            ``max_kv_length``, which steers the kernel choice only; sink, ``out=``,
            validation; ``config`` a PrefillConfig / dict / ``dispatch.Choice``).

    Returns:
        out [T, H, 512] bf16: attention over the dequantized rows (:func:`sparse_mla.fp8.
        dequantize`); zeros for a token with no valid slot.
    """
    kv_indptr = _slot_lists(kv_indices, kv_indptr, kv_lengths)
    bound = length_bound(max_kv_length, kv_indices, kv_lengths)
    return _prefill_fp8(q, cache, kv_indices, kv_indptr, softmax_scale, attn_sink, out, config,
                        validate, bound)  # fmt: skip


def _prefill_fp8(q, cache, kv_indices, kv_indptr, softmax_scale, attn_sink, out, config,
                 validate, max_kv_length=None):  # fmt: skip
    """:func:`sparse_mla_prefill_fp8` on the op's form of the lists (dense rows' lengths in
    ``kv_indptr``'s place, :mod:`sparse_mla.validation`)."""
    x, choice = _checked(q, cache, kv_indices, kv_indptr, softmax_scale, attn_sink, out, config,
                         validate, max_kv_length)  # fmt: skip
    if out is None:
        out = torch.empty_like(x.q, memory_format=torch.contiguous_format)
    _launch(x, cache, choice, out)
    return out


def _checked(q, cache: FP8Cache, kv_indices, kv_indptr, softmax_scale, attn_sink, out, config,
             validate, max_kv_length=None):  # fmt: skip
    """The entry's checks (raising by name, in this order) and its kernel choice:
    (validated inputs, choice); ``max_kv_length`` bounds dense ids' lengths for the choice."""
    if isinstance(q, torch.Tensor) and q.dtype != torch.bfloat16:
        raise TypeError(f"q must be bfloat16 with an FP8 KV cache (RoPE is bf16), got {q.dtype}")
    if isinstance(q, torch.Tensor) and q.dim() == 3 and q.shape[-1] != HEAD_DIM:
        raise ValueError(
            f"q head dim must be {HEAD_DIM} (448 NoPE + 64 RoPE) with an FP8 KV cache, got "
            f"{q.shape[-1]}"
        )
    stub = _stub(cache.device)
    if isinstance(q, torch.Tensor) and cache.device != q.device:
        raise ValueError(f"kv is on {cache.device} but q is on {q.device}; devices must match")
    x = validate_inputs(
        q, stub, kv_indices, kv_indptr, softmax_scale, attn_sink=attn_sink, out=out,
        validate=validate,
    )  # fmt: skip
    if out is not None and out.numel() and _shares_memory(out, cache.data):
        raise ValueError("out overlaps kv; the kernel would read what it writes")
    q = x.q
    T, H, D = q.shape
    arch = None if runtime.runs_interpreted(q) else runtime.arch(q.get_device())
    nnz = planned_nnz(x.kv_indices, length_bound(max_kv_length, x.kv_indices, x.kv_indptr))
    lengths = dense_form(x.kv_indices, x.kv_indptr) == 2
    call = dispatch.Call(arch, H, D, q.dtype, cache, T, nnz, kv_format=KV_FORMAT,
                         dense_lengths=lengths)  # fmt: skip
    return x, dispatch.choose(call, config=config)


def _launch(x, cache: FP8Cache, choice: dispatch.Choice, out) -> None:
    """The chosen kernel's launch into ``out`` on checked inputs (:func:`_checked`)."""
    if out.numel() == 0:
        return
    if cache.num_slots == 0:
        out.zero_()
        return
    k = dispatch.kernel(choice.kernel)
    ids, ptr = _csr_for(k, x.kv_indices, x.kv_indptr)  # dense ids as CSR where k reads CSR only
    k.run(x.q, cache, ids, ptr, x.softmax_scale, x.attn_sink, out, choice.launch)


_STUBS: dict[torch.device, torch.Tensor] = {}


def _stub(device: torch.device) -> torch.Tensor:
    """An empty [0, 512] bf16 tensor standing for the pool in :func:`validate_inputs` (which
    checks the other arguments against it; the cache has checked itself): one per device, not
    kept when made inside a CUDA-graph capture."""
    t = _STUBS.get(device)
    if t is None:
        t = torch.empty(0, HEAD_DIM, dtype=torch.bfloat16, device=device)
        if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            _STUBS[device] = t
    return t
