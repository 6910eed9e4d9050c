"""fp32 references and error metrics: the single source of truth for what the kernels compute.

``mla_decode_ref`` defines MLA decode with page size 1 (the Gluon kernel's decode mode): request
b attends to the pool slots kv_indices[kv_indptr[b]:kv_indptr[b+1]]; logits = (q_nope·kv_c +
q_pe·k_pe) * sm_scale, and the output is P·kv_c (the latent row is the value).

``sparse_mla_prefill_ref`` defines the operator of DESIGN.md §2, for CSR slot lists and for the
dense [T, K] form (``kv_indptr=None``: row t is token t's list, or its first ``kv_lengths[t]``
ids). It is vectorised over tokens
and chunked so that a 16k-token call fits in memory: each chunk gathers its tokens' slots into a
padded ``[chunk, L, D]`` block, where ``L`` is the longest slot list in the chunk.

Error rule (after FlashAttention's tests): against the fp32 reference, a kernel's error may be
at most ``factor`` (2) times the error of plain PyTorch computing the same thing in the input
dtype, plus a small absolute floor for outputs that are almost exactly zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "ErrorReport",
    "check_against_reference",
    "error_report",
    "max_abs_error",
    "mla_decode_ref",
    "rel_l2_error",
    "sparse_mla_prefill_ref",
]

# Budget for one chunk's gathered rows, in elements (fp32): 64 Mi elements = 256 MiB.
_CHUNK_ELEMENTS = 64 * 1024 * 1024


def _slot_matrix(kv_indices, kv_indptr, t0, t1, num_kv):
    """Padded slot ids [t, L] (int64, invalid -> 0) and validity mask [t, L] for tokens t0..t1."""
    starts = kv_indptr[t0:t1].to(torch.int64)
    lengths = kv_indptr[t0 + 1 : t1 + 1].to(torch.int64) - starts
    width = int(lengths.max()) if lengths.numel() else 0
    col = torch.arange(width, device=kv_indices.device)
    in_row = col[None, :] < lengths[:, None]
    pos = torch.where(in_row, starts[:, None] + col[None, :], torch.zeros_like(col[None, :]))
    slots = kv_indices.to(torch.int64)[pos] if kv_indices.numel() else pos
    valid = in_row & (slots >= 0) & (slots < num_kv)
    return torch.where(valid, slots, torch.zeros_like(slots)), valid


def _slot_matrix_dense(kv_indices, t0, t1, num_kv, kv_lengths=None):
    """:func:`_slot_matrix` of the dense form: row t of kv_indices [T, K] is token t's list (its
    first kv_lengths[t] ids, clamped to [0, K], when given)."""
    slots = kv_indices[t0:t1].to(torch.int64)
    valid = (slots >= 0) & (slots < num_kv)
    if kv_lengths is not None:
        n = kv_lengths[t0:t1].to(device=slots.device, dtype=torch.int64)
        col = torch.arange(slots.shape[1], device=slots.device)
        valid &= col[None, :] < n[:, None]
    return torch.where(valid, slots, torch.zeros_like(slots)), valid


def _softmax_with_sink(logits, valid, sink):
    """Softmax over the valid columns of logits [t, H, L] plus an optional [H] sink column (in
    the denominator only). Returns (p [t, H, L], row_max [t, H, 1], denom [t, H, 1]); a row
    with nothing to attend to gets p = 0 and denom = 0 (or exp(sink - sink) with a sink)."""
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    row_max = logits.amax(dim=-1, keepdim=True)
    if sink is not None:
        row_max = torch.maximum(row_max, sink[None, :, None])
    # Nothing to attend to (-inf): shift by 0. A sink of +inf keeps row_max = +inf, so every
    # p is exp(x - inf) = 0 and the row is zeros (resetting it to 0 would overflow exp).
    row_max = torch.where(row_max == float("-inf"), torch.zeros_like(row_max), row_max)
    p = torch.exp(logits - row_max)
    denom = p.sum(dim=-1, keepdim=True)
    if sink is not None:
        denom = denom + torch.exp(sink[None, :, None] - row_max)
    p = p / torch.where(denom > 0, denom, torch.ones_like(denom))
    return p, row_max, denom


def sparse_mla_prefill_ref(
    q: torch.Tensor,
    kv: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor | None,
    softmax_scale: float,
    *,
    attn_sink: torch.Tensor | None = None,
    upcast: bool = True,
    chunk_tokens: int | None = None,
    kv_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sparse MLA prefill, computed plainly in PyTorch.

    Args:
        q: [T, H, D] queries.
        kv: [N, D] (or [N, 1, D]) latent KV pool; K and V are the same row.
        kv_indices: [nnz] slot ids; a slot s is valid iff 0 <= s < N, else it is absent.
            Or, with ``kv_indptr=None``, the dense form [T, K]: row t is token t's list.
        kv_indptr: [T+1] CSR offsets into kv_indices; None for the dense form.
        softmax_scale: multiplies q·k before the softmax.
        attn_sink: optional [H] fp32 sink logits, added to the denominator only.
        upcast: True (default) computes in fp32 and returns fp32: the reference. False computes
            in q's dtype (logits and P·V in that dtype, softmax in fp32 then rounded), the
            "plain PyTorch in the same dtype" baseline of the error rule.
        chunk_tokens: tokens per chunk (default: sized so a chunk's gather stays ~256 MiB).
        kv_lengths: dense form only: [T] rows' lengths, token t's list is
            ``kv_indices[t, :kv_lengths[t]]`` (a length outside [0, K] is clamped to it).

    Returns:
        [T, H, D] output, fp32 when ``upcast`` else q's dtype. Tokens with no valid slot get 0.
    """
    if kv.dim() == 3:
        kv = kv.reshape(kv.shape[0], kv.shape[-1])
    T, H, D = q.shape
    N = kv.shape[0]
    dtype = torch.float32 if upcast else q.dtype
    out = torch.zeros(T, H, D, dtype=dtype, device=q.device)
    if T == 0 or N == 0:
        return out
    sink = None if attn_sink is None else attn_sink.to(device=q.device, dtype=torch.float32)
    dense = kv_indptr is None
    if dense and kv_indices.dim() != 2:
        raise ValueError(f"kv_indptr=None needs dense kv_indices [T, K], got {kv_indices.shape}")
    if kv_lengths is not None and not dense:
        raise ValueError("kv_lengths goes with the dense form (kv_indptr=None)")
    if chunk_tokens is None:
        if dense:
            longest = max(kv_indices.shape[1], 1)
        else:
            lengths = (kv_indptr[1:] - kv_indptr[:-1]).to(torch.int64)
            longest = max(int(lengths.max()), 1)
        chunk_tokens = max(1, _CHUNK_ELEMENTS // (longest * max(D, H)))
    for t0 in range(0, T, chunk_tokens):
        t1 = min(T, t0 + chunk_tokens)
        if dense:
            slots, valid = _slot_matrix_dense(kv_indices, t0, t1, N, kv_lengths)
        else:
            slots, valid = _slot_matrix(kv_indices, kv_indptr, t0, t1, N)
        if slots.shape[1] == 0:
            continue
        rows = kv[slots].to(dtype)  # [t, L, D]
        rows = torch.where(valid[..., None], rows, torch.zeros((), dtype=dtype, device=q.device))
        qc = q[t0:t1].to(dtype)
        logits = torch.einsum("thd,tld->thl", qc, rows).float() * softmax_scale  # [t, H, L]
        p, _, _ = _softmax_with_sink(logits, valid, sink)
        o = torch.einsum("thl,tld->thd", p.to(dtype), rows)
        has_any = valid.any(dim=1)  # [t]
        out[t0:t1] = torch.where(has_any[:, None, None], o, torch.zeros((), dtype=dtype))
    return out


def rel_l2_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64 (0 when both are all zero; inf when only ref is)."""
    out = out.double()
    ref = ref.double()
    num = torch.linalg.vector_norm(out - ref).item()
    den = torch.linalg.vector_norm(ref).item()
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def max_abs_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    if out.numel() == 0:
        return 0.0
    return (out.double() - ref.double()).abs().max().item()


@dataclass(frozen=True)
class ErrorReport:
    """Errors of a result and of the same-dtype PyTorch baseline, both against fp32."""

    rel_l2: float
    max_abs: float
    baseline_rel_l2: float
    baseline_max_abs: float
    factor: float
    atol: float

    @property
    def ok(self) -> bool:
        """Within ``factor`` x the baseline's error (plus ``atol``), and no NaN anywhere."""
        if not (math.isfinite(self.rel_l2) and math.isfinite(self.max_abs)):
            return False
        return (
            self.max_abs <= self.factor * self.baseline_max_abs + self.atol
            and self.rel_l2 <= self.factor * self.baseline_rel_l2 + self.atol
        )

    def __str__(self) -> str:
        verdict = "ok" if self.ok else "FAIL"
        return (
            f"{verdict}: rel_l2 {self.rel_l2:.3e} (torch same dtype {self.baseline_rel_l2:.3e}), "
            f"max_abs {self.max_abs:.3e} (torch same dtype {self.baseline_max_abs:.3e}), "
            f"allowed {self.factor:g}x + {self.atol:g}"
        )


def error_report(
    out: torch.Tensor,
    ref: torch.Tensor,
    baseline: torch.Tensor,
    *,
    factor: float = 2.0,
    atol: float = 1e-5,
) -> ErrorReport:
    """Compare ``out`` and the same-dtype ``baseline`` against the fp32 ``ref``."""
    return ErrorReport(
        rel_l2=rel_l2_error(out, ref),
        max_abs=max_abs_error(out, ref),
        baseline_rel_l2=rel_l2_error(baseline, ref),
        baseline_max_abs=max_abs_error(baseline, ref),
        factor=factor,
        atol=atol,
    )


def check_against_reference(
    out: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor | None,
    softmax_scale: float,
    *,
    attn_sink: torch.Tensor | None = None,
    factor: float = 2.0,
    atol: float = 1e-5,
    kv_lengths: torch.Tensor | None = None,
) -> ErrorReport:
    """Error report of a prefill output against the fp32 reference (2x-PyTorch rule); CSR or,
    with ``kv_indptr=None``, dense [T, K] ids (and their rows' ``kv_lengths``)."""
    kwargs = dict(attn_sink=attn_sink, kv_lengths=kv_lengths)
    ref = sparse_mla_prefill_ref(q, kv, kv_indices, kv_indptr, softmax_scale, **kwargs)
    base = sparse_mla_prefill_ref(
        q, kv, kv_indices, kv_indptr, softmax_scale, upcast=False, **kwargs
    )
    return error_report(out, ref, base, factor=factor, atol=atol)


def mla_decode_ref(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    sm_scale: float,
    *,
    attn_sink: torch.Tensor | None = None,
    return_lse: bool = False,
    upcast: bool = True,
):
    """MLA decode attention, computed plainly in PyTorch.

    Args:
        q_nope: [B, H, Dc] (Dc = 512) latent queries.
        q_pe: [B, H, Dr] (Dr = 64) RoPE queries.
        kv_c: [N, Dc] (or [N, 1, Dc]) latent KV pool; K's first part and V.
        k_pe: [N, Dr] (or [N, 1, Dr]) RoPE keys.
        kv_indices: [nnz] slot ids (page size 1); s is valid iff 0 <= s < N.
        kv_indptr: [B+1] CSR offsets into kv_indices.
        sm_scale: multiplies the logits.
        attn_sink: optional [H] fp32 sink logit, in the denominator only.
        return_lse: also return the [B, H] fp32 natural-log LSE of the softmax denominator
            (sink included; -inf for a request with nothing to attend to).
        upcast: True computes in fp32 (the reference); False in q's dtype (the baseline).

    Returns:
        [B, H, Dc] output (fp32 when ``upcast``), zeros for requests with no valid slot;
        with ``return_lse``, (out, lse).
    """
    if kv_c.dim() == 3:
        kv_c = kv_c.reshape(kv_c.shape[0], kv_c.shape[-1])
    if k_pe.dim() == 3:
        k_pe = k_pe.reshape(k_pe.shape[0], k_pe.shape[-1])
    B, H, Dc = q_nope.shape
    N = kv_c.shape[0]
    dtype = torch.float32 if upcast else q_nope.dtype
    dev = q_nope.device
    out = torch.zeros(B, H, Dc, dtype=dtype, device=dev)
    lse = torch.full((B, H), float("-inf"), dtype=torch.float32, device=dev)
    sink = None if attn_sink is None else attn_sink.to(device=dev, dtype=torch.float32)
    if B == 0:
        return (out, lse) if return_lse else out
    slots, valid = _slot_matrix(kv_indices, kv_indptr, 0, B, N)  # [B, L]
    if N == 0 or slots.shape[1] == 0:
        if sink is not None:
            lse = sink[None, :].expand(B, H).clone()
        return (out, lse) if return_lse else out
    rows_c = kv_c[slots].to(dtype)  # [B, L, Dc]
    rows_r = k_pe[slots].to(dtype)  # [B, L, Dr]
    zero = torch.zeros((), dtype=dtype, device=dev)
    rows_c = torch.where(valid[..., None], rows_c, zero)
    rows_r = torch.where(valid[..., None], rows_r, zero)
    logits = torch.einsum("bhd,bld->bhl", q_nope.to(dtype), rows_c).float()
    logits = logits + torch.einsum("bhd,bld->bhl", q_pe.to(dtype), rows_r).float()
    p, row_max, denom = _softmax_with_sink(logits * sm_scale, valid, sink)  # [B, H, L]
    o = torch.einsum("bhl,bld->bhd", p.to(dtype), rows_c)
    has_any = valid.any(dim=1)
    out = torch.where(has_any[:, None, None], o, zero)
    lse = torch.where(denom[..., 0] > 0, torch.log(denom[..., 0]) + row_max[..., 0], lse)
    return (out, lse) if return_lse else out
