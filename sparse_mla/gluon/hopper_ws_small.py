"""Hopper (sm90) sparse prefill for few heads (H <= 32), warp-specialised, heads on wgmma's N.

At H <= 16 the work is a gather: each 1 KiB KV row feeds 4 H FLOP per dimension, so the kernel
must keep the SM's gather bandwidth busy while doing little math. The H >= 64 kernel
(``hopper_ws.py``) puts heads on wgmma's M, which is 64 per warpgroup: at H = 16 three quarters
of its math would be padding. Here the operands are swapped so that the slots are M and the
heads are N (wgmma allows N = 16):

- S^T [64 slots, 16 heads] = K [64, 512] (shared memory) x Q^T [512, 16] (shared memory);
- the softmax runs down the slots (per head: a column of S^T, reduced across the 4 warps);
- O^T [512, 16] += V^T [512, 64] (the same KV tile read transposed) x P^T [64, 16] (shared).

Persistent: one program per SM takes (token, block of 16 x ``HEAD_GROUPS`` heads) items
round-robin, 4 + 4 x ``HEAD_GROUPS`` warps in 1 + ``HEAD_GROUPS`` partitions: a **producer**
warpgroup that cp.async-gathers Q once per item and then the token's KV rows, 64 slots a tile,
into a ring of tiles (each with a ``ready`` and a ``free`` mbarrier), and ``HEAD_GROUPS``
**consumer** warpgroups, consumer g doing the math above for heads 16 g .. 16 g + 15 of the
item's block on the same KV tile with its own Q rows, P^T buffer, softmax state and output
rows. A tile is freed once every consumer has arrived on its ``free`` barrier (count
``HEAD_GROUPS``), and so is Q (``Q_FREE``). So at 17-32 heads (``HEAD_GROUPS`` = 2) each KV row
is gathered once per token, not once per 16 heads.

One consumer per 16 heads: per tile a consumer reads the tile twice from shared memory (K, then
V^T: 128 KiB) in about the time the gather of the next tile takes at the SM's share of the
measured gather ceiling; a second consumer doubles those reads (256 KiB a tile), and works while
the first one waits on its own chain (wgmma, cross-warp max, P^T, wgmma).

Shared memory (bf16/fp16; the limit is 227 KiB = 232,448 bytes a block):

- ``HEAD_GROUPS`` = 1: Q 16 x 512 x 2 = 16 KiB, ring 3 x 64 x 512 x 2 = 192 KiB, P^T
  64 x 16 x 2 = 2 KiB, 8 barriers 64 B: 215,104 bytes, 220,228 with the compiler's scratch
  (the epilogue's layout conversion and the cross-warp max).
- ``HEAD_GROUPS`` = 2: Q 32 KiB and two P^T (4 KiB) with a 3-tile ring would be 233,536 bytes
  before any scratch, over the limit; so the ring has 2 tiles (128 KiB): 168,000 bytes before
  scratch. ``ring_stages`` says which.

Absent slots (< 0, >= N, past the list's end) copy nothing and are zero-filled, and their
logits are -inf, so the pool is never read for them and NaN cannot reach the output. The CSR
range is clamped to [0, nnz] as in every kernel of the package.
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
    _slots,
)

BLOCK_H = gl.constexpr(16)  # heads per consumer warpgroup: wgmma's N (an item has HEAD_GROUPS)
BLOCK_K = gl.constexpr(64)  # slots per tile: wgmma's M
STAGES = gl.constexpr(3)  # KV tiles in flight at HEAD_GROUPS = 1 (3 x 64 KiB); see ring_stages
PRODUCER_REGS = gl.constexpr(64)  # HEAD_GROUPS = 1: the consumer gets the rest (256)
# HEAD_GROUPS = 2: 12 warps, 3 x 168 registers a thread to share: the producer's request, the
# second consumer's (a worker) and what is left for the first (the default partition).
PRODUCER_REGS_2 = gl.constexpr(40)
CONSUMER_REGS = gl.constexpr(232)


@constexpr_function
def _head_groups(head_groups):
    """The kernel's HEAD_GROUPS, checked; None (a cross-compile whose ``triton.compile``
    signature predates the parameter, so it is unbound) is the default, 1."""
    head_groups = 1 if head_groups is None else head_groups
    if head_groups not in (1, 2):
        raise ValueError(f"HEAD_GROUPS must be 1 or 2, got {head_groups!r}")
    return head_groups


@constexpr_function
def ring_stages(head_groups):
    """KV tiles in the ring: 3 at one head group; 2 at two (Q and P^T grow by 18 KiB and a third
    64 KiB tile no longer fits in 227 KiB; the module docstring has the bytes)."""
    return 3 if head_groups == 1 else 2


# S^T [64 slots, 16 heads] and O^T [512, 16]: one warpgroup, 16 rows a warp per 64-row block.
MMA_ST = gl.constexpr(
    gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
)
ROW_ST = gl.constexpr(gl.SliceLayout(1, MMA_ST.value))  # per slot
COL_ST = gl.constexpr(gl.SliceLayout(0, MMA_ST.value))  # per head
# P^T [64 slots, 16 heads] in shared memory: wgmma's B operand (heads contiguous).
SMEM_P = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2))
# The epilogue's stores: a lane holds 8 consecutive dims of one head (16-byte stores).
STORE = gl.constexpr(gl.BlockedLayout([8, 1], [32, 1], [1, 4], [0, 1]))

# Barrier slots.
READY = gl.constexpr(0)  # + stage: a tile has landed (the producer's 128 lanes arrive)
FREE = gl.constexpr(3)  # + stage: every consumer is done with it (HEAD_GROUPS arrivals)
Q_READY = gl.constexpr(6)
Q_FREE = gl.constexpr(7)
NUM_BARS = gl.constexpr(8)


@gluon.jit
def _producer(
    q_ptr, kv_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr,
    stride_qr, stride_qh, stride_kvn, stride_or, stride_oh, num_heads, num_kv, nnz, qk_scale,
    num_items, q_smem, kv_smem, p_smem, bars, HEAD_GROUPS: gl.constexpr = 1,
):  # fmt: skip
    heads: gl.constexpr = BLOCK_H * HEAD_GROUPS  # per item
    stages: gl.constexpr = ring_stages(HEAD_GROUPS)
    offs_hq = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, GATHER))
    offs_c = gl.arange(0, HALF, layout=gl.SliceLayout(0, GATHER))
    g = 0  # tiles gathered so far over all items: ring slot and phase
    it = 0
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        pid_r, pid_h, lo, hi, num_tiles = _item_range(item, indptr_ptr, nnz, num_heads, heads)
        mbarrier.wait(bars.index(Q_FREE), (it & 1) ^ 1)
        # Q of each head group (rows past num_heads zero-filled): Q_READY counts every copy.
        for grp in gl.static_range(HEAD_GROUPS):
            _copy_q(q_smem.index(grp), q_ptr, pid_r, pid_h * heads + grp * BLOCK_H + offs_hq,
                    offs_c, stride_qr, stride_qh, num_heads)  # fmt: skip
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
    num_items, q_smem, kv_smem, p_smem, bars, HEAD_GROUPS: gl.constexpr = 1,
    GROUP: gl.constexpr = 0,
):  # fmt: skip
    """Head group ``GROUP`` (heads 16 GROUP .. 16 GROUP + 15 of each item's block)."""
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    heads: gl.constexpr = BLOCK_H * HEAD_GROUPS  # per item
    stages: gl.constexpr = ring_stages(HEAD_GROUPS)
    g = 0
    it = 0
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        pid_r, pid_h, lo, hi, num_tiles = _item_range(item, indptr_ptr, nnz, num_heads, heads)
        m_i = gl.full([BLOCK_H], M_INIT, gl.float32, layout=COL_ST)
        # The denominator per (slot row, head), summed over the slots once at the end: one
        # cross-warp reduction per tile (the max) instead of two.
        l2 = gl.zeros([BLOCK_K, BLOCK_H], gl.float32, layout=MMA_ST)
        acc = gl.zeros([HEAD_DIM, BLOCK_H], gl.float32, layout=MMA_ST)  # O^T
        mbarrier.wait(bars.index(Q_READY), it & 1)
        if num_tiles == 0:
            _arrive(bars.index(Q_FREE))
        for t in range(num_tiles):
            stage = (g + t) % stages
            ph = ((g + t) // stages) & 1
            z = _opaque_zero(t)  # keeps the wgmma descriptors inside the loop
            tile = kv_smem.index(stage + z)
            q_tile = q_smem.index(GROUP + z)
            offs = lo + t * BLOCK_K + gl.arange(0, BLOCK_K, layout=ROW_ST)
            in_list = offs < hi
            slot = gl.load(idx_ptr + offs, mask=in_list, other=-1).to(gl.int64)
            valid = in_list & (slot >= 0) & (slot < num_kv)

            mbarrier.wait(bars.index(READY + stage), ph)
            fence_async_shared()  # cp.async writes (generic proxy) before wgmma reads (async)
            s = gl.zeros([BLOCK_K, BLOCK_H], gl.float32, layout=MMA_ST)
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
            p_smem.index(GROUP + z).store(p.to(dtype))
            fence_async_shared()
            gl.thread_barrier()  # every warp's part of P^T is in before the wgmma reads it
            # Absent rows of V were zero-filled by the gather: 0 * 0, never NaN.
            acc = warpgroup_mma(tile.permute((1, 0)), p_smem.index(GROUP + z), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=[acc])
            _arrive(bars.index(FREE + stage))
        g += num_tiles

        l_i = gl.sum(l2, 0)
        # The sink: a virtual column with logit sink_h and a zero value vector (-inf: none).
        h0 = pid_h * heads + GROUP * BLOCK_H  # this consumer's heads: h0 .. h0 + 15
        offs_h = h0 + gl.arange(0, BLOCK_H, layout=COL_ST)
        sink = gl.load(sink_ptr + offs_h, mask=offs_h < num_heads, other=float("-inf")) * LOG2E
        den = l_i + gl.exp2(sink - m_i)
        # A head with no valid slot gets zeros, whatever its sink.
        inv = gl.where(l_i > 0.0, 1.0 / den, 0.0)
        o = gl.convert_layout((acc * inv[None, :]).to(dtype), STORE)  # [512, heads]
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, STORE))
        offs_ho = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, STORE))
        o_ptrs = out_ptr + pid_r * stride_or + offs_ho[None, :] * stride_oh + offs_d[:, None]
        gl.store(o_ptrs, o, mask=(offs_ho < num_heads)[None, :])
        it += 1  # noqa: SIM113 (Gluon loops have no enumerate)


@gluon.jit
def _shared_state(dtype: gl.constexpr, HEAD_GROUPS: gl.constexpr = 1):
    """Q, the KV ring, P^T and the barriers (initialised), as every partition sees them: Q and
    P^T have one [16, 512] / [64, 16] slice per head group (consumer)."""
    q_smem = gl.allocate_shared_memory(dtype, [HEAD_GROUPS, BLOCK_H, HEAD_DIM], SMEM)
    kv_smem = gl.allocate_shared_memory(dtype, [ring_stages(HEAD_GROUPS), BLOCK_K, HEAD_DIM], SMEM)
    p_smem = gl.allocate_shared_memory(dtype, [HEAD_GROUPS, BLOCK_K, BLOCK_H], SMEM_P)
    bars = gl.allocate_shared_memory(gl.int64, [NUM_BARS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(ring_stages(HEAD_GROUPS)):
        mbarrier.init(bars.index(READY + i), count=128)  # the producer's lanes, via cp.async
        mbarrier.init(bars.index(FREE + i), count=HEAD_GROUPS)  # one arrival per consumer
    mbarrier.init(bars.index(Q_READY), count=128)
    mbarrier.init(bars.index(Q_FREE), count=HEAD_GROUPS)
    return q_smem, kv_smem, p_smem, bars


@gluon.jit(do_not_specialize=["nnz"])
def _prefill_ws_small_kernel(
    q_ptr,  # [R, H, 512]
    kv_ptr,  # [N, 512]
    idx_ptr,  # [nnz] int32 | int64
    indptr_ptr,  # [R + 1]
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
    HEAD_GROUPS: gl.constexpr = 1,  # consumer warpgroups, 16 heads each: 1 or 2
):
    """Persistent: grid (min(items, SMs),); launched with num_warps=4: 4 warps here (consumer
    0) + 4 per further consumer + 4 (the producer)."""
    groups: gl.constexpr = _head_groups(HEAD_GROUPS)
    q_smem, kv_smem, p_smem, bars = _shared_state(q_ptr.dtype.element_ty, groups)
    args = (
        q_ptr, kv_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr,
        stride_qr, stride_qh, stride_kvn, stride_or, stride_oh, num_heads, num_kv, nnz, qk_scale,
        num_items, q_smem, kv_smem, p_smem, bars,
    )  # fmt: skip
    if groups == 1:
        gl.warp_specialize([(_consumer, args), (_producer, args)], [4], [PRODUCER_REGS])
    else:
        # Each partition's arguments written out in the call: a tuple assigned to a name turns
        # its constexprs (HEAD_GROUPS, the group) into tensors.
        gl.warp_specialize(
            [
                (_consumer, (
                    q_ptr, kv_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr,
                    stride_qr, stride_qh, stride_kvn, stride_or, stride_oh, num_heads, num_kv,
                    nnz, qk_scale, num_items, q_smem, kv_smem, p_smem, bars, groups, 0,
                )),
                (_consumer, (
                    q_ptr, kv_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr,
                    stride_qr, stride_qh, stride_kvn, stride_or, stride_oh, num_heads, num_kv,
                    nnz, qk_scale, num_items, q_smem, kv_smem, p_smem, bars, groups, 1,
                )),
                (_producer, (
                    q_ptr, kv_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr,
                    stride_qr, stride_qh, stride_kvn, stride_or, stride_oh, num_heads, num_kv,
                    nnz, qk_scale, num_items, q_smem, kv_smem, p_smem, bars, groups,
                )),
            ],
            [4, 4],
            [CONSUMER_REGS, PRODUCER_REGS_2],
        )  # fmt: skip
