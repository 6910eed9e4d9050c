"""Hopper (sm90) sparse prefill, warp-specialised: one producer and two consumer warpgroups.

Persistent: one program per SM takes (token, block of 64 heads) work items round-robin; each
program runs 12 warps in three partitions:

- **producer** (4 warps, few registers): loads Q once by TMA, then cp.async-gathers the token's
  KV rows, 64 slots a tile, into two shared-memory tile buffers. Each buffer is filled and
  released in two halves of 256 columns (``L`` = D[0:256], ``R`` = D[256:512]); each half has
  a ``ready`` mbarrier (the producer's 128 lanes arrive when their copies land) and a ``free``
  one (the consumer that reads it last arrives). Absent slots (< 0, >= N, past the list's end) copy
  nothing and are zero-filled, so their V rows are 0 and the pool is never read for them. With a
  tile's first half the producer also publishes the tile's checked slot ids (-1: absent) in
  shared memory, from which its consumer masks S (no reload of kv_indices).
- **consumer 0** (the default partition) computes S = Q K^T of the even tiles (buffer 0) and
  owns O[:, 0:256]; **consumer 1** computes S of the odd tiles (buffer 1) and owns O[:, 256:512].
  Both S tiles are [64, 64] wgmma (M = 64 heads, N = 64 slots, K = 512) with Q and K in shared
  memory, so each warpgroup's wgmma reads whole 64-wide operands.
- Both halves of O need both tiles' P: a consumer applies its own P from registers
  (wgmma with A in registers) and the other consumer's P from shared memory.
- A short last tile: when the odd tile of an item's last pair holds at most ``TAIL`` (16)
  list slots, consumer 1's S and its own PV run over those 16 slots only (m64n16 and K = 16)
  and it publishes P1 with zeros past them (consumer 0's PV stays whole): a quarter of that
  tile's work on consumer 1, the latency of a small call's longest item at T = 64.
- The two must share one running max. Per pair of tiles each consumer publishes the row max
  of its S tile and both meet (a named barrier); each then takes m = max(m, both row maxima),
  so both exponentiate and rescale at the same time, and their O halves and partial sums stay
  in the same base. The two partial sums are added at the end.
- The output: each consumer normalises its O half and writes it in four [64, 64] blocks, each
  through its P buffer (free by then) into a layout of 16 contiguous bytes a lane, then by the
  lanes' own 16-byte stores (``OUT_DIRECT``; PERF_NOTES "No cliffs" step 46: 1-2% faster than
  a TMA store a block with a wait before the next). ``gluon_ws_fp8``, which shares the
  consumers, does so only where each program runs one item and writes by TMA elsewhere
  (step 47).

Dense ids (``DENSE_IDS``: kv_indices [R, K], no kv_indptr, an engine's top-k output as FlashMLA
takes it): an item's range is row r, [r K, (r + 1) K), so its slot ids load at once, without
the kv_indptr round trip before them (the last small-call gap to FlashMLA, PERF_NOTES "No
cliffs" step 5). Under ``DENSE_IDS`` = False the kernel is instruction for instruction the CSR
one (SASS diffed); ``ids_per_row`` is then 0 and unused.

The producer and the consumers hand over through mbarriers (``ready`` / ``free`` per half, Q's
``Q_READY`` / ``Q_FREE``); each is used once per pair of tiles (Q's once per item), so its phase
is the parity of the pair's count over all of the program's items (a producer's first wait on
a ``free`` barrier passes at once). The consumers meet each other on named barriers (``NB_*``).
Q is loaded once per item, after both consumers released the previous item's (``Q_FREE``),
while they finish its last PVs and store its output.

Small calls (``SMALL``, :func:`small_call`: a program's share of kv_indices is at most 2048
ids; at the H200's 132 SMs up to ~256 tokens at 64 heads) are one or two items a program, and
an item is a chain of dependent memory round trips: kv_indptr, then the slot ids, then the KV
rows, with Q beside it. There the producer asks L2 for its share of kv_indices at start
(``_prefetch_ids``), and a program's first item sends Q before its kv_indptr loads; where
the shares are at most CALL_ROWS ids, consumer 1 asks L2 for its share's KV rows while Q lands
(``_prefetch_call_rows``), so the rows are on their way before any item's ids are back.
Larger calls keep the steady-state order (each item's range loads first, in flight while the
consumers finish the previous item): the small-call order measured 1-2% slower at T = 16384,
H128. Consumer 0 is the same in both (it takes ``SMALL`` only because the partitions share
one argument list).
Calls of few items (``NUM_SPLITS`` > 1, chosen on the host by ``launch.ws_num_splits``): each
(token, head block) is NUM_SPLITS items, each a piece of the token's list in whole pairs of
tiles; a piece's consumers store their O half normalised by the piece's own sum (fp32, from the
accumulator registers) and its base-2 log-sum-exp, and a reduce launch combines the pieces
with the sink (``algorithm._mla_reduce_kernel`` by column blocks). At one split the kernel is
the one without it (PTX diffed).
The kernel is FlashMLA's sm90 sparse-prefill schedule (DeepSeek, csrc/sm90/prefill/sparse)
re-derived in Gluon (read, not copied), with a different exchange of the running max and a
different epilogue; docs/PERF_NOTES.md says what each step bought.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import constexpr_function
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .. import _consts

BLOCK_H = gl.constexpr(64)  # heads per program: the M of every wgmma
BLOCK_K = gl.constexpr(64)  # slots per tile
HEAD_DIM = gl.constexpr(512)
HALF = gl.constexpr(HEAD_DIM // 2)
# Registers per thread (setmaxnreg) of the producer and of consumer 1 (the worker partitions):
# three warpgroups share the 65,536 registers, 168 a thread each at launch (65,536 / 384,
# rounded down to 8); the workers give theirs up to these and consumer 0 (the default
# partition) takes the rest, REG_POOL - CONSUMER_REGS - PRODUCER_REGS, at most 256:
# 504 - 224 - 48 = 232 (register_split checks a launch's).
PRODUCER_REGS = gl.constexpr(48)
CONSUMER_REGS = gl.constexpr(224)
REG_POOL = 3 * (65536 // (3 * 128) // 8 * 8)  # 504


@constexpr_function
def register_split(consumer_regs: int, producer_regs: int) -> tuple[int, int, int]:
    """(consumer 0, consumer 1, producer) registers a thread for a launch's CONSUMER_REGS and
    PRODUCER_REGS; ValueError saying why a split cannot be (not a multiple of 8 in [24, 256],
    or consumer 0 left with fewer registers than consumer 1: both hold a [64, 256] fp32 O half,
    128 registers, and the same S tile)."""
    for name, v in (("CONSUMER_REGS", consumer_regs), ("PRODUCER_REGS", producer_regs)):
        if not (isinstance(v, int) and not isinstance(v, bool) and 24 <= v <= 256 and v % 8 == 0):
            raise ValueError(f"{name} must be a multiple of 8 in [24, 256], got {v!r}")
    default = min(256, REG_POOL - consumer_regs - producer_regs)
    if default < consumer_regs:
        raise ValueError(
            f"register split: consumer 0 would get {REG_POOL} - {consumer_regs} - "
            f"{producer_regs} = {default} registers, fewer than consumer 1's {consumer_regs} "
            f"(the pool is {REG_POOL} a thread over the three warpgroups)"
        )
    return default, consumer_regs, producer_regs


@constexpr_function
def _worker_regs(consumer_regs, producer_regs):
    """[CONSUMER_REGS, PRODUCER_REGS] of a launch, checked (None: the module's default)."""
    c = CONSUMER_REGS.value if consumer_regs is None else consumer_regs
    p = PRODUCER_REGS.value if producer_regs is None else producer_regs
    register_split(c, p)
    return [c, p]


M_INIT = gl.constexpr(
    -1.0e30
)  # running max before any valid slot: finite, so 2^(m_old - m_new) is never NaN
LOG2E = gl.constexpr(_consts.LOG2E)

# The consumers take a POS_SCALE constexpr (:func:`_masked_max`): the launcher sets it for a
# softmax scale > 0 (launch._launch_persistent's pos_scale).
FOLDS_SCALE = True

# The mbarriers by number (:func:`_bar`), kept in one allocation per role (:func:`_shared_state`).
READY = gl.constexpr(0)  # + 2 * buffer + half: a half tile has landed (producer's 128 lanes arrive)
FREE = gl.constexpr(4)  # + 2 * buffer + half: its last reader is done (one arrival)
Q_READY = gl.constexpr(8)  # Q has landed
Q_FREE = gl.constexpr(9)  # both consumers are past their last QK^T of a work item
NUM_BARS = gl.constexpr(10)
# The same slots by name, <buffer><half> (half L = D[0:256], R = D[256:512]), as the partitions
# use them; READY / FREE + 2 * buffer + half stays for the loops and _qk_half.
READY_0L, READY_0R = gl.constexpr(READY.value + 0), gl.constexpr(READY.value + 1)
READY_1L, READY_1R = gl.constexpr(READY.value + 2), gl.constexpr(READY.value + 3)
FREE_0L, FREE_0R = gl.constexpr(FREE.value + 0), gl.constexpr(FREE.value + 1)
FREE_1L, FREE_1R = gl.constexpr(FREE.value + 2), gl.constexpr(FREE.value + 3)
# Named (hardware) barriers between the two consumers, 256 threads each. NB_MAX and NB_L are
# meeting points (both consumers bar.sync); at NB_P0 / NB_P1 the consumer that stored its P
# arrives without waiting (bar.arrive) and the other waits. Each is used once per pair of tiles
# (NB_L once per item), and no consumer can arrive twice before the other has passed once
# (every arrival is behind the previous NB_MAX), so no phase is needed. Triton's own
# warp-specialisation code uses ids 0-3.
NB_MAX = gl.constexpr(8)  # both row maxima of the pair are published
NB_P0 = gl.constexpr(9)  # consumer 0 stored P0
NB_P1 = gl.constexpr(10)  # consumer 1 stored P1
NB_L = gl.constexpr(11)  # epilogue: both partial sums stored


# S tile [64 heads, 64 slots] of one warpgroup.
MMA_S = gl.constexpr(
    gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
)
# O half [64 heads, 256 columns] of one warpgroup.
MMA_O = gl.constexpr(
    gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
)
ROW_S = gl.constexpr(gl.SliceLayout(1, MMA_S.value))
# A short last tile: when the odd tile of an item's last pair holds at most TAIL slots (its
# list ends there, or the even tile was the last), consumer 1's S is [64 heads, TAIL slots]
# and its own PV takes K = TAIL: a quarter of that work. Consumer 0's PV with that P stays
# whole (K = 64, zeros past TAIL): its last-pair form with a K = TAIL branch beside it was
# miscompiled by ptxas (Triton 3.6; the branch's second wgmma read a B descriptor register
# that no path had set, an out-of-bounds shared read on the H200).
TAIL = gl.constexpr(16)
MMA_T = gl.constexpr(
    gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
)
ROW_T = gl.constexpr(gl.SliceLayout(1, MMA_T.value))
ROW_O = gl.constexpr(gl.SliceLayout(1, MMA_O.value))
DOT_P = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA_O.value, k_width=2))
# Copies of [64, 256] half tiles by one warpgroup: 8 lanes cover 128 contiguous bytes of a row
# (one swizzle row of the destination), a lane holds 4 rows x 4 16-byte vectors, so it needs
# only 4 slot ids per tile.
GATHER = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))
SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
VEC = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
LANE = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))  # one element per thread of 4 warps
# The output goes out in [BLOCK_H, OUT_BLOCK] blocks of out [R, H, 512] (128-byte rows): by the
# consumers' 16-byte stores (ST_OUT) here; in gluon_ws_fp8 by TMA in [1, BLOCK_H, OUT_BLOCK]
# boxes (OUT_SMEM) where items follow one another in a program.
OUT_BLOCK = gl.constexpr(64)
OUT_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3))
ST_OUT = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))  # 16 bytes a lane
# For the launcher: out by its pointer and strides, its rows 16-byte aligned (an out view that
# is not is written through a buffer and copied).
OUT_ALIGNED = True
# Q comes in by TMA too: one [1, BLOCK_H, Q_BLOCK] block of q [R, H, 512] per item (rows past
# H zero-filled by the descriptor's bounds; the compiler issues it as eight 128-byte-wide boxes,
# the swizzle's width), on one barrier that expects its bytes.
Q_BLOCK = gl.constexpr(512)
Q_SMEM = OUT_SMEM
Q_BY_TMA = True  # for the launcher: pass a TMA descriptor of q in place of its pointer
# _prefetch_ids (SMALL calls): 256 prefetches of PF_IDS ids a program (32 bytes of int32 ids
# each), 2 a lane of the producer's 128. A call is SMALL when each program's share of
# kv_indices is at most SMALL_IDS ids (:func:`small_call`).
PF = gl.constexpr(gl.BlockedLayout([2], [32], [4], [0]))
PF_IDS = gl.constexpr(8)
SMALL_IDS = PF_IDS.value * 256


def small_call(nnz: int, programs: int) -> bool:
    """Whether a call of ``nnz`` slot ids over ``programs`` persistent programs runs the
    small-call order (host side; ``nnz`` is kv_indices.numel(), no device read)."""
    return 0 < nnz <= SMALL_IDS * programs


def l2_rows(splits: int) -> bool:
    """Whether a call whose lists run in ``splits`` pieces is built with ``L2_ROWS`` (the
    producer asks L2 for the next pair's KV rows, :func:`_prefetch_rows`): only split calls,
    where it is measured faster (H200, in turns against the same kernel without it, twice each:
    whole lists T = 1 / 4 H128 and T = 4 / 16 H64 -0.8..-3.4%; T = 16 H128 +0.8..+1.6%). At the
    points that gain, each piece is one pair, so no prefetch is issued: the gain is the build's
    schedule (ptxas orders all three partitions differently with it), not L2. Where prefetches
    are issued in unsplit calls they lost: 128 items of 640-slot lists +2.7..+4.2%, T = 16384
    +3..+5%; whole lists T = 64 H128 gained 0.7-1.1% (data/bench/ws_l2rows_ab_h200_b1f7a7a.log,
    ws_l2gate_ab_h200_1f8b501.log, ws_l2split_ab_h200_f971c08.log; PERF_NOTES "No cliffs" step
    22)."""
    return splits > 1


@gluon.jit
def _item_range(
    item, indptr_ptr, nnz, num_heads, HEADS: gl.constexpr, ids_per_row, DENSE_IDS: gl.constexpr,
    NUM_SPLITS: gl.constexpr = 1,
):  # fmt: skip
    """Work item ``item``'s token, head block and CSR slot range [lo, hi) with its tile count.
    The range is clamped to [0, nnz] (nnz = kv_indices.numel()): no kv_indptr, checked or not,
    reads outside kv_indices (a decreasing pair or a range past nnz keeps the in-bounds part).
    ``DENSE_IDS``: kv_indices is dense [R, ids_per_row] (contiguous) and token r's range is
    row r, [r x ids_per_row, (r + 1) x ids_per_row), known without a load; ``DENSE_IDS`` = 2:
    its first n ids, n = indptr_ptr[r] (the rows' lengths in kv_indptr's place) clamped to
    [0, ids_per_row].

    Items are (token, block of HEADS heads) with a token's blocks adjacent; the persistent programs
    take them round-robin, so the programs that gather the same rows run at the same time and
    share them in L2.

    ``NUM_SPLITS`` > 1: items are (token, head block, split), a group's splits adjacent, and
    the range is split ``item % NUM_SPLITS``'s piece of the token's list: pieces of whole
    pairs of tiles (the two consumers' unit), cdiv(cdiv(len, NUM_SPLITS), 128) x 128 slots
    each, the last the rest, pieces past a short list empty."""
    num_hb = (num_heads + HEADS - 1) // HEADS
    group = item // NUM_SPLITS
    pid_h = group % num_hb
    pid_r = (group // num_hb).to(gl.int64)
    if DENSE_IDS:
        lo = pid_r * ids_per_row
        hi = lo + ids_per_row
        if DENSE_IDS == 2:
            n = gl.load(indptr_ptr + pid_r).to(gl.int64)
            hi = lo + gl.minimum(gl.maximum(n, 0), ids_per_row)
    else:
        lo = gl.load(indptr_ptr + pid_r).to(gl.int64)
        hi = gl.load(indptr_ptr + pid_r + 1).to(gl.int64)
        lo = gl.minimum(gl.maximum(lo, 0), nnz)
        hi = gl.minimum(gl.maximum(hi, lo), nnz)
    if NUM_SPLITS > 1:
        pair = 2 * BLOCK_K
        chunk = ((hi - lo + NUM_SPLITS - 1) // NUM_SPLITS + pair - 1) // pair * pair
        lo = gl.minimum(lo + (item % NUM_SPLITS) * chunk, hi)
        hi = gl.minimum(lo + chunk, hi)
    num_tiles = ((hi - lo + BLOCK_K - 1) // BLOCK_K).to(gl.int32)
    return pid_r, pid_h, lo, hi, num_tiles


@gluon.jit
def _slot_ids(idx_ptr, pos0, hi, num_kv, layout: gl.constexpr):
    """[64] slot ids at CSR positions pos0 .. pos0+63 as int32 in ``layout`` (a [64] layout),
    -1 where absent (past the list, < 0 or >= N: a valid id is < N < 2^31)."""
    offs = pos0 + gl.arange(0, BLOCK_K, layout=layout)
    in_list = offs < hi
    slot = gl.load(idx_ptr + offs, mask=in_list, other=-1).to(gl.int64)
    return gl.where(in_list & (slot >= 0) & (slot < num_kv), slot, -1).to(gl.int32)


@gluon.jit
def _slots(idx_ptr, pos0, hi, num_kv):
    """:func:`_slot_ids` one per gathered row of the producer's layout."""
    return _slot_ids(idx_ptr, pos0, hi, num_kv, gl.SliceLayout(1, GATHER))


@gluon.jit
def _gather_half(dst, kv_ptr, slot, stride_kvn, col0):
    """cp.async the columns [col0, col0 + 256) of the KV rows ``slot`` ([64], -1: absent) into
    ``dst`` ([64, 256]); absent rows copy nothing and are zero-filled."""
    offs_c = col0 + gl.arange(0, HALF, layout=gl.SliceLayout(0, GATHER))
    rows = gl.maximum(slot, 0).to(gl.int64) * stride_kvn
    ptrs = kv_ptr + rows[:, None] + offs_c[None, :]
    # Rows start 16-byte aligned (checked on the host): 16-byte cp.async per lane.
    ptrs = gl.max_contiguous(gl.multiple_of(ptrs, [16, 16]), [1, 8])
    cp.async_copy_global_to_shared(dst, ptrs, mask=(slot >= 0)[:, None], cache_modifier=".cg")


@gluon.jit
def _copy_q(dst, q_ptr, pid_r, offs_h, offs_c, stride_qr, stride_qh, num_heads):
    """cp.async Q rows ``offs_h`` of token ``pid_r`` into ``dst`` ([rows, 512]) in two halves of
    256 columns; rows past num_heads are zero-filled."""
    for half in gl.static_range(2):
        q_ptrs = (
            q_ptr + pid_r * stride_qr + offs_h[:, None] * stride_qh + half * HALF + offs_c[None, :]
        )
        q_ptrs = gl.max_contiguous(gl.multiple_of(q_ptrs, [16, 16]), [1, 8])
        cp.async_copy_global_to_shared(
            dst.slice(half * HALF, HALF, dim=1),
            q_ptrs,
            mask=(offs_h < num_heads)[:, None],
            cache_modifier=".cg",
        )


@gluon.jit
def _prefetch_ids(idx_ptr, nnz):
    """Ask L2 for this program's share of kv_indices (a small call: a few hundred lines a
    program at most): an item's slot ids can load only once its CSR range (kv_indptr) is back,
    and this makes their round trip an L2 hit."""
    nprog = gl.num_programs(0)
    span = (nnz + nprog - 1) // nprog  # ids in each program's share
    offs = gl.program_id(0) * span + gl.arange(0, 256, layout=PF) * PF_IDS
    offs = gl.minimum(offs, nnz - 1).to(gl.int64)  # every address in bounds
    addr = (idx_ptr + offs).to(gl.int64, bitcast=True)
    gl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\n mov.b32 $0, 0;", "=r,l", [addr], dtype=gl.int32,
        is_pure=False, pack=1,
    )  # fmt: skip


@gluon.jit
def _bulk_prefetch_rows(kv_ptr, slot, ok, stride_kvn):
    """One 1 KiB bulk prefetch into L2 of pool row ``slot`` where ``ok`` (a row's bytes at D =
    512, 16-bit), one a lane."""
    addr = (kv_ptr + gl.where(ok, slot, 0) * stride_kvn).to(gl.int64, bitcast=True)
    gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0;\n"
        " @p cp.async.bulk.prefetch.L2.global [$1], 1024;\n mov.b32 $0, 0; }",
        "=r,l,r", [addr, ok.to(gl.int32)], dtype=gl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@gluon.jit
def _prefetch_rows(kv_ptr, idx_ptr, pos0, hi, num_kv, stride_kvn):
    """Ask L2 for the KV rows of the pair of tiles at CSR positions pos0 .. pos0 + 127 (past the
    list, absent or out-of-range ids: nothing), one 1 KiB bulk prefetch a row, a row a lane:
    their gathers, a pair later, then find them in L2 rather than wait on DRAM for each 16-byte
    piece (FlashMLA's gather asks L2 for 256-byte blocks, which Triton 3.6 cannot say)."""
    offs = pos0 + gl.arange(0, 2 * BLOCK_K, layout=LANE)
    in_list = offs < hi
    slot = gl.load(idx_ptr + offs, mask=in_list, other=-1).to(gl.int64)
    ok = in_list & (slot >= 0) & (slot < num_kv)
    _bulk_prefetch_rows(kv_ptr, slot, ok, stride_kvn)


# A small call's share of kv_indices a program at most for :func:`_prefetch_call_rows`: one id
# a lane of a consumer's 128, so at most 128 x SMs rows (16 MiB) asked of L2 a call.
CALL_ROWS = gl.constexpr(128)


@gluon.jit
def _prefetch_call_rows(kv_ptr, idx_ptr, nnz, num_kv, stride_kvn):
    """Ask L2 for the KV rows of this program's share of kv_indices (a small call whose shares
    are at most CALL_ROWS ids; else nothing), one 1 KiB bulk prefetch a row: together the
    programs ask for every row the call gathers at its start, so an item's gathers, issued
    only once its range and ids are back, find them in L2 or on their way. Run by consumer 1,
    idle until Q lands, off the producer's chain of loads."""
    nprog = gl.num_programs(0)
    span = (nnz + nprog - 1) // nprog
    if span <= CALL_ROWS:
        k = gl.arange(0, CALL_ROWS, layout=LANE)
        offs = gl.program_id(0).to(gl.int64) * span + k
        ok = (k < span) & (offs < nnz)
        slot = gl.load(idx_ptr + offs, mask=ok, other=-1).to(gl.int64)
        ok = ok & (slot >= 0) & (slot < num_kv)
        _bulk_prefetch_rows(kv_ptr, slot, ok, stride_kvn)


@gluon.jit
def _load_q(q_desc, q_smem, bars, it, pid_r, pid_h):
    """Q [64, 512] of head block ``pid_h`` of token ``pid_r`` (rows past num_heads zero-filled
    by the descriptor), once both consumers are past their last QK^T of the previous item: by
    TMA (eight bulk copies) rather than 32 16-byte cp.async per lane, which cost 1.5-2.6 us of
    an item's latency at T = 64 (data/bench/ws_lat_h200.log, ablation abl_noq)."""
    mbarrier.wait(_bar(bars, Q_FREE), (it & 1) ^ 1)
    mbarrier.expect(_bar(bars, Q_READY), BLOCK_H * HEAD_DIM * q_desc.dtype.primitive_bitwidth // 8)
    tma.async_copy_global_to_shared(
        q_desc, [pid_r.to(gl.int32), pid_h * BLOCK_H, 0], _bar(bars, Q_READY),
        q_smem.index(0).reshape([1, BLOCK_H, HEAD_DIM]),
    )  # fmt: skip


@gluon.jit
def _begin_item(
    item, it, num_hb, q_desc, q_smem, bars, indptr_ptr, nnz, num_heads, BLOCK_H: gl.constexpr,
    ids_per_row, SMALL: gl.constexpr, DENSE_IDS: gl.constexpr, NUM_SPLITS: gl.constexpr = 1,
):  # fmt: skip
    """Item ``item`` (the producer's ``it``-th): its slot range [lo, hi) and tile count
    (:func:`_item_range`), with its Q sent by TMA. A small call sends the first item's Q before
    the range's loads (nothing to wait for), the others' after them, as a large call does (the
    range's loads first: in flight while the consumers finish the previous item)."""
    if SMALL:
        if it == 0:
            group = item // NUM_SPLITS
            _load_q(q_desc, q_smem, bars, it, (group // num_hb).to(gl.int64), group % num_hb)
        pid_r, pid_h, lo, hi, num_tiles = _item_range(
            item, indptr_ptr, nnz, num_heads, BLOCK_H, ids_per_row, DENSE_IDS, NUM_SPLITS
        )
        if it > 0:
            _load_q(q_desc, q_smem, bars, it, pid_r, pid_h)
    else:
        pid_r, pid_h, lo, hi, num_tiles = _item_range(
            item, indptr_ptr, nnz, num_heads, BLOCK_H, ids_per_row, DENSE_IDS, NUM_SPLITS
        )
        _load_q(q_desc, q_smem, bars, it, pid_r, pid_h)
    return lo, hi, num_tiles


@gluon.jit
def _producer(
    q_desc, kv_ptr, idx_ptr, indptr_ptr, sink_ptr, out,
    stride_qr, stride_qh, stride_kvn, num_heads, num_kv, nnz, qk_scale,
    num_items, ids_per_row, q_smem, kv_smem, p0_smem, p1_smem, m0_smem, m1_smem, l_smem, bars,
    tile_ids, SMALL: gl.constexpr, DENSE_IDS: gl.constexpr, POS_SCALE: gl.constexpr = False,
    PUBLISHED: gl.constexpr = True, NUM_SPLITS: gl.constexpr = 1, opart_ptr=None,
    lsepart_ptr=None, L2_ROWS: gl.constexpr = False,
):  # fmt: skip
    if SMALL:
        _prefetch_ids(idx_ptr, nnz)
    num_hb = (num_heads + BLOCK_H - 1) // BLOCK_H
    g0 = 0  # pairs of tiles gathered so far, over all items: the barriers' phase
    it = 0  # items so far
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        lo, hi, num_tiles = _begin_item(
            item, it, num_hb, q_desc, q_smem, bars, indptr_ptr, nnz, num_heads, BLOCK_H,
            ids_per_row, SMALL, DENSE_IDS, NUM_SPLITS,
        )  # fmt: skip

        num_pairs = (num_tiles + 1) // 2
        for j in range(num_pairs):
            ph = ((g0 + j) & 1) ^ 1  # a fresh barrier's "previous phase" counts as complete
            # Both tiles' ids first: their load latency hides behind the wait for a buffer.
            slot0 = _slots(idx_ptr, lo + (2 * j) * BLOCK_K, hi, num_kv)
            slot1 = _slots(idx_ptr, lo + (2 * j + 1) * BLOCK_K, hi, num_kv)
            if L2_ROWS:  # the next pair's rows into L2 while this one waits for its buffers
                _prefetch_rows(kv_ptr, idx_ptr, lo + (2 * j + 2) * BLOCK_K, hi, num_kv, stride_kvn)
            # In the order the consumers release them: 0L (consumer 0's own PV), 1R (consumer
            # 1's own PV), 0R (consumer 1's PV with P0), 1L (consumer 0's PV with P1).
            # A tile's first half also publishes its slot ids (-1: absent) for its consumer's
            # mask (:func:`_tile_valid`), behind the half's copies (issued first), released by
            # one more arrival on that ready barrier.
            mbarrier.wait(_bar(bars, FREE_0L), ph)
            _gather_half(kv_smem.index(0).slice(0, HALF, dim=1), kv_ptr, slot0, stride_kvn, 0)
            tile_ids[0].store(slot0)
            cp.mbarrier_arrive(_bar(bars, READY_0L), increment_count=False)
            _arrive(_bar(bars, READY_0L))
            mbarrier.wait(_bar(bars, FREE_1R), ph)
            _gather_half(kv_smem.index(1).slice(HALF, HALF, dim=1), kv_ptr, slot1, stride_kvn, HALF)
            tile_ids[1].store(slot1)
            cp.mbarrier_arrive(_bar(bars, READY_1R), increment_count=False)
            _arrive(_bar(bars, READY_1R))
            mbarrier.wait(_bar(bars, FREE_0R), ph)
            _gather_half(kv_smem.index(0).slice(HALF, HALF, dim=1), kv_ptr, slot0, stride_kvn, HALF)
            cp.mbarrier_arrive(_bar(bars, READY_0R), increment_count=False)
            mbarrier.wait(_bar(bars, FREE_1L), ph)
            _gather_half(kv_smem.index(1).slice(0, HALF, dim=1), kv_ptr, slot1, stride_kvn, 0)
            cp.mbarrier_arrive(_bar(bars, READY_1L), increment_count=False)
        g0 += num_pairs
        it += 1  # noqa: SIM113 (Gluon loops have no enumerate)
    # No copy may still be in flight when the program ends.
    cp.commit_group()
    cp.wait_group(0)


@gluon.jit
def _tile_valid(
    ids_smem, idx_ptr, pos0, hi, num_kv, PUBLISHED: gl.constexpr, N: gl.constexpr = BLOCK_K,
    MMA: gl.constexpr = MMA_S,
):  # fmt: skip
    """[N] per-slot validity of the tile at CSR position ``pos0`` (in a buffer whose ids are
    ``ids_smem``), in the column layout of an S tile ``MMA`` (the full tile's, or a short last
    tile's first N slots). ``PUBLISHED``: from the slot ids its producer published with the
    tile (-1: absent), read after the tile's first ready wait and before its first free
    arrival (the producer writes the next tile's after that free wait): 8 shared loads and 16
    compares a thread. Otherwise from kv_indices (:mod:`hopper_ws_fp8`, whose producer has no
    registers to spare for the stores): 16 global loads and ~150 instructions of 64-bit
    address arithmetic and compares."""
    if PUBLISHED:
        if N < BLOCK_K:
            ids_smem = ids_smem.slice(0, N)
        valid = ids_smem.load(gl.SliceLayout(0, MMA)) >= 0
    else:
        offs = pos0 + gl.arange(0, N, layout=gl.SliceLayout(0, MMA))
        in_list = offs < hi
        slot = gl.load(idx_ptr + offs, mask=in_list, other=-1).to(gl.int64)
        valid = in_list & (slot >= 0) & (slot < num_kv)
    return valid


@gluon.jit
def _qk_half(q_tile, kv_tile, bars, half: gl.constexpr, ready0: gl.constexpr, ph, s, use_acc):
    """Issue S (+)= Q[:, half] K[:, half]^T once that half of the tile has landed (async)."""
    mbarrier.wait(_bar(bars, ready0 + half), ph)
    fence_async_shared()  # the cp.async writes (generic proxy) before wgmma's reads (async proxy)
    return warpgroup_mma(
        q_tile.slice(half * HALF, HALF, dim=1),
        kv_tile.slice(half * HALF, HALF, dim=1).permute((1, 0)),
        s,
        use_acc=use_acc,
        is_async=True,
    )


@gluon.jit
def _qk(
    q_tile, kv_tile, bars, first_half: gl.constexpr, ready0: gl.constexpr, ph,
    N: gl.constexpr = BLOCK_K, MMA: gl.constexpr = MMA_S, WAIT: gl.constexpr = True,
):  # fmt: skip
    """S = Q K^T of one tile: the half ``first_half`` of D as soon as it lands, then the other.
    ``N`` < BLOCK_K: the tile's first N slots only (a short last tile: [64, TAIL], MMA_T).
    ``WAIT=False``: S still in flight (the caller's ``warpgroup_mma_wait(0, deps=[s])``)."""
    if N < BLOCK_K:
        kv_tile = kv_tile.slice(0, N, dim=0)
    s = gl.zeros([BLOCK_H, N], gl.float32, layout=MMA)
    s = _qk_half(q_tile, kv_tile, bars, first_half, ready0, ph, s, False)
    s = _qk_half(q_tile, kv_tile, bars, 1 - first_half, ready0, ph, s, True)
    if WAIT:
        s = warpgroup_mma_wait(0, deps=[s])
    return s


@gluon.jit
def _short_tail(lo, hi, num_pairs):
    """Whether the odd tile of the item's last pair holds at most TAIL slots (none when the
    even tile is the item's last)."""
    return hi - lo - (2 * num_pairs - 1) * BLOCK_K <= TAIL


@gluon.jit
def _opaque_zero(j):
    """0, computed from the loop counter so that the compiler cannot hoist what depends on it.

    The shared-memory buffers of a consumer are the same every iteration, so LLVM hoists all
    64 wgmma descriptors of a pair (64-bit each) out of the loop, and ptxas spills them.
    Indexing the buffers by this zero keeps each descriptor next to its wgmma."""
    return gl.inline_asm_elementwise(
        "and.b32 $0, $1, 0;", "=r,r", [j], dtype=gl.int32, is_pure=True, pack=1
    )


@gluon.jit
def _bar(bars, i: gl.constexpr):
    """mbarrier ``i`` (READY + k, FREE + k, Q_READY or Q_FREE) of :func:`_shared_state`'s
    ``bars``, a tuple of one allocation per role."""
    if i < FREE:
        b = bars[0].index(i - READY)
    elif i < Q_READY:
        b = bars[1].index(i - FREE)
    elif i == Q_READY:
        b = bars[2].index(0)
    else:
        b = bars[3].index(0)
    return b


@gluon.jit
def _arrive(bar):
    """One arrival for the whole warpgroup, after all its lanes' shared-memory writes."""
    gl.thread_barrier()
    mbarrier.arrive(bar)


@gluon.jit
def _named_barrier(asm: gl.constexpr, bar_id: gl.constexpr):
    """``asm`` (a ``bar`` instruction on barrier ``$1`` for 256 threads: both consumers) once
    per thread of this warpgroup. A thread's earlier memory accesses are performed for the
    threads that pass the barrier (PTX barrier semantics); not pure, so kept in order."""
    ids = gl.full([128], bar_id, gl.int32, layout=LANE)
    gl.inline_asm_elementwise(asm, "=r,r", [ids], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _bar_arrive(bar_id: gl.constexpr):
    """Arrive on named barrier ``bar_id`` without waiting."""
    _named_barrier("bar.arrive $1, 256;\n mov.b32 $0, 0;", bar_id)


@gluon.jit
def _bar_sync(bar_id: gl.constexpr):
    """Arrive on named barrier ``bar_id`` and wait until all 256 threads have arrived."""
    _named_barrier("bar.sync $1, 256;\n mov.b32 $0, 0;", bar_id)


@gluon.jit
def _epilogue(
    acc, m_i, l_i, l_mine, l_other, col0, pid_r, pid_h, sink, out, stage, num_heads,
    pid_s=0, opart_ptr=None, lsepart_ptr=None, NUM_SPLITS: gl.constexpr = 1,
    OUT_DIRECT: gl.constexpr = False, stride_or=0, stride_oh=0,
):  # fmt: skip
    """Add the two partial sums, fold in the sink (``sink``: its logits, :func:`_load_sink`,
    loaded at the item's start so that no global load sits on this stretch; PERF_NOTES "No
    cliffs" step 27), normalise and write this O half through ``stage`` into ``out``: its
    pointer, with ``OUT_DIRECT`` (row strides ``stride_or`` / ``stride_oh``, rows 16-byte
    aligned: :func:`_st_block`), else its TMA descriptor (:func:`_tma_block`). The sums'
    slots alternate by item: a consumer writes an item's slot only after the barrier of the
    item before, which the other passes only after reading the slot two items back.
    ``NUM_SPLITS`` > 1: the split's partial instead (:func:`_partial`)."""
    l_mine.store(l_i)
    _bar_sync(NB_L)
    l_tot = l_i + l_other.load(ROW_S)
    if NUM_SPLITS > 1:
        _partial(acc, m_i, l_tot, col0, pid_r * NUM_SPLITS + pid_s, pid_h, opart_ptr,
                 lsepart_ptr, num_heads)  # fmt: skip
    else:
        den = l_tot + gl.exp2(sink - m_i)
        # A head with no valid slot gets zeros, whatever its sink.
        inv = gl.where(l_tot > 0.0, 1.0 / den, 0.0)
        o = (acc * gl.convert_layout(inv, ROW_O)[:, None]).to(stage.dtype)
        # Four [64, 64] column blocks (reshapes and splits of the registers, no data
        # movement), each through ``stage`` (this consumer's P buffer, which the other
        # consumer has finished reading: it passed NB_L after its last PV). Rows past
        # num_heads are masked (OUT_DIRECT) or clipped by the descriptor's shape.
        lo_half, hi_half = o.reshape([BLOCK_H, 2, HALF // 2]).permute((0, 2, 1)).split()
        c0, c1 = lo_half.reshape([BLOCK_H, 2, HALF // 4]).permute((0, 2, 1)).split()
        c2, c3 = hi_half.reshape([BLOCK_H, 2, HALF // 4]).permute((0, 2, 1)).split()
        h0 = pid_h * BLOCK_H
        if OUT_DIRECT:
            base = out + pid_r * stride_or
            _st_block(c0, stage, base, h0, col0, stride_oh, num_heads)
            _st_block(c1, stage, base, h0, col0 + OUT_BLOCK, stride_oh, num_heads)
            _st_block(c2, stage, base, h0, col0 + 2 * OUT_BLOCK, stride_oh, num_heads)
            _st_block(c3, stage, base, h0, col0 + 3 * OUT_BLOCK, stride_oh, num_heads)
        else:
            row = pid_r.to(gl.int32)
            _tma_block(c0, stage, out, row, h0, col0)
            _tma_block(c1, stage, out, row, h0, col0 + OUT_BLOCK)
            _tma_block(c2, stage, out, row, h0, col0 + 2 * OUT_BLOCK)
            _tma_block(c3, stage, out, row, h0, col0 + 3 * OUT_BLOCK)
            tma.store_wait(0)  # the P buffer is written again in the next item


@gluon.jit
def _partial(acc, m_i, l_tot, col0, part, pid_h, opart_ptr, lsepart_ptr, num_heads):
    """A split's partial, as the shared algorithm stores it for ``_mla_reduce_kernel``: this
    O half normalised by the split's own sum (no sink: the reduce folds it in once) into
    opart [R, NUM_SPLITS, H, 512] fp32 at row ``part`` (token x NUM_SPLITS + split), and
    (consumer 0) the base-2 log-sum-exp m + log2(l) of each head into lsepart [R, NUM_SPLITS,
    H] (-inf for a head with no valid slot, whose O is 0). Straight from the accumulator's
    registers: each thread's column pairs fill whole 32-byte sectors."""
    inv = gl.where(l_tot > 0.0, 1.0 / l_tot, 0.0)
    o = acc * gl.convert_layout(inv, ROW_O)[:, None]
    offs_h = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW_O)
    offs_d = col0 + gl.arange(0, HALF, layout=gl.SliceLayout(0, MMA_O))
    rows = part.to(gl.int64) * num_heads + offs_h
    gl.store(opart_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], o,
             mask=(offs_h < num_heads)[:, None])  # fmt: skip
    if col0 == 0:
        offs_l = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW_S)
        lse2 = gl.where(l_tot > 0.0, m_i + gl.log2(gl.maximum(l_tot, 1e-30)), float("-inf"))
        gl.store(lsepart_ptr + part.to(gl.int64) * num_heads + offs_l, lse2,
                 mask=offs_l < num_heads)  # fmt: skip


@gluon.jit
def _st_block(c, stage, base, h0, col, stride_oh, num_heads):
    """Store the [64, 64] block ``c`` to out[row, h0:h0 + 64, col:col + 64] (``base``: out's
    row ``row``) through ``stage``: the registers into it, then back in a layout of 16
    contiguous bytes a lane (ST_OUT: a warp writes four 128-byte rows an instruction) and out
    by the lanes' own stores, fire and forget (no TMA engine, no wait for its read of the stage
    before the next block: the warpgroup barrier after the loads is the stage's only guard)."""
    stage.store(c)
    gl.thread_barrier()
    v = stage.load(ST_OUT)
    offs_h = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ST_OUT))
    offs_c = col + gl.arange(0, OUT_BLOCK, layout=gl.SliceLayout(0, ST_OUT))
    ptrs = base + offs_h[:, None].to(gl.int64) * stride_oh + offs_c[None, :]
    ptrs = gl.max_contiguous(gl.multiple_of(ptrs, [16, 16]), [1, 8])  # rows aligned: OUT_ALIGNED
    gl.store(ptrs, v, mask=(offs_h < num_heads)[:, None])
    gl.thread_barrier()  # every lane has read the stage before the next block is written


@gluon.jit
def _tma_block(c, stage, out_desc, row, h0, col):
    """Store the [64, 64] block ``c`` to out[row, h0:h0 + 64, col:col + 64] through ``stage``.
    The issuing lane's wait for the stage's previous block is followed by a warpgroup barrier
    (the compiler's, for the write after the TMA read) before any lane writes it again."""
    tma.store_wait(0)
    stage.store(c)
    fence_async_shared()  # the generic-proxy writes before the TMA engine (async proxy) reads
    gl.thread_barrier()
    tma.async_copy_shared_to_global(
        out_desc, [row, h0, col], stage.reshape([1, BLOCK_H, OUT_BLOCK])
    )


@gluon.jit
def _load_sink(sink_ptr, pid_h, num_heads):
    """The sink logits of head block ``pid_h`` in log2 units: a virtual column with logit
    sink_h and a zero value vector (-inf: no sink)."""
    offs_h = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW_S)
    return gl.load(sink_ptr + offs_h, mask=offs_h < num_heads, other=float("-inf")) * LOG2E


@gluon.jit
def _masked_max(s, valid, qk_scale, POS_SCALE: gl.constexpr):
    """(the tile for :func:`_exp_tile`, its row maxima of the scaled logits, log2 units), the
    slots not in ``valid`` at -inf. With ``POS_SCALE`` (qk_scale > 0, the host's knowledge)
    the max is taken over the raw S and scaled once a row (max(s) x c = max(s x c) for c > 0),
    and the tile stays unscaled: its scale goes into the exponent's one FFMA a logit, 32
    FMULs a thread a tile fewer between the S and the row-max meeting. Otherwise (a scale of
    0 or below: -inf x c is not -inf) the tile is scaled first, as before."""
    if POS_SCALE:
        s = gl.where(valid[None, :], s, float("-inf"))
        r = gl.max(s, 1) * qk_scale
    else:
        s = gl.where(valid[None, :], s * qk_scale, float("-inf"))
        r = gl.max(s, 1)
    return s, r


@gluon.jit
def _exp_tile(s, m, qk_scale, POS_SCALE: gl.constexpr):
    """2^(s x c - m) of :func:`_masked_max`'s tile (already s x c without ``POS_SCALE``), m the
    rows' new running maxima in the tile's row layout."""
    if POS_SCALE:  # noqa: SIM108 (a constexpr branch: one side is compiled)
        p = gl.exp2(s * qk_scale - m[:, None])
    else:
        p = gl.exp2(s - m[:, None])
    return p


# A row's running max moves only when a pair's logits pass it by more than RESCALE_SLACK (log2
# units): below that the stale max stays, P = 2^(s c - m) <= 2^RESCALE_SLACK (well inside
# bf16's range and the fp32 sums'), and the row's O and l need no rescale (alpha = 2^0 = 1
# exactly). Both consumers decide from the same m_i and row maxima, so their O halves stay in
# one base.
RESCALE_SLACK = gl.constexpr(8.0)


@gluon.jit
def _new_max(m_i, r_own, r_other):
    """(the rows' running max after a pair, 2^(m_i - it)) from the pair's two row maxima."""
    m_cand = gl.maximum(m_i, gl.maximum(r_own, r_other))
    m_new = gl.where(m_cand > m_i + RESCALE_SLACK, m_cand, m_i)
    return m_new, gl.exp2(m_i - m_new)


# _rescale_o's two pieces of PTX. A warp holds 16 rows of O (two a thread), so whether any
# of them moved is a warp vote, and a warp whose rows all kept their max skips its 128
# multiplies a thread (a branch uniform over the warp; the wgmma after it reconverges).
_VOTE_ASM = gl.constexpr(
    "{ .reg .pred p, q; setp.ne.f32 p, $2, 0f3F800000; setp.ne.or.f32 p, $3, 0f3F800000, p;"
    " vote.sync.any.pred q, p, 0xffffffff; selp.b32 $0, 1, 0, q; mov.b32 $1, $0; }"
)


@constexpr_function
def _rescale_asm(n):
    """PTX for :func:`_rescale_o` over a thread's ``n`` O elements: outputs $0..$n-1, the
    elements $n..$2n-1, the warp's flag by element $2n..$3n-1 (the same in each: $2n is
    read), the alphas $3n..$4n-1."""
    mul = " ".join(f"mul.f32 ${i}, ${n + i}, ${3 * n + i};" for i in range(n))
    mov = " ".join(f"mov.b32 ${i}, ${n + i};" for i in range(n))
    return (
        "{ .reg .pred p; setp.ne.s32 p, $"
        + str(2 * n)
        + ", 0; @p bra RS${:uid}; "
        + mov
        + " bra DN${:uid}; RS${:uid}: "
        + mul
        + " DN${:uid}: }"
    )


O_PER_THREAD = gl.constexpr(BLOCK_H.value * HALF.value // 128)  # 128 fp32 a thread


@constexpr_function
def _rescale_constraints(n):
    """Constraints of :func:`_rescale_asm`'s operands."""
    return ",".join(["=f"] * n + ["f"] * n + ["r"] * n + ["f"] * n)


@gluon.jit
def _rescale_o(acc, alpha):
    """acc x alpha by rows (``alpha`` in ROW_S), skipped by every warp none of whose 16 rows
    has alpha != 1 (:data:`RESCALE_SLACK`)."""
    a = gl.convert_layout(alpha, ROW_O)
    flag = gl.inline_asm_elementwise(
        _VOTE_ASM, "=r,=r,f,f", [a], dtype=gl.int32, is_pure=True, pack=2
    )
    return gl.inline_asm_elementwise(
        _rescale_asm(O_PER_THREAD), _rescale_constraints(O_PER_THREAD),
        [acc, flag[:, None], a[:, None]], dtype=gl.float32, is_pure=True, pack=O_PER_THREAD,
    )  # fmt: skip


@gluon.jit
def _consumer_item(
    item, indptr_ptr, sink_ptr, nnz, num_heads, ids_per_row, DENSE_IDS: gl.constexpr,
    NUM_SPLITS: gl.constexpr = 1,
):  # fmt: skip
    """A consumer's start of a work item: its range, pairs of tiles, fresh softmax state and
    the head block's sink logits (loaded now, in flight while Q and the tiles land, for the
    epilogue; PERF_NOTES "No cliffs" step 27)."""
    pid_r, pid_h, lo, hi, num_tiles = _item_range(
        item, indptr_ptr, nnz, num_heads, BLOCK_H, ids_per_row, DENSE_IDS, NUM_SPLITS
    )
    sink = _load_sink(sink_ptr, pid_h, num_heads)
    m_i = gl.full([BLOCK_H], M_INIT, gl.float32, layout=ROW_S)
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=ROW_S)
    acc = gl.zeros([BLOCK_H, HALF], gl.float32, layout=MMA_O)
    return pid_r, pid_h, lo, hi, (num_tiles + 1) // 2, m_i, l_i, acc, sink


@gluon.jit
def _consumer0(
    q_desc, kv_ptr, idx_ptr, indptr_ptr, sink_ptr, out,
    stride_qr, stride_qh, stride_kvn, num_heads, num_kv, nnz, qk_scale,
    num_items, ids_per_row, q_smem, kv_smem, p0_smem, p1_smem, m0_smem, m1_smem, l_smem, bars,
    tile_ids, SMALL: gl.constexpr, DENSE_IDS: gl.constexpr, POS_SCALE: gl.constexpr = False,
    PUBLISHED: gl.constexpr = True, NUM_SPLITS: gl.constexpr = 1, opart_ptr=None,
    lsepart_ptr=None, OUT_DIRECT: gl.constexpr = False, stride_or=0, stride_oh=0,
):  # fmt: skip
    """Even tiles' S, O[:, 0:256]; issues the next pair's S behind its last PV of a pair.
    ``out``: out's TMA descriptor, or with ``OUT_DIRECT`` its pointer (strides ``stride_or``,
    ``stride_oh``; :func:`_epilogue`)."""
    dtype: gl.constexpr = q_desc.dtype
    g0 = 0
    it = 0
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        pid_r, pid_h, lo, hi, num_pairs, m_i, l_i, acc, sink = _consumer_item(
            item, indptr_ptr, sink_ptr, nnz, num_heads, ids_per_row, DENSE_IDS, NUM_SPLITS
        )
        mbarrier.wait(_bar(bars, Q_READY), it & 1)
        # S of the first pair's tile; each iteration issues the next one's behind its last PV.
        s = gl.zeros([BLOCK_H, BLOCK_K], gl.float32, layout=MMA_S)
        valid = gl.zeros([BLOCK_K], gl.int32, layout=gl.SliceLayout(0, MMA_S)) == 0
        if num_pairs > 0:
            zi = _opaque_zero(item)
            s = _qk(q_smem.index(zi), kv_smem.index(zi), bars, 0, READY_0L, g0 & 1, WAIT=False)
            valid = _tile_valid(tile_ids[0], idx_ptr, lo, hi, num_kv, PUBLISHED)  # under the S
            s = warpgroup_mma_wait(0, deps=[s])
        if num_pairs <= 1:
            _arrive(_bar(bars, Q_FREE))  # done with this item's Q
        for j in range(num_pairs):
            ph = (g0 + j) & 1
            z = _opaque_zero(j)
            buf0 = kv_smem.index(z)
            buf1 = kv_smem.index(z + 1)
            s, r0 = _masked_max(s, valid, qk_scale, POS_SCALE)
            m0_smem.store(r0)
            _bar_sync(NB_MAX)  # both row maxima published
            m_new, alpha = _new_max(m_i, r0, m1_smem.load(ROW_S))
            p = _exp_tile(s, m_new, qk_scale, POS_SCALE)
            l_i = l_i * alpha + gl.sum(p, 1)
            m_i = m_new
            acc = _rescale_o(acc, alpha)
            p16 = p.to(dtype)
            p_op = gl.convert_layout(p16, DOT_P)
            acc = warpgroup_mma(p_op, buf0.slice(0, HALF, dim=1), acc, is_async=True)
            p0_smem.index(z).store(p16)
            fence_async_shared()
            _bar_arrive(NB_P0)
            acc, p_op = warpgroup_mma_wait(0, deps=[acc, p_op])
            _arrive(_bar(bars, FREE_0L))

            _bar_sync(NB_P1)
            pv = warpgroup_mma(p1_smem.index(z), buf1.slice(0, HALF, dim=1), acc, is_async=True)
            if j + 1 < num_pairs:
                # The next pair's S: its left half is back (consumer 0 freed it first) while
                # this PV runs; the right half follows once consumer 1 is done with it.
                q_tile = q_smem.index(z)
                s = gl.zeros([BLOCK_H, BLOCK_K], gl.float32, layout=MMA_S)
                s = _qk_half(q_tile, buf0, bars, 0, READY_0L, ph ^ 1, s, False)
                valid = _tile_valid(  # its ids landed with that half (PUBLISHED)
                    tile_ids[0], idx_ptr, lo + (2 * j + 2) * BLOCK_K, hi, num_kv, PUBLISHED
                )
                acc = warpgroup_mma_wait(1, deps=[pv])  # the PV (issued first) is done
                _arrive(_bar(bars, FREE_1L))
                s = _qk_half(q_tile, buf0, bars, 1, READY_0L, ph ^ 1, s, True)
                s = warpgroup_mma_wait(0, deps=[s])
                if j + 2 == num_pairs:
                    _arrive(_bar(bars, Q_FREE))
            else:
                acc = warpgroup_mma_wait(0, deps=[pv])
                _arrive(_bar(bars, FREE_1L))
        g0 += num_pairs
        _epilogue(
            acc, m_i, l_i, l_smem.index(2 * (it & 1)), l_smem.index(1 + 2 * (it & 1)), 0,
            pid_r, pid_h, sink, out, p0_smem.index(0), num_heads,
            item % NUM_SPLITS, opart_ptr, lsepart_ptr, NUM_SPLITS, OUT_DIRECT, stride_or,
            stride_oh,
        )  # fmt: skip
        it += 1  # noqa: SIM113 (Gluon loops have no enumerate)


@gluon.jit
def _consumer1(
    q_desc, kv_ptr, idx_ptr, indptr_ptr, sink_ptr, out,
    stride_qr, stride_qh, stride_kvn, num_heads, num_kv, nnz, qk_scale,
    num_items, ids_per_row, q_smem, kv_smem, p0_smem, p1_smem, m0_smem, m1_smem, l_smem, bars,
    tile_ids, SMALL: gl.constexpr, DENSE_IDS: gl.constexpr, POS_SCALE: gl.constexpr = False,
    PUBLISHED: gl.constexpr = True, NUM_SPLITS: gl.constexpr = 1, opart_ptr=None,
    lsepart_ptr=None, ROWS_AHEAD: gl.constexpr = False, OUT_DIRECT: gl.constexpr = False,
    stride_or=0, stride_oh=0,
):  # fmt: skip
    """Odd tiles' S, O[:, 256:512]; ``out`` as :func:`_consumer0`'s. ``ROWS_AHEAD`` (``kv_ptr``
    a [N, 512] 16-bit pool, not an FP8 cache's bytes): a small call's rows asked of L2 at its
    start (:func:`_prefetch_call_rows`)."""
    dtype: gl.constexpr = q_desc.dtype
    g0 = 0
    it = 0
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        pid_r, pid_h, lo, hi, num_pairs, m_i, l_i, acc, sink = _consumer_item(
            item, indptr_ptr, sink_ptr, nnz, num_heads, ids_per_row, DENSE_IDS, NUM_SPLITS
        )
        if SMALL:  # noqa: SIM102 (constexpr branches around a runtime one)
            if ROWS_AHEAD:  # noqa: SIM102
                if it == 0:  # the call's rows into L2 while this program's first Q lands
                    _prefetch_call_rows(kv_ptr, idx_ptr, nnz, num_kv, stride_kvn)
        mbarrier.wait(_bar(bars, Q_READY), it & 1)
        if num_pairs == 0:
            _arrive(_bar(bars, Q_FREE))
        short = _short_tail(lo, hi, num_pairs)
        for j in range(num_pairs):
            ph = (g0 + j) & 1
            z = _opaque_zero(j)
            buf0 = kv_smem.index(z)
            buf1 = kv_smem.index(z + 1)
            q_tile = q_smem.index(z)
            pos = lo + (2 * j + 1) * BLOCK_K
            if short and j + 1 == num_pairs:  # a short last tile: S and P over TAIL slots
                # S issued first: the mask's loads and compares run while it is in flight
                s_t = _qk(q_tile, buf1, bars, 1, READY_1L, ph, TAIL, MMA_T, False)
                valid_t = _tile_valid(tile_ids[1], idx_ptr, pos, hi, num_kv, PUBLISHED, TAIL, MMA_T)
                s_t = warpgroup_mma_wait(0, deps=[s_t])
                _arrive(_bar(bars, Q_FREE))  # done with this item's Q
                acc, m_i, l_i = _consumer1_pv(
                    s_t, valid_t, m_i, l_i, acc, qk_scale, buf0, buf1, p0_smem.index(z),
                    p1_smem.index(z), m0_smem, m1_smem, bars, dtype, ROW_T, True, POS_SCALE,
                )  # fmt: skip
            else:
                s = _qk(q_tile, buf1, bars, 1, READY_1L, ph, WAIT=False)
                valid = _tile_valid(tile_ids[1], idx_ptr, pos, hi, num_kv, PUBLISHED)
                s = warpgroup_mma_wait(0, deps=[s])
                if j + 1 == num_pairs:
                    _arrive(_bar(bars, Q_FREE))  # done with this item's Q
                acc, m_i, l_i = _consumer1_pv(
                    s, valid, m_i, l_i, acc, qk_scale, buf0, buf1, p0_smem.index(z),
                    p1_smem.index(z), m0_smem, m1_smem, bars, dtype, ROW_S, False, POS_SCALE,
                )  # fmt: skip
        g0 += num_pairs
        _epilogue(
            acc, m_i, l_i, l_smem.index(1 + 2 * (it & 1)), l_smem.index(2 * (it & 1)),
            HALF, pid_r, pid_h, sink, out, p1_smem.index(0), num_heads,
            item % NUM_SPLITS, opart_ptr, lsepart_ptr, NUM_SPLITS, OUT_DIRECT, stride_or,
            stride_oh,
        )  # fmt: skip
        it += 1  # noqa: SIM113 (Gluon loops have no enumerate)


@gluon.jit
def _consumer1_pv(
    s, valid, m_i, l_i, acc, qk_scale, buf0, buf1, p0, p1, m0_smem, m1_smem, bars, dtype,
    ROW: gl.constexpr, SHORT: gl.constexpr, POS_SCALE: gl.constexpr = False,
):  # fmt: skip
    """Consumer 1's softmax of its S tile ``s`` (rows in layout ``ROW``; ``SHORT``: the first
    TAIL slots of a short last tile) and both its PVs: its own P from registers into the
    O half, P published in ``p1`` ([64, 64]; a short tile's P in its first TAIL columns and
    zeros in the rest, since consumer 0's PV takes the whole buffer as ever), then consumer
    0's P0 from shared memory. Returns the new (acc, m_i, l_i); m_i and l_i stay in ROW_S."""
    s, r1 = _masked_max(s, valid, qk_scale, POS_SCALE)
    r1 = gl.convert_layout(r1, ROW_S)
    m1_smem.store(r1)
    _bar_sync(NB_MAX)  # both row maxima published
    m_new, alpha = _new_max(m_i, r1, m0_smem.load(ROW_S))
    p = _exp_tile(s, gl.convert_layout(m_new, ROW), qk_scale, POS_SCALE)
    l_i = l_i * alpha + gl.convert_layout(gl.sum(p, 1), ROW_S)
    acc = _rescale_o(acc, alpha)
    p16 = p.to(dtype)
    p_op = gl.convert_layout(p16, DOT_P)
    v1 = buf1.slice(HALF, HALF, dim=1)
    if SHORT:
        v1 = v1.slice(0, TAIL, dim=0)
    acc = warpgroup_mma(p_op, v1, acc, is_async=True)
    if SHORT:  # consumer 0's PV reads all 64 columns: zeros past the TAIL slots
        p1.slice(0, TAIL, dim=1).store(p16)
        for c in gl.static_range(1, BLOCK_K // TAIL):
            p1.slice(c * TAIL, TAIL, dim=1).store(gl.zeros_like(p16))
    else:
        p1.store(p16)
    fence_async_shared()
    _bar_arrive(NB_P1)

    _bar_sync(NB_P0)
    acc = warpgroup_mma(p0, buf0.slice(HALF, HALF, dim=1), acc, is_async=True)
    p_op = warpgroup_mma_wait(1, deps=[p_op])  # the PV with this warpgroup's P is done
    _arrive(_bar(bars, FREE_1R))
    acc = warpgroup_mma_wait(0, deps=[acc])
    _arrive(_bar(bars, FREE_0R))
    return acc, m_new, l_i


@constexpr_function
def _ready_count(i, ready_count, ids_arrival):
    """Arrivals that complete ready barrier READY + ``i``: ``ids_arrival`` more on a tile's
    first half (0L, 1R), the one that also brings the tile's slot ids."""
    first = i in (READY_0L.value - READY.value, READY_1R.value - READY.value)
    return ready_count + (ids_arrival if first else 0)


@gluon.jit
def _shared_state(dtype: gl.constexpr, READY_COUNT: gl.constexpr, IDS_ARRIVAL: gl.constexpr):
    """The kernel's shared memory and its mbarriers, initialised: (q_smem, kv_smem, p0_smem,
    p1_smem, m0_smem, m1_smem, l_smem, bars, tile_ids). ``READY_COUNT``: arrivals that
    complete a half's ``ready`` barrier (128: the producer's lanes through cp.async; 1: one
    arrival of a producer that stores the half itself, :mod:`hopper_ws_fp8`);
    ``IDS_ARRIVAL``: one more on the first half of each tile (0L, 1R), the producer's release
    of the tile's slot ids (``tile_ids``, one [64] int32 vector a buffer) when its copies
    cannot (cp.async's arrival does not order the lanes' own stores).

    Shared memory (2-byte dtype): Q 64 x 512 x 2 = 65,536 B; the two KV tiles 2 x 64 x 512 x 2
    = 131,072; P0 and P1 2 x 64 x 64 x 2 = 16,384; the row maxima and partial sums 6 x 64 x 4
    = 1,536; the tiles' slot ids 2 x 64 x 4 = 512; 10 mbarriers x 8 = 80 (``bars``: four
    allocations, READY, FREE, Q_READY, Q_FREE): 215,120 B of the 232,448 a block may have
    (227 KiB; the compiler adds its scratch and the small allocations' alignment)."""
    q_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_H, HEAD_DIM], SMEM)
    kv_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_K, HEAD_DIM], SMEM)
    # One allocation per buffer that one consumer writes and the other reads: the compiler's
    # shared-memory hazard analysis sees whole allocations, and a write to one slot of a shared
    # array followed by a read of another would cost a warpgroup barrier each.
    p0_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_H, BLOCK_K], SMEM)
    p1_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_H, BLOCK_K], SMEM)
    # Each consumer's row max of the pair (m0_smem: consumer 0's), and the epilogue's partial
    # sums (consumer 0's, consumer 1's, alternating by item parity), one [64] fp32 vector each.
    m0_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], VEC)
    m1_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], VEC)
    l_smem = gl.allocate_shared_memory(gl.float32, [4, BLOCK_H], VEC)
    # Each buffer's slot ids (the producer writes, that buffer's consumer reads): one each.
    tile_ids = (
        gl.allocate_shared_memory(gl.int32, [BLOCK_K], VEC),
        gl.allocate_shared_memory(gl.int32, [BLOCK_K], VEC),
    )
    # The mbarriers by role, one allocation each: the compiler's shared-memory hazard analysis
    # takes an mbarrier arrive for a write and a wait for a read of the whole allocation, so in
    # one array every wait behind an arrive of another slot cost the warpgroup a barrier.
    bars = (
        gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout()),  # READY + i
        gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout()),  # FREE + i
        gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout()),  # Q_READY
        gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout()),  # Q_FREE
    )
    for i in gl.static_range(4):
        mbarrier.init(_bar(bars, READY + i), count=_ready_count(i, READY_COUNT, IDS_ARRIVAL))
        mbarrier.init(_bar(bars, FREE + i), count=1)
    mbarrier.init(_bar(bars, Q_READY), count=1)  # the producer's expect; the bytes by TMA
    mbarrier.init(_bar(bars, Q_FREE), count=2)  # one arrival per consumer
    return q_smem, kv_smem, p0_smem, p1_smem, m0_smem, m1_smem, l_smem, bars, tile_ids


@gluon.jit(do_not_specialize=["nnz"])
def _prefill_ws_kernel(
    q_desc,  # TMA descriptor of q [R, H, 512]: boxes [1, BLOCK_H, Q_BLOCK], Q_SMEM
    kv_ptr,  # [N, 512]
    idx_ptr,  # [nnz] int32 | int64 (DENSE_IDS: [R, ids_per_row], contiguous)
    indptr_ptr,  # [R + 1] (unused under DENSE_IDS)
    sink_ptr,  # [H] fp32 sink logits (-inf: no sink)
    out_ptr,  # [R, H, 512], rows 16-byte aligned (OUT_ALIGNED): the consumers' own stores
    stride_qr,  # q's strides: unused (the descriptor holds them), kept for the shared launch
    stride_qh,
    stride_kvn,
    stride_or,  # out's strides (elements; multiples of 8: OUT_ALIGNED)
    stride_oh,
    num_heads,
    num_kv,
    nnz,  # kv_indices.numel(): each item's CSR range is clamped to [0, nnz]
    qk_scale,  # sm_scale * log2(e)
    num_items,  # R * cdiv(H, 64) * NUM_SPLITS work items (token, head block[, split])
    ids_per_row,  # DENSE_IDS: K of the dense [R, K] ids (CSR: 0, unused)
    opart_ptr,  # NUM_SPLITS > 1: [R, NUM_SPLITS, H, 512] fp32 partials (else unused)
    lsepart_ptr,  # NUM_SPLITS > 1: [R, NUM_SPLITS, H] fp32 base-2 LSE partials
    SMALL: gl.constexpr = False,  # small_call(nnz, programs): the small-call order
    CONSUMER_REGS: gl.constexpr = None,  # consumer 1's registers (None: CONSUMER_REGS)
    PRODUCER_REGS: gl.constexpr = None,  # the producer's registers (None: PRODUCER_REGS)
    DENSE_IDS: gl.constexpr = False,  # kv_indices is dense [R, ids_per_row]; no kv_indptr
    POS_SCALE: gl.constexpr = False,  # qk_scale > 0: the scale folds into the exponent
    NUM_SPLITS: gl.constexpr = 1,  # > 1: each list in pieces, partials for _mla_reduce_kernel
    L2_ROWS: gl.constexpr = False,  # l2_rows(NUM_SPLITS): the next pair's rows into L2
):
    """Persistent: grid (min(items, SMs),), each program takes items round-robin; 4 warps here
    (consumer 0) + 8 in the worker partitions. ``num_items``: R * cdiv(H, 64) * NUM_SPLITS."""
    q_smem, kv_smem, p0_smem, p1_smem, m0_smem, m1_smem, l_smem, bars, tile_ids = _shared_state(
        q_desc.dtype,
        128,  # READY: the producer's 128 lanes arrive, via cp.async
        1,  # and a tile's first half once more: its slot ids (_producer)
    )
    # The partitions' arguments written out in each call: a tuple assigned to a name first
    # would turn its constexprs (SMALL, ..., NUM_SPLITS) into tensors.
    gl.warp_specialize(
        [
        (_consumer0, (
            q_desc, kv_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr, stride_qr, stride_qh,
            stride_kvn, num_heads, num_kv, nnz, qk_scale, num_items, ids_per_row, q_smem,
            kv_smem, p0_smem, p1_smem, m0_smem, m1_smem, l_smem, bars, tile_ids, SMALL,
            DENSE_IDS, POS_SCALE, True, NUM_SPLITS, opart_ptr, lsepart_ptr, True, stride_or,
            stride_oh,
        )),
        (_consumer1, (
            q_desc, kv_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr, stride_qr, stride_qh,
            stride_kvn, num_heads, num_kv, nnz, qk_scale, num_items, ids_per_row, q_smem,
            kv_smem, p0_smem, p1_smem, m0_smem, m1_smem, l_smem, bars, tile_ids, SMALL,
            DENSE_IDS, POS_SCALE, True, NUM_SPLITS, opart_ptr, lsepart_ptr, True, True,
            stride_or, stride_oh,
        )),
        (_producer, (
            q_desc, kv_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr, stride_qr, stride_qh,
            stride_kvn, num_heads, num_kv, nnz, qk_scale, num_items, ids_per_row, q_smem,
            kv_smem, p0_smem, p1_smem, m0_smem, m1_smem, l_smem, bars, tile_ids, SMALL,
            DENSE_IDS, POS_SCALE, True, NUM_SPLITS, opart_ptr, lsepart_ptr, L2_ROWS,
        )),
        ],
        [4, 4],
        _worker_regs(CONSUMER_REGS, PRODUCER_REGS),
    )  # fmt: skip
