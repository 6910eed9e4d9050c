"""``gluon_ws_small`` with each token's slot list split over SPLITS programs (issue 22's moonshot).

At T = 64 and H <= 48 the heads-on-N kernel has one item a token (two at 33-48 heads), so 64
(or 128) of the H200's 132 SMs work and the call lasts one item: ~9.1-11.8 us against FlashMLA
padded's 12.3 (0.73-0.95; the moonshot asks <= 0.75). Splitting a token's ~640 slots over two
or three programs fills the SMs and shortens the chain: each program walks 1/SPLITS of the
tiles, stores its normalised partial O^T and base-2 LSE (fp32), and the split that arrives last
at its (token, head block) combines them (``algorithm._combine``, the last-arrival form of the
split kernels' fused reduce: an acq_rel arrival counter per group, zero at rest).

Prediction (T = 64, CSA top-k 512 + window 128: 10 tiles a token): an item costs ~2.5 us fixed
(launch, Q, epilogue) + ~0.65 us a tile, so SPLITS = 2 takes ~6 tiles' time: 9.5 -> ~7 us at
H16 (0.57x FlashMLA), H1-16 all under 0.75x; at 17-48 heads (N = 32 tiles) ~11 -> ~8 us. At
T = 256 (256-512 items, 2-4 waves already) little or a loss (the partials' extra traffic).

Shared memory: the epilogue's fp32 layout change (O^T [512, 16] for the partial's stores) takes
32 KiB of scratch, so at 16 heads the ring has 2 tiles, not 3 (sm90 cross-compile: 183,364 bytes;
3 tiles would be 247,876, over the 232,448 limit; 255 registers, no spills, at 16 and 32 heads).

This file is the variant only (producer and consumer as ``hopper_ws_small``'s, the range and the
epilogue split), checked against the fp32 reference (``bench._check``) and timed in turns with
the package's ``gluon_ws_small`` and FlashMLA padded:

    PYTHONPATH=.:.peers python experiments/ws_small_split.py [TxH ...]   # an H200; ~1-2 min
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from turns import add_flashmla, in_turns, main

from sparse_mla import bench
from sparse_mla.gluon import mla_gluon
from sparse_mla.gluon.algorithm import _combine
from sparse_mla.gluon.hopper_ws import (
    GATHER,
    HALF,
    HEAD_DIM,
    M_INIT,
    _arrive,
    _copy_q,
    _gather_half,
    _item_range,
    _opaque_zero,
    _prefetch_ids,
    _slots,
)
from sparse_mla.gluon.hopper_ws_small import (
    BLOCK_H,
    BLOCK_K,
    FREE,
    Q_FREE,
    Q_READY,
    READY,
    STORE,
    _head_groups,
    _producer_regs,
    _shared_state,
    col_st,
    mma_st,
    ring_stages,
    row_st,
)

POINTS = [(T, H) for T in (64, 256) for H in (1, 8, 16, 24, 32, 48)]
LOG2E = 1.4426950408889634


@gluon.jit
def _split_range(item, indptr_ptr, nnz, num_heads, HEADS: gl.constexpr, SPLITS: gl.constexpr):
    """Item ``item``'s token, head block, split and slot range: the group's (token, head
    block) CSR range cut into SPLITS runs of whole 64-slot tiles (the last ones may be empty).
    A group's splits are adjacent items, so they run at the same time."""
    group = item // SPLITS
    split = item % SPLITS
    pid_r, pid_h, lo, hi, num_tiles = _item_range(group, indptr_ptr, nnz, num_heads, HEADS, 0,
                                                  False)  # fmt: skip
    per = (num_tiles + SPLITS - 1) // SPLITS
    lo_s = gl.minimum(lo + (split * per * BLOCK_K).to(gl.int64), hi)
    hi_s = gl.minimum(lo_s + (per * BLOCK_K).to(gl.int64), hi)
    n = ((hi_s - lo_s + BLOCK_K - 1) // BLOCK_K).to(gl.int32)
    return pid_r, pid_h, split, lo_s, hi_s, n


@gluon.jit
def _producer(
    q_ptr, kv_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr, opart_ptr, lsepart_ptr, count_ptr,
    stride_qr, stride_qh, stride_kvn, stride_or, stride_oh, num_heads, num_kv, nnz, qk_scale,
    num_items, q_smem, kv_smem, p_smem, bars, HEAD_GROUPS: gl.constexpr,
    STAGES: gl.constexpr, SPLITS: gl.constexpr, RED: gl.constexpr,
):  # fmt: skip
    heads: gl.constexpr = BLOCK_H * HEAD_GROUPS
    stages: gl.constexpr = ring_stages(HEAD_GROUPS, STAGES)
    _prefetch_ids(idx_ptr, nnz)  # small calls only here
    offs_hq = gl.arange(0, heads, layout=gl.SliceLayout(1, GATHER))
    offs_c = gl.arange(0, HALF, layout=gl.SliceLayout(0, GATHER))
    g = 0
    it = 0
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        pid_r, pid_h, _split, lo, hi, num_tiles = _split_range(
            item, indptr_ptr, nnz, num_heads, heads, SPLITS
        )
        mbarrier.wait(bars.index(Q_FREE), (it & 1) ^ 1)
        _copy_q(q_smem.index(0), q_ptr, pid_r, pid_h * heads + offs_hq, offs_c, stride_qr,
                stride_qh, num_heads)  # fmt: skip
        cp.mbarrier_arrive(bars.index(Q_READY), increment_count=False)
        for t in range(num_tiles):
            stage = (g + t) % stages
            ph = (((g + t) // stages) & 1) ^ 1
            slot = _slots(idx_ptr, lo + t * BLOCK_K, hi, num_kv)
            mbarrier.wait(bars.index(FREE + stage), ph)
            tile = kv_smem.index(stage)
            _gather_half(tile.slice(0, HALF, dim=1), kv_ptr, slot, stride_kvn, 0)
            _gather_half(tile.slice(HALF, HALF, dim=1), kv_ptr, slot, stride_kvn, HALF)
            cp.mbarrier_arrive(bars.index(READY + stage), increment_count=False)
        g += num_tiles
        it += 1  # noqa: SIM113
    cp.commit_group()
    cp.wait_group(0)


@gluon.jit
def _consumer(
    q_ptr, kv_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr, opart_ptr, lsepart_ptr, count_ptr,
    stride_qr, stride_qh, stride_kvn, stride_or, stride_oh, num_heads, num_kv, nnz, qk_scale,
    num_items, q_smem, kv_smem, p_smem, bars, HEAD_GROUPS: gl.constexpr,
    STAGES: gl.constexpr, SPLITS: gl.constexpr, RED: gl.constexpr,
):  # fmt: skip
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    heads: gl.constexpr = BLOCK_H * HEAD_GROUPS
    stages: gl.constexpr = ring_stages(HEAD_GROUPS, STAGES)
    mma: gl.constexpr = mma_st(heads)
    row: gl.constexpr = row_st(heads)
    col: gl.constexpr = col_st(heads)
    num_hb = (num_heads + heads - 1) // heads
    g = 0
    it = 0
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        pid_r, pid_h, split, lo, hi, num_tiles = _split_range(item, indptr_ptr, nnz, num_heads,
                                                              heads, SPLITS)  # fmt: skip
        m_i = gl.full([heads], M_INIT, gl.float32, layout=col)
        l2 = gl.zeros([BLOCK_K, heads], gl.float32, layout=mma)
        acc = gl.zeros([HEAD_DIM, heads], gl.float32, layout=mma)  # O^T
        mbarrier.wait(bars.index(Q_READY), it & 1)
        if num_tiles == 0:
            _arrive(bars.index(Q_FREE))
        for t in range(num_tiles):
            stage = (g + t) % stages
            ph = ((g + t) // stages) & 1
            z = _opaque_zero(t)
            tile = kv_smem.index(stage + z)
            q_tile = q_smem.index(z)
            offs = lo + t * BLOCK_K + gl.arange(0, BLOCK_K, layout=row)
            in_list = offs < hi
            slot = gl.load(idx_ptr + offs, mask=in_list, other=-1).to(gl.int64)
            valid = in_list & (slot >= 0) & (slot < num_kv)
            mbarrier.wait(bars.index(READY + stage), ph)
            fence_async_shared()
            s = gl.zeros([BLOCK_K, heads], gl.float32, layout=mma)
            s = warpgroup_mma(tile, q_tile.permute((1, 0)), s, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(0, deps=[s])
            if t + 1 == num_tiles:
                _arrive(bars.index(Q_FREE))
            s = gl.where(valid[:, None], s * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 0))
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s - m_new[None, :])
            l2 = l2 * alpha[None, :] + p
            m_i = m_new
            acc = acc * alpha[None, :]
            p_smem.index(z).store(p.to(dtype))
            fence_async_shared()
            gl.thread_barrier()
            acc = warpgroup_mma(tile.permute((1, 0)), p_smem.index(z), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=[acc])
            _arrive(bars.index(FREE + stage))
        g += num_tiles

        # This split's normalised partial O^T and base-2 LSE (-inf: no valid slot), then the
        # last of the group's splits to arrive combines them into out.
        l_i = gl.sum(l2, 0)
        l_safe = gl.where(l_i > 0.0, l_i, 1.0)
        o = gl.convert_layout(acc / l_safe[None, :], STORE)  # [512, heads] fp32
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, STORE))
        offs_ho = pid_h * heads + gl.arange(0, heads, layout=gl.SliceLayout(0, STORE))
        part = pid_r * SPLITS + split
        o_ptrs = opart_ptr + (part * num_heads + offs_ho[None, :]) * HEAD_DIM + offs_d[:, None]
        gl.store(o_ptrs, o, mask=(offs_ho < num_heads)[None, :])
        offs_h = pid_h * heads + gl.arange(0, heads, layout=col)
        lse2 = gl.where(l_i > 0.0, m_i + gl.log2(l_safe), float("-inf"))
        gl.store(lsepart_ptr + part * num_heads + offs_h, lse2, mask=offs_h < num_heads)
        gl.thread_barrier()  # every warp's partial stores issued before the arrival
        counter = count_ptr + pid_r * num_hb + pid_h
        arrived = gl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:
            gl.store(counter, 0)
            _combine(
                opart_ptr, lsepart_ptr, sink_ptr, out_ptr, lsepart_ptr, pid_r, pid_h * heads,
                stride_or, stride_oh, num_heads, heads, HEAD_DIM, 128, SPLITS, True, False, RED,
                ".cg",
            )  # fmt: skip
        it += 1  # noqa: SIM113


@gluon.jit(do_not_specialize=["nnz"])
def _ws_small_split_kernel(
    q_ptr, kv_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr, opart_ptr, lsepart_ptr, count_ptr,
    stride_qr, stride_qh, stride_kvn, stride_or, stride_oh, num_heads, num_kv, nnz, qk_scale,
    num_items, HEAD_GROUPS: gl.constexpr = 1, STAGES: gl.constexpr = None,
    PRODUCER_REGS: gl.constexpr = None, SPLITS: gl.constexpr = 2, RED: gl.constexpr = None,
):  # fmt: skip
    """Persistent, grid (min(items, SMs),), items = R x head blocks x SPLITS; num_warps=4."""
    groups: gl.constexpr = _head_groups(HEAD_GROUPS)
    q_smem, kv_smem, p_smem, bars = _shared_state(q_ptr.dtype.element_ty, groups, STAGES)
    gl.warp_specialize(
        [
            (_consumer, (
                q_ptr, kv_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr, opart_ptr, lsepart_ptr,
                count_ptr, stride_qr, stride_qh, stride_kvn, stride_or, stride_oh, num_heads,
                num_kv, nnz, qk_scale, num_items, q_smem, kv_smem, p_smem, bars, groups, STAGES,
                SPLITS, RED,
            )),
            (_producer, (
                q_ptr, kv_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr, opart_ptr, lsepart_ptr,
                count_ptr, stride_qr, stride_qh, stride_kvn, stride_or, stride_oh, num_heads,
                num_kv, nnz, qk_scale, num_items, q_smem, kv_smem, p_smem, bars, groups, STAGES,
                SPLITS, RED,
            )),
        ],
        [4],
        [_producer_regs(PRODUCER_REGS)],
    )  # fmt: skip


RED_LAYOUT = gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0])  # [heads, 128] fp32, 4 warps


class Split:
    """The split launch at one shape, its scratch made once (the counters zero at rest)."""

    def __init__(self, q, kv, idx, indptr, sink, scale, splits):
        R, H, D = q.shape
        self.hg = 1 if H <= 16 else 2
        heads = 16 * self.hg
        self.num_hb = -(-H // heads)
        self.items = R * self.num_hb * splits
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        self.grid = (min(self.items, sms),)
        dev = q.device
        self.opart = torch.empty(R * splits * H * D, dtype=torch.float32, device=dev)
        self.lsepart = torch.empty(R * splits * H, dtype=torch.float32, device=dev)
        self.count = torch.zeros(R * self.num_hb, dtype=torch.int32, device=dev)
        self.sink = sink if sink is not None else torch.full((H,), float("-inf"), device=dev)
        self.args = (q, kv, idx, indptr, scale)
        self.splits = splits

    def __call__(self, out):
        q, kv, idx, indptr, scale = self.args
        _ws_small_split_kernel[self.grid](
            q, kv, idx, indptr, self.sink, out, self.opart, self.lsepart, self.count,
            q.stride(0), q.stride(1), kv.stride(0), out.stride(0), out.stride(1), q.shape[1],
            kv.shape[0], idx.numel(), float(scale) * LOG2E, self.items, HEAD_GROUPS=self.hg,
            STAGES=2, SPLITS=self.splits, RED=RED_LAYOUT, num_warps=4, num_stages=1,
        )  # fmt: skip
        return out


def point(T: int, H: int, dev: torch.device, peers: bench.Peers, splits=(2, 3)) -> str:
    w = bench.GridPoint("dsv4_csa", T, H, bench._grid_topk(H)).build(
        dev, seed=0, sink=True, big_buffer=True
    )
    q, kv, idx, indptr, scale = w.args()
    kv = kv[:, 0, :] if kv.dim() == 3 else kv
    refs = bench._References(w, 256)
    out = torch.empty_like(q)
    fns, names = [], []

    def pkg(o):
        return mla_gluon(q, None, kv, None, idx, indptr, scale, has_pe=False,
                         attn_sink=w.attn_sink, out=o, kernel="gluon_ws_small")  # fmt: skip

    runs = [("ws_small", pkg)] + [
        (f"split{s}", Split(q, kv, idx, indptr, w.attn_sink, scale, s)) for s in splits
    ]
    for name, run in runs:
        ok, _rel, note = bench._check(run, w, 256, refs)
        if not ok:
            return f"T={T:5d} H={H:3d}: {name} WRONG ({note})"
        again = run(torch.full_like(q, float("nan")))  # bitwise repeat, counters back at 0
        first = run(torch.full_like(q, float("nan")))
        torch.cuda.synchronize()
        if not torch.equal(again, first):
            return f"T={T:5d} H={H:3d}: {name} NOT REPEATABLE"
        fns.append(lambda run=run: run(out))
        names.append(name)
    add_flashmla(w, dev, peers, q, fns, names, refs=refs, out=out)
    return in_turns(f"T={T:5d} H={H:3d}", fns, names, lambda n: True)


if __name__ == "__main__":
    main(point, POINTS)
