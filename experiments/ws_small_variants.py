"""Variants and ablations of the H <= 16 sm90 kernel (``sparse_mla/gluon/hopper_ws_small.py``)
for docs/PERF_NOTES.md; not part of the package. Each has the package kernel's signature and is
launched through it by ``experiments/ws_small_variants_probe.py``:

- ``k_gather_only``: the producer as is, a consumer that releases each tile as soon as it lands
  (no math): the gather's own bound;
- ``k_math_only``: the consumer as is, a producer that does the ring handshakes without copying
  (the math on whatever shared memory holds): the consumer's own bound;
- ``k_pipe``: the next tile's S^T issued before this tile's softmax (two wgmma groups in flight).
  As measured (this file at 86f5834) it gave wrong results (NaN) and then an illegal address on
  the H200. The suspect, found in the IR afterwards: an ``scf.if`` (the Q_FREE arrival) between
  the wait for S^T and the wait for the PV, with the PV's accumulator registers in flight across
  the branch. It now arrives after both waits; that version has not run on a GPU yet.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from sparse_mla.gluon.hopper_ws import (
    GATHER,
    HALF,
    HEAD_DIM,
    LOG2E,
    M_INIT,
    _arrive,
    _copy_q,
    _item_range,
    _opaque_zero,
)
from sparse_mla.gluon.hopper_ws_small import (
    BLOCK_H,
    BLOCK_K,
    COL_ST,
    FREE,
    MMA_ST,
    PRODUCER_REGS,
    Q_FREE,
    Q_READY,
    READY,
    ROW_ST,
    STAGES,
    STORE,
    _consumer,
    _producer,
    _shared_state,
)


@gluon.jit
def _valid(idx_ptr, pos0, hi, num_kv):
    offs = pos0 + gl.arange(0, BLOCK_K, layout=ROW_ST)
    in_list = offs < hi
    slot = gl.load(idx_ptr + offs, mask=in_list, other=-1).to(gl.int64)
    return in_list & (slot >= 0) & (slot < num_kv)


@gluon.jit
def _softmax(s, valid, m_i, l2, qk_scale):
    s = gl.where(valid[:, None], s * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 0))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - m_new[None, :])
    l2 = l2 * alpha[None, :] + p
    return p, alpha, m_new, l2


@gluon.jit
def _epi(
    acc,
    m_i,
    l2,
    pid_r,
    pid_h,
    sink_ptr,
    out_ptr,
    stride_or,
    stride_oh,
    num_heads,
    dtype: gl.constexpr,
):
    l_i = gl.sum(l2, 0)
    offs_h = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=COL_ST)
    sink = gl.load(sink_ptr + offs_h, mask=offs_h < num_heads, other=float("-inf")) * LOG2E
    den = l_i + gl.exp2(sink - m_i)
    inv = gl.where(l_i > 0.0, 1.0 / den, 0.0)
    o = gl.convert_layout((acc * inv[None, :]).to(dtype), STORE)
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, STORE))
    offs_ho = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, STORE))
    o_ptrs = out_ptr + pid_r * stride_or + offs_ho[None, :] * stride_oh + offs_d[:, None]
    gl.store(o_ptrs, o, mask=(offs_ho < num_heads)[None, :])


@gluon.jit
def _consumer_pipe(
    q_ptr, kv_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr,
    stride_qr, stride_qh, stride_kvn, stride_or, stride_oh, num_heads, num_kv, nnz, qk_scale,
    num_items, q_smem, kv_smem, p_smem, bars,
):  # fmt: skip
    """S(t+1) issued before the softmax of tile t; l kept per slot row, summed at the end."""
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    g = 0
    it = 0
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        pid_r, pid_h, lo, hi, num_tiles = _item_range(item, indptr_ptr, nnz, num_heads, BLOCK_H)
        m_i = gl.full([BLOCK_H], M_INIT, gl.float32, layout=COL_ST)
        l2 = gl.zeros([BLOCK_K, BLOCK_H], gl.float32, layout=MMA_ST)
        acc = gl.zeros([HEAD_DIM, BLOCK_H], gl.float32, layout=MMA_ST)
        s = gl.zeros([BLOCK_K, BLOCK_H], gl.float32, layout=MMA_ST)
        valid = _valid(idx_ptr, lo, hi, num_kv)
        mbarrier.wait(bars.index(Q_READY), it & 1)
        if num_tiles > 0:
            zi = _opaque_zero(item)
            st0 = g % STAGES
            mbarrier.wait(bars.index(READY + st0), (g // STAGES) & 1)
            fence_async_shared()
            s = warpgroup_mma(
                kv_smem.index(st0 + zi),
                q_smem.index(zi).permute((1, 0)),
                s,
                use_acc=False,
                is_async=True,
            )
            s = warpgroup_mma_wait(0, deps=[s])
        if num_tiles <= 1:
            _arrive(bars.index(Q_FREE))
        for t in range(num_tiles):
            stage = (g + t) % STAGES
            z = _opaque_zero(t)
            tile = kv_smem.index(stage + z)
            if t + 1 < num_tiles:
                nstage = (g + t + 1) % STAGES
                nph = ((g + t + 1) // STAGES) & 1
                nvalid = _valid(idx_ptr, lo + (t + 1) * BLOCK_K, hi, num_kv)
                mbarrier.wait(bars.index(READY + nstage), nph)
                fence_async_shared()
                sn = gl.zeros([BLOCK_K, BLOCK_H], gl.float32, layout=MMA_ST)
                sn = warpgroup_mma(
                    kv_smem.index(nstage + z),
                    q_smem.index(z).permute((1, 0)),
                    sn,
                    use_acc=False,
                    is_async=True,
                )
                p, alpha, m_i, l2 = _softmax(s, valid, m_i, l2, qk_scale)
                acc = acc * alpha[None, :]
                p_smem.index(z).store(p.to(dtype))
                fence_async_shared()
                gl.thread_barrier()
                pv = warpgroup_mma(tile.permute((1, 0)), p_smem.index(z), acc, is_async=True)
                s = warpgroup_mma_wait(1, deps=[sn])
                acc = warpgroup_mma_wait(0, deps=[pv])
                # After both waits: no branch while the PV's accumulator is in flight (the
                # version measured at 86f5834 arrived here between the two waits and failed).
                if t + 2 == num_tiles:
                    _arrive(bars.index(Q_FREE))
                valid = nvalid
            else:
                p, alpha, m_i, l2 = _softmax(s, valid, m_i, l2, qk_scale)
                acc = acc * alpha[None, :]
                p_smem.index(z).store(p.to(dtype))
                fence_async_shared()
                gl.thread_barrier()
                acc = warpgroup_mma(tile.permute((1, 0)), p_smem.index(z), acc, is_async=True)
                acc = warpgroup_mma_wait(0, deps=[acc])
            _arrive(bars.index(FREE + stage))
        g += num_tiles
        _epi(acc, m_i, l2, pid_r, pid_h, sink_ptr, out_ptr, stride_or, stride_oh, num_heads, dtype)
        it += 1  # noqa: SIM113 (Gluon loops have no enumerate)


@gluon.jit
def _consumer_gather_only(
    q_ptr, kv_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr,
    stride_qr, stride_qh, stride_kvn, stride_or, stride_oh, num_heads, num_kv, nnz, qk_scale,
    num_items, q_smem, kv_smem, p_smem, bars,
):  # fmt: skip
    """Ablation: no math, the tiles are released as soon as they land (the producer's bound)."""
    g = 0
    it = 0
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        _, _, _, _, num_tiles = _item_range(item, indptr_ptr, nnz, num_heads, BLOCK_H)
        mbarrier.wait(bars.index(Q_READY), it & 1)
        _arrive(bars.index(Q_FREE))
        for t in range(num_tiles):
            stage = (g + t) % STAGES
            mbarrier.wait(bars.index(READY + stage), ((g + t) // STAGES) & 1)
            _arrive(bars.index(FREE + stage))
        g += num_tiles
        it += 1  # noqa: SIM113 (Gluon loops have no enumerate)


@gluon.jit
def _producer_nogather(
    q_ptr, kv_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr,
    stride_qr, stride_qh, stride_kvn, stride_or, stride_oh, num_heads, num_kv, nnz, qk_scale,
    num_items, q_smem, kv_smem, p_smem, bars,
):  # fmt: skip
    """Ablation: the ring's handshakes without the gathers (the consumer's bound)."""
    offs_hq = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, GATHER))
    offs_c = gl.arange(0, HALF, layout=gl.SliceLayout(0, GATHER))
    g = 0
    it = 0
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        pid_r, pid_h, _, _, num_tiles = _item_range(item, indptr_ptr, nnz, num_heads, BLOCK_H)
        mbarrier.wait(bars.index(Q_FREE), (it & 1) ^ 1)
        _copy_q(
            q_smem.index(0),
            q_ptr,
            pid_r,
            pid_h * BLOCK_H + offs_hq,
            offs_c,
            stride_qr,
            stride_qh,
            num_heads,
        )
        cp.mbarrier_arrive(bars.index(Q_READY), increment_count=False)
        for t in range(num_tiles):
            stage = (g + t) % STAGES
            ph = (((g + t) // STAGES) & 1) ^ 1
            mbarrier.wait(bars.index(FREE + stage), ph)
            cp.mbarrier_arrive(bars.index(READY + stage), increment_count=False)
        g += num_tiles
        it += 1  # noqa: SIM113 (Gluon loops have no enumerate)
    cp.commit_group()
    cp.wait_group(0)


@gluon.jit(do_not_specialize=["nnz"])
def k_pipe(
    q_ptr, kv_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr, stride_qr, stride_qh, stride_kvn,
    stride_or, stride_oh, num_heads, num_kv, nnz, qk_scale, num_items,
):  # fmt: skip
    q_smem, kv_smem, p_smem, bars = _shared_state(q_ptr.dtype.element_ty)
    args = (
        q_ptr, kv_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr, stride_qr, stride_qh, stride_kvn,
        stride_or, stride_oh, num_heads, num_kv, nnz, qk_scale, num_items,
        q_smem, kv_smem, p_smem, bars,
    )  # fmt: skip
    gl.warp_specialize([(_consumer_pipe, args), (_producer, args)], [4], [PRODUCER_REGS])


@gluon.jit(do_not_specialize=["nnz"])
def k_gather_only(
    q_ptr, kv_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr, stride_qr, stride_qh, stride_kvn,
    stride_or, stride_oh, num_heads, num_kv, nnz, qk_scale, num_items,
):  # fmt: skip
    q_smem, kv_smem, p_smem, bars = _shared_state(q_ptr.dtype.element_ty)
    args = (
        q_ptr, kv_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr, stride_qr, stride_qh, stride_kvn,
        stride_or, stride_oh, num_heads, num_kv, nnz, qk_scale, num_items,
        q_smem, kv_smem, p_smem, bars,
    )  # fmt: skip
    gl.warp_specialize([(_consumer_gather_only, args), (_producer, args)], [4], [PRODUCER_REGS])


@gluon.jit(do_not_specialize=["nnz"])
def k_math_only(
    q_ptr, kv_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr, stride_qr, stride_qh, stride_kvn,
    stride_or, stride_oh, num_heads, num_kv, nnz, qk_scale, num_items,
):  # fmt: skip
    q_smem, kv_smem, p_smem, bars = _shared_state(q_ptr.dtype.element_ty)
    args = (
        q_ptr, kv_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr, stride_qr, stride_qh, stride_kvn,
        stride_or, stride_oh, num_heads, num_kv, nnz, qk_scale, num_items,
        q_smem, kv_smem, p_smem, bars,
    )  # fmt: skip
    gl.warp_specialize([(_consumer, args), (_producer_nogather, args)], [4], [PRODUCER_REGS])
