"""Input validation shared by every sparse-prefill entry (Triton, Gluon, the dispatcher).

:func:`validate_inputs` checks the arguments the kernels share (queries, pool, CSR indices,
scale, sink, output buffer) and returns them ready to launch: the pool as [N, D], the small 1-D
tensors contiguous (a strided view such as ``sinks[:, layer]`` is copied, a contiguous one is
passed through untouched), ``q`` with a unit last stride. Every rejection is a ``TypeError`` or
``ValueError`` that names the argument, raised before anything is written.

Two forms of the slot lists: CSR (``kv_indices`` [nnz] with ``kv_indptr`` [T+1]) and dense
(``kv_indices`` [T, K] with ``kv_indptr=None``: token t's list is ``kv_indices[t, :]``, -1 or any
other id outside [0, N) absent, as an engine's top-k output is). :func:`dense_as_csr` turns the
dense form into CSR on its device (no host sync) for a kernel that reads only CSR.

Dense ids may come with per-row lengths (the entry's ``kv_lengths``, FlashMLA's
``topk_length``): token t's list is then ``kv_indices[t, :kv_lengths[t]]``. Below the entry they
travel in ``kv_indptr``'s place: at the entry (CSR needs a 1-D ``kv_indices``) a 2-D
``kv_indices`` with a ``kv_indptr`` tensor means dense ids and their [T] lengths; at a launch,
where dense rows may also be handed over as CSR with a kept kv_indptr of T + 1 or more entries,
:func:`dense_form` tells the three forms apart. :func:`dense_lengths_csr` packs dense rows with
lengths into CSR on the device for a kernel that reads only CSR.

``kv_indptr`` values are checked on the host when that costs no device sync: always for CPU
tensors, and for GPU tensors with ``validate=True`` or ``SPARSE_MLA_VALIDATE=1`` in the
environment (read per call). The kernels also clamp each token's CSR range to
``[0, kv_indices.numel()]``, so an unchecked bad ``kv_indptr`` can never make them read outside
``kv_indices`` (see :func:`sparse_mla.prefill.sparse_mla_prefill` for what such a token gets).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ._consts import LOG2E as _LOG2E
from ._env import getenv

__all__ = [
    "ENV_VALIDATE", "LENGTH_BOUND_STEP", "Inputs", "check_indptr", "check_lengths",
    "check_ptr_values", "dense_as_csr", "dense_form", "dense_ids_value", "dense_launch",
    "dense_lengths_csr", "length_bound", "planned_nnz", "validate_inputs",
]  # fmt: skip

ENV_VALIDATE = "SPARSE_MLA_VALIDATE"
FLOAT_TYPES = (torch.float16, torch.bfloat16)
INDEX_TYPES = (torch.int32, torch.int64)
_FP32_MAX = 3.4028234663852886e38


@dataclass(frozen=True)
class Inputs:
    """Arguments after :func:`validate_inputs`: what a launcher passes to its kernel."""

    q: torch.Tensor  # [T, H, D], last-dim stride 1
    kv: torch.Tensor  # [N, D], last-dim stride 1 (when N > 0)
    kv_indices: torch.Tensor  # [nnz] (CSR) or [T, K] (dense), contiguous
    # CSR: [T + 1], contiguous. Dense kv_indices: None, or the rows' lengths [T], contiguous.
    kv_indptr: torch.Tensor | None
    softmax_scale: float
    attn_sink: torch.Tensor | None  # [H] fp32, contiguous
    out: torch.Tensor | None  # the caller's buffer, as given


def _desc(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__


def _is_fp8(t: torch.Tensor) -> bool:
    return "float8" in str(t.dtype)


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, last byte + 1) that a non-empty tensor's elements occupy."""
    last = 0
    for n, s in zip(t.shape, t.stride(), strict=True):
        last += (n - 1) * s
    p = t.data_ptr()
    return p, p + (last + 1) * t.element_size()


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


def _has_internal_overlap(t: torch.Tensor) -> bool:
    """True unless the dims, sorted by stride, each step past the whole of the smaller ones
    (a sufficient condition for distinct elements at distinct addresses)."""
    dims = sorted((s, n) for n, s in zip(t.shape, t.stride(), strict=True) if n > 1)
    extent = 1
    for stride, size in dims:
        if stride < extent:
            return True
        extent = stride * size
    return False


def check_indptr(kv_indptr: torch.Tensor, nnz: int, name: str = "kv_indptr") -> None:
    """Raise ValueError unless 0 <= kv_indptr[0] <= kv_indptr[1] <= ... <= kv_indptr[-1] <= nnz.

    Reads the values: call it only where that costs no device sync (CPU tensors) or where the
    caller asked for it. A first entry above 0 is allowed (the list is a window of kv_indices).
    """
    ptr = kv_indptr.detach().to(device="cpu", dtype=torch.int64)
    if ptr.numel() == 0:
        return
    first, last = int(ptr[0]), int(ptr[-1])
    if first < 0:
        raise ValueError(f"{name}[0] = {first} is negative; CSR offsets start at >= 0")
    steps = ptr[1:] - ptr[:-1]
    if steps.numel() and bool((steps < 0).any()):
        t = int((steps < 0).nonzero()[0])
        raise ValueError(
            f"{name} must be non-decreasing, but {name}[{t}] = {int(ptr[t])} > "
            f"{name}[{t + 1}] = {int(ptr[t + 1])}"
        )
    if last > nnz:
        raise ValueError(
            f"{name}[-1] = {last} is past the end of kv_indices ({nnz} entries); it would read "
            "outside kv_indices"
        )


def check_lengths(kv_lengths: torch.Tensor, width: int, name: str = "kv_lengths") -> None:
    """Raise ValueError unless 0 <= kv_lengths[t] <= width (K, the dense ids' row length) for
    every t. Reads the values, as :func:`check_indptr` does."""
    n = kv_lengths.detach().to(device="cpu", dtype=torch.int64)
    if n.numel() == 0:
        return
    bad = ((n < 0) | (n > width)).nonzero()
    if bad.numel():
        t = int(bad[0])
        raise ValueError(
            f"{name}[{t}] = {int(n[t])} is outside [0, K = {width}] (K: kv_indices' row length)"
        )


def check_ptr_values(kv_indices: torch.Tensor, kv_indptr: torch.Tensor) -> None:
    """The value check of a validated call's ``kv_indptr``: :func:`check_indptr` for CSR,
    :func:`check_lengths` for dense ids' lengths (a 2-D ``kv_indices``)."""
    if kv_indices.dim() == 2:
        check_lengths(kv_indptr, kv_indices.shape[1])
    else:
        check_indptr(kv_indptr, kv_indices.numel())


def _slot_lists(kv_indices, kv_indptr, kv_lengths):
    """What the op takes in ``kv_indptr``'s place: kv_indptr (CSR), None (dense) or the dense
    rows' lengths (:mod:`sparse_mla.validation` says why they share it). Raises ValueError when
    the three do not make one of those forms."""
    dense = isinstance(kv_indices, torch.Tensor) and kv_indices.dim() == 2
    if kv_lengths is not None:
        if kv_indptr is not None:
            raise ValueError(
                "kv_lengths goes with the dense form (kv_indices [T, K], kv_indptr=None), but a "
                "kv_indptr was given too"
            )
        if not dense:
            raise ValueError(
                f"kv_lengths goes with dense [T, K] kv_indices, got "
                f"{_desc(kv_indices)} (a CSR list's lengths are in its kv_indptr)"
            )
        return kv_lengths
    if kv_indptr is not None and dense:
        raise ValueError(
            f"kv_indices is 2-D {tuple(kv_indices.shape)} (the dense [T, K] form) but a "
            "kv_indptr was given: pass kv_indptr=None for the dense form (and the rows' "
            "lengths, if any, as kv_lengths), or a 1-D kv_indices with kv_indptr (CSR)"
        )
    return kv_indptr


# max_kv_length rounds up to whole 64-slot tiles (the kernels' KV tile), so a bound that grows
# by a token a step keeps one plan (and one kernel choice) for 64 steps.
LENGTH_BOUND_STEP = 64


def length_bound(max_kv_length, kv_indices, kv_lengths) -> int | None:
    """The entry's ``max_kv_length`` as the kernel choice and split count use it: None when it
    is not given; else, checked (an int >= 0, given with dense ids and their ``kv_lengths``),
    rounded up to a multiple of :data:`LENGTH_BOUND_STEP` and at most K (the ids' row length).
    TypeError/ValueError naming it otherwise."""
    if max_kv_length is None:
        return None
    if isinstance(max_kv_length, bool) or not hasattr(type(max_kv_length), "__index__"):
        raise TypeError(f"max_kv_length must be an int or None, got {type(max_kv_length).__name__}")
    max_kv_length = operator.index(max_kv_length)  # a numpy or torch integer scalar too
    if max_kv_length < 0:
        raise ValueError(f"max_kv_length must be >= 0, got {max_kv_length}")
    if kv_lengths is None or not isinstance(kv_indices, torch.Tensor) or kv_indices.dim() != 2:
        raise ValueError(
            "max_kv_length bounds the rows' kv_lengths: it goes with dense [T, K] kv_indices and "
            "their kv_lengths (a CSR call's lists are known by their total length already)"
        )
    step = LENGTH_BOUND_STEP
    return min(kv_indices.shape[1], -(-max_kv_length // step) * step)


def planned_nnz(kv_indices: torch.Tensor, bound: int | None) -> int:
    """The lists' total length a call's kernel choice and split count plan for: T x ``bound``
    (:func:`length_bound`'s) when given, else ``kv_indices.numel()`` (for dense ids with
    lengths, T x K: every row taken as whole, since reading the lengths would sync)."""
    if bound is None:
        return kv_indices.numel()
    return kv_indices.shape[0] * bound


def _wants_value_check(validate: bool | None, device: torch.device) -> bool:
    if validate is not None:
        return bool(validate)
    if device.type == "cpu":
        return True
    return _env_asks_values()


def _env_asks_values() -> bool:
    """Whether ``SPARSE_MLA_VALIDATE`` asks GPU calls to check kv_indptr's values."""
    return (getenv(ENV_VALIDATE) or "").strip().lower() in ("1", "true", "yes", "on")


# Layouts that passed every check that reads no address and no value, keyed by (head_dim,
# then shape, strides, dtype and device of q, kv, kv_indices, kv_indptr, attn_sink, out) ->
# the byte extents the overlap check needs. A call with a known layout re-checks only what
# depends on more than the layout: the scale, out's overlap with the inputs (their addresses)
# and, when asked, kv_indptr's values. Only plain tensors whose layout needs no copy or view
# (q's last stride 1, a 2-D kv, contiguous 1-D tensors) and the default names are recorded.
_LAYOUTS: dict[tuple, tuple] = {}
_LAYOUTS_MAX = 1024


def _layout_key(q, kv, kv_indices, kv_indptr, attn_sink, out, head_dim) -> tuple:
    s = attn_sink
    return (
        head_dim, q.shape, q.stride(), q.dtype, q.device, kv.shape, kv.stride(), kv.dtype,
        kv.device, kv_indices.shape, kv_indices.stride(), kv_indices.dtype, kv_indices.device,
        None if kv_indptr is None else (kv_indptr.shape, kv_indptr.stride(), kv_indptr.dtype,
                                        kv_indptr.device),
        None if s is None else (s.shape, s.stride(), s.dtype, s.device),
        None if out is None else (out.shape, out.stride(), out.dtype, out.device),
    )  # fmt: skip


def _extent(t: torch.Tensor) -> int:
    """Bytes from a tensor's first element to past its last (0: empty)."""
    if t.numel() == 0:
        return 0
    lo, hi = _span(t)
    return hi - lo


def _record_layout(key, x: Inputs, q, kv, kv_indices, kv_indptr, attn_sink, out) -> None:
    if x.q is not q or x.kv is not kv or x.kv_indices is not kv_indices:
        return
    if x.kv_indptr is not kv_indptr or x.attn_sink is not attn_sink:
        return
    if len(_LAYOUTS) >= _LAYOUTS_MAX:
        _LAYOUTS.clear()
    inputs = (kv, kv_indices, kv_indptr, attn_sink)
    out_ext = 0 if out is None else _extent(out)
    same_strides = out is not None and out.stride() == q.stride()
    exts = tuple(0 if t is None else _extent(t) for t in inputs)
    _LAYOUTS[key] = (out_ext, _extent(q), same_strides, exts)


def _overlaps_known(layout, q, kv, kv_indices, kv_indptr, attn_sink, out) -> bool:
    """Whether out overlaps q (other than as the same view) or an input, from the recorded
    extents and today's addresses (the test of _check_out_memory)."""
    out_ext, q_ext, same_strides, (e0, e1, e2, e3) = layout
    o0 = out.data_ptr()
    o1 = o0 + out_ext
    if q_ext:
        q0 = q.data_ptr()
        if not (same_strides and q0 == o0) and o0 < q0 + q_ext and q0 < o1:
            return True
    # each input's extent; 0: empty or absent (a dense call's kv_indptr, no sink). Unrolled:
    # the replay of a plan runs this on every call.
    return bool(
        (e0 and o0 < (t := kv.data_ptr()) + e0 and t < o1)
        or (e1 and o0 < (t := kv_indices.data_ptr()) + e1 and t < o1)
        or (e2 and o0 < (t := kv_indptr.data_ptr()) + e2 and t < o1)
        or (e3 and o0 < (t := attn_sink.data_ptr()) + e3 and t < o1)
    )


def validate_inputs(
    q,
    kv,
    kv_indices,
    kv_indptr,
    softmax_scale,
    *,
    attn_sink=None,
    out=None,
    head_dim: int | None = None,
    validate: bool | None = None,
    names: Mapping[str, str] | None = None,
) -> Inputs:
    """Check the shared arguments of a sparse-prefill call (DESIGN.md §2) and normalise them.

    Args:
        q, kv, kv_indices, kv_indptr, softmax_scale, attn_sink, out: as in
            :func:`sparse_mla.sparse_mla_prefill` (``kv_indptr=None``: ``kv_indices`` is the
            dense [T, K] form; it has no values to check).
        head_dim: the only head dim the kernel serves (Gluon: 512); None: any D >= 1.
        validate: check ``kv_indptr``'s values on the host (True), never (False), or when it
            costs no device sync (None: CPU tensors, or ``SPARSE_MLA_VALIDATE=1`` for GPU ones).
        names: how the caller names the arguments in messages, e.g. ``{"q": "q_nope"}``.

    Returns:
        :class:`Inputs`. Raises TypeError/ValueError naming the argument otherwise.

    The checks that read only shapes, strides, dtypes and devices run once per layout (a call
    whose layout passed them before re-checks the scale, the overlap of ``out`` with the
    inputs and, when asked, ``kv_indptr``'s values); any failure takes the full path, which
    raises the named error.
    """
    T = torch.Tensor
    plain = (
        names is None and type(q) is T and type(kv) is T and type(kv_indices) is T
        and (kv_indptr is None or type(kv_indptr) is T)
        and (attn_sink is None or type(attn_sink) is T)
        and (out is None or type(out) is T) and type(softmax_scale) is float
    )  # fmt: skip
    key = None
    if plain:
        key = _layout_key(q, kv, kv_indices, kv_indptr, attn_sink, out, head_dim)
        layout = _LAYOUTS.get(key)
        if (
            layout is not None
            and math.isfinite(softmax_scale)
            and abs(softmax_scale) * _LOG2E <= _FP32_MAX
            and (out is None or not layout[0]
                 or not _overlaps_known(layout, q, kv, kv_indices, kv_indptr, attn_sink, out))
        ):  # fmt: skip
            if kv_indptr is not None and _wants_value_check(validate, q.device):
                check_ptr_values(kv_indices, kv_indptr)
            return Inputs(q, kv, kv_indices, kv_indptr, softmax_scale, attn_sink, out)
    x = _validate_inputs(
        q, kv, kv_indices, kv_indptr, softmax_scale, attn_sink=attn_sink, out=out,
        head_dim=head_dim, validate=validate, names=names,
    )  # fmt: skip
    if key is not None:
        _record_layout(key, x, q, kv, kv_indices, kv_indptr, attn_sink, out)
    return x


def _validate_inputs(
    q,
    kv,
    kv_indices,
    kv_indptr,
    softmax_scale,
    *,
    attn_sink=None,
    out=None,
    head_dim: int | None = None,
    validate: bool | None = None,
    names: Mapping[str, str] | None = None,
) -> Inputs:
    """Check the shared arguments of a sparse-prefill call (DESIGN.md §2) and normalise them.

    Args:
        q, kv, kv_indices, kv_indptr, softmax_scale, attn_sink, out: as in
            :func:`sparse_mla.sparse_mla_prefill`.
        head_dim: the only head dim the kernel serves (Gluon: 512); None: any D >= 1.
        validate: check ``kv_indptr``'s values on the host (True), never (False), or when it
            costs no device sync (None: CPU tensors, or ``SPARSE_MLA_VALIDATE=1`` for GPU ones).
        names: how the caller names the arguments in messages, e.g. ``{"q": "q_nope"}``.

    Returns:
        :class:`Inputs`. Raises TypeError/ValueError naming the argument otherwise.
    """
    n = {"q": "q", "kv": "kv", "softmax_scale": "softmax_scale", **(names or {})}
    nq, nkv, nscale = n["q"], n["kv"], n["softmax_scale"]
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"{nq} must be a [T, H, D] tensor, got {_desc(q)}")
    if q.dtype not in FLOAT_TYPES:
        raise TypeError(f"{nq} must be float16 or bfloat16, got {q.dtype}")
    if q.device.type not in ("cpu", "cuda"):  # ROCm's torch calls its GPUs "cuda" too
        hint = " (meta tensors hold no data)" if q.device.type == "meta" else ""
        raise ValueError(
            f"{nq} is on {q.device}{hint}; the kernels run on CPU tensors (Triton's interpreter) "
            "or on CUDA/ROCm GPU tensors"
        )
    T, H, D = q.shape
    if head_dim is not None and head_dim != D:
        raise ValueError(f"{nq} head dim must be {head_dim}, got {D}")
    if D < 1:
        raise ValueError(f"{nq} head dim D must be >= 1, got shape {tuple(q.shape)}")
    if q.stride(-1) != 1:
        q = q.contiguous()  # the kernels index the last dim with unit stride
    if not isinstance(kv, torch.Tensor):
        raise TypeError(f"{nkv} must be a tensor, got {type(kv).__name__}")
    if kv.dim() == 3:
        if kv.shape[1] != 1:
            raise ValueError(f"{nkv} must be [N, D] or [N, 1, D], got shape {tuple(kv.shape)}")
        kv = kv[:, 0, :]
    if kv.dim() != 2:
        raise ValueError(f"{nkv} must be [N, D] or [N, 1, D], got shape {tuple(kv.shape)}")
    if kv.dtype != q.dtype:
        fp8 = (
            "pass an fp8 KV cache in FlashMLA's MODEL1 layout as sparse_mla.FP8Cache(data, "
            "block_size); "
            if _is_fp8(kv)
            else ""
        )
        raise TypeError(
            f"{nkv} dtype {kv.dtype} must match {nq} dtype {q.dtype} ({fp8}K and V are {nkv})"
        )
    if kv.shape[1] != D:
        raise ValueError(f"{nkv} head dim {kv.shape[1]} does not match {nq} head dim {D}")
    if kv.shape[0] > 0 and kv.stride(1) != 1:
        raise ValueError(
            f"{nkv} must have a contiguous last dim (stride 1), got strides {kv.stride()} "
            "(copying the pool per call would cost more than the kernel)"
        )
    dense = kv_indptr is None or (isinstance(kv_indices, torch.Tensor) and kv_indices.dim() == 2)
    if dense:
        _check_dense_ids(kv_indices, T)
        if kv_indptr is not None:  # the rows' lengths, in kv_indptr's place (module docstring)
            if not isinstance(kv_indptr, torch.Tensor) or kv_indptr.dim() != 1:
                raise ValueError(f"kv_lengths must be a 1-D tensor, got {_desc(kv_indptr)}")
            if kv_indptr.dtype not in INDEX_TYPES:
                raise TypeError(f"kv_lengths must be int32 or int64, got {kv_indptr.dtype}")
            if kv_indptr.numel() != T:
                raise ValueError(
                    f"kv_lengths must have T = {T} entries, one per row of kv_indices, got "
                    f"{kv_indptr.numel()}"
                )
    else:
        for name, t in (("kv_indices", kv_indices), ("kv_indptr", kv_indptr)):
            if not isinstance(t, torch.Tensor) or t.dim() != 1:
                raise ValueError(f"{name} must be a 1-D tensor, got {_desc(t)}")
            if t.dtype not in INDEX_TYPES:
                raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
        if kv_indptr.numel() != T + 1:
            raise ValueError(f"kv_indptr must have T+1 = {T + 1} entries, got {kv_indptr.numel()}")
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"{nscale} must be a float, got {type(softmax_scale).__name__}")
    try:
        finite = math.isfinite(softmax_scale)
    except OverflowError:  # an int past float's range, e.g. 10**400
        finite = False
    if not finite:
        got = softmax_scale if isinstance(softmax_scale, float) else "an int past float's range"
        raise ValueError(f"{nscale} must be finite, got {got}")
    if abs(float(softmax_scale)) * _LOG2E > _FP32_MAX:
        raise ValueError(f"{nscale} = {softmax_scale} overflows fp32 (the kernels' logit scale)")
    if attn_sink is not None:
        if not isinstance(attn_sink, torch.Tensor):
            raise TypeError(f"attn_sink must be a tensor or None, got {type(attn_sink).__name__}")
        if attn_sink.dtype != torch.float32:
            raise TypeError(f"attn_sink must be float32, got {attn_sink.dtype}")
        if tuple(attn_sink.shape) != (H,):
            raise ValueError(
                f"attn_sink must have shape [H] = ({H},), got {tuple(attn_sink.shape)}"
            )
    named = [(nkv, kv), ("kv_indices", kv_indices)]
    if kv_indptr is not None:
        named.append(("kv_lengths" if dense else "kv_indptr", kv_indptr))
    if attn_sink is not None:
        named.append(("attn_sink", attn_sink))
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a tensor or None, got {type(out).__name__}")
        if tuple(out.shape) != (T, H, D):
            raise ValueError(f"out shape {tuple(out.shape)} must equal {nq} shape {(T, H, D)}")
        if out.dtype != q.dtype:
            raise TypeError(f"out dtype {out.dtype} must equal {nq} dtype {q.dtype}")
        if out.numel() and out.stride(-1) != 1:
            raise ValueError(f"out must have last-dim stride 1, got strides {out.stride()}")
        named.append(("out", out))
    for name, t in named:
        if t.device != q.device:
            raise ValueError(
                f"{name} is on {t.device} but {nq} is on {q.device}; devices must match"
            )
    if out is not None and out.numel():
        _check_out_memory(out, q, named[:-1], nq)
    # Dense [T, K] ids of any other strides (a column slice of a wider top-k buffer, a
    # transposed view) are copied, as a strided 1-D list is: the kernels read row t at t * K.
    kv_indices = kv_indices.contiguous()
    if kv_indptr is not None:
        kv_indptr = kv_indptr.contiguous()
    if attn_sink is not None:
        attn_sink = attn_sink.contiguous()
    if kv_indptr is not None and _wants_value_check(validate, q.device):
        check_ptr_values(kv_indices, kv_indptr)
    return Inputs(q, kv, kv_indices, kv_indptr, float(softmax_scale), attn_sink, out)


def _check_dense_ids(kv_indices, T: int) -> None:
    """The dense form's kv_indices (kv_indptr None): [T, K] int32/int64."""
    if not isinstance(kv_indices, torch.Tensor) or kv_indices.dim() != 2:
        if isinstance(kv_indices, torch.Tensor) and kv_indices.dim() == 1:
            raise ValueError(
                f"kv_indptr is None, so kv_indices must be the dense [T, K] form, got a 1-D "
                f"tensor of shape {tuple(kv_indices.shape)} (a CSR list needs its kv_indptr)"
            )
        raise ValueError(
            f"kv_indices must be a 1-D tensor with kv_indptr, or a [T, K] tensor with "
            f"kv_indptr=None, got {_desc(kv_indices)}"
        )
    if kv_indices.dtype not in INDEX_TYPES:
        raise TypeError(f"kv_indices must be int32 or int64, got {kv_indices.dtype}")
    if kv_indices.shape[0] != T:
        raise ValueError(
            f"kv_indices (dense, kv_indptr=None) must have T = {T} rows, one per token, got "
            f"shape {tuple(kv_indices.shape)}"
        )


def dense_as_csr(kv_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The CSR form of validated dense ids [T, K] (contiguous): (kv_indices flattened, a view;
    kv_indptr = [0, K, 2K, ..., T K], built on their device by one ``arange``, no host sync).
    kv_indptr is int64 when T K does not fit int32, else in kv_indices' dtype."""
    T, K = kv_indices.shape
    dtype = kv_indices.dtype if T * K < 2**31 else torch.int64
    if K == 0:
        ptr = torch.zeros(T + 1, dtype=dtype, device=kv_indices.device)
    else:
        ptr = torch.arange(0, (T + 1) * K, K, dtype=dtype, device=kv_indices.device)
    return kv_indices.reshape(-1), ptr


# The kv_indptr of dense ids for the kernels that read CSR only, [0, K, 2K, ...]: the same for
# every call with the same K, dtype and device, so it is made once for up to the most tokens seen
# and kept. A launch reads entries 0..T of it. A tensor once handed to a launch (a plan's replay
# keeps its address, a CUDA graph reads it) is never freed: a longer one is added beside it, at
# least twice as long, so a key holds at most ~log2(T) of them.
_DENSE_PTRS: dict[tuple, list[torch.Tensor]] = {}


def _dense_launch_csr(kv_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`dense_as_csr` for a launch: (kv_indices itself, [T, K] contiguous: a kernel reads
    it through its address and numel, the flattened view's; a kv_indptr whose entries 0..T are
    dense_as_csr's, kept as above). With a kept one long enough no torch op runs, so the call
    can be planned (:mod:`sparse_mla.op`). Inside a CUDA-graph capture a new one is made and
    not kept (the graph's memory), as dense_as_csr does."""
    if not kv_indices.is_contiguous():  # (validated ids are; a kernel reads them as flat rows)
        kv_indices = kv_indices.contiguous()
    T, K = kv_indices.shape
    dtype = kv_indices.dtype if T * K < 2**31 else torch.int64
    dev = kv_indices.device
    key = (K, dtype, dev)
    kept = _DENSE_PTRS.get(key)
    if kept and kept[-1].numel() > T:
        return kv_indices, kept[-1]
    if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return dense_as_csr(kv_indices)
    n = max(T + 1, 2 * kept[-1].numel() if kept else 0)
    if dtype == torch.int32 and K:
        n = min(n, (2**31 - 1) // K + 1)  # entries up to (n - 1) K fit; T K < 2^31 keeps n > T
    ptr = torch.arange(n, dtype=dtype, device=dev).mul_(K)
    _DENSE_PTRS.setdefault(key, []).append(ptr)
    return kv_indices, ptr


def dense_form(kv_indices: torch.Tensor, kv_indptr: torch.Tensor | None) -> int:
    """How a launch's slot lists read (the kernels' ``DENSE_IDS``): 0 CSR, 1 dense rows, 2 dense
    rows with their lengths. A 2-D ``kv_indices`` is dense with no ``kv_indptr`` and with the
    rows' lengths ([T], in kv_indptr's place); with a longer kv_indptr (T + 1 entries or more:
    :func:`_dense_launch_csr`'s, :func:`dense_as_csr`'s) it is CSR over the flattened rows."""
    if kv_indices.dim() == 1:
        return 0
    if kv_indptr is None:
        return 1
    return 2 if kv_indptr.numel() == kv_indices.shape[0] else 0


def dense_ids_value(form: int | bool):
    """The kernels' ``DENSE_IDS`` constexpr for a :func:`dense_form` (or a compile shape's
    ``dense`` flag: True / 1 / 2): True for dense rows, 2 with their lengths (only passed when
    set, so a CSR launch is the kernel it always was)."""
    return True if form is True or form == 1 else 2


def dense_launch(kv_indices: torch.Tensor, kv_indptr: torch.Tensor | None):
    """A launch's (``DENSE_IDS`` or None for CSR, kv_indptr argument, ``ids_per_row``): CSR as
    it is with 0; dense rows with K, kv_indices standing in for the unused kv_indptr pointer;
    dense rows with their lengths with K, the lengths in its place (:func:`dense_form`)."""
    form = dense_form(kv_indices, kv_indptr)
    if form == 0:
        return None, kv_indptr, 0
    ptr = kv_indices if form == 1 else kv_indptr
    return dense_ids_value(form), ptr, kv_indices.shape[1]


def dense_lengths_csr(
    kv_indices: torch.Tensor, kv_lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The CSR form of validated dense ids [T, K] (contiguous) with their rows' lengths [T]:
    (ids [T K], kv_indptr [T + 1]) where token t's list is ``kv_indices[t, :n_t]``, n_t =
    kv_lengths[t] clamped to [0, K] (as the kernels that read lengths clamp them). Built on
    the device by a few torch ops, no host sync: the lists packed to the front of a [T K]
    buffer (the tail past kv_indptr[T] is never read), kv_indptr their running sum. kv_indptr
    is int64 when T K does not fit int32, else in kv_indices' dtype."""
    T, K = kv_indices.shape
    dev = kv_indices.device
    dtype = kv_indices.dtype if T * K < 2**31 else torch.int64
    n = kv_lengths.to(torch.int64).clamp(0, K)
    ptr = torch.zeros(T + 1, dtype=torch.int64, device=dev)
    torch.cumsum(n, 0, out=ptr[1:])
    j = torch.arange(K, device=dev)
    # Slot (t, j) goes to ptr[t] + j when j < n_t, else to a spare last element (never read).
    dest = torch.where(j[None, :] < n[:, None], ptr[:-1, None] + j[None, :], T * K)
    buf = torch.empty(T * K + 1, dtype=kv_indices.dtype, device=dev)
    buf.scatter_(0, dest.reshape(-1), kv_indices.reshape(-1))
    return buf[: T * K], ptr.to(dtype)


def _check_out_memory(out, q, inputs, nq) -> None:
    """``out`` must not overlap itself or an input; ``out`` may be ``q`` itself (in place:
    each program reads its own block of q before it writes the same block of out)."""
    if _has_internal_overlap(out):
        raise ValueError(
            f"out has overlapping elements (strides {out.stride()} for shape {tuple(out.shape)})"
        )
    # The same test as _shares_memory (devices already match), with out's span computed once.
    o0, o1 = _span(out)
    same_view = out.data_ptr() == q.data_ptr() and out.stride() == q.stride()
    if not same_view and q.numel():
        q0, q1 = _span(q)
        if o0 < q1 and q0 < o1:
            raise ValueError(f"out overlaps {nq} (only out={nq} itself, the same view, is allowed)")
    for name, t in inputs:
        if t.numel():
            t0, t1 = _span(t)
            if o0 < t1 and t0 < o1:
                raise ValueError(f"out overlaps {name}; the kernel would read what it writes")
