"""Captured engine inputs: record a prefill call, store it compactly, rebuild it, replay it.

File format
-----------
One ``.safetensors`` file per call. Tensors:

========== ============== ===================================================================
name        shape          contents
========== ============== ===================================================================
q           [T, H, D]      the queries (made contiguous)
kv_rows     [U, D]         the pool rows that some slot references (valid slots only)
kv_slots    [U] int64      their original slot ids, ascending
kv_indices  [nnz]          slot ids exactly as given (dtype kept: int32 or int64)
kv_indptr   [T+1]          CSR offsets exactly as given
attn_sink   [H] fp32       only when the call had a sink
========== ============== ===================================================================

The JSON metadata lives in the safetensors header (``__metadata__["sparse_mla.capture"]``), so
a capture is a single file that is written atomically (temp file in the same folder, fsync,
``os.replace``). It holds the call (shapes, dtypes, strides, pool size N, scale), slot
statistics, the source (what was wrapped, call number, workload), package/torch/Triton/Python
versions, the device, and ``content_sha256``: a SHA-256 over every tensor's bytes and the rest of
the metadata, checked on load so a truncated or edited file fails with :class:`CaptureError`.
Print it with ``sparse-mla replay FILE --info`` or ``load_capture(FILE).metadata``.

Replay rebuilds a pool of the original N rows (optionally inside a >2 GiB buffer, as an engine
allocates it) with every row that no slot references set to NaN, so a kernel that reads a row it
should not (an invalid slot clamped into range, a wrong offset) produces NaN and fails loudly.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib
import json
import math
import os
import platform
import stat
import struct
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ._files import atomic_write as _atomic_write
from .validation import check_indptr

__all__ = [
    "ENGINES",
    "Capture",
    "CaptureError",
    "CaptureTooLarge",
    "EngineMapping",
    "Recorder",
    "ReplayReport",
    "aiter_pa_prefill_sparse_extract",
    "encode_capture",
    "flashmla_sparse_extract",
    "load_capture",
    "replay",
    "save_capture",
    "slot_stats",
    "update_metadata",
]

FORMAT = "sparse_mla.capture"
FORMAT_VERSION = 1
_META_KEY = "sparse_mla.capture"
_HASH_KEY = "content_sha256"
_TENSOR_ORDER = ("q", "kv_rows", "kv_slots", "kv_indices", "kv_indptr", "attn_sink")


class CaptureError(ValueError):
    """A capture file that cannot be trusted: not safetensors, truncated, or modified."""


class CaptureTooLarge(ValueError):
    """The encoded capture is larger than the byte budget it was given (nothing was written)."""

    def __init__(self, nbytes: int, max_bytes: int):
        super().__init__(f"capture needs {nbytes} bytes, over the budget of {max_bytes} bytes")
        self.nbytes = nbytes
        self.max_bytes = max_bytes


# ----------------------------------------------------------------------------------------------
# Encoding
# ----------------------------------------------------------------------------------------------


def _check_call(q, kv, kv_indices, kv_indptr, softmax_scale, attn_sink):
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q must be a [T, H, D] tensor, got {_desc(q)}")
    if not isinstance(kv, torch.Tensor) or kv.dim() not in (2, 3):
        raise ValueError(f"kv must be a [N, D] or [N, 1, D] tensor, got {_desc(kv)}")
    if kv.dim() == 3 and kv.shape[1] != 1:
        raise ValueError(f"kv must be [N, D] or [N, 1, D], got shape {tuple(kv.shape)}")
    if kv.shape[-1] != q.shape[-1]:
        raise ValueError(f"kv head dim {kv.shape[-1]} does not match q head dim {q.shape[-1]}")
    if kv.dtype != q.dtype:
        raise TypeError(f"kv dtype {kv.dtype} must match q dtype {q.dtype}")
    for name, t in (("kv_indices", kv_indices), ("kv_indptr", kv_indptr)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1:
            raise ValueError(f"{name} must be a 1-D tensor, got {_desc(t)}")
        if t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    if kv_indptr.numel() != q.shape[0] + 1:
        raise ValueError(
            f"kv_indptr must have T+1 = {q.shape[0] + 1} entries, got {kv_indptr.numel()}"
        )
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a float, got {type(softmax_scale).__name__}")
    if attn_sink is not None:
        if not isinstance(attn_sink, torch.Tensor) or attn_sink.dtype != torch.float32:
            raise TypeError(f"attn_sink must be a float32 tensor or None, got {_desc(attn_sink)}")
        if tuple(attn_sink.shape) != (q.shape[1],):
            raise ValueError(f"attn_sink must have shape [H] = ({q.shape[1]},)")


def _desc(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__


def _stat(x: torch.Tensor) -> dict[str, float]:
    if x.numel() == 0:
        return {"min": 0, "mean": 0.0, "max": 0}
    return {"min": int(x.min()), "mean": float(x.double().mean()), "max": int(x.max())}


def slot_stats(kv_indices: torch.Tensor, kv_indptr: torch.Tensor, num_kv: int) -> dict[str, Any]:
    """Slot statistics of a CSR index set against a pool of ``num_kv`` rows.

    Returns a JSON-ready dict: ``nnz``, ``tokens``, ``slots_per_token`` and
    ``valid_per_token`` (min/mean/max), ``invalid`` (entries outside [0, N)), ``empty_tokens``
    (no valid slot), ``unique_rows`` (distinct valid slots), ``pool_rows`` (N) and
    ``pool_fraction`` (unique_rows / N).
    """
    ptr = kv_indptr.to(torch.int64)
    idx = kv_indices.to(torch.int64)
    T = ptr.numel() - 1
    lengths = ptr[1:] - ptr[:-1]
    valid = (idx >= 0) & (idx < num_kv)
    if T > 0 and idx.numel():
        # Valid slots per token: a prefix sum over the validity flags, read at the CSR offsets.
        csum = torch.zeros(idx.numel() + 1, dtype=torch.int64, device=idx.device)
        csum[1:] = valid.to(torch.int64).cumsum(0)
        valid_per_token = csum[ptr[1:]] - csum[ptr[:-1]]
    else:
        valid_per_token = torch.zeros(T, dtype=torch.int64, device=idx.device)
    unique = int(torch.unique(idx[valid]).numel()) if idx.numel() else 0
    return {
        "nnz": int(idx.numel()),
        "tokens": T,
        "slots_per_token": _stat(lengths),
        "valid_per_token": _stat(valid_per_token),
        "invalid": int((~valid).sum()),
        "empty_tokens": int((valid_per_token == 0).sum()),
        "unique_rows": unique,
        "pool_rows": int(num_kv),
        "pool_fraction": unique / num_kv if num_kv else 0.0,
    }


def _environment(device: torch.device) -> dict[str, Any]:
    import triton

    from . import __version__

    env = {
        "sparse_mla": __version__,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "device_type": device.type,
    }
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        env["device"] = torch.cuda.get_device_name(idx)
        env["hip"] = torch.version.hip
    else:
        env["device"] = f"{device.type} ({platform.machine()})"
    return env


def _content_hash(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> str:
    h = hashlib.sha256()
    body = {k: v for k, v in meta.items() if k != _HASH_KEY}
    h.update(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def encode_capture(
    q: torch.Tensor,
    kv: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    softmax_scale: float,
    attn_sink: torch.Tensor | None = None,
    *,
    source: str = "",
    extra: dict[str, Any] | None = None,
    synthetic: bool = False,
) -> tuple[bytes, dict[str, Any]]:
    """Encode one call as safetensors bytes; returns (file bytes, metadata). Writes nothing.

    Only the pool rows referenced by a valid slot are stored (``kv_rows`` with their ids in
    ``kv_slots``); ``kv`` may be a view into a larger buffer and may live on any device.
    ``synthetic``: the inputs were generated (e.g. by :mod:`sparse_mla.workloads`), not
    recorded from a serving engine; stored as ``metadata["synthetic"]``.
    """
    from safetensors.torch import save

    _check_call(q, kv, kv_indices, kv_indptr, softmax_scale, attn_sink)
    kv2 = kv.reshape(kv.shape[0], kv.shape[-1]) if kv.dim() == 3 else kv
    N = kv2.shape[0]
    idx64 = kv_indices.to(torch.int64)
    slots = torch.unique(idx64[(idx64 >= 0) & (idx64 < N)])  # ascending
    rows = kv2[slots] if slots.numel() else kv2.new_empty(0, kv2.shape[1])
    tensors = {
        "q": q.detach().contiguous().cpu(),
        "kv_rows": rows.detach().contiguous().cpu(),
        "kv_slots": slots.cpu(),
        "kv_indices": kv_indices.detach().contiguous().cpu(),
        "kv_indptr": kv_indptr.detach().contiguous().cpu(),
    }
    if attn_sink is not None:
        tensors["attn_sink"] = attn_sink.detach().contiguous().cpu()
    T, H, D = q.shape
    meta: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "source": source,
        "synthetic": bool(synthetic),
        "call": {
            "T": T,
            "H": H,
            "D": D,
            "num_kv": N,
            "softmax_scale": float(softmax_scale),
            "has_sink": attn_sink is not None,
            "q_dtype": str(q.dtype).removeprefix("torch."),
            "q_strides": list(q.stride()),
            "kv_shape": list(kv.shape),
            "kv_strides": list(kv.stride()),
            "kv_indices_dtype": str(kv_indices.dtype).removeprefix("torch."),
            "kv_indptr_dtype": str(kv_indptr.dtype).removeprefix("torch."),
        },
        "tensors": {
            k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
            for k, v in tensors.items()
        },
        "slots": slot_stats(kv_indices, kv_indptr, N),
        "environment": _environment(q.device),
        "extra": extra or {},
    }
    meta[_HASH_KEY] = _content_hash(tensors, meta)
    data = save(tensors, metadata={_META_KEY: json.dumps(meta, sort_keys=True)})
    return data, meta


def save_capture(
    path: str | os.PathLike,
    q: torch.Tensor,
    kv: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    softmax_scale: float,
    attn_sink: torch.Tensor | None = None,
    *,
    source: str = "",
    extra: dict[str, Any] | None = None,
    max_bytes: int | None = None,
    synthetic: bool = False,
) -> Path:
    """Write one prefill call to ``path`` (a ``.safetensors`` file), atomically.

    Args are those of :func:`sparse_mla.sparse_mla_prefill`. ``source`` says where the call came
    from (free text); ``extra`` is any JSON-serialisable dict stored under ``metadata["extra"]``.
    ``max_bytes``: raise :class:`CaptureTooLarge` (writing nothing) if the file would be larger.
    Returns the path. The folder must exist.
    """
    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"path: folder {str(path.parent)!r} does not exist")
    data, _ = encode_capture(
        q, kv, kv_indices, kv_indptr, softmax_scale, attn_sink, source=source, extra=extra,
        synthetic=synthetic,
    )  # fmt: skip
    if max_bytes is not None and len(data) > max_bytes:
        raise CaptureTooLarge(len(data), max_bytes)
    _atomic_write(path, data)
    return path


# ----------------------------------------------------------------------------------------------
# Loading and rebuilding
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Capture:
    """One captured call, compacted: see the module docstring for the tensors and metadata."""

    q: torch.Tensor  # [T, H, D]
    kv_rows: torch.Tensor  # [U, D]
    kv_slots: torch.Tensor  # [U] int64, ascending
    kv_indices: torch.Tensor  # [nnz]
    kv_indptr: torch.Tensor  # [T + 1]
    attn_sink: torch.Tensor | None  # [H] fp32
    metadata: dict[str, Any] = field(repr=False)
    path: Path | None = None

    @property
    def num_kv(self) -> int:
        """N, the pool size of the original call."""
        return int(self.metadata["call"]["num_kv"])

    @property
    def softmax_scale(self) -> float:
        return float(self.metadata["call"]["softmax_scale"])

    @property
    def name(self) -> str:
        return self.path.stem if self.path is not None else "capture"

    @property
    def synthetic(self) -> bool | None:
        """True: generated inputs, not an engine's; None: the file does not say (older
        captures)."""
        return self.metadata.get("synthetic")

    def rebuild(
        self,
        device: str | torch.device = "cpu",
        *,
        big_buffer: bool | None = None,
        fill: float = float("nan"),
    ):
        """Inputs of the original call with a full-size pool: a :class:`~.workloads.Workload`.

        Every pool row that no slot references is set to ``fill`` (NaN), so reading one shows in
        the output. ``big_buffer`` (default: True on a GPU, False on CPU) places the N-row pool
        at the end of a >2 GiB allocation, as an engine's KV cache is.
        """
        from .workloads import Workload, pool_tensor

        device = torch.device(device)
        if big_buffer is None:
            big_buffer = device.type != "cpu"
        D = self.q.shape[-1]
        kv = pool_tensor(self.num_kv, D, self.q.dtype, device, big_buffer=big_buffer)
        kv.fill_(fill)
        if self.kv_slots.numel():
            kv[self.kv_slots.to(device)] = self.kv_rows.to(device)
        meta = {
            "kind": "capture",
            "T": self.q.shape[0],
            "H": self.q.shape[1],
            "D": D,
            "pool_rows": self.num_kv,
            "nnz": self.kv_indices.numel(),
            "big_buffer": big_buffer,
            "source": self.metadata.get("source", ""),
            "file": str(self.path) if self.path else None,
        }
        return Workload(
            name=self.name,
            q=self.q.to(device),
            kv=kv,
            kv_indices=self.kv_indices.to(device),
            kv_indptr=self.kv_indptr.to(device),
            softmax_scale=self.softmax_scale,
            attn_sink=None if self.attn_sink is None else self.attn_sink.to(device),
            meta=meta,
        )


# safetensors' own bound on the JSON header; a capture's is a few KiB.
_MAX_HEADER_BYTES = 100 * 1024 * 1024
# The largest pool a capture may describe (num_kv x D x element size): more than any device has,
# so a replay never tries to allocate what a damaged or hostile file claims.
MAX_POOL_BYTES = 1 << 40


def _header_length(prefix: bytes, size: int, where: str) -> int:
    """The JSON header's length from the 8-byte prefix of a file of ``size`` bytes."""
    if size < 8 or len(prefix) < 8:
        raise CaptureError(f"{where}: truncated: {size} bytes, not a safetensors file")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > size - 8:
        raise CaptureError(f"{where}: truncated: header says {n} bytes but only {size - 8} follow")
    if n > _MAX_HEADER_BYTES:
        raise CaptureError(
            f"{where}: header says {n} bytes, over safetensors' {_MAX_HEADER_BYTES}; not a capture"
        )
    return n


def _parse_header(head: bytes, size: int, where: str) -> dict[str, Any]:
    """The safetensors header of a file of ``size`` bytes, from its first 8 + n bytes ``head``;
    checks that the tensors it lists fill the rest of the file exactly."""
    n = _header_length(head, size, where)
    if len(head) < 8 + n:
        raise CaptureError(f"{where}: truncated: header says {n} bytes but fewer follow")
    try:
        header = json.loads(head[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CaptureError(f"{where}: header is not valid JSON ({e}); file damaged") from e
    if not isinstance(header, dict):
        raise CaptureError(f"{where}: header is not a JSON object; file damaged")
    end = 0
    for k, v in header.items():
        if k == "__metadata__":
            if not isinstance(v, dict):
                raise CaptureError(f"{where}: header __metadata__ is not an object; file damaged")
            continue
        offsets = v.get("data_offsets") if isinstance(v, dict) else None
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(type(o) is int and o >= 0 for o in offsets)
            and offsets[0] <= offsets[1]
            and isinstance(v.get("dtype"), str)
            and isinstance(v.get("shape"), list)
            and all(type(d) is int and d >= 0 for d in v["shape"])
        ):
            raise CaptureError(f"{where}: header entry {k!r} is malformed; file damaged")
        end = max(end, offsets[1])
    if 8 + n + end != size:
        raise CaptureError(
            f"{where}: truncated or padded: tensors need {8 + n + end} bytes, file has {size}"
        )
    return header


_FLOATS = (torch.float16, torch.bfloat16)
_INTS = (torch.int32, torch.int64)


_FP32_MAX = 3.4028234663852886e38


def _check_call_metadata(meta: dict[str, Any], header: dict[str, Any]) -> None:
    """Raise CaptureError unless ``meta["call"]`` describes a call that can be rebuilt and agrees
    with the tensor shapes the header lists. Reads no tensor: a file claiming an impossible pool
    (``num_kv`` of 10**15) is refused before anything large is allocated."""
    call = meta.get("call")
    if not isinstance(call, dict):
        raise CaptureError("metadata has no 'call' object")
    for key, lo in (("T", 0), ("H", 1), ("D", 1), ("num_kv", 0)):
        v = call.get(key)
        if type(v) is not int or v < lo:
            raise CaptureError(f"metadata call.{key} must be an int >= {lo}, got {v!r}")
    scale = call.get("softmax_scale")
    try:
        finite = type(scale) in (int, float) and math.isfinite(scale) and abs(scale) <= _FP32_MAX
    except OverflowError:  # an int past float's range
        finite = False
    if not finite:
        raise CaptureError(f"metadata call.softmax_scale must be a finite fp32 number, got {scale}")
    T, H, D, N = call["T"], call["H"], call["D"], call["num_kv"]
    pool = N * D * 2  # fp16/bf16 rows
    if pool > MAX_POOL_BYTES:
        raise CaptureError(
            f"metadata call.num_kv = {N} with D = {D} makes a {pool:.3g}-byte pool, over the "
            f"{MAX_POOL_BYTES}-byte limit of a replay"
        )
    kv_shape = call.get("kv_shape")
    if kv_shape is not None and (
        not isinstance(kv_shape, list) or not kv_shape or kv_shape[0] != N or kv_shape[-1] != D
    ):
        raise CaptureError(f"metadata call.kv_shape {kv_shape!r} disagrees with num_kv={N}, D={D}")
    shapes = {k: v["shape"] for k, v in header.items() if k != "__metadata__"}
    for name, want in (("q", [T, H, D]), ("kv_indptr", [T + 1]), ("attn_sink", [H])):
        if name in shapes and shapes[name] != want:
            raise CaptureError(
                f"metadata call (T={T}, H={H}, D={D}) disagrees with tensor {name} of shape "
                f"{shapes[name]}"
            )
    rows = shapes.get("kv_rows")
    if rows is not None and (len(rows) != 2 or rows[1] != D or rows[0] > N):
        raise CaptureError(f"kv_rows of shape {rows} cannot be rows of a [{N}, {D}] pool")


def _check_structure(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """Raise CaptureError unless the tensors and ``meta["call"]`` describe one valid call."""
    call = meta.get("call")
    if not isinstance(call, dict):
        raise CaptureError("metadata has no 'call' object")
    for key, typ in (("num_kv", int), ("softmax_scale", (int, float)), ("has_sink", bool)):
        if not isinstance(call.get(key), typ) or (key == "num_kv" and call[key] < 0):
            raise CaptureError(f"metadata call.{key} is missing or malformed: {call.get(key)!r}")
    q, rows, slots = tensors["q"], tensors["kv_rows"], tensors["kv_slots"]
    idx, ptr, sink = tensors["kv_indices"], tensors["kv_indptr"], tensors.get("attn_sink")
    if q.dim() != 3 or q.dtype not in _FLOATS:
        raise CaptureError(f"q must be a [T, H, D] fp16/bf16 tensor, got {q.dtype} {q.shape}")
    T, H, D = q.shape
    if rows.dim() != 2 or rows.shape[1] != D or rows.dtype != q.dtype:
        raise CaptureError(f"kv_rows must be [U, {D}] {q.dtype}, got {rows.dtype} {rows.shape}")
    if slots.dtype != torch.int64 or tuple(slots.shape) != (rows.shape[0],):
        raise CaptureError(f"kv_slots must be [{rows.shape[0]}] int64, got {slots.shape}")
    if slots.numel() and not (int(slots.min()) >= 0 and int(slots.max()) < call["num_kv"]):
        raise CaptureError(f"kv_slots must lie in [0, num_kv={call['num_kv']})")
    if idx.dim() != 1 or idx.dtype not in _INTS or ptr.dim() != 1 or ptr.dtype not in _INTS:
        raise CaptureError("kv_indices and kv_indptr must be 1-D int32/int64 tensors")
    if ptr.numel() != T + 1:
        raise CaptureError(f"kv_indptr has {ptr.numel()} entries for T = {T} tokens")
    try:
        check_indptr(ptr, idx.numel())
    except ValueError as e:
        raise CaptureError(str(e)) from None
    if (sink is not None) != call["has_sink"]:
        raise CaptureError("metadata call.has_sink does not match the attn_sink tensor")
    if sink is not None and (sink.dtype != torch.float32 or tuple(sink.shape) != (H,)):
        raise CaptureError(f"attn_sink must be [{H}] float32, got {sink.dtype} {sink.shape}")


def load_capture(path: str | os.PathLike) -> Capture:
    """Read and verify a capture file. Raises :class:`CaptureError` for any file that is not an
    intact capture (truncated, modified, malformed, or describing an impossible call), or that
    is not a regular file (a FIFO, a device such as /dev/zero, a directory);
    ``FileNotFoundError`` if there is none.

    The 8-byte length, the JSON header and the call in the metadata are checked against the
    file's size before the tensors are read, so a huge or endless file is refused at once."""
    path = Path(path)
    # O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused just below).
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CaptureError(f"{path}: not a regular file; a capture is a .safetensors file")
        with os.fdopen(fd, "rb") as f:
            fd = -1  # closed with f
            try:
                return _read(f, st.st_size, path)
            except (CaptureError, OSError):
                raise
            except Exception as e:  # any other failure to decode is damage too
                raise CaptureError(f"{path}: damaged ({type(e).__name__}: {e})") from e
    finally:
        if fd >= 0:
            os.close(fd)


def _read(f, size: int, path: Path) -> Capture:
    from safetensors import SafetensorError
    from safetensors.torch import load

    where = str(path)
    n = _header_length(f.read(8), size, where)
    f.seek(0)
    header = _parse_header(f.read(8 + n), size, where)
    meta_text = header.get("__metadata__", {}).get(_META_KEY)
    if meta_text is None:
        raise CaptureError(f"{path}: a safetensors file but not a sparse_mla capture")
    try:
        meta = json.loads(meta_text)
    except json.JSONDecodeError as e:
        raise CaptureError(f"{path}: damaged ({e})") from e
    if not isinstance(meta, dict):
        raise CaptureError(f"{path}: metadata is not a JSON object; file damaged")
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise CaptureError(
            f"{path}: format {meta.get('format')!r} v{meta.get('format_version')!r} is not "
            f"{FORMAT!r} v{FORMAT_VERSION}"
        )
    try:
        _check_call_metadata(meta, header)  # before reading the tensors
    except CaptureError as e:
        raise CaptureError(f"{path}: {e}") from None
    f.seek(0)
    raw = f.read()
    if len(raw) != size:
        raise CaptureError(f"{path}: the file changed while it was read ({size} -> {len(raw)} B)")
    try:
        tensors = load(raw)
    except SafetensorError as e:
        raise CaptureError(f"{path}: damaged ({e})") from e
    del raw
    missing = [k for k in _TENSOR_ORDER[:-1] if k not in tensors]
    if missing:
        raise CaptureError(f"{path}: missing tensor(s) {missing}")
    if meta.get(_HASH_KEY) != _content_hash(tensors, meta):
        raise CaptureError(
            f"{path}: content hash mismatch: the file was modified after it was written"
        )
    try:
        _check_structure(tensors, meta)
    except CaptureError as e:
        raise CaptureError(f"{path}: {e}") from None
    return Capture(
        q=tensors["q"],
        kv_rows=tensors["kv_rows"],
        kv_slots=tensors["kv_slots"],
        kv_indices=tensors["kv_indices"],
        kv_indptr=tensors["kv_indptr"],
        attn_sink=tensors.get("attn_sink"),
        metadata=meta,
        path=path,
    )


def update_metadata(path: str | os.PathLike, **fields: Any) -> Capture:
    """Set top-level metadata ``fields`` of a capture file (e.g. ``synthetic=True``), keeping
    its tensors; the content hash is recomputed and the file rewritten atomically. The
    call-describing fields (format, call, tensors, slots, content hash) cannot be changed."""
    from safetensors.torch import save

    fixed = {"format", "format_version", "call", "tensors", "slots", _HASH_KEY}
    bad = sorted(set(fields) & fixed)
    if bad:
        raise ValueError(f"update_metadata: {bad} describe the call and cannot be changed")
    cap = load_capture(path)
    meta = {**cap.metadata, **fields}
    tensors = {k: v for k, v in (("q", cap.q), ("kv_rows", cap.kv_rows),
                                 ("kv_slots", cap.kv_slots), ("kv_indices", cap.kv_indices),
                                 ("kv_indptr", cap.kv_indptr), ("attn_sink", cap.attn_sink))
               if v is not None}  # fmt: skip
    meta[_HASH_KEY] = _content_hash(tensors, meta)
    data = save(tensors, metadata={_META_KEY: json.dumps(meta, sort_keys=True)})
    _atomic_write(Path(path), data)
    return load_capture(path)


# ----------------------------------------------------------------------------------------------
# Replay
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplayReport:
    """Result of replaying a capture through one kernel, against the fp32 reference."""

    name: str
    kernel: str
    device: str
    T: int
    H: int
    D: int
    num_kv: int
    nnz: int
    nan_outputs: int  # NaN/Inf elements in the kernel's output
    error: Any  # reference.ErrorReport
    time_ms: float | None = None

    @property
    def ok(self) -> bool:
        return self.nan_outputs == 0 and self.error.ok

    def __str__(self) -> str:
        t = f", {self.time_ms:.3f} ms" if self.time_ms is not None else ""
        nan = f", {self.nan_outputs} non-finite outputs" if self.nan_outputs else ""
        return (
            f"{self.name} [{self.kernel} on {self.device}] T={self.T} H={self.H} D={self.D} "
            f"N={self.num_kv} nnz={self.nnz}{nan}{t}\n  {self.error}"
        )


def replay(
    capture: Capture | str | os.PathLike,
    fn: Callable[..., torch.Tensor] | None = None,
    *,
    device: str | torch.device | None = None,
    big_buffer: bool | None = None,
    time: bool = False,
) -> ReplayReport:
    """Rebuild ``capture`` (unreferenced pool rows NaN), run ``fn`` on it, compare with fp32.

    ``fn`` has :func:`sparse_mla.sparse_mla_prefill`'s signature (the default). ``device``
    defaults to the GPU when there is one, else CPU (Triton interpreter). ``time`` measures the
    call with ``triton.testing.do_bench`` (GPU only). The report is ``ok`` when the output has no
    NaN/Inf and is within the reference's 2x-PyTorch error rule.
    """
    from . import runtime
    from .reference import check_against_reference

    if not isinstance(capture, Capture):
        capture = load_capture(capture)
    if fn is None:
        from .prefill import sparse_mla_prefill as fn
    if device is None:
        device = "cuda" if runtime.has_gpu() else "cpu"
    w = capture.rebuild(device, big_buffer=big_buffer)
    out = fn(*w.args(), **w.kwargs())
    nan_outputs = int((~torch.isfinite(out)).sum())
    err = check_against_reference(out, *w.args(), **w.kwargs())
    ms = None
    if time and w.q.device.type != "cpu":
        import triton.testing

        ms = triton.testing.do_bench(lambda: fn(*w.args(), **w.kwargs()), return_mode="median")
    T, H, D = w.q.shape
    return ReplayReport(
        name=capture.name,
        kernel=getattr(fn, "__name__", repr(fn)),
        device=str(w.q.device),
        T=T,
        H=H,
        D=D,
        num_kv=capture.num_kv,
        nnz=w.kv_indices.numel(),
        nan_outputs=nan_outputs,
        error=err,
        time_ms=ms,
    )


# ----------------------------------------------------------------------------------------------
# Recording
# ----------------------------------------------------------------------------------------------

DEFAULT_TARGET = "sparse_mla.prefill:sparse_mla_prefill"

# Argument names engines use for each operand (first match wins), after the positional order
# q, kv, kv_indices, kv_indptr, softmax_scale.
_ARG_NAMES = {
    "q": ("q", "query"),
    "kv": ("kv", "unified_kv", "kv_cache", "kv_buffer"),
    "kv_indices": ("kv_indices", "indices", "slot_ids"),
    "kv_indptr": ("kv_indptr", "indptr", "kv_indptr_prefix", "cu_seqlens"),
    "softmax_scale": ("softmax_scale", "sm_scale", "scale"),
    "attn_sink": ("attn_sink", "sink", "sinks"),
}
_POSITIONAL = ("q", "kv", "kv_indices", "kv_indptr", "softmax_scale", "attn_sink")


def default_extract(args: tuple, kwargs: dict) -> dict[str, Any]:
    """Map a call's arguments to capture operands (``sparse_mla_prefill``'s order and names).
    ``sparse_mla_prefill``'s dense form (kv_indices [T, K], kv_indptr None or left out, the
    rows' ``kv_lengths`` if given) is recorded as the CSR lists it means, made by the package's
    :func:`~sparse_mla.indices.dense_to_csr` (an absent id stays absent)."""
    found: dict[str, Any] = dict(zip(_POSITIONAL, args, strict=False))
    for key, names in _ARG_NAMES.items():
        if key in found:
            continue
        for n in names:
            if n in kwargs:
                found[key] = kwargs[n]
                break
    ids = found.get("kv_indices")
    if isinstance(ids, torch.Tensor) and ids.dim() == 2 and found.get("kv_indptr") is None:
        from .indices import dense_to_csr

        kv = found.get("kv")
        n = kv.shape[0] if isinstance(kv, torch.Tensor) else None
        found["kv_indices"], found["kv_indptr"] = dense_to_csr(ids, kwargs.get("kv_lengths"), n)
    missing = [k for k in _POSITIONAL[:-1] if k not in found]
    if missing:
        raise ValueError(f"cannot find {missing} among the call's arguments; pass extract=")
    found.setdefault("attn_sink", None)
    return found


def _bind(names: tuple[str, ...], args: tuple, kwargs: dict, what: str) -> dict[str, Any]:
    """A call's arguments by parameter name (positional first, then keywords)."""
    if len(args) > len(names):
        raise ValueError(f"{what}: {len(args)} positional arguments, at most {len(names)} known")
    bound = dict(zip(names, args, strict=False))
    for k, v in kwargs.items():
        if k in names:
            bound[k] = v
    return bound


# FlashMLA's sparse prefill (deepseek-ai/FlashMLA, flash_mla/flash_mla_interface.py):
#   flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None)
#   -> (out, max_logits, lse)
_FLASHMLA_PARAMS = ("q", "kv", "indices", "sm_scale", "d_v", "attn_sink", "topk_length")


def flashmla_sparse_extract(args: tuple, kwargs: dict) -> dict[str, Any]:
    """Capture operands of a FlashMLA-style ``flash_mla_sparse_fwd`` call.

    q [s_q, h_q, d_qk], kv [s_kv, 1, d_qk], indices [s_q, 1, topk] int32 (invalid: -1 or
    >= s_kv), optional attn_sink [h_q] fp32 and topk_length [s_q] (token t uses its first
    topk_length[t] entries). The dense indices become CSR with the package's own
    :func:`~sparse_mla.indices.dense_to_csr`, so an invalid entry stays invalid. Only calls
    with d_qk == d_v (DSv4: 512) map: this operator has one row width for K and V; a
    DeepSeek-V3.2-style call (d_qk 576, d_v 512) is refused with that reason.
    """
    from .indices import dense_to_csr

    a = _bind(_FLASHMLA_PARAMS, args, kwargs, "flash_mla_sparse_fwd")
    missing = [k for k in _FLASHMLA_PARAMS[:4] if k not in a]
    if missing:
        raise ValueError(f"flash_mla_sparse_fwd call without {missing}")
    q, kv, indices = a["q"], a["kv"], a["indices"]
    d_v = a.get("d_v", 512)
    if q.shape[-1] != d_v:
        raise ValueError(
            f"flash_mla_sparse_fwd with d_qk={q.shape[-1]} != d_v={d_v}: this operator reads K "
            "and V from the same row of one width (DSv4: 512), so this call cannot be captured"
        )
    if kv.dim() == 3 and kv.shape[1] != 1:
        raise ValueError(f"flash_mla_sparse_fwd: kv must have one KV head, got {tuple(kv.shape)}")
    if indices.dim() == 3:
        if indices.shape[1] != 1:
            raise ValueError(f"indices must be [s_q, 1, topk], got {tuple(indices.shape)}")
        indices = indices[:, 0, :]
    kv_indices, kv_indptr = dense_to_csr(indices, a.get("topk_length"), num_kv=kv.shape[0])
    return {
        "q": q,
        "kv": kv,
        "kv_indices": kv_indices,
        "kv_indptr": kv_indptr,
        "softmax_scale": float(a["sm_scale"]),
        "attn_sink": a.get("attn_sink"),
    }


# aiter's sparse prefill (ROCm/aiter, aiter/ops/triton/attention/pa_prefill_sparse.py):
#   pa_prefill_sparse(q, unified_kv, kv_indices_prefix, kv_indptr_prefix, kv,
#                     kv_indices_extend, kv_indptr_extend, attn_sink, softmax_scale,
#                     has_invalid=None, out=None) -> out
_AITER_PARAMS = (
    "q", "unified_kv", "kv_indices_prefix", "kv_indptr_prefix", "kv", "kv_indices_extend",
    "kv_indptr_extend", "attn_sink", "softmax_scale", "has_invalid", "out",
)  # fmt: skip


def aiter_pa_prefill_sparse_extract(args: tuple, kwargs: dict) -> dict[str, Any]:
    """Capture operands of aiter's ``pa_prefill_sparse``: its prefix source (``unified_kv``
    with ``kv_indices_prefix`` / ``kv_indptr_prefix``, already CSR) is this operator's pool.
    A call that also reads the second ("extend") source is refused: one capture holds one
    pool."""
    a = _bind(_AITER_PARAMS, args, kwargs, "pa_prefill_sparse")
    missing = [k for k in ("q", "unified_kv", "kv_indices_prefix", "kv_indptr_prefix",
                           "softmax_scale") if k not in a]  # fmt: skip
    if missing:
        raise ValueError(f"pa_prefill_sparse call without {missing}")
    ext = a.get("kv_indices_extend")
    if ext is not None and ext.numel() > 0:
        raise ValueError(
            "pa_prefill_sparse with a non-empty extend source: two KV pools cannot be one capture"
        )
    return {
        "q": a["q"],
        "kv": a["unified_kv"],
        "kv_indices": a["kv_indices_prefix"],
        "kv_indptr": a["kv_indptr_prefix"],
        "softmax_scale": float(a["softmax_scale"]),
        "attn_sink": a.get("attn_sink"),
    }


@dataclass(frozen=True)
class EngineMapping:
    """Where to record an engine's sparse prefill: the function to patch (``target``), how its
    arguments become capture operands (``extract``), its signature and where that signature
    was read (``checked``), and what is not checked (``caveat``)."""

    name: str
    target: str
    extract: Callable[[tuple, dict], dict[str, Any]]
    signature: str
    checked: str
    caveat: str = ""


_FLASHMLA_SIG = (
    "flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None)"
)
ENGINES: dict[str, EngineMapping] = {
    m.name: m
    for m in (
        EngineMapping(
            "flashmla", "flash_mla:flash_mla_sparse_fwd", flashmla_sparse_extract, _FLASHMLA_SIG,
            "deepseek-ai/FlashMLA flash_mla/flash_mla_interface.py (exported by flash_mla)",
        ),
        EngineMapping(
            "vllm", "vllm.v1.attention.backends.mla.flashmla_sparse:flash_mla_sparse_fwd",
            flashmla_sparse_extract, _FLASHMLA_SIG,
            "vllm-project/vllm: the sparse MLA backend imports flash_mla_sparse_fwd by name "
            "from vllm.v1.attention.ops.flashmla, which re-exports FlashMLA's own",
            "the vendored copy's signature (vllm/third_party/flashmla) was not read; the "
            "backend's call sites were not checked",
        ),
        EngineMapping(
            "sglang", "sgl_kernel.flash_mla:flash_mla_sparse_fwd", flashmla_sparse_extract,
            _FLASHMLA_SIG,
            "sgl-project/sglang sgl-kernel/python/sgl_kernel/flash_mla.py (the stored copy "
            "has q, kv, indices, sm_scale, d_v; newer ones add attn_sink, topk_length)",
            "SGLang's DSv4 attention backend and how it imports this function were not "
            "checked: if it imports the name at module load, patch its module instead",
        ),
        EngineMapping(
            "aiter", "aiter.ops.triton.attention.pa_prefill_sparse:pa_prefill_sparse",
            aiter_pa_prefill_sparse_extract,
            "pa_prefill_sparse(q, unified_kv, kv_indices_prefix, kv_indptr_prefix, kv, "
            "kv_indices_extend, kv_indptr_extend, attn_sink, softmax_scale, has_invalid=None, "
            "out=None)",
            "ROCm/aiter aiter/ops/triton/attention/pa_prefill_sparse.py",
            "calls with a non-empty extend source are refused",
        ),
    )
}  # fmt: skip


def _resolve(target: str):
    if ":" not in target:
        raise ValueError(f"target must look like 'package.module:function', got {target!r}")
    mod_name, attr_path = target.split(":", 1)
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise ImportError(
            f"Recorder: cannot import {mod_name!r} for target {target!r} ({e}); is that engine "
            "installed in this environment?"
        ) from e
    owner = module
    *parents, leaf = attr_path.split(".")
    for p in parents:
        owner = getattr(owner, p)
    if not hasattr(owner, leaf):
        raise AttributeError(f"Recorder: {mod_name!r} has no attribute {attr_path!r}")
    return owner, leaf


class Recorder:
    """Record calls of a function into capture files, patched only inside a ``with`` block.

    Args:
        out_dir: folder for the files (created if missing).
        target: ``"module:function"`` (or ``"module:Class.method"``) to patch while the block
            runs, e.g. an engine's sparse prefill entry; default: the package's
            ``sparse_mla_prefill`` (also the alias ``sparse_mla.sparse_mla_prefill``). A
            callable instead of a string patches nothing: call :attr:`fn` yourself. Code that
            imported the function by name before the block keeps the unpatched one.
        every: record call numbers 0, n, 2n, ... (counting every call made).
        first: only the first ``first`` calls are candidates (None: all).
        max_files: stop after this many files (None: no limit).
        max_bytes: total bytes for all files; a call that would exceed it is skipped.
        extract: ``(args, kwargs) -> dict(q, kv, kv_indices, kv_indptr, softmax_scale,
            attn_sink)`` for functions with another signature (default: :func:`default_extract`).
        filename: file name pattern; ``{call}`` is the call number.
        strict: re-raise recording errors; default False records them in :attr:`errors`,
            warns once (at the first), and lets the wrapped call run unaffected.
        synthetic: the calls run on generated inputs (a workload), not an engine's; stored in
            each file's metadata.

    After the block, :attr:`files` lists the files written (also returned by :meth:`close`).
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        target: str | Callable | None = None,
        *,
        every: int = 1,
        first: int | None = None,
        max_files: int | None = None,
        max_bytes: int = 64 * 2**20,
        extract: Callable[[tuple, dict], dict[str, Any]] | None = None,
        filename: str = "call_{call:05d}.safetensors",
        source: str | None = None,
        extra: dict[str, Any] | None = None,
        strict: bool = False,
        synthetic: bool = False,
    ):
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an int >= 1, got {every!r}")
        if first is not None and (not isinstance(first, int) or first < 0):
            raise ValueError(f"first must be an int >= 0 or None, got {first!r}")
        if max_files is not None and (not isinstance(max_files, int) or max_files < 0):
            raise ValueError(f"max_files must be an int >= 0 or None, got {max_files!r}")
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
        if target is not None and not isinstance(target, str) and not callable(target):
            raise TypeError(f"target must be 'module:function', a callable or None, got {target!r}")
        self.out_dir = Path(out_dir)
        self.target = DEFAULT_TARGET if target is None else target
        self.every, self.first, self.max_files, self.max_bytes = every, first, max_files, max_bytes
        self.extract = extract or default_extract
        self.filename = filename
        self.source = source
        self.extra = dict(extra or {})
        self.strict = strict
        self.synthetic = synthetic
        self.files: list[Path] = []
        self.errors: list[str] = []
        self.calls = 0
        self.skipped_for_size = 0
        self.bytes_written = 0
        self._lock = threading.Lock()
        self._patches: list[tuple[object, str, object]] = []
        self._original: Callable | None = None
        self.fn: Callable | None = None

    # -- patching ----------------------------------------------------------------------------

    def __enter__(self) -> Recorder:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if callable(self.target):
            self._original = self.target
            self.fn = self._wrap(self.target)
            return self
        owner, leaf = _resolve(self.target)
        self._original = getattr(owner, leaf)
        self.fn = self._wrap(self._original)
        places = [(owner, leaf)]
        if self.target == DEFAULT_TARGET:
            import sparse_mla

            if getattr(sparse_mla, leaf, None) is self._original:
                places.append((sparse_mla, leaf))
        for o, name in places:
            self._patches.append((o, name, getattr(o, name)))
            setattr(o, name, self.fn)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> list[Path]:
        """Undo the patches (idempotent); returns the files written."""
        while self._patches:
            o, name, orig = self._patches.pop()
            setattr(o, name, orig)
        return list(self.files)

    def _wrap(self, fn: Callable) -> Callable:
        def recorded(*args, **kwargs):
            self._maybe_record(args, kwargs)
            return fn(*args, **kwargs)

        recorded.__name__ = getattr(fn, "__name__", "recorded")
        recorded.__doc__ = getattr(fn, "__doc__", None)
        recorded.__wrapped__ = fn
        return recorded

    # -- sampling ----------------------------------------------------------------------------

    def _wants(self, call: int) -> bool:
        if self.first is not None and call >= self.first:
            return False
        if self.max_files is not None and len(self.files) >= self.max_files:
            return False
        return call % self.every == 0

    def _maybe_record(self, args: tuple, kwargs: dict) -> None:
        with self._lock:
            call = self.calls
            self.calls += 1
            if not self._wants(call):
                return
            try:
                self._record(call, args, kwargs)
            except CaptureTooLarge:
                self.skipped_for_size += 1
            except Exception as e:
                if self.strict:
                    raise
                self.errors.append(f"call {call}: {type(e).__name__}: {e}")
                if len(self.errors) == 1:  # say it once; the rest are in .errors
                    warnings.warn(
                        f"Recorder: call {call} of {self._target_name()} was not recorded "
                        f"({type(e).__name__}: {e}); the call itself ran. Pass extract= (or "
                        "Recorder.for_engine) for this signature; later failures go to "
                        ".errors only",
                        RuntimeWarning,
                        stacklevel=3,
                    )

    def _target_name(self) -> str:
        return self.target if isinstance(self.target, str) else _qualname(self.target)

    @classmethod
    def for_engine(cls, engine: str, out_dir: str | os.PathLike, **kwargs) -> Recorder:
        """A Recorder on an engine's sparse prefill with its argument mapping
        (:data:`ENGINES`: ``"flashmla"``, ``"vllm"``, ``"sglang"``, ``"aiter"``). ``target=``
        overrides where to patch (e.g. the module that imported the function by name)."""
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {sorted(ENGINES)}, got {engine!r}")
        m = ENGINES[engine]
        kwargs.setdefault("source", f"{m.name}: {m.signature}")
        return cls(out_dir, kwargs.pop("target", m.target), extract=m.extract, **kwargs)

    def _record(self, call: int, args: tuple, kwargs: dict) -> None:
        ops = self.extract(args, kwargs)
        target = self._target_name()
        source = self.source or f"Recorder({target})"
        path = self.out_dir / self.filename.format(call=call)
        budget = self.max_bytes - self.bytes_written
        save_capture(
            path,
            ops["q"],
            ops["kv"],
            ops["kv_indices"],
            ops["kv_indptr"],
            ops["softmax_scale"],
            ops.get("attn_sink"),
            source=source,
            extra={**self.extra, "call": call, "target": target},
            max_bytes=budget,
            synthetic=self.synthetic,
        )
        self.files.append(path)
        self.bytes_written += path.stat().st_size


def _qualname(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"
