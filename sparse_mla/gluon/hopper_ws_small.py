"""Hopper (sm90) sparse prefill for few heads (H <= 32), warp-specialised, heads on wgmma's N.

At H <= 16 the work is a gather: each 1 KiB KV row feeds 4 H FLOP per dimension, so the kernel
must keep the SM's gather bandwidth busy while doing little math. The H >= 64 kernel
(``hopper_ws.py``) puts heads on wgmma's M, which is 64 per warpgroup: at H = 16 three quarters
of its math would be padding. Here the operands are swapped so that the slots are M and the
heads are N (wgmma allows N = 16):

- S^T [64 slots, 16 heads] = K [64, 512] (shared memory) x Q^T [512, 16] (shared memory);
- the softmax runs down the slots (per head: a column of S^T, reduced across the 4 warps);
- O^T [512, 16] += V^T [512, 64] (the same KV tile read transposed) x P^T [64, 16] (shared).

Persistent: one program per SM takes (token, block of ``heads`` = 16 x ``HEAD_GROUPS`` heads)
items round-robin, 8 warps in two partitions: a **producer** warpgroup that cp.async-gathers Q
once per item and then the token's KV rows, 64 slots a tile, into a ring of tiles (each with a
``ready`` and a ``free`` mbarrier), and a **consumer** warpgroup doing the math above with
N = ``heads``: m64n16k16 at ``HEAD_GROUPS`` = 1 (H <= 16), m64n32k16 at 2 (17 <= H <= 32, heads
past H zero-filled in Q and not stored). So at 17-32 heads each KV row is gathered once per
token, not once per 16 heads.

Why one consumer with N = 32 rather than two consumer warpgroups of N = 16 on the same tile:
wgmma reads its A operand (the KV tile: K for S^T, V^T for O^T) from shared memory once per
warpgroup, and at N = 16 that read, not the tensor cores, sets the pace (2.5 KiB per 8 cycles
of m64n16k16 at peak, against the SM's 128 B/clk). Two consumers read the tile four times a
tile (292 KiB of wgmma operands), one consumer at N = 32 twice (164 KiB). Both were built and
measured on the H200 (CSA, T = 16384, 32 heads): two consumers 2.49 ms (the code at 8cabe83),
one at N = 32 2.17 ms; 16 heads twice per token (two items a token) 3.44 ms.

The consumer holds O^T [512, heads] fp32 (64 or 128 registers a thread) and the denominator per
(slot, head) (8 or 16): at N = 32 ptxas uses 240 of its 256 registers, no spills.

Shared memory (bf16/fp16; the limit is 227 KiB = 232,448 bytes a block):

- ``HEAD_GROUPS`` = 1: Q 16 x 512 x 2 = 16 KiB, ring 3 x 64 x 512 x 2 = 192 KiB, P^T
  64 x 16 x 2 = 2 KiB, 8 barriers 64 B: 215,104 bytes; 219,204 with the compiler's scratch (the
  epilogue's layout conversion and the cross-warp max), 220,228 with the 1 KiB the driver
  reserves.
- ``HEAD_GROUPS`` = 2: Q 32 KiB and P^T 4 KiB with a 3-tile ring would be 233,536 bytes before
  any scratch, over the limit; so the ring has 2 tiles (128 KiB): 168,000 bytes, 173,124 with
  scratch and the reserve. ``ring_stages`` says which. A 2-tile ring costs nothing measurable:
  at 16 heads it ran CSA in 1.731 ms against 1.743 with 3 tiles (same run).

Absent slots (< 0, >= N, past the list's end) copy nothing and are zero-filled, and their
logits are -inf, so the pool is never read for them and NaN cannot reach the output. The CSR
range is clamped to [0, nnz] as in every kernel of the package. Dense ids (``DENSE_IDS``,
kv_indices [R, K], no kv_indptr): an item's range is row r, known without a load
(``hopper_ws._item_range``).

Small calls (``SMALL``, set by the launcher from :func:`hopper_ws.small_call`: a program's share
of kv_indices is at most 2048 ids): the producer first asks L2 for its program's share of the
ids (:func:`hopper_ws._prefetch_ids`), so the ids it loads once an item's kv_indptr range is
back are an L2 hit, not a second DRAM round trip (as ``gluon_ws``'s small-call order does).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import constexpr_function
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .hopper_ws import (
    GATHER,
    HALF,
    HEAD_DIM,
    LOG2E,
    M_INIT,
    SMEM,
    _arrive,
    _copy_q,
    _gather_half,
    _item_range,
    _opaque_zero,
    _prefetch_ids,
    _slots,
    small_call,  # noqa: F401 (the launcher sets SMALL from the module's small_call)
)

BLOCK_H = gl.constexpr(16)  # heads per item at HEAD_GROUPS = 1 (16 x HEAD_GROUPS): wgmma's N
BLOCK_K = gl.constexpr(64)  # slots per tile: wgmma's M
STAGES = gl.constexpr(3)  # KV tiles in flight at HEAD_GROUPS = 1 (3 x 64 KiB); see ring_stages
# Registers per thread of the producer (setmaxnreg). Two warpgroups share the 65,536 registers:
# 256 a thread each at launch; the producer gives back down to PRODUCER_REGS and the consumer
# takes min(256, 512 - PRODUCER_REGS): 256 for any PRODUCER_REGS <= 256.
PRODUCER_REGS = gl.constexpr(64)


@constexpr_function
def _head_groups(head_groups):
    """The kernel's HEAD_GROUPS, checked; None (a cross-compile whose ``triton.compile``
    signature predates the parameter, so it is unbound) is the default, 1."""
    head_groups = 1 if head_groups is None else head_groups
    if head_groups not in (1, 2):
        raise ValueError(f"HEAD_GROUPS must be 1 or 2, got {head_groups!r}")
    return head_groups


@constexpr_function
def _producer_regs(regs):
    """The launch's PRODUCER_REGS, checked (None: unbound in a cross-compile's signature, the
    module's default)."""
    regs = PRODUCER_REGS.value if regs is None else regs
    if not (isinstance(regs, int) and 24 <= regs <= 256 and regs % 8 == 0):
        raise ValueError(f"PRODUCER_REGS must be a multiple of 8 in [24, 256], got {regs!r}")
    return regs


@constexpr_function
def ring_stages(head_groups, stages=None):
    """KV tiles in the ring: ``stages`` when given (the launch's STAGES: 2 or 3), else 3 at 16
    heads and 2 at 32 (Q and P^T grow by 18 KiB and a third 64 KiB tile no longer fits in
    227 KiB; the module docstring has the bytes). The barriers have slots for 3."""
    if stages is None:
        return 3 if head_groups == 1 else 2
    if stages not in (2, 3):
        raise ValueError(f"STAGES must be 2 or 3, got {stages!r}")
    return stages


@constexpr_function
def mma_st(heads):
    """S^T [64 slots, heads] and O^T [512, heads]: one warpgroup, 16 rows a warp per 64-row
    block, wgmma m64n{heads}k16."""
    return gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, heads, 16]
    )


@constexpr_function
def row_st(heads):
    return gl.SliceLayout(1, mma_st(heads))  # per slot


@constexpr_function
def col_st(heads):
    return gl.SliceLayout(0, mma_st(heads))  # per head


@constexpr_function
def smem_p(heads):
    """P^T [64 slots, heads] in shared memory: wgmma's B operand, heads contiguous (rows of
    2 x heads bytes, swizzled as wide as a row)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=2 * heads, element_bitwidth=16, rank=2)


# The layouts at HEAD_GROUPS = 1 (16 heads).
MMA_ST = gl.constexpr(mma_st(16))
ROW_ST = gl.constexpr(row_st(16))
COL_ST = gl.constexpr(col_st(16))
SMEM_P = gl.constexpr(smem_p(16))
# The epilogue's stores: a lane holds 8 consecutive dims of one head (16-byte stores).
STORE = gl.constexpr(gl.BlockedLayout([8, 1], [32, 1], [1, 4], [0, 1]))

# Barrier slots.
READY = gl.constexpr(0)  # + stage: a tile has landed (the producer's 128 lanes arrive)
FREE = gl.constexpr(3)  # + stage: the consumer is done with it
Q_READY = gl.constexpr(6)
Q_FREE = gl.constexpr(7)
NUM_BARS = gl.constexpr(8)


@gluon.jit
def _producer(
    q_ptr, kv_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr,
    stride_qr, stride_qh, stride_kvn, stride_or, stride_oh, num_heads, num_kv, nnz, qk_scale,
    num_items, ids_per_row, q_smem, kv_smem, p_smem, bars, HEAD_GROUPS: gl.constexpr = 1,
    STAGES: gl.constexpr = None, DENSE_IDS: gl.constexpr = False, SMALL: gl.constexpr = False,
):  # fmt: skip
    heads: gl.constexpr = BLOCK_H * HEAD_GROUPS  # per item
    stages: gl.constexpr = ring_stages(HEAD_GROUPS, STAGES)
    if SMALL:  # the program's share of kv_indices into L2 before its first range load
        _prefetch_ids(idx_ptr, nnz)
    offs_hq = gl.arange(0, heads, layout=gl.SliceLayout(1, GATHER))
    offs_c = gl.arange(0, HALF, layout=gl.SliceLayout(0, GATHER))
    g = 0  # tiles gathered so far over all items: ring slot and phase
    it = 0
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        pid_r, pid_h, lo, hi, num_tiles = _item_range(
            item, indptr_ptr, nnz, num_heads, heads, ids_per_row, DENSE_IDS
        )
        mbarrier.wait(bars.index(Q_FREE), (it & 1) ^ 1)
        _copy_q(q_smem.index(0), q_ptr, pid_r, pid_h * heads + offs_hq, offs_c, stride_qr,
                stride_qh, num_heads)  # fmt: skip
        cp.mbarrier_arrive(bars.index(Q_READY), increment_count=False)
        for t in range(num_tiles):
            stage = (g + t) % stages
            ph = (((g + t) // stages) & 1) ^ 1  # a fresh barrier's previous phase is complete
            # The ids first: their latency hides behind the wait for a free slot.
            slot = _slots(idx_ptr, lo + t * BLOCK_K, hi, num_kv)
            mbarrier.wait(bars.index(FREE + stage), ph)
            tile = kv_smem.index(stage)
            _gather_half(tile.slice(0, HALF, dim=1), kv_ptr, slot, stride_kvn, 0)
            _gather_half(tile.slice(HALF, HALF, dim=1), kv_ptr, slot, stride_kvn, HALF)
            cp.mbarrier_arrive(bars.index(READY + stage), increment_count=False)
        g += num_tiles
        it += 1  # noqa: SIM113 (Gluon loops have no enumerate)
    cp.commit_group()
    cp.wait_group(0)


@gluon.jit
def _consumer(
    q_ptr, kv_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr,
    stride_qr, stride_qh, stride_kvn, stride_or, stride_oh, num_heads, num_kv, nnz, qk_scale,
    num_items, ids_per_row, q_smem, kv_smem, p_smem, bars, HEAD_GROUPS: gl.constexpr = 1,
    STAGES: gl.constexpr = None, DENSE_IDS: gl.constexpr = False, SMALL: gl.constexpr = False,
):  # fmt: skip
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    heads: gl.constexpr = BLOCK_H * HEAD_GROUPS  # per item: wgmma's N
    stages: gl.constexpr = ring_stages(HEAD_GROUPS, STAGES)
    mma: gl.constexpr = mma_st(heads)
    row: gl.constexpr = row_st(heads)
    col: gl.constexpr = col_st(heads)
    g = 0
    it = 0
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        pid_r, pid_h, lo, hi, num_tiles = _item_range(
            item, indptr_ptr, nnz, num_heads, heads, ids_per_row, DENSE_IDS
        )
        m_i = gl.full([heads], M_INIT, gl.float32, layout=col)
        # The denominator per (slot row, head), summed over the slots once at the end: one
        # cross-warp reduction per tile (the max) instead of two.
        l2 = gl.zeros([BLOCK_K, heads], gl.float32, layout=mma)
        acc = gl.zeros([HEAD_DIM, heads], gl.float32, layout=mma)  # O^T
        mbarrier.wait(bars.index(Q_READY), it & 1)
        if num_tiles == 0:
            _arrive(bars.index(Q_FREE))
        for t in range(num_tiles):
            stage = (g + t) % stages
            ph = ((g + t) // stages) & 1
            z = _opaque_zero(t)  # keeps the wgmma descriptors inside the loop
            tile = kv_smem.index(stage + z)
            q_tile = q_smem.index(z)
            offs = lo + t * BLOCK_K + gl.arange(0, BLOCK_K, layout=row)
            in_list = offs < hi
            slot = gl.load(idx_ptr + offs, mask=in_list, other=-1).to(gl.int64)
            valid = in_list & (slot >= 0) & (slot < num_kv)

            mbarrier.wait(bars.index(READY + stage), ph)
            fence_async_shared()  # cp.async writes (generic proxy) before wgmma reads (async)
            s = gl.zeros([BLOCK_K, heads], gl.float32, layout=mma)
            s = warpgroup_mma(tile, q_tile.permute((1, 0)), s, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(0, deps=[s])
            if t + 1 == num_tiles:
                _arrive(bars.index(Q_FREE))  # done with this item's Q
            s = gl.where(valid[:, None], s * qk_scale, float("-inf"))  # [slots, heads]
            m_new = gl.maximum(m_i, gl.max(s, 0))
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s - m_new[None, :])
            l2 = l2 * alpha[None, :] + p
            m_i = m_new
            acc = acc * alpha[None, :]
            p_smem.index(z).store(p.to(dtype))
            fence_async_shared()
            gl.thread_barrier()  # every warp's part of P^T is in before the wgmma reads it
            # Absent rows of V were zero-filled by the gather: 0 * 0, never NaN.
            acc = warpgroup_mma(tile.permute((1, 0)), p_smem.index(z), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=[acc])
            _arrive(bars.index(FREE + stage))
        g += num_tiles

        l_i = gl.sum(l2, 0)
        # The sink: a virtual column with logit sink_h and a zero value vector (-inf: none).
        offs_h = pid_h * heads + gl.arange(0, heads, layout=col)
        sink = gl.load(sink_ptr + offs_h, mask=offs_h < num_heads, other=float("-inf")) * LOG2E
        den = l_i + gl.exp2(sink - m_i)
        # A head with no valid slot gets zeros, whatever its sink.
        inv = gl.where(l_i > 0.0, 1.0 / den, 0.0)
        o = gl.convert_layout((acc * inv[None, :]).to(dtype), STORE)  # [512, heads]
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, STORE))
        offs_ho = pid_h * heads + gl.arange(0, heads, layout=gl.SliceLayout(0, STORE))
        o_ptrs = out_ptr + pid_r * stride_or + offs_ho[None, :] * stride_oh + offs_d[:, None]
        gl.store(o_ptrs, o, mask=(offs_ho < num_heads)[None, :])
        it += 1  # noqa: SIM113 (Gluon loops have no enumerate)


@gluon.jit
def _shared_state(
    dtype: gl.constexpr, HEAD_GROUPS: gl.constexpr = 1, STAGES: gl.constexpr = None,
    READY_COUNT: gl.constexpr = 128,
):  # fmt: skip
    """Q [16 HEAD_GROUPS, 512], the KV ring, P^T [64, 16 HEAD_GROUPS] and the barriers
    (initialised), as every partition sees them. ``READY_COUNT``: arrivals that mark a tile
    landed (128: the producer's lanes, by cp.async; 1: a producer that stores the tile itself,
    :mod:`hopper_fp8`)."""
    heads: gl.constexpr = BLOCK_H * HEAD_GROUPS
    q_smem = gl.allocate_shared_memory(dtype, [1, heads, HEAD_DIM], SMEM)
    stages: gl.constexpr = ring_stages(HEAD_GROUPS, STAGES)
    kv_smem = gl.allocate_shared_memory(dtype, [stages, BLOCK_K, HEAD_DIM], SMEM)
    p_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_K, heads], smem_p(heads))
    bars = gl.allocate_shared_memory(gl.int64, [NUM_BARS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(stages):
        mbarrier.init(bars.index(READY + i), count=READY_COUNT)
        mbarrier.init(bars.index(FREE + i), count=1)
    mbarrier.init(bars.index(Q_READY), count=128)
    mbarrier.init(bars.index(Q_FREE), count=1)
    return q_smem, kv_smem, p_smem, bars


@gluon.jit(do_not_specialize=["nnz"])
def _prefill_ws_small_kernel(
    q_ptr,  # [R, H, 512]
    kv_ptr,  # [N, 512]
    idx_ptr,  # [nnz] int32 | int64 (DENSE_IDS: [R, ids_per_row], contiguous)
    indptr_ptr,  # [R + 1] (unused under DENSE_IDS)
    sink_ptr,  # [H] fp32 sink logits (-inf: no sink)
    out_ptr,  # [R, H, 512]
    stride_qr,
    stride_qh,
    stride_kvn,
    stride_or,
    stride_oh,
    num_heads,
    num_kv,
    nnz,  # kv_indices.numel(): every CSR range is clamped to [0, nnz]
    qk_scale,  # sm_scale * log2(e)
    num_items,  # R * cdiv(H, 16 * HEAD_GROUPS)
    ids_per_row,  # DENSE_IDS: K of the dense [R, K] ids (CSR: 0, unused)
    HEAD_GROUPS: gl.constexpr = 1,  # heads per item / 16 (wgmma's N / 16): 1 or 2
    STAGES: gl.constexpr = None,  # KV tiles in the ring (None: ring_stages' default)
    PRODUCER_REGS: gl.constexpr = None,  # the producer's registers (None: PRODUCER_REGS)
    DENSE_IDS: gl.constexpr = False,  # kv_indices is dense [R, ids_per_row]; no kv_indptr
    SMALL: gl.constexpr = False,  # small_call(nnz, programs): prefetch the ids into L2
):
    """Persistent: grid (min(items, SMs),); launched with num_warps=4: 4 warps here (the
    consumer) + 4 (the producer)."""
    groups: gl.constexpr = _head_groups(HEAD_GROUPS)
    q_smem, kv_smem, p_smem, bars = _shared_state(q_ptr.dtype.element_ty, groups, STAGES)
    # The partitions' arguments written out in the call: a tuple assigned to a name would turn
    # its constexpr (HEAD_GROUPS) into a tensor.
    gl.warp_specialize(
        [
            (_consumer, (
                q_ptr, kv_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr,
                stride_qr, stride_qh, stride_kvn, stride_or, stride_oh, num_heads, num_kv, nnz,
                qk_scale, num_items, ids_per_row, q_smem, kv_smem, p_smem, bars, groups, STAGES,
                DENSE_IDS, SMALL,
            )),
            (_producer, (
                q_ptr, kv_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr,
                stride_qr, stride_qh, stride_kvn, stride_or, stride_oh, num_heads, num_kv, nnz,
                qk_scale, num_items, ids_per_row, q_smem, kv_smem, p_smem, bars, groups, STAGES,
                DENSE_IDS, SMALL,
            )),
        ],
        [4],
        [_producer_regs(PRODUCER_REGS)],
    )  # fmt: skip
