"""Benchmark of the sparse prefill: providers x workloads against floors measured in the same run.

For each workload (:mod:`sparse_mla.workloads`) every provider runs once on a NaN-poisoned output,
is checked against the fp32 reference (on token slices when T is large), and only then is timed
with ``triton.testing.do_bench(return_mode="median")``. Providers:

- ``triton``: :func:`sparse_mla.sparse_mla_prefill` with its configs/ launch (``config=None``);
- ``gluon``: the Gluon kernel's Hopper instantiation (:func:`sparse_mla.gluon.mla_gluon`,
  ``has_pe=False``), on an NVIDIA sm90 GPU only;
- ``torch``: :func:`torch_gather_prefill`, a plain PyTorch gather and two batched matmuls.

Work model (per call, ``nnz`` = valid (token, slot) pairs)
-----------------------------------------------------------
- FLOPs = ``4 * nnz * H * D``: a multiply-add (2 FLOPs) per head, dim and slot in Q K^T and in
  P V. Softmax, sink and the output scaling are not counted.
- gathered bytes = ``nnz * D * elem_size``: each slot's row read once per token (all H heads of
  a token share it). A kernel whose head blocks split a token's heads reads more than this; that
  is its cost, not the floor's. q, the output and the slot ids are not counted (at most a few
  percent of the floor on the standard workloads).

Floor
-----
:func:`measure_ceilings` measures, on the device of the run: the bf16 matmul rate (8192^3,
random), device-to-device copy bandwidth (1 GiB, read + write counted) and the row-gather rate
of :func:`gather_sum` (random 1 KiB rows summed by a Triton kernel) for pools of 4 MiB to 1 GiB
(L2-resident to HBM). ``floor = max(FLOPs / matmul rate, gathered bytes / gather rate)``, the
gather rate taken at the smallest measured pool at least as large as the workload's KV pool
(the largest one past 1 GiB). ``frac_of_floor = floor_ms / ms``: 1.0 runs at the floor.

Rows
----
Tidy CSV rows (:data:`CSV_COLUMNS`), appended to ``data/bench/<device-slug>.csv`` by default.
``nnz`` is the valid (token, slot) pairs; ``config`` the launch as JSON; a provider that fails
the check (or raises) gets ``ok=False``, its reason in ``note``, and no timing. The ceilings are
rows too, with ``provider = "ceiling:<name>"`` and their rate in ``tflops``
(matmul) or ``gather_tbs`` (copy: read + write; gathers: bytes read), in TB/s.
"""

from __future__ import annotations

import csv
import datetime
import json
import math
import re
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

from . import runtime

__all__ = [
    "CSV_COLUMNS",
    "DEFAULT_WORKLOADS",
    "GATHER_POOL_BYTES",
    "PROVIDERS",
    "Ceilings",
    "append_rows",
    "device_slug",
    "floor_ms",
    "format_table",
    "gather_sum",
    "git_commit",
    "measure_ceilings",
    "run_bench",
    "torch_gather_prefill",
    "work_model",
]

# The five workloads of issue 9's table (T=16384, D=512, sink on).
DEFAULT_WORKLOADS = (
    "csa_h16_topk512",
    "csa_h8_topk512",
    "csa_h64_topk512",
    "csa_h128_topk1024",
    "glm_h16_topk2048",
)
PROVIDERS = ("triton", "gluon", "torch")
GATHER_POOL_BYTES = (4 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30)
CSV_COLUMNS = (
    "timestamp", "device", "torch", "triton", "commit", "workload", "T", "H", "D", "topk", "nnz",
    "provider", "config", "ok", "rel_l2", "ms", "tflops", "gather_tbs", "floor_ms",
    "frac_of_floor", "note",
)  # fmt: skip

# torch provider: gathered elements per token chunk (256 Mi elements = 512 MiB of bf16 rows).
_TORCH_CHUNK_ELEMENTS = 256 * 1024 * 1024


# ----------------------------------------------------------------------------------------------
# Work model and floor
# ----------------------------------------------------------------------------------------------


def work_model(nnz: int, num_heads: int, head_dim: int, elem_size: int = 2) -> tuple[int, int]:
    """(FLOPs, gathered bytes) of one call with ``nnz`` valid (token, slot) pairs.

    FLOPs = 4 * nnz * H * D (Q K^T and P V, 2 FLOPs a multiply-add); bytes = nnz * D *
    elem_size (each slot's row gathered once per token, shared by all its heads).
    """
    for name, v in (("nnz", nnz), ("num_heads", num_heads), ("head_dim", head_dim),
                    ("elem_size", elem_size)):  # fmt: skip
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    return 4 * nnz * num_heads * head_dim, nnz * head_dim * elem_size


@dataclass(frozen=True)
class Ceilings:
    """Rates measured on one device: bf16 matmul (FLOP/s), copy (bytes/s, read + write) and
    the row gather (bytes/s) keyed by pool size in bytes."""

    matmul_flops: float
    copy_bytes: float
    gather_bytes: dict[int, float] = field(default_factory=dict)

    def gather_rate(self, pool_bytes: int) -> float:
        """Gather rate at the smallest measured pool >= ``pool_bytes`` (else the largest)."""
        if not self.gather_bytes:
            raise ValueError("no gather rates measured")
        sizes = sorted(self.gather_bytes)
        for s in sizes:
            if s >= pool_bytes:
                return self.gather_bytes[s]
        return self.gather_bytes[sizes[-1]]


def floor_ms(flops: float, gathered_bytes: float, pool_bytes: int, ceilings: Ceilings) -> float:
    """max(FLOPs / matmul rate, gathered bytes / gather rate at the pool's size), in ms."""
    compute_s = flops / ceilings.matmul_flops
    gather_s = gathered_bytes / ceilings.gather_rate(pool_bytes)
    return max(compute_s, gather_s) * 1e3


# ----------------------------------------------------------------------------------------------
# Row-gather ceiling kernel
# ----------------------------------------------------------------------------------------------


@triton.jit
def _gather_sum_kernel(
    pool_ptr,  # [N, HEAD_DIM]
    idx_ptr,  # [num_programs * ROWS_PER_PROG] slot ids
    out_ptr,  # [num_programs, HEAD_DIM] fp32
    stride_pn,
    ROWS_PER_PROG: tl.constexpr,
    BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK)  # [BLOCK]
    offs_d = tl.arange(0, HEAD_DIM)  # [HEAD_DIM]
    acc = tl.zeros([BLOCK, HEAD_DIM], dtype=tl.float32)
    base = pid * ROWS_PER_PROG
    for r0 in range(0, ROWS_PER_PROG, BLOCK):
        slot = tl.load(idx_ptr + base + r0 + offs_r).to(tl.int64)  # [BLOCK]
        rows = tl.load(pool_ptr + slot[:, None] * stride_pn + offs_d[None, :])  # [BLOCK, HEAD_DIM]
        # Sum in registers; reduce across rows once at the end, not per block.
        acc += rows.to(tl.float32)
    tl.store(out_ptr + pid * HEAD_DIM + offs_d, tl.sum(acc, 0))


def gather_sum(
    pool: torch.Tensor,
    slots: torch.Tensor,
    *,
    rows_per_program: int = 256,
    block: int = 32,
    num_warps: int = 8,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-program sums of gathered rows: the row-gather ceiling's kernel.

    Args:
        pool: [N, D] fp16/bf16/fp32 rows (D a power of two, last dim contiguous).
        slots: [P * rows_per_program] int32/int64 ids in [0, N), all valid (not checked on GPU).
        rows_per_program: rows one program gathers, a multiple of ``block``.
        block: rows gathered per load.
        out: optional [P, D] fp32 buffer.

    Returns:
        [P, D] fp32: row p is the sum of pool[slots[p*R:(p+1)*R]], R = rows_per_program.
    """
    if not isinstance(pool, torch.Tensor) or pool.dim() != 2 or pool.stride(1) != 1:
        raise ValueError(f"pool must be a [N, D] tensor with a contiguous last dim, got {pool!r}")
    D = pool.shape[1]
    if D & (D - 1) or D == 0:
        raise ValueError(f"pool's row width must be a power of two, got {D}")
    if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"slots must be a 1-D int32/int64 tensor, got {slots.dtype} {slots.shape}")
    if block < 1 or block & (block - 1) or rows_per_program % block:
        raise ValueError(
            f"block must be a power of two dividing rows_per_program, got {block}, "
            f"{rows_per_program}"
        )
    if slots.numel() % rows_per_program:
        raise ValueError(
            f"slots ({slots.numel()}) must be a multiple of rows_per_program ({rows_per_program})"
        )
    P = slots.numel() // rows_per_program
    if out is None:
        out = torch.empty(P, D, dtype=torch.float32, device=pool.device)
    if P:
        runtime.launch(
            _gather_sum_kernel,
            (P,),
            pool,
            slots,
            out,
            pool.stride(0),
            ROWS_PER_PROG=rows_per_program,
            BLOCK=block,
            HEAD_DIM=D,
            interpret=runtime.runs_interpreted(pool),
            num_warps=num_warps,
        )
    return out


def _do_bench(fn: Callable[[], Any], quick: bool) -> float:
    if quick:
        return float(triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median"))
    return float(triton.testing.do_bench(fn, return_mode="median"))


def measure_ceilings(
    device: str | torch.device = "cuda",
    *,
    pool_bytes: Sequence[int] = GATHER_POOL_BYTES,
    matmul_size: int = 8192,
    copy_bytes: int = 1 << 30,
    gathered_rows: int = 1 << 22,
    quick: bool = False,
    seed: int = 0,
) -> tuple[Ceilings, list[dict[str, Any]]]:
    """Measure the matmul, copy and row-gather rates on a GPU (do_bench medians, random data).

    Returns:
        (Ceilings, rows): rows are partial CSV rows (provider "ceiling:<name>", config, ms,
        tflops or gather_tbs) for :func:`run_bench` to complete.
    """
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"measure_ceilings needs a GPU device, got {device}")
    gen = torch.Generator(device=device).manual_seed(seed)
    rows: list[dict[str, Any]] = []

    matmul, ms = _matmul_rate(matmul_size, device, gen, quick)
    cfg = {"M": matmul_size, "N": matmul_size, "K": matmul_size, "dtype": "bfloat16"}
    rows.append({"provider": "ceiling:matmul_bf16", "config": cfg, "ms": ms,
                 "tflops": matmul / 1e12})  # fmt: skip
    copy, ms = _copy_rate(copy_bytes, device, gen, quick)
    rows.append({"provider": "ceiling:copy", "config": {"bytes": copy_bytes}, "ms": ms,
                 "gather_tbs": copy / 1e12})  # fmt: skip
    gather = {}
    for size, (rate, ms, cfg) in _gather_rates(pool_bytes, gathered_rows, device, gen, quick):
        gather[size] = rate
        rows.append({"provider": f"ceiling:gather_{_size_name(size)}", "config": cfg, "ms": ms,
                     "gather_tbs": rate / 1e12})  # fmt: skip
    return Ceilings(matmul, copy, gather), rows


def _matmul_rate(n: int, device, gen, quick: bool) -> tuple[float, float]:
    """(FLOP/s, ms) of a random bf16 [n, n] x [n, n] torch.matmul."""
    a = torch.randn(n, n, device=device, generator=gen, dtype=torch.float32).to(torch.bfloat16)
    b = torch.randn(n, n, device=device, generator=gen, dtype=torch.float32).to(torch.bfloat16)
    c = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    ms = _do_bench(lambda: torch.matmul(a, b, out=c), quick)
    return 2.0 * n**3 / (ms * 1e-3), ms


def _copy_rate(nbytes: int, device, gen, quick: bool) -> tuple[float, float]:
    """(bytes/s read + written, ms) of a device-to-device copy of ``nbytes``."""
    src = torch.empty(nbytes // 2, device=device, dtype=torch.bfloat16)
    src.normal_(generator=gen)
    dst = torch.empty_like(src)
    ms = _do_bench(lambda: dst.copy_(src), quick)
    return 2.0 * nbytes / (ms * 1e-3), ms


# Launches tried for the gather ceiling: (rows per program, rows per load, warps). The ceiling
# is the best of them, so a floor built on it is not loosened by one slow launch.
_GATHER_LAUNCHES = [(r, b, w) for r in (64, 256) for b in (16, 32, 64) for w in (4, 8)]


def _gather_rates(pool_bytes, gathered_rows: int, device, gen, quick: bool):
    """Yield (pool size, bytes/s, ms, config) of the fastest :func:`gather_sum` launch over
    random 1 KiB rows of bf16 pools of each size (prefixes of one random pool)."""
    D, row_bytes = 512, 1024
    pool = torch.empty(max(pool_bytes) // row_bytes, D, device=device, dtype=torch.bfloat16)
    pool.normal_(generator=gen)
    launches = _GATHER_LAUNCHES[:4] if quick else _GATHER_LAUNCHES
    for size in sorted(pool_bytes):
        num = size // row_bytes
        slots = torch.randint(0, num, (gathered_rows,), device=device, generator=gen,
                              dtype=torch.int32)  # fmt: skip
        view = pool[:num]
        best = None
        for rpp, block, warps in launches:
            out = torch.empty(gathered_rows // rpp, D, device=device, dtype=torch.float32)

            def fn(v=view, s=slots, o=out, r=rpp, b=block, w=warps):
                gather_sum(v, s, rows_per_program=r, block=b, num_warps=w, out=o)

            ms = _do_bench(fn, quick)
            if best is None or ms < best[0]:
                best = (ms, {"rows_per_program": rpp, "block": block, "num_warps": warps})
        ms, launch = best
        cfg = {"pool_bytes": size, "rows": gathered_rows, "row_bytes": row_bytes, **launch}
        yield size, (gathered_rows * row_bytes / (ms * 1e-3), ms, cfg)


def _size_name(n: int) -> str:
    if n >= 1 << 30 and n % (1 << 30) == 0:
        return f"{n >> 30}GiB"
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20}MiB"
    return f"{n}B"


# ----------------------------------------------------------------------------------------------
# PyTorch provider
# ----------------------------------------------------------------------------------------------


def torch_gather_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    softmax_scale: float,
    *,
    attn_sink: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    max_slots: int | None = None,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """Sparse MLA prefill in plain PyTorch: gather, two batched matmuls, fp32 softmax.

    Computes in q's dtype (logits and P V in bf16/fp16 with fp32 accumulation, as the GPU's
    matmuls do), softmax in fp32. Tokens are processed in chunks, each gathering its tokens'
    rows into a padded [chunk, max_slots, D] block.

    Args:
        q: [T, H, D]; kv: [N, D] (or [N, 1, D]); kv_indices: [nnz]; kv_indptr: [T+1];
        softmax_scale, attn_sink ([H] fp32): as :func:`sparse_mla.sparse_mla_prefill`.
        out: optional [T, H, D] buffer in q's dtype.
        max_slots: padded width, at least the longest slot list (default: measured, a host
            sync); pass it to keep the call free of syncs.
        chunk_tokens: tokens per chunk (default: ~256 Mi gathered elements per chunk).

    Returns:
        out [T, H, D] in q's dtype; a token with no valid slot gets zeros.
    """
    if kv.dim() == 3:
        kv = kv.reshape(kv.shape[0], kv.shape[-1])
    if q.dim() != 3 or kv.dim() != 2 or kv.shape[1] != q.shape[2]:
        raise ValueError(f"q must be [T, H, D] and kv [N, D]; got {tuple(q.shape)}, "
                         f"{tuple(kv.shape)}")  # fmt: skip
    T, H, D = q.shape
    N = kv.shape[0]
    if kv_indptr.numel() != T + 1:
        raise ValueError(f"kv_indptr must have T+1 = {T + 1} entries, got {kv_indptr.numel()}")
    if out is None:
        out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
    starts = kv_indptr[:-1].to(torch.int64)
    lengths = kv_indptr[1:].to(torch.int64) - starts
    L = int(lengths.max()) if max_slots is None and T else (max_slots or 0)
    if T == 0 or N == 0 or L == 0 or kv_indices.numel() == 0:
        return out.zero_()
    if chunk_tokens is None:
        chunk_tokens = max(1, _TORCH_CHUNK_ELEMENTS // (L * max(D, H)))
    idx = kv_indices.to(torch.int64)
    col = torch.arange(L, device=q.device)
    sink = None if attn_sink is None else attn_sink.to(torch.float32)[None, :, None]  # [1, H, 1]
    for t0 in range(0, T, chunk_tokens):
        t1 = min(T, t0 + chunk_tokens)
        in_row = col[None, :] < lengths[t0:t1, None]  # [t, L]
        pos = torch.where(in_row, starts[t0:t1, None] + col[None, :], 0)
        slots = idx[pos]
        valid = in_row & (slots >= 0) & (slots < N)
        rows = kv[torch.where(valid, slots, 0)]  # [t, L, D]
        logits = torch.bmm(q[t0:t1], rows.transpose(1, 2)).float() * softmax_scale  # [t, H, L]
        logits.masked_fill_(~valid[:, None, :], float("-inf"))
        m = logits.amax(dim=-1, keepdim=True)  # [t, H, 1]
        if sink is not None:
            m = torch.maximum(m, sink)
        m = torch.where(torch.isfinite(m), m, 0.0)
        p = torch.exp(logits - m)
        denom = p.sum(dim=-1, keepdim=True)
        if sink is not None:
            denom = denom + torch.exp(sink - m)
        p = p / torch.where(denom > 0, denom, 1.0)
        o = torch.bmm(p.to(q.dtype), rows)  # [t, H, D]
        has_any = valid.any(dim=1)[:, None, None]
        out[t0:t1] = torch.where(has_any, o, 0.0)
    return out


# ----------------------------------------------------------------------------------------------
# Providers, correctness gate, timing
# ----------------------------------------------------------------------------------------------


def _gluon_unavailable(device: torch.device) -> str | None:
    """Why the Gluon provider cannot run here, or None."""
    if device.type != "cuda":
        return "needs a GPU (Gluon kernels do not run in the interpreter)"
    if runtime.is_amd():
        return "the benchmark runs the Hopper instantiation: NVIDIA sm90 only"
    arch = runtime.arch(device.index or 0)
    if arch != "sm90":
        return f"needs sm90, this GPU is {arch}"
    try:
        from . import gluon  # noqa: F401
    except Exception as e:  # a broken optional provider must not stop the benchmark
        return f"sparse_mla.gluon is not importable ({type(e).__name__}: {e})"
    return None


def _provider(name: str, w, device: torch.device) -> tuple[Callable[[torch.Tensor], Any], dict]:
    """(call(out), launch config as a dict) of one provider on workload ``w``."""
    q, kv, idx, indptr, scale = w.args()
    H, D = q.shape[1], q.shape[2]
    sink = w.attn_sink
    if name == "triton":
        from .prefill import resolve_config, sparse_mla_prefill

        arch = runtime.arch(device.index or 0) if device.type == "cuda" else None
        cfg = resolve_config(H, D, None, arch).to_dict()

        def call(out):
            return sparse_mla_prefill(q, kv, idx, indptr, scale, attn_sink=sink, out=out)

        return call, cfg
    if name == "gluon":
        from .gluon import choose_num_splits, default_config, mla_gluon
        from .gluon.launch import get_target

        gcfg = default_config(H, get_target(runtime.arch(device.index or 0)), has_pe=False)
        sms = torch.cuda.get_device_properties(device.index or 0).multi_processor_count
        splits = choose_num_splits(q.shape[0], H, idx.numel(), gcfg, sms)
        cfg = {**asdict(gcfg), "num_kv_splits": splits}

        def call(out):
            return mla_gluon(q, None, kv, None, idx, indptr, scale, has_pe=False,
                             attn_sink=sink, out=out)  # fmt: skip

        return call, cfg
    if name == "torch":
        lengths = indptr[1:].to(torch.int64) - indptr[:-1].to(torch.int64)
        L = int(lengths.max()) if lengths.numel() else 0
        chunk = max(1, _TORCH_CHUNK_ELEMENTS // (max(L, 1) * max(D, H)))
        cfg = {"max_slots": L, "chunk_tokens": chunk}

        def call(out):
            return torch_gather_prefill(q, kv, idx, indptr, scale, attn_sink=sink, out=out,
                                        max_slots=L, chunk_tokens=chunk)  # fmt: skip

        return call, cfg
    raise ValueError(f"unknown provider {name!r}; expected one of {PROVIDERS}")


def _token_slices(num_tokens: int, check_tokens: int) -> list[tuple[int, int]]:
    """Token ranges checked: all of them when num_tokens <= check_tokens, else the first and
    last halves of ``check_tokens`` (short and empty lists first, full ones at the end)."""
    if num_tokens <= check_tokens:
        return [(0, num_tokens)] if num_tokens else []
    half = max(1, check_tokens // 2)
    return [(0, half), (num_tokens - half, num_tokens)]


def _check(call, w, check_tokens: int) -> tuple[bool, float, str]:
    """Run ``call`` once into a NaN-poisoned output and compare slices with the fp32 reference.

    Returns (ok, worst rel_l2, note).
    """
    from .reference import check_against_reference

    q, kv, idx, indptr, scale = w.args()
    out = torch.full_like(q, float("nan"))
    got = call(out)
    if got is not out:
        return False, math.nan, "provider did not write into the given out"
    if bool(torch.isnan(out).any()):
        return False, math.nan, "NaN in the output (unwritten or wrong rows)"
    ok, worst, notes = True, 0.0, []
    for t0, t1 in _token_slices(q.shape[0], check_tokens):
        a, b = int(indptr[t0]), int(indptr[t1])
        sl_indptr = indptr[t0 : t1 + 1] - indptr[t0]
        sink = w.attn_sink
        rep = check_against_reference(out[t0:t1], q[t0:t1], kv, idx[a:b], sl_indptr, scale,
                                      attn_sink=sink)  # fmt: skip
        worst = max(worst, rep.rel_l2) if math.isfinite(rep.rel_l2) else math.inf
        if not rep.ok:
            ok = False
            notes.append(f"tokens [{t0}, {t1}): {rep}")
    return ok, worst, "; ".join(notes)


def _time(call, out: torch.Tensor, device: torch.device, quick: bool) -> float:
    if device.type == "cuda":
        return _do_bench(lambda: call(out), quick)
    # Interpreter smoke run: the check already warmed up; one timed call is enough.
    times = []
    for _ in range(1 if quick else 3):
        t = time.perf_counter()
        call(out)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


# ----------------------------------------------------------------------------------------------
# CSV rows and the table
# ----------------------------------------------------------------------------------------------


def device_slug(name: str) -> str:
    """A file-name form of a device name: "NVIDIA H200" -> "nvidia-h200"."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return slug or "unknown"


def git_commit(repo: Path | str | None = None) -> str:
    """``git rev-parse HEAD`` of the source tree, or "unknown" (no git, not a checkout)."""
    repo = Path(repo) if repo is not None else Path(__file__).resolve().parent.parent
    try:
        res = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True,
                             text=True, timeout=10, check=False)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    sha = res.stdout.strip()
    return sha if res.returncode == 0 and re.fullmatch(r"[0-9a-f]{40}", sha) else "unknown"


def _cell(col: str, v: Any) -> Any:
    if v is None:
        return ""
    if col == "config":
        return v if isinstance(v, str) else json.dumps(v, sort_keys=True)
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.6g}"
    return v


def append_rows(path: Path | str, rows: Iterable[Mapping[str, Any]]) -> Path:
    """Append rows (:data:`CSV_COLUMNS`; missing keys empty) to a CSV, with a header when new.

    Raises ValueError if the file exists with a different header (rows of another layout).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    if not new:
        with path.open(newline="") as f:
            header = next(csv.reader(f), [])
        if tuple(header) != CSV_COLUMNS:
            raise ValueError(f"{path} has columns {header}, not the bench's {list(CSV_COLUMNS)}; "
                             "write to another --out")  # fmt: skip
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        if new:
            w.writeheader()
        for r in rows:
            w.writerow({c: _cell(c, r.get(c)) for c in CSV_COLUMNS})
    return path


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """A short aligned table of benchmark rows (ceilings first, then workload x provider)."""
    cols = ["workload", "provider", "ok", "ms", "tflops", "gather_tbs", "floor_ms",
            "frac_of_floor"]  # fmt: skip

    def fmt(v) -> str:
        if v is None or v == "" or (isinstance(v, float) and math.isnan(v)):
            return "-"
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    cells = [[fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# The benchmark
# ----------------------------------------------------------------------------------------------


def run_bench(
    workloads: Sequence[str] = DEFAULT_WORKLOADS,
    *,
    tokens: int = 16384,
    providers: Sequence[str] = PROVIDERS,
    device: str | torch.device = "cuda",
    ceilings: bool = True,
    quick: bool = False,
    check_tokens: int | None = None,
    sink: bool = True,
    seed: int = 0,
    commit: str | None = None,
    out_path: Path | str | None = None,
    log: Callable[[str], Any] | None = print,
) -> list[dict[str, Any]]:
    """Check then time every provider on every named workload; returns the CSV rows.

    Args:
        workloads: :func:`sparse_mla.workloads.by_name` names, built at ``tokens`` tokens with
            the pool inside a >2 GiB buffer on a GPU, sink on unless ``sink=False``.
        providers: subset of :data:`PROVIDERS`; "gluon" is skipped (a log line, no row) off sm90.
        device: "cuda" (timed with do_bench) or "cpu" (Triton interpreter, a smoke run).
        ceilings: measure the ceilings first (GPU only) and fill floor_ms / frac_of_floor.
        quick: shorter do_bench windows and a 64-token correctness slice.
        check_tokens: tokens compared with the fp32 reference (default 256, quick 64).
        commit: recorded commit (default :func:`git_commit`).
        out_path: CSV appended to after the ceilings and after each workload (None: rows
            are only returned).
        log: progress lines (None: silent).
    """
    from . import workloads as _workloads

    say = log or (lambda _msg: None)
    device = torch.device(device)
    unknown = [p for p in providers if p not in PROVIDERS]
    if unknown:
        raise ValueError(f"providers: unknown {unknown}; expected a subset of {list(PROVIDERS)}")
    for name in workloads:
        if name not in _workloads.WORKLOADS:
            raise ValueError(f"unknown workload {name!r}; known: "
                             f"{', '.join(_workloads.standard_names())}")  # fmt: skip
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens must be an int >= 1, got {tokens!r}")
    gpu = device.type == "cuda"
    if check_tokens is None:
        check_tokens = 64 if quick else 256
    common = {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": runtime.device_name(device.index or 0) if gpu else "cpu (Triton interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": commit or git_commit(),
    }
    rows: list[dict[str, Any]] = []

    def keep(new_rows: list[dict[str, Any]]) -> None:
        # Saved as they come, so a run cut short by a time limit keeps what it measured.
        rows.extend(new_rows)
        if out_path is not None and new_rows:
            append_rows(out_path, new_rows)

    ceil = None
    if ceilings and gpu:
        say("measuring ceilings (bf16 matmul, copy, row gather 4 MiB..1 GiB) ...")
        ceil, ceil_rows = measure_ceilings(device, quick=quick, seed=seed)
        keep([{**common, "ok": True, **r} for r in ceil_rows])
    elif ceilings:
        say("ceilings skipped: they need a GPU")

    gluon_why = _gluon_unavailable(device) if "gluon" in providers else None
    for name in workloads:
        w = _workloads.by_name(name, T=tokens, device=device, big_buffer=gpu, sink=sink,
                               seed=seed)  # fmt: skip
        keep(_bench_workload(name, w, providers, device, ceil, common, check_tokens, quick,
                             gluon_why, say))  # fmt: skip
        del w
        if gpu:
            torch.cuda.empty_cache()
    return rows


def _bench_workload(name, w, providers, device, ceil, common, check_tokens, quick, gluon_why, say):
    """Rows of every provider on one built workload (check, then time when it passes)."""
    q = w.q
    T, H, D = q.shape
    nnz = w.valid_slots
    flops, nbytes = work_model(nnz, H, D, q.element_size())
    pool_bytes = w.kv.shape[0] * D * w.kv.element_size()
    fl = floor_ms(flops, nbytes, pool_bytes, ceil) if ceil else None
    base = {**common, "workload": name, "T": T, "H": H, "D": D, "topk": w.meta.get("topk"),
            "nnz": nnz, "floor_ms": fl}  # fmt: skip
    say(f"{w!r}: {flops / 1e12:.3f} TFLOP, {nbytes / 1e9:.3f} GB gathered, pool "
        f"{pool_bytes / 2**20:.1f} MiB" + (f", floor {fl:.3f} ms" if fl else ""))  # fmt: skip
    rows = []
    for prov in providers:
        if prov == "gluon" and gluon_why:
            say(f"  gluon: skipped ({gluon_why})")
            continue
        row = {**base, "provider": prov}
        try:
            call, cfg = _provider(prov, w, device)
            row["config"] = cfg
            ok, rel, note = _check(call, w, check_tokens)
            row.update(ok=ok, rel_l2=rel, note=note or None)
            if ok:
                ms = _time(call, torch.empty_like(q), device, quick)
                s = ms * 1e-3
                row.update(ms=ms, tflops=flops / s / 1e12, gather_tbs=nbytes / s / 1e12)
                if fl is not None:
                    row["frac_of_floor"] = fl / ms
        except Exception as e:  # one provider's failure must not end the run
            row.update(ok=False, note=f"{type(e).__name__}: {e}"[:500])
        status = "ok" if row["ok"] else "FAIL"
        timing = f"{row['ms']:.3f} ms" if row.get("ms") is not None else "not timed"
        say(f"  {prov}: {status}, rel_l2 {row.get('rel_l2', math.nan):.2e}, {timing}"
            + (f" ({row['note']})" if row.get("note") else ""))  # fmt: skip
        rows.append(row)
    return rows
