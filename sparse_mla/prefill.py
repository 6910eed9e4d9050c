"""Triton sparse MLA prefill: kernel -> launch config -> input validation -> public entry ->
the kernels the entry can run (registered with :mod:`sparse_mla.dispatch`, which picks one).

One program owns one token and a block of BLOCK_H heads. It walks the token's slot list (its CSR
range, or under ``DENSE_IDS`` row t of the dense [T, K] ids, with no kv_indptr load; under
``DENSE_IDS`` = 2 only the row's first kv_lengths[t] ids, one load from the lengths) BLOCK_K
slots at a time: load the slot ids (the next tile's ids are fetched one iteration ahead), gather
the KV rows masked by validity, S = Q K^T, online softmax (running max ``m_i``, denominator
``l_i``, fp32 accumulator ``acc``), P cast to the KV dtype for P V. The sink joins the softmax at
the end as a virtual column whose value vector is zero; a token with no valid slot stores zeros.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from . import configs, dispatch, fastlaunch, op, runtime, validation
from .configs import PrefillConfig
from .fp8 import FP8Cache
from .validation import _dense_launch_csr, dense_lengths_csr, validate_inputs

__all__ = ["PrefillConfig", "default_config", "resolve_config", "sparse_mla_prefill"]

from ._consts import LOG2E as _LOG2E


@triton.jit
def _mma(a, b, acc, INTERP_BF16: tl.constexpr):
    # Triton 3.6's interpreter multiplies bf16 bit patterns in tl.dot (triton-lang/triton#11584).
    # Under INTERP_BF16 (set only for interpreted bf16 launches) the operands go to fp32 first,
    # which is what the GPU's bf16 MMA computes: exact products, fp32 accumulation.
    if INTERP_BF16:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _round_to(x, dtype: tl.constexpr, INTERP_BF16: tl.constexpr):
    # The 3.6 interpreter casts fp32 -> bf16 by truncation; the GPU rounds to nearest even.
    # Under INTERP_BF16 round in fp32 first (bit trick), so the truncating cast is exact.
    if INTERP_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _load_tile(
    kv_ptr, idx_ptr, offs_s, end, num_kv, stride_kvn, offs_d, head_dim, EVEN_HD: tl.constexpr
):
    """Slot ids at positions offs_s [BLOCK_K] and their rows [BLOCK_K, BLOCK_D]; invalid -> 0."""
    in_row = offs_s < end
    slot = tl.load(idx_ptr + offs_s, mask=in_row, other=-1).to(tl.int64)
    valid = in_row & (slot >= 0) & (slot < num_kv)  # [BLOCK_K]; invalid rows are never read
    kv_ptrs = kv_ptr + slot[:, None] * stride_kvn + offs_d[None, :]  # int64 offsets
    if EVEN_HD:
        kv = tl.load(kv_ptrs, mask=valid[:, None], other=0.0)
    else:
        kv = tl.load(kv_ptrs, mask=valid[:, None] & (offs_d[None, :] < head_dim), other=0.0)
    return kv, valid


@triton.jit
def _softmax_tile(qk, m_i, l_i, USE_EXP2: tl.constexpr):
    """One tile's online-softmax step over logits ``qk`` [BLOCK_H, BLOCK_K] (-inf where a slot
    is absent): (p, alpha, l_i, m_i) after it; the caller rescales its accumulator by alpha and
    adds p V. Shared by the bf16 and the FP8-cache Triton kernels."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))  # [BLOCK_H]
    # A row with no valid slot so far keeps m = -inf; shift by 0 so exp() sees -inf, not NaN.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    if USE_EXP2:
        alpha = tl.math.exp2(m_i - m_shift)
        p = tl.math.exp2(qk - m_shift[:, None])
    else:
        alpha = tl.exp(m_i - m_shift)
        p = tl.exp(qk - m_shift[:, None])
    return p, alpha, l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def _fold_sink(acc, m_i, l_i, sink_ptr, offs_h, num_heads, EVEN_HD: tl.constexpr,
               USE_EXP2: tl.constexpr):  # fmt: skip
    """Fold the sink, a virtual column with logit sink_h and a zero value vector, into the
    final (acc, l_i). Shared by the bf16 and the FP8-cache Triton kernels."""
    if EVEN_HD:
        sink = tl.load(sink_ptr + offs_h)
    else:
        sink = tl.load(sink_ptr + offs_h, mask=offs_h < num_heads, other=0.0)
    if USE_EXP2:
        sink = sink * 1.4426950408889634  # LOG2E (sparse_mla._consts)
    has_slot = m_i > float("-inf")
    m_fin = tl.where(has_slot, tl.maximum(m_i, sink), sink)
    # An empty token with a sink of -inf (or one that overflows to -inf once scaled) keeps
    # m = -inf: shift by 0 so alpha is 0, not exp(-inf + inf) = NaN.
    m_fin = tl.where(m_fin == float("-inf"), 0.0, m_fin)
    if USE_EXP2:
        alpha = tl.math.exp2(m_i - m_fin)
        l_i = l_i * alpha + tl.math.exp2(sink - m_fin)
    else:
        alpha = tl.exp(m_i - m_fin)
        l_i = l_i * alpha + tl.exp(sink - m_fin)
    # An empty token's acc is 0 and stays 0 whatever the sink (a NaN sink makes alpha NaN).
    return acc * tl.where(has_slot, alpha, 0.0)[:, None], l_i


@triton.jit(do_not_specialize=["nnz"])
def _sparse_mla_prefill_kernel(
    q_ptr,  # [T, H, D]
    kv_ptr,  # [N, D]
    idx_ptr,  # [nnz] int32 | int64 (DENSE_IDS: [T, ids_per_row], contiguous)
    indptr_ptr,  # [T + 1] (DENSE_IDS 1: unused; 2: the rows' lengths [T])
    sink_ptr,  # [H] fp32 (unused without HAS_SINK)
    out_ptr,  # [T, H, D]
    stride_qt,
    stride_qh,
    stride_kvn,
    stride_ot,
    stride_oh,
    num_heads,
    head_dim,
    num_kv,
    nnz,  # kv_indices.numel(): each token's CSR range is clamped to [0, nnz]
    qk_scale,  # softmax_scale, times log2(e) under USE_EXP2
    ids_per_row,  # DENSE_IDS: K, the dense ids' row length (CSR: 0, unused)
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SINK: tl.constexpr,
    EVEN_HD: tl.constexpr,
    USE_EXP2: tl.constexpr,
    PREFETCH_KV: tl.constexpr,
    INTERP_BF16: tl.constexpr,
    DENSE_IDS: tl.constexpr = False,  # 0/False: CSR; 1/True: dense rows; 2: with lengths
):
    pid_t = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1)

    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]

    q_ptrs = q_ptr + pid_t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :]
    if EVEN_HD:
        q = tl.load(q_ptrs)  # [BLOCK_H, BLOCK_D]
    else:
        mask_hd = (offs_h[:, None] < num_heads) & (offs_d[None, :] < head_dim)
        q = tl.load(q_ptrs, mask=mask_hd, other=0.0)

    if DENSE_IDS:
        # Dense ids: token t's list is row t of [T, K], known without a load.
        start = pid_t * ids_per_row
        end = start + ids_per_row
        if DENSE_IDS == 2:  # the row's first kv_lengths[t] ids, clamped to [0, K]
            n = tl.load(indptr_ptr + pid_t).to(tl.int64)
            end = start + tl.minimum(tl.maximum(n, 0), ids_per_row)
    else:
        # Clamped so that no kv_indptr, checked or not, reads outside kv_indices: a decreasing
        # pair or a range past nnz leaves the token the in-bounds part of its list (or nothing).
        start = tl.load(indptr_ptr + pid_t).to(tl.int64)
        end = tl.load(indptr_ptr + pid_t + 1).to(tl.int64)
        start = tl.minimum(tl.maximum(start, 0), nnz)
        end = tl.minimum(tl.maximum(end, start), nnz)
    num_slots = (end - start).to(tl.int32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)

    if PREFETCH_KV:
        kv_next, valid_next = _load_tile(
            kv_ptr, idx_ptr, start + offs_k, end, num_kv, stride_kvn, offs_d, head_dim, EVEN_HD
        )
    for k0 in range(0, num_slots, BLOCK_K):
        if PREFETCH_KV:
            # Issue the next tile's id and row loads before this tile's math, so the gather
            # latency hides behind the two MMAs (Triton 3.6 does not pipeline this gather).
            kv, valid = kv_next, valid_next
            offs_next = start + (k0 + BLOCK_K) + offs_k
            kv_next, valid_next = _load_tile(
                kv_ptr, idx_ptr, offs_next, end, num_kv, stride_kvn, offs_d, head_dim, EVEN_HD
            )
        else:
            kv, valid = _load_tile(
                kv_ptr, idx_ptr, start + k0 + offs_k, end, num_kv, stride_kvn, offs_d, head_dim,
                EVEN_HD,
            )  # fmt: skip

        qk = tl.zeros([BLOCK_H, BLOCK_K], dtype=tl.float32)
        qk = _mma(q, tl.trans(kv), qk, INTERP_BF16) * qk_scale  # [BLOCK_H, BLOCK_K]
        qk = tl.where(valid[None, :], qk, float("-inf"))

        p, alpha, l_i, m_i = _softmax_tile(qk, m_i, l_i, USE_EXP2)
        acc = acc * alpha[:, None]
        acc = _mma(_round_to(p, kv.dtype, INTERP_BF16), kv, acc, INTERP_BF16)  # [BLOCK_H, BLOCK_D]

    if HAS_SINK:
        acc, l_i = _fold_sink(acc, m_i, l_i, sink_ptr, offs_h, num_heads, EVEN_HD, USE_EXP2)
    # A token with no valid slot has acc == 0; keep it 0 (not 0/0) with or without a sink.
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]

    out_ptrs = out_ptr + pid_t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    if EVEN_HD:
        tl.store(out_ptrs, _round_to(o, out_ptr.dtype.element_ty, INTERP_BF16))
    else:
        mask_hd = (offs_h[:, None] < num_heads) & (offs_d[None, :] < head_dim)
        tl.store(out_ptrs, _round_to(o, out_ptr.dtype.element_ty, INTERP_BF16), mask=mask_hd)


# ----------------------------------------------------------------------------------------------
# Launch configuration
# ----------------------------------------------------------------------------------------------


# Triton's largest tensor (TRITON_MAX_TENSOR_NUMEL): bounds BLOCK_H x BLOCK_D and BLOCK_K x BLOCK_D.
MAX_TILE_ELEMENTS = 1 << 20


def default_config(num_heads: int, head_dim: int) -> PrefillConfig:
    """The launch used when configs/ has no entry for (arch, H, D) and none is given.

    BLOCK_H covers all heads up to 64 (each KV row is then gathered once per token), at least 16
    for tl.dot; BLOCK_K shrinks as the head block grows to bound the register tile.
    """
    block_h = max(16, min(64, triton.next_power_of_2(num_heads)))
    block_d = triton.next_power_of_2(head_dim)
    block_k = 32 if block_h * block_d <= 16 * 512 else 16
    num_warps = 4 if block_h <= 16 else 8
    return PrefillConfig(BLOCK_H=block_h, BLOCK_K=block_k, num_warps=num_warps, num_stages=2)


def resolve_config(
    num_heads: int,
    head_dim: int,
    config: PrefillConfig | dict[str, Any] | None = None,
    arch: str | None = None,
) -> PrefillConfig:
    """The launch for a call: ``config`` if given, else the tuned entry, else the default."""
    if config is None:
        found = configs.lookup(arch, num_heads, head_dim) if arch else None
        cfg = found if found is not None else default_config(num_heads, head_dim)
    elif isinstance(config, PrefillConfig):
        cfg = config
    elif isinstance(config, dict):
        cfg = PrefillConfig.from_dict(config)
    else:
        raise TypeError(f"config must be a PrefillConfig, a dict or None, got {type(config)}")
    cfg.validate()
    return cfg


def _even_hd_ok(cfg: PrefillConfig, num_heads: int, head_dim: int, block_d: int) -> bool:
    return head_dim == block_d and num_heads % cfg.BLOCK_H == 0


# ----------------------------------------------------------------------------------------------
# Public entry
# ----------------------------------------------------------------------------------------------


def sparse_mla_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    *,
    attn_sink: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: PrefillConfig | dict[str, Any] | None = None,
    validate: bool | None = None,
    kv_lengths: torch.Tensor | None = None,
    max_kv_length: int | None = None,
) -> torch.Tensor:
    """Sparse MLA prefill attention: each token attends to its own list of pool slots, given as
    CSR (``kv_indices`` [nnz] + ``kv_indptr`` [T+1]) or dense (``kv_indices`` [T, K],
    ``kv_indptr=None``, optionally with the rows' lengths ``kv_lengths``).

    Args:
        q: [T, H, D] fp16 or bf16 (any strides; a last dim with stride != 1 is copied).
        kv: [N, D] (or [N, 1, D]) latent KV pool in q's dtype, last dim contiguous; K and V are
            the same row. It may be a view into a larger buffer.
            Or a :class:`sparse_mla.FP8Cache` (FlashMLA's MODEL1 FP8 layout, q then bf16 and
            D = 512; slot s valid iff 0 <= s < num_blocks x block_size): the FP8 kernels
            read it (``gluon_ws_small_fp8`` on sm90, ``triton_fp8`` elsewhere;
            :mod:`sparse_mla.fp8_prefill`).
        kv_indices: [nnz] int32 or int64 slot ids, used in the dtype given. A slot s is valid
            iff 0 <= s < N; any other value is absent and its row is never read.
            Or the dense form, ``kv_indptr=None``: [T, K] int32 or int64, token t's list is
            ``kv_indices[t, :]`` (an engine's top-k output, -1 padded: -1 and any other id
            outside [0, N) are absent, as in CSR). K = 0 and all-absent rows give zeros. A
            view with other strides (e.g. ``topk_buf[:, :K]``) is copied to contiguous first.
            Without ``kv_lengths`` every row is walked to its end: padding past a row's last
            valid id costs its tiles (no row is gathered for them; rows padded far past their
            lists took up to 1.66x the CSR call's time on the H200, docs/PERF_NOTES.md). Pass
            the rows' lengths when the engine has them (FlashMLA's ``topk_length``).
            The kernels that read the dense form themselves (``dispatch.Kernel.dense_ids``)
            load a token's ids at row t x K with no kv_indptr hop (and its length, one load,
            with ``kv_lengths``); the others get the CSR form on the device, no host sync: the
            ids as they are and a kept [0, K, 2K, ...] kv_indptr
            (:func:`sparse_mla.validation.dense_as_csr`), or with ``kv_lengths`` the lists
            packed by a few torch ops (:func:`sparse_mla.validation.dense_lengths_csr`).
        kv_indptr: [T+1] int32 or int64: token t uses kv_indices[kv_indptr[t]:kv_indptr[t+1]].
            Entries must satisfy 0 <= kv_indptr[0] <= ... <= kv_indptr[T] <= nnz (the first
            may be above 0: the tokens use a window of kv_indices). None: the dense form.
        softmax_scale: logits = (q_h · kv_s) * softmax_scale; finite, and finite in fp32.
            Required (it defaults to None only so that ``kv_indptr`` may be left out).
        attn_sink: optional [H] fp32 per-head sink logit, added to the softmax denominator only.
        out: optional [T, H, D] buffer with q's dtype and device and last-dim stride 1; it must
            not overlap an input (``out=q``, the same view, computes in place).
        config: None: the kernel recorded as the fastest in configs/ for (arch, H, D) where it
            can run the call, else Triton with its tuned entry or :func:`default_config`
            (:mod:`sparse_mla.dispatch`). Given, it forces a kernel and launch: a PrefillConfig
            or a dict of its fields (Triton), a ``GluonConfig`` (Gluon), or a
            ``dispatch.Choice`` naming any registered kernel.
        validate: check kv_indptr's (or kv_lengths') values on the host.
            None (default): for CPU tensors, and
            for GPU tensors only when ``SPARSE_MLA_VALIDATE=1`` (checking them costs a sync).
            Under ``torch.compile`` the check runs when the graph runs (inside the op), never
            at trace time; inside a CUDA-graph capture it is skipped (:mod:`sparse_mla.op`).
        kv_lengths: dense form only: [T] int32 or int64, token t's list is
            ``kv_indices[t, :kv_lengths[t]]`` (FlashMLA's ``topk_length``); ids past it are
            never read. 0 <= kv_lengths[t] <= K, checked as kv_indptr is (``validate``);
            unchecked, the kernels clamp each length to [0, K].
        max_kv_length: with ``kv_lengths`` only: a host int the caller knows bounds them (the
            batch's longest list, as FlashAttention's ``max_seqlen_k``; e.g. min(top-k,
            context) + window). The kernel choice and the KV split count cannot read the
            lengths without a sync, so without it they take every row as K long: an engine's
            fixed-width top-k on a short context then splits lists that are a few tiles long
            (1.25-1.54x the CSR call, H200, docs/PERF_NOTES.md step 38). It steers only that
            choice (rounded up to a multiple of 64, at most K); every list is still read to
            its ``kv_lengths[t]``, so a bound below a length costs speed, never correctness.

    Returns:
        out: [T, H, D] in q's dtype. A token with no valid slot gets zeros, whatever the sink
        (-inf and +inf included).

    The call goes through the registered op ``torch.ops.sparse_mla.prefill`` (:mod:`sparse_mla.
    op`), so ``torch.compile`` (``fullgraph=True``, ``mode="reduce-overhead"``) takes it as one
    opaque node; the kernel choice and launch happen inside the op, cached per (device, dtype,
    shape, token bucket, config, configs file). On a GPU tensor the kernel is compiled; on CPU
    tensors Triton's kernel runs in its interpreter. The inputs are validated once, in the op
    (:func:`sparse_mla.validation.validate_inputs`, shared with ``mla_gluon``), whichever
    kernel then runs. Bad input raises
    TypeError/ValueError naming the argument, before ``out`` is touched. Unchecked, a bad
    kv_indptr still reads nothing outside kv_indices: every kernel clamps token t's range to
    lo = clamp(kv_indptr[t], 0, nnz), hi = clamp(kv_indptr[t+1], lo, nnz), so such a token
    attends to the in-bounds part of its list, or gets zeros when that is empty.
    """
    if softmax_scale is None:
        raise TypeError("sparse_mla_prefill: softmax_scale is required (e.g. head_dim ** -0.5)")
    kv_indptr = validation._slot_lists(kv_indices, kv_indptr, kv_lengths)
    bound = validation.length_bound(max_kv_length, kv_indices, kv_lengths)
    if isinstance(kv, FP8Cache):  # torch.ops.sparse_mla.prefill_fp8: the FP8 kernels
        return op.prefill_fp8(
            q, kv, kv_indices, kv_indptr, softmax_scale, attn_sink=attn_sink, out=out,
            config=config, validate=validate, max_kv_length=bound,
        )  # fmt: skip
    if not _op_args(q, kv, kv_indices, kv_indptr, softmax_scale, attn_sink, out):
        # Not what the operator's schema takes: raise the named TypeError/ValueError.
        validate_inputs(
            q, kv, kv_indices, kv_indptr, softmax_scale, attn_sink=attn_sink, out=out,
            validate=False,
        )  # fmt: skip
    spec = None if config is None else op.spec_of(config)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    op.call(q, kv, kv_indices, kv_indptr, float(softmax_scale), attn_sink, out, spec,
            None if validate is None else bool(validate), bound)  # fmt: skip
    return out


def _op_args(q, kv, kv_indices, kv_indptr, softmax_scale, attn_sink, out) -> bool:
    """Whether the arguments have the types ``torch.ops.sparse_mla.prefill`` takes."""
    T = torch.Tensor
    return (
        isinstance(q, T) and isinstance(kv, T) and isinstance(kv_indices, T)
        and (kv_indptr is None or isinstance(kv_indptr, T))
        and (attn_sink is None or isinstance(attn_sink, T))
        and (out is None or isinstance(out, T)) and isinstance(softmax_scale, (int, float))
        and not isinstance(softmax_scale, bool) and _fits_float(softmax_scale)
        and (q.is_cpu or q.is_cuda)  # meta and others: refused by name, not faked
    )  # fmt: skip


def _fits_float(x) -> bool:
    """Whether ``float(x)`` is defined (an int past float's range is not: the validation's
    ValueError names it)."""
    try:
        float(x)
    except OverflowError:
        return False
    return True


def _prefill_impl(
    q, kv, kv_indices, kv_indptr, softmax_scale, attn_sink, out, config=None, validate=None,
    max_kv_length=None,
):  # fmt: skip
    """The real kernel of ``torch.ops.sparse_mla.prefill`` (:mod:`sparse_mla.op`): validate,
    choose the kernel (cached: :func:`sparse_mla.dispatch.choose_cached`), launch into ``out``.

    ``config``: None or a :func:`sparse_mla.op.config_spec` string. ``validate``: as the
    entry's; inside a CUDA-graph capture the value check is skipped (a replay could not run
    it), see :mod:`sparse_mla.op`. ``max_kv_length``: the entry's bound on dense ids' lengths
    (:func:`sparse_mla.validation.length_bound`), for the choice and the split count only."""
    check = op._value_check(validate, q)
    x = validate_inputs(
        q, kv, kv_indices, kv_indptr, softmax_scale, attn_sink=attn_sink, out=out,
        validate=check,
    )  # fmt: skip
    q, kv2 = x.q, x.kv
    T, H, D = q.shape
    if config is None:
        conf = key = None
    else:
        conf = op.config_object(config)
        key = (config, id(conf))
    bound = validation.length_bound(max_kv_length, x.kv_indices, x.kv_indptr)
    nnz = validation.planned_nnz(x.kv_indices, bound)
    lengths = validation.dense_form(x.kv_indices, x.kv_indptr) == 2
    choice = dispatch.choose_cached(_arch_of(q), H, D, q.dtype, kv2, T, nnz, config=conf,
                                    config_key=key, dense_lengths=lengths)  # fmt: skip
    k = dispatch.kernel(choice.kernel)
    if out.numel() == 0:
        return
    if kv2.shape[0] == 0:
        out.zero_()  # every slot is invalid: every token is empty
        return
    ids, ptr = _csr_for(k, x.kv_indices, x.kv_indptr)
    if bound is None:
        k.run(q, kv2, ids, ptr, x.softmax_scale, x.attn_sink, out, choice.launch)
    else:  # the split count planned for the bound, not for T x K
        k.run(q, kv2, ids, ptr, x.softmax_scale, x.attn_sink, out, choice.launch, nnz=nnz)


def _csr_for(k: dispatch.Kernel, ids, ptr):
    """The slot lists as kernel ``k`` takes them: as they are, or dense ids as CSR for a kernel
    that reads CSR only (no host sync either way)."""
    form = validation.dense_form(ids, ptr)
    if form == 0 or k.dense_ids:
        return ids, ptr
    if form == 1:
        return _dense_launch_csr(ids)  # kept kv_indptr, no torch op: plans replay it
    return dense_lengths_csr(ids, ptr)  # lengths: packed (torch ops: no plan)


op.register_impl(_prefill_impl)


def _arch_of(q: torch.Tensor) -> str | None:
    """The arch whose tuned configs a call on ``q`` reads; None in the interpreter."""
    return None if q.is_cpu else runtime.arch(q.get_device())  # (get_device: no device object)


def _run_triton(q, kv2, kv_indices, kv_indptr, softmax_scale, attn_sink, out, cfg: PrefillConfig,
                nnz=None):  # fmt: skip
    """Launch the Triton kernel on validated, non-empty inputs (``kv2`` is [N, D]); CSR, or
    dense [T, K] ids with ``kv_indptr`` None (``DENSE_IDS``: row t at t x K, no indptr load) or
    their rows' lengths [T] (``DENSE_IDS`` = 2). ``nnz`` (a planned total length) plans nothing
    here: one program per (token, head block)."""
    T, H, D = q.shape
    interpret = runtime.runs_interpreted(q)
    has_sink = attn_sink is not None
    dense, ptr, per_row = validation.dense_launch(kv_indices, kv_indptr)
    kw = _triton_launch(cfg, H, D, has_sink, interpret and q.dtype == torch.bfloat16, interpret,
                        dense)  # fmt: skip
    qk_scale = float(softmax_scale) * (_LOG2E if cfg.USE_EXP2 else 1.0)
    sink = attn_sink if has_sink else _no_sink(q.device)
    grid = (T, runtime.cdiv(H, cfg.BLOCK_H))
    (qs0, qs1, _), (os0, os1, _) = q.stride(), out.stride()
    args = (q, kv2, kv_indices, ptr, sink, out, qs0, qs1, kv2.stride(0), os0, os1,
            H, D, kv2.shape[0], kv_indices.numel(), qk_scale, per_row)  # fmt: skip
    if interpret:
        runtime.launch(_sparse_mla_prefill_kernel, grid, *args, interpret=True, **kw)
    else:  # kw is _triton_launch's cached dict: the direct launch keys on its identity
        fastlaunch.launcher(_sparse_mla_prefill_kernel)(grid, args, kw)
    return out


@functools.lru_cache(maxsize=1024)
def _triton_launch(cfg: PrefillConfig, H: int, D: int, has_sink: bool, interp_bf16: bool,
                   interpret: bool, dense: bool | int | None = None) -> dict[str, Any]:  # fmt: skip
    """The constexprs and options of a Triton launch (cached: they depend on no tensor).
    ``DENSE_IDS`` (``dense``: :func:`sparse_mla.validation.dense_launch`'s) is passed only when
    set, so a CSR launch is the kernel it always was."""
    block_d = triton.next_power_of_2(D)
    even_hd = _even_hd_ok(cfg, H, D, block_d) if cfg.EVEN_HD is None else cfg.EVEN_HD
    options = cfg.compile_options("hip" if not interpret and runtime.is_amd() else "cuda")
    return {
        "BLOCK_H": cfg.BLOCK_H, "BLOCK_K": cfg.BLOCK_K, "BLOCK_D": block_d,
        "HAS_SINK": has_sink, "EVEN_HD": even_hd, "USE_EXP2": cfg.USE_EXP2,
        "PREFETCH_KV": cfg.PREFETCH_KV, "INTERP_BF16": interp_bf16,
        **({"DENSE_IDS": dense} if dense else {}), **options,
    }  # fmt: skip


_NO_SINK: dict[torch.device, torch.Tensor] = {}


def _no_sink(device: torch.device) -> torch.Tensor:
    """An empty fp32 tensor for the sink pointer of a launch without a sink (one per device)."""
    t = _NO_SINK.get(device)
    if t is None:
        t = torch.empty(0, dtype=torch.float32, device=device)
        if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            _NO_SINK[device] = t
    return t


def _resolve_triton(launch, call: dispatch.Call) -> PrefillConfig:
    """Triton's launch for a call (None: tuned or default), checked against the call's shape."""
    cfg = resolve_config(call.num_heads, call.head_dim, launch, call.arch)
    block_d = triton.next_power_of_2(call.head_dim)
    if max(cfg.BLOCK_H, cfg.BLOCK_K) * block_d > MAX_TILE_ELEMENTS:
        raise ValueError(
            f"config: BLOCK_H={cfg.BLOCK_H} / BLOCK_K={cfg.BLOCK_K} with head dim "
            f"{call.head_dim} (BLOCK_D={block_d}) makes a tile over Triton's "
            f"{MAX_TILE_ELEMENTS} elements"
        )
    if cfg.EVEN_HD and not _even_hd_ok(cfg, call.num_heads, call.head_dim, block_d):
        raise ValueError(
            f"config: EVEN_HD needs head_dim == BLOCK_D and H % BLOCK_H == 0; got "
            f"head_dim={call.head_dim}, BLOCK_D={block_d}, H={call.num_heads}, "
            f"BLOCK_H={cfg.BLOCK_H}"
        )
    return cfg


# ----------------------------------------------------------------------------------------------
# Kernels the entry can run (sparse_mla.dispatch picks one per call)
# ----------------------------------------------------------------------------------------------


def _gluon_unavailable(name: str, call: dispatch.Call) -> str | None:
    """Why Gluon kernel ``name`` cannot run a call (None: it can): a GPU of an arch it serves,
    head_dim 512, fp16/bf16, a pool whose rows start 16-byte aligned, and its own rule
    (:func:`sparse_mla.gluon.launch.why_not`) for its default launch."""
    if call.arch is None or (call.kv is not None and call.kv.device.type == "cpu"):
        return "Gluon kernels need a GPU (they do not run in the interpreter)"
    from .gluon import launch as gluon_launch

    try:
        target = gluon_launch.get_target(call.arch)
    except ValueError:
        return f"Gluon kernels have no {call.arch} instantiation"
    if call.head_dim != gluon_launch.HEAD_DIM:
        return f"Gluon kernels need head_dim {gluon_launch.HEAD_DIM}, got {call.head_dim}"
    if call.dtype is not None and call.dtype not in (torch.float16, torch.bfloat16):
        return f"Gluon kernels take fp16 or bf16, got {call.dtype}"
    kv = call.kv
    misaligned = kv is not None and (kv.data_ptr() % 16 or (kv.stride(0) * kv.element_size()) % 16)
    if misaligned and kv.shape[0] > 0:
        return "the pool's rows do not start 16-byte aligned"
    cfg = gluon_launch.resolve_launch(name, None, call.num_heads, target)
    return gluon_launch.why_not(name, cfg, target, has_pe=False)


def _resolve_gluon(name: str, launch, call: dispatch.Call):
    """Gluon kernel ``name``'s launch for a call (None: its default at the call's heads)."""
    from .gluon import launch as gluon_launch

    target = gluon_launch.get_target(call.arch or "sm90")
    return gluon_launch.resolve_launch(name, launch, call.num_heads, target)


def _run_gluon(name: str, q, kv2, kv_indices, kv_indptr, softmax_scale, attn_sink, out, cfg,
               nnz=None):  # fmt: skip
    from .gluon import launch as gluon_launch

    with runtime.compiling():  # a launch may compile: not while another thread interprets
        return gluon_launch.run_validated(
            q, None, kv2, None, kv_indices, kv_indptr, softmax_scale, has_pe=False,
            attn_sink=attn_sink, out=out, config=cfg, kernel=name, nnz=nnz,
        )  # fmt: skip


def _compile_gluon(name: str, target: str, **shape):
    from .gluon import launch as gluon_launch

    return gluon_launch.compile_args("prefill", target, name, **shape)


def launch_constexprs(
    num_heads: int, head_dim: int, dtype: torch.dtype, cfg: PrefillConfig, *, has_sink: bool
) -> dict[str, Any]:
    """The constexprs the kernel compiles with for a call (used by inspect and tests)."""
    block_d = triton.next_power_of_2(head_dim)
    even_ok = _even_hd_ok(cfg, num_heads, head_dim, block_d)
    return {
        "BLOCK_H": cfg.BLOCK_H,
        "BLOCK_K": cfg.BLOCK_K,
        "BLOCK_D": block_d,
        "HAS_SINK": has_sink,
        "EVEN_HD": even_ok if cfg.EVEN_HD is None else cfg.EVEN_HD,
        "USE_EXP2": cfg.USE_EXP2,
        "PREFETCH_KV": cfg.PREFETCH_KV,
        "INTERP_BF16": False,
    }
