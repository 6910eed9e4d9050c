"""Hopper (sm90) sparse prefill for few heads (H <= 16), warp-specialised, heads on wgmma's N.

At H <= 16 the work is a gather: each 1 KiB KV row feeds 4 H FLOP per dimension, so the kernel
must keep the SM's gather bandwidth busy while doing little math. The H >= 64 kernel
(``hopper_ws.py``) puts heads on wgmma's M, which is 64 per warpgroup: at H = 16 three quarters
of its math would be padding. Here the operands are swapped so that the slots are M and the
heads are N (wgmma allows N = 16):

- S^T [64 slots, 16 heads] = K [64, 512] (shared memory) x Q^T [512, 16] (shared memory);
- the softmax runs down the slots (per head: a column of S^T, reduced across the 4 warps);
- O^T [512, 16] += V^T [512, 64] (the same KV tile read transposed) x P^T [64, 16] (shared).

Persistent: one program per SM takes (token, block of 16 heads) items round-robin, 8 warps in
two partitions: a **producer** warpgroup that cp.async-gathers Q once per item and then the
token's KV rows, 64 slots a tile, into a ring of ``STAGES`` tiles (each with a ``ready`` and a
``free`` mbarrier), and a **consumer** warpgroup doing the math above. One consumer is enough:
per tile it reads the tile twice from shared memory (K, then V^T: 128 KiB) in about the time the
gather of the next tile takes at the SM's share of the measured gather ceiling.

Absent slots (< 0, >= N, past the list's end) copy nothing and are zero-filled, and their
logits are -inf, so the pool is never read for them and NaN cannot reach the output. The CSR
range is clamped to [0, nnz] as in every kernel of the package.
"""

from __future__ import annotations

from triton.experimental import gluon
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

BLOCK_H = gl.constexpr(16)  # heads per item: wgmma's N
BLOCK_K = gl.constexpr(64)  # slots per tile: wgmma's M
STAGES = gl.constexpr(3)  # KV tiles in flight (3 x 64 KiB)
PRODUCER_REGS = gl.constexpr(64)

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
FREE = gl.constexpr(3)  # + stage: the consumer is done with it
Q_READY = gl.constexpr(6)
Q_FREE = gl.constexpr(7)
NUM_BARS = gl.constexpr(8)


@gluon.jit
def _producer(
    q_ptr, kv_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr,
    stride_qr, stride_qh, stride_kvn, stride_or, stride_oh, num_heads, num_kv, nnz, qk_scale,
    num_items, q_smem, kv_smem, p_smem, bars,
):  # fmt: skip
    offs_hq = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, GATHER))
    offs_c = gl.arange(0, HALF, layout=gl.SliceLayout(0, GATHER))
    g = 0  # tiles gathered so far over all items: ring slot and phase
    it = 0
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        pid_r, pid_h, lo, hi, num_tiles = _item_range(item, indptr_ptr, nnz, num_heads, BLOCK_H)
        mbarrier.wait(bars.index(Q_FREE), (it & 1) ^ 1)
        _copy_q(q_smem.index(0), q_ptr, pid_r, pid_h * BLOCK_H + offs_hq, offs_c, stride_qr,
                stride_qh, num_heads)  # fmt: skip
        cp.mbarrier_arrive(bars.index(Q_READY), increment_count=False)
        for t in range(num_tiles):
            stage = (g + t) % STAGES
            ph = (((g + t) // STAGES) & 1) ^ 1  # a fresh barrier's previous phase is complete
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
    num_items, q_smem, kv_smem, p_smem, bars,
):  # fmt: skip
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    g = 0
    it = 0
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        pid_r, pid_h, lo, hi, num_tiles = _item_range(item, indptr_ptr, nnz, num_heads, BLOCK_H)
        m_i = gl.full([BLOCK_H], M_INIT, gl.float32, layout=COL_ST)
        # The denominator per (slot row, head), summed over the slots once at the end: one
        # cross-warp reduction per tile (the max) instead of two.
        l2 = gl.zeros([BLOCK_K, BLOCK_H], gl.float32, layout=MMA_ST)
        acc = gl.zeros([HEAD_DIM, BLOCK_H], gl.float32, layout=MMA_ST)  # O^T
        mbarrier.wait(bars.index(Q_READY), it & 1)
        if num_tiles == 0:
            _arrive(bars.index(Q_FREE))
        for t in range(num_tiles):
            stage = (g + t) % STAGES
            ph = ((g + t) // STAGES) & 1
            z = _opaque_zero(t)  # keeps the wgmma descriptors inside the loop
            tile = kv_smem.index(stage + z)
            q_tile = q_smem.index(z)
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
        offs_h = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=COL_ST)
        sink = gl.load(sink_ptr + offs_h, mask=offs_h < num_heads, other=float("-inf")) * LOG2E
        den = l_i + gl.exp2(sink - m_i)
        # A head with no valid slot gets zeros, whatever its sink.
        inv = gl.where(l_i > 0.0, 1.0 / den, 0.0)
        o = gl.convert_layout((acc * inv[None, :]).to(dtype), STORE)  # [512, heads]
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, STORE))
        offs_ho = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, STORE))
        o_ptrs = out_ptr + pid_r * stride_or + offs_ho[None, :] * stride_oh + offs_d[:, None]
        gl.store(o_ptrs, o, mask=(offs_ho < num_heads)[None, :])
        it += 1  # noqa: SIM113 (Gluon loops have no enumerate)


@gluon.jit
def _shared_state(dtype: gl.constexpr):
    """Q, the KV ring, P^T and the barriers (initialised), as every partition sees them."""
    q_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_H, HEAD_DIM], SMEM)
    kv_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, HEAD_DIM], SMEM)
    p_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_K, BLOCK_H], SMEM_P)
    bars = gl.allocate_shared_memory(gl.int64, [NUM_BARS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(READY + i), count=128)  # the producer's lanes, via cp.async
        mbarrier.init(bars.index(FREE + i), count=1)
    mbarrier.init(bars.index(Q_READY), count=128)
    mbarrier.init(bars.index(Q_FREE), count=1)
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
    num_items,  # R * cdiv(H, 16)
):
    """Persistent: grid (min(items, SMs),); 4 warps here (the consumer) + 4 (the producer)."""
    q_smem, kv_smem, p_smem, bars = _shared_state(q_ptr.dtype.element_ty)
    args = (
        q_ptr, kv_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr,
        stride_qr, stride_qh, stride_kvn, stride_or, stride_oh, num_heads, num_kv, nnz, qk_scale,
        num_items, q_smem, kv_smem, p_smem, bars,
    )  # fmt: skip
    gl.warp_specialize([(_consumer, args), (_producer, args)], [4], [PRODUCER_REGS])
