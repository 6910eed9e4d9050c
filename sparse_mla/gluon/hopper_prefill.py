"""Hopper (sm90) sparse prefill of the Gluon MLA kernel: wgmma with a cp.async ring of KV tiles.

The shared algorithm (``algorithm.py``) runs mma.sync from registers with a double-buffered
gather; at H >= 64 that is slower than the tuned Triton launch, because one CTA per SM computes
and gathers in turn. This kernel keeps the same operator and program shape (one program per
token and block of 64 heads, online softmax in base 2, sink, empty rows zero) but:

- S = Q K^T and O += P V are ``warpgroup_mma`` (wgmma, M = 64) on shared-memory operands in
  the NVMMA swizzled layout: Q resident, the KV tile read as K^T (transposed view) and as V.
  Two warpgroups split the slots of S and the 512 output columns of O ([64, 256] fp32 each).
- KV tiles live in a ring of STAGES shared-memory buffers filled by cp.async gathers issued
  STAGES - 1 tiles ahead, so the gather of tile k + STAGES - 1 is in flight during tile k's
  MMAs. Slot ids are loaded one tile before their gather is issued.
- Invalid slots (s < 0 or s >= N) and the tail past the row's end are masked in the gather:
  cp.async copies 0 bytes and zero-fills, so those V rows are 0 and never read from the pool;
  their logits are -inf.

The epilogue (sink, empty rows, stores, split partials) is ``algorithm._epilogue``, shared
with the other instantiations. The main loop is kept apart from ``algorithm.py`` because the
wgmma operands must stay in shared memory in the NVMMA layout (no register operand chunks)
and the ring depth changes the loop's structure; gfx950 keeps the shared algorithm.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from .algorithm import _combiner, _epilogue, _softmax_step, _split_range, _split_ticket


def layouts(block_h: int, block_k: int, head_dim: int, num_warps: int) -> dict:
    """Host-built layout constexprs for :func:`_prefill_wgmma_kernel` (num_warps = 8)."""
    wn = num_warps // 4  # warpgroups, side by side along N
    return {
        # S [BLOCK_H, BLOCK_K]: each warpgroup owns BLOCK_K / wn slots.
        "MMA_S": gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, wn], instr_shape=[16, block_k // wn, 16]
        ),
        # O [BLOCK_H, HEAD_DIM]: each warpgroup owns HEAD_DIM / wn output columns.
        "MMA_O": gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, wn], instr_shape=[16, min(256, head_dim // wn), 16]
        ),
        # Gathers: 16-byte vectors per lane, one warp per row.
        "GATHER": gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0]),
        "SMEM": gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2),
        "SMEM_P": gl.NVMMASharedLayout(
            swizzle_byte_width=min(128, block_k * 2), element_bitwidth=16, rank=2
        ),
    }


@gluon.jit
def _load_slots(idx_ptr, offs_s, hi, num_kv):
    """Slot ids at CSR positions ``offs_s`` (int64) and whether each is a valid pool row."""
    slot = gl.load(idx_ptr + offs_s, mask=offs_s < hi, other=-1).to(gl.int64)
    valid = (offs_s < hi) & (slot >= 0) & (slot < num_kv)
    return slot, valid


@gluon.jit
def _gather_tile(smem, kv_ptr, slot, valid, stride_kvn, offs_d):
    """cp.async the KV rows ``slot`` ([BLOCK_K]) into ``smem``; invalid ones are zero-filled."""
    ptrs = kv_ptr + (slot * stride_kvn)[:, None] + offs_d[None, :]  # [BLOCK_K, HEAD_DIM]
    # Rows start 16-byte aligned (checked on the host): 16-byte cp.async per lane.
    ptrs = gl.max_contiguous(gl.multiple_of(ptrs, [16, 16]), [1, 8])
    cp.async_copy_global_to_shared(smem, ptrs, mask=valid[:, None])
    cp.commit_group()


@gluon.jit(do_not_specialize=["nnz"])
def _prefill_wgmma_kernel(
    q_ptr,  # [R, H, HEAD_DIM]
    kv_ptr,  # [N, HEAD_DIM]
    idx_ptr,  # [nnz] int32 | int64
    indptr_ptr,  # [R + 1]
    sink_ptr,  # [H] fp32 (unused without HAS_SINK)
    out_ptr,  # [R, H, HEAD_DIM]
    lse_ptr,  # [R, H] fp32 (written under WRITE_LSE)
    opart_ptr,  # [R, NUM_SPLITS, H, HEAD_DIM] fp32 (NUM_SPLITS > 1)
    lsepart_ptr,  # [R, NUM_SPLITS, H] fp32, base-2 (NUM_SPLITS > 1)
    count_ptr,  # [R * cdiv(H, BLOCK_H)] int32, zero at rest (FUSED_REDUCE)
    stride_qr,
    stride_qh,
    stride_kvn,
    stride_or,
    stride_oh,
    num_heads,
    num_kv,
    nnz,  # kv_indices.numel(): each row's CSR range is clamped to [0, nnz]
    qk_scale,  # sm_scale * log2(e)
    BLOCK_H: gl.constexpr,
    BLOCK_K: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    STAGES: gl.constexpr,
    HAS_SINK: gl.constexpr,
    NUM_SPLITS: gl.constexpr,
    WRITE_LSE: gl.constexpr,
    MMA_S: gl.constexpr,
    MMA_O: gl.constexpr,
    GATHER: gl.constexpr,
    SMEM: gl.constexpr,
    SMEM_P: gl.constexpr,
    FUSED_REDUCE: gl.constexpr,
    RED: gl.constexpr,
    COMBINERS: gl.constexpr = 0,  # > 0: combiner programs after the splits (_combiner)
):
    """Axis 0 is (token, head block), head blocks of a token adjacent (they share its rows in
    L2), axis 1 the KV split; with ``COMBINERS`` > 0 one axis of R x blocks x (NUM_SPLITS +
    COMBINERS) programs whose roles come from work tickets in start order, the splits' first
    (``algorithm._ticket``, ``algorithm._combiner``)."""
    ROW_S: gl.constexpr = gl.SliceLayout(1, MMA_S)  # per-head vectors of the S tile
    COL_S: gl.constexpr = gl.SliceLayout(0, MMA_S)  # per-slot vectors of the S tile
    ROW_O: gl.constexpr = gl.SliceLayout(1, MMA_O)
    COL_O: gl.constexpr = gl.SliceLayout(0, MMA_O)
    dtype: gl.constexpr = q_ptr.dtype.element_ty

    num_hb = gl.cdiv(num_heads, BLOCK_H)
    if COMBINERS > 0:
        groups, pid, pid_s, work, comb = _split_ticket(count_ptr, NUM_SPLITS, COMBINERS)
    else:
        pid = gl.program_id(0)
        pid_s = gl.program_id(1)
        work: gl.constexpr = True  # the branch below is the kernel's only path
    pid_h = pid % num_hb
    pid_r = (pid // num_hb).to(gl.int64)
    if work:  # (token pid_r, head block pid_h, KV split pid_s)
        # ---- Q -> shared memory (NVMMA layout), once per program.
        offs_hg = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, GATHER))
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, GATHER))
        q_ptrs = q_ptr + pid_r * stride_qr + offs_hg[:, None] * stride_qh + offs_d[None, :]
        q = gl.load(q_ptrs, mask=(offs_hg < num_heads)[:, None], other=0.0)  # [BLOCK_H, HEAD_DIM]
        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, HEAD_DIM], SMEM, q)
        kv_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, HEAD_DIM], SMEM)
        p_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_K], SMEM_P)

        # ---- This split's slot range [lo, hi) of the row's CSR list (int64 positions).
        lo, hi, num_tiles = _split_range(indptr_ptr, nnz, pid_r, pid_s, NUM_SPLITS, BLOCK_K)

        # ---- Prologue: gathers of tiles 0 .. STAGES-2 in flight (past hi they copy nothing).
        offs_k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, GATHER))
        for t in gl.static_range(STAGES - 1):
            slot, valid = _load_slots(idx_ptr, lo + t * BLOCK_K + offs_k, hi, num_kv)
            _gather_tile(kv_smem.index(t), kv_ptr, slot, valid, stride_kvn, offs_d)
        # Ids of the next tile to gather, loaded one iteration before its gather is issued.
        slot_n, valid_n = _load_slots(idx_ptr, lo + (STAGES - 1) * BLOCK_K + offs_k, hi, num_kv)

        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=ROW_S)
        l_i = gl.zeros([BLOCK_H], gl.float32, layout=ROW_S)
        acc = gl.zeros([BLOCK_H, HEAD_DIM], gl.float32, layout=MMA_O)
        s_zero = gl.zeros([BLOCK_H, BLOCK_K], gl.float32, layout=MMA_S)
        offs_c = gl.arange(0, BLOCK_K, layout=COL_S)

        for it in range(num_tiles):
            stage = it % STAGES
            # This tile's ids again for the logit mask (an L1/L2 hit), consumed after S.
            offs_sc = lo + it * BLOCK_K + offs_c
            _, valid_c = _load_slots(idx_ptr, offs_sc, hi, num_kv)  # [BLOCK_K]

            # Every warp is done with tile it-1, whose buffer the gather of tile it+STAGES-1 reuses.
            gl.thread_barrier()
            _gather_tile(
                kv_smem.index((it + STAGES - 1) % STAGES),
                kv_ptr,
                slot_n,
                valid_n,
                stride_kvn,
                offs_d,
            )
            offs_n = lo + (it + STAGES) * BLOCK_K + offs_k
            slot_n, valid_n = _load_slots(idx_ptr, offs_n, hi, num_kv)
            cp.wait_group(STAGES - 1)  # this thread's copies of tile it have landed
            # cp.async writes are generic-proxy; wgmma reads through the async proxy.
            fence_async_shared()
            gl.thread_barrier()  # ... and every other thread's
            kv_tile = kv_smem.index(stage)  # [BLOCK_K, HEAD_DIM]

            qk = warpgroup_mma(q_smem, kv_tile.permute((1, 0)), s_zero, use_acc=False)
            qk = gl.where(valid_c[None, :], qk * qk_scale, float("-inf"))  # [BLOCK_H, BLOCK_K]
            p, alpha, m_i, l_i = _softmax_step(qk, m_i, l_i)

            # P through shared memory: both warpgroups need all of it as the A operand of O.
            p_smem.store(p.to(dtype))
            fence_async_shared()
            gl.thread_barrier()
            acc = acc * gl.convert_layout(alpha, ROW_O)[:, None]
            # Invalid and tail rows of V were zero-filled by the gather: 0 * 0, never NaN.
            acc = warpgroup_mma(p_smem, kv_tile, acc)
        cp.wait_group(0)

        _epilogue(
            acc, m_i, l_i, pid_r, pid_h, pid_s, sink_ptr, out_ptr, lse_ptr, opart_ptr, lsepart_ptr,
            stride_or, stride_oh, num_heads, count_ptr, BLOCK_H, HEAD_DIM, HAS_SINK, NUM_SPLITS,
            WRITE_LSE, ROW_S, ROW_O, COL_O, FUSED_REDUCE, RED, COMBINERS,
        )  # fmt: skip
    else:
        _combiner(
            comb, groups, groups // num_hb, count_ptr, opart_ptr,
            lsepart_ptr, sink_ptr, out_ptr, lse_ptr, stride_or, stride_oh, num_heads, BLOCK_H,
            HEAD_DIM, NUM_SPLITS, HAS_SINK, WRITE_LSE, RED, COMBINERS, False,
        )  # fmt: skip
