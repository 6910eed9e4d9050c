"""gluon_ws_small_fp8 with a shared-memory staging ring for the raw FP8 bytes (issue 25; not
measured yet). PERF_NOTES ("The FP8 cache on Hopper", "Why the register path is slow") has the
evidence behind it and the prediction.

The package kernel's producers ``ld.global`` each slot's 576 + 7 bytes into registers (34 loads
a lane a tile, 14 of them single scale bytes) through the L1, whose data array is what the
220 KiB of shared memory leave of the SM's 256 KiB, and which the loads' fills and reads share
with the consumer's wgmma operand reads. Here the bytes go the bf16 kernel's way instead:

- a **loader** warpgroup cp.asyncs (16-byte ``LDGSTS.BYPASS``, no L1 line allocated; the scale
  words 4 bytes a lane) each tile's NoPE (seven [64 rows, 64 B] planes), RoPE ([64, 128 B]) and
  scale words (two [64] word planes) into a 2-slot staging ring (37,376 bytes a slot), up to
  two tiles ahead of the dequantization, and arrives on the slot's ``full`` barrier as its
  copies land (128 arrivals, as the bf16 producer's ``ready``); it also copies each item's Q,
  after the item's first tile;
- ``DEQ`` (1 or 2) **dequant** warpgroups take the tiles round-robin: wait ``full``, read the
  whole slot into registers (18 ``LDS.128`` + 4 ``LDS.32`` a lane, conflict-free: a quarter-warp
  reads 128 contiguous bytes), free the slot (one arrival), wait for a free bf16 tile, dequantize
  and store it (the package's conflict-free ``STS.128`` pattern), fence, arrive ``ready``;
- the consumer is the package's, unchanged, on a 2-tile bf16 ring (a third 64 KiB tile does not
  fit beside the staging ring: Q 16 KiB + ring 128 KiB + P^T 2 KiB + staging 73 KiB).

The dequantization gives the package's bits with 3 integer instructions a value pair (the
package's compile to ~4.25): a byte permute that also writes each byte's sign over the byte
above it, a shift by 4 and one mask (``_dequant_words``) instead of a permute, two masks and a
shift-or; then the same two bf16x2 multiplies (2^120, then the scale).

Ablations (timed only): ``NULL_CONSUMER`` replaces the consumer by one that frees each tile as
it lands (the producers' own tile rate; no output), for this kernel (``stage2_gather``) and for
the package's producers (``pkg_gather``); ``pkg_noload`` runs the package kernel with
``num_slots = 0``, so every slot is invalid: its loads are predicated off but it still
dequantizes (zeros), stores and runs the consumer (all logits -inf): the kernel minus the global
loads; ``OLD_DQ`` (``stage2_olddq``) dequantizes with the package's instruction sequence (same
bits), to separate the staging from the cheaper dequantization.

``python experiments/fp8_stage.py`` on the H200 (repository root, ``PYTHONPATH=.``): checks the
variant against the package's fp32 reference (NaN-poisoned out, random inputs, edge cases),
then times it beside the package kernel and the bf16 kernel on the dequantized pool
(``triton.testing.do_bench`` medians, one process) and prints a table.
"""

from __future__ import annotations

import dataclasses
import math
import sys

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from sparse_mla.gluon import hopper_fp8 as K
from sparse_mla.gluon.hopper_ws import GATHER, HALF, _arrive, _copy_q
from sparse_mla.gluon.hopper_ws_small import (
    BLOCK_H,
    BLOCK_K,
    FREE,
    Q_FREE,
    Q_READY,
    READY,
    _consumer,
    _shared_state,
    ring_stages,
)

RING = gl.constexpr(2)  # bf16 tiles (the consumer's ring)
SLOTS = gl.constexpr(2)  # staging slots (tiles of raw bytes)
NCHUNK = gl.constexpr(7)  # NoPE chunks of 64 e4m3 bytes
# Staging barriers: FULL + s (the loader's 128 lanes, as their cp.asyncs land), EMPTY + s (one
# arrival: a dequant warpgroup has read the slot).
FULL = gl.constexpr(0)
EMPTY = gl.constexpr(2)
LOADER_REGS = gl.constexpr(64)

# [64 rows, 16 words] (a NoPE chunk, 64 bytes a row): 4 lanes x 16 bytes a row, 8 rows a warp
# instruction; a lane's rows are lane // 4 + 8 warp + 32 i, as hopper_fp8's (K.ROWS is its
# row slice). A quarter-warp covers rows r, r + 1 of a 64-byte-row plane: 128 contiguous bytes.
CHUNK_L = gl.constexpr(gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0]))
# [64 rows, 32 words] (RoPE, 128 bytes a row): 8 lanes x 16 bytes a row, 4 rows a warp
# instruction, so a quarter-warp reads one 128-byte row of its plane and writes 8 distinct
# 16-byte units of the tile's last 128-byte swizzle atom.
ROPE_L = gl.constexpr(gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0]))
# Plain row-major staging (a layout names the rank of one slot's view; the allocation has one
# more, leading, dimension).
STAGED = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))
STAGED1 = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))


@gluon.jit
def _dequant_words(w, scale2):
    """As hopper_fp8._dequant_words (same bits), with ``prmt``'s sign replication: the bytes
    b0, b1 become [sign(b1) b1 sign(b0) b0]; shifted left by 4 and masked with 0x87F087F0 each
    half is bf16 [s 0000 eeee mmm 0000] = x 2^-120 (subnormals included)."""
    return gl.inline_asm_elementwise(
        """
        {
        .reg .b32 z, c, t0, t1;
        mov.b32 z, 0;
        mov.b32 c, 0x7B807B80;
        prmt.b32 t0, $2, z, 0x9180;
        prmt.b32 t1, $2, z, 0xB3A2;
        shl.b32 t0, t0, 4;
        shl.b32 t1, t1, 4;
        and.b32 t0, t0, 0x87F087F0;
        and.b32 t1, t1, 0x87F087F0;
        mul.rn.bf16x2 t0, t0, c;
        mul.rn.bf16x2 t1, t1, c;
        mul.rn.bf16x2 $0, t0, $3;
        mul.rn.bf16x2 $1, t1, $3;
        }
        """,
        "=r,=r,r,r",
        [w, scale2],
        dtype=(gl.int32, gl.int32),
        is_pure=True,
        pack=1,
    )


@gluon.jit
def _rows_in(idx_ptr, pos0, hi, num_slots, block_size, block_shift, stride_block,
             LAYOUT: gl.constexpr, POW2: gl.constexpr):  # fmt: skip
    """hopper_fp8._rows in a given [64] layout: validity, byte offsets of [NoPE | RoPE] and of
    the scales (invalid: 0, never read)."""
    offs = pos0 + gl.arange(0, BLOCK_K, layout=LAYOUT)
    in_list = offs < hi
    slot = gl.load(idx_ptr + offs, mask=in_list, other=-1).to(gl.int64)
    valid = in_list & (slot >= 0) & (slot < num_slots)
    s = gl.where(valid, slot, 0).to(gl.int32)
    if POW2:
        blk = s >> block_shift
        tok = s & (block_size - 1)
    else:
        blk = s // block_size
        tok = s - blk * block_size
    base = blk.to(gl.int64) * stride_block
    row = base + tok * K.ROW_BYTES
    scl = base + block_size * K.ROW_BYTES + tok * K.SCALE_BYTES
    return valid, row, scl


@gluon.jit
def _issue(cache_ptr, nope_st, rope_st, scl_st, slot, idx_ptr, pos0, hi, num_slots, block_size,
           block_shift, stride_block, POW2: gl.constexpr):  # fmt: skip
    """cp.async one tile's raw bytes into staging slot ``slot`` (invalid rows zero-filled)."""
    valid, row, scl = _rows_in(idx_ptr, pos0, hi, num_slots, block_size, block_shift,
                               stride_block, K.ROWS, POW2)  # fmt: skip
    offs_w = gl.arange(0, 16, layout=gl.SliceLayout(0, CHUNK_L))
    for ch in gl.static_range(NCHUNK):
        base = (cache_ptr + row + ch * 64).to(gl.pointer_type(gl.int32))
        ptrs = gl.max_contiguous(gl.multiple_of(base[:, None] + offs_w[None, :], [16, 16]), [1, 4])
        cp.async_copy_global_to_shared(nope_st.index(slot * NCHUNK + ch), ptrs,
                                       mask=valid[:, None], cache_modifier=".cg")  # fmt: skip
    # RoPE: a [64, 128 B] plane written in K.ROPE's lanes (the rows above; the fill is 2-way
    # bank-conflicted, 8 KiB a tile); the dequant reads it back 8 lanes a row (ROPE_L).
    offs_r = gl.arange(0, 32, layout=gl.SliceLayout(0, K.ROPE))
    rbase = (cache_ptr + row + K.NOPE).to(gl.pointer_type(gl.int32))
    rptrs = gl.max_contiguous(gl.multiple_of(rbase[:, None] + offs_r[None, :], [16, 16]), [1, 4])
    cp.async_copy_global_to_shared(rope_st.index(slot), rptrs, mask=valid[:, None],
                                   cache_modifier=".cg")  # fmt: skip
    # The scale words: 4-byte copies (cp.async.ca), the rows' 4 lanes each copying the same.
    sptrs = (cache_ptr + scl).to(gl.pointer_type(gl.int32))
    cp.async_copy_global_to_shared(scl_st.index(slot * 2), sptrs, mask=valid)
    cp.async_copy_global_to_shared(scl_st.index(slot * 2 + 1), sptrs + 1, mask=valid)


@gluon.jit
def _issue_tile(cache_ptr, nope_st, rope_st, scl_st, sbars, n, idx_ptr, pos0, hi, num_slots,
                block_size, block_shift, stride_block, POW2: gl.constexpr):  # fmt: skip
    """The program's tile ``n``: wait for its staging slot, cp.async its bytes, and have each
    lane arrive on the slot's ``full`` barrier once its copies land."""
    s = n % SLOTS
    mbarrier.wait(sbars.index(EMPTY + s), ((n // SLOTS) & 1) ^ 1)
    _issue(cache_ptr, nope_st, rope_st, scl_st, s, idx_ptr, pos0, hi, num_slots, block_size,
           block_shift, stride_block, POW2)  # fmt: skip
    cp.mbarrier_arrive(sbars.index(FULL + s), increment_count=False)


@gluon.jit
def _loader(q_ptr, cache_ptr, idx_ptr, indptr_ptr, stride_qr, stride_qh, stride_block, num_heads,
            num_slots, nnz, num_items, block_size, block_shift, q_smem, nope_st, rope_st, scl_st,
            bars, sbars, POW2: gl.constexpr):  # fmt: skip
    """Every tile's raw bytes into the staging ring as slots free up, and each item's Q: after
    the item's first tile, so that tile is not held behind the wait for the previous item's
    last S^T (Q's buffer is single)."""
    offs_hq = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, GATHER))
    offs_c = gl.arange(0, HALF, layout=gl.SliceLayout(0, GATHER))
    g = 0
    it = 0
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        pid_r, pid_h, lo, hi, num_tiles = K._csr_range(item, indptr_ptr, nnz, num_heads, BLOCK_H)
        if num_tiles > 0:
            _issue_tile(cache_ptr, nope_st, rope_st, scl_st, sbars, g, idx_ptr, lo, hi,
                        num_slots, block_size, block_shift, stride_block, POW2)  # fmt: skip
        mbarrier.wait(bars.index(Q_FREE), (it & 1) ^ 1)
        _copy_q(q_smem.index(0), q_ptr, pid_r, pid_h * BLOCK_H + offs_hq, offs_c, stride_qr,
                stride_qh, num_heads)  # fmt: skip
        cp.mbarrier_arrive(bars.index(Q_READY), increment_count=False)
        for t in range(1, num_tiles):
            _issue_tile(cache_ptr, nope_st, rope_st, scl_st, sbars, g + t, idx_ptr,
                        lo + t * BLOCK_K, hi, num_slots, block_size, block_shift, stride_block,
                        POW2)  # fmt: skip
        g += num_tiles
        it += 1  # noqa: SIM113 (Gluon loops have no enumerate)
    cp.commit_group()
    cp.wait_group(0)


@gluon.jit
def _scale_word(scl_st, s, j: gl.constexpr):
    return scl_st.index(s * 2 + j).load(K.ROWS)


@gluon.jit
def _store_chunk(words, w, sw, ch: gl.constexpr, OLD_DQ: gl.constexpr):
    """Dequantize NoPE chunk ``ch`` ([64, 16] words in CHUNK_L) with its scale byte (byte
    ch % 4 of the rows' scale word ``sw``) into the tile's words [ch 32, ch 32 + 32);
    ``OLD_DQ``: with the package's instruction sequence (the same bits)."""
    e = (sw >> (8 * (ch % 4))) & 0xFF
    if OLD_DQ:
        lo, hi = K._dequant_words(w, K._scale_bf16x2(e)[:, None])
    else:
        lo, hi = _dequant_words(w, K._scale_bf16x2(e)[:, None])
    words.slice(ch * 32, 32, dim=1).store(gl.join(lo, hi).reshape([BLOCK_K, 32]))


@gluon.jit
def _dequant(indptr_ptr, nnz, num_heads, num_items, kv_smem, nope_st, rope_st, scl_st, bars,
             sbars, PID: gl.constexpr, NDEQ: gl.constexpr, OLD_DQ: gl.constexpr):  # fmt: skip
    """Dequant warpgroup ``PID`` of ``NDEQ``: tiles g = PID, PID + NDEQ, ... of the program."""
    g = 0
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        _, _, _, _, num_tiles = K._csr_range(item, indptr_ptr, nnz, num_heads, BLOCK_H)
        t0 = (PID + NDEQ - g % NDEQ) % NDEQ
        for t in range(t0, num_tiles, NDEQ):
            s = (g + t) % SLOTS
            mbarrier.wait(sbars.index(FULL + s), ((g + t) // SLOTS) & 1)
            x0 = nope_st.index(s * NCHUNK + 0).load(CHUNK_L)
            x1 = nope_st.index(s * NCHUNK + 1).load(CHUNK_L)
            x2 = nope_st.index(s * NCHUNK + 2).load(CHUNK_L)
            x3 = nope_st.index(s * NCHUNK + 3).load(CHUNK_L)
            x4 = nope_st.index(s * NCHUNK + 4).load(CHUNK_L)
            x5 = nope_st.index(s * NCHUNK + 5).load(CHUNK_L)
            x6 = nope_st.index(s * NCHUNK + 6).load(CHUNK_L)
            rope = rope_st.index(s).load(ROPE_L)
            s0 = _scale_word(scl_st, s, 0)
            s1 = _scale_word(scl_st, s, 1)
            _arrive(sbars.index(EMPTY + s))  # the slot is in registers: the loader may refill it
            stage = (g + t) % RING
            mbarrier.wait(bars.index(FREE + stage), (((g + t) // RING) & 1) ^ 1)
            words = kv_smem.index(stage)._reinterpret(gl.int32, [BLOCK_K, 256], K.WORDS)
            _store_chunk(words, x0, s0, 0, OLD_DQ)
            _store_chunk(words, x1, s0, 1, OLD_DQ)
            _store_chunk(words, x2, s0, 2, OLD_DQ)
            _store_chunk(words, x3, s0, 3, OLD_DQ)
            _store_chunk(words, x4, s1, 4, OLD_DQ)
            _store_chunk(words, x5, s1, 5, OLD_DQ)
            _store_chunk(words, x6, s1, 6, OLD_DQ)
            words.slice(K.NOPE // 2, 32, dim=1).store(rope)
            fence_async_shared()  # generic-proxy stores before wgmma's reads
            _arrive(bars.index(READY + stage))
        g += num_tiles


@gluon.jit
def _consumer_null(
    q_ptr, kv_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr,
    stride_qr, stride_qh, stride_kvn, stride_or, stride_oh, num_heads, num_kv, nnz, qk_scale,
    num_items, ids_per_row, q_smem, kv_smem, p_smem, bars, HEAD_GROUPS: gl.constexpr = 1,
    STAGES: gl.constexpr = None, DENSE_IDS: gl.constexpr = False,
):  # fmt: skip
    """Ablation: the consumer's handshakes only (each tile freed as it lands; no math, no
    output): the producers' own tile rate."""
    stages: gl.constexpr = ring_stages(HEAD_GROUPS, STAGES)
    g = 0
    it = 0
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        _, _, _, _, num_tiles = K._csr_range(item, indptr_ptr, nnz, num_heads, BLOCK_H)
        mbarrier.wait(bars.index(Q_READY), it & 1)
        for t in range(num_tiles):
            stage = (g + t) % stages
            mbarrier.wait(bars.index(READY + stage), ((g + t) // stages) & 1)
            _arrive(bars.index(FREE + stage))
        _arrive(bars.index(Q_FREE))
        g += num_tiles
        it += 1  # noqa: SIM113


@gluon.jit
def _consumer_any(
    q_ptr, kv_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr,
    stride_qr, stride_qh, stride_kvn, stride_or, stride_oh, num_heads, num_kv, nnz, qk_scale,
    num_items, q_smem, kv_smem, p_smem, bars, NULL_CONSUMER: gl.constexpr,
):  # fmt: skip
    """The package's consumer on the 2-tile ring, or (NULL_CONSUMER) the ablation's."""
    if NULL_CONSUMER:
        _consumer_null(q_ptr, kv_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr, stride_qr,
                       stride_qh, stride_kvn, stride_or, stride_oh, num_heads, num_kv, nnz,
                       qk_scale, num_items, 0, q_smem, kv_smem, p_smem, bars, 1, RING,
                       False)  # fmt: skip
    else:
        _consumer(q_ptr, kv_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr, stride_qr, stride_qh,
                  stride_kvn, stride_or, stride_oh, num_heads, num_kv, nnz, qk_scale, num_items,
                  0, q_smem, kv_smem, p_smem, bars, 1, RING, False)  # fmt: skip


@gluon.jit(do_not_specialize=["nnz"])
def k_stage(
    q_ptr, cache_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr, stride_qr, stride_qh,
    stride_block, stride_or, stride_oh, num_heads, num_slots, nnz, qk_scale, num_items,
    block_size, block_shift, DEQ: gl.constexpr = 2, DEQ_REGS: gl.constexpr = 136,
    NULL_CONSUMER: gl.constexpr = False, POW2: gl.constexpr = True, OLD_DQ: gl.constexpr = False,
):  # fmt: skip
    """The staged kernel (CSR lists, H <= 16): consumer (default partition, 4 warps), loader
    (4 warps), DEQ dequant warpgroups. Persistent grid (min(items, SMs),), num_warps=4."""
    q_smem, kv_smem, p_smem, bars = _shared_state(gl.bfloat16, 1, RING, 1)
    nope_st = gl.allocate_shared_memory(gl.int32, [SLOTS * NCHUNK, BLOCK_K, 16], STAGED)
    rope_st = gl.allocate_shared_memory(gl.int32, [SLOTS, BLOCK_K, 32], STAGED)
    scl_st = gl.allocate_shared_memory(gl.int32, [SLOTS * 2, BLOCK_K], STAGED1)
    sbars = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(SLOTS):
        mbarrier.init(sbars.index(FULL + i), count=128)
        mbarrier.init(sbars.index(EMPTY + i), count=1)
    if DEQ == 1:
        gl.warp_specialize(
            [
            (_consumer_any, (
                q_ptr, cache_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr, stride_qr, stride_qh,
                stride_block, stride_or, stride_oh, num_heads, num_slots, nnz, qk_scale,
                num_items, q_smem, kv_smem, p_smem, bars, NULL_CONSUMER,
            )),
            (_loader, (
                q_ptr, cache_ptr, idx_ptr, indptr_ptr, stride_qr, stride_qh, stride_block,
                num_heads, num_slots, nnz, num_items, block_size, block_shift, q_smem, nope_st,
                rope_st, scl_st, bars, sbars, POW2,
            )),
            (_dequant, (
                indptr_ptr, nnz, num_heads, num_items, kv_smem, nope_st, rope_st, scl_st, bars,
                sbars, 0, 1, OLD_DQ,
            )),
            ],
            [4, 4],
            [LOADER_REGS, DEQ_REGS],
        )  # fmt: skip
    else:
        gl.warp_specialize(
            [
            (_consumer_any, (
                q_ptr, cache_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr, stride_qr, stride_qh,
                stride_block, stride_or, stride_oh, num_heads, num_slots, nnz, qk_scale,
                num_items, q_smem, kv_smem, p_smem, bars, NULL_CONSUMER,
            )),
            (_loader, (
                q_ptr, cache_ptr, idx_ptr, indptr_ptr, stride_qr, stride_qh, stride_block,
                num_heads, num_slots, nnz, num_items, block_size, block_shift, q_smem, nope_st,
                rope_st, scl_st, bars, sbars, POW2,
            )),
            (_dequant, (
                indptr_ptr, nnz, num_heads, num_items, kv_smem, nope_st, rope_st, scl_st, bars,
                sbars, 0, 2, OLD_DQ,
            )),
            (_dequant, (
                indptr_ptr, nnz, num_heads, num_items, kv_smem, nope_st, rope_st, scl_st, bars,
                sbars, 1, 2, OLD_DQ,
            )),
            ],
            [4, 4, 4],
            [LOADER_REGS, DEQ_REGS, DEQ_REGS],
        )  # fmt: skip


@gluon.jit(do_not_specialize=["nnz"])
def k_pkg_gather(
    q_ptr, cache_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr, stride_qr, stride_qh,
    stride_block, stride_or, stride_oh, num_heads, num_slots, nnz, qk_scale, num_items,
    block_size, block_shift, POW2: gl.constexpr = True,
):  # fmt: skip
    """Ablation: the package's two producers (its default launch) and a consumer that frees each
    tile as it lands."""
    q_smem, kv_smem, p_smem, bars = _shared_state(gl.bfloat16, 1, None, 1)
    gl.warp_specialize(
        [
        (_consumer_null, (
            q_ptr, cache_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr, stride_qr, stride_qh,
            stride_block, stride_or, stride_oh, num_heads, num_slots, nnz, qk_scale,
            num_items, 0, q_smem, kv_smem, p_smem, bars, 1, None, False,
        )),
        (K._producer, (
            q_ptr, cache_ptr, idx_ptr, indptr_ptr, stride_qr, stride_qh, stride_block,
            num_heads, num_slots, nnz, num_items, block_size, block_shift, q_smem, kv_smem,
            bars, 1, None, POW2, False, 0, 2,
        )),
        (K._producer, (
            q_ptr, cache_ptr, idx_ptr, indptr_ptr, stride_qr, stride_qh, stride_block,
            num_heads, num_slots, nnz, num_items, block_size, block_shift, q_smem, kv_smem,
            bars, 1, None, POW2, False, 1, 2,
        )),
        ],
        [4, 4],
        [K.PRODUCER_REGS, K.PRODUCER_REGS],
    )  # fmt: skip


SIGNATURE = {
    "q_ptr": "*bf16", "cache_ptr": "*u8", "idx_ptr": "*i32", "indptr_ptr": "*i32",
    "sink_ptr": "*fp32", "out_ptr": "*bf16", "stride_qr": "i32", "stride_qh": "i32",
    "stride_block": "i64", "stride_or": "i32", "stride_oh": "i32", "num_heads": "i32",
    "num_slots": "i32", "nnz": "i32", "qk_scale": "fp32", "num_items": "i32",
    "block_size": "i32", "block_shift": "i32",
}  # fmt: skip


def cross_compile(kernel, **constexprs):
    """Compile ``kernel`` for sm90 on a machine without a GPU (CPU checks): the compiled
    kernel, ``REG:.. SHARED:.. LOCAL:..`` and the SASS."""
    import triton
    from triton.experimental.gluon._runtime import GluonASTSource

    from sparse_mla.gluon.launch import compile_attrs, get_target
    from sparse_mla.inspect import _cuobjdump

    # Every parameter in the kernel's order, the constexprs with their values or defaults (a
    # signature keyed out of order binds constexprs to the wrong parameters).
    sig, cx = {}, {}
    for p in kernel.params:
        if p.name in SIGNATURE:
            sig[p.name] = SIGNATURE[p.name]
        else:
            sig[p.name] = "constexpr"
            cx[p.name] = constexprs.get(p.name, p.default)
    src = GluonASTSource(kernel, sig, cx, compile_attrs(kernel, sig))
    c = triton.compile(src, target=get_target("sm90").gpu_target(),
                       options={"num_warps": 4, "num_stages": 1})  # fmt: skip
    usage = _cuobjdump(c.asm["cubin"], "--dump-resource-usage").strip().splitlines()[-1]
    return c, usage.strip(), _cuobjdump(c.asm["cubin"], "--dump-sass")


def _launch(kernel, w, cache, out, num_slots=None, **constexprs):
    """Launch a kernel of this file (or the package's FP8 kernel) with launch_fp8.run's
    arguments."""
    from sparse_mla._consts import LOG2E
    from sparse_mla.gluon import launch as L

    q = w.q
    R, H, _ = q.shape
    sink = L._no_sink(H, q.device) if w.attn_sink is None else w.attn_sink.contiguous()
    items = R * math.ceil(H / BLOCK_H.value)
    grid = (min(items, L._num_compute_units(q.device.index or 0)),)
    bs = cache.block_size
    kernel[grid](
        q, cache.kernel_bytes(), w.kv_indices, w.kv_indptr, sink, out, q.stride(0), q.stride(1),
        cache.block_stride, out.stride(0), out.stride(1), H,
        cache.num_slots if num_slots is None else num_slots, w.kv_indices.numel(),
        float(w.softmax_scale) * LOG2E, items, bs, int(math.log2(bs)),
        num_warps=4, **constexprs,
    )  # fmt: skip
    return out


def _check(name, fn, w, deq):
    """NaN-poisoned out, fp32 reference over the dequantized rows."""
    import torch

    from sparse_mla.reference import check_against_reference

    out = torch.full_like(w.q, float("nan"))
    fn(out)
    torch.cuda.synchronize()
    rep = check_against_reference(out, w.q, deq, w.kv_indices, w.kv_indptr, w.softmax_scale,
                                  attn_sink=w.attn_sink)  # fmt: skip
    written = not torch.isnan(out).any().item()
    return bool(rep.ok) and written, rep


def main() -> int:
    import torch
    import triton

    from sparse_mla import fp8 as F
    from sparse_mla import sparse_mla_prefill
    from sparse_mla import workloads as W
    from sparse_mla.gluon.launch_fp8 import FP8SmallConfig

    torch.manual_seed(0)
    variants = {
        "stage2": lambda w, c, o: _launch(k_stage, w, c, o, DEQ=2, DEQ_REGS=136),
        "stage1": lambda w, c, o: _launch(k_stage, w, c, o, DEQ=1, DEQ_REGS=152),
    }
    ok_all = True
    # Checks: random workloads (fresh seeds), block sizes 64 and 2 (many blocks), one with
    # absent ids (-1, past the cache) and an empty list, and the CSA point timed below; each with
    # NaN-poisoned out.
    for T, H, topk, seed, edge in [(37, 16, 100, 11, False), (300, 8, 700, 12, False),
                                   (64, 1, 64, 13, False), (45, 16, 80, 14, True),
                                   (16384, 16, 512, 1, False)]:  # fmt: skip
        w = W.dsv4_csa(T, H, topk=topk, device="cuda", seed=seed)
        for bs in (64, 2) if T < 1000 else (64,):
            cache = F.quantize(w.kv.reshape(w.kv.shape[0], -1), bs)
            if edge:
                idx = w.kv_indices.clone()
                idx[::7] = -1
                idx[3::11] = cache.num_slots + 5
                ptr = w.kv_indptr.clone()
                ptr[5] = ptr[4]  # token 4's list is empty (the tokens after it shift)
                w = dataclasses.replace(w, kv_indices=idx, kv_indptr=ptr)
            deq = F.dequantize(cache)
            for name, run in variants.items():
                good, rep = _check(name, lambda o, run=run, w=w, c=cache: run(w, c, o), w, deq)
                ok_all &= good
                print(f"check {name} T={T} H={H} topk={topk} bs={bs} edge={edge}: "
                      f"{'ok' if good else 'FAIL'} {rep}", flush=True)  # fmt: skip
    rows = []
    cfg = FP8SmallConfig()  # the package's default launch (two producers)
    for T, H in [(16384, 16), (16384, 8), (1024, 16)]:
        w = W.dsv4_csa(T, H, topk=512, device="cuda", seed=1)
        cache = F.quantize(w.kv.reshape(w.kv.shape[0], -1), 64)
        deq = F.dequantize(cache)
        out = torch.empty_like(w.q)
        pkw = {"attn_sink": w.attn_sink, "out": out}
        timed = {
            "package": lambda w=w, c=cache, k=pkw: sparse_mla_prefill(
                w.q, c, w.kv_indices, w.kv_indptr, w.softmax_scale, config=cfg, **k
            ),
            "bf16_default": lambda w=w, d=deq, k=pkw: sparse_mla_prefill(
                w.q, d, w.kv_indices, w.kv_indptr, w.softmax_scale, **k
            ),
        }
        for name, run in variants.items():
            timed[name] = lambda run=run, w=w, c=cache, o=out: run(w, c, o)
        if T == 16384 and H == 16:  # the ablations (outputs not the operator's)
            ablations = {
                "pkg_gather": (k_pkg_gather, None, {}),
                "stage2_gather": (k_stage, None, {"DEQ": 2, "DEQ_REGS": 136,
                                                  "NULL_CONSUMER": True}),
                "stage2_olddq": (k_stage, None, {"DEQ": 2, "DEQ_REGS": 136, "OLD_DQ": True}),
                "pkg_noload": (K._prefill_ws_small_fp8_kernel, 0,
                               {"PRODUCERS": 2, "PRODUCER_REGS": 128}),
            }  # fmt: skip
            for name, (kern, n, cx) in ablations.items():
                timed[name] = lambda kern=kern, n=n, cx=cx, w=w, c=cache, o=out: _launch(
                    kern, w, c, o, num_slots=n, **cx
                )
        for rnd in range(2):  # two rounds: the spread between them is the noise
            for name, fn in timed.items():
                fn()
                torch.cuda.synchronize()
                ms = triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")
                rows.append((T, H, name, rnd, ms))
                print(f"time T={T} H={H} {name} round{rnd}: {ms:.4f} ms", flush=True)
    print("\n| T | H | kernel | ms (round 0 / 1) |\n| --- | --- | --- | --- |")
    keys = []
    for T, H, name, _, _ in rows:
        if (T, H, name) not in keys:
            keys.append((T, H, name))
    for T, H, name in keys:
        ms = [m for t, h, n, _, m in rows if (t, h, n) == (T, H, name)]
        print(f"| {T} | {H} | {name} | {' / '.join(f'{m:.3f}' for m in ms)} |")
    print("checks:", "ALL OK" if ok_all else "FAILED")
    return 0 if ok_all else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--compile":
        # CPU: cross-compile every kernel of this file for sm90 (resources, spills).
        for kern, cx in [(k_stage, {"DEQ": 2, "DEQ_REGS": 136}),
                         (k_stage, {"DEQ": 1, "DEQ_REGS": 152}),
                         (k_stage, {"DEQ": 2, "DEQ_REGS": 136, "NULL_CONSUMER": True}),
                         (k_stage, {"DEQ": 2, "DEQ_REGS": 136, "OLD_DQ": True}),
                         (k_pkg_gather, {})]:  # fmt: skip
            c, usage, sass = cross_compile(kern, **cx)
            spills = f"STL {sass.count('STL')} LDL {sass.count('LDL')}"
            print(kern.__name__, cx, " ".join(usage.split()[:4]), "dynamic shared",
                  c.metadata.shared, spills)  # fmt: skip
        sys.exit(0)
    sys.exit(main())
