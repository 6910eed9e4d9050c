"""Hopper (sm90) sparse prefill straight from the FP8 KV cache (MODEL1 layout), 64 heads on M.

The warp-specialised kernel of :mod:`hopper_ws` (persistent; 64 heads on wgmma's M; its two consumer
warpgroups and the Q load by TMA reused unchanged; O by TMA, or in calls of one item a program by
the consumers' own 16-byte stores, ``OUT_DIRECT``) with the FP8 producer of :mod:`hopper_fp8` in
place of the cp.async row gather: the producer loads each slot's 576 bytes of [NoPE | RoPE] and its
scales into registers, dequantizes the NoPE bytes (:func:`hopper_fp8._dequant_words`: a byte
permute, logic ops and bf16x2 multiplies, exact as :func:`sparse_mla.fp8.dequantize`) and stores the
bf16 row into the same swizzled [64, 512] tiles the bf16 kernel's cp.async fills. Each tile half
(``L`` = D[0:256] = NoPE chunks 0-3, ``R`` = D[256:512] = NoPE chunks 4-6 and the RoPE part) is
filled once its ``free`` barrier has passed, in the order the consumers release them (0L, 1R, 0R, 1L
a pair of tiles), and announced on its ``ready`` barrier with one arrival (after the warpgroup's
stores and a proxy fence), not cp.async's 128.

The register budget decides the producer. The three warpgroups share 504 registers a thread;
the consumers hold their O halves ([64, 256] fp32, 128 registers) and S, and cross-compile
without spills at 224 (consumer 0, which also holds the next pair's S behind its PV) and 192
(consumer 1), so the producer gets 88 (:data:`PRODUCER_REGS`, :data:`CONSUMER_REGS`; 216 / 200
/ 88 compiles without spills too, but consumer 0 spills with int64 ids there). A
producer that held a whole half tile of fp8 bytes in registers (32-40 words a lane) and
loaded the next half before storing this one would need ~130. So the producer streams the
pair of tiles as 18 *pieces*, one 64-byte chunk of each of the 64 rows (a lane: 2 rows x 16
bytes, 4 words): 0L's chunks 0-3, 1R's 4-8, 0R's 4-8, 1L's 0-3 (chunks 7-8 are the RoPE
part, stored as they are). It keeps ``AHEAD`` pieces loaded ahead of the one it stores
(``AHEAD`` x 4 KiB in flight a program), the window running on into the next pair's first
pieces (their slot ids load at the start of the pair), so the loads of the next pieces are in
flight while it waits for a half to be free and while it dequantizes. A half's 3-4 ue8m0
scales come with its first piece as one 4-byte load a row (bytes 0-3 for ``L``, 4-7 for
``R``: 7 scales and the pad byte), not one byte load a chunk.

Slot ids travel as int32 (-1: absent) and, with a power-of-two block size, each piece
recomputes its rows' byte offsets from them (:func:`_per_piece`, :func:`hopper_fp8._slot_bytes`):
four tiles' ids (this pair's and the next pair's) cost 8 registers, their 64-bit row offsets
16 more. That is what lets 4 pieces be in flight (``AHEAD`` = 4, the default) in 88 registers
without spills; docs/PERF_NOTES.md ("The FP8 cache on Hopper at 33-128 heads") has the
cross-compiles behind the split and the window.

The compiler puts a warpgroup barrier before each piece's shared stores (its hazard analysis
sees the whole tile allocation, not the disjoint words of two pieces): ~20 a pair of tiles.

Absent slots (< 0, >= num_slots, past the list) load nothing and store zeros (their logits
are -inf in the consumers), so the cache is never read for them and NaN cannot reach the
output. Dense ids (``DENSE_IDS``) as in :mod:`hopper_ws`.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import constexpr_function
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from .hopper_fp8 import CHUNK, NOPE, WORDS, _load_words, _slot_bytes, _store_nope, nope_layout
from .hopper_ws import (
    BLOCK_H,
    BLOCK_K,
    FREE,
    READY,
    _arrive,
    _bar,
    _begin_item,
    _consumer0,
    _consumer1,
    _prefetch_ids,
    _shared_state,
    _slot_ids,
    register_split,
)

# The register split (setmaxnreg) of the three warpgroups: consumer 1 and the producer take
# these, consumer 0 the rest of the 504 a thread: 504 - 192 - 88 = 224 (hopper_ws.register_split).
CONSUMER_REGS = gl.constexpr(192)
PRODUCER_REGS = gl.constexpr(88)
AHEAD = gl.constexpr(4)  # pieces loaded ahead of the one being stored (4 KiB each)
MAX_AHEAD = 8  # (host side and _ahead)

PIECE = gl.constexpr(nope_layout(1))  # [64 rows, 1 chunk, 16 words]: 2 rows x 4 words a lane
PROWS = gl.constexpr(gl.SliceLayout(1, gl.SliceLayout(2, PIECE.value)))  # [64] per row
PIECES = gl.constexpr(18)  # a pair of tiles: 2 x (7 NoPE + 2 RoPE chunks)
# The pair's pieces in order: (tile of the pair, chunk, ring half) with the halves in the order
# the consumers free them; a half is 2 x buffer + (0: L, 1: R), its barriers READY / FREE + it.
_HALVES = ((0, 0), (1, 1), (0, 1), (1, 0))  # 0L, 1R, 0R, 1L
_SEQ = tuple(
    (t, c, 2 * t + h) for t, h in _HALVES for c in (range(0, 4) if h == 0 else range(4, 9))
)
assert len(_SEQ) == PIECES.value


@constexpr_function
def _tile(k):
    """Tile of the pair (0, 1) of piece ``k``."""
    return _SEQ[k][0]


@constexpr_function
def _chunk(k):
    """64-byte chunk of the row (0-6 NoPE, 7-8 RoPE) of piece ``k``."""
    return _SEQ[k][1]


@constexpr_function
def _half(k):
    """Ring half (2 x buffer + L/R) that piece ``k`` fills."""
    return _SEQ[k][2]


@constexpr_function
def _first(k):
    """Whether piece ``k`` is its half's first (the half's free wait and scales come with it)."""
    return k == 0 or _SEQ[k - 1][2] != _SEQ[k][2]


@constexpr_function
def _last(k):
    """Whether piece ``k`` is its half's last (the half is announced after it)."""
    return k == PIECES.value - 1 or _SEQ[k + 1][2] != _SEQ[k][2]


@constexpr_function
def _next(k, ahead):
    """The piece loaded at step ``k``: ``ahead`` pieces on, into the next pair past the end."""
    return (k + ahead) % PIECES.value


@constexpr_function
def _ahead(ahead):
    """The launch's AHEAD, checked (None: unbound in a cross-compile's signature: the default)."""
    ahead = AHEAD.value if ahead is None else ahead
    if not (isinstance(ahead, int) and 1 <= ahead <= MAX_AHEAD):
        raise ValueError(f"AHEAD must be an int in [1, {MAX_AHEAD}], got {ahead!r}")
    return ahead


@constexpr_function
def _worker_regs(consumer_regs, producer_regs):
    """[CONSUMER_REGS, PRODUCER_REGS] of a launch, checked (None: this module's defaults)."""
    c = CONSUMER_REGS.value if consumer_regs is None else consumer_regs
    p = PRODUCER_REGS.value if producer_regs is None else producer_regs
    register_split(c, p)
    return [c, p]


@gluon.jit
def _per_piece(slot):
    """``slot`` itself, through an instruction the compiler keeps: each piece computes its
    rows' byte offsets anew (a few integer instructions) instead of LLVM computing them once
    per tile and holding four 64-bit offsets a tile in registers across the pair. That frees
    the registers of one more piece in flight: AHEAD = 4 cross-compiles without spills at 88
    registers with it, 3 without it."""
    return gl.inline_asm_elementwise(
        "mov.b32 $0, $1;", "=r,r", [slot], dtype=gl.int32, is_pure=False, pack=1
    )


@gluon.jit
def _load_piece(cache_ptr, slot, block_size, block_shift, stride_block, POW2: gl.constexpr,
                C: gl.constexpr):  # fmt: skip
    """Chunk ``C`` of the rows ``slot`` ([64] int32, -1: absent): words [64, 1, 16]; 0 for
    absent rows. With a power-of-two block size each piece computes its rows' offsets (a
    shift, a mask, two multiply-adds); with another block size that would be a division a
    piece, and the compiler keeps each tile's offsets instead."""
    if POW2:
        slot = _per_piece(slot)
    valid, row, _ = _slot_bytes(slot, block_size, block_shift, stride_block, POW2)
    return _load_words(cache_ptr, valid, row, C, 1)


@gluon.jit
def _load_scales(cache_ptr, slot, block_size, block_shift, stride_block, POW2: gl.constexpr,
                 C: gl.constexpr):  # fmt: skip
    """The 4 scale bytes of the half whose first chunk is ``C`` (0: scales 0-3, 4: scales 4-6
    and the pad byte) as one int32 word a row ([64]); 0 for absent rows."""
    valid, _, scl = _slot_bytes(slot, block_size, block_shift, stride_block, POW2)
    ptrs = (cache_ptr + scl + C).to(gl.pointer_type(gl.int32))  # scl is 8-byte aligned
    return gl.load(ptrs, mask=valid, other=0)


@gluon.jit
def _store_piece(tile, w, sw, C: gl.constexpr):
    """Chunk ``C`` of a tile's rows (words ``w``; ``sw``: its half's scale words) into the bf16
    tile [64, 512] (swizzled, wgmma's layout): NoPE dequantized, RoPE as it is."""
    words = tile._reinterpret(gl.int32, [BLOCK_K, 256], WORDS)
    if C < 7:
        e = ((sw >> (8 * (C % 4))) & 0xFF)[:, None]  # chunk C's ue8m0 byte, [64, 1]
        _store_nope(words, w, e, C, 1)
    else:
        col: gl.constexpr = NOPE // 2 + (C - 7) * (CHUNK // 4)  # bf16 pairs: 224, 240
        words.slice(col, CHUNK // 4, dim=1).store(w.reshape([BLOCK_K, CHUNK // 4]))


@gluon.jit
def _producer(
    q_desc, cache_ptr, idx_ptr, indptr_ptr, stride_block, num_heads, num_slots, nnz, num_items,
    ids_per_row, block_size, block_shift, q_smem, kv_smem, bars,
    SMALL: gl.constexpr, DENSE_IDS: gl.constexpr, POW2: gl.constexpr, AHEAD: gl.constexpr,
):  # fmt: skip
    """Q by TMA once per item (as :func:`hopper_ws._producer`), then each pair of tiles as
    18 pieces: load piece k + AHEAD, wait for piece k's half to be free (its first piece),
    dequantize and store piece k, announce the half (its last piece)."""
    if SMALL:
        _prefetch_ids(idx_ptr, nnz)
    num_hb = (num_heads + BLOCK_H - 1) // BLOCK_H
    g0 = 0  # pairs of tiles filled so far, over all items: the barriers' phase
    it = 0  # items so far
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        lo, hi, num_tiles = _begin_item(
            item, it, num_hb, q_desc, q_smem, bars, indptr_ptr, nnz, num_heads, BLOCK_H,
            ids_per_row, SMALL, DENSE_IDS,
        )  # fmt: skip
        s0 = _slot_ids(idx_ptr, lo, hi, num_slots, PROWS)
        s1 = _slot_ids(idx_ptr, lo + BLOCK_K, hi, num_slots, PROWS)
        # The window: the pieces loaded and not yet stored (words), and the scale words of
        # the halves whose first piece is among them, oldest first.
        win = ()
        sws = ()
        for k in gl.static_range(AHEAD):
            slot = s0 if _tile(k) == 0 else s1
            w = _load_piece(cache_ptr, slot, block_size, block_shift, stride_block, POW2,
                            _chunk(k))  # fmt: skip
            win = win + (w,)  # noqa: RUF005 (a Gluon tuple: no unpacking in the JIT)
            if _first(k) and _chunk(k) < 7:
                sw = _load_scales(cache_ptr, slot, block_size, block_shift, stride_block, POW2,
                                  _chunk(k))  # fmt: skip
                sws = sws + (sw,)  # noqa: RUF005
        num_pairs = (num_tiles + 1) // 2
        for j in range(num_pairs):
            ph = ((g0 + j) & 1) ^ 1  # a fresh barrier's "previous phase" counts as complete
            # The next pair's ids (past the list: -1, nothing loaded): the window runs on.
            n0 = _slot_ids(idx_ptr, lo + (2 * j + 2) * BLOCK_K, hi, num_slots, PROWS)
            n1 = _slot_ids(idx_ptr, lo + (2 * j + 3) * BLOCK_K, hi, num_slots, PROWS)
            for k in gl.static_range(PIECES):
                # Load piece k + AHEAD (of this pair, or of the next one past its end).
                if k + AHEAD < PIECES:
                    slot = s0 if _tile(_next(k, AHEAD)) == 0 else s1
                else:
                    slot = n0 if _tile(_next(k, AHEAD)) == 0 else n1
                w = _load_piece(cache_ptr, slot, block_size, block_shift, stride_block, POW2,
                                _chunk(_next(k, AHEAD)))  # fmt: skip
                win = win + (w,)  # noqa: RUF005
                if _first(_next(k, AHEAD)) and _chunk(_next(k, AHEAD)) < 7:
                    sw = _load_scales(cache_ptr, slot, block_size, block_shift, stride_block,
                                      POW2, _chunk(_next(k, AHEAD)))  # fmt: skip
                    sws = sws + (sw,)  # noqa: RUF005
                # Store piece k.
                if _first(k):
                    mbarrier.wait(_bar(bars, FREE + _half(k)), ph)
                    scales = sws[0]
                    sws = sws[1:]
                _store_piece(kv_smem.index(_tile(k)), win[0], scales, _chunk(k))
                win = win[1:]
                if _last(k):
                    fence_async_shared()  # the generic-proxy stores before wgmma's reads
                    _arrive(_bar(bars, READY + _half(k)))
            s0 = n0
            s1 = n1
        g0 += num_pairs
        it += 1  # noqa: SIM113 (Gluon loops have no enumerate)


@gluon.jit(do_not_specialize=["nnz"])
def _prefill_ws_fp8_kernel(
    q_desc,  # TMA descriptor of q [R, H, 512] bf16: boxes [1, BLOCK_H, Q_BLOCK], Q_SMEM
    cache_ptr,  # the cache's bytes (uint8), MODEL1 layout
    idx_ptr,  # [nnz] int32 | int64 (DENSE_IDS: [R, ids_per_row], contiguous)
    indptr_ptr,  # [R + 1] (unused under DENSE_IDS)
    sink_ptr,  # [H] fp32 sink logits (-inf: no sink)
    out,  # out [R, H, 512]: with OUT_DIRECT its pointer (rows 16-byte aligned), else its TMA
    # descriptor (boxes [1, BLOCK_H, OUT_BLOCK], OUT_SMEM)
    stride_qr,  # unused (the descriptors hold the strides), kept for the shared launch
    stride_qh,
    stride_block,  # bytes from one block to the next
    stride_or,  # out's strides (elements; OUT_DIRECT)
    stride_oh,
    num_heads,
    num_slots,  # num_blocks x block_size: slot s is valid iff 0 <= s < num_slots
    nnz,
    qk_scale,  # sm_scale * log2(e)
    num_items,  # R * cdiv(H, 64)
    ids_per_row,  # DENSE_IDS: K of the dense [R, K] ids (CSR: 0, unused)
    block_size,
    block_shift,  # log2(block_size) when POW2
    SMALL: gl.constexpr = False,  # hopper_ws.small_call(nnz, programs)
    CONSUMER_REGS: gl.constexpr = None,  # consumer 1's registers (None: CONSUMER_REGS)
    PRODUCER_REGS: gl.constexpr = None,  # the producer's (None: PRODUCER_REGS)
    DENSE_IDS: gl.constexpr = False,
    POW2: gl.constexpr = True,  # block_size is a power of two
    AHEAD: gl.constexpr = None,  # pieces the producer loads ahead (None: AHEAD)
    POS_SCALE: gl.constexpr = False,  # qk_scale > 0: the consumers fold it into the exponent
    # O by the consumers' own stores (hopper_ws's step 46), set when each program runs one
    # item (launch.single_item): faster there, slower where items follow (step 47)
    OUT_DIRECT: gl.constexpr = False,
):
    """Persistent: grid (min(items, SMs),); 4 warps here (consumer 0) + 8 in the workers."""
    ahead: gl.constexpr = _ahead(AHEAD)
    q_smem, kv_smem, p0_smem, p1_smem, m0_smem, m1_smem, l_smem, bars, tile_ids = _shared_state(
        q_desc.dtype,
        1,  # READY: one arrival of the producer warpgroup, after its stores
        0,  # no slot ids published (tile_ids unused): this producer has no registers for them
    )
    # The consumers' arguments as hopper_ws's (the cache's bytes stand for the pool and
    # num_slots for its rows: the consumers read neither but the slot ids' bounds, which they
    # check themselves, PUBLISHED=False).
    gl.warp_specialize(
        [
        (_consumer0, (
            q_desc, cache_ptr, idx_ptr, indptr_ptr, sink_ptr, out, stride_qr, stride_qh,
            stride_block, num_heads, num_slots, nnz, qk_scale, num_items, ids_per_row, q_smem,
            kv_smem, p0_smem, p1_smem, m0_smem, m1_smem, l_smem, bars, tile_ids, SMALL,
            DENSE_IDS, POS_SCALE, False, 1, None, None, OUT_DIRECT, stride_or, stride_oh,
        )),
        (_consumer1, (
            q_desc, cache_ptr, idx_ptr, indptr_ptr, sink_ptr, out, stride_qr, stride_qh,
            stride_block, num_heads, num_slots, nnz, qk_scale, num_items, ids_per_row, q_smem,
            kv_smem, p0_smem, p1_smem, m0_smem, m1_smem, l_smem, bars, tile_ids, SMALL,
            DENSE_IDS, POS_SCALE, False, 1, None, None, False, OUT_DIRECT, stride_or, stride_oh,
        )),
        (_producer, (
            q_desc, cache_ptr, idx_ptr, indptr_ptr, stride_block, num_heads, num_slots, nnz,
            num_items, ids_per_row, block_size, block_shift, q_smem, kv_smem, bars, SMALL,
            DENSE_IDS, POW2, ahead,
        )),
        ],
        [4, 4],
        _worker_regs(CONSUMER_REGS, PRODUCER_REGS),
    )  # fmt: skip
