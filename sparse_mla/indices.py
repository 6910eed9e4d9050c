"""Index packing: dense top-k -> CSR slot lists, and the DSv4 combined compressed + window lists.

The prefill kernel reads CSR slot lists (``kv_indices [nnz]``, ``kv_indptr [T+1]``). Engines
produce dense ``[T, W]`` top-k tensors with -1 padding and per-request pool layouts; the
builders here convert them. Each builder has two implementations that agree exactly (same
values, same dtypes) on valid input:

- ``impl="torch"``: plain PyTorch, the reference;
- ``impl="triton"``: Triton kernels launched through :func:`sparse_mla.runtime.launch`
  (compiled on GPU tensors, Triton's interpreter on CPU tensors);
- ``impl="auto"`` (default): Triton on GPU tensors, torch on CPU tensors.

Host syncs. Sizing a packed output needs its length (nnz). A caller that knows it passes
``total=`` and the Triton path then runs without reading any tensor on the host. Value checks
(lengths in range, request layouts that fit their pool block, ...) read tensors too, so
``validate=None`` (the default) runs them on CPU tensors, and on GPU tensors only when the call
syncs anyway (no ``total``); ``validate=True``/``False`` forces them on/off. Shape, dtype and
device checks always run. Without the value checks the kernels stay memory-safe (they clamp
and mask) but the result of invalid input is unspecified.

Under ``torch.compile``. The builders that size their output without a host sync
(:func:`dense_to_csr` and :func:`dsv4_combined_indices` given ``total``, the latter also given
``topk_indices`` or ``num_tokens``; :func:`global_topk_from_block_table` always) are registered
ops while Dynamo traces (``torch.ops.sparse_mla.dense_to_csr``, ``...dsv4_combined_indices``,
``...global_topk_from_block_table``): one opaque node each, whose fake kernel sizes the outputs
from ``total`` / the shapes, and whose real kernel is the same function run eagerly when the
graph runs, so ``fullgraph=True`` works and gives the same bits as eager; the value checks
(``validate``) run there, on the real tensors, as in eager mode. Eager calls do not go through
the ops (no dispatcher cost). Without ``total`` the output's size is a tensor value (a host
read), which Dynamo cannot trace without a graph break: call those outside the compiled region.
:func:`request_of_token`, :func:`dsv4_positions` and :func:`dsv4_token_lengths` are plain torch
code and trace as such given ``num_tokens``; their value checks (``validate``, by default on CPU
tensors) read tensors on the host, so under ``fullgraph=True`` pass ``validate=False``.

Invalid slots. Every slot the builders produce is either a real pool row or exactly -1; an
invalid input entry (-1 padding, an id out of range) is never rebased into a valid-looking
slot (aiter's builder added the block base to -1).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from . import runtime

__all__ = [
    "dense_to_csr",
    "dsv4_combined_indices",
    "dsv4_positions",
    "dsv4_token_lengths",
    "global_topk_from_block_table",
    "request_of_token",
]

_INDEX_TYPES = (torch.int32, torch.int64)
_INT_TYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
_INT32_MAX = 2**31 - 1
# Stands for "no cap" in kernels; an int64 kernel argument.
_NO_CAP = 2**62


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _valid_counts_kernel(
    idx_ptr,  # [T, W] int32 | int64
    counts_ptr,  # [T] int64
    W,
    stride_t,
    stride_w,
    num_kv,
    HAS_NUM_KV: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    pid_t = tl.program_id(0).to(tl.int64)
    offs_w = tl.arange(0, BLOCK_W)  # [BLOCK_W]
    n = tl.zeros([BLOCK_W], dtype=tl.int64)
    for w0 in range(0, W, BLOCK_W):
        w = w0 + offs_w
        ids = tl.load(idx_ptr + pid_t * stride_t + w * stride_w, mask=w < W, other=-1)
        valid = ids >= 0
        if HAS_NUM_KV:
            valid = valid & (ids < num_kv)
        n += valid.to(tl.int64)
    tl.store(counts_ptr + pid_t, tl.sum(n, 0))


@triton.jit
def _indptr_scan_kernel(
    counts_ptr,  # [T] int32 | int64
    indptr_ptr,  # [T + 1] int32 | int64
    T,
    BLOCK_T: tl.constexpr,
):
    # One program: an inclusive scan tile by tile, carrying the running total.
    offs_t = tl.arange(0, BLOCK_T)  # [BLOCK_T]
    carry = tl.sum(tl.zeros([BLOCK_T], dtype=tl.int64), 0)
    tl.store(indptr_ptr, carry.to(indptr_ptr.dtype.element_ty))
    for t0 in range(0, T, BLOCK_T):
        t = t0 + offs_t
        c = tl.load(counts_ptr + t, mask=t < T, other=0).to(tl.int64)
        cs = tl.cumsum(c, 0) + carry  # [BLOCK_T]
        tl.store(indptr_ptr + 1 + t, cs.to(indptr_ptr.dtype.element_ty), mask=t < T)
        carry += tl.sum(c, 0)


@triton.jit
def _dense_pack_kernel(
    idx_ptr,  # [T, W] int32 | int64
    len_ptr,  # [T] int64, clamped to [0, W] (unused without HAS_LENGTHS)
    indptr_ptr,  # [T + 1]
    out_ptr,  # [total], idx dtype
    W,
    stride_t,
    stride_w,
    num_kv,
    total,
    HAS_LENGTHS: tl.constexpr,
    HAS_NUM_KV: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    pid_t = tl.program_id(0).to(tl.int64)
    offs_w = tl.arange(0, BLOCK_W)  # [BLOCK_W]
    start = tl.load(indptr_ptr + pid_t).to(tl.int64)
    if HAS_LENGTHS:
        n = tl.load(len_ptr + pid_t)
    carry = start
    for w0 in range(0, W, BLOCK_W):
        w = w0 + offs_w
        ids = tl.load(idx_ptr + pid_t * stride_t + w * stride_w, mask=w < W, other=-1)
        valid = ids >= 0
        if HAS_NUM_KV:
            valid = valid & (ids < num_kv)
        if HAS_LENGTHS:
            keep = w < n
            vals = tl.where(valid, ids, -1)
            pos = start + w
        else:
            # Stream compaction: a kept entry goes after the kept entries before it.
            keep = valid
            pos = carry + tl.cumsum(keep.to(tl.int64), 0) - 1  # [BLOCK_W]
            carry += tl.sum(keep.to(tl.int64), 0)
            vals = ids
        # pos < total keeps a wrong caller-given total from writing out of bounds.
        tl.store(out_ptr + pos, vals.to(out_ptr.dtype.element_ty), mask=keep & (pos < total))


@triton.jit
def _dsv4_pack_kernel(
    topk_ptr,  # [T, W] request-local compressed ids (unused without HAS_TOPK_IDS)
    pos_ptr,  # [T] int64 token positions
    cbase_ptr,  # [T] int64 slot of the request's compressed row 0
    wbase_ptr,  # [T] int64 slot of the request's window row holding position 0
    indptr_ptr,  # [T + 1]
    out_ptr,  # [total]
    W,
    stride_t,
    stride_w,
    ratio,
    topk_cap,
    window,
    num_compressed,
    total,
    HAS_TOPK_IDS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_t = tl.program_id(0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    start = tl.load(indptr_ptr + pid_t).to(tl.int64)
    p = tl.load(pos_ptr + pid_t)
    n_c = tl.minimum((p + 1) // ratio, topk_cap)
    n_w = tl.minimum(p + 1, window)
    c_base = tl.load(cbase_ptr + pid_t)

    for k0 in range(0, n_c, BLOCK_K):
        k = k0 + offs_k  # [BLOCK_K] int64
        in_list = k < n_c
        if HAS_TOPK_IDS:
            ids = tl.load(
                topk_ptr + pid_t * stride_t + k * stride_w, mask=in_list & (k < W), other=-1
            ).to(tl.int64)
        else:
            ids = k
        # An invalid id stays -1: it is never rebased into a valid-looking slot.
        valid = (ids >= 0) & (ids < num_compressed)
        slot = tl.where(valid, c_base + ids, -1)
        dst = start + k
        tl.store(out_ptr + dst, slot.to(out_ptr.dtype.element_ty), mask=in_list & (dst < total))

    first = tl.load(wbase_ptr + pid_t) + p - n_w + 1  # slot of the oldest window position
    for k0 in range(0, n_w, BLOCK_K):
        k = k0 + offs_k  # [BLOCK_K] int64
        dst = start + n_c + k
        tl.store(
            out_ptr + dst, (first + k).to(out_ptr.dtype.element_ty), mask=(k < n_w) & (dst < total)
        )


@triton.jit
def _block_table_kernel(
    local_ptr,  # [T, K] request-local token ids
    bt_ptr,  # [B, max_blocks] physical block ids
    req_ptr,  # [T]
    out_ptr,  # [T, K] contiguous
    K,
    stride_lt,
    stride_lk,
    stride_bb,
    stride_bm,
    num_reqs,
    max_blocks,
    block_size,
    BLOCK_K: tl.constexpr,
):
    pid_t = tl.program_id(0).to(tl.int64)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)  # [BLOCK_K]
    mask_k = offs_k < K
    r = tl.load(req_ptr + pid_t).to(tl.int64)
    ids = tl.load(local_ptr + pid_t * stride_lt + offs_k * stride_lk, mask=mask_k, other=-1)
    ids = ids.to(tl.int64)
    ok = (ids >= 0) & (r >= 0) & (r < num_reqs)
    blk = tl.where(ok, ids // block_size, 0)
    ok = ok & (blk < max_blocks)
    phys = tl.load(bt_ptr + r * stride_bb + blk * stride_bm, mask=ok, other=-1).to(tl.int64)
    ok = ok & (phys >= 0)
    slot = tl.where(ok, phys * block_size + ids % block_size, -1)
    tl.store(out_ptr + pid_t * K + offs_k, slot.to(out_ptr.dtype.element_ty), mask=mask_k)


# ----------------------------------------------------------------------------------------------
# Shared checks and helpers
# ----------------------------------------------------------------------------------------------


def _check_impl(impl: str) -> None:
    if impl not in ("auto", "torch", "triton"):
        raise ValueError(f"impl must be 'auto', 'torch' or 'triton', got {impl!r}")


def _use_triton(impl: str, t: torch.Tensor) -> bool:
    _check_impl(impl)
    if impl == "auto":
        return not runtime.runs_interpreted(t)
    return impl == "triton"


def _should_validate(validate: bool | None, device: torch.device, syncs_anyway: bool) -> bool:
    if validate is not None:
        return bool(validate)
    return device.type == "cpu" or syncs_anyway


def _check_tensor(name, t, ndim, dtypes, what="an integer"):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must be {what} tensor ({allowed}), got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")


def _check_devices(ref_name: str, ref: torch.Tensor, **named) -> None:
    for name, t in named.items():
        if t is not None and t.device != ref.device:
            raise ValueError(
                f"{name} is on {t.device} but {ref_name} is on {ref.device}; devices must match"
            )


def _check_int(name: str, v, *, minimum: int = 0, allow_none: bool = False) -> None:
    if v is None and allow_none:
        return
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")


def _check_index_dtype(name: str, d) -> None:
    if d is not None and d not in _INDEX_TYPES:
        raise TypeError(f"{name} must be torch.int32 or torch.int64, got {d}")


def _as_int_tensor(name: str, x, device: torch.device) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, Sequence) and not isinstance(x, (str, bytes)):
        return torch.tensor(list(x), dtype=torch.int64, device=device)
    raise TypeError(f"{name} must be a tensor or a sequence of ints, got {type(x).__name__}")


def _auto_indptr_dtype(values_dtype: torch.dtype, bound: int) -> torch.dtype:
    # int32 offsets only when the values are int32 and no row layout can pass 2^31 - 1.
    if values_dtype == torch.int32 and bound <= _INT32_MAX:
        return torch.int32
    return torch.int64


def _block(n: int, lo: int = 16, hi: int = 1024) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(int(n), 1))))


def _triton_indptr(counts: torch.Tensor, indptr_dtype: torch.dtype) -> torch.Tensor:
    T = counts.numel()
    indptr = torch.empty(T + 1, dtype=indptr_dtype, device=counts.device)
    runtime.launch(
        _indptr_scan_kernel,
        (1,),
        counts,
        indptr,
        T,
        BLOCK_T=_block(T),
        interpret=runtime.runs_interpreted(counts),
        num_warps=4,
    )
    return indptr


def _torch_indptr(counts: torch.Tensor, indptr_dtype: torch.dtype) -> torch.Tensor:
    indptr = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=counts.device)
    torch.cumsum(counts.to(torch.int64), 0, out=indptr[1:])
    return indptr.to(indptr_dtype)


def _resolve_total(name_total, total, indptr, check: bool) -> int:
    if total is None:
        return int(indptr[-1])
    if check:
        actual = int(indptr[-1])
        if actual != total:
            raise ValueError(f"{name_total}={total} but the packed lists hold {actual} entries")
    return total


def _check_indptr_fits(indptr_dtype: torch.dtype, total: int) -> None:
    if indptr_dtype == torch.int32 and total > _INT32_MAX:
        raise ValueError(
            f"indptr_dtype=torch.int32 cannot hold nnz={total}; use torch.int64 (or the default)"
        )


# ----------------------------------------------------------------------------------------------
# dense [T, W] -> CSR
# ----------------------------------------------------------------------------------------------


def dense_to_csr(
    indices: torch.Tensor,
    lengths: torch.Tensor | Sequence[int] | None = None,
    num_kv: int | None = None,
    total: int | None = None,
    *,
    impl: str = "auto",
    indptr_dtype: torch.dtype | None = None,
    validate: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack a dense ``[T, W]`` top-k with -1 padding into CSR slot lists.

    Args:
        indices: [T, W] int32 or int64 slot ids; any negative entry is invalid (padding).
            Any strides.
        lengths: optional [T] integer tensor (or a sequence of ints), 0 <= lengths[t] <= W.
            Without it, row t's list is its valid entries (>= 0, and < num_kv when given), in
            order; invalid entries are dropped. With it, row t's list is exactly its first
            lengths[t] entries, positions kept; invalid entries among them become -1.
        num_kv: optional pool size N. Entries outside [0, N) are invalid: dropped without
            ``lengths``, -1 with it. Without num_kv only negative entries are invalid.
        total: the nnz, if the caller knows it (``sum(lengths)``, or the valid count). The
            Triton path then sizes its output without a host sync. It must be right: it is
            checked whenever values are validated; otherwise a wrong total gives a wrong
            (but never out-of-bounds) result.
        impl: "torch" (reference), "triton", or "auto" (Triton on GPU, torch on CPU).
        indptr_dtype: dtype of kv_indptr. Default: int32 when ``indices`` is int32 and
            T * W <= 2^31 - 1 (so no nnz can overflow it), else int64.
        validate: check tensor values (lengths range, total); None: on CPU tensors, and on
            GPU tensors unless ``total`` is given (see the module docstring).

    Returns:
        kv_indices: [nnz], ``indices``' dtype. Every invalid entry kept is exactly -1.
        kv_indptr: [T+1], row t is ``kv_indices[kv_indptr[t]:kv_indptr[t+1]]``.
    """
    _check_tensor("indices", indices, 2, _INDEX_TYPES, "an int32 or int64")
    T, W = indices.shape
    if lengths is not None:
        lengths = _as_int_tensor("lengths", lengths, indices.device)
        _check_tensor("lengths", lengths, 1, _INT_TYPES)
        if lengths.numel() != T:
            raise ValueError(
                f"lengths must have one entry per row of indices (T={T}), got {lengths.numel()}"
            )
        _check_devices("indices", indices, lengths=lengths)
    _check_int("num_kv", num_kv, allow_none=True)
    _check_int("total", total, allow_none=True)
    _check_index_dtype("indptr_dtype", indptr_dtype)
    _check_impl(impl)
    if total is not None and torch.compiler.is_compiling():  # one opaque node (module doc)
        if indptr_dtype is None:
            indptr_dtype = _auto_indptr_dtype(indices.dtype, T * W)
        _check_indptr_fits(indptr_dtype, total)
        return torch.ops.sparse_mla.dense_to_csr(
            indices, lengths, num_kv, total, impl, indptr_dtype, validate
        )
    check = _should_validate(validate, indices.device, syncs_anyway=total is None)
    if lengths is not None and check and T:
        lo, hi = int(lengths.min()), int(lengths.max())
        if lo < 0:
            raise ValueError(f"lengths must be >= 0, got a length of {lo}")
        if hi > W:
            raise ValueError(f"lengths must be <= W={W} (the width of indices), got {hi}")
    if indptr_dtype is None:
        indptr_dtype = _auto_indptr_dtype(indices.dtype, T * W)
    if total is not None:
        _check_indptr_fits(indptr_dtype, total)
    lens = None if lengths is None else lengths.to(torch.int64).clamp(0, W)

    if not _use_triton(impl, indices):
        valid = indices >= 0
        # torch compares an int32 tensor with a Python int in int32: a num_kv >= 2^31 would
        # wrap. Every int32 is below such a pool size, so the bound only applies when it fits.
        if num_kv is not None and num_kv <= torch.iinfo(indices.dtype).max:
            valid &= indices < num_kv
        if lens is None:
            keep = valid
            values = indices
        else:
            keep = torch.arange(W, device=indices.device)[None, :] < lens[:, None]
            values = torch.where(valid, indices, torch.full_like(indices, -1))
        kv_indices = values[keep]
        indptr = _torch_indptr(keep.sum(1), indptr_dtype)
        _resolve_total("total", total, indptr, check=True)
        _check_indptr_fits(indptr_dtype, kv_indices.numel())
        return kv_indices, indptr

    interpret = runtime.runs_interpreted(indices)
    block_w = _block(W)
    if lens is None:
        counts = torch.empty(T, dtype=torch.int64, device=indices.device)
        if T:
            runtime.launch(
                _valid_counts_kernel,
                (T,),
                indices,
                counts,
                W,
                indices.stride(0),
                indices.stride(1),
                0 if num_kv is None else num_kv,
                HAS_NUM_KV=num_kv is not None,
                BLOCK_W=block_w,
                interpret=interpret,
                num_warps=4,
            )
    else:
        counts = lens
    indptr = _triton_indptr(counts, indptr_dtype)
    nnz = _resolve_total("total", total, indptr, check)
    _check_indptr_fits(indptr_dtype, nnz)
    kv_indices = torch.empty(nnz, dtype=indices.dtype, device=indices.device)
    if T and nnz:
        runtime.launch(
            _dense_pack_kernel,
            (T,),
            indices,
            counts,
            indptr,
            kv_indices,
            W,
            indices.stride(0),
            indices.stride(1),
            0 if num_kv is None else num_kv,
            nnz,
            HAS_LENGTHS=lens is not None,
            HAS_NUM_KV=num_kv is not None,
            BLOCK_W=block_w,
            interpret=interpret,
            num_warps=4,
        )
    return kv_indices, indptr


# ----------------------------------------------------------------------------------------------
# DSv4 per-request layout
# ----------------------------------------------------------------------------------------------


def _check_batch(query_start_loc, seq_lens):
    _check_tensor("query_start_loc", query_start_loc, 1, _INT_TYPES)
    _check_tensor("seq_lens", seq_lens, 1, _INT_TYPES)
    if query_start_loc.numel() != seq_lens.numel() + 1:
        raise ValueError(
            f"query_start_loc must have B+1 = {seq_lens.numel() + 1} entries (B = len(seq_lens)), "
            f"got {query_start_loc.numel()}"
        )
    _check_devices("query_start_loc", query_start_loc, seq_lens=seq_lens)


def _check_batch_values(query_start_loc, seq_lens, num_tokens):
    qsl = query_start_loc.to(torch.int64)
    if int(qsl[0]) != 0:
        raise ValueError(f"query_start_loc[0] must be 0, got {int(qsl[0])}")
    q_len = qsl[1:] - qsl[:-1]
    if q_len.numel() and int(q_len.min()) < 0:
        raise ValueError("query_start_loc must be non-decreasing")
    if num_tokens is not None and int(qsl[-1]) != num_tokens:
        raise ValueError(
            f"query_start_loc[-1]={int(qsl[-1])} must equal the number of tokens T={num_tokens}"
        )
    if q_len.numel() and bool((seq_lens.to(torch.int64) < q_len).any()):
        r = int(torch.nonzero(seq_lens.to(torch.int64) < q_len)[0, 0])
        raise ValueError(
            f"seq_lens[{r}]={int(seq_lens[r])} is shorter than that request's query length "
            f"{int(q_len[r])} (query_start_loc diffs)"
        )


def request_of_token(
    query_start_loc: torch.Tensor, *, num_tokens: int | None = None
) -> torch.Tensor:
    """Request id of every token: token t belongs to r with qsl[r] <= t < qsl[r+1].

    Args:
        query_start_loc: [B+1] integer token offsets of the requests (qsl[0] = 0).
        num_tokens: T; default ``query_start_loc[-1]`` (a host sync on a GPU).

    Returns:
        [T] int64 request ids.
    """
    _check_tensor("query_start_loc", query_start_loc, 1, _INT_TYPES)
    if query_start_loc.numel() == 0:
        raise ValueError("query_start_loc must have B+1 >= 1 entries, got 0")
    _check_int("num_tokens", num_tokens, allow_none=True)
    T = int(query_start_loc[-1]) if num_tokens is None else num_tokens
    qsl = query_start_loc.to(torch.int64)
    t = torch.arange(T, dtype=torch.int64, device=qsl.device)
    # Empty requests (qsl[r] == qsl[r+1]) own no token: right=True skips past them.
    return torch.searchsorted(qsl[1:].contiguous(), t, right=True)


def dsv4_positions(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    num_tokens: int | None = None,
    validate: bool | None = None,
) -> torch.Tensor:
    """Positions of the new tokens: request r's q_len tokens are the last q_len of seq_lens[r].

    Args:
        query_start_loc: [B+1] integer token offsets; q_len[r] = qsl[r+1] - qsl[r].
        seq_lens: [B] integer total sequence lengths (context + new tokens), >= q_len.
        num_tokens: T = qsl[-1] if the caller knows it (avoids a host sync on a GPU).
        validate: check qsl[0] == 0, non-decreasing, seq_lens >= q_len, T (see module doc).

    Returns:
        positions: [T] in seq_lens' dtype; token qsl[r] + i has position
        seq_lens[r] - q_len[r] + i.
    """
    _check_batch(query_start_loc, seq_lens)
    _check_int("num_tokens", num_tokens, allow_none=True)
    if _should_validate(validate, seq_lens.device, syncs_anyway=num_tokens is None):
        _check_batch_values(query_start_loc, seq_lens, num_tokens)
    req = request_of_token(query_start_loc, num_tokens=num_tokens)
    return _positions(query_start_loc, seq_lens, req).to(seq_lens.dtype)


def _positions(query_start_loc, seq_lens, req):
    qsl = query_start_loc.to(torch.int64)
    if seq_lens.numel() == 0:
        return req.clone()  # T == 0
    first = (seq_lens.to(torch.int64) - (qsl[1:] - qsl[:-1]))[req]  # position of each request's 1st
    t = torch.arange(req.numel(), dtype=torch.int64, device=req.device)
    return first + (t - qsl[:-1][req])


def _check_layout_args(ratio, topk, window):
    _check_int("ratio", ratio, minimum=1)
    _check_int("topk", topk, allow_none=True)
    _check_int("window", window)


def dsv4_token_lengths(
    positions: torch.Tensor, *, ratio: int, topk: int | None, window: int
) -> torch.Tensor:
    """Slots per token in DSv4 sparse attention: compressed rows plus window rows.

    A token at position p sees ``min((p+1)//ratio, topk)`` compressed rows (CSA: ratio 4,
    topk 512 on V4-Flash, 1024 on V4-Pro) plus ``min(p+1, window)`` window rows (window 128).
    ``topk=None`` means no cap: the heavily compressed layers (HCA, ratio 128) see every
    compressed row, ``(p+1)//ratio``.

    Args:
        positions: [T] integer token positions (>= 0).
        ratio: compression ratio (>= 1); ratio 1 compresses nothing (one row per position).
        topk: cap on the compressed rows per token, or None for no cap.
        window: sliding-window size (>= 0).

    Returns:
        lengths: [T] in positions' dtype.
    """
    _check_tensor("positions", positions, 1, _INT_TYPES)
    _check_layout_args(ratio, topk, window)
    p1 = positions.to(torch.int64) + 1
    n_c = torch.div(p1, ratio, rounding_mode="floor")
    if topk is not None:
        n_c = n_c.clamp(max=topk)
    return (n_c + p1.clamp(max=window)).to(positions.dtype)


def dsv4_combined_indices(
    topk_indices: torch.Tensor | None,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    ratio: int,
    topk: int | None,
    window: int,
    pool_block_rows: int,
    num_compressed: int,
    impl: str = "auto",
    total: int | None = None,
    num_tokens: int | None = None,
    dtype: torch.dtype | None = None,
    indptr_dtype: torch.dtype | None = None,
    validate: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DSv4 CSR slot lists: each token's compressed top-k rows, then its window rows.

    Pool layout (linear, one block of M = ``pool_block_rows`` rows per request; C =
    ``num_compressed``; request r has q_len new tokens, seq_len L, first new position
    s = L - q_len)::

        slot r*M + 0                    r*M + C                          r*M + C + window + q_len
             | compressed rows 0..C-1   | window rows 0..window+q_len-1  | (unused) ... | r*M + M
                                          row k holds position s - window + k

    So compressed row j of request r is slot ``r*M + j``, and position x of request r (for
    s - window <= x < L) is slot ``r*M + C + window + (x - s)``. Window row 0 (position
    s - window) is never referenced (the first new token sees window - 1 older positions plus
    itself); it keeps the formula simple. Rows of negative positions are never referenced.

    Token t of request r, at position p (see :func:`dsv4_positions`), gets
    ``n_c = min((p+1)//ratio, topk)`` compressed slots: ``r*M + topk_indices[t, j]`` for
    j < n_c, where an id outside [0, C) (the -1 padding included) gives -1, never a rebased
    slot. Then ``n_w = min(p+1, window)`` window slots, positions p-n_w+1 .. p, oldest first.
    Every token's list has exactly n_c + n_w entries (:func:`dsv4_token_lengths`).

    Args:
        topk_indices: [T, W] int32/int64 request-local compressed row ids, -1 padding; or None
            for "every compressed row" (HCA): ids 0 .. n_c-1 (then T comes from
            ``num_tokens`` or ``query_start_loc[-1]``).
        query_start_loc: [B+1] integer token offsets of the requests; qsl[-1] = T.
        seq_lens: [B] integer sequence lengths (context + new tokens), >= q_len.
        ratio: compression ratio (4 CSA, 128 HCA; 1 allowed).
        topk: cap on compressed rows per token (<= W), or None for no cap (HCA).
        window: sliding window (128 in DSv4).
        pool_block_rows: M, pool rows per request block.
        num_compressed: C, compressed rows at the start of each block.
        impl: "torch" (reference), "triton" or "auto" (Triton on GPU, torch on CPU).
        total: the nnz = sum of the token lengths, if known (no host sync on the Triton path).
        num_tokens: T when ``topk_indices`` is None and the caller knows it.
        dtype: kv_indices dtype; default ``topk_indices``' dtype (int64 when it is None).
        indptr_dtype: default int32 when dtype is int32 and T * (C + window) <= 2^31 - 1.
        validate: value checks (see the module docstring): qsl[0] == 0 and non-decreasing,
            qsl[-1] == T, seq_lens >= q_len, every request's L//ratio <= C and
            C + window + q_len <= M, n_c <= W, total.

    Returns:
        kv_indices: [nnz] slots (or -1), in ``dtype``.
        kv_indptr: [T+1].
    """
    _check_batch(query_start_loc, seq_lens)
    _check_layout_args(ratio, topk, window)
    _check_int("pool_block_rows", pool_block_rows, minimum=1)
    _check_int("num_compressed", num_compressed)
    _check_int("total", total, allow_none=True)
    _check_int("num_tokens", num_tokens, allow_none=True)
    _check_index_dtype("dtype", dtype)
    _check_index_dtype("indptr_dtype", indptr_dtype)
    _check_impl(impl)
    if num_compressed + window > pool_block_rows:
        raise ValueError(
            f"num_compressed + window = {num_compressed + window} exceeds pool_block_rows="
            f"{pool_block_rows}"
        )
    if topk_indices is not None:
        _check_tensor("topk_indices", topk_indices, 2, _INDEX_TYPES, "an int32 or int64")
        _check_devices("topk_indices", topk_indices, query_start_loc=query_start_loc)
        T, W = topk_indices.shape
        if num_tokens is not None and num_tokens != T:
            raise ValueError(f"num_tokens={num_tokens} but topk_indices has {T} rows")
        if topk is not None and topk > W:
            raise ValueError(f"topk={topk} exceeds the width of topk_indices (W={W})")
        device = topk_indices.device
    else:
        device = query_start_loc.device
        T = int(query_start_loc[-1]) if num_tokens is None else num_tokens
        W = 0
    B = seq_lens.numel()
    if dtype is None:
        dtype = topk_indices.dtype if topk_indices is not None else torch.int64
    if dtype == torch.int32 and B * pool_block_rows - 1 > _INT32_MAX:
        raise ValueError(
            f"{B} request blocks of {pool_block_rows} rows do not fit int32 slots; "
            "pass dtype=torch.int64"
        )
    if indptr_dtype is None:
        cap = num_compressed if topk is None else min(topk, num_compressed)
        indptr_dtype = _auto_indptr_dtype(dtype, T * (cap + window))
    if total is not None:
        _check_indptr_fits(indptr_dtype, total)
        if torch.compiler.is_compiling():  # one opaque node (module doc)
            return torch.ops.sparse_mla.dsv4_combined_indices(
                topk_indices, query_start_loc, seq_lens, ratio, topk, window, pool_block_rows,
                num_compressed, impl, total, T, dtype, indptr_dtype, validate,
            )  # fmt: skip

    check = _should_validate(validate, device, syncs_anyway=total is None)
    if check:
        _check_batch_values(query_start_loc, seq_lens, T)
        qsl = query_start_loc.to(torch.int64)
        q_len = qsl[1:] - qsl[:-1]
        L = seq_lens.to(torch.int64)
        if B:
            n_rows = torch.div(L, ratio, rounding_mode="floor")
            if int(n_rows.max()) > num_compressed:
                r = int(torch.argmax(n_rows))
                raise ValueError(
                    f"request {r} (seq_len {int(L[r])}) has {int(n_rows[r])} compressed rows but "
                    f"num_compressed={num_compressed}"
                )
            need = num_compressed + window + q_len
            if int(need.max()) > pool_block_rows:
                r = int(torch.argmax(need))
                raise ValueError(
                    f"request {r} needs num_compressed + window + q_len = {int(need[r])} rows, "
                    f"more than pool_block_rows={pool_block_rows}"
                )

    req = request_of_token(query_start_loc, num_tokens=T)
    positions = _positions(query_start_loc, seq_lens, req)  # [T] int64
    lengths = dsv4_token_lengths(positions, ratio=ratio, topk=topk, window=window)
    n_c = lengths - positions.add(1).clamp(max=window)
    if check and topk is None and topk_indices is not None and T and int(n_c.max()) > W:
        raise ValueError(
            f"a token needs {int(n_c.max())} compressed ids (topk=None) but topk_indices has "
            f"width W={W}"
        )
    qsl = query_start_loc.to(torch.int64)
    c_base = req * pool_block_rows  # [T]
    # Slot of position 0 in the request's window rows: position x is at w_base + x.
    s = (seq_lens.to(torch.int64) - (qsl[1:] - qsl[:-1]))[req] if B else req
    w_base = c_base + num_compressed + window - s

    if not _use_triton(impl, query_start_loc if topk_indices is None else topk_indices):
        width_c = max(W, int(n_c.max()) if T else 0)
        col = torch.arange(width_c, device=device)
        if topk_indices is not None:
            ids = torch.full((T, width_c), -1, dtype=torch.int64, device=device)
            ids[:, :W] = topk_indices.to(torch.int64)
        else:
            ids = col[None, :].expand(T, width_c)
        valid = (ids >= 0) & (ids < num_compressed)
        slots_c = torch.where(valid, c_base[:, None] + ids, torch.full_like(ids, -1))
        keep_c = col[None, :] < n_c[:, None]
        n_w = positions.add(1).clamp(max=window)
        col_w = torch.arange(window, device=device)
        slots_w = (w_base + positions - n_w + 1)[:, None] + col_w[None, :]
        keep_w = col_w[None, :] < n_w[:, None]
        kv_indices = torch.cat([slots_c, slots_w], 1)[torch.cat([keep_c, keep_w], 1)].to(dtype)
        indptr = _torch_indptr(lengths, indptr_dtype)
        _resolve_total("total", total, indptr, check=True)
        _check_indptr_fits(indptr_dtype, kv_indices.numel())
        return kv_indices, indptr

    indptr = _triton_indptr(lengths, indptr_dtype)
    nnz = _resolve_total("total", total, indptr, check)
    _check_indptr_fits(indptr_dtype, nnz)
    kv_indices = torch.empty(nnz, dtype=dtype, device=device)
    if T and nnz:
        dummy = positions  # any tensor: the kernel does not read topk_ptr without HAS_TOPK_IDS
        topk_t = topk_indices if topk_indices is not None else dummy
        runtime.launch(
            _dsv4_pack_kernel,
            (T,),
            topk_t,
            positions,
            c_base,
            w_base,
            indptr,
            kv_indices,
            W,
            topk_t.stride(0),
            topk_t.stride(-1),
            ratio,
            _NO_CAP if topk is None else topk,
            window,
            num_compressed,
            nnz,
            HAS_TOPK_IDS=topk_indices is not None,
            BLOCK_K=128,
            interpret=runtime.runs_interpreted(kv_indices),
            num_warps=4,
        )
    return kv_indices, indptr


# ----------------------------------------------------------------------------------------------
# Request-local top-k -> global slots through a block table
# ----------------------------------------------------------------------------------------------


def global_topk_from_block_table(
    local_topk: torch.Tensor,
    block_table: torch.Tensor,
    req_of_token: torch.Tensor,
    block_size: int,
    *,
    impl: str = "auto",
    dtype: torch.dtype | None = None,
    validate: bool | None = None,
) -> torch.Tensor:
    """Map request-local token ids to paged-pool slots through a block table.

    ``slot = block_table[req, i // block_size] * block_size + i % block_size`` for token
    ``t`` in request ``req = req_of_token[t]`` and local id ``i = local_topk[t, k]``. The
    result is -1 where i < 0, where i // block_size is past the table's width, and where the
    table entry is negative (an unallocated block): never a rebased -1.

    Args:
        local_topk: [T, K] int32/int64 request-local ids, -1 padding.
        block_table: [B, max_blocks] int32/int64 physical block ids.
        req_of_token: [T] integer request of each token (:func:`request_of_token`).
        block_size: tokens per block (>= 1).
        impl: "torch" (reference), "triton" or "auto" (Triton on GPU, torch on CPU).
        dtype: output dtype; default ``local_topk``'s.
        validate: check 0 <= req_of_token < B and that int32 slots cannot overflow (reads
            tensors; default only on CPU, see the module docstring). Unchecked, a token with an
            out-of-range request gets all -1.

    Returns:
        slots: [T, K] contiguous, in ``dtype``; -1 stays -1.
    """
    _check_tensor("local_topk", local_topk, 2, _INDEX_TYPES, "an int32 or int64")
    _check_tensor("block_table", block_table, 2, _INDEX_TYPES, "an int32 or int64")
    _check_tensor("req_of_token", req_of_token, 1, _INT_TYPES)
    _check_int("block_size", block_size, minimum=1)
    _check_index_dtype("dtype", dtype)
    _check_impl(impl)
    T, K = local_topk.shape
    B, max_blocks = block_table.shape
    if req_of_token.numel() != T:
        raise ValueError(
            f"req_of_token must have one entry per row of local_topk (T={T}), "
            f"got {req_of_token.numel()}"
        )
    _check_devices("local_topk", local_topk, block_table=block_table, req_of_token=req_of_token)
    dtype = local_topk.dtype if dtype is None else dtype
    if torch.compiler.is_compiling():  # one opaque node (module doc)
        return torch.ops.sparse_mla.global_topk_from_block_table(
            local_topk, block_table, req_of_token, block_size, impl, dtype, validate
        )
    if _should_validate(validate, local_topk.device, syncs_anyway=False) and T:
        lo, hi = int(req_of_token.min()), int(req_of_token.max())
        if lo < 0 or hi >= B:
            raise ValueError(f"req_of_token must be in [0, B={B}), got values in [{lo}, {hi}]")
        if dtype == torch.int32 and block_table.numel():
            top = int(block_table.max()) * block_size + block_size - 1
            if top > _INT32_MAX:
                raise ValueError(f"slots up to {top} do not fit int32; pass dtype=torch.int64")

    if not _use_triton(impl, local_topk):
        ids = local_topk.to(torch.int64)
        req = req_of_token.to(torch.int64)
        req_ok = (req >= 0) & (req < B)
        ok = (ids >= 0) & req_ok[:, None]
        blk = torch.where(ok, torch.div(ids, block_size, rounding_mode="floor"), 0)
        ok &= blk < max_blocks
        if B == 0 or max_blocks == 0:
            return torch.full((T, K), -1, dtype=dtype, device=local_topk.device)
        req_c = torch.where(req_ok, req, 0)
        phys = block_table.to(torch.int64)[req_c[:, None], torch.where(ok, blk, 0)]
        ok &= phys >= 0
        slots = torch.where(ok, phys * block_size + ids.remainder(block_size), -1)
        return slots.to(dtype).contiguous()

    out = torch.empty((T, K), dtype=dtype, device=local_topk.device)
    if T and K:
        req_of_token = req_of_token.contiguous()  # read with unit stride (a no-op if it is)
        block_k = _block(K, hi=256)
        runtime.launch(
            _block_table_kernel,
            (T, triton.cdiv(K, block_k)),
            local_topk,
            block_table,
            req_of_token,
            out,
            K,
            local_topk.stride(0),
            local_topk.stride(1),
            block_table.stride(0),
            block_table.stride(1),
            B,
            max_blocks,
            block_size,
            BLOCK_K=block_k,
            interpret=runtime.runs_interpreted(local_topk),
            num_warps=4,
        )
    return out


# ----------------------------------------------------------------------------------------------
# The builders as registered ops, for torch.compile (module docstring)
# ----------------------------------------------------------------------------------------------

_LIB = torch.library.Library("sparse_mla", "FRAGMENT")
_LIB.define(
    "dense_to_csr(Tensor indices, Tensor? lengths, int? num_kv, int total, str impl, "
    "ScalarType indptr_dtype, bool? validate) -> (Tensor, Tensor)"
)
_LIB.define(
    "dsv4_combined_indices(Tensor? topk_indices, Tensor query_start_loc, Tensor seq_lens, "
    "int ratio, int? topk, int window, int pool_block_rows, int num_compressed, str impl, "
    "int total, int num_tokens, ScalarType dtype, ScalarType indptr_dtype, bool? validate) "
    "-> (Tensor, Tensor)"
)
_LIB.define(
    "global_topk_from_block_table(Tensor local_topk, Tensor block_table, Tensor req_of_token, "
    "int block_size, str impl, ScalarType dtype, bool? validate) -> Tensor"
)


def _dense_to_csr_op(indices, lengths, num_kv, total, impl, indptr_dtype, validate):
    return dense_to_csr(indices, lengths, num_kv, total, impl=impl, indptr_dtype=indptr_dtype,
                        validate=validate)  # fmt: skip


def _dsv4_combined_op(topk_indices, query_start_loc, seq_lens, ratio, topk, window,
                      pool_block_rows, num_compressed, impl, total, num_tokens, dtype,
                      indptr_dtype, validate):  # fmt: skip
    return dsv4_combined_indices(
        topk_indices, query_start_loc, seq_lens, ratio=ratio, topk=topk, window=window,
        pool_block_rows=pool_block_rows, num_compressed=num_compressed, impl=impl, total=total,
        num_tokens=num_tokens, dtype=dtype, indptr_dtype=indptr_dtype, validate=validate,
    )  # fmt: skip


def _global_topk_op(local_topk, block_table, req_of_token, block_size, impl, dtype, validate):
    return global_topk_from_block_table(local_topk, block_table, req_of_token, block_size,
                                        impl=impl, dtype=dtype, validate=validate)  # fmt: skip


# The real kernels run the eager functions (not compiling then), on every device.
_LIB.impl("dense_to_csr", _dense_to_csr_op, "CompositeExplicitAutograd")
_LIB.impl("dsv4_combined_indices", _dsv4_combined_op, "CompositeExplicitAutograd")
_LIB.impl("global_topk_from_block_table", _global_topk_op, "CompositeExplicitAutograd")


@torch.library.register_fake("sparse_mla::dense_to_csr", lib=_LIB)
def _dense_to_csr_fake(indices, lengths, num_kv, total, impl, indptr_dtype, validate):
    return (indices.new_empty(total),
            indices.new_empty(indices.shape[0] + 1, dtype=indptr_dtype))  # fmt: skip


@torch.library.register_fake("sparse_mla::dsv4_combined_indices", lib=_LIB)
def _dsv4_combined_fake(topk_indices, query_start_loc, seq_lens, ratio, topk, window,
                        pool_block_rows, num_compressed, impl, total, num_tokens, dtype,
                        indptr_dtype, validate):  # fmt: skip
    q = query_start_loc
    return q.new_empty(total, dtype=dtype), q.new_empty(num_tokens + 1, dtype=indptr_dtype)


@torch.library.register_fake("sparse_mla::global_topk_from_block_table", lib=_LIB)
def _global_topk_fake(local_topk, block_table, req_of_token, block_size, impl, dtype, validate):
    return local_topk.new_empty(local_topk.shape, dtype=dtype)
