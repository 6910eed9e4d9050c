"""Benchmark of the sparse prefill: providers x workloads against floors measured in the same run.

For each workload (:mod:`sparse_mla.workloads`) every provider runs once on a NaN-poisoned output,
is checked against the fp32 reference (on token slices when T is large; the reference of a
workload is computed once and shared by its providers), and only then is timed: with
``triton.testing.do_bench(return_mode="median")``, or, given a time budget (the grid's way), with
:func:`time_budget` (the same L2 flush before each call and median of per-call event times, but
as many calls as fit the budget, at least 5, queued behind a GPU sleep so that ``ms`` is the
GPU's time, not the host's: a small call's Python and launch cost is not in it); on a GPU the
providers that pass a workload's check are then timed in turns (:func:`time_interleaved`: rounds
in orders where each provider follows every other equally often), so that none inherits the
clocks one particular other left. Providers:

- each kernel of the package (every name in :data:`sparse_mla.dispatch.KERNELS`, read at run
  time), forced through :func:`sparse_mla.sparse_mla_prefill` (Triton with its tuned launch for
  the arch, the others with their default launch); a kernel that cannot run a call here (Gluon
  off a GPU, a head count it does not serve) is skipped;
- ``default``: exactly what ``sparse_mla_prefill(..., config=None)`` runs (the kernel the
  entry's :func:`sparse_mla.dispatch.choose_cached` picks for the call); its config names the
  kernel;
- ``default_dense``: ``config=None`` on the dense form of the same lists (``kv_indices`` [T, K],
  ``kv_indptr=None``), the -1-padded index matrix the FlashMLA provider receives (K the longest
  list rounded up to 128; built outside the timing); its config names the kernel and K;
- ``default_dense_len``: the same with the rows' lengths (``kv_lengths``), as FlashMLA gets its
  ``topk_length``;
- ``default_dense_wide``: the same lists as an engine's top-k holds them, K its fixed width
  (the workload's top-k + window, at least the longest list rounded up to 128), with
  ``kv_lengths`` and the bound the engine knows, ``max_kv_length`` (the longest list);
- ``torch``: :func:`torch_gather_prefill`, a plain PyTorch gather and two batched matmuls;
- peers, when importable (their code is never part of the package; ``../shared/peers/``):
  ``flashmla``, DeepSeek's ``flash_mla.flash_mla_sparse_fwd`` (H 64 or 128; fewer heads are
  zero-padded to 64 and reported as ``flashmla_pad64``, 65-127 heads to 128 as
  ``flashmla_pad128``; the -1-padded [T, 1, topk] index matrix, topk a multiple of 128, with
  ``topk_length``, and the padding are built outside the timed region), and ``aiter``, aiter's
  Triton ``_sparse_attn_prefill_kernel`` at the best of a small config grid
  (:func:`aiter_configs`), each config gated before it is timed, the row naming the winner. A
  peer that is missing, does not serve the shape, or raises while set up is one log line and no
  row.

Grid
----
:func:`run_grid` (``sparse-mla bench --grid``) benches the points of :func:`grid_points` in one
run with one set of ceilings: the DSv4 CSA workload (top-k 512 + window 128, top-k 1024 from
:data:`GRID_TOPK1024_FROM_H` heads) at every head count of :data:`GRID_HEADS` and every T of
:data:`GRID_TOKENS`, plus GLM-style full top-k 2048 at :data:`GRID_GLM_HEADS` and T 16384. Each
point's workload is built once on the device, shared by its providers and freed before the next.

FP8 cache
---------
:func:`run_fp8` (``sparse-mla bench --fp8``, rows in ``data/bench/<device-slug>_fp8.csv``)
benches the FP8 KV cache (issue 25; :mod:`sparse_mla.fp8`) in one run: at the DSv4 CSA points of
:func:`fp8_points` (T 16384 x H 8/16/32/64/128, top-k 1024 at H 128, plus T 256 and 1024 at
H 16) the pool is quantized into a MODEL1 cache, and ``fp8_default`` (config=None on the
cache), each registered FP8 kernel (``fp8_<name>``), peer (a) ``flashmla*_fp8ws`` (vLLM's way:
:func:`gather_dequantize` of the referenced rows into a bf16 workspace, then FlashMLA's bf16
prefill, timed together) and peer (c) ``bf16_default_dequant`` (the package's bf16 default on
the dequantized pool) are checked against the fp32 reference over the dequantized rows and
timed. Peer (b), FlashMLA's sparse FP8 decode kernel (``csrc/sm90/decode/sparse_fp8``), is not
built by the peers' stand-in (sm90 sparse prefill only) and has no row. ``gather_tbs`` there is
the bytes of rows each provider's kernel gathers (584 a slot from the cache, 1024 from a bf16
pool; the config's ``slot_bytes``).

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
Tidy CSV rows (:data:`CSV_COLUMNS`), appended to ``data/bench/<device-slug>.csv`` by default
(a grid run: ``data/bench/<device-slug>_grid.csv``). Every row of a run has its ``timestamp``
(the run's id), ``device``, versions and ``commit``; every workload row its ``workload``, ``T``,
``H``, ``D``, ``topk``, ``provider`` and ``ok``. ``nnz`` is the valid (token, slot) pairs;
``pool_bytes`` the KV pool's size (which gather rate the floor used); ``config`` the launch as
JSON; a provider that fails the check (or raises) gets ``ok=False``, its reason in ``note``, and
no timing (``ms`` empty). The ceilings are rows too, with ``provider = "ceiling:<name>"`` and
their rate in ``tflops`` (matmul) or ``gather_tbs`` (copy: read + write; gathers: bytes read),
in TB/s.

Timing covers what one eager call costs the GPU between two events after an L2 flush: a call
whose host side (Python, validation, launch) takes longer than the flush leaves the GPU idle
inside the timed window, so the times of the smallest calls (T 64, few heads: tens of us) may
include part of their launch overhead, for every provider alike.
"""

from __future__ import annotations

import csv
import datetime
import functools
import json
import math
import re
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

from . import _consts, runtime

__all__ = [
    "AITER_MODULES",
    "BF16_SLOT_BYTES",
    "CSV_COLUMNS",
    "DEFAULT_WORKLOADS",
    "FP8_BLOCK_SIZE",
    "FP8_HEADS",
    "FP8_PEERS",
    "FP8_SLOT_BYTES",
    "FP8_SLOW_FACTOR",
    "FP8_SMALL_POINTS",
    "FP8_TOKENS",
    "GATHER_POOL_BYTES",
    "GRID_GLM_HEADS",
    "GRID_GLM_TOKENS",
    "GRID_HEADS",
    "GRID_TOKENS",
    "GRID_TOPK1024_FROM_H",
    "PROVIDERS",
    "Ceilings",
    "GridPoint",
    "Peers",
    "Prepared",
    "aiter_configs",
    "append_rows",
    "balanced_orders",
    "budget_reps",
    "budget_samples",
    "device_slug",
    "flashmla_heads",
    "floor_ms",
    "format_table",
    "fp8_kernels",
    "fp8_points",
    "fp8_provider_names",
    "gather_dequantize",
    "gather_sum",
    "git_commit",
    "grid_points",
    "grid_providers",
    "measure_ceilings",
    "pick_run",
    "provider_names",
    "read_rows",
    "run_bench",
    "run_fp8",
    "run_grid",
    "run_summary",
    "time_budget",
    "time_interleaved",
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
# The providers of a default run besides the package's registered kernels (provider_names()).
PROVIDERS = _consts.NON_KERNEL_PROVIDERS
# The grid (run_grid): CSA at every H x T, top-k 1024 from GRID_TOPK1024_FROM_H heads (V4-Pro's
# 128 heads and the head counts between it and V4-Flash's 64), GLM full top-k 2048 at a few H.
GRID_HEADS = (1, 2, 4, 8, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 112, 128)
GRID_TOKENS = (64, 256, 1024, 4096, 16384)
GRID_TOPK1024_FROM_H = 96
GRID_GLM_HEADS = (16, 32, 64)
GRID_GLM_TOKENS = (16384,)
GRID_GLM_TOPK = 2048
# Per provider and point: time budget (ms) of the timed calls, and their least and most number.
GRID_BUDGET_MS = 40.0
BUDGET_MIN_REPS = 5
BUDGET_MAX_REPS = 200
# Least timing rounds of one point's providers (:func:`time_interleaved`), timed by a budget.
TIMING_ROUNDS = 4
GATHER_POOL_BYTES = (4 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30)
CSV_COLUMNS = (
    "timestamp", "device", "torch", "triton", "commit", "workload", "T", "H", "D", "topk", "nnz",
    "provider", "config", "ok", "rel_l2", "ms", "tflops", "gather_tbs", "floor_ms",
    "frac_of_floor", "note", "pool_bytes", "host_us",
)  # fmt: skip
# --host: back-to-back calls (out= given, no sync between) whose wall time / HOST_REPS is a
# provider's host time per call (host_us), after HOST_WARMUP calls (host_time_us).
HOST_REPS = 200
HOST_WARMUP = 20
HOST_WINDOWS = 5  # host_us is the median of this many windows of HOST_REPS calls

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


def budget_reps(
    estimate_ms: float,
    budget_ms: float,
    *,
    min_reps: int = BUDGET_MIN_REPS,
    max_reps: int = BUDGET_MAX_REPS,
) -> int:
    """Timed calls that fit ``budget_ms`` at ``estimate_ms`` each (L2 flush included), clamped
    to [min_reps, max_reps]: a 25 ms call still gets ``min_reps`` samples for its median, a
    10 us one stops at ``max_reps``."""
    if not (budget_ms > 0 and min_reps >= 1 and max_reps >= min_reps):
        raise ValueError(f"need budget_ms > 0 and 1 <= min_reps <= max_reps, got {budget_ms}, "
                         f"{min_reps}, {max_reps}")  # fmt: skip
    if not math.isfinite(estimate_ms) or estimate_ms <= 0:
        return max_reps
    return max(min_reps, min(max_reps, int(budget_ms / estimate_ms)))


def _bench_driver():
    """Triton's active driver: events, synchronize and the L2 flush buffer (a test fakes it)."""
    return triton.runtime.driver.active


def time_budget(
    fn: Callable[[], Any],
    budget_ms: float,
    *,
    min_reps: int = BUDGET_MIN_REPS,
    max_reps: int = BUDGET_MAX_REPS,
) -> float:
    """Median GPU ms of ``fn``, as many calls as fit ``budget_ms`` (:func:`budget_samples`)."""
    return float(statistics.median(budget_samples(fn, budget_ms, min_reps=min_reps,
                                                  max_reps=max_reps)))  # fmt: skip


def budget_samples(
    fn: Callable[[], Any],
    budget_ms: float,
    *,
    min_reps: int = BUDGET_MIN_REPS,
    max_reps: int = BUDGET_MAX_REPS,
) -> list[float]:
    """GPU ms of each timed call of ``fn``, as many calls as fit ``budget_ms``
    (:func:`budget_reps`).

    Measured as ``triton.testing.do_bench`` measures (the L2 flushed before every call, one
    event pair around each), without its fixed 25 ms warm-up and 100 ms window: two flushed calls
    warm up and give the estimate, then the timed calls. ``fn`` must have run once already (the
    correctness gate does), so no call here compiles.

    The timed calls go in batches of :data:`HOLD_BATCH`, each behind a GPU sleep long enough
    for the host to queue the whole batch (:func:`_hold_gpu`): the events then time the GPU's
    work alone. Without it a call whose host side (Python, argument checks, launch) outlasts the
    flush would be timed with the GPU idle, waiting for the host; that host time is a cost of
    its own, not of the kernel (and is not what this column measures).
    """
    drv = _bench_driver()
    di = drv.get_device_interface()
    cache = drv.get_empty_cache_for_benchmark()
    start, end = di.Event(enable_timing=True), di.Event(enable_timing=True)
    di.synchronize()
    start.record()
    host = []
    for _ in range(2):
        drv.clear_cache(cache)
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
    end.record()
    di.synchronize()
    n = budget_reps(start.elapsed_time(end) / 2, budget_ms, min_reps=min_reps, max_reps=max_reps)
    host_ms = min(host)
    starts = [di.Event(enable_timing=True) for _ in range(n)]
    ends = [di.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        if i % HOLD_BATCH == 0:
            _hold_gpu(min(HOLD_BATCH, n - i) * (2 * host_ms + 0.05) + 0.5)
        drv.clear_cache(cache)
        starts[i].record()
        fn()
        ends[i].record()
    di.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]


def balanced_orders(n: int) -> list[list[int]]:
    """Orders of ``n`` items, one a round, balanced for what the item before leaves behind (a
    Williams design): for even ``n``, ``n`` orders in which every item takes every place once and
    comes right after every other item once; for odd ``n``, the ``n + 1`` orders of ``n + 1``
    items with the extra one dropped (every item at most twice in a place, and right after
    every other at least once). Over the whole set every item's places add up alike, so a drift
    linear in time moves every item's time alike too.

    ``[[0, 1, 3, 2], [1, 2, 0, 3], [2, 3, 1, 0], [3, 0, 2, 1]]`` for 4."""
    if type(n) is not int or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    m = n + n % 2
    first, lo, hi = [0], 1, m - 1
    for k in range(1, m):
        if k % 2:
            first.append(lo)
            lo += 1
        else:
            first.append(hi)
            hi -= 1
    return [[i for i in ((x + r) % m for x in first) if i < n] for r in range(m)]


def time_interleaved(
    fns: Sequence[Callable[[], Any]],
    budget_ms: float,
    *,
    rounds: int | None = None,
    min_reps: int = BUDGET_MIN_REPS,
    max_reps: int = BUDGET_MAX_REPS,
) -> list[float]:
    """Median GPU ms of each of ``fns``, timed in turns: ``rounds`` rounds, each giving every
    function ``budget_ms / rounds`` of :func:`budget_samples` (but at least ``min_reps`` calls:
    a long call gets ``rounds`` x ``min_reps`` in all, more than one budget), round ``r`` in the
    order ``balanced_orders(len(fns))[r % len(...)]``; a function's time is the median of its
    rounds' medians. ``rounds`` None: the whole set of orders, repeated up to at least
    :data:`TIMING_ROUNDS` rounds (4 for 2 or 3 functions, 8 for 7 or 8).

    Why turns: timed one after another, a provider inherits the clocks the ones before it left.
    On the H200 a long point's later providers ran up to 9% slower than the same kernel timed
    earlier (run of 389977b, H128 T=16384: ``gluon_ws`` 7.24 ms, then ``default``, running the
    same kernel, 7.91, then ``default_dense`` 8.61), enough to fail a 5% goal by order alone.
    Why balanced orders: what a provider inherits depends on the one before it, not only on its
    place. With four rounds forwards and backwards, the place after ``gluon_ws_small`` (H96-H128
    T = 16384) read 3-7% slow whoever sat in it (``experiments/grid_order.py``, tenth session):
    ``default`` 1.03-1.07x ``gluon_ws`` forced in the grid's order, 0.95-0.99x with the two
    swapped, 1.00-1.01x alone together. Here every provider comes after every other (and takes
    every place) equally often."""
    if rounds is not None and (type(rounds) is not int or rounds < 1):
        raise ValueError(f"rounds must be an int >= 1, got {rounds!r}")
    if not (budget_ms > 0 and min_reps >= 1 and max_reps >= min_reps):
        raise ValueError(f"need budget_ms > 0 and 1 <= min_reps <= max_reps, got {budget_ms}, "
                         f"{min_reps}, {max_reps}")  # fmt: skip
    if not fns:
        return []
    orders = balanced_orders(len(fns))
    if rounds is None:
        rounds = len(orders) * -(-TIMING_ROUNDS // len(orders))
    per_min = min_reps
    per_max = max(per_min, max_reps // rounds)
    medians: list[list[float]] = [[] for _ in fns]
    for r in range(rounds):
        for i in orders[r % len(orders)]:
            calls = budget_samples(fns[i], budget_ms / rounds, min_reps=per_min, max_reps=per_max)
            medians[i].append(statistics.median(calls))
    return [float(statistics.median(x)) for x in medians]


HOLD_BATCH = 16  # timed calls queued behind one GPU sleep


def _hold_gpu(ms: float) -> None:
    """Keep the current CUDA stream busy for about ``ms`` (a spin kernel), so the host can queue
    work behind it; nothing without a CUDA device."""
    if not torch.cuda.is_available():
        return
    torch.cuda._sleep(int(ms * _sleep_cycles_per_ms()))


@functools.cache
def _sleep_cycles_per_ms() -> float:
    """``torch.cuda._sleep`` cycles per ms on this GPU, measured once with events."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm-up
    a.record()
    torch.cuda._sleep(20_000_000)
    b.record()
    b.synchronize()
    return 20_000_000 / max(a.elapsed_time(b), 1e-3)


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


@dataclass
class Prepared:
    """A provider set up on one workload: ``run(out)`` writes the result into ``out`` (the
    correctness gate); ``timed()`` is what is timed (default: ``run`` into a scratch buffer);
    ``name`` is the row's provider name (e.g. ``flashmla_pad64``)."""

    name: str
    run: Callable[[torch.Tensor], Any]
    config: dict[str, Any]
    timed: Callable[[], Any] | None = None


class Unavailable(Exception):
    """A provider that cannot run here (a missing peer, an arch or shape it does not serve):
    one log line, no row."""


def _arch(device: torch.device) -> str | None:
    return runtime.arch(device.index or 0) if device.type == "cuda" else None


def _dispatch_call(w, device: torch.device):
    """The :class:`sparse_mla.dispatch.Call` the entry builds for workload ``w`` (its T and nnz
    too, where the dispatch takes them: a choice may depend on the token count)."""
    import dataclasses

    from . import dispatch

    q, kv, idx = w.q, w.kv, w.kv_indices
    kv2 = kv[:, 0, :] if kv.dim() == 3 else kv
    fields = {f.name for f in dataclasses.fields(dispatch.Call)}
    extra = {k: v for k, v in (("num_tokens", q.shape[0]), ("nnz", idx.numel())) if k in fields}
    return dispatch.Call(_arch(device), q.shape[1], q.shape[2], q.dtype, kv2, **extra)


def _entry_choice(call):
    """The choice ``sparse_mla_prefill(config=None)`` makes for ``call``: the entry's own cached
    lookup (:func:`sparse_mla.dispatch.choose_cached`), so a row's kernel label is the kernel
    that ran (it once read ``dispatch.choose``, which saw tuned files the entry did not)."""
    from . import dispatch

    return dispatch.choose_cached(call.arch, call.num_heads, call.head_dim, call.dtype, call.kv,
                                  call.num_tokens, call.nnz,
                                  dense_lengths=call.dense_lengths)  # fmt: skip


def _package_kernel(name: str, w, device: torch.device) -> Prepared:
    """A registered kernel of the package, forced through the public entry."""
    from . import dispatch
    from .prefill import resolve_config, sparse_mla_prefill

    q, kv, idx, indptr, scale = w.args()
    H, D = q.shape[1], q.shape[2]
    call_info = _dispatch_call(w, device)
    k = dispatch.kernel(name)
    why = k.unavailable(call_info)
    if why:
        raise Unavailable(why)
    # Triton: its tuned launch for the arch (as config=None would pick); others: their default.
    launch = resolve_config(H, D, None, call_info.arch) if name == dispatch.FALLBACK else None
    choice = dispatch.Choice(name, k.resolve(launch, call_info))
    cfg = choice.launch_dict()
    if "num_kv_splits" in k.per_call_keys and device.type == "cuda":
        try:  # what the launcher computes per call (recorded, not passed)
            from .gluon.launch import call_splits, get_target

            sms = torch.cuda.get_device_properties(device.index or 0).multi_processor_count
            ran, splits = call_splits(name, choice.launch, q.shape[0], H, idx.numel(),
                                      get_target(call_info.arch), sms)  # fmt: skip
            cfg["num_kv_splits"] = splits
            if ran is not choice.launch:  # gluon_mma's 16-head trade: the blocks that ran
                cfg["split_BLOCK_H"] = ran.BLOCK_H
        except Exception:  # the column is informative; the call computes its own
            pass

    def call(out):
        return sparse_mla_prefill(q, kv, idx, indptr, scale, attn_sink=w.attn_sink, out=out,
                                  config=choice)  # fmt: skip

    return Prepared(name, call, cfg)


def _default(w, device: torch.device) -> Prepared:
    """Exactly what ``sparse_mla_prefill(..., config=None)`` runs."""
    from .prefill import sparse_mla_prefill

    q, kv, idx, indptr, scale = w.args()
    choice = _entry_choice(_dispatch_call(w, device))
    cfg = {"kernel": choice.kernel, **choice.launch_dict()}

    def call(out):
        return sparse_mla_prefill(q, kv, idx, indptr, scale, attn_sink=w.attn_sink, out=out)

    return Prepared("default", call, cfg)


def _dense_ids_note(kernel: str, K: int, lengths: bool, bound: int | None = None) -> str:
    """A dense-ids provider's ``ids`` config entry: the form, and whether ``kernel`` reads it
    as it is or gets it packed to CSR by the entry."""
    from . import dispatch

    reads = "as they are" if dispatch.kernel(kernel).dense_ids else "as CSR"
    bounded = "" if bound is None else f" and max_kv_length {bound}"
    return f"dense [T, {K}]{' with lengths' if lengths else ''}{bounded} {reads}"


def _engine_width(w, longest: int) -> int:
    """The row length of an engine's top-k for workload ``w``: its top-k plus its window
    (``meta``; a workload without them: ``longest``), at least ``longest``."""
    topk = w.meta.get("topk") if isinstance(w.meta.get("topk"), int) else None
    if topk is None:
        return longest
    window = w.meta.get("window")
    return max(longest, topk + (window if isinstance(window, int) else 0))


def _default_dense(w, device: torch.device, lengths: bool = False, wide: bool = False) -> Prepared:
    """``sparse_mla_prefill(..., config=None)`` on dense ids: the [T, K] int32 matrix, -1
    padded, that :func:`_flashmla` passes FlashMLA (:func:`_dense_topk`), with
    ``kv_indptr=None`` (``default_dense``), and with ``lengths`` its rows' lengths as
    ``kv_lengths``, FlashMLA's ``topk_length`` (``default_dense_len``); ``wide``: padded to an
    engine's fixed width (:func:`_engine_width`) with the lengths and their bound
    ``max_kv_length`` (``default_dense_wide``)."""
    import dataclasses

    from . import validation
    from .prefill import sparse_mla_prefill

    q, kv, idx, indptr, scale = w.args()
    kv2 = kv[:, 0, :] if kv.dim() == 3 else kv
    dense, n = _dense_topk(idx, indptr, kv2.shape[0], 128)
    m = None
    if wide:
        width = _engine_width(w, dense.shape[1])
        dense = torch.nn.functional.pad(dense, (0, width - dense.shape[1]), value=-1)
        lengths, m = True, int(n.max()) if n.numel() else 0
    n = n if lengths else None
    nnz = validation.planned_nnz(dense, None if m is None else validation.length_bound(m, dense, n))
    choice = _entry_choice(
        dataclasses.replace(_dispatch_call(w, device), nnz=nnz, dense_lengths=lengths)
    )
    ids = _dense_ids_note(choice.kernel, dense.shape[1], lengths, m)
    cfg = {"kernel": choice.kernel, "ids": ids, **choice.launch_dict()}

    def call(out):
        return sparse_mla_prefill(q, kv, dense, None, scale, attn_sink=w.attn_sink, out=out,
                                  kv_lengths=n, max_kv_length=m)  # fmt: skip

    name = "default_dense_wide" if wide else "default_dense_len" if lengths else "default_dense"
    return Prepared(name, call, cfg)


def _torch(w, device: torch.device) -> Prepared:
    q, kv, idx, indptr, scale = w.args()
    H, D = q.shape[1], q.shape[2]
    lengths = indptr[1:].to(torch.int64) - indptr[:-1].to(torch.int64)
    L = int(lengths.max()) if lengths.numel() else 0
    chunk = max(1, _TORCH_CHUNK_ELEMENTS // (max(L, 1) * max(D, H)))
    cfg = {"max_slots": L, "chunk_tokens": chunk}

    def call(out):
        return torch_gather_prefill(q, kv, idx, indptr, scale, attn_sink=w.attn_sink, out=out,
                                    max_slots=L, chunk_tokens=chunk)  # fmt: skip

    return Prepared("torch", call, cfg)


def _provider(name: str, w, device: torch.device, peers: Peers | None = None) -> Prepared:
    """Set up one provider on workload ``w``; :class:`Unavailable` when it cannot run here."""
    from . import dispatch

    if name == "default":
        return _default(w, device)
    if name in ("default_dense", "default_dense_len", "default_dense_wide"):
        return _default_dense(w, device, lengths=name == "default_dense_len",
                              wide=name == "default_dense_wide")  # fmt: skip
    if name == "torch":
        return _torch(w, device)
    if name in _FLASHMLA_NAMES:
        return _flashmla(w, device, (peers or Peers()).flash_mla())
    if name == "aiter":
        raise ValueError("aiter is prepared per config: use _aiter_candidates")
    if name in dispatch.KERNELS:
        return _package_kernel(name, w, device)
    raise ValueError(f"unknown provider {name!r}; expected one of {list(provider_names())}")


# ----------------------------------------------------------------------------------------------
# Peers: FlashMLA and aiter, when importable (never committed; ../shared/peers/README.md)
# ----------------------------------------------------------------------------------------------

_FLASHMLA_NAMES = ("flashmla", "flashmla_pad64", "flashmla_pad128")
# The head counts FlashMLA's sparse prefill serves; a call with fewer heads is zero-padded to the
# next one (the row is then named flashmla_pad<heads>).
_FLASHMLA_HEADS = (64, 128)
# Where aiter's DSv4 sparse prefill kernel is looked for: the file assemble.sh writes (on
# PYTHONPATH), then an installed aiter.
AITER_MODULES = (
    "aiter_sparse_dsv4_kernels",
    "aiter.ops.triton._triton_kernels.attention.sparse_attention_dsv4",
)
_AITER_KERNEL = "_sparse_attn_prefill_kernel"


@dataclass
class Peers:
    """Peer modules, imported once per run; a module that cannot be imported is a reason."""

    aiter_module: str | None = None  # a module name or a .py path; None: AITER_MODULES
    _cache: dict[str, Any] = field(default_factory=dict)

    def _load(self, key: str, load: Callable[[], Any]):
        if key not in self._cache:
            try:
                self._cache[key] = load()
            except Unavailable as e:
                self._cache[key] = e
            except Exception as e:  # a broken peer is a missing peer
                why = f"{key} is not importable ({type(e).__name__}: {e})"
                self._cache[key] = Unavailable(why[:300])
        found = self._cache[key]
        if isinstance(found, Unavailable):
            raise found
        return found

    def flash_mla(self):
        import importlib

        return self._load("flash_mla", lambda: importlib.import_module("flash_mla"))

    def aiter(self):
        return self._load("aiter", self._import_aiter)

    def _import_aiter(self):
        import importlib
        import importlib.util

        names = [self.aiter_module] if self.aiter_module else list(AITER_MODULES)
        why = []
        for name in names:
            try:
                if name.endswith(".py") or "/" in name:
                    spec = importlib.util.spec_from_file_location("_aiter_peer", name)
                    if spec is None or spec.loader is None:
                        raise ImportError(f"cannot load {name}")
                    mod = importlib.util.module_from_spec(spec)
                    spec.loader.exec_module(mod)
                else:
                    mod = importlib.import_module(name)
            except Exception as e:
                why.append(f"{name}: {type(e).__name__}: {e}")
                continue
            if hasattr(mod, _AITER_KERNEL):
                return mod
            why.append(f"{name} has no {_AITER_KERNEL}")
        raise Unavailable("not importable (" + "; ".join(why) + ")")


def _flashmla_unavailable(device: torch.device) -> str | None:
    """Why FlashMLA's sparse prefill cannot run on ``device`` (None: it can)."""
    if device.type != "cuda" or runtime.is_amd():
        return "needs an NVIDIA GPU (sm90 or sm100)"
    arch = _arch(device)
    if arch not in ("sm90", "sm100"):
        return f"needs sm90 or sm100, this GPU is {arch}"
    return None


def _dense_topk(idx: torch.Tensor, indptr: torch.Tensor, num_kv: int, multiple: int):
    """CSR slots -> ([T, topk] int32 with -1 padding, [T] int32 lengths), topk the longest
    list rounded up to ``multiple``. An invalid slot becomes -1 before the int32 cast (an
    int64 id past N must not wrap into a valid-looking one)."""
    T = indptr.numel() - 1
    starts = indptr[:-1].to(torch.int64)
    lengths = indptr[1:].to(torch.int64) - starts
    longest = int(lengths.max()) if T else 0
    topk = max(multiple, -(-longest // multiple) * multiple)
    dense = torch.full((T, topk), -1, dtype=torch.int32, device=idx.device)
    rows = torch.repeat_interleave(torch.arange(T, device=idx.device), lengths)
    cols = torch.arange(idx.numel(), device=idx.device) - torch.repeat_interleave(starts, lengths)
    ok = (idx >= 0) & (idx < num_kv)
    dense[rows, cols] = torch.where(ok, idx, -1).to(torch.int32)
    return dense, lengths.to(torch.int32)


def flashmla_heads(num_heads: int) -> tuple[int, str]:
    """(heads FlashMLA runs, provider name) for a call with ``num_heads`` heads: 64 or 128 as
    they are (``flashmla``), 1-63 zero-padded to 64 (``flashmla_pad64``), 65-127 to 128
    (``flashmla_pad128``); more than 128 is :class:`Unavailable`."""
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads must be an int >= 1, got {num_heads!r}")
    for heads in _FLASHMLA_HEADS:
        if num_heads <= heads:
            return heads, "flashmla" if heads == num_heads else f"flashmla_pad{heads}"
    raise Unavailable(f"serves at most {_FLASHMLA_HEADS[-1]} heads, got {num_heads}")


def _pad_heads(q: torch.Tensor, sink: torch.Tensor | None, heads: int):
    """q [T, H, D] and sink [H] zero-padded to ``heads`` heads (as they are when H == heads).

    A head's softmax, sink included, is its own: the padding heads (q = 0, sink 0) cannot change
    the real heads' outputs, which are the first H of the padded call's.
    """
    T, H, D = q.shape
    if heads == H:
        return q, sink
    qp = q.new_zeros(T, heads, D)
    qp[:, :H] = q
    if sink is not None:
        sink = torch.cat([sink, sink.new_zeros(heads - H)])
    return qp, sink


def _flashmla(w, device: torch.device, mod) -> Prepared:
    """FlashMLA's ``flash_mla_sparse_fwd``: H in {64, 128} natively, fewer heads zero-padded
    to the next of them (:func:`flashmla_heads`). Index matrix and padding are built once,
    outside the timing; the timed call is FlashMLA's own (it allocates its output); the check
    copies its first H heads into out."""
    why = _flashmla_unavailable(device)
    if why:
        raise Unavailable(why)
    q, kv, idx, indptr, scale = w.args()
    H, D = q.shape[1:]
    if q.dtype != torch.bfloat16 or D != 512:
        raise Unavailable(f"needs bf16 and head_dim 512, got {q.dtype} and {D}")
    heads, name = flashmla_heads(H)
    kv2 = kv[:, 0, :] if kv.dim() == 3 else kv
    indices, topk_length = _dense_topk(idx, indptr, kv2.shape[0], 128)
    indices = indices[:, None, :]  # [T, 1, topk]
    qp, sink = _pad_heads(q, w.attn_sink, heads)
    kv3 = kv2[:, None, :]  # [N, 1, D]

    def timed():
        return mod.flash_mla_sparse_fwd(qp, kv3, indices, scale, d_v=D, attn_sink=sink,
                                        topk_length=topk_length)  # fmt: skip

    def call(out):
        res = timed()
        res = res[0] if isinstance(res, (tuple, list)) else res
        out.copy_(res[:, :H])
        return out

    cfg = {"heads": heads, "topk": indices.shape[-1], "topk_length": True,
           "module": getattr(mod, "__file__", None) or mod.__name__}  # fmt: skip
    return Prepared(name, call, cfg, timed)


# aiter's kernel at a small grid valid on any Triton GPU (its own autotune list is AMD-only):
# BLOCK_H from its list (32 up to 32 heads, else 64), then (BLOCK_K, num_warps, num_stages).
_AITER_GRID = {
    32: [(32, 4, 1), (32, 4, 2), (64, 4, 2), (32, 8, 1), (32, 8, 2), (64, 8, 2)],
    64: [(32, 8, 1), (32, 8, 2), (64, 8, 2)],
}


def aiter_configs(num_heads: int) -> list[dict[str, int]]:
    """The launch configs tried for aiter's kernel at ``num_heads`` heads."""
    block_h = 32 if num_heads <= 32 else 64
    return [{"BLOCK_H": block_h, "BLOCK_K": bk, "num_warps": nw, "num_stages": ns}
            for bk, nw, ns in _AITER_GRID[block_h]]  # fmt: skip


def _aiter_unavailable(device: torch.device) -> str | None:
    """Why aiter's kernel is not benchmarked on ``device`` (None: it is)."""
    if device.type != "cuda":
        return "needs a GPU (a timing of the interpreter says nothing about the kernel)"
    return None


def _aiter_candidates(w, device: torch.device, mod) -> list[Prepared]:
    """aiter's ``_sparse_attn_prefill_kernel`` (the JIT function under its autotuner) at each
    of :func:`aiter_configs`."""
    why = _aiter_unavailable(device)
    if why:
        raise Unavailable(why)
    kernel = getattr(mod, _AITER_KERNEL)
    fn = getattr(kernel, "fn", kernel)  # @triton.autotune -> the @triton.jit function
    q, kv, idx, indptr, scale = w.args()
    T, H, D = q.shape
    kv2 = kv[:, 0, :] if kv.dim() == 3 else kv
    sink = w.attn_sink if w.attn_sink is not None else q.new_zeros(1, dtype=torch.float32)
    block_d = triton.next_power_of_2(D)
    out = []
    for cfg in aiter_configs(H):

        def call(o, cfg=cfg):
            fn[(T, triton.cdiv(H, cfg["BLOCK_H"]))](
                q, kv2, idx, indptr, sink, o,
                q.stride(0), q.stride(1), q.stride(2), kv2.stride(0), kv2.stride(1),
                o.stride(0), o.stride(1), o.stride(2), H, D, kv2.shape[0], float(scale),
                HAS_ATTN_SINK=w.attn_sink is not None, BLOCK_H=cfg["BLOCK_H"], BLOCK_D=block_d,
                BLOCK_K=cfg["BLOCK_K"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
            )  # fmt: skip
            return o

        out.append(Prepared("aiter", call, dict(cfg)))
    return out


def provider_names() -> tuple[str, ...]:
    """Every provider name: the package's registered kernels, ``default``, ``default_dense``,
    ``default_dense_len``, ``torch`` and the peers (FlashMLA, aiter)."""
    from . import dispatch

    return (*dispatch.KERNELS, *PROVIDERS)


def _token_slices(num_tokens: int, check_tokens: int) -> list[tuple[int, int]]:
    """Token ranges checked: all of them when num_tokens <= check_tokens, else the first and
    last halves of ``check_tokens`` (short and empty lists first, full ones at the end)."""
    if num_tokens <= check_tokens:
        return [(0, num_tokens)] if num_tokens else []
    half = max(1, check_tokens // 2)
    return [(0, half), (num_tokens - half, num_tokens)]


class _References:
    """The fp32 reference and the same-dtype PyTorch baseline of a workload's checked token
    slices (:func:`_token_slices`), computed on first use and shared by every provider."""

    def __init__(self, w, check_tokens: int):
        self.w = w
        self.slices = _token_slices(w.q.shape[0], check_tokens)
        self._done: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, t0: int, t1: int) -> tuple[torch.Tensor, torch.Tensor]:
        from .reference import sparse_mla_prefill_ref

        if (t0, t1) not in self._done:
            q, kv, idx, indptr, scale = self.w.args()
            a, b = int(indptr[t0]), int(indptr[t1])
            args = (q[t0:t1], kv, idx[a:b], indptr[t0 : t1 + 1] - indptr[t0], scale)
            sink = self.w.attn_sink
            ref = sparse_mla_prefill_ref(*args, attn_sink=sink)
            base = sparse_mla_prefill_ref(*args, attn_sink=sink, upcast=False)
            self._done[(t0, t1)] = (ref, base)
        return self._done[(t0, t1)]


def _check(call, w, check_tokens: int, refs: _References | None = None) -> tuple[bool, float, str]:
    """Run ``call`` once into a NaN-poisoned output and compare slices with the fp32 reference
    (the rule of :func:`sparse_mla.reference.check_against_reference`).

    Returns (ok, worst rel_l2, note).
    """
    from .reference import error_report

    refs = refs if refs is not None else _References(w, check_tokens)
    q = w.q
    out = torch.full_like(q, float("nan"))
    got = call(out)
    if got is not out:
        return False, math.nan, "provider did not write into the given out"
    if bool(torch.isnan(out).any()):
        return False, math.nan, "NaN in the output (unwritten or wrong rows)"
    ok, worst, notes = True, 0.0, []
    for t0, t1 in refs.slices:
        ref, base = refs.get(t0, t1)
        rep = error_report(out[t0:t1], ref, base)
        worst = max(worst, rep.rel_l2) if math.isfinite(rep.rel_l2) else math.inf
        if not rep.ok:
            ok = False
            notes.append(f"tokens [{t0}, {t1}): {rep}")
    return ok, worst, "; ".join(notes)


def _time(
    call, out: torch.Tensor, device: torch.device, quick: bool, budget_ms: float | None = None
) -> float:
    """ms of ``call(out)``: :func:`time_budget` when a budget is given, else do_bench; on CPU
    an interpreter smoke timing."""
    if device.type == "cuda":
        if budget_ms is not None:
            return time_budget(lambda: call(out), budget_ms)
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

    A file written by an older version, whose columns are a prefix of :data:`CSV_COLUMNS`,
    is first rewritten (atomically) with the new header, its rows keeping their values and the
    new columns empty. Raises ValueError if the file exists with another layout.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    if not new:
        with path.open(newline="") as f:
            header = next(csv.reader(f), [])
        if tuple(header) != CSV_COLUMNS:
            if tuple(header) != CSV_COLUMNS[: len(header)]:
                raise ValueError(f"{path} has columns {header}, not the bench's "
                                 f"{list(CSV_COLUMNS)}; write to another --out")  # fmt: skip
            _add_columns(path)
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        if new:
            w.writeheader()
        for r in rows:
            w.writerow({c: _cell(c, r.get(c)) for c in CSV_COLUMNS})
    return path


def _add_columns(path: Path) -> None:
    """Rewrite an older bench CSV with the current header (new columns empty)."""
    import io

    from ._files import atomic_write

    with path.open(newline="") as f:
        old = list(csv.DictReader(f))
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, lineterminator="\r\n")
    w.writeheader()
    for r in old:
        w.writerow({c: r.get(c, "") or "" for c in CSV_COLUMNS})
    atomic_write(path, buf.getvalue().encode())


_FLOAT_CELLS = ("rel_l2", "ms", "tflops", "gather_tbs", "floor_ms", "frac_of_floor", "host_us")
_INT_CELLS = ("T", "H", "D", "topk", "nnz", "pool_bytes")


def read_rows(path: Path | str) -> list[dict[str, Any]]:
    """Rows of a bench CSV with their types back: ints, floats, ``ok`` a bool, ``config`` a
    dict, empty cells None."""
    out = []
    with Path(path).open(newline="") as f:
        for r in csv.DictReader(f):
            row: dict[str, Any] = {}
            for k, v in r.items():
                if v == "" or v is None:
                    row[k] = None
                elif k in _FLOAT_CELLS:
                    row[k] = float(v)
                elif k in _INT_CELLS:
                    row[k] = int(v)
                elif k == "ok":
                    row[k] = v == "True"
                elif k == "config":
                    row[k] = json.loads(v)
                else:
                    row[k] = v
            out.append(row)
    return out


def pick_run(rows: Sequence[Mapping[str, Any]], run: str | None = None) -> str:
    """The run (its ``timestamp``) of bench rows to read: ``run`` when given (ValueError if
    no row has it), else the latest run that has workload rows."""
    runs = sorted({r["timestamp"] for r in rows if r.get("workload") and r.get("timestamp")})
    if not runs:
        raise ValueError("no workload rows")
    run = run or runs[-1]
    if run not in runs:
        raise ValueError(f"no run {run!r}; runs: {runs}")
    return run


def run_summary(rows: Sequence[Mapping[str, Any]], run: str | None = None) -> dict[str, Any]:
    """One run's workloads with their same-run floors and every provider's time.

    Args:
        rows: :func:`read_rows` (or :func:`run_bench`) rows, possibly of several runs.
        run: the run's ``timestamp`` (default: the latest run with workload rows).

    Returns:
        {"run", "device", "commit", "torch", "triton", "gather_tbs": {pool bytes: the run's
        row-gather rate in TB/s}, "workloads": {name: {"H", "D", "T",
        "topk", "nnz", "flops", "bytes", "floor_ms", "matmul_ms", "gather_ms", "ms":
        {provider: ms}, "failed": [provider, ...], "config": {provider: config}}}}.
        ``matmul_ms`` = FLOPs / the run's matmul rate; ``gather_ms`` = gathered bytes / the
        run's gather rate at the pool's size (rows without ``pool_bytes``: the floor when it is
        above the matmul floor, else None).
    """
    run = pick_run(rows, run)
    mine = [r for r in rows if r.get("timestamp") == run]
    matmul = gather = None
    rates: dict[int, float] = {}
    for r in mine:
        prov = r.get("provider") or ""
        if prov == "ceiling:matmul_bf16" and r.get("tflops"):
            matmul = float(r["tflops"]) * 1e12
        elif prov.startswith("ceiling:gather_") and r.get("gather_tbs"):
            cfg = r["config"] if isinstance(r["config"], Mapping) else json.loads(r["config"])
            rates[int(cfg["pool_bytes"])] = float(r["gather_tbs"]) * 1e12
    if rates:
        gather = Ceilings(matmul or math.inf, 0.0, rates)
    work: dict[str, dict[str, Any]] = {}
    first = None
    for r in mine:
        if not r.get("workload"):
            continue
        first = first or r
        w = work.get(r["workload"])
        if w is None:
            H, D, nnz = int(r["H"]), int(r["D"]), int(r["nnz"])
            flops, nbytes = work_model(nnz, H, D)
            floor = r.get("floor_ms")
            mm = flops / matmul * 1e3 if matmul else None
            if gather is not None and r.get("pool_bytes"):
                g = nbytes / gather.gather_rate(int(r["pool_bytes"])) * 1e3
            elif floor is not None and mm is not None and floor > mm * (1 + 1e-6):
                g = floor
            else:
                g = None
            w = work[r["workload"]] = {
                "H": H, "D": D, "T": r.get("T"), "topk": r.get("topk"), "nnz": nnz,
                "flops": flops, "bytes": nbytes, "floor_ms": floor, "matmul_ms": mm,
                "gather_ms": g, "ms": {}, "failed": [], "config": {},
            }  # fmt: skip
        w["config"][r["provider"]] = r.get("config")
        if r.get("ok") and r.get("ms"):
            w["ms"][r["provider"]] = float(r["ms"])
        else:
            w["failed"].append(r["provider"])
    first = first or {}
    return {"run": run, "device": first.get("device"), "commit": first.get("commit"),
            "torch": first.get("torch"), "triton": first.get("triton"),
            "gather_tbs": {b: r / 1e12 for b, r in sorted(rates.items())},
            "workloads": work}  # fmt: skip


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """A short aligned table of benchmark rows (ceilings first, then workload x provider)."""
    cols = ["workload", "provider", "ok", "ms", "tflops", "gather_tbs", "floor_ms",
            "frac_of_floor"]  # fmt: skip
    if any(r.get("host_us") not in (None, "") for r in rows):
        cols.append("host_us")

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


def _print_flush(msg: str) -> None:
    print(msg, flush=True)


def _chosen_providers(providers: Sequence[str] | None, default: Sequence[str]) -> list[str]:
    """The providers of a run in order, duplicates dropped; FlashMLA is one provider whatever
    name asks for it (its rows are named by the head count)."""
    known = (*provider_names(), *_FLASHMLA_NAMES)
    chosen = list(default) if providers is None else list(providers)
    unknown = [p for p in chosen if p not in known]
    if unknown:
        raise ValueError(f"providers: unknown {unknown}; expected a subset of {list(known)}")
    out: list[str] = []
    for p in chosen:
        if p in out or (p in _FLASHMLA_NAMES and any(o in _FLASHMLA_NAMES for o in out)):
            continue
        out.append(p)
    return out


class _Run:
    """One run's common columns, its rows and where they go (appended as they come, so a run
    cut short by a time limit keeps what it measured)."""

    def __init__(self, device: torch.device, commit: str | None, out_path, say):
        gpu = device.type == "cuda"
        now = datetime.datetime.now(datetime.timezone.utc)
        self.common = {
            "timestamp": now.isoformat(timespec="seconds"),
            "device": runtime.device_name(device.index or 0) if gpu else "cpu (Triton interpreter)",
            "torch": torch.__version__,
            "triton": triton.__version__,
            "commit": commit or git_commit(),
        }
        self.rows: list[dict[str, Any]] = []
        self.out_path = out_path
        self.say = say
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def keep(self, new_rows: list[dict[str, Any]]) -> None:
        self.rows.extend(new_rows)
        if self.out_path is not None and new_rows:
            append_rows(self.out_path, new_rows)

    def ceilings(self, device: torch.device, wanted: bool, quick: bool, seed: int):
        """Measure the ceilings (GPU only) once for the run; returns them or None."""
        if wanted and device.type == "cuda":
            self.say("measuring ceilings (bf16 matmul, copy, row gather 4 MiB..1 GiB) ...")
            ceil, ceil_rows = measure_ceilings(device, quick=quick, seed=seed)
            self.keep([{**self.common, "ok": True, **r} for r in ceil_rows])
            self.say(f"  ceilings done at {self.elapsed():.0f} s")
            return ceil
        if wanted:
            self.say("ceilings skipped: they need a GPU")
        return None


def _check_budget(budget_ms: float | None) -> None:
    if budget_ms is not None and (isinstance(budget_ms, bool) or not budget_ms > 0):
        raise ValueError(f"budget_ms must be > 0 (or None: do_bench), got {budget_ms!r}")


def run_bench(
    workloads: Sequence[str] = DEFAULT_WORKLOADS,
    *,
    tokens: int = 16384,
    providers: Sequence[str] | None = None,
    device: str | torch.device = "cuda",
    ceilings: bool = True,
    quick: bool = False,
    check_tokens: int | None = None,
    sink: bool = True,
    seed: int = 0,
    commit: str | None = None,
    out_path: Path | str | None = None,
    aiter_module: str | None = None,
    budget_ms: float | None = None,
    host: bool = False,
    log: Callable[[str], Any] | None = print,
) -> list[dict[str, Any]]:
    """Check then time every provider on every named workload; returns the CSV rows.

    Args:
        workloads: :func:`sparse_mla.workloads.by_name` names, built at ``tokens`` tokens with
            the pool inside a >2 GiB buffer on a GPU, sink on unless ``sink=False``.
        providers: names from :func:`provider_names` (default: all of them). One that cannot run
            here (a peer that is not importable, a kernel without this arch, a shape it does not
            serve) is one log line and no row; a peer that raises while set up likewise.
        device: "cuda" (timed with do_bench) or "cpu" (Triton interpreter, a smoke run).
        ceilings: measure the ceilings first (GPU only) and fill floor_ms / frac_of_floor.
        quick: shorter do_bench windows and a 64-token correctness slice.
        check_tokens: tokens compared with the fp32 reference (default 256, quick 64).
        commit: recorded commit (default :func:`git_commit`).
        out_path: CSV appended to after the ceilings and after each workload (None: rows
            are only returned).
        aiter_module: where aiter's kernel is imported from (a module name or a .py path;
            default: :data:`AITER_MODULES`).
        budget_ms: time each provider with :func:`time_budget` at this budget instead of
            do_bench (None).
        host: also measure each provider's host time per call (``host_us``,
            :func:`host_time_us`; GPU only).
        log: progress lines (None: silent).
    """
    from . import workloads as _workloads

    say = log or (lambda _msg: None)
    device = torch.device(device)
    chosen = _chosen_providers(providers, provider_names())
    for name in workloads:
        if name not in _workloads.WORKLOADS:
            raise ValueError(f"unknown workload {name!r}; known: "
                             f"{', '.join(_workloads.standard_names())}")  # fmt: skip
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens must be an int >= 1, got {tokens!r}")
    _check_budget(budget_ms)
    gpu = device.type == "cuda"
    if check_tokens is None:
        check_tokens = 64 if quick else 256
    run = _Run(device, commit, out_path, say)
    ceil = run.ceilings(device, ceilings, quick, seed)
    peers = Peers(aiter_module)
    for name in workloads:
        w = _workloads.by_name(name, T=tokens, device=device, big_buffer=gpu, sink=sink,
                               seed=seed)  # fmt: skip
        run.keep(_bench_workload(name, w, chosen, device, ceil, run.common, check_tokens,
                                 quick, peers, say, budget_ms=budget_ms, host=host))  # fmt: skip
        del w
        if gpu:
            torch.cuda.empty_cache()
        say(f"  {name} done at {run.elapsed():.0f} s")
    return run.rows


# ----------------------------------------------------------------------------------------------
# The grid: every head count x every prompt chunk length, one run
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GridPoint:
    """One point of the grid: ``kind`` ("dsv4_csa" or "glm_full_topk") at T tokens, H heads and
    top-k ``topk``; :meth:`build` makes its workload (seeded, so every run builds the same).

    ``context`` (CSA only): tokens already in the request's cache before the call's T, as in a
    chunked-prefill step or an MTP / speculative step of a long request. At 0 (the grid's own
    points) the call is a whole prompt and a token's list grows with its position (about 40
    slots a token at T = 64); from ``4 x topk`` on every list is whole (top-k + window slots).
    """

    kind: str
    T: int
    H: int
    topk: int
    context: int = 0

    def __post_init__(self):
        if self.kind not in ("dsv4_csa", "glm_full_topk"):
            raise ValueError(f"kind must be 'dsv4_csa' or 'glm_full_topk', got {self.kind!r}")
        c = self.context
        if isinstance(c, bool) or not isinstance(c, int) or c < 0:
            raise ValueError(f"context must be an int >= 0, got {c!r}")
        if c and self.kind != "dsv4_csa":
            raise ValueError(f"context is a CSA point's ({self.kind} has none), got {c}")

    @property
    def workload(self) -> str:
        """The rows' ``workload``: ``csa_h{H}_topk{k}`` or ``glm_h{H}_topk{k}`` (no T: that is
        the ``T`` column, as in a named-workload run), ``_ctx{context}`` appended when the
        point has a context."""
        family = {"dsv4_csa": "csa", "glm_full_topk": "glm"}[self.kind]
        ctx = f"_ctx{self.context}" if self.context else ""
        return f"{family}_h{self.H}_topk{self.topk}{ctx}"

    def build(
        self,
        device: str | torch.device = "cpu",
        *,
        seed: int = 0,
        sink: bool = True,
        big_buffer: bool = False,
        **kw,
    ):
        """The point's :class:`~sparse_mla.workloads.Workload`, built on ``device`` (``kw``:
        further generator arguments, e.g. a small ``D`` for a CPU test)."""
        from . import workloads as _workloads

        generators = {"dsv4_csa": _workloads.dsv4_csa, "glm_full_topk": _workloads.glm_full_topk}
        fn = generators[self.kind]
        if self.context:
            kw = {"context": self.context, **kw}
        return fn(self.T, self.H, topk=self.topk, device=device, seed=seed, sink=sink,
                  big_buffer=big_buffer, name=f"{self.workload}_t{self.T}", **kw)  # fmt: skip


def _grid_topk(num_heads: int) -> int:
    """The CSA top-k of the grid at ``num_heads``: 1024 (V4-Pro) from GRID_TOPK1024_FROM_H."""
    return 1024 if num_heads >= GRID_TOPK1024_FROM_H else 512


def _sizes(name: str, values: Iterable[int]) -> list[int]:
    out: list[int] = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be ints >= 1, got {v!r}")
        if v not in out:
            out.append(v)
    if not out:
        raise ValueError(f"{name}: give at least one value")
    return out


def grid_points(
    heads: Iterable[int] = GRID_HEADS,
    tokens: Iterable[int] = GRID_TOKENS,
    *,
    glm: bool = True,
    context: int = 0,
) -> list[GridPoint]:
    """The grid's points, T-major in the given orders (short calls first): the CSA workload
    (top-k 512, 1024 from :data:`GRID_TOPK1024_FROM_H` heads) at every (T, H); then, with
    ``glm``, GLM full top-k 2048 at the (T, H) of :data:`GRID_GLM_TOKENS` x
    :data:`GRID_GLM_HEADS` that ``tokens`` and ``heads`` include. The full grid: 80 + 3 points.
    ``context``: the CSA points' cached tokens before the call (:class:`GridPoint`); GLM points
    have none, so ``glm`` must be False with a context.
    """
    heads, tokens = _sizes("heads", heads), _sizes("tokens", tokens)
    if context and glm:
        raise ValueError("GLM points have no context: pass glm=False with a context")
    points = [GridPoint("dsv4_csa", T, H, _grid_topk(H), context) for T in tokens for H in heads]
    if glm:
        points += [GridPoint("glm_full_topk", T, H, GRID_GLM_TOPK) for T in tokens
                   if T in GRID_GLM_TOKENS for H in heads if H in GRID_GLM_HEADS]  # fmt: skip
    return points


def grid_providers() -> tuple[str, ...]:
    """A grid run's default providers: every registered package kernel, ``default``,
    ``default_dense`` and ``default_dense_len`` (config=None on FlashMLA's dense ids, without
    and with their lengths) and FlashMLA (``torch`` and ``aiter`` only when asked for: they are
    slow to time)."""
    from . import dispatch

    return (*dispatch.KERNELS, "default", "default_dense", "default_dense_len", "flashmla")


def run_grid(
    points: Sequence[GridPoint] | None = None,
    *,
    heads: Iterable[int] = GRID_HEADS,
    tokens: Iterable[int] = GRID_TOKENS,
    glm: bool = True,
    context: int = 0,
    providers: Sequence[str] | None = None,
    device: str | torch.device = "cuda",
    ceilings: bool = True,
    quick: bool = False,
    check_tokens: int | None = None,
    sink: bool = True,
    seed: int = 0,
    commit: str | None = None,
    out_path: Path | str | None = None,
    aiter_module: str | None = None,
    budget_ms: float | None = GRID_BUDGET_MS,
    time_limit_s: float | None = None,
    host: bool = False,
    log: Callable[[str], Any] | None = _print_flush,
    **workload_kw,
) -> list[dict[str, Any]]:
    """Check then time every provider at every grid point, in one run; returns the CSV rows.

    Args:
        points: the points (default :func:`grid_points` of ``heads``, ``tokens``, ``glm``,
            ``context``).
        providers: default :func:`grid_providers`; names as for :func:`run_bench`.
        budget_ms: per provider and point, the time budget of :func:`time_budget` (None:
            do_bench's fixed windows, about 125 ms each).
        time_limit_s: start no point after this many seconds (the rows so far are kept; the
            points left are logged).
        host: also measure each provider's host time per call (``host_us``,
            :func:`host_time_us`; GPU only).
        log: progress: the run's header, one line per point with every provider's ms (and which
            kernel ``default`` ran), first-seen skip reasons and failures (None: silent).
        workload_kw: passed to each point's :meth:`GridPoint.build` (e.g. ``D`` for a CPU test).

    Other arguments as for :func:`run_bench`. Rows are appended to ``out_path`` after each
    point; each point's workload is built on ``device`` once, shared by its providers and
    freed before the next.
    """
    say = log or (lambda _msg: None)
    device = torch.device(device)
    if points is None:
        points = grid_points(heads, tokens, glm=glm, context=context)
    points = list(points)
    chosen = _chosen_providers(providers, grid_providers())
    _check_budget(budget_ms)
    if time_limit_s is not None and not time_limit_s > 0:
        raise ValueError(f"time_limit_s must be > 0 (or None), got {time_limit_s!r}")
    gpu = device.type == "cuda"
    if check_tokens is None:
        check_tokens = 64 if quick else 256
    run = _Run(device, commit, out_path, say)
    timing = f"{budget_ms:g} ms budget" if budget_ms is not None else "do_bench"
    say(f"grid: {len(points)} points x {len(chosen)} providers ({', '.join(chosen)}), "
        f"{timing} per provider and point, run {run.common['timestamp']}")  # fmt: skip
    ceil = run.ceilings(device, ceilings, quick, seed)
    peers = Peers(aiter_module)
    seen: set[tuple[str, str]] = set()
    width = len(str(len(points)))
    for i, pt in enumerate(points, 1):
        if time_limit_s is not None and run.elapsed() >= time_limit_s:
            left = ", ".join(f"{p.workload} T={p.T}" for p in points[i - 1 :])
            say(f"time limit {time_limit_s:g} s reached: {len(points) - i + 1} points not run "
                f"({left})")  # fmt: skip
            break
        w = pt.build(device, seed=seed, sink=sink, big_buffer=gpu, **workload_kw)
        rows = _bench_workload(pt.workload, w, chosen, device, ceil, run.common, check_tokens,
                               quick, peers, say, budget_ms=budget_ms, seen=seen,
                               host=host)  # fmt: skip
        del w
        if gpu:
            torch.cuda.empty_cache()
        run.keep(rows)
        say(f"[{i:>{width}}/{len(points)} {run.elapsed():5.0f} s] {pt.workload} T={pt.T}: "
            + _point_summary(rows, chosen))  # fmt: skip
    say(f"grid done at {run.elapsed():.0f} s: {len(run.rows)} rows")
    return run.rows


def _provider_of(row_name: str) -> str:
    """The requested provider of a row (``flashmla_pad64`` -> ``flashmla``)."""
    return "flashmla" if row_name in _FLASHMLA_NAMES else row_name


def _point_summary(rows: Sequence[Mapping[str, Any]], chosen: Sequence[str]) -> str:
    """One point's providers: ``name ms`` (FAIL when its check failed, ``-`` when it does not
    serve the point), which kernel ``default`` ran, and the floor."""
    by = {_provider_of(r["provider"]): r for r in rows}
    parts = []
    for prov in chosen:
        r = by.get("flashmla" if prov in _FLASHMLA_NAMES else prov)
        if r is None:
            parts.append(f"{prov} -")
            continue
        shown = f"{r['provider']} {r['ms']:.4g}" if r.get("ok") and r.get("ms") else (
            f"{r['provider']} FAIL")  # fmt: skip
        cfg = r.get("config")
        if prov.startswith("default") and isinstance(cfg, Mapping) and cfg.get("kernel"):
            shown += f" ({cfg['kernel']})"
        parts.append(shown)
    floor = next((r["floor_ms"] for r in rows if r.get("floor_ms")), None)
    return "  ".join(parts) + (f"  | floor {floor:.4g}" if floor else "")


def _bench_workload(name, w, chosen, device, ceil, common, check_tokens, quick, peers, say, *,
                    budget_ms=None, seen=None, host=False):  # fmt: skip
    """Rows of every provider on one built workload (check, then time when it passes).

    ``seen`` None: a line per provider (a named-workload run). A set: the grid's quiet mode,
    where a skip reason is logged the first time it is seen (the set keeps them) and a failure
    always; the caller prints the point's one line.
    """
    q = w.q
    T, H, D = q.shape
    nnz = w.valid_slots
    flops, nbytes = work_model(nnz, H, D, q.element_size())
    pool_bytes = w.kv.shape[0] * D * w.kv.element_size()
    fl = floor_ms(flops, nbytes, pool_bytes, ceil) if ceil else None
    base = {**common, "workload": name, "T": T, "H": H, "D": D, "topk": w.meta.get("topk"),
            "nnz": nnz, "floor_ms": fl, "pool_bytes": pool_bytes}  # fmt: skip
    verbose = seen is None
    if verbose:
        say(f"{w!r}: {flops / 1e12:.3f} TFLOP, {nbytes / 1e9:.3f} GB gathered, pool "
            f"{pool_bytes / 2**20:.1f} MiB" + (f", floor {fl:.3f} ms" if fl else ""))  # fmt: skip

    def once(prov: str, what: str) -> None:
        if verbose:
            say(f"  {prov}: {what}"[:500])
        elif (prov, what) not in seen:
            seen.add((prov, what))
            say(f"    {prov}: {what}"[:500])

    refs = _References(w, check_tokens)
    rows = []
    peer_names = (*_FLASHMLA_NAMES, "aiter")
    # On a GPU with a budget (the grid's way), the providers that pass are timed together
    # afterwards, in turns (time_interleaved), so that none inherits another's clocks.
    defer = device.type == "cuda" and budget_ms is not None
    pending: list[tuple[dict[str, Any], Callable[[], Any]]] = []
    spent: dict[int, float] = {}
    # One output buffer for every timed provider that writes into one (the package's): none is
    # timed on an allocation of its own (at T = 16384 an out is 0.3-2.1 GB; the providers' own
    # buffers left `default` and the same kernel forced timed on different memory).
    timing_out = torch.empty_like(w.q)
    for prov in chosen:
        t0 = time.perf_counter()
        row = {**base, "provider": prov}
        try:
            if prov == "aiter":
                row.update(_best_of(_aiter_candidates(w, device, peers.aiter()), w, device,
                                    check_tokens, quick, say, refs=refs,
                                    budget_ms=budget_ms))  # fmt: skip
            else:
                prepared = _provider(prov, w, device, peers)
                row.update(provider=prepared.name, config=prepared.config)
                res, timer = _check_and_time(prepared, w, device, check_tokens, quick, refs=refs,
                                             budget_ms=budget_ms, host=host, defer=defer,
                                             out=timing_out)  # fmt: skip
                row.update(res)
                if timer is not None:
                    pending.append((row, timer))
        except Unavailable as e:
            once(prov, f"skipped ({e})")
            continue
        except Exception as e:  # one provider's failure must not end the run
            if prov in peer_names:
                once(prov, f"skipped, it raised ({type(e).__name__}: {e})")
                continue
            row.update(ok=False, note=f"{type(e).__name__}: {e}"[:500])
        spent[id(row)] = time.perf_counter() - t0
        rows.append(row)
    if pending:
        t0 = time.perf_counter()
        for (row, _), ms in zip(pending, time_interleaved([fn for _, fn in pending], budget_ms),
                                strict=True):  # fmt: skip
            row["ms"] = ms
        share = (time.perf_counter() - t0) / len(pending)
        for row, fn in pending:
            spent[id(row)] += share
            if host:
                t0 = time.perf_counter()
                row["host_us"] = host_time_us(fn, device)
                spent[id(row)] += time.perf_counter() - t0
    for row in rows:
        if row.get("ms") is not None:
            s = row["ms"] * 1e-3
            row.update(tflops=flops / s / 1e12, gather_tbs=nbytes / s / 1e12)
            if fl is not None:
                row["frac_of_floor"] = fl / row["ms"]
        if verbose:
            status = "ok" if row["ok"] else "FAIL"
            timing = f"{row['ms']:.3f} ms" if row.get("ms") is not None else "not timed"
            if row.get("host_us") is not None:
                timing += f", host {row['host_us']:.1f} us/call"
            rel = row.get("rel_l2")
            rel = math.nan if rel is None else rel
            say(f"  {row['provider']}: {status}, rel_l2 {rel:.2e}, {timing}"
                f" [{spent[id(row)]:.1f} s]"
                + (f" ({row['note']})" if row.get("note") else ""))  # fmt: skip
        elif not row["ok"]:
            say(f"    {row['provider']} at {name} T={T}: FAIL ({row.get('note')})"[:500])
    return rows


def _check_and_time(p: Prepared, w, device, check_tokens: int, quick: bool, *, out, refs=None,
                    budget_ms=None, host=False,
                    defer=False) -> tuple[dict[str, Any], Callable[[], Any] | None]:  # fmt: skip
    """ok / rel_l2 / note from the gate, and ms when it passed (and host_us with ``host``).

    With ``defer`` nothing is timed here: a call that passed comes back as the second item (a
    zero-argument callable writing ``out``), for the caller to time with the point's other
    providers (:func:`time_interleaved`) and to measure its host time; else that item is None.
    ``out``: the buffer the timed calls write (shaped as ``w.q``, shared by a point's
    providers). The gate checks on outputs of its own (NaN-poisoned), never on this one."""
    ok, rel, note = _check(p.run, w, check_tokens, refs)
    res: dict[str, Any] = {"ok": ok, "rel_l2": rel, "note": note or None}
    if not ok:
        return res, None
    fn = p.timed if p.timed is not None else (lambda: p.run(out))
    if defer:
        return res, fn
    res["ms"] = _time(lambda _out: fn(), None, device, quick, budget_ms)
    if host and device.type == "cuda":
        res["host_us"] = host_time_us(fn, device)
    return res, None


def host_time_us(fn: Callable[[], Any], device: torch.device, reps: int = HOST_REPS,
                 warmup: int = HOST_WARMUP, windows: int = HOST_WINDOWS) -> float:  # fmt: skip
    """Host time per call of ``fn`` (us): ``reps`` calls back to back with no sync between,
    wall time / reps, after ``warmup`` calls and a sync; the median of ``windows`` such
    windows (a sync between them). The GPU runs the launches while the host issues more, so
    this is what a call costs the CPU thread (validation, dispatch, launch), not the kernel's
    time, as long as the launch queue does not fill (it holds about a thousand launches; a
    call here makes one or two)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(windows):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - t0) / reps * 1e6)
    torch.cuda.synchronize(device)
    return statistics.median(times)


def _best_of(candidates: list[Prepared], w, device, check_tokens, quick, say, *, refs=None,
             budget_ms=None) -> dict[str, Any]:  # fmt: skip
    """Gate every candidate config, rank those that pass by a short timing, time the fastest
    in full; the row names the winner's config and how many were tried."""
    passed, wrong, raised = [], [], []
    short = None if budget_ms is None else budget_ms / 4
    for p in candidates:
        try:
            ok, rel, note = _check(p.run, w, check_tokens, refs)
        except Exception as e:  # a config that does not compile or launch here is no candidate
            raised.append(f"{p.config}: {type(e).__name__}: {str(e)[:120]}")
            continue
        if not ok:
            wrong.append(f"{p.config}: {note or 'wrong result'}")
            continue
        ms = _time(p.run, torch.empty_like(w.q), device, True, short)
        passed.append((ms, rel, p))
    if raised or wrong:
        say(f"  {candidates[0].name}: {len(raised) + len(wrong)} of {len(candidates)} configs "
            "out: " + " | ".join(raised + wrong)[:800])  # fmt: skip
    if not passed:
        if not wrong:
            raise Unavailable("no config compiled and ran here")
        return {"ok": False, "rel_l2": None, "note": "every config failed the check: "
                + " | ".join(wrong)[:400], "config": {"tried": len(candidates)}}  # fmt: skip
    _, rel, best = min(passed, key=lambda t: t[0])
    ms = _time(best.run, torch.empty_like(w.q), device, quick, budget_ms)
    cfg = {**best.config, "tried": len(candidates), "passed": len(passed)}
    return {"provider": best.name, "ok": True, "rel_l2": rel, "ms": ms, "config": cfg}


# ----------------------------------------------------------------------------------------------
# FP8 KV cache (issue 25): the FP8 kernels and their peers on the same cache, one run
# ----------------------------------------------------------------------------------------------

FP8_BLOCK_SIZE = 64  # tokens a block of the MODEL1 cache (FlashMLA's sparse FP8 block size)
FP8_HEADS = (8, 16, 32, 64, 128)
FP8_TOKENS = (16384,)
FP8_SMALL_POINTS = ((1024, 16), (256, 16))  # (T, H): short calls, run last
FP8_SLOW_FACTOR = 10.0  # a provider whose one call takes more than this x the fastest: not timed
BF16_SLOT_BYTES = 1024  # a slot's bf16 row: 512 x 2 bytes
FP8_SLOT_BYTES = 584  # a slot in the MODEL1 cache: 576 bytes of [NoPE | RoPE] + 8 scale bytes
# The peers of an FP8 run besides the package's FP8 kernels (fp8_provider_names()).
FP8_PEERS = ("flashmla_fp8ws", "flashmla_fp8decode", "bf16_default_dequant")


def gather_dequantize(cache, slots: torch.Tensor, *, out: torch.Tensor | None = None):
    """The bf16 rows of ``slots`` read from an FP8 cache: a vLLM-style workspace fill.

    Only the listed slots' bytes are read (576 bytes of [NoPE | RoPE] and 7 scale bytes each),
    decoded as :func:`sparse_mla.fp8.dequantize` decodes them (e4m3fn x ue8m0 in fp32, rounded
    to bf16: the same bits), on the slots' device, with no host sync. An invalid slot (< 0 or
    >= the cache's slots) gives a zero row.

    Args:
        cache: a :class:`sparse_mla.fp8.FP8Cache`.
        slots: [n] int32/int64 slot ids.
        out: optional [n, 512] bf16 buffer with a unit last stride (the workspace).

    Returns:
        out [n, 512] bf16: row i is ``dequantize(cache)[slots[i]]``, or zeros.
    """
    from . import fp8

    if not isinstance(cache, fp8.FP8Cache):
        raise TypeError(f"gather_dequantize takes an FP8Cache, got {type(cache).__name__}")
    if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.dtype not in (
        torch.int32, torch.int64):  # fmt: skip
        raise TypeError("slots must be a 1-D int32/int64 tensor")
    n = slots.numel()
    if out is None:
        out = torch.empty(n, fp8.HEAD_DIM, dtype=torch.bfloat16, device=cache.device)
    if tuple(out.shape) != (n, fp8.HEAD_DIM) or out.dtype != torch.bfloat16 or (
        n and out.stride(1) != 1):  # fmt: skip
        raise ValueError(f"out must be [{n}, {fp8.HEAD_DIM}] bf16 with a unit last stride, got "
                         f"{tuple(out.shape)} {out.dtype}")  # fmt: skip
    if n == 0:
        return out
    if cache.num_slots == 0:
        return out.zero_()
    bs = cache.block_size
    s = slots.to(torch.int64)
    valid = ((s >= 0) & (s < cache.num_slots))[:, None]
    s = torch.where(valid[:, 0], s, 0)
    blk = torch.div(s, bs, rounding_mode="floor")
    tok = s - blk * bs
    raw = cache.as_bytes()  # [num_blocks, bs x 584] uint8, the block stride kept
    body = raw[:, : bs * fp8.ROW_BYTES].unflatten(1, (bs, fp8.ROW_BYTES))
    scl = raw[:, bs * fp8.ROW_BYTES :].unflatten(1, (bs, fp8.SCALE_BYTES))
    rows = body[blk, tok]  # [n, 576]: only these rows' bytes are read
    scales = scl[blk, tok, : fp8.NUM_TILES]  # [n, 7]
    nope = rows[:, : fp8.D_NOPE].contiguous().view(torch.float8_e4m3fn).float()
    nope = nope.view(n, fp8.NUM_TILES, fp8.TILE) * fp8._ue8m0_value(scales)[..., None]
    rope = rows[:, fp8.D_NOPE :].contiguous().view(torch.bfloat16)  # [n, 64]
    out[:, : fp8.D_NOPE] = torch.where(valid, nope.view(n, fp8.D_NOPE), 0.0)
    out[:, fp8.D_NOPE :] = torch.where(valid, rope, 0.0)
    return out


def fp8_kernels() -> tuple[str, ...]:
    """The registered kernels that read the FP8 cache, the fallback (Triton) last: it runs
    after the others so the slow-provider rule has their times to compare with."""
    from . import dispatch, fp8

    names = [n for n, k in dispatch.KERNELS.items() if k.kv_format == fp8.KV_FORMAT]
    last = dispatch.FALLBACKS.get(fp8.KV_FORMAT)
    return tuple(sorted(names, key=lambda n: n == last))


def fp8_provider_names() -> tuple[str, ...]:
    """Every provider of an FP8 run, in the order they run: ``fp8_default``,
    ``fp8_default_dense_len``, the package's FP8 kernels but the fallback (``fp8_<name>``), the
    peers (:data:`FP8_PEERS`), the fallback."""
    from . import dispatch, fp8

    ks = fp8_kernels()
    last = dispatch.FALLBACKS.get(fp8.KV_FORMAT)
    first = [f"fp8_{k}" for k in ks if k != last]
    tail = [f"fp8_{k}" for k in ks if k == last]
    return ("fp8_default", "fp8_default_dense_len", *first, *FP8_PEERS, *tail)


def fp8_points(
    heads: Iterable[int] = FP8_HEADS,
    tokens: Iterable[int] = FP8_TOKENS,
    *,
    small: Iterable[tuple[int, int]] = FP8_SMALL_POINTS,
) -> list[GridPoint]:
    """The FP8 run's points: the DSv4 CSA workload at every T x H (top-k 512 + window 128,
    top-k 1024 from :data:`GRID_TOPK1024_FROM_H` heads), then the short calls of ``small``
    ((T, H) pairs): the points issue 25's goals are stated at come first, so a run cut short
    by its time limit loses the short ones."""
    small = [(T, H) for T, H in small]
    for T, H in small:
        _sizes("small", (T, H))
    points = grid_points(heads, tokens, glm=False)
    points += [GridPoint("dsv4_csa", T, H, _grid_topk(H)) for T, H in small]
    out: list[GridPoint] = []
    for p in points:
        if p not in out:
            out.append(p)
    return out


@dataclass
class _FP8Point:
    """One point's inputs: the bf16 workload ``w`` (its q and ids), the FP8 cache quantized
    from its pool, and ``wd``: the same call on the dequantized cache (the rows every FP8
    kernel reads; the reference and the bf16 peer read them)."""

    w: Any
    cache: Any
    wd: Any


def _fp8_call(p: _FP8Point, device: torch.device):
    from . import dispatch, fp8

    q = p.w.q
    return dispatch.Call(_arch(device), q.shape[1], q.shape[2], q.dtype, p.cache, q.shape[0],
                         p.w.kv_indices.numel(), kv_format=fp8.KV_FORMAT)  # fmt: skip


def _fp8_cfg(p: _FP8Point, **kw) -> dict[str, Any]:
    return {**kw, "kv": "fp8_model1", "block_size": p.cache.block_size,
            "slot_bytes": FP8_SLOT_BYTES}  # fmt: skip


def _fp8_kernel_provider(name: str, p: _FP8Point, device: torch.device) -> Prepared:
    """``fp8_default`` (config=None on the cache) or ``fp8_<kernel>`` (config=Choice)."""
    from . import dispatch
    from .prefill import sparse_mla_prefill

    call_info = _fp8_call(p, device)
    if name == "fp8_default_dense_len":
        return _fp8_default_dense_len(p, call_info)
    if name == "fp8_default":
        choice = dispatch.choose(call_info)
        config = None
    else:
        kname = name[len("fp8_") :]
        k = dispatch.kernel(kname)
        why = k.why_not(call_info)
        if why:
            raise Unavailable(why)
        choice = dispatch.Choice(kname, k.resolve(None, call_info))
        config = dispatch.Choice(kname)
    cfg = _fp8_cfg(p, kernel=choice.kernel, **choice.launch_dict())
    q, _, idx, indptr, scale = p.w.args()
    cache, sink = p.cache, p.w.attn_sink

    def call(out):
        return sparse_mla_prefill(q, cache, idx, indptr, scale, attn_sink=sink, out=out,
                                  config=config)  # fmt: skip

    return Prepared(name, call, cfg)


def _fp8_default_dense_len(p: _FP8Point, call_info) -> Prepared:
    """``fp8_default_dense_len``: config=None on the cache with the ids as FlashMLA's peers get
    them, dense [T, K] int32 (-1 padded, :func:`_dense_topk`) with the rows' lengths as
    ``kv_lengths`` (an engine's top-k output with its ``topk_length``)."""
    import dataclasses

    from . import dispatch
    from .prefill import sparse_mla_prefill

    q, _, idx, indptr, scale = p.w.args()
    cache, sink = p.cache, p.w.attn_sink
    dense, n = _dense_topk(idx, indptr, cache.num_slots, 128)
    choice = dispatch.choose(dataclasses.replace(call_info, nnz=dense.numel(), dense_lengths=True))
    ids = _dense_ids_note(choice.kernel, dense.shape[1], True)
    cfg = _fp8_cfg(p, kernel=choice.kernel, ids=ids, **choice.launch_dict())

    def call(out):
        return sparse_mla_prefill(q, cache, dense, None, scale, attn_sink=sink, out=out,
                                  kv_lengths=n)  # fmt: skip

    return Prepared("fp8_default_dense_len", call, cfg)


def _bf16_default_dequant(p: _FP8Point, device: torch.device) -> Prepared:
    """Peer (c): the package's bf16 ``config=None`` on the dequantized pool (every slot of the
    cache decoded once, outside the timing)."""
    prepared = _default(p.wd, device)
    cfg = {**prepared.config, "kv": "bf16 (the cache dequantized, outside the timing)",
           "slot_bytes": BF16_SLOT_BYTES}  # fmt: skip
    return Prepared("bf16_default_dequant", prepared.run, cfg)


def _flashmla_fp8_setup(p: _FP8Point, device: torch.device, lacking: str | None = None):
    """What both FlashMLA peers of an FP8 run need: (q, scale, heads FlashMLA runs, row name,
    the slot ids as a [T, topk] int32 matrix -1 padded to a multiple of 128, the lists'
    lengths); :class:`Unavailable` where FlashMLA cannot run on ``device``, then with the
    caller's ``lacking`` (what its FlashMLA build lacks, if anything), then where the call is
    not bf16 at head_dim 512."""
    from . import fp8

    why = _flashmla_unavailable(device) or lacking
    if why:
        raise Unavailable(why)
    q, _, idx, indptr, scale = p.w.args()
    D = q.shape[2]
    if q.dtype != torch.bfloat16 or D != fp8.HEAD_DIM:
        raise Unavailable(f"needs bf16 and head_dim 512, got {q.dtype} and {D}")
    heads, name = flashmla_heads(q.shape[1])
    dense, topk_length = _dense_topk(idx, indptr, p.cache.num_slots, 128)
    return q, scale, heads, name, dense, topk_length


def _flashmla_fp8ws(p: _FP8Point, device: torch.device, mod) -> Prepared:
    """Peer (a), what vLLM does with an FP8 cache: gather and dequantize the referenced rows
    into a bf16 workspace (:func:`gather_dequantize`), then FlashMLA's bf16 sparse prefill on
    the workspace (heads zero-padded to 64/128 as :func:`_flashmla`); both timed together.

    Built once outside the timing: the referenced slots (sorted, unique), the index matrix
    remapped to workspace rows ([T, 1, topk] int32, -1 padded, topk a multiple of 128), the
    padded q and sink. An engine gets the first from its block tables; vLLM remaps the ids in
    a small kernel of its own each call, which is not timed here (in the peer's favour)."""
    q, scale, heads, name, dense, topk_length = _flashmla_fp8_setup(p, device)
    H, D = q.shape[1:]
    cache = p.cache
    ws_slots = torch.unique(dense[dense >= 0])  # sorted
    U = ws_slots.numel()
    if U == 0:
        raise Unavailable("no valid slot to gather")
    lut = torch.full((cache.num_slots,), -1, dtype=torch.int32, device=q.device)
    lut[ws_slots] = torch.arange(U, dtype=torch.int32, device=q.device)
    ws_idx = torch.where(dense >= 0, lut[dense.clamp_min(0).long()], -1).to(torch.int32)
    ws_idx = ws_idx[:, None, :]  # [T, 1, topk]
    ws = torch.full((U, 1, D), float("nan"), dtype=torch.bfloat16, device=q.device)
    qp, sink = _pad_heads(q, p.w.attn_sink, heads)

    def timed():
        gather_dequantize(cache, ws_slots, out=ws[:, 0])
        return mod.flash_mla_sparse_fwd(qp, ws, ws_idx, scale, d_v=D, attn_sink=sink,
                                        topk_length=topk_length)  # fmt: skip

    def call(out):
        ws.fill_(float("nan"))  # a row the gather misses would show as NaN in out
        res = timed()
        res = res[0] if isinstance(res, (tuple, list)) else res
        out.copy_(res[:, :H])
        return out

    cfg = {"heads": heads, "topk": ws_idx.shape[-1], "topk_length": True, "workspace_rows": U,
           "workspace": "torch gather-dequant of the referenced rows, timed",
           "kv": "bf16 workspace", "slot_bytes": BF16_SLOT_BYTES,
           "module": getattr(mod, "__file__", None) or mod.__name__}  # fmt: skip
    return Prepared(f"{name}_fp8ws", call, cfg, timed)


def _flashmla_fp8decode(p: _FP8Point, device: torch.device, mod) -> Prepared:
    """Peer (b), what vLLM runs with few heads per rank: FlashMLA's sparse FP8 *decode* kernel
    (MODEL1 cache, ``csrc/sm90/decode/sparse_fp8``) over the prefill tokens as vLLM's "mixed
    batch" does, all tokens one batch entry (``q`` [1, T, heads, 512], ``indices`` [1, T, topk]
    slot ids, -1 padded, which the kernel masks; no ``topk_length``, which is one length per
    batch entry), heads zero-padded to 64/128 as :func:`_flashmla`; the cache read as it is
    (``[num_blocks, block_size, 1, 584]`` bytes, its blocks' padded stride). (One batch entry a
    token, b = T, is not a shape FlashMLA takes at prefill sizes: its scheduling-metadata
    kernel keeps 5 ints per batch entry in shared memory, 320 KiB at T = 16384.)

    FlashMLA's call (``flash_mla_with_kvcache`` with ``is_fp8_kvcache=True``, its scheduling
    metadata from ``get_mla_metadata``): the metadata is filled by the first call (the check)
    and reused by the timed ones, as an engine makes it once a step for all its layers; a timed
    call is the decode kernel and its split combine."""
    from . import fp8

    has_decode = hasattr(mod, "flash_mla_with_kvcache") and hasattr(mod, "get_mla_metadata")
    q, scale, heads, name, dense, _ = _flashmla_fp8_setup(
        p, device, None if has_decode else "this FlashMLA build has no sparse decode "
        "(flash_mla_with_kvcache)")  # fmt: skip
    T, H, D = q.shape
    cache = p.cache
    if dense.shape[1] == 0:
        raise Unavailable("no slot list to decode")
    qp, sink = _pad_heads(q, p.w.attn_sink, heads)
    q4 = qp.reshape(1, T, heads, D)
    indices = dense[None].contiguous()
    tb = fp8.TOKEN_BYTES
    k_cache = cache.as_bytes().as_strided(
        (cache.num_blocks, cache.block_size, 1, tb), (cache.block_stride, tb, tb, 1)
    )
    meta = mod.get_mla_metadata()[0]

    def timed():
        return mod.flash_mla_with_kvcache(q4, k_cache, None, None, D, meta, None, scale, False,
                                          True, indices, sink)  # fmt: skip

    def call(out):
        res = timed()
        res = res[0] if isinstance(res, (tuple, list)) else res
        out.copy_(res[0, :, :H])
        return out

    cfg = {"heads": heads, "topk": indices.shape[-1], "topk_length": False,
           "queries": "all tokens one batch entry: q [1, T, heads, 512]",
           "kv": "the FP8 cache (MODEL1), read by the kernel", "slot_bytes": FP8_SLOT_BYTES,
           "module": getattr(mod, "__file__", None) or mod.__name__}  # fmt: skip
    return Prepared(f"{name}_fp8decode", call, cfg, timed)


def _fp8_provider(name: str, p: _FP8Point, device: torch.device, peers: Peers) -> Prepared:
    """Set up one provider of an FP8 run; :class:`Unavailable` when it cannot run here."""
    if name == "flashmla_fp8ws":
        return _flashmla_fp8ws(p, device, peers.flash_mla())
    if name == "flashmla_fp8decode":
        return _flashmla_fp8decode(p, device, peers.flash_mla())
    if name == "bf16_default_dequant":
        return _bf16_default_dequant(p, device)
    if name in ("fp8_default", "fp8_default_dense_len") or (
        name.startswith("fp8_") and name[4:] in fp8_kernels()
    ):
        return _fp8_kernel_provider(name, p, device)
    raise ValueError(f"unknown FP8 provider {name!r}; expected one of {list(fp8_provider_names())}")


def _one_call_ms(fn: Callable[[], Any], device: torch.device) -> float:
    """One call's ms (after an L2 flush, between two events; on CPU its wall time): the
    estimate the slow-provider rule of :func:`run_fp8` reads."""
    if device.type != "cuda":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    drv = _bench_driver()
    di = drv.get_device_interface()
    cache = drv.get_empty_cache_for_benchmark()
    start, end = di.Event(enable_timing=True), di.Event(enable_timing=True)
    drv.clear_cache(cache)
    start.record()
    fn()
    end.record()
    di.synchronize()
    return float(start.elapsed_time(end))


def _bench_fp8_point(pt: GridPoint, p: _FP8Point, chosen, device, ceil, common, check_tokens,
                     quick, peers, say, *, budget_ms, seen, slow_factor):  # fmt: skip
    """Rows of every FP8-run provider at one point: check each against the fp32 reference over
    the dequantized rows and estimate one call; then time, in turns on a GPU
    (:func:`time_interleaved`), every one that passed and is not ``slow_factor`` x slower than
    the fastest estimate at this point."""
    q = p.w.q
    T, H, D = q.shape
    nnz = p.wd.valid_slots  # valid against the cache's slots
    flops, fp8_bytes = work_model(nnz, H, D)[0], nnz * FP8_SLOT_BYTES
    pool_bytes = p.cache.num_blocks * p.cache.block_stride
    fl = floor_ms(flops, fp8_bytes, pool_bytes, ceil) if ceil else None
    base = {**common, "workload": pt.workload, "T": T, "H": H, "D": D, "topk": pt.topk,
            "nnz": nnz, "floor_ms": fl, "pool_bytes": pool_bytes}  # fmt: skip

    def once(prov: str, what: str) -> None:
        if (prov, what) not in seen:
            seen.add((prov, what))
            say(f"    {prov}: {what}"[:500])

    refs = _References(p.wd, check_tokens)
    rows = []
    timers: list[tuple[dict[str, Any], Callable[[], Any], float]] = []
    out = torch.empty_like(q)  # every timed provider's output, as in _bench_workload
    for prov in chosen:
        row: dict[str, Any] = {**base, "provider": prov}
        try:
            prepared = _fp8_provider(prov, p, device, peers)
            row["_slot_bytes"] = prepared.config.get("slot_bytes")
            row.update(provider=prepared.name, config=prepared.config)
            ok, rel, note = _check(prepared.run, p.wd, check_tokens, refs)
            row.update(ok=ok, rel_l2=rel, note=note or None)
            if ok:
                fn = prepared.timed if prepared.timed is not None else (
                    lambda run=prepared.run, o=out: run(o))  # fmt: skip
                est = _one_call_ms(fn, device) if math.isfinite(slow_factor) else 0.0
                timers.append((row, fn, est))
        except Unavailable as e:
            once(prov, f"skipped ({e})")
            continue
        except Exception as e:  # one provider's failure must not end the run
            if prov in ("flashmla_fp8ws", "flashmla_fp8decode"):  # a peer's failure: no row
                once(prov, f"skipped, it raised ({type(e).__name__}: {e})")
                continue
            row.update(ok=False, note=f"{type(e).__name__}: {e}"[:500])
        rows.append(row)
    # The slow-provider rule against the fastest one-call estimate, then the rest timed: in
    # turns on a GPU with a budget (time_interleaved), else one after another.
    fastest = min((est for _, _, est in timers), default=math.inf)
    first = min(range(len(timers)), key=lambda i: timers[i][2], default=None)
    timed = []
    for i, (row, fn, est) in enumerate(timers):
        if i != first and est > slow_factor * fastest:  # the fastest one is always timed
            row["note"] = (f"not timed: one call took {est:.4g} ms, more than {slow_factor:g}x "
                           f"the fastest provider here ({fastest:.4g} ms)")  # fmt: skip
            say(f"    {row['provider']} at {pt.workload} T={T}: {row['note']}")
        else:
            timed.append((row, fn))
    if timed and device.type == "cuda" and budget_ms is not None:
        for (row, _), ms in zip(timed, time_interleaved([f for _, f in timed], budget_ms),
                                strict=True):  # fmt: skip
            row["ms"] = ms
    else:
        for row, fn in timed:
            row["ms"] = _time(lambda _out, f=fn: f(), None, device, quick, budget_ms)
    for row in rows:
        slot_bytes = row.pop("_slot_bytes", None)
        if row.get("ms") is not None:
            s = row["ms"] * 1e-3
            row.update(tflops=flops / s / 1e12, gather_tbs=nnz * slot_bytes / s / 1e12)
            if fl is not None:
                row["frac_of_floor"] = fl / row["ms"]
        elif not row.get("ok"):
            say(f"    {row['provider']} at {pt.workload} T={T}: FAIL ({row.get('note')})"[:500])
    return rows


def _fp8_point_summary(rows: Sequence[Mapping[str, Any]]) -> str:
    parts = []
    for r in rows:
        if r.get("ok") and r.get("ms"):
            shown = f"{r['provider']} {r['ms']:.4g}"
            if r["provider"] in ("fp8_default", "bf16_default_dequant"):
                shown += f" ({r['config'].get('kernel')})"
            if r.get("gather_tbs"):
                shown += f" [{r['gather_tbs']:.2f} TB/s]"
        elif r.get("ok"):
            shown = f"{r['provider']} not timed"
        else:
            shown = f"{r['provider']} FAIL"
        parts.append(shown)
    floor = next((r["floor_ms"] for r in rows if r.get("floor_ms")), None)
    return "  ".join(parts) + (f"  | floor {floor:.4g}" if floor else "")


def run_fp8(
    points: Sequence[GridPoint] | None = None,
    *,
    heads: Iterable[int] | None = None,
    tokens: Iterable[int] | None = None,
    providers: Sequence[str] | None = None,
    device: str | torch.device = "cuda",
    ceilings: bool | Ceilings = True,
    quick: bool = False,
    check_tokens: int | None = None,
    sink: bool = True,
    seed: int = 0,
    commit: str | None = None,
    out_path: Path | str | None = None,
    budget_ms: float | None = GRID_BUDGET_MS,
    time_limit_s: float | None = None,
    block_size: int = FP8_BLOCK_SIZE,
    slow_factor: float | None = None,
    log: Callable[[str], Any] | None = _print_flush,
    **workload_kw,
) -> list[dict[str, Any]]:
    """``sparse-mla bench --fp8``: the kernels that read the FP8 cache and their peers on the
    same cache, in one run; returns the CSV rows (appended to ``out_path`` after each point).

    At each point the workload's bf16 pool is quantized into a MODEL1 cache
    (:func:`sparse_mla.fp8.quantize`, ``block_size`` tokens a block) and every provider is
    checked against the fp32 reference over the dequantized rows (NaN-poisoned outputs), then
    timed (:func:`time_budget` at ``budget_ms``). Providers (:func:`fp8_provider_names`):

    - ``fp8_default``: ``sparse_mla_prefill(q, cache, ...)`` with config=None (its config names
      the kernel the dispatch picked);
    - ``fp8_default_dense_len``: the same on the ids as FlashMLA's peers get them, dense
      [T, K] with the rows' lengths (``kv_lengths``);
    - ``fp8_<name>``: each registered FP8 kernel (``kv_format`` "fp8_model1") that can run the
      call, forced with ``config=dispatch.Choice(name)``;
    - ``flashmla_fp8ws`` (rows ``flashmla_pad64_fp8ws``, ``flashmla_fp8ws``, ...), peer (a),
      vLLM's way: :func:`gather_dequantize` of the referenced rows into a bf16 workspace, then
      FlashMLA's bf16 sparse prefill on it, timed together (:func:`_flashmla_fp8ws`);
    - ``bf16_default_dequant``, peer (c): the package's bf16 ``config=None`` on the
      dequantized pool (the dequantization not timed).

    - ``flashmla_fp8decode`` (rows ``flashmla_pad64_fp8decode``, ...), peer (b): FlashMLA's
      sparse FP8 *decode* kernel (``csrc/sm90/decode/sparse_fp8``) over the prefill tokens, all
      of them one batch entry, as vLLM's mixed batch runs it with few heads per rank
      (:func:`_flashmla_fp8decode`); unavailable with a FlashMLA build that has no sparse
      decode (``flash_mla_with_kvcache``; the peers' stand-in gained one in the ninth session).

    Columns: ``gather_tbs`` is the rows' bytes each provider's kernel gathers per second:
    nnz x 584 (:data:`FP8_SLOT_BYTES`: 576 bytes of [NoPE | RoPE] + 8 scale bytes) for the FP8
    kernels, nnz x 1024 for the bf16 ones (FlashMLA on the workspace, the bf16 default); the
    config's ``slot_bytes`` says which. ``floor_ms`` uses the FP8 bytes (the least any
    provider must read) at the gather rate of 1 KiB rows measured for a pool of the cache's
    size (``pool_bytes``): optimistic for 584-byte rows. A provider whose one call (after the
    check) takes more than ``slow_factor`` x the fastest one-call estimate at the point (the
    Triton FP8 kernel at T=16384) is not timed: its row has ``ok`` and ``rel_l2``, no ``ms``,
    and the reason in ``note`` (also logged). On a GPU the others are timed in turns
    (:func:`time_interleaved`), as in the grid.

    Args:
        points: default :func:`fp8_points` (``heads`` x ``tokens`` when either is given,
            without the small points).
        ceilings: measure them (GPU only), or given :class:`Ceilings` (a test's).
        slow_factor: the slow-provider rule's factor (None: :data:`FP8_SLOW_FACTOR` on a GPU,
            no rule on CPU, where the interpreter's times say nothing of the kernels').
        workload_kw: passed to each point's :meth:`GridPoint.build`.

    Other arguments as for :func:`run_grid`.
    """
    import dataclasses

    from . import fp8

    say = log or (lambda _msg: None)
    device = torch.device(device)
    if points is None:
        if heads is None and tokens is None:
            points = fp8_points()
        else:
            points = fp8_points(heads or FP8_HEADS, tokens or FP8_TOKENS, small=())
    points = list(points)
    known = fp8_provider_names()
    chosen: list[str] = []
    for prov in known if providers is None else providers:
        if prov not in known:
            raise ValueError(f"providers: unknown {prov!r}; an FP8 run has {list(known)}")
        if prov not in chosen:
            chosen.append(prov)
    _check_budget(budget_ms)
    if time_limit_s is not None and not time_limit_s > 0:
        raise ValueError(f"time_limit_s must be > 0 (or None), got {time_limit_s!r}")
    gpu = device.type == "cuda"
    if slow_factor is None:
        slow_factor = FP8_SLOW_FACTOR if gpu else math.inf
    if not slow_factor > 0:
        raise ValueError(f"slow_factor must be > 0, got {slow_factor!r}")
    if check_tokens is None:
        check_tokens = 64 if quick else 256
    run = _Run(device, commit, out_path, say)
    timing = f"{budget_ms:g} ms budget" if budget_ms is not None else "do_bench"
    say(f"fp8: {len(points)} points x {len(chosen)} providers ({', '.join(chosen)}), FP8 cache "
        f"block_size {block_size}, {timing} per provider and point, run "
        f"{run.common['timestamp']}")  # fmt: skip
    say("    flashmla_fp8ws (peer a): gather-dequant of the referenced rows + FlashMLA bf16, "
        "timed together; flashmla_fp8decode (peer b): FlashMLA's sparse FP8 decode kernel over "
        "the prefill tokens, all of them one batch entry")  # fmt: skip
    if isinstance(ceilings, Ceilings):
        ceil = ceilings
    else:
        ceil = run.ceilings(device, ceilings, quick, seed)
    peers = Peers()
    seen: set[tuple[str, str]] = set()
    width = len(str(len(points)))
    for i, pt in enumerate(points, 1):
        if time_limit_s is not None and run.elapsed() >= time_limit_s:
            left = ", ".join(f"{q.workload} T={q.T}" for q in points[i - 1 :])
            say(f"time limit {time_limit_s:g} s reached: {len(points) - i + 1} points not run "
                f"({left})")  # fmt: skip
            break
        w = pt.build(device, seed=seed, sink=sink, big_buffer=False, **workload_kw)
        cache = fp8.quantize(w.kv, block_size)
        p = _FP8Point(w, cache, dataclasses.replace(w, kv=fp8.dequantize(cache)))
        rows = _bench_fp8_point(pt, p, chosen, device, ceil, run.common, check_tokens, quick,
                                peers, say, budget_ms=budget_ms, seen=seen,
                                slow_factor=slow_factor)  # fmt: skip
        del w, cache, p
        if gpu:
            torch.cuda.empty_cache()
        run.keep(rows)
        say(f"[{i:>{width}}/{len(points)} {run.elapsed():5.0f} s] {pt.workload} T={pt.T}: "
            + _fp8_point_summary(rows))  # fmt: skip
    say(f"fp8 done at {run.elapsed():.0f} s: {len(run.rows)} rows")
    return run.rows
