"""Host side of the Gluon MLA kernel: targets, launch config, split rule, validation, entry.

``mla_gluon`` runs one of the Gluon kernels (:data:`KERNELS`; default ``gluon_mma``, the shared
algorithm) on a GPU (Gluon kernels do not run in Triton's interpreter); which one
``sparse_mla_prefill`` runs per shape is :mod:`sparse_mla.dispatch`'s choice;
``compile_args`` gives what ``triton.compile(GluonASTSource(...))`` needs to cross-compile either
mode for "gfx950" or "sm90" on a machine without the GPU.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
import triton
from triton.experimental.gluon import language as gl

from .. import fastlaunch, runtime
from .._consts import LOG2E as _LOG2E
from ..validation import (
    _dense_launch_csr,
    _shares_memory,
    _slot_lists,
    dense_form,
    dense_ids_value,
    dense_launch,
    dense_lengths_csr,
    length_bound,
    planned_nnz,
    validate_inputs,
)  # fmt: skip
from . import cdna4, hopper, hopper_prefill, hopper_ws, hopper_ws_small
from .algorithm import _mla_fwd_kernel, _mla_reduce_kernel
from .hopper_prefill import _prefill_wgmma_kernel
from .hopper_ws import _prefill_ws_kernel
from .hopper_ws_small import _prefill_ws_small_kernel

__all__ = [
    "KERNELS",
    "GluonConfig",
    "SmallWSConfig",
    "WSConfig",
    "choose_num_splits",
    "compile_args",
    "compile_attrs",
    "compile_for",
    "default_config",
    "gluon_kernel",
    "mla_gluon",
    "programs_per_sm",
    "resolve_launch",
    "run_validated",
    "split_plan",
    "why_not",
]

HEAD_DIM = 512
PE_DIM = 64
DK = 64  # width of one Q/K chunk of S = Q K^T
MAX_SPLITS = 16
SPLIT_BLOCK_H = 16  # gluon_mma's head block for prefill calls that split (run_validated)
SMEM_LIMIT = 227 * 1024  # sm90 shared memory per block

# ----------------------------------------------------------------------------------------------
# Targets and their arch pieces
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """A compile target and the arch-piece module that serves it."""

    name: str  # "gfx950" | "sm90"
    arch: str  # ARCH constexpr: "cdna4" | "hopper"
    backend: str  # "hip" | "cuda"
    arch_id: str | int  # GPUTarget arch: "gfx950" | 90
    pieces: ModuleType

    @property
    def warp_size(self) -> int:
        return self.pieces.WARP_SIZE

    def gpu_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget(self.backend, self.arch_id, self.warp_size)


_TARGETS = {
    "gfx950": Target("gfx950", "cdna4", "hip", "gfx950", cdna4),
    "sm90": Target("sm90", "hopper", "cuda", 90, hopper),
}


def get_target(name: str) -> Target:
    """The Gluon target for an arch id. sm80..sm90 share the Hopper pieces (mma.sync, cp.async)."""
    if name in _TARGETS:
        return _TARGETS[name]
    if name.startswith("sm") and name[2:].isdigit() and 80 <= int(name[2:]) < 100:
        return Target(name, "hopper", "cuda", int(name[2:]), hopper)
    raise ValueError(
        f"target {name!r} is not served by the Gluon MLA kernel; expected 'gfx950' or 'sm90' "
        "(sm80-sm90 use the Hopper pieces)"
    )


@functools.cache
def _num_compute_units(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# ----------------------------------------------------------------------------------------------
# Launch configuration
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GluonConfig:
    """Launch of the tiled Gluon kernels (``gluon_mma``: the shared algorithm; ``gluon_wgmma``:
    the sm90 wgmma ring): BLOCK_H heads x BLOCK_K slots per tile, ``num_warps``, and the ring
    depth ``num_stages`` (``gluon_wgmma`` only). Which kernel runs is its name, never a field
    of this object (:data:`KERNELS`)."""

    BLOCK_H: int = 16
    BLOCK_K: int = 32
    num_warps: int = 4
    num_stages: int = 4

    def validate(self) -> None:
        for name in ("BLOCK_H", "BLOCK_K", "num_warps", "num_stages"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):  # not 4.0, not True
                raise ValueError(f"config: {name} must be an int, got {v!r}")
        if self.BLOCK_H not in (16, 32, 64):
            raise ValueError(f"config: BLOCK_H must be 16, 32 or 64, got {self.BLOCK_H!r}")
        if self.BLOCK_K not in (16, 32, 64):
            raise ValueError(f"config: BLOCK_K must be 16, 32 or 64, got {self.BLOCK_K!r}")
        if self.num_warps not in (4, 8):
            raise ValueError(f"config: num_warps must be 4 or 8, got {self.num_warps!r}")
        if not 2 <= self.num_stages <= 8:
            raise ValueError(f"config: num_stages must be in [2, 8], got {self.num_stages!r}")


def _regs_field(name: str, v: Any) -> None:
    if type(v) is not int or not 24 <= v <= 256 or v % 8:
        raise ValueError(f"config: {name} must be a multiple of 8 in [24, 256], got {v!r}")


@dataclass(frozen=True)
class SmallWSConfig:
    """Launch of ``gluon_ws_small`` (``hopper_ws_small.py``, heads on wgmma's N): a work item
    is a token and 16 x HEAD_GROUPS heads, its consumer warpgroup's wgmma N (1: H <= 16;
    2: 17 <= H <= 32, each KV row gathered once for up to 32 heads). ``STAGES``: KV tiles in
    the ring (None: 3 at one head group, 2 at two, the most that fit); ``PRODUCER_REGS``: the
    producer warpgroup's registers a thread (the consumer takes min(256, 512 - it))."""

    HEAD_GROUPS: int = 1
    STAGES: int | None = None
    PRODUCER_REGS: int = hopper_ws_small.PRODUCER_REGS.value

    def stages(self) -> int:
        return hopper_ws_small.ring_stages(self.HEAD_GROUPS, self.STAGES)

    def smem_bytes(self) -> int:
        """Q, the KV ring, P^T (2-byte elements) and the barriers, as the kernel allocates."""
        heads = hopper_ws_small.BLOCK_H.value * self.HEAD_GROUPS
        return (2 * (heads * HEAD_DIM + self.stages() * 64 * HEAD_DIM + 64 * heads)
                + 8 * hopper_ws_small.NUM_BARS.value)  # fmt: skip

    def validate(self) -> None:
        if type(self.HEAD_GROUPS) is not int or self.HEAD_GROUPS not in (1, 2):
            raise ValueError(f"config: HEAD_GROUPS must be 1 or 2, got {self.HEAD_GROUPS!r}")
        if self.STAGES is not None and (type(self.STAGES) is not int or self.STAGES not in (2, 3)):
            raise ValueError(f"config: STAGES must be 2 or 3 (or None), got {self.STAGES!r}")
        _regs_field("PRODUCER_REGS", self.PRODUCER_REGS)
        if self.smem_bytes() > SMEM_LIMIT:
            raise ValueError(
                f"config: {self.stages()} KV tiles at HEAD_GROUPS={self.HEAD_GROUPS} take "
                f"{self.smem_bytes()} bytes of shared memory, more than the {SMEM_LIMIT} a "
                "block may have (fewer STAGES)"
            )


@dataclass(frozen=True)
class WSConfig:
    """Launch of ``gluon_ws`` (``hopper_ws.py``: 64 heads on wgmma's M, a producer and two
    consumers; the 64-slot tile and the two-tile ring are the design, not knobs). The register
    split: ``CONSUMER_REGS`` (consumer 1) and ``PRODUCER_REGS`` a thread; consumer 0 takes the
    rest of the 504 a thread the three warpgroups share (:func:`hopper_ws.register_split`)."""

    CONSUMER_REGS: int = hopper_ws.CONSUMER_REGS.value
    PRODUCER_REGS: int = hopper_ws.PRODUCER_REGS.value

    def validate(self) -> None:
        _regs_field("CONSUMER_REGS", self.CONSUMER_REGS)
        _regs_field("PRODUCER_REGS", self.PRODUCER_REGS)
        try:
            hopper_ws.register_split(self.CONSUMER_REGS, self.PRODUCER_REGS)
        except ValueError as e:
            raise ValueError(f"config: {e}") from None


def _wgmma_smem_bytes(cfg: GluonConfig) -> int:
    """Q + the KV ring + P, bf16/fp16 (the kernel's shared-memory allocations)."""
    return 2 * (cfg.BLOCK_H * HEAD_DIM + cfg.num_stages * cfg.BLOCK_K * HEAD_DIM
                + cfg.BLOCK_H * cfg.BLOCK_K)  # fmt: skip


def _sm90(target: Target) -> bool:
    return target.arch == "hopper" and target.arch_id == 90


def _why_not_mma(cfg, target, *, has_pe, num_splits, write_lse):
    if not isinstance(cfg, GluonConfig):
        return f"takes a GluonConfig, got {type(cfg).__name__}"
    return None


def _why_not_wgmma(cfg, target, *, has_pe, num_splits, write_lse):
    if not _sm90(target):
        return f"needs sm90 (wgmma), the target is {target.name}"
    if has_pe:
        return "serves the sparse prefill only (no RoPE part)"
    if not isinstance(cfg, GluonConfig):
        return f"takes a GluonConfig, got {type(cfg).__name__}"
    if cfg.BLOCK_H != 64 or cfg.num_warps != 8 or cfg.BLOCK_K not in (32, 64):
        return f"needs BLOCK_H=64, num_warps=8 and BLOCK_K 32 or 64, got {cfg}"
    if _wgmma_smem_bytes(cfg) > SMEM_LIMIT:
        return (
            f"needs <= {SMEM_LIMIT} bytes of shared memory, {cfg} takes "
            f"{_wgmma_smem_bytes(cfg)} (fewer num_stages)"
        )
    return None


def _why_not_ws(cfg, target, *, has_pe, num_splits, write_lse, config_type=WSConfig):
    if not _sm90(target):
        return f"needs sm90 (wgmma, warp specialisation), the target is {target.name}"
    if has_pe:
        return "serves the sparse prefill only (no RoPE part)"
    if write_lse:
        return "writes no LSE"
    if num_splits != 1 and config_type is not WSConfig:
        return "runs one KV split"
    if not isinstance(cfg, config_type):
        return f"takes a {config_type.__name__}, got {type(cfg).__name__}"
    return None


def _why_not_ws_small(cfg, target, **kw):
    return _why_not_ws(cfg, target, config_type=SmallWSConfig, **kw)


@functools.cache
def _default_mma(num_heads: int, target: Target) -> GluonConfig:
    """BLOCK_H covers the heads up to 64 (a KV row is gathered once per 64 heads); 8 warps at
    BLOCK_H=64 keep the [64, 512] fp32 accumulator at 64 registers per lane (Hopper: 128).
    One object per (heads, target): a launch that is this object is the kernel's own, which a
    prefill call that splits may trade for :data:`SPLIT_CONFIG` (:func:`run_validated`); a
    config given with the same fields is kept as given."""
    block_h = 16 if num_heads <= 16 else (32 if num_heads <= 32 else 64)
    return GluonConfig(BLOCK_H=block_h, BLOCK_K=32, num_warps=8 if block_h == 64 else 4)


# gluon_mma's launch for prefill calls that split with its default head blocks (> 16 heads): the
# default's 16-head form, whose splits' reduce runs in the split launch (fused_reduce).
SPLIT_CONFIG = GluonConfig(BLOCK_H=SPLIT_BLOCK_H, BLOCK_K=32, num_warps=4)
# ... taken for 32-head defaults, and for 64-head ones only while the call has at most this many
# 16-head programs (rows x cdiv(H, 16)). Measured on the H200 in turns against the 64-head
# launch (fused by combiners where they fit; data/bench/split_config_combiners_h200.log):
# 16-head blocks 0.80-0.92x at H32 (T 4-64), 0.91x at H64 T4 (16 programs), but 1.13x at H64
# T16 (64) and 1.05x at H128 T4 (32); even at H64/H128 T64.
SPLIT_TRADE_PROGRAMS = 16


def _default_wgmma(num_heads: int, target: Target) -> GluonConfig:
    """BLOCK_K=64 and a 2-deep ring (205 KB of shared memory): on the H200 at T=16384 it
    measured 4.80 ms (CSA H=64, topk 512) and 14.5 ms (H=128, topk 1024) against 5.95 / 18.4 ms
    for BLOCK_K=32 with 3 or 4 stages (docs/PERF_NOTES.md)."""
    return GluonConfig(BLOCK_H=64, BLOCK_K=64, num_warps=8, num_stages=2)


def _default_ws_small(num_heads: int, target: Target) -> SmallWSConfig:
    """One head group up to 16 heads, two above (more heads run several items per token)."""
    return SmallWSConfig(HEAD_GROUPS=1 if num_heads <= 16 else 2)


@dataclass(frozen=True)
class GluonKernel:
    """One Gluon kernel of the package: what the registry (:mod:`sparse_mla.dispatch`) and
    :func:`compile_args` / :func:`run_validated` need to know about it.

    ``why_not(cfg, target, has_pe=, num_splits=, write_lse=)`` says why it cannot take a launch
    (None: it can); ``default(num_heads, target)`` is its launch when none is given;
    ``splits``: whether it runs KV splits with a reduce step (and an LSE); ``dense_ids``:
    whether it reads dense [R, K] ids itself (``DENSE_IDS``: row r at r x K, no kv_indptr
    load); the others get the CSR form built on the device (:func:`run_validated`)."""

    name: str
    summary: str
    modes: tuple[str, ...]
    targets: tuple[str, ...]
    config_type: type
    default: Any
    why_not: Any
    splits: bool
    knobs: dict[str, tuple] = field(default_factory=dict)
    dense_ids: bool = False


KERNELS: dict[str, GluonKernel] = {
    k.name: k
    for k in (
        GluonKernel(
            "gluon_mma",
            "the shared Gluon MLA algorithm (algorithm.py): decode and sparse prefill, mma.sync "
            "on sm80-sm90, MFMA and buffer loads on gfx950; KV splits with a reduce step (on "
            "NVIDIA with 16-head blocks in the same launch; a prefill call that splits with its "
            "default launch takes 16-head blocks)",
            ("decode", "prefill"), ("sm90", "gfx950"), GluonConfig, _default_mma, _why_not_mma,
            True, {"BLOCK_H": (16, 32, 64), "BLOCK_K": (16, 32, 64), "num_warps": (4, 8)},
        ),
        GluonKernel(
            "gluon_wgmma",
            "sm90 sparse prefill (hopper_prefill.py): 64 heads x BLOCK_K slots, wgmma, a ring "
            "of num_stages cp.async KV tiles; KV splits with a reduce step",
            ("prefill",), ("sm90",), GluonConfig, _default_wgmma, _why_not_wgmma, True,
            {"BLOCK_K": (32, 64), "num_stages": (2, 3, 4)},
        ),
        GluonKernel(
            "gluon_ws",
            "sm90 warp-specialised sparse prefill (hopper_ws.py): 64 heads on wgmma's M (head "
            "blocks clipped at H), one producer and two consumers, persistent; a call of few "
            "items splits each list into pieces of whole tile pairs, with a reduce step",
            ("prefill",), ("sm90",), WSConfig, lambda h, t: WSConfig(), _why_not_ws, True,
            {"CONSUMER_REGS": (200, 208, 216, 224), "PRODUCER_REGS": (24, 32, 40, 48, 56)},
            dense_ids=True,
        ),
        GluonKernel(
            "gluon_ws_small",
            "sm90 warp-specialised sparse prefill for few heads (hopper_ws_small.py): one "
            "producer and one consumer, heads on wgmma's N = 16 x HEAD_GROUPS, persistent",
            ("prefill",), ("sm90",), SmallWSConfig, _default_ws_small, _why_not_ws_small, False,
            {"HEAD_GROUPS": (1, 2), "STAGES": (2, 3), "PRODUCER_REGS": (24, 32, 48, 64)},
            dense_ids=True,
        ),
    )
}  # fmt: skip
DEFAULT_KERNEL = "gluon_mma"


def gluon_kernel(name: str) -> GluonKernel:
    """The Gluon kernel ``name``; ValueError listing the known ones."""
    try:
        return KERNELS[name]
    except KeyError:
        raise ValueError(f"Gluon kernel {name!r} is unknown; known: {sorted(KERNELS)}") from None


def resolve_launch(name: str, config: Any, num_heads: int, target: Target):
    """Kernel ``name``'s launch: ``config`` (its config object, a dict of its fields, or None
    for its default at ``num_heads``), validated."""
    k = gluon_kernel(name)
    if config is None:
        cfg = k.default(num_heads, target)
    elif isinstance(config, k.config_type):
        cfg = config
    elif isinstance(config, dict):
        try:
            cfg = k.config_type(**config)
        except TypeError as e:
            raise ValueError(f"config: {name} takes {k.config_type.__name__} fields: {e}") from None
    else:
        raise TypeError(
            f"config: {name} takes a {k.config_type.__name__} (or a dict of its fields), got "
            f"{type(config).__name__}"
        )
    cfg.validate()
    return cfg


def why_not(
    name: str, cfg, target: Target, *, has_pe: bool, num_splits: int = 1, write_lse: bool = False
) -> str | None:
    """Why kernel ``name`` cannot run a launch (None: it can)."""
    k = gluon_kernel(name)
    mode = "decode" if has_pe else "prefill"
    if mode not in k.modes:
        return f"{name} serves {' and '.join(k.modes)} only, not {mode}"
    return k.why_not(cfg, target, has_pe=has_pe, num_splits=num_splits, write_lse=write_lse)


def default_config(num_heads: int, target: Target, *, has_pe: bool = True) -> GluonConfig:
    """The shared algorithm's (``gluon_mma``'s) launch for ``num_heads`` heads."""
    return _default_mma(num_heads, target)


def choose_num_splits(
    rows: int, num_heads: int, nnz: int, cfg: GluonConfig, num_units: int,
    per_unit: int | None = None,
) -> int:  # fmt: skip
    """KV splits per (row, head block): the split rule, without a host sync.

    One split when the grid rows x cdiv(H, BLOCK_H) already gives every SM/CU a program.
    Otherwise, with ``per_unit`` (programs an SM holds at once, :func:`programs_per_sm`), as
    many splits as fit the ``num_units * per_unit`` program slots in one wave (a program past
    them is a second wave as long as the first); without it (AMD: not measured), enough
    splits to cover the CUs once, rounded up. Either way no more than keep >= 2 tiles
    (2 * BLOCK_K slots) of the average row (nnz / rows) per split, and at most 16.
    """
    programs = rows * runtime.cdiv(num_heads, cfg.BLOCK_H)
    if programs == 0 or programs >= num_units:
        return 1
    if per_unit is None:
        by_fill = runtime.cdiv(num_units, programs)
    else:
        by_fill = num_units * per_unit // programs
    by_work = max(1, (nnz // max(rows, 1)) // (2 * cfg.BLOCK_K))
    return max(1, min(by_fill, by_work, MAX_SPLITS))


def programs_per_sm(cfg: GluonConfig, target: Target) -> int | None:
    """Programs of the split kernels (``gluon_mma``, ``gluon_wgmma``) an SM holds at once on
    NVIDIA targets: 8 warps an SM (their builds take 255 registers a thread, and the
    shared-memory ring binds at the same count; ``sparse-mla isa --target sm90``), so one
    8-warp program or two 4-warp ones. None on AMD (the CU rule keeps rounding up)."""
    if target.backend != "cuda":
        return None
    return max(1, 8 // cfg.num_warps)


# gluon_ws splits a call's lists only while its (token, head block) items are at most
# 1 / WS_SPLIT_FILL of the SMs, and only into pieces at least WS_SPLIT_MIN_SAVED tiles shorter
# than the whole list: a split pays ~7-8 us (its fp32 partials and the reduce launch) and a
# tile costs ~1.5 us (H200; PERF_NOTES "No cliffs" step 19). Calls of at most
# WS_SPLIT_FEW_ITEMS items split already for WS_SPLIT_MIN_SAVED_FEW tiles: there a pair of
# tiles costs ~3-4 us and a split ~5 us (1-4 items on 384-slot lists: 3 pieces 0.85-0.91x the
# unsplit call; 64 items on 640-slot lists, 2 pieces: 1.08x; PERF_NOTES step 39).
WS_SPLIT_FILL = 2
WS_SPLIT_MIN_SAVED = 6
WS_SPLIT_FEW_ITEMS = 4
WS_SPLIT_MIN_SAVED_FEW = 4


def ws_num_splits(rows: int, num_heads: int, nnz: int, num_units: int) -> int:
    """``gluon_ws``'s KV splits for a call of ``rows`` rows, H heads and ``nnz`` slots (no
    host sync): 1 while its items (rows x cdiv(H, 64)) fill more than 1 / :data:`WS_SPLIT_FILL`
    of the ``num_units`` SMs; else as many as fit the SMs in one wave, each at least one pair
    of 64-slot tiles of the average list rounded up (cdiv(nnz, rows): when the lists are not
    all one length, some are longer than the average, and a piece of theirs would hold one
    pair more), at most :data:`MAX_SPLITS`, then as many as the pieces of whole pairs that
    count makes (no empty piece on average lists), and 1 unless a piece is at least
    :data:`WS_SPLIT_MIN_SAVED` tiles shorter than the list (:data:`WS_SPLIT_MIN_SAVED_FEW`
    for at most :data:`WS_SPLIT_FEW_ITEMS` items)."""
    items = rows * runtime.cdiv(num_heads, hopper_ws.BLOCK_H.value)
    if items == 0 or items * WS_SPLIT_FILL > num_units:
        return 1
    pair = 2 * hopper_ws.BLOCK_K.value
    pairs = runtime.cdiv(max(runtime.cdiv(nnz, rows), 1), pair)
    splits = max(1, min(num_units // items, pairs, MAX_SPLITS))
    per_piece = runtime.cdiv(pairs, splits)
    need = WS_SPLIT_MIN_SAVED_FEW if items <= WS_SPLIT_FEW_ITEMS else WS_SPLIT_MIN_SAVED
    if 2 * (pairs - per_piece) < need:
        return 1
    return runtime.cdiv(pairs, per_piece)


def split_plan(
    name: str, cfg: GluonConfig, rows: int, num_heads: int, nnz: int, target: Target,
    num_units: int, *, own_launch: bool, has_pe: bool = False,
) -> tuple[GluonConfig, int]:  # fmt: skip
    """The launch and KV split count a split kernel's call of ``rows`` rows, H heads and
    ``nnz`` slots runs with when the caller gives no split count: ``cfg`` with
    :func:`choose_num_splits`' count, except that ``gluon_mma`` with its own default launch
    (``own_launch``: config None, or the :func:`_default_mma` object) trades it for
    :data:`SPLIT_CONFIG` when that launch would split on NVIDIA: 4x the programs, fewer
    splits and the reduce fused into the launch, while 16-head programs still leave SMs idle
    (they split too) and, for 64-head defaults, while there are at most
    :data:`SPLIT_TRADE_PROGRAMS` of them (where they fill the GPU, 4x the row gathers cost more
    than the second launch saved: H200, T = 64 H128). One function for the run and for what
    the benchmark records. ``gluon_ws``: ``cfg`` with :func:`ws_num_splits`' count."""
    if name == "gluon_ws":
        return cfg, ws_num_splits(rows, num_heads, nnz, num_units)
    splits = choose_num_splits(rows, num_heads, nnz, cfg, num_units, programs_per_sm(cfg, target))
    if (
        splits > 1 and own_launch and not has_pe and name == "gluon_mma"
        and cfg.BLOCK_H > SPLIT_BLOCK_H and target.backend == "cuda"
    ):  # fmt: skip
        split16 = choose_num_splits(rows, num_heads, nnz, SPLIT_CONFIG, num_units,
                                    programs_per_sm(SPLIT_CONFIG, target))  # fmt: skip
        few = cfg.BLOCK_H <= 32 or rows * runtime.cdiv(num_heads, SPLIT_BLOCK_H) <= (
            SPLIT_TRADE_PROGRAMS
        )
        if split16 > 1 and few:
            return SPLIT_CONFIG, split16
    return cfg, splits


def call_splits(
    name: str, cfg: Any, rows: int, num_heads: int, nnz: int, target: Target, num_units: int
) -> tuple[Any, int]:  # fmt: skip
    """The launch and KV split count of a call ``config=Choice(name, cfg)`` of ``rows`` rows,
    H heads and ``nnz`` slots runs on ``num_units`` SMs / CUs (:func:`split_plan`, with
    ``cfg`` as the dispatch resolved it: None or the kernel's own default object is its own
    launch, which ``gluon_mma`` may trade); ``(cfg, 1)`` for a kernel that does not split. What
    the bench's ``num_kv_splits`` column and ``sparse-mla which --sms`` say."""
    if not gluon_kernel(name).splits:
        return cfg, 1
    own = cfg is None or cfg is _default_mma(num_heads, target)
    if cfg is None:
        cfg = resolve_launch(name, None, num_heads, target)
    return split_plan(name, cfg, rows, num_heads, nnz, target, num_units, own_launch=own)


def _layouts(cfg: GluonConfig, target: Target) -> dict[str, Any]:
    ws = target.warp_size
    nw = cfg.num_warps
    wm = min(cfg.BLOCK_H // 16, nw)
    return {
        "K_WIDTH": target.pieces.K_WIDTH,
        # S tile [BLOCK_H, BLOCK_K]: warps over heads first, the rest over slots.
        "MMA_QK": target.pieces.mma_layout([wm, nw // wm]),
        # O tile [BLOCK_H, 512]: warps split the 512 output columns; P is read by all.
        "MMA_PV": target.pieces.mma_layout([1, nw]),
        # Gathers: 16-byte vectors per lane, one warp per row.
        "GATHER": gl.BlockedLayout([1, 8], [1, ws], [nw, 1], [1, 0]),
        "GATHER_PE": gl.BlockedLayout([1, 8], [ws // 8, 8], [nw, 1], [1, 0]),
        "SMEM": target.pieces.shared_layout(),
    }


def kernel_constexprs(
    cfg: GluonConfig,
    target: Target,
    *,
    has_pe: bool,
    has_sink: bool,
    num_splits: int,
    write_lse: bool,
    use_buffer: bool,
    fused: bool | None = None,
) -> dict[str, Any]:
    """The constexprs ``_mla_fwd_kernel`` compiles with for a launch (``fused``: the reduce of
    KV splits in the same launch; None: :func:`fused_reduce`'s rule)."""
    return {
        "ARCH": target.arch,
        "BLOCK_H": cfg.BLOCK_H,
        "BLOCK_K": cfg.BLOCK_K,
        "HEAD_DIM": HEAD_DIM,
        "PE_DIM": PE_DIM,
        "DK": DK,
        "HAS_PE": has_pe,
        "HAS_SINK": has_sink,
        "NUM_SPLITS": num_splits,
        "WRITE_LSE": write_lse,
        "USE_BUFFER": use_buffer and target.arch == "cdna4",
        **_layouts(cfg, target),
        **_fused_reduce(num_splits, target, cfg, fused),
    }


def wgmma_constexprs(
    cfg: GluonConfig, *, has_sink: bool, num_splits: int, write_lse: bool,
    fused: bool | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The constexprs ``_prefill_wgmma_kernel`` compiles with for a launch (``fused`` as for
    :func:`kernel_constexprs`)."""
    return {
        "BLOCK_H": cfg.BLOCK_H,
        "BLOCK_K": cfg.BLOCK_K,
        "HEAD_DIM": HEAD_DIM,
        "STAGES": cfg.num_stages,
        "HAS_SINK": has_sink,
        "NUM_SPLITS": num_splits,
        "WRITE_LSE": write_lse,
        **hopper_prefill.layouts(cfg.BLOCK_H, cfg.BLOCK_K, HEAD_DIM, cfg.num_warps),
        **_fused_reduce(num_splits, get_target("sm90"), cfg, fused),
    }


def fused_reduce(
    num_splits: int, target: Target, block_h: int, groups: int = 1, units: int | None = None
) -> bool:
    """Whether a split launch combines its partials in the same launch instead of a second
    launch of ``_mla_reduce_kernel``, for ``groups`` (row, head block) pairs on ``units``
    SMs (None: not known, as when cross-compiling; taken as fitting). On NVIDIA targets: with
    head blocks of at most 16 whenever it splits (the last split of a (row, head block) to
    arrive combines, ``algorithm._epilogue``'s ``FUSED_REDUCE``); with larger blocks when the
    :func:`combiners` programs, one per 16 heads of each group, fit on the SMs at once (they
    wait for the splits' arrivals and combine a part each, ``algorithm._combiner``; each holds
    a whole program's shared memory, one an SM at these sizes).

    Measured on the H200 (``experiments/fused_reduce.py``, docs/PERF_NOTES.md), fused against
    two launches: 16-head blocks, last arrival, -0.9..-8.1 us at T = 4-64; 32/64-head blocks
    with combiners -1.0..-11.1 us at T = 4, -0.0..-5.8 at T = 16 (combiners 16-128), +0.2..+10.6
    at T = 64 (combiners 128-512: more than a wave). The last-arrival form at 32/64-head blocks
    had been slower by 2-35 us (one program combining splits x BLOCK_H x 2 KB alone). gfx950
    keeps the second launch (its acquire/release across XCDs' L2s is untested on hardware)."""
    if num_splits <= 1 or target.backend != "cuda":
        return False
    return block_h <= SPLIT_BLOCK_H or units is None or combiners(block_h) * groups <= units


def combiners(block_h: int) -> int:
    """Combiner programs per (row, head block) of a fused split launch: 0 for head blocks of at
    most 16 (the last split to arrive combines), else one per 16 heads, as the reduce kernel
    spreads them."""
    return 0 if block_h <= SPLIT_BLOCK_H else block_h // SPLIT_BLOCK_H


def _fused_reduce(num_splits: int, target: Target, cfg, fused) -> dict[str, Any]:
    if fused is None:
        fused = fused_reduce(num_splits, target, cfg.BLOCK_H)
    fused = bool(fused) and num_splits > 1
    # The reduce's [heads, 128] chunk: 4 fp32 a lane, a warp a row.
    red = (
        gl.BlockedLayout([1, 4], [1, target.warp_size], [cfg.num_warps, 1], [1, 0])
        if fused
        else None
    )
    return {"FUSED_REDUCE": fused, "RED": red, "COMBINERS": combiners(cfg.BLOCK_H) if fused else 0}


def _reduce_constexprs(num_heads, num_splits, has_sink, write_lse, target, num_warps=4, cols=0):
    """``_mla_reduce_kernel``'s constexprs; ``cols`` > 0: one program per block of that many
    columns (its ``COLS``; none passed for whole rows)."""
    return {
        "BLOCK_H": 16 if num_heads >= 16 else triton.next_power_of_2(num_heads),
        "HEAD_DIM": HEAD_DIM,
        "NUM_SPLITS": num_splits,
        "HAS_SINK": has_sink,
        "WRITE_LSE": write_lse,
        "LAYOUT": gl.BlockedLayout([1, 4], [1, target.warp_size], [num_warps, 1], [1, 0]),
        **({"COLS": cols} if cols else {}),
    }


def _use_buffer(target: Target, *pools: torch.Tensor) -> bool:
    """Buffer loads (32-bit offsets) only when every pool's byte span fits below 2^31."""
    if target.arch != "cdna4":
        return False
    for t in pools:
        if t.shape[0] == 0:
            continue
        span = ((t.shape[0] - 1) * t.stride(0) + t.shape[1]) * t.element_size()
        if span > target.pieces.BUFFER_MAX_BYTES:
            return False
    return True


# ----------------------------------------------------------------------------------------------
# Cross-compiling (inspect, notebooks, CPU tests)
# ----------------------------------------------------------------------------------------------

_DTYPE_SIG = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def compile_args(
    mode: str, target_name: str, kernel: str | None = None, **shape
) -> tuple[Any, dict, dict, dict]:
    """What ``triton.compile(GluonASTSource(kernel, signature, constexprs), target, options)``
    needs to compile one mode of a Gluon kernel for a target, without its GPU.

    Args:
        mode: "decode" (has_pe, q_pe/k_pe) or "prefill" (DSv4 sparse prefill, no PE).
        target_name: "gfx950" or "sm90".
        kernel: the Gluon kernel's name (:data:`KERNELS`; default ``gluon_mma``, the shared
            algorithm that serves both modes on both targets).
        **shape: num_heads (default 64), dtype (torch.bfloat16), index_dtype (torch.int32),
            has_sink (prefill: True), num_splits (1), return_lse (decode: True), use_buffer
            (True: pool below 2 GiB), config (the kernel's launch; default its own default),
            small (``gluon_ws``, ``gluon_ws_small``: the small-call order,
            ``hopper_ws.small_call``; False), dense (``gluon_ws``, ``gluon_ws_small``: dense
            [R, K] ids, ``DENSE_IDS``; 2: with the rows' lengths; False), l2_rows
            (``gluon_ws``: the producer asks L2 for the next pair's rows, ``L2_ROWS``, as a
            split call runs, ``hopper_ws.l2_rows``; False), fused_reduce (``gluon_mma``,
            ``gluon_wgmma`` with num_splits > 1: the reduce in the same launch; None:
            :func:`fused_reduce`).

    Returns:
        (kernel, signature, constexprs, options): signature maps every parameter to its
        Triton type ("constexpr" for constexprs); options has num_warps (and num_stages).
        Pass ``attrs=compile_attrs(kernel, signature)`` to ``GluonASTSource`` (the gfx950
        buffer loads need the aligned pointers), or call :func:`compile_for`.
    """
    if mode not in ("decode", "prefill"):
        raise ValueError(f"mode must be 'decode' or 'prefill', got {mode!r}")
    target = get_target(target_name)
    known = {"num_heads", "dtype", "index_dtype", "has_sink", "num_splits", "return_lse",
             "use_buffer", "config", "small", "dense", "fused_reduce", "l2_rows"}  # fmt: skip
    unknown = sorted(set(shape) - known)
    if unknown:
        raise ValueError(f"compile_args: unknown shape key(s) {unknown}; expected {sorted(known)}")
    name = kernel or DEFAULT_KERNEL
    has_pe = mode == "decode"
    num_heads = int(shape.get("num_heads", 64))
    dtype = shape.get("dtype", torch.bfloat16)
    if dtype not in _DTYPE_SIG:
        raise TypeError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
    index_dtype = shape.get("index_dtype", torch.int32)
    if index_dtype not in (torch.int32, torch.int64):
        raise TypeError(f"index_dtype must be torch.int32 or torch.int64, got {index_dtype}")
    cfg = resolve_launch(name, shape.get("config"), num_heads, target)
    elem = "*" + _DTYPE_SIG[dtype]
    idx = "*i64" if index_dtype == torch.int64 else "*i32"
    num_splits = int(shape.get("num_splits", 1))
    write_lse = bool(shape.get("return_lse", has_pe))
    why = why_not(name, cfg, target, has_pe=has_pe, num_splits=num_splits, write_lse=write_lse)
    if why:
        raise ValueError(f"compile_args: {name} cannot compile this launch: {why}")
    if name in ("gluon_ws", "gluon_ws_small"):
        ws_kernel, module = _WS[name]
        # A launch without a sink passes -inf logits (_launch_persistent), so no constexprs
        # but the head groups. Both store O from out's pointer (hopper_ws 16 bytes a lane,
        # its rows aligned: OUT_ALIGNED).
        out_sig = {"out_ptr": elem, "stride_or": "i32", "stride_oh": "i32"}
        if getattr(module, "Q_BY_TMA", False):
            box = [1, module.BLOCK_H.value, module.Q_BLOCK.value]
            q_sig = {"q_desc": f"tensordesc<{elem[1:]}{box},{module.Q_SMEM.value!r}>"}
        else:
            q_sig = {"q_ptr": elem}
        signature = {
            **q_sig, "kv_ptr": elem, "idx_ptr": idx, "indptr_ptr": idx,
            "sink_ptr": "*fp32", "stride_qr": "i32", "stride_qh": "i32", "stride_kvn": "i32",
            **out_sig, "num_heads": "i32", "num_kv": "i32", "nnz": "i32", "qk_scale": "fp32",
            "num_items": "i32", "ids_per_row": "i32",
        }  # fmt: skip
        constexprs = _ws_constexprs(cfg)
        if name == "gluon_ws":  # the split partials' pointers (unused at one split) and count
            signature.update({"opart_ptr": "*fp32", "lsepart_ptr": "*fp32"})
            constexprs["NUM_SPLITS"] = num_splits  # (the run passes it only when > 1)
        dense = shape.get("dense", False)
        if dense:  # only when set: a CSR launch passes none (2: dense with lengths)
            constexprs["DENSE_IDS"] = dense_ids_value(dense)
        if name == "gluon_ws" and shape.get("l2_rows", False):
            constexprs["L2_ROWS"] = True  # only when set, as the run (hopper_ws.l2_rows)
        if hasattr(module, "small_call"):
            # The small-call order (hopper_ws.small_call): shape key ``small`` (default: the
            # large-call kernel, the one every long prefill runs).
            constexprs["SMALL"] = bool(shape.get("small", False))
        if getattr(module, "FOLDS_SCALE", False) and shape.get("pos_scale", True):
            # A positive softmax scale (every model's) folds into the exponent: shape key
            # ``pos_scale`` (default on; off: the launch for a scale of 0 or below).
            constexprs["POS_SCALE"] = True
        signature.update({k: "constexpr" for k in constexprs})
        return ws_kernel, signature, constexprs, {"num_warps": 4, "num_stages": 1}
    if name == "gluon_wgmma":
        constexprs = wgmma_constexprs(
            cfg,
            has_sink=bool(shape.get("has_sink", True)),
            num_splits=num_splits,
            write_lse=bool(shape.get("return_lse", False)),
            fused=shape.get("fused_reduce"),
        )
        signature = {
            "q_ptr": elem, "kv_ptr": elem, "idx_ptr": idx, "indptr_ptr": idx,
            "sink_ptr": "*fp32", "out_ptr": elem, "lse_ptr": "*fp32", "opart_ptr": "*fp32",
            "lsepart_ptr": "*fp32", "count_ptr": "*i32", "stride_qr": "i32", "stride_qh": "i32",
            "stride_kvn": "i32",
            "stride_or": "i32", "stride_oh": "i32", "num_heads": "i32", "num_kv": "i32",
            "nnz": "i32", "qk_scale": "fp32",
        }  # fmt: skip
        signature.update({k: "constexpr" for k in constexprs})
        return _prefill_wgmma_kernel, signature, constexprs, {"num_warps": 8, "num_stages": 1}
    constexprs = kernel_constexprs(
        cfg,
        target,
        has_pe=has_pe,
        has_sink=bool(shape.get("has_sink", not has_pe)),
        num_splits=num_splits,
        write_lse=write_lse,
        use_buffer=bool(shape.get("use_buffer", True)),
        fused=shape.get("fused_reduce"),
    )
    signature = {
        "q_ptr": elem, "qpe_ptr": elem, "kv_ptr": elem, "kpe_ptr": elem, "idx_ptr": idx,
        "indptr_ptr": idx, "sink_ptr": "*fp32", "out_ptr": elem, "lse_ptr": "*fp32",
        "opart_ptr": "*fp32", "lsepart_ptr": "*fp32", "count_ptr": "*i32",
        "stride_qr": "i32", "stride_qh": "i32", "stride_qper": "i32", "stride_qpeh": "i32",
        "stride_kvn": "i32", "stride_kpen": "i32", "stride_or": "i32", "stride_oh": "i32",
        "num_heads": "i32", "num_kv": "i32", "nnz": "i32", "qk_scale": "fp32",
    }  # fmt: skip
    signature.update({k: "constexpr" for k in constexprs})
    options = {"num_warps": cfg.num_warps, "num_stages": 1}
    return _mla_fwd_kernel, signature, constexprs, options


_WS = {
    "gluon_ws": (_prefill_ws_kernel, hopper_ws),
    "gluon_ws_small": (_prefill_ws_small_kernel, hopper_ws_small),
}


def _ws_constexprs(cfg) -> dict[str, Any]:
    """The constexpr arguments of a warp-specialised kernel's launch (its config's fields)."""
    if isinstance(cfg, SmallWSConfig):
        return {"HEAD_GROUPS": cfg.HEAD_GROUPS, "STAGES": cfg.STAGES,
                "PRODUCER_REGS": cfg.PRODUCER_REGS}  # fmt: skip
    if isinstance(cfg, WSConfig):
        return {"CONSUMER_REGS": cfg.CONSUMER_REGS, "PRODUCER_REGS": cfg.PRODUCER_REGS}
    return {}


def _ws_split_constexprs(cfg, splits: int) -> dict[str, Any]:
    """:func:`_ws_constexprs` of a ``gluon_ws`` launch that splits its lists ``splits`` ways."""
    return {**_ws_constexprs(cfg), "NUM_SPLITS": splits}


def _heads_per_item(name: str, cfg) -> int:
    """Heads of one work item (token, head block) of a warp-specialised kernel."""
    if name == "gluon_ws_small":
        return hopper_ws_small.BLOCK_H.value * cfg.HEAD_GROUPS
    return hopper_ws.BLOCK_H.value


def compile_attrs(kernel, signature: dict) -> dict:
    """``attrs`` for ``GluonASTSource``: every pointer 16-byte aligned and the KV row strides
    multiples of 16 elements, as the JIT specialises them for an engine's tensors. The gfx950
    buffer loads into LDS need the aligned base pointer to use 16-byte ``buffer_load ... lds``."""
    aligned = {"stride_kvn", "stride_kpen"}
    attrs = {}
    for i, name in enumerate(kernel.arg_names):
        ty = signature.get(name)
        if ty is not None and (ty.startswith("*") or name in aligned):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return attrs


def compile_for(mode: str, target_name: str, kernel: str | None = None, **shape):
    """Cross-compile one mode for a target: ``triton.compile`` of :func:`compile_args`."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from ..inspect import _signature

    kernel, signature, constexprs, options = compile_args(mode, target_name, kernel, **shape)
    # Every constexpr given, defaults included (as inspect.compile gives them): Triton 3.6's
    # ASTSource.hash keys the cache on the given constexprs' values in parameter order, without
    # saying which parameters they are, so two builds that each set a different optional
    # constexpr to the same value (the last one set in both) would share one cache entry.
    signature, constexprs = _signature(kernel, constexprs, signature)
    src = GluonASTSource(kernel, signature, constexprs, compile_attrs(kernel, signature))
    with runtime.compiling():  # not while another thread interprets a kernel
        return triton.compile(src, target=get_target(target_name).gpu_target(), options=options)


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------

_NAMES = {"q": "q_nope", "kv": "kv_c", "softmax_scale": "sm_scale"}


def _check_aligned(name, t):
    if t.shape[0] > 0 and (t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16):
        # The gathers copy 16 bytes per lane.
        raise ValueError(f"{name} rows must start 16-byte aligned (base and row stride)")


def _check_pool(name, t, dim, dtype, ref_name):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dim() == 3 and t.shape[1] == 1:
        t = t[:, 0, :]
    if t.dim() != 2 or t.shape[1] != dim:
        raise ValueError(f"{name} must be [N, {dim}] (or [N, 1, {dim}]), got {tuple(t.shape)}")
    if t.dtype != dtype:
        fp8 = (
            " (an fp8 cache is not supported; dequantise it first)"
            if "float8" in str(t.dtype)
            else ""
        )
        raise TypeError(f"{name} dtype {t.dtype} must match {ref_name} dtype {dtype}{fp8}")
    if t.shape[0] > 0 and t.stride(1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")
    _check_aligned(name, t)
    return t


def _validate(
    q_nope, q_pe, kv_c, k_pe, kv_indices, kv_indptr, sm_scale, has_pe, sink, out, splits,
    validate=None,
):  # fmt: skip
    """The shared checks (:func:`sparse_mla.validation.validate_inputs`) plus the Gluon-only
    ones: head dim 512, 16-byte aligned pool rows, the RoPE pair, the split count."""
    x = validate_inputs(
        q_nope, kv_c, kv_indices, kv_indptr, sm_scale, attn_sink=sink, out=out,
        head_dim=HEAD_DIM, validate=validate, names=_NAMES,
    )  # fmt: skip
    _check_aligned("kv_c", x.kv)
    R, H, _ = x.q.shape
    if has_pe:
        if q_pe is None or k_pe is None:
            raise ValueError("has_pe=True needs q_pe [R, H, 64] and k_pe [N, 64]")
        if not isinstance(q_pe, torch.Tensor) or q_pe.dim() != 3:
            raise ValueError(f"q_pe must be a [R, H, {PE_DIM}] tensor, got {type(q_pe).__name__}")
        if tuple(q_pe.shape) != (R, H, PE_DIM) or q_pe.dtype != x.q.dtype:
            raise ValueError(
                f"q_pe must be [{R}, {H}, {PE_DIM}] in {x.q.dtype}, got "
                f"{tuple(q_pe.shape)} {q_pe.dtype}"
            )
        if q_pe.stride(2) != 1:
            raise ValueError(f"q_pe must have a contiguous last dim, got strides {q_pe.stride()}")
        k_pe = _check_pool("k_pe", k_pe, PE_DIM, x.q.dtype, "q_nope")
        if k_pe.shape[0] != x.kv.shape[0]:
            raise ValueError(f"k_pe has {k_pe.shape[0]} rows but kv_c has {x.kv.shape[0]}")
        for name, t in (("q_pe", q_pe), ("k_pe", k_pe)):
            if t.device != x.q.device:
                raise ValueError(f"{name} is on {t.device} but q_nope is on {x.q.device}")
            if out is not None and _shares_memory(out, t):
                raise ValueError(f"out overlaps {name}; the kernel would read what it writes")
    elif q_pe is not None or k_pe is not None:
        raise ValueError("has_pe=False (sparse prefill) takes no q_pe/k_pe; pass None")
    if splits is not None and (isinstance(splits, bool) or not isinstance(splits, int)):
        raise TypeError(f"num_kv_splits must be an int or None, got {type(splits).__name__}")
    if splits is not None and not 1 <= splits <= 64:
        raise ValueError(f"num_kv_splits must be in [1, 64], got {splits}")
    return x, k_pe


# ----------------------------------------------------------------------------------------------
# Public entry
# ----------------------------------------------------------------------------------------------


def mla_gluon(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor | None,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor | None,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    sm_scale: float,
    *,
    has_pe: bool = True,
    attn_sink: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    num_kv_splits: int | None = None,
    return_lse: bool = False,
    target: str | None = None,
    config: Any = None,
    validate: bool | None = None,
    kernel: str | None = None,
    kv_lengths: torch.Tensor | None = None,
    max_kv_length: int | None = None,
):
    """Unified MLA attention (Gluon): MLA decode with the RoPE part, or DSv4 sparse prefill.

    ``kernel`` names the Gluon kernel that runs (:data:`KERNELS`): ``gluon_mma`` (default, the
    shared algorithm: both modes, every target), or on sm90 for the prefill ``gluon_wgmma``,
    ``gluon_ws`` or ``gluon_ws_small``. ``sparse_mla_prefill`` picks one per call
    (:mod:`sparse_mla.dispatch`); here the caller does.

    Args:
        q_nope: [R, H, 512] fp16/bf16 queries (R = decode requests, or prefill tokens).
        q_pe: [R, H, 64] RoPE queries (decode); None when ``has_pe=False``.
        kv_c: [N, 512] (or [N, 1, 512]) latent KV pool in q's dtype; K and V of the 512 part.
        k_pe: [N, 64] RoPE keys (decode); None when ``has_pe=False``.
        kv_indices: [nnz] int32/int64 pool slots (page size 1); s is valid iff 0 <= s < N,
            any other slot is absent and its rows are never read. Or dense [R, K] with
            ``kv_indptr=None``: row r's list is kv_indices[r, :], or its first
            ``kv_lengths[r]`` ids (``gluon_ws`` and ``gluon_ws_small`` read it as it is, the
            others get its CSR form).
        kv_indptr: [R+1] CSR offsets: row r uses kv_indices[kv_indptr[r]:kv_indptr[r+1]];
            None for dense kv_indices.
        sm_scale: logits = (q_nope·kv_c + q_pe·k_pe) * sm_scale.
        has_pe: True: MLA decode; False: sparse prefill (the operator of DESIGN.md §2).
        attn_sink: optional [H] fp32 sink logit, in the softmax denominator only.
        out: optional [R, H, 512] output buffer (q's dtype, last-dim stride 1).
        num_kv_splits: KV splits with a reduce step; None: :func:`choose_num_splits`.
        return_lse: also return the [R, H] fp32 natural-log LSE of the softmax denominator
            (sink included; -inf for a row with nothing to attend to).
        target: "sm90" / "gfx950" to insist on a target; None: the local GPU.
        config: the kernel's launch (:class:`GluonConfig`, :class:`SmallWSConfig`,
            :class:`WSConfig` or a dict of its fields); None: the kernel's default.
        kernel: the Gluon kernel (above).
        kv_lengths: dense kv_indices only: [R] int32/int64 rows' lengths, 0 <= n <= K (as
            :func:`sparse_mla.sparse_mla_prefill`'s).
        max_kv_length: with ``kv_lengths`` only: a host int bounding them, which the split
            count plans for in K's place (as :func:`sparse_mla.sparse_mla_prefill`'s; never
            changes what is read).
        validate: check kv_indptr's (or kv_lengths') values on the host (see
            :func:`sparse_mla.validation.validate_inputs`; None: only with
            ``SPARSE_MLA_VALIDATE=1``, as the tensors are on a GPU). Unchecked, each row's range
            is clamped to [0, nnz] in the kernel: a bad entry never reads outside kv_indices.

    Returns:
        out [R, H, 512] in q's dtype (rows with no valid slot are zeros), or (out, lse).
    """
    kv_indptr = _slot_lists(kv_indices, kv_indptr, kv_lengths)
    bound = length_bound(max_kv_length, kv_indices, kv_lengths)
    x, kpe2 = _validate(
        q_nope, q_pe, kv_c, k_pe, kv_indices, kv_indptr, sm_scale, has_pe, attn_sink, out,
        num_kv_splits, validate,
    )  # fmt: skip
    name = kernel or DEFAULT_KERNEL
    gluon_kernel(name)  # a typo is an error before anything runs
    if config is not None:
        resolve_launch(name, config, x.q.shape[1], get_target(target or "sm90"))
    with runtime.compiling():  # a launch may compile: not while another thread interprets
        return run_validated(
            x.q, q_pe, x.kv, kpe2, x.kv_indices, x.kv_indptr, x.softmax_scale,
            has_pe=has_pe, attn_sink=x.attn_sink, out=out, num_kv_splits=num_kv_splits,
            return_lse=return_lse, target=target, config=config, kernel=name,
            nnz=planned_nnz(x.kv_indices, bound),
        )  # fmt: skip


@functools.cache
def _cached(constexprs_fn):
    """``constexprs_fn`` memoised (its arguments are configs, targets, ints and flags): a
    launch builds its layout objects once, and Triton's cache key then compares the same
    objects. The dict returned is shared: callers spread it (``**cx``), never change it."""
    return functools.lru_cache(maxsize=256)(constexprs_fn)


def run_validated(
    q_nope, q_pe, kv2, kpe2, kv_indices, kv_indptr, sm_scale, *, has_pe, attn_sink=None,
    out=None, num_kv_splits=None, return_lse=False, target=None, config=None, kernel=None,
    nnz=None,
):  # fmt: skip
    """:func:`mla_gluon` after its validation (``kv2``/``kpe2`` are the [N, 512]/[N, 64] pools):
    for a caller that validated the inputs already, e.g. ``sparse_mla_prefill``'s dispatch.
    ``kernel`` (default ``gluon_mma``) runs with ``config`` (None: its default); ValueError
    saying why when it cannot run the call. ``nnz``: the lists' total length the split count
    plans for (None: ``kv_indices.numel()``; the entry's ``max_kv_length`` makes it T x that
    bound for dense ids with lengths)."""
    if runtime.runs_interpreted(q_nope):
        raise RuntimeError(
            "mla_gluon needs a GPU: Gluon kernels do not run in Triton's interpreter; "
            "use sparse_mla.gluon.compile_args to cross-compile on a CPU machine"
        )
    dev = q_nope.device.index or 0
    local = runtime.arch(dev)
    tgt = get_target(local)
    if target is not None and get_target(target).name != tgt.name:
        raise ValueError(f"target {target!r} does not match the local GPU ({local})")
    name = kernel or DEFAULT_KERNEL
    R, H, _ = q_nope.shape
    cfg = _checked_launch(name, config, H, tgt, has_pe, return_lse, num_kv_splits)
    N = kv2.shape[0]
    planned = kv_indices.numel() if nnz is None else nnz
    form = dense_form(kv_indices, kv_indptr)
    if form and not (name in _WS and KERNELS[name].dense_ids):
        # dense ids as CSR, no host sync: a kept kv_indptr, or with lengths the lists packed
        kv_indices, kv_indptr = (_dense_launch_csr(kv_indices) if form == 1
                                 else dense_lengths_csr(kv_indices, kv_indptr))  # fmt: skip
    if out is None:
        out = torch.empty(R, H, HEAD_DIM, dtype=q_nope.dtype, device=q_nope.device)
    lse = torch.empty(R, H, dtype=torch.float32, device=q_nope.device) if return_lse else None
    if R == 0 or N == 0:
        out.zero_()
        if lse is not None:
            if attn_sink is not None:
                lse.copy_(attn_sink.expand(R, H))
            else:
                lse.fill_(-math.inf)
        return (out, lse) if return_lse else out

    if name in _WS:
        ws_kernel, module = _WS[name]
        splits, extra_args, cx = 1, (), _ws_constexprs(cfg)
        if name == "gluon_ws":
            splits = num_kv_splits
            if not splits:  # the rule the bench records too (split_plan: ws_num_splits)
                _, splits = split_plan(name, cfg, R, H, planned, tgt, _num_compute_units(dev),
                                       own_launch=False)  # fmt: skip
            if splits > 1:
                opart = torch.empty(R, splits, H, HEAD_DIM, dtype=torch.float32,
                                    device=q_nope.device)  # fmt: skip
                lsepart = torch.empty(R, splits, H, dtype=torch.float32, device=q_nope.device)
                extra_args = (opart, lsepart)
                cx = _cached(_ws_split_constexprs)(cfg, splits)
            else:
                extra_args = (_unused(q_nope.device),) * 2
        _launch_persistent(ws_kernel, _heads_per_item(name, cfg), q_nope, kv2, kv_indices,
                           kv_indptr, attn_sink, out, sm_scale, dev,
                           out_aligned=getattr(module, "OUT_ALIGNED", False),
                           q_tma=getattr(module, "Q_BY_TMA", False),
                           constexprs=cx,
                           small_call=getattr(module, "small_call", None),
                           pos_scale=getattr(module, "FOLDS_SCALE", False),
                           extra_args=extra_args, splits=splits,
                           l2_rows=name == "gluon_ws" and hopper_ws.l2_rows(splits))  # fmt: skip
        if splits > 1:
            _reduce(opart, lsepart, attn_sink, out, lsepart, H, splits, tgt, cols=REDUCE_COLS)
        return out
    units = _num_compute_units(dev)
    if num_kv_splits:
        splits = num_kv_splits
    else:  # a prefill call too small to fill the GPU may trade gluon_mma's own head blocks
        own = config is None or config is _default_mma(H, tgt)
        plan_cfg, splits = split_plan(name, cfg, R, H, planned, tgt, units, own_launch=own,
                                      has_pe=has_pe)  # fmt: skip
        if plan_cfg is not cfg:
            cfg = _checked_launch(name, plan_cfg, H, tgt, has_pe, return_lse, None)
    block_h = cfg.BLOCK_H
    pools = (kv2, kpe2) if has_pe else (kv2,)
    sink = attn_sink.contiguous() if attn_sink is not None else _unused(q_nope.device)
    lse_arg = lse if lse is not None else _unused(q_nope.device)
    groups = R * runtime.cdiv(H, block_h)  # (row, head block) pairs
    fused = fused_reduce(splits, tgt, block_h, groups, units)
    if splits > 1:
        opart = torch.empty(R, splits, H, HEAD_DIM, dtype=torch.float32, device=q_nope.device)
        lsepart = torch.empty(R, splits, H, dtype=torch.float32, device=q_nope.device)
    else:
        opart = lsepart = _unused(q_nope.device)
    # The fused reduce's arrival counters, one per (row, head block), and the combiners' work
    # ticket after them: zero at rest (the last split or combiner of each sets its counter back
    # to 0, the last ticket the ticket), so a kept set serves the next launch too.
    count = (
        fastlaunch.zeroed(groups + 1, torch.int32, q_nope.device)
        if fused
        else _unused(q_nope.device, torch.int32)
    )
    if name == "gluon_wgmma":
        wcx = _cached(wgmma_constexprs)(
            cfg, has_sink=attn_sink is not None, num_splits=splits, write_lse=return_lse,
            fused=fused,
        )  # fmt: skip
        combine = wcx["COMBINERS"]
        fastlaunch.launcher(_prefill_wgmma_kernel)(
            (groups * (splits + combine), 1) if combine else (groups, splits),
            (q_nope, kv2, kv_indices, kv_indptr, sink, out, lse_arg, opart, lsepart, count,
             q_nope.stride(0), q_nope.stride(1), kv2.stride(0), out.stride(0), out.stride(1),
             H, N, kv_indices.numel(), float(sm_scale) * _LOG2E),
            fastlaunch.merged(wcx, num_warps=cfg.num_warps, num_stages=1),
        )  # fmt: skip
    else:
        _launch_shared(
            cfg, tgt, q_nope, q_pe, kv2, kpe2, kv_indices, kv_indptr, sink, out, lse_arg, opart,
            lsepart, count, sm_scale, has_pe=has_pe, has_sink=attn_sink is not None, splits=splits,
            write_lse=return_lse, use_buffer=_use_buffer(tgt, *pools), fused=fused,
        )  # fmt: skip
    if splits > 1 and not fused:
        _reduce(opart, lsepart, attn_sink, out, lse_arg, H, splits, tgt, return_lse)
    return (out, lse) if return_lse else out


# Columns a program of gluon_ws's reduce combines (_mla_reduce_kernel's COLS): 4 programs a
# (row, 16-head block), so a one-token call's reduce runs on 32 SMs at 128 heads, not 8.
REDUCE_COLS = 128


def _reduce(
    opart, lsepart, attn_sink, out, lse_arg, num_heads, splits, tgt, write_lse=False, cols=0
):  # fmt: skip
    """The split launches' reduce step (``_mla_reduce_kernel``): ``out`` (and the LSE under
    ``write_lse``) from the [R, splits, H, 512] partials and their base-2 LSEs, sink folded;
    one program per (row, 16-head block), or per (row, 16-head block, ``cols`` columns)
    (``gluon_ws``'s, :data:`REDUCE_COLS`)."""
    R = out.shape[0]
    sink = attn_sink.contiguous() if attn_sink is not None else _unused(out.device)
    rcx = _cached(_reduce_constexprs)(num_heads, splits, attn_sink is not None, write_lse, tgt,
                                      cols=cols)  # fmt: skip
    grid = (R, runtime.cdiv(num_heads, rcx["BLOCK_H"]))
    fastlaunch.launcher(_mla_reduce_kernel)(
        (*grid, HEAD_DIM // cols) if cols else grid,
        (opart, lsepart, sink, out, lse_arg, out.stride(0), out.stride(1), num_heads),
        fastlaunch.merged(rcx, num_warps=4),
    )  # fmt: skip


# (kernel, config, heads, target, has_pe, return_lse, splits) -> the resolved, checked launch.
_CHECKED: dict[tuple, Any] = {}


def _checked_launch(name, config, num_heads, tgt, has_pe, return_lse, num_kv_splits):
    """Kernel ``name``'s launch for a call, resolved and checked (:func:`resolve_launch`,
    :func:`why_not`): ValueError saying why it cannot run. Cached for hashable configs (the
    config objects; a dict is resolved per call)."""
    try:
        key = (name, config, num_heads, tgt, has_pe, return_lse, num_kv_splits)
        cfg = _CHECKED.get(key)
    except TypeError:  # a dict config
        key = cfg = None
    if cfg is not None:
        return cfg
    spec = gluon_kernel(name)
    cfg = resolve_launch(name, config, num_heads, tgt)
    if num_kv_splits is not None and num_kv_splits > 1 and not spec.splits:
        raise ValueError(f"{name} runs one KV split; num_kv_splits={num_kv_splits}")
    why = why_not(name, cfg, tgt, has_pe=has_pe, num_splits=1, write_lse=return_lse)
    if why:
        raise ValueError(f"{name} cannot run this call: {why}")
    if key is not None:
        if len(_CHECKED) >= 1024:
            _CHECKED.clear()
        _CHECKED[key] = cfg
    return cfg


_NO_SINK: dict[tuple, torch.Tensor] = {}


def _no_sink(num_heads: int, device: torch.device) -> torch.Tensor:
    """[H] fp32 of -inf: the sink of a persistent launch without one (2^-inf adds 0 to the
    denominator). One per (H, device), never written; not kept when made inside a CUDA-graph
    capture (its memory would be the graph's)."""
    key = (num_heads, device)
    t = _NO_SINK.get(key)
    if t is None:
        t = torch.full((num_heads,), -math.inf, dtype=torch.float32, device=device)
        if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            _NO_SINK[key] = t
    return t


def _launch_persistent(
    kernel, heads_per_item, q, kv2, kv_indices, kv_indptr, attn_sink, out, sm_scale, dev,
    *, out_tma=False, out_aligned=False, single_direct=False, q_tma=False, constexprs=None,
    small_call=None, num_kv=None, stride_kvn=None, extra_args=(), pos_scale=False, splits=1,
    l2_rows=False,
):  # fmt: skip
    """Launch a warp-specialised sm90 prefill kernel: persistent, one program per SM over
    R x cdiv(H, heads_per_item) work items (4 warps here + its worker partitions).

    ``out_tma``: the kernel writes O by TMA (``hopper_ws_fp8``) and takes a descriptor of
    ``out`` (boxes [1, heads_per_item, OUT_BLOCK]) in place of its pointer; an ``out`` that
    TMA cannot address (base or a stride not a multiple of 16 bytes, last dim not contiguous)
    is written through a contiguous buffer and copied. ``out_aligned``: the kernel takes out's
    pointer and stores O 16 bytes a lane (``hopper_ws``, ``OUT_ALIGNED``), so such an ``out``
    goes through a buffer too. ``single_direct`` (with ``out_tma``): a call of at most one item
    a program (:func:`single_item`) is built with ``OUT_DIRECT`` and takes out's pointer, the
    others the descriptor (``hopper_ws_fp8``; PERF_NOTES "No cliffs" step 47). Either way out's
    two row strides follow ``stride_kvn``. ``q_tma``: the kernel reads Q by TMA (``hopper_ws``)
    and takes a descriptor of ``q`` (boxes [1, heads_per_item, Q_BLOCK]) in place of its
    pointer (q rows 16-byte aligned, as for the cp.async copies).
    ``small_call(nnz, programs)``: the kernel has a ``SMALL`` constexpr, set from it
    (``hopper_ws.small_call``).
    ``kv_indices`` dense [R, K] (contiguous): ``DENSE_IDS`` and ``ids_per_row`` = K, with
    ``kv_indptr`` None (kv_indices stands in for the unused pointer) or the rows' lengths [R]
    (``DENSE_IDS`` = 2).
    ``num_kv`` / ``stride_kvn``: the pool's rows and row stride when ``kv2`` is not a [N, D]
    pool (an FP8 cache's bytes: its slots and block stride, :mod:`launch_fp8`);
    ``extra_args``: the kernel's arguments after ``ids_per_row``. ``pos_scale``: the kernel has
    a ``POS_SCALE`` constexpr (``hopper_ws``'s consumers), set when ``sm_scale`` > 0.
    ``splits`` > 1: each (token, head block) is that many items (``hopper_ws``'s NUM_SPLITS,
    in ``constexprs``), which write partials (in ``extra_args``), not ``out``. ``l2_rows``: pass
    ``L2_ROWS`` (``hopper_ws``'s producer prefetches rows into L2; ``hopper_ws.l2_rows``)."""
    R, H, _ = q.shape
    # The producer copies Q with 16-byte cp.async: rows must start 16-byte aligned.
    qs0, qs1, _ = q.stride()
    if q.data_ptr() % 16 or qs0 % 8 or qs1 % 8:
        q = q.contiguous()
        qs0, qs1, _ = q.stride()
    # No sink: logits of -inf add 2^-inf = 0 to the denominator.
    sink = _no_sink(H, q.device) if attn_sink is None else attn_sink.contiguous()
    items = R * runtime.cdiv(H, heads_per_item) * splits
    grid = (min(items, _num_compute_units(dev)),)
    extra = {} if small_call is None else {"SMALL": small_call(kv_indices.numel(), grid[0])}
    if single_direct and single_item(items, grid[0]):  # passed only when set, like DENSE_IDS
        extra["OUT_DIRECT"] = True
        out_tma, out_aligned = False, True
    dense, kv_indptr, per_row = dense_launch(kv_indices, kv_indptr)
    if dense:  # dense ids (DENSE_IDS is passed only when set: CSR is unchanged)
        extra["DENSE_IDS"] = dense
    if pos_scale and sm_scale > 0:  # passed only when set, like DENSE_IDS
        extra["POS_SCALE"] = True
    if l2_rows:  # passed only when set, like DENSE_IDS
        extra["L2_ROWS"] = True
    # One dict per (constexprs, SMALL): the direct launch keys on its identity.
    kwargs = fastlaunch.frozen(**(constexprs or {}), **extra, num_warps=4, num_stages=1)
    # TMA descriptors as TmaArg: built (TensorDescriptor) only when kernel[grid] runs; the
    # direct launch reuses the encoded CUtensorMap of the same address, shape and strides.
    q_arg = q
    if q_tma:
        q_arg = fastlaunch.TmaArg(
            q, (1, heads_per_item, hopper_ws.Q_BLOCK.value), hopper_ws.Q_SMEM.value
        )
    common = (q_arg, kv2, kv_indices, kv_indptr, sink)
    n = kv2.shape[0] if num_kv is None else num_kv
    tail = (H, n, kv_indices.numel(), float(sm_scale) * _LOG2E, items, per_row, *extra_args)
    stride = kv2.stride(0) if stride_kvn is None else stride_kvn
    launch = fastlaunch.launcher(kernel)
    dst = out
    if (out_tma or out_aligned) and not _aligned_rows(out):
        dst = torch.empty(out.shape, dtype=out.dtype, device=out.device)
    o_arg = dst
    if out_tma:
        o_arg = fastlaunch.TmaArg(
            dst, (1, heads_per_item, hopper_ws.OUT_BLOCK.value), hopper_ws.OUT_SMEM.value
        )
    os0, os1, _ = dst.stride()
    launch(grid, (*common, o_arg, qs0, qs1, stride, os0, os1, *tail), kwargs)
    if dst is not out and splits == 1:  # a split launch writes partials, never dst
        out.copy_(dst)


def single_item(items: int, programs: int) -> bool:
    """Whether each persistent program runs at most one work item: where ``gluon_ws_fp8``
    stores O by its consumers' own 16-byte stores (``OUT_DIRECT``). Measured in turns against
    TMA stores (H200): 2-2.5% faster at T = 64 (one item a program), 0.6-0.8% slower at T = 256
    H64 (two), 2-2.5% slower at T = 1024 H64 and T = 16384, where the next item's producer
    streams its rows while the stores go out (data/bench/fp8_out_ab_h200_c4e9b62.log,
    fp8_out_small_ab_h200_19d0616.log)."""
    return items <= programs


def _aligned_rows(t: torch.Tensor) -> bool:
    """Whether ``t``'s rows are 16-byte aligned, as a TMA descriptor and 16-byte stores need:
    16-byte aligned base, every stride but the last (which must be 1) a multiple of 16
    bytes."""
    es = t.element_size()
    return (
        t.data_ptr() % 16 == 0
        and t.stride(-1) == 1
        and all(s * es % 16 == 0 for s in t.stride()[:-1])
    )


def _launch_shared(
    cfg, tgt, q_nope, q_pe, kv2, kpe2, kv_indices, kv_indptr, sink, out, lse_arg, opart, lsepart,
    count, sm_scale, *, has_pe, has_sink, splits, write_lse, use_buffer, fused,
):  # fmt: skip
    """Launch the shared algorithm's ``_mla_fwd_kernel`` (``gluon_mma``: decode and prefill,
    every target, any H)."""
    R, H, _ = q_nope.shape
    cx = _cached(kernel_constexprs)(
        cfg, tgt, has_pe=has_pe, has_sink=has_sink, num_splits=splits, write_lse=write_lse,
        use_buffer=use_buffer, fused=fused,
    )  # fmt: skip
    qpe = q_pe if has_pe else q_nope
    kpe = kpe2 if has_pe else kv2
    combine = cx["COMBINERS"]
    grid = (
        (R * runtime.cdiv(H, cfg.BLOCK_H) * (splits + combine), 1, 1)
        if combine
        else (R, runtime.cdiv(H, cfg.BLOCK_H), splits)
    )
    fastlaunch.launcher(_mla_fwd_kernel)(
        grid,
        (q_nope, qpe, kv2, kpe, kv_indices, kv_indptr, sink, out, lse_arg, opart, lsepart, count,
         q_nope.stride(0), q_nope.stride(1), qpe.stride(0), qpe.stride(1),
         kv2.stride(0), kpe.stride(0), out.stride(0), out.stride(1),
         H, kv2.shape[0], kv_indices.numel(), float(sm_scale) * _LOG2E),
        fastlaunch.merged(cx, num_warps=cfg.num_warps, num_stages=1),
    )  # fmt: skip


_UNUSED: dict[tuple, torch.Tensor] = {}


def _unused(device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:func:`lse_dummy` (or an int32 one: the arrival counters of a launch without the fused
    reduce) made once per (device, dtype); the launch neither reads nor writes it."""
    t = _UNUSED.get((device, dtype))
    if t is None:
        t = torch.empty(1, dtype=dtype, device=device)
        if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            _UNUSED[(device, dtype)] = t
    return t


def lse_dummy(like: torch.Tensor) -> torch.Tensor:
    """A 1-element fp32 placeholder for pointer arguments a launch does not use."""
    return torch.empty(1, dtype=torch.float32, device=like.device)
