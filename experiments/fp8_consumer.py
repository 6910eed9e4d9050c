"""An FP8 small-head kernel whose consumer dequantizes K itself (issue 25; cross-compiled only,
not measured yet). PERF_NOTES ("The FP8 cache on Hopper", "Why the register path is slow", and
"Shared-memory accounting" in the FP8 bench section) has the evidence behind it.

Why: at T = 16384 H16 the bf16 small kernel (``hopper_ws_small``) takes 1.73 ms and the
package FP8 one (``hopper_fp8``: producers dequantize into the bf16 tile) 2.40; counted per
64-slot tile, both move ~18 TB/s of shared memory, bf16 192 KiB a tile (64 KiB in by cp.async,
64 read as QK's A, 64 read as PV's A), FP8 256 KiB (``fp8_stage``: 32 KiB of fp8 in, 32 read by
the dequant warps, 64 of bf16 written, 2 x 64 read). If shared memory is the ceiling, an FP8
kernel gets faster only by moving fewer bytes a tile. Here the consumer's QK takes K from
registers, so the bf16 tile is read by one MMA only:

- a **loader** warpgroup cp.asyncs each tile's raw bytes into a 2-entry ring: the 448 e4m3 NoPE
  bytes a slot (seven [64 rows, 64 B] planes, 16-byte ``LDGSTS.BYPASS``) and the 8 scale bytes
  (two word planes) into staging, the 64 bf16 RoPE values straight into the last 64 columns of
  the entry's bf16 V tile (they need no dequantization); absent slots (< 0, >= num_slots, past
  the list) copy nothing and are zero-filled, as in the package. Q once per item, its NoPE
  columns permuted (below) with 4-byte cp.asyncs;
- the **consumer** warpgroup, per tile and per 64-dim NoPE chunk: loads its fp8 bytes from
  staging (2 ``LDS.128`` a lane, conflict-free: a quarter-warp reads 128 contiguous bytes),
  dequantizes them (:func:`_dequant4`, the bits of ``sparse_mla.fp8.dequantize``: fp8_stage's
  sign-replicating ``prmt``, a shift, one mask, two bf16x2 multiplies), issues
  S^T += K_chunk Q_chunk^T with K_chunk as wgmma's A operand **from registers**
  (``DotOperandLayout(0, MMA_ST, k_width=2)``), and stores the same bf16 values into the V tile
  (4 ``STS.128`` a lane, conflict-free in the 128-byte swizzle); the RoPE chunk's QK takes A
  from the V tile and is issued first (the loader's bytes are there on ``ready``), so the
  stores come after every QK read of the tile. Softmax, sink, empty rows and
  O^T += V^T P^T are ``hopper_ws_small``'s.

The register A fragment of m64nNk16 (bf16) gives a lane, per 16-wide k step, the columns
2t, 2t + 1, 2t + 8, 2t + 9 (t = lane % 4) of rows r and r + 8; over a 64-wide chunk that is 16
columns a row, but not contiguous ones. The contraction's order is free as long as Q^T (the B
operand) has the same one, so each chunk's 64 dims are permuted: logical column
k' = 16 kb + 8 h + 2 t + e holds physical dim 16 t + 4 kb + 2 h + e, and lane t's 16 values of a
row are the 16 contiguous bytes [16 t, 16 t + 16) of the staged chunk: one 16-byte load a row.
:data:`LOAD_L` is that load's layout; :func:`_k_order` turns the loaded (physical) tensor into
the logical one by a reshape and a permute, which differs from the dot-operand layout only in
its registers' order (no data moves). The V tile keeps the physical order (PV is unchanged);
Q's NoPE columns are loaded permuted (Q's RoPE chunk, like K's, is not permuted).

Shared-memory bytes a tile (H16): 28 KiB of fp8 + 8 KiB of RoPE in, 28 KiB of fp8 read, 56 KiB
of bf16 written, 8 KiB (RoPE, QK's A) + 64 KiB (PV's A) read: 192 KiB, the bf16 kernel's own
traffic (Q and P^T, read by both, aside), against 256 KiB for the package FP8 kernel.

What the sm90 cross-compile says (``--compile``; SASS of the tile loops, a warp): no spills; the
wgmmas take A from registers (``HGMMA.64x16x16.F32.BF16 R24, R96, gdesc``), all 8 QK groups in
flight with one wait, so the 7 chunks' A fragments (112 registers a lane) live until it; the
layout change to the dot operand is register moves only (no shuffles, no shared memory). But
the consumer issues **1,264 instructions a tile** (the bf16 kernel's: 471): 14 LDS.128 + 28
STS.128, 120 PRMT, 120 LOP3, 224 HMUL2 (two multiplies a value pair), ~220 IMAD (the shifts
and ~90 register moves: STS.128 wants a row's 8 values in 4 consecutive registers, wgmma's A
wants rows r and r + 8 interleaved). The compiler also puts a warpgroup barrier between two
stores into one shared buffer (it does not prove column slices disjoint): ``STORES`` = 3 (the
default: chunks 0-3, 4-5, 6) has 3 such barriers a tile, 7 stores have 7. Loader: 139.

**Prediction** (T = 16384, CSA top-k 512 + window 128): IF shared memory is the ceiling, about
the bf16 kernel's time, **~1.75 ms at H16 and H8** (package FP8 2.40, ``fp8_stage`` 2.28). If
instead issue binds (PERF_NOTES' line through the bf16 and package kernels, ~0.62 ns a tile per
instruction a sub-partition issues: 1,403 here against 599 for bf16), ~2.2-2.3 ms: no gain
over ``fp8_stage``. Not measured yet. The ablations say which: ``ONE_MUL`` (the two multiplies
folded into one, exact only for scales up to 2^7: 1,124 instructions) gains ~0.1 ms if issue
binds and nothing if shared memory does; ``STORES`` = 0 (no V stores, outputs wrong) removes
56 KiB of stores a tile and 143 instructions; 7 stores add 4 barriers. ``PIPE`` is the step
if the consumer's chain binds: tile t - 1's PV (32 wgmmas, one group) is issued before tile t's
loads and dequantization and waited (``wgmma.wait_group 8``; ptxas emits ``DEPBAR.LE gsb0,
0x7``, also retiring the RoPE group) before tile t's softmax, so it runs under the ~1,000
dequantization instructions instead of after them; no value is in flight across a branch or
the loop's back edge (the package's ``pipe`` variant failed that way, PERF_NOTES): tile 0 is
peeled into an ``if`` that waits its own S^T, and the last PV is issued and waited after the
loop. Cross-compiled: no spills, O^T's 64 registers untouched between issue and wait.

Shared memory: Q 16 KiB, P^T 2 KiB, two entries of [V tile 64 KiB | fp8 28 KiB | scales 512 B]:
207,872 bytes, 212,036 with the compiler's scratch (a third entry does not fit in 227 KiB; the
bf16 kernel on a 2-tile ring measured as on 3, PERF_NOTES). The RoPE's fill is 2-way
bank-conflicted (K.ROPE's rows, 4 lanes a row: a conflict-free layout would need the rows'
offsets converted through shared memory or computed twice). H <= 16 only (HEAD_GROUPS = 1,
N = 16), CSR int32 ids, any block size (``POW2`` False for one that is not a power of two), sink
optional.

``python experiments/fp8_consumer.py --compile`` (CPU): cross-compiles the kernel and its
variants for sm90 and prints registers (REG is the launch's 255; setmaxnreg gives the loader 64
and the consumer 256), spills, shared memory and each partition's SASS instructions a tile
(``PIPE``: consumer 1,309). Without arguments, on the H200 (repository root,
``PYTHONPATH=.``): times the package FP8 kernel (``gluon_ws_small_fp8``) and the bf16
``gluon_ws_small`` on the dequantized pool at T = 16384 H16 and H8, then for each variant (the
kernel, ``STORES`` = 7, ``ONE_MUL``, ``PIPE``, ``PIPE`` with ``ONE_MUL``; or those named on
the command line) checks it against the package's fp32 reference over ``fp8.dequantize(cache)``
(NaN-poisoned out, fresh random inputs, H 1/8/16, block sizes 64 and 2, absent ids, an empty
list, sink on and off, and at the H16 timed point) and, if it passes, times it (do_bench medians,
two rounds); ``STORES`` = 0 is timed only.
"""

from __future__ import annotations

import dataclasses
import sys

import fp8_stage as S  # experiments/fp8_stage.py: loader pieces, cross_compile, _launch, _check
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from sparse_mla.gluon import hopper_fp8 as K
from sparse_mla.gluon.hopper_ws import HEAD_DIM, LOG2E, M_INIT, _arrive, _opaque_zero
from sparse_mla.gluon.hopper_ws_small import (
    BLOCK_H,
    BLOCK_K,
    COL_ST,
    FREE,
    MMA_ST,
    Q_FREE,
    Q_READY,
    READY,
    ROW_ST,
    STORE,
    _shared_state,
)

RING = gl.constexpr(2)  # entries: [V tile | fp8 staging | scales]
NCHUNK = gl.constexpr(7)  # NoPE chunks of 64 dims
LOADER_REGS = gl.constexpr(64)
# One NoPE chunk [64 slots, 64 fp8 bytes] as the consumer loads it: a lane holds bytes
# [16 t, 16 t + 16) (t = lane % 4) of rows 16 warp + lane // 4 and that + 8, the rows of its
# wgmma A fragment; registers: 16 contiguous bytes (one LDS.128), then the row + 8.
LOAD_L = gl.constexpr(
    gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [8, 0]],
        lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]],
        block_bases=[],
        shape=[64, 64],
    )
)
LOAD_ROWS = gl.constexpr(gl.SliceLayout(1, LOAD_L.value))  # [64] per slot, as LOAD_L's rows
DOT_K = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA_ST.value, k_width=2))
BYTES = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))
# Q's permuted copy: [16 heads, 32 words] a chunk, 4 words a lane (4-byte cp.asyncs).
QCOPY = gl.constexpr(gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0]))


@gluon.jit
def _dequant4(x, scale):
    """4 e4m3fn bytes (``pack=4``: one register) times their bf16 ``scale`` (a power of two)
    as 4 bf16 in two bf16x2 registers: fp8_stage._dequant_words' instructions (the bits of
    ``sparse_mla.fp8.dequantize``) on uint8 elements, so the result is a bf16 tensor of x's
    shape and layout."""
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
        mul.rn.bf16x2 $1, t1, $4;
        }
        """,
        "=r,=r,r,r,r",
        [x, scale],
        dtype=gl.bfloat16,
        is_pure=True,
        pack=4,
    )


@gluon.jit
def _dequant4_1mul(x, factor):
    """Ablation ``ONE_MUL``: :func:`_dequant4` with the two multiplies folded into one by
    ``factor`` = 2^120 x scale = 2^(E - 7); the same bits while that is a bf16 (E <= 134, scales
    up to 2^7, and E = 255), not for larger scales."""
    return gl.inline_asm_elementwise(
        """
        {
        .reg .b32 z, t0, t1;
        mov.b32 z, 0;
        prmt.b32 t0, $2, z, 0x9180;
        prmt.b32 t1, $2, z, 0xB3A2;
        shl.b32 t0, t0, 4;
        shl.b32 t1, t1, 4;
        and.b32 t0, t0, 0x87F087F0;
        and.b32 t1, t1, 0x87F087F0;
        mul.rn.bf16x2 $0, t0, $3;
        mul.rn.bf16x2 $1, t1, $4;
        }
        """,
        "=r,=r,r,r,r",
        [x, factor],
        dtype=gl.bfloat16,
        is_pure=True,
        pack=4,
    )


@gluon.jit
def _k_order(y):
    """[64, 64] physical dims p = 16 t + 4 kb + 2 h + e -> logical k' = 16 kb + 8 h + 2 t + e
    (a reshape and a permute: a relabelling of registers, no data movement)."""
    y = y.reshape([BLOCK_K, 4, 4, 2, 2])  # (slot, t, kb, h, e)
    y = y.permute((0, 2, 3, 1, 4))  # (slot, kb, h, t, e)
    return y.reshape([BLOCK_K, 64])


@gluon.jit
def _copy_q_perm(q_words, q_ptr, pid_r, pid_h, stride_qr, stride_qh, num_heads):
    """cp.async token ``pid_r``'s 16 heads of Q into ``q_words`` ([16, 256] words: bf16 pairs),
    each NoPE chunk's pairs in the logical order of :func:`_k_order` (logical pair
    w = 8 kb + 4 h + t holds physical pair 8 t + 2 kb + h), the RoPE chunk as it is; heads past
    num_heads are zero-filled. 4-byte copies (the permutation leaves 2 bf16 contiguous)."""
    offs_h = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, QCOPY))
    w = gl.arange(0, 32, layout=gl.SliceLayout(0, QCOPY))
    perm = 8 * (w & 3) + 2 * (w >> 3) + ((w >> 2) & 1)
    rows = q_ptr + pid_r * stride_qr + offs_h.to(gl.int64) * stride_qh
    mask = (offs_h < num_heads)[:, None]
    for ch in gl.static_range(8):
        base = (rows + ch * 64).to(gl.pointer_type(gl.int32))
        if ch < NCHUNK:  # noqa: SIM108 (a constexpr branch: NoPE permuted, RoPE not)
            ptrs = base[:, None] + perm[None, :]
        else:
            ptrs = base[:, None] + w[None, :]
        cp.async_copy_global_to_shared(q_words.slice(ch * 32, 32, dim=1), ptrs, mask=mask)


@gluon.jit
def _issue(cache_ptr, nope_st, scl_st, tile, e, idx_ptr, pos0, hi, num_slots, block_size,
           block_shift, stride_block, POW2: gl.constexpr):  # fmt: skip
    """cp.async one tile's raw bytes into ring entry ``e``: NoPE and scales into staging, RoPE
    into the V tile's last 64 columns (fp8_stage._issue with the RoPE's destination changed;
    invalid rows copy nothing and are zero-filled)."""
    valid, row, scl = S._rows_in(idx_ptr, pos0, hi, num_slots, block_size, block_shift,
                                 stride_block, K.ROWS, POW2)  # fmt: skip
    offs_w = gl.arange(0, 16, layout=gl.SliceLayout(0, S.CHUNK_L))
    for ch in gl.static_range(NCHUNK):
        base = (cache_ptr + row + ch * 64).to(gl.pointer_type(gl.int32))
        ptrs = gl.max_contiguous(gl.multiple_of(base[:, None] + offs_w[None, :], [16, 16]), [1, 4])
        cp.async_copy_global_to_shared(nope_st.index(e * NCHUNK + ch), ptrs,
                                       mask=valid[:, None], cache_modifier=".cg")  # fmt: skip
    # RoPE: in the package's RoPE layout (K.ROPE, whose rows are K.ROWS, as above): 4 lanes x 16
    # bytes a row, so a quarter-warp's 16-byte units in the tile's last swizzle atom collide
    # 2-way (+64 wavefronts a tile). ROPE_L (8 lanes a row) would be conflict-free but needs
    # the rows in another layout: a convert_layout through shared memory (two barriers) or the
    # ids loaded again (+52 instructions a tile), each dearer than the conflict.
    offs_r = gl.arange(0, 32, layout=gl.SliceLayout(0, K.ROPE))
    rbase = (cache_ptr + row + K.NOPE).to(gl.pointer_type(gl.int32))
    rptrs = gl.max_contiguous(gl.multiple_of(rbase[:, None] + offs_r[None, :], [16, 16]), [1, 4])
    words = tile._reinterpret(gl.int32, [BLOCK_K, 256], K.WORDS)
    cp.async_copy_global_to_shared(words.slice(K.NOPE // 2, 32, dim=1), rptrs,
                                   mask=valid[:, None], cache_modifier=".cg")  # fmt: skip
    sptrs = (cache_ptr + scl).to(gl.pointer_type(gl.int32))
    cp.async_copy_global_to_shared(scl_st.index(e * 2), sptrs, mask=valid)
    cp.async_copy_global_to_shared(scl_st.index(e * 2 + 1), sptrs + 1, mask=valid)


@gluon.jit
def _issue_tile(cache_ptr, nope_st, scl_st, kv_smem, bars, n, idx_ptr, pos0, hi, num_slots,
                block_size, block_shift, stride_block, POW2: gl.constexpr):  # fmt: skip
    """The program's tile ``n``: wait for its ring entry, cp.async its bytes, and have each lane
    arrive on the entry's READY barrier (128 arrivals) once its copies land."""
    e = n % RING
    mbarrier.wait(bars.index(FREE + e), ((n // RING) & 1) ^ 1)
    _issue(cache_ptr, nope_st, scl_st, kv_smem.index(e), e, idx_ptr, pos0, hi, num_slots,
           block_size, block_shift, stride_block, POW2)  # fmt: skip
    cp.mbarrier_arrive(bars.index(READY + e), increment_count=False)


@gluon.jit
def _loader(q_ptr, cache_ptr, idx_ptr, indptr_ptr, stride_qr, stride_qh, stride_block, num_heads,
            num_slots, nnz, num_items, block_size, block_shift, q_smem, kv_smem, nope_st, scl_st,
            bars, POW2: gl.constexpr):  # fmt: skip
    """Every tile's raw bytes as ring entries free up, and each item's permuted Q after the
    item's first tile (fp8_stage._loader's order: that tile is not held behind the wait for the
    previous item's last S^T)."""
    q_words = q_smem.index(0)._reinterpret(gl.int32, [BLOCK_H, 256], K.WORDS)
    g = 0
    it = 0
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        pid_r, pid_h, lo, hi, num_tiles = K._csr_range(item, indptr_ptr, nnz, num_heads, BLOCK_H)
        if num_tiles > 0:
            _issue_tile(cache_ptr, nope_st, scl_st, kv_smem, bars, g, idx_ptr, lo, hi, num_slots,
                        block_size, block_shift, stride_block, POW2)  # fmt: skip
        mbarrier.wait(bars.index(Q_FREE), (it & 1) ^ 1)
        _copy_q_perm(q_words, q_ptr, pid_r, pid_h, stride_qr, stride_qh, num_heads)
        cp.mbarrier_arrive(bars.index(Q_READY), increment_count=False)
        for t in range(1, num_tiles):
            _issue_tile(cache_ptr, nope_st, scl_st, kv_smem, bars, g + t, idx_ptr,
                        lo + t * BLOCK_K, hi, num_slots, block_size, block_shift, stride_block,
                        POW2)  # fmt: skip
        g += num_tiles
        it += 1  # noqa: SIM113 (Gluon loops have no enumerate)
    cp.commit_group()
    cp.wait_group(0)


@gluon.jit
def _qk_chunk(s, q_tile, nope, sw, ch: gl.constexpr, ONE_MUL: gl.constexpr):
    """NoPE chunk ``ch``: fp8 bytes from staging -> bf16 y (scale byte ch % 4 of the rows' scale
    word ``sw``) -> S^T += K_ch Q_ch^T with K_ch = y from registers (async); returns y too, for
    the V tile (physical order)."""
    x = nope.load(LOAD_L)  # [64, 64] uint8
    e = (sw >> (8 * (ch % 4))) & 0xFF
    if ONE_MUL:
        bits = gl.where(e == 255, 0x7FC0, (e + 120) << 7)  # 2^(E - 7)
        factor = bits.to(gl.int16).to(gl.bfloat16, bitcast=True)
        y = _dequant4_1mul(x, factor[:, None])
    else:
        scale = (K._scale_bf16x2(e) & 0xFFFF).to(gl.int16).to(gl.bfloat16, bitcast=True)
        y = _dequant4(x, scale[:, None])  # [64 slots, 64 dims] bf16
    a = gl.convert_layout(_k_order(y), DOT_K)
    b = q_tile.slice(ch * 64, 64, dim=1).permute((1, 0))  # [64 dims (logical), 16 heads]
    s = warpgroup_mma(a, b, s, is_async=True)
    return s, y


@gluon.jit
def _cat2(y0, y1):
    """[64, 64] x 2 -> [64, 128] (y0's columns first): a relabelling of registers."""
    return gl.join(y0, y1).permute((0, 2, 1)).reshape([BLOCK_K, 128])


@gluon.jit
def _store_v(tile, y0, y1, y2, y3, y4, y5, y6, STORES: gl.constexpr):
    """The NoPE chunks' bf16 values into the V tile: ``STORES`` = 7, a store a chunk; 3, chunks
    0-3, 4-5 and 6 as one store each. The same STS.128s either way; the compiler's
    shared-memory analysis puts a warpgroup barrier between two stores to one buffer (it does
    not prove the column slices disjoint), so 3 stores mean 2 barriers a tile instead of 6.
    0 (ablation, timed only): none; PV then reads whatever the tile held."""
    if STORES == 0:
        pass  # ablation: no stores (PV reads stale NoPE; timed only, outputs wrong)
    elif STORES == 7:
        tile.slice(0, 64, dim=1).store(y0)
        tile.slice(64, 64, dim=1).store(y1)
        tile.slice(128, 64, dim=1).store(y2)
        tile.slice(192, 64, dim=1).store(y3)
        tile.slice(256, 64, dim=1).store(y4)
        tile.slice(320, 64, dim=1).store(y5)
        tile.slice(384, 64, dim=1).store(y6)
    else:
        y03 = gl.join(_cat2(y0, y1), _cat2(y2, y3)).permute((0, 2, 1)).reshape([BLOCK_K, 256])
        tile.slice(0, 256, dim=1).store(y03)
        tile.slice(256, 128, dim=1).store(_cat2(y4, y5))
        tile.slice(384, 64, dim=1).store(y6)


@gluon.jit
def _consumer(cache_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr, stride_or, stride_oh,
              num_heads, num_slots, nnz, qk_scale, num_items, q_smem, kv_smem, p_smem, nope_st,
              scl_st, bars, STORES: gl.constexpr, ONE_MUL: gl.constexpr):  # fmt: skip
    """hopper_ws_small._consumer at HEAD_GROUPS = 1 with S^T computed from the staged fp8 bytes
    (:func:`_qk_chunk`); the softmax, PV and epilogue are copied from it line for line (its
    body is one function, not pieces to import)."""
    dtype: gl.constexpr = gl.bfloat16
    heads: gl.constexpr = BLOCK_H
    g = 0
    it = 0
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        pid_r, pid_h, lo, hi, num_tiles = K._csr_range(item, indptr_ptr, nnz, num_heads, heads)
        m_i = gl.full([heads], M_INIT, gl.float32, layout=COL_ST)
        l2 = gl.zeros([BLOCK_K, heads], gl.float32, layout=MMA_ST)
        acc = gl.zeros([HEAD_DIM, heads], gl.float32, layout=MMA_ST)  # O^T
        mbarrier.wait(bars.index(Q_READY), it & 1)
        if num_tiles == 0:
            _arrive(bars.index(Q_FREE))
        for t in range(num_tiles):
            e = (g + t) % RING
            ph = ((g + t) // RING) & 1
            z = _opaque_zero(t)  # keeps the wgmma descriptors inside the loop
            tile = kv_smem.index(e + z)
            q_tile = q_smem.index(z)
            offs = lo + t * BLOCK_K + gl.arange(0, BLOCK_K, layout=ROW_ST)
            in_list = offs < hi
            slot = gl.load(idx_ptr + offs, mask=in_list, other=-1).to(gl.int64)
            valid = in_list & (slot >= 0) & (slot < num_slots)

            mbarrier.wait(bars.index(READY + e), ph)
            fence_async_shared()  # cp.async writes (RoPE, Q) before wgmma reads (async proxy)
            sw0 = scl_st.index(e * 2).load(LOAD_ROWS)
            sw1 = scl_st.index(e * 2 + 1).load(LOAD_ROWS)
            s = gl.zeros([BLOCK_K, heads], gl.float32, layout=MMA_ST)
            # RoPE first: A from the V tile, where the loader put it (not permuted, nor is
            # Q's), read before the NoPE stores touch the tile (no barrier between them).
            rope = tile.slice(K.NOPE, 64, dim=1)
            s = warpgroup_mma(rope, q_tile.slice(K.NOPE, 64, dim=1).permute((1, 0)), s,
                              use_acc=False, is_async=True)  # fmt: skip
            # The A fragments stay in registers until the wait below (112 a lane).
            s, y0 = _qk_chunk(s, q_tile, nope_st.index(e * NCHUNK + 0), sw0, 0, ONE_MUL)
            s, y1 = _qk_chunk(s, q_tile, nope_st.index(e * NCHUNK + 1), sw0, 1, ONE_MUL)
            s, y2 = _qk_chunk(s, q_tile, nope_st.index(e * NCHUNK + 2), sw0, 2, ONE_MUL)
            s, y3 = _qk_chunk(s, q_tile, nope_st.index(e * NCHUNK + 3), sw0, 3, ONE_MUL)
            s, y4 = _qk_chunk(s, q_tile, nope_st.index(e * NCHUNK + 4), sw1, 4, ONE_MUL)
            s, y5 = _qk_chunk(s, q_tile, nope_st.index(e * NCHUNK + 5), sw1, 5, ONE_MUL)
            s, y6 = _qk_chunk(s, q_tile, nope_st.index(e * NCHUNK + 6), sw1, 6, ONE_MUL)
            _store_v(tile, y0, y1, y2, y3, y4, y5, y6, STORES)
            s = warpgroup_mma_wait(0, deps=[s])
            if t + 1 == num_tiles:
                _arrive(bars.index(Q_FREE))  # done with this item's Q
            # Copied from hopper_ws_small._consumer from here to the end of the tile.
            s = gl.where(valid[:, None], s * qk_scale, float("-inf"))  # [slots, heads]
            m_new = gl.maximum(m_i, gl.max(s, 0))
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s - m_new[None, :])
            l2 = l2 * alpha[None, :] + p
            m_i = m_new
            acc = acc * alpha[None, :]
            p_smem.index(z).store(p.to(dtype))
            fence_async_shared()  # also orders the V tile's stores before PV's wgmma reads
            gl.thread_barrier()  # every warp's part of P^T and V is in before the wgmma reads it
            # Absent rows of V are zero (zero-filled bytes dequantize to 0): 0 * 0, never NaN.
            acc = warpgroup_mma(tile.permute((1, 0)), p_smem.index(z), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=[acc])
            _arrive(bars.index(FREE + e))
        g += num_tiles

        # Copied from hopper_ws_small._consumer (the epilogue).
        l_i = gl.sum(l2, 0)
        offs_h = pid_h * heads + gl.arange(0, heads, layout=COL_ST)
        sink = gl.load(sink_ptr + offs_h, mask=offs_h < num_heads, other=float("-inf")) * LOG2E
        den = l_i + gl.exp2(sink - m_i)
        inv = gl.where(l_i > 0.0, 1.0 / den, 0.0)  # a head with no valid slot gets zeros
        o = gl.convert_layout((acc * inv[None, :]).to(dtype), STORE)  # [512, heads]
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, STORE))
        offs_ho = pid_h * heads + gl.arange(0, heads, layout=gl.SliceLayout(0, STORE))
        o_ptrs = out_ptr + pid_r * stride_or + offs_ho[None, :] * stride_oh + offs_d[:, None]
        gl.store(o_ptrs, o, mask=(offs_ho < num_heads)[None, :])
        it += 1  # noqa: SIM113 (Gluon loops have no enumerate)


@gluon.jit
def _qk_tile(idx_ptr, lo, hi, num_slots, n, t, q_smem, kv_smem, nope_st, scl_st, bars,
             STORES: gl.constexpr, ONE_MUL: gl.constexpr):  # fmt: skip
    """(``PIPE``) The program's tile ``n`` (the item's ``t``): wait for it, issue its S^T
    (8 wgmma groups, in flight on return) and store its V tile, as :func:`_consumer` does;
    returns S^T (in flight) and the slots' validity."""
    e = n % RING
    z = _opaque_zero(t)  # keeps the wgmma descriptors inside the loop
    tile = kv_smem.index(e + z)
    q_tile = q_smem.index(z)
    offs = lo + t * BLOCK_K + gl.arange(0, BLOCK_K, layout=ROW_ST)
    in_list = offs < hi
    slot = gl.load(idx_ptr + offs, mask=in_list, other=-1).to(gl.int64)
    valid = in_list & (slot >= 0) & (slot < num_slots)
    mbarrier.wait(bars.index(READY + e), (n // RING) & 1)
    fence_async_shared()  # cp.async writes (RoPE, Q) before wgmma reads (async proxy)
    sw0 = scl_st.index(e * 2).load(LOAD_ROWS)
    sw1 = scl_st.index(e * 2 + 1).load(LOAD_ROWS)
    s = gl.zeros([BLOCK_K, BLOCK_H], gl.float32, layout=MMA_ST)
    rope = tile.slice(K.NOPE, 64, dim=1)
    s = warpgroup_mma(rope, q_tile.slice(K.NOPE, 64, dim=1).permute((1, 0)), s, use_acc=False,
                      is_async=True)  # fmt: skip
    s, y0 = _qk_chunk(s, q_tile, nope_st.index(e * NCHUNK + 0), sw0, 0, ONE_MUL)
    s, y1 = _qk_chunk(s, q_tile, nope_st.index(e * NCHUNK + 1), sw0, 1, ONE_MUL)
    s, y2 = _qk_chunk(s, q_tile, nope_st.index(e * NCHUNK + 2), sw0, 2, ONE_MUL)
    s, y3 = _qk_chunk(s, q_tile, nope_st.index(e * NCHUNK + 3), sw0, 3, ONE_MUL)
    s, y4 = _qk_chunk(s, q_tile, nope_st.index(e * NCHUNK + 4), sw1, 4, ONE_MUL)
    s, y5 = _qk_chunk(s, q_tile, nope_st.index(e * NCHUNK + 5), sw1, 5, ONE_MUL)
    s, y6 = _qk_chunk(s, q_tile, nope_st.index(e * NCHUNK + 6), sw1, 6, ONE_MUL)
    _store_v(tile, y0, y1, y2, y3, y4, y5, y6, STORES)
    return s, valid


@gluon.jit
def _softmax_p(s, valid, m_i, l2, acc, qk_scale, p_tile):
    """(``PIPE``) hopper_ws_small._consumer's softmax step (copied): S^T -> P^T into
    ``p_tile``, the running max, the denominators and O^T rescaled; then the fence and barrier
    that let wgmma read P^T and the V tile."""
    s = gl.where(valid[:, None], s * qk_scale, float("-inf"))  # [slots, heads]
    m_new = gl.maximum(m_i, gl.max(s, 0))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - m_new[None, :])
    l2 = l2 * alpha[None, :] + p
    acc = acc * alpha[None, :]
    p_tile.store(p.to(gl.bfloat16))
    fence_async_shared()  # also orders the V tile's stores before PV's wgmma reads
    gl.thread_barrier()  # every warp's part of P^T and V is in before the wgmma reads it
    return m_new, l2, acc


@gluon.jit
def _consumer_pipe(cache_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr, stride_or, stride_oh,
                   num_heads, num_slots, nnz, qk_scale, num_items, q_smem, kv_smem, p_smem,
                   nope_st, scl_st, bars, STORES: gl.constexpr, ONE_MUL: gl.constexpr):  # fmt: skip
    """``PIPE``: :func:`_consumer` with tile t - 1's PV issued before tile t's loads and
    dequantization, so the tensor cores run it while the consumer issues them; waited (the
    oldest of 9 groups) before tile t's softmax. Nothing is in flight across a branch or the
    loop's back edge: tile 0 is peeled off (its S^T waited inside its ``if``) and the last PV
    issued and waited after the loop. Registers: O^T (64) in flight beside the A fragments."""
    heads: gl.constexpr = BLOCK_H
    g = 0
    it = 0
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        pid_r, pid_h, lo, hi, num_tiles = K._csr_range(item, indptr_ptr, nnz, num_heads, heads)
        m_i = gl.full([heads], M_INIT, gl.float32, layout=COL_ST)
        l2 = gl.zeros([BLOCK_K, heads], gl.float32, layout=MMA_ST)
        acc = gl.zeros([HEAD_DIM, heads], gl.float32, layout=MMA_ST)  # O^T
        mbarrier.wait(bars.index(Q_READY), it & 1)
        if num_tiles == 0:
            _arrive(bars.index(Q_FREE))
        if num_tiles > 0:
            s, valid = _qk_tile(idx_ptr, lo, hi, num_slots, g, 0, q_smem, kv_smem, nope_st,
                                scl_st, bars, STORES, ONE_MUL)  # fmt: skip
            s = warpgroup_mma_wait(0, deps=[s])
            if num_tiles == 1:
                _arrive(bars.index(Q_FREE))  # done with this item's Q
            m_i, l2, acc = _softmax_p(s, valid, m_i, l2, acc, qk_scale, p_smem.index(0))
        for t in range(1, num_tiles):
            z = _opaque_zero(t)
            prev = (g + t - 1) % RING
            # PV of tile t - 1 (its P^T and V are in): one group, the oldest of the next 9.
            acc = warpgroup_mma(kv_smem.index(prev + z).permute((1, 0)), p_smem.index(z), acc,
                                is_async=True)  # fmt: skip
            s, valid = _qk_tile(idx_ptr, lo, hi, num_slots, g + t, t, q_smem, kv_smem, nope_st,
                                scl_st, bars, STORES, ONE_MUL)  # fmt: skip
            acc = warpgroup_mma_wait(8, deps=[acc])  # the PV; S^T's 8 groups may still run
            _arrive(bars.index(FREE + prev))
            s = warpgroup_mma_wait(0, deps=[s])
            if t + 1 == num_tiles:
                _arrive(bars.index(Q_FREE))  # done with this item's Q
            m_i, l2, acc = _softmax_p(s, valid, m_i, l2, acc, qk_scale, p_smem.index(z))
        if num_tiles > 0:
            z = _opaque_zero(num_tiles)
            last = (g + num_tiles - 1) % RING
            acc = warpgroup_mma(kv_smem.index(last + z).permute((1, 0)), p_smem.index(z), acc,
                                is_async=True)  # fmt: skip
            acc = warpgroup_mma_wait(0, deps=[acc])
            _arrive(bars.index(FREE + last))
        g += num_tiles

        # Copied from hopper_ws_small._consumer (the epilogue).
        l_i = gl.sum(l2, 0)
        offs_h = pid_h * heads + gl.arange(0, heads, layout=COL_ST)
        sink = gl.load(sink_ptr + offs_h, mask=offs_h < num_heads, other=float("-inf")) * LOG2E
        den = l_i + gl.exp2(sink - m_i)
        inv = gl.where(l_i > 0.0, 1.0 / den, 0.0)  # a head with no valid slot gets zeros
        o = gl.convert_layout((acc * inv[None, :]).to(gl.bfloat16), STORE)  # [512, heads]
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, STORE))
        offs_ho = pid_h * heads + gl.arange(0, heads, layout=gl.SliceLayout(0, STORE))
        o_ptrs = out_ptr + pid_r * stride_or + offs_ho[None, :] * stride_oh + offs_d[:, None]
        gl.store(o_ptrs, o, mask=(offs_ho < num_heads)[None, :])
        it += 1  # noqa: SIM113 (Gluon loops have no enumerate)


@gluon.jit
def _consumer_any(cache_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr, stride_or, stride_oh,
                  num_heads, num_slots, nnz, qk_scale, num_items, q_smem, kv_smem, p_smem,
                  nope_st, scl_st, bars, STORES: gl.constexpr, ONE_MUL: gl.constexpr,
                  PIPE: gl.constexpr):  # fmt: skip
    if PIPE:
        _consumer_pipe(cache_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr, stride_or, stride_oh,
                       num_heads, num_slots, nnz, qk_scale, num_items, q_smem, kv_smem, p_smem,
                       nope_st, scl_st, bars, STORES, ONE_MUL)  # fmt: skip
    else:
        _consumer(cache_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr, stride_or, stride_oh,
                  num_heads, num_slots, nnz, qk_scale, num_items, q_smem, kv_smem, p_smem,
                  nope_st, scl_st, bars, STORES, ONE_MUL)  # fmt: skip


@gluon.jit(do_not_specialize=["nnz"])
def k_consumer(
    q_ptr, cache_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr, stride_qr, stride_qh,
    stride_block, stride_or, stride_oh, num_heads, num_slots, nnz, qk_scale, num_items,
    block_size, block_shift, POW2: gl.constexpr = True, STORES: gl.constexpr = 3,
    ONE_MUL: gl.constexpr = False, PIPE: gl.constexpr = False,
):  # fmt: skip
    """The kernel (CSR lists, H <= 16; fp8_stage.k_stage's arguments, so its launcher serves):
    consumer (default partition, 4 warps) and loader (4 warps). Persistent grid
    (min(items, SMs),), num_warps=4."""
    # Q, the 2 V tiles, P^T and the barriers as the package's small kernel lays them out;
    # READY counts the loader's 128 lanes (cp.async arrivals).
    q_smem, kv_smem, p_smem, bars = _shared_state(gl.bfloat16, 1, RING, 128)
    nope_st = gl.allocate_shared_memory(gl.uint8, [RING * NCHUNK, BLOCK_K, 64], BYTES)
    scl_st = gl.allocate_shared_memory(gl.int32, [RING * 2, BLOCK_K], S.STAGED1)
    nope_w = nope_st._reinterpret(gl.int32, [RING * NCHUNK, BLOCK_K, 16], BYTES)  # the loader's
    gl.warp_specialize(
        [
        (_consumer_any, (
            cache_ptr, idx_ptr, indptr_ptr, sink_ptr, out_ptr, stride_or, stride_oh, num_heads,
            num_slots, nnz, qk_scale, num_items, q_smem, kv_smem, p_smem, nope_st, scl_st, bars,
            STORES, ONE_MUL, PIPE,
        )),
        (_loader, (
            q_ptr, cache_ptr, idx_ptr, indptr_ptr, stride_qr, stride_qh, stride_block, num_heads,
            num_slots, nnz, num_items, block_size, block_shift, q_smem, kv_smem, nope_w, scl_st,
            bars, POW2,
        )),
        ],
        [4],
        [LOADER_REGS],
    )  # fmt: skip


def run(w, cache, out, **constexprs):
    """Launch :func:`k_consumer` (``constexprs``: STORES, ONE_MUL) on workload ``w`` (bf16 q
    [T, H <= 16, 512]) and FP8 cache ``cache``, writing ``out``."""
    assert w.q.shape[1] <= BLOCK_H.value, "H <= 16 only (HEAD_GROUPS = 1)"
    bs = cache.block_size
    return S._launch(k_consumer, w, cache, out, POW2=(bs & (bs - 1)) == 0, **constexprs)


# Checked and timed: the kernel (the V tile's NoPE in 3 stores), the same with 7 stores (6
# compiler barriers a tile instead of 2), with the one-multiply dequantization (exact for
# scales up to 2^7, which the random checks' caches have: ~140 fewer instructions a tile), and
# pipelined (PIPE).
VARIANTS = {
    "fp8_consumer": {},
    "fp8_consumer_st7": {"STORES": 7},
    "fp8_consumer_1mul": {"ONE_MUL": True},
    # Tile t - 1's PV issued before tile t's dequantization (overlapped with it).
    "fp8_consumer_pipe": {"PIPE": True},
    "fp8_consumer_pipe_1mul": {"PIPE": True, "ONE_MUL": True},
}
# Timed only (outputs wrong): no V-tile stores, the kernel minus 56 KiB of shared-memory
# stores and their instructions.
ABLATIONS = {"fp8_consumer_nostore": {"STORES": 0}}


def _cases(device="cuda"):
    """The checks' workloads: (label, workload, cache, dequantized pool). Fresh random inputs
    (distinct seeds), H 1/8/16, block sizes 64 and 2, absent ids (-1, past the cache) with an
    empty list, sink on and off."""
    from sparse_mla import fp8 as F
    from sparse_mla import workloads as W

    cases = [  # (T, H, topk, seed, edge, sink)
        (37, 16, 100, 11, False, True), (300, 8, 700, 12, False, False),
        (64, 1, 64, 13, False, True), (45, 16, 80, 14, True, True),
        (45, 16, 80, 15, True, False), (2048, 16, 512, 16, False, True),
    ]  # fmt: skip
    for T, H, topk, seed, edge, sink in cases:
        w = W.dsv4_csa(T, H, topk=topk, device=device, seed=seed, sink=sink)
        for bs in (64, 2):
            cache = F.quantize(w.kv.reshape(w.kv.shape[0], -1), bs)
            wc = w
            if edge:
                idx = w.kv_indices.clone()
                idx[::7] = -1
                idx[3::11] = cache.num_slots + 5
                ptr = w.kv_indptr.clone()
                ptr[5] = ptr[4]  # token 4's list is empty (the tokens after it shift)
                wc = dataclasses.replace(w, kv_indices=idx, kv_indptr=ptr)
            label = f"T={T} H={H} topk={topk} bs={bs} edge={edge} sink={sink}"
            yield label, wc, cache, F.dequantize(cache)


def _check_variant(name, cx, w, cache, deq, label):
    """One check with NaN-poisoned out; a raised error (compile, launch) counts as a failure."""
    try:
        good, rep = S._check(name, lambda o: run(w, cache, o, **cx), w, deq)
    except Exception as exc:
        good, rep = False, f"raised {type(exc).__name__}: {exc}"
    print(f"check {name} {label}: {'ok' if good else 'FAIL'} {rep}", flush=True)
    return good


def main(names) -> int:
    """The package FP8 and bf16 kernels timed at the timed points, then each variant in
    ``names`` in turn: its checks, then its times. A variant that fails a check is not timed;
    one that faults the GPU ends the run (run the others by name: ``python
    experiments/fp8_consumer.py NAME ...``). Ablations are timed only."""
    import torch
    import triton

    from sparse_mla import fp8 as F
    from sparse_mla import sparse_mla_prefill
    from sparse_mla import workloads as W
    from sparse_mla.gluon.launch_fp8 import FP8SmallConfig

    torch.manual_seed(0)
    cfg = FP8SmallConfig()  # the package's default FP8 launch
    points = []
    for T, H in [(16384, 16), (16384, 8)]:  # CSA top-k 512 + window 128
        w = W.dsv4_csa(T, H, topk=512, device="cuda", seed=1)
        cache = F.quantize(w.kv.reshape(w.kv.shape[0], -1), 64)
        points.append((T, H, w, cache, F.dequantize(cache), torch.empty_like(w.q)))
    rows, failed = [], []

    def time_it(name, fn, T, H):
        for rnd in range(2):  # two rounds: the spread between them is the noise
            fn()
            torch.cuda.synchronize()
            ms = triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")
            rows.append((T, H, name, ms))
            print(f"time T={T} H={H} {name} round{rnd}: {ms:.4f} ms", flush=True)

    for T, H, w, cache, deq, out in points:  # the package's kernels, once
        kw = {"attn_sink": w.attn_sink, "out": out}
        args = (w.q, cache, w.kv_indices, w.kv_indptr, w.softmax_scale)
        time_it("gluon_ws_small_fp8", lambda a=args, k=kw: sparse_mla_prefill(*a, config=cfg, **k),
                T, H)  # fmt: skip
        # config=None on the dequantized bf16 pool: gluon_ws_small at H <= 16.
        args = (w.q, deq, w.kv_indices, w.kv_indptr, w.softmax_scale)
        time_it("bf16_gluon_ws_small", lambda a=args, k=kw: sparse_mla_prefill(*a, **k), T, H)
    for name in names:
        cx = {**VARIANTS, **ABLATIONS}[name]
        if name in VARIANTS:
            good = all([_check_variant(name, cx, *c[1:], c[0]) for c in _cases()])
            for T, H, w, cache, deq, _ in points[:1]:  # the H16 one (the fp32 reference is slow)
                good &= _check_variant(name, cx, w, cache, deq, f"(timed point) T={T} H={H}")
            if not good:
                failed.append(name)
                print(f"{name}: a check FAILED, not timed", flush=True)
                continue
        for T, H, w, cache, _, out in points:
            time_it(name, lambda w=w, c=cache, o=out, cx=cx: run(w, c, o, **cx), T, H)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}")  # fmt: skip
    print("| T | H | kernel | ms (round 0 / 1) |\n| --- | --- | --- | --- |")
    for key in dict.fromkeys((t, h, n) for t, h, n, _ in rows):
        ms = [m for t, h, n, m in rows if (t, h, n) == key]
        print(f"| {key[0]} | {key[1]} | {key[2]} | {' / '.join(f'{m:.3f}' for m in ms)} |")
    print("checks:", f"FAILED: {', '.join(failed)}" if failed else "ALL OK")
    return 1 if failed else 0


def _tile_loops(sass):
    """The innermost SASS loops (a back edge) that issue wgmmas (the consumer's tile loop) or
    cp.asyncs (the loader's): (name, instructions a warp a tile, a count of the notable ones)."""
    import re
    from collections import Counter

    ins = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = []
    for addr, text in ins:
        m = re.search(r"BRA (0x[0-9a-f]+)", text)
        if not (m and int(m.group(1), 16) < addr):
            continue
        body = [t for a, t in ins if int(m.group(1), 16) <= a <= addr]
        ops = Counter(t.split()[1 if t.startswith("@") else 0].split(".")[0] for t in body)
        ops["LDS"] = sum("LDS" in t and "@!PT" not in t for t in body)  # not the padding
        name = "consumer" if ops["HGMMA"] else "loader" if ops["LDGSTS"] else None
        if name:
            loops.append((len(body), name, ops))
    out = []
    for name in ("consumer", "loader"):
        n, _, ops = min((x for x in loops if x[1] == name), default=(0, name, Counter()))
        keys = ("HGMMA", "LDGSTS", "LDS", "STS", "BAR", "HMUL2", "PRMT", "LOP3", "IMAD")
        out.append(f"{name} {n} a tile (" + ", ".join(f"{k} {ops[k]}" for k in keys) + ")")
    return "; ".join(out)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--compile":
        # CPU: cross-compile for sm90 (registers, spills, shared memory).
        for cx in ({"POW2": True}, {"POW2": False}, {"STORES": 7}, {"ONE_MUL": True},
                   {"STORES": 0}, {"PIPE": True}, {"PIPE": True, "ONE_MUL": True}):  # fmt: skip
            c, usage, sass = S.cross_compile(k_consumer, **cx)
            spills = f"STL {sass.count('STL')} LDL {sass.count('LDL')}"
            print("k_consumer", cx, " ".join(usage.split()[:4]), "dynamic shared",
                  c.metadata.shared, spills)  # fmt: skip
            print("  SASS instructions a warp:", _tile_loops(sass))
        sys.exit(0)
    # GPU: the variants named (default: all, the kernel first).
    sys.exit(main(sys.argv[1:] or [*VARIANTS, *ABLATIONS]))
