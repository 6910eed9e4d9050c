"""Hopper (sm90) sparse prefill straight from the FP8 KV cache (MODEL1 layout), few heads.

The heads-on-N kernel of :mod:`hopper_ws_small` (persistent; its consumer warpgroup is reused
unchanged) with producers that read the FP8 cache instead of a bf16 pool. Per slot a producer
fetches the token's 576 bytes of [NoPE | RoPE] and its 7 scale bytes (:mod:`sparse_mla.fp8` has
the layout: slot s is token s % block_size of block s // block_size) into registers,
dequantizes the 448 e4m3fn NoPE bytes, and writes the bf16 row into the same shared-memory
tile the bf16 kernel's cp.async fills. So the consumer's wgmmas read bf16 operands equal to
:func:`sparse_mla.fp8.dequantize`'s rows, and the error rule of the bf16 kernels holds
unchanged (fp8 is not fed to the MMA: that would need Q in fp8 too).

Why registers, not a cp.async staging buffer: at 16 heads the bf16 kernel's tile rate is set by
its gather and by shared-memory bandwidth (the tile is written once and read twice by wgmma,
192 KiB a tile); staging the fp8 bytes in shared memory first would add 2 x 37 KiB of shared
traffic a tile, while the register path writes the same 64 KiB the bf16 kernel writes.

The dequantization, per pair of bytes (PTX in :func:`_dequant_words`): a byte permute puts
the two e4m3 bytes in the high byte of two 16-bit lanes; the magnitude bits (eeee mmm) shifted
right by 4 and the sign bit kept give bf16 bits whose value is exactly x * 2^-120 (e4m3's
exponent field lands in the low 4 bits of bf16's, and e4m3 subnormals land on bf16
subnormals, which sm90's bf16 arithmetic keeps). Two bf16x2 multiplies, by 2^120 and by the
tile's ue8m0 scale 2^(E - 127) (E = 0: 2^-127, a bf16 subnormal; E = 255: NaN), give
x * scale rounded once to bf16, as ``dequantize`` does (exact unless it underflows bf16).
Two integer operations and a multiply of bf16x2 a value pair (per 4-byte word: two permutes,
four ands, two shifts, two ors, four multiplies), no conversion instruction.
The two NaN bytes of e4m3fn (0x7F, 0xFF), which the quantizer never writes, decode as
+-480 x scale here (``dequantize`` gives NaN).

A producer holds one tile's bytes in registers between its loads and its stores, so the
tiles a program has in flight are its producers: ``PRODUCERS`` warpgroups (1-3) take the
ring's tiles round-robin, each loading its next tile's slot ids before it waits for a free
tile. With one producer, ``PIPELINE`` instead issues the next tile's loads (the next item's
first after an item's last) before it stores the current one. Each loaded tile is stored once
a ring tile is free and then announced on that tile's ``ready`` barrier (one arrival, after
the warpgroup's stores and a proxy fence).

Measured on the H200 (docs/PERF_NOTES.md, "The FP8 cache on Hopper"): correct at every launch,
but 1.3-1.4x slower than the bf16 kernel at 8-32 heads whatever the producers; the next step
there is ``experiments/fp8_seg128.py``'s loads. At 64 heads and more it runs two or four items
a token and is 2.1-2.3x slower than a bf16 workspace fed to FlashMLA; there the dispatch runs
:mod:`hopper_ws_fp8` (``gluon_ws_fp8``: the heads-on-M kernel with an FP8 producer built from
this module's loads and dequantization).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import constexpr_function
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from .hopper_ws import GATHER, HALF, _arrive, _copy_q, _item_range
from .hopper_ws_small import (
    BLOCK_H,
    BLOCK_K,
    FREE,
    Q_FREE,
    Q_READY,
    READY,
    _consumer,
    _head_groups,
    _shared_state,
    ring_stages,
)

ROW_BYTES = gl.constexpr(576)  # [448 e4m3 NoPE | 64 bf16 RoPE] a token
NOPE = gl.constexpr(448)
SCALE_BYTES = gl.constexpr(8)  # 7 ue8m0 scales (one per 64-wide NoPE tile) and a pad byte
CHUNK = gl.constexpr(64)
# Registers per thread of each producer warpgroup (register_split): a tile's raw bytes take
# about 80; with two producers the consumer keeps 504 - 2 x 128 = 248.
PRODUCER_REGS = gl.constexpr(128)


@constexpr_function
def nope_layout(nch):
    """A [64 rows, nch chunks, 16 words] piece of NoPE (a word: 4 e4m3 bytes): a lane holds 4
    words (16 bytes, one load) of each of its rows' nch chunks, 4 lanes a 64-byte chunk, 8 rows
    a warp; so a lane's rows are the same (lane // 4 + 8 warp + 32 i) for every nch and for
    ROPE."""
    return gl.BlockedLayout([1, nch, 4], [8, 1, 4], [4, 1, 1], [2, 1, 0])


# RoPE [64 rows, 32 words] (a word: 2 bf16): 16 bytes a lane, the rows as in nope_layout.
ROPE = gl.constexpr(gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0]))
ROWS = gl.constexpr(gl.SliceLayout(1, ROPE.value))  # [64] per-row values
# The bf16 tile [64, 512] seen as 32-bit words [64, 256] (pairs of bf16): the same bytes and
# the same 128-byte swizzle, so the producer stores whole words.
WORDS = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2))


@constexpr_function
def register_split(producers, producer_regs, head_groups=1):
    """(consumer, producer) registers a thread for PRODUCERS producer warpgroups of
    PRODUCER_REGS each: the warpgroups share 65,536 registers, (65,536 / threads) rounded down
    to 8 a thread each at launch; the consumer (the default partition) takes the rest, at most
    256. ValueError when a split cannot be: the consumer holds O^T [512, 16 x head_groups] fp32
    and the denominators, and compiles without spills in 176 registers at one head group and
    in 240 at two."""
    if producers not in (1, 2, 3):
        raise ValueError(f"PRODUCERS must be 1, 2 or 3, got {producers!r}")
    regs = producer_regs
    if not (isinstance(regs, int) and not isinstance(regs, bool) and 24 <= regs <= 256
            and regs % 8 == 0):  # fmt: skip
        raise ValueError(f"PRODUCER_REGS must be a multiple of 8 in [24, 256], got {regs!r}")
    pool = (producers + 1) * (65536 // ((producers + 1) * 128) // 8 * 8)
    consumer = min(256, pool - producers * regs)
    need = 176 if head_groups == 1 else 240
    if consumer < need:
        raise ValueError(
            f"register split: {producers} producer warpgroup(s) of {regs} registers leave the "
            f"consumer {consumer} of the {pool} a thread the warpgroups share (it needs {need} "
            f"at HEAD_GROUPS={head_groups})"
        )
    return consumer, regs


@constexpr_function
def _worker_regs(producers, producer_regs, head_groups):
    regs = PRODUCER_REGS.value if producer_regs is None else producer_regs
    register_split(producers, regs, head_groups)
    return [regs] * producers


@gluon.jit
def _dequant_words(w, scale2):
    """A word ``w`` of 4 e4m3fn bytes times ``scale2`` (bf16x2, both halves the scale) as two
    words of bf16x2: bytes 0-1 and bytes 2-3."""
    return gl.inline_asm_elementwise(
        """
        {
        .reg .b32 z, c, t0, t1, s0, s1;
        mov.b32 z, 0;
        mov.b32 c, 0x7B807B80;
        prmt.b32 t0, $2, z, 0x1404;
        prmt.b32 t1, $2, z, 0x3424;
        and.b32 s0, t0, 0x80008000;
        and.b32 s1, t1, 0x80008000;
        and.b32 t0, t0, 0x7F007F00;
        and.b32 t1, t1, 0x7F007F00;
        shr.b32 t0, t0, 4;
        shr.b32 t1, t1, 4;
        or.b32 t0, t0, s0;
        or.b32 t1, t1, s1;
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
def _scale_bf16x2(e):
    """ue8m0 bytes (uint8) -> bf16x2 words of 2^(E - 127) in both halves: bf16 bits E << 7;
    E = 0 is the subnormal 2^-127 (bits 0x40), E = 255 is NaN (0x7FC0)."""
    e = e.to(gl.int32)
    bits = gl.where(e == 0, 0x40, e << 7)
    bits = gl.where(e == 255, 0x7FC0, bits)
    return bits | (bits << 16)


@gluon.jit
def _offsets(s, block_size, block_shift, stride_block, POW2: gl.constexpr):
    """The byte offsets of [NoPE | RoPE] and of the scales of valid slots ``s`` (int32)."""
    if POW2:
        blk = s >> block_shift
        tok = s & (block_size - 1)
    else:
        blk = s // block_size
        tok = s - blk * block_size
    base = blk.to(gl.int64) * stride_block
    row = base + tok * ROW_BYTES
    scl = base + block_size * ROW_BYTES + tok * SCALE_BYTES
    return row, scl


@gluon.jit
def _slot_bytes(slot, block_size, block_shift, stride_block, POW2: gl.constexpr):
    """Validity and the byte offsets of [NoPE | RoPE] and of the scales of slots ``slot``
    (int32, -1: absent, as :func:`_slot_ids` gives them; invalid: offset 0, never read)."""
    row, scl = _offsets(gl.maximum(slot, 0), block_size, block_shift, stride_block, POW2)
    return slot >= 0, row, scl


@gluon.jit
def _rows(idx_ptr, pos0, hi, num_slots, block_size, block_shift, stride_block, POW2: gl.constexpr):
    """Validity and the byte offsets of [NoPE | RoPE] and of the scales of the slots at CSR
    positions pos0 .. pos0 + 63 ([64] each, in ROWS; invalid: offset 0, never read)."""
    offs = pos0 + gl.arange(0, BLOCK_K, layout=ROWS)
    in_list = offs < hi
    slot = gl.load(idx_ptr + offs, mask=in_list, other=-1).to(gl.int64)
    valid = in_list & (slot >= 0) & (slot < num_slots)
    s = gl.where(valid, slot, 0).to(gl.int32)  # < num_slots < 2^31
    row, scl = _offsets(s, block_size, block_shift, stride_block, POW2)
    return valid, row, scl


@gluon.jit
def _load_words(cache_ptr, valid, row, CH0: gl.constexpr, NCH: gl.constexpr):
    """64-byte chunks CH0 .. CH0 + NCH - 1 of the rows' 576 bytes (0-6: NoPE, 7-8: RoPE) as
    words [64, NCH, 16] (int32, 4 bytes each) in nope_layout(NCH); 0 for invalid rows."""
    l3: gl.constexpr = nope_layout(NCH)
    rows: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, l3))
    row = gl.convert_layout(row, rows)
    ok = gl.convert_layout(valid, rows)
    offs_c = CH0 + gl.arange(0, NCH, layout=gl.SliceLayout(0, gl.SliceLayout(2, l3)))
    offs_w = gl.arange(0, CHUNK // 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, l3)))
    words = (cache_ptr + row).to(gl.pointer_type(gl.int32))  # rows are 16-byte aligned
    ptrs = words[:, None, None] + (offs_c * (CHUNK // 4))[None, :, None] + offs_w[None, None, :]
    ptrs = gl.max_contiguous(gl.multiple_of(ptrs, [16, 16, 16]), [1, 1, 4])  # bytes; words
    return gl.load(ptrs, mask=ok[:, None, None], other=0)


@gluon.jit
def _load_nope(cache_ptr, valid, row, scl, CH0: gl.constexpr, NCH: gl.constexpr):
    """NoPE chunks CH0 .. CH0 + NCH - 1 of the rows: words [64, NCH, 16] (int32, 4 bytes each)
    and scale bytes [64, NCH] (uint8); 0 for invalid rows."""
    l3: gl.constexpr = nope_layout(NCH)
    rows: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, l3))
    w = _load_words(cache_ptr, valid, row, CH0, NCH)
    ok = gl.convert_layout(valid, rows)
    offs_c = CH0 + gl.arange(0, NCH, layout=gl.SliceLayout(0, gl.SliceLayout(2, l3)))
    srow = gl.convert_layout(scl, rows)
    e = gl.load(cache_ptr + srow[:, None] + offs_c[None, :], mask=ok[:, None], other=0)
    return w, e


@gluon.jit
def _load_rope(cache_ptr, valid, row):
    """The RoPE part of the rows: words [64, 32] (int32, 2 bf16 each); 0 for invalid rows."""
    offs_w = gl.arange(0, CHUNK // 2, layout=gl.SliceLayout(0, ROPE))
    base = (cache_ptr + row + NOPE).to(gl.pointer_type(gl.int32))
    ptrs = gl.max_contiguous(gl.multiple_of(base[:, None] + offs_w[None, :], [16, 16]), [1, 4])
    return gl.load(ptrs, mask=valid[:, None], other=0)


@gluon.jit
def _load_rows(cache_ptr, valid, row, scl):
    """Every byte the rows of one tile need, in registers (loads issued, not waited for)."""
    x0, e0 = _load_nope(cache_ptr, valid, row, scl, 0, 4)
    x1, e1 = _load_nope(cache_ptr, valid, row, scl, 4, 2)
    x2, e2 = _load_nope(cache_ptr, valid, row, scl, 6, 1)
    rope = _load_rope(cache_ptr, valid, row)
    return x0, e0, x1, e1, x2, e2, rope


@gluon.jit
def _load_tile(cache_ptr, idx_ptr, pos0, hi, num_slots, block_size, block_shift, stride_block,
               POW2: gl.constexpr):  # fmt: skip
    """The slot ids at CSR positions pos0 .. pos0 + 63, then every byte their rows need."""
    valid, row, scl = _rows(
        idx_ptr, pos0, hi, num_slots, block_size, block_shift, stride_block, POW2
    )
    return _load_rows(cache_ptr, valid, row, scl)


@gluon.jit
def _store_nope(words, w, e, CH0: gl.constexpr, NCH: gl.constexpr):
    """Dequantize NoPE chunks CH0 .. CH0 + NCH - 1 into the tile's words."""
    lo, hi = _dequant_words(w, _scale_bf16x2(e)[:, :, None])
    y = gl.join(lo, hi).reshape([BLOCK_K, NCH * CHUNK // 2])  # word 2j: bytes 4j, 4j+1
    words.slice(CH0 * CHUNK // 2, NCH * CHUNK // 2, dim=1).store(y)


@gluon.jit
def _store_tile(tile, x0, e0, x1, e1, x2, e2, rope):
    """Dequantize a tile's bytes into the bf16 tile [64, 512] (swizzled, wgmma's layout)."""
    words = tile._reinterpret(gl.int32, [BLOCK_K, 256], WORDS)
    _store_nope(words, x0, e0, 0, 4)
    _store_nope(words, x1, e1, 4, 2)
    _store_nope(words, x2, e2, 6, 1)
    words.slice(NOPE // 2, CHUNK // 2, dim=1).store(rope)


@gluon.jit
def _producer(
    q_ptr, cache_ptr, idx_ptr, indptr_ptr, stride_qr, stride_qh, stride_block, num_heads,
    num_slots, nnz, num_items, block_size, block_shift, ids_per_row, q_smem, kv_smem, bars,
    HEAD_GROUPS: gl.constexpr, STAGES: gl.constexpr, POW2: gl.constexpr, PIPELINE: gl.constexpr,
    PID: gl.constexpr, NPROD: gl.constexpr, DENSE_IDS: gl.constexpr = False,
):  # fmt: skip
    """Producer ``PID`` of ``NPROD``: fills the ring's tiles g = PID, PID + NPROD, ... (over all
    of the program's items); producer 0 also copies each item's Q."""
    heads: gl.constexpr = BLOCK_H * HEAD_GROUPS
    stages: gl.constexpr = ring_stages(HEAD_GROUPS, STAGES)
    offs_hq = gl.arange(0, heads, layout=gl.SliceLayout(1, GATHER))
    offs_c = gl.arange(0, HALF, layout=gl.SliceLayout(0, GATHER))
    nprog = gl.num_programs(0)
    g = 0  # tiles of all producers so far over all items: ring slot and phase
    it = 0
    if PIPELINE:
        # (NPROD == 1) The first item's first tile; each tile then loads the one after it.
        _, _, lo0, hi0, _ = _item_range(
            gl.program_id(0), indptr_ptr, nnz, num_heads, heads, ids_per_row, DENSE_IDS
        )
        x0, e0, x1, e1, x2, e2, rope = _load_tile(
            cache_ptr, idx_ptr, lo0, hi0, num_slots, block_size, block_shift, stride_block, POW2
        )
    for item in range(gl.program_id(0), num_items, nprog):
        pid_r, pid_h, lo, hi, num_tiles = _item_range(
            item, indptr_ptr, nnz, num_heads, heads, ids_per_row, DENSE_IDS
        )
        if PIPELINE:
            # The next item's range: its first tile loads during this item's last.
            nxt = gl.minimum(item + nprog, num_items - 1)
            _, _, nlo, nhi, _ = _item_range(
                nxt, indptr_ptr, nnz, num_heads, heads, ids_per_row, DENSE_IDS
            )
            nhi = gl.where(item + nprog < num_items, nhi, nlo)
        if PID == 0:
            mbarrier.wait(bars.index(Q_FREE), (it & 1) ^ 1)
            _copy_q(q_smem.index(0), q_ptr, pid_r, pid_h * heads + offs_hq, offs_c, stride_qr,
                    stride_qh, num_heads)  # fmt: skip
            cp.mbarrier_arrive(bars.index(Q_READY), increment_count=False)
        t0 = (PID + NPROD - g % NPROD) % NPROD  # this producer's first tile of the item
        if not PIPELINE:
            valid, row, scl = _rows(
                idx_ptr, lo + t0 * BLOCK_K, hi, num_slots, block_size, block_shift,
                stride_block, POW2,
            )  # fmt: skip
        for t in range(t0, num_tiles, NPROD):
            stage = (g + t) % stages
            ph = (((g + t) // stages) & 1) ^ 1  # a fresh barrier's previous phase is complete
            if PIPELINE:
                last = t + 1 == num_tiles
                pos = gl.where(last, nlo, lo + (t + 1) * BLOCK_K)
                end = gl.where(last, nhi, hi)
                n0, f0, n1, f1, n2, f2, nrope = _load_tile(
                    cache_ptr, idx_ptr, pos, end, num_slots, block_size, block_shift,
                    stride_block, POW2,
                )  # fmt: skip
            else:
                # This tile's ids came with the previous one; the next's go out now, so only
                # the rows' bytes are a round trip on the way to the store.
                x0, e0, x1, e1, x2, e2, rope = _load_rows(cache_ptr, valid, row, scl)
                valid, row, scl = _rows(
                    idx_ptr, lo + (t + NPROD) * BLOCK_K, hi, num_slots, block_size, block_shift,
                    stride_block, POW2,
                )  # fmt: skip
            mbarrier.wait(bars.index(FREE + stage), ph)
            _store_tile(kv_smem.index(stage), x0, e0, x1, e1, x2, e2, rope)
            fence_async_shared()  # the generic-proxy stores before wgmma's (async proxy) reads
            _arrive(bars.index(READY + stage))
            if PIPELINE:
                x0, e0, x1, e1, x2, e2, rope = n0, f0, n1, f1, n2, f2, nrope
        if PIPELINE:  # noqa: SIM102 (a constexpr test, then a runtime one)
            if num_tiles == 0:
                # Nothing used the tile loaded for this (empty) item: load the next one's.
                x0, e0, x1, e1, x2, e2, rope = _load_tile(
                    cache_ptr, idx_ptr, nlo, nhi, num_slots, block_size, block_shift,
                    stride_block, POW2,
                )  # fmt: skip
        g += num_tiles
        it += 1  # noqa: SIM113 (Gluon loops have no enumerate)
    cp.commit_group()
    cp.wait_group(0)


@constexpr_function
def _check_pipeline(pipeline, producers, stages):
    """PIPELINE needs one producer (it loads each tile's successor); a producer's wait for a
    free tile is by phase parity, unambiguous only while no producer is more than a lap of the
    ring ahead: PRODUCERS <= the ring's tiles."""
    if pipeline and producers != 1:
        raise ValueError("PIPELINE needs PRODUCERS=1 (one producer loads each tile's successor)")
    if producers > stages:
        raise ValueError(f"PRODUCERS={producers} needs at least as many ring tiles, got {stages}")
    return pipeline


@gluon.jit(do_not_specialize=["nnz"])
def _prefill_ws_small_fp8_kernel(
    q_ptr,  # [R, H, 512] bf16
    cache_ptr,  # the cache's bytes (uint8), MODEL1 layout
    idx_ptr,  # [nnz] int32 | int64 (DENSE_IDS: [R, ids_per_row], contiguous)
    indptr_ptr,  # [R + 1] (DENSE_IDS True: unused; 2: the rows' lengths [R])
    sink_ptr,  # [H] fp32 sink logits (-inf: no sink)
    out_ptr,  # [R, H, 512] bf16
    stride_qr,
    stride_qh,
    stride_block,  # bytes from one block to the next
    stride_or,
    stride_oh,
    num_heads,
    num_slots,  # num_blocks x block_size: slot s is valid iff 0 <= s < num_slots
    nnz,
    qk_scale,  # sm_scale * log2(e)
    num_items,  # R * cdiv(H, 16 * HEAD_GROUPS)
    block_size,
    block_shift,  # log2(block_size) when POW2
    ids_per_row,  # DENSE_IDS: K of the dense [R, K] ids (CSR: 0, unused)
    HEAD_GROUPS: gl.constexpr = 1,
    STAGES: gl.constexpr = None,
    PRODUCERS: gl.constexpr = 2,  # producer warpgroups (tiles round-robin)
    PRODUCER_REGS: gl.constexpr = None,
    POW2: gl.constexpr = True,  # block_size is a power of two
    PIPELINE: gl.constexpr = False,  # (PRODUCERS = 1) load a tile's successor before storing it
    DENSE_IDS: gl.constexpr = False,  # dense [R, ids_per_row] ids (2: with the rows' lengths)
):
    """Persistent: grid (min(items, SMs),); num_warps=4: the consumer here + 4 warps a
    producer."""
    groups: gl.constexpr = _head_groups(HEAD_GROUPS)
    pipe: gl.constexpr = _check_pipeline(PIPELINE, PRODUCERS, ring_stages(groups, STAGES))
    regs: gl.constexpr = _worker_regs(PRODUCERS, PRODUCER_REGS, groups)
    # The lists as hopper_ws._item_range reads them: CSR, dense rows (DENSE_IDS) or dense
    # rows with their lengths (2). READY: one arrival (a producer warpgroup's, after its
    # stores), not cp.async's 128. The partitions' arguments written out in each call: a
    # tuple assigned to a name would turn its constexprs into tensors.
    q_smem, kv_smem, p_smem, bars = _shared_state(gl.bfloat16, groups, STAGES, 1)
    if PRODUCERS == 1:
        gl.warp_specialize(
            [
            (_consumer, (
                q_ptr, cache_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr, stride_qr, stride_qh,
                stride_block, stride_or, stride_oh, num_heads, num_slots, nnz, qk_scale,
                num_items, ids_per_row, q_smem, kv_smem, p_smem, bars, groups, STAGES, DENSE_IDS,
            )),
            (_producer, (
                q_ptr, cache_ptr, idx_ptr, indptr_ptr, stride_qr, stride_qh, stride_block,
                num_heads, num_slots, nnz, num_items, block_size, block_shift, ids_per_row, q_smem,
                kv_smem, bars, groups, STAGES, POW2, pipe, 0, 1, DENSE_IDS,
            )),
            ],
            [4],
            regs,
        )  # fmt: skip
    elif PRODUCERS == 2:
        gl.warp_specialize(
            [
            (_consumer, (
                q_ptr, cache_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr, stride_qr, stride_qh,
                stride_block, stride_or, stride_oh, num_heads, num_slots, nnz, qk_scale,
                num_items, ids_per_row, q_smem, kv_smem, p_smem, bars, groups, STAGES, DENSE_IDS,
            )),
            (_producer, (
                q_ptr, cache_ptr, idx_ptr, indptr_ptr, stride_qr, stride_qh, stride_block,
                num_heads, num_slots, nnz, num_items, block_size, block_shift, ids_per_row, q_smem,
                kv_smem, bars, groups, STAGES, POW2, False, 0, 2, DENSE_IDS,
            )),
            (_producer, (
                q_ptr, cache_ptr, idx_ptr, indptr_ptr, stride_qr, stride_qh, stride_block,
                num_heads, num_slots, nnz, num_items, block_size, block_shift, ids_per_row, q_smem,
                kv_smem, bars, groups, STAGES, POW2, False, 1, 2, DENSE_IDS,
            )),
            ],
            [4, 4],
            regs,
        )  # fmt: skip
    else:
        gl.warp_specialize(
            [
            (_consumer, (
                q_ptr, cache_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr, stride_qr, stride_qh,
                stride_block, stride_or, stride_oh, num_heads, num_slots, nnz, qk_scale,
                num_items, ids_per_row, q_smem, kv_smem, p_smem, bars, groups, STAGES, DENSE_IDS,
            )),
            (_producer, (
                q_ptr, cache_ptr, idx_ptr, indptr_ptr, stride_qr, stride_qh, stride_block,
                num_heads, num_slots, nnz, num_items, block_size, block_shift, ids_per_row, q_smem,
                kv_smem, bars, groups, STAGES, POW2, False, 0, 3, DENSE_IDS,
            )),
            (_producer, (
                q_ptr, cache_ptr, idx_ptr, indptr_ptr, stride_qr, stride_qh, stride_block,
                num_heads, num_slots, nnz, num_items, block_size, block_shift, ids_per_row, q_smem,
                kv_smem, bars, groups, STAGES, POW2, False, 1, 3, DENSE_IDS,
            )),
            (_producer, (
                q_ptr, cache_ptr, idx_ptr, indptr_ptr, stride_qr, stride_qh, stride_block,
                num_heads, num_slots, nnz, num_items, block_size, block_shift, ids_per_row, q_smem,
                kv_smem, bars, groups, STAGES, POW2, False, 2, 3, DENSE_IDS,
            )),
            ],
            [4, 4, 4],
            regs,
        )  # fmt: skip
