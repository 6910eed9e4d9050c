"""A variant of gluon_ws_small_fp8's producer loads, to measure on the H200 (not measured yet).

The hypothesis (docs/PERF_NOTES.md, the FP8 cache on Hopper): the package's producer issues 16
global-memory requests a slot (7 NoPE chunks of 64 bytes, 2 RoPE halves, 7 one-byte scales),
each warp instruction touching 8 rows, twice the bf16 gather's 8 requests of 128 bytes (4 rows
a warp instruction); at the measured tile rate the FP8 kernel already issues ~1.5x the bf16
kernel's requests a cycle, so requests, not bytes, would be its limit. This variant reads a
slot in 6: the row's first 512 bytes as four 128-byte segments (8 lanes x 16 bytes a row, 4
rows a warp instruction, as the bf16 gather), its last 64 bytes (the RoPE tail) with 8-byte
lanes, and the 7 scale bytes as one 8-byte load. Segments 0-2 are NoPE chunks 0-5; segment 3
is chunk 6 and the first half of RoPE, split in registers. Predicted, if requests bind:
T = 16384 H16 from 2.34-2.40 ms to ~1.1-1.4 ms.

``install()`` replaces ``_rows``, ``_load_rows`` and ``_store_tile`` in
:mod:`sparse_mla.gluon.hopper_fp8` before its kernel first compiles (a process of its own:
the JIT keys on the functions it finds then); ``python experiments/fp8_seg128.py`` on the GPU
checks the variant against the fp32 reference and times it beside the package's loads, one
process each (data/bench once measured).
"""

from __future__ import annotations

import os
import subprocess
import sys

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from sparse_mla.gluon import hopper_fp8 as K

# [64 rows, 2 segments, 2 halves, 16 words] (segments 0-1: NoPE chunks 0-3): a lane holds 4
# words (16 bytes) of each half of each segment of its rows; 8 lanes cover a 128-byte segment
# of a row, 4 rows a warp.
SEG = gl.constexpr(gl.BlockedLayout([1, 1, 1, 4], [4, 1, 2, 4], [4, 1, 1, 1], [3, 2, 1, 0]))
# One segment [64, 2 halves, 16 words], the same lanes: segment 2 (chunks 4-5) and segment 3
# (chunk 6 | RoPE words 0-15).
SEG3 = gl.constexpr(gl.BlockedLayout([1, 1, 4], [4, 2, 4], [4, 1, 1], [2, 1, 0]))
# Half a segment [64, 16 words] (NoPE chunk 6, RoPE words 0-15): 4 lanes x 16 bytes a row,
# lanes 4-7 of a row's 8 duplicating 0-3, so the rows stay those of SEG.
HALFSEG = gl.constexpr(gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0]))
# The RoPE tail [64, 16 words]: 8 lanes x 2 words (8 bytes) a row, the same rows.
TAIL = gl.constexpr(gl.BlockedLayout([1, 2], [4, 8], [4, 1], [1, 0]))
SEG_ROWS = gl.constexpr(gl.SliceLayout(1, TAIL.value))


@gluon.jit
def _rows(idx_ptr, pos0, hi, num_slots, block_size, block_shift, stride_block, POW2: gl.constexpr):
    """As hopper_fp8._rows, in the rows layout of SEG / SEG3 / TAIL (4 rows a lane)."""
    offs = pos0 + gl.arange(0, K.BLOCK_K, layout=SEG_ROWS)
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
def _load_seg(cache_ptr, valid, row, byte0):
    """One 128-byte segment of the rows from byte ``byte0``: words [64, 2, 16]."""
    rows3: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, SEG3))
    r3 = gl.convert_layout(row, rows3)
    ok3 = gl.convert_layout(valid, rows3)
    offs_h = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, SEG3)))
    offs_w = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, SEG3)))
    w3 = (cache_ptr + r3 + byte0).to(gl.pointer_type(gl.int32))
    p3 = w3[:, None, None] + (offs_h * 16)[None, :, None] + offs_w[None, None, :]
    p3 = gl.max_contiguous(gl.multiple_of(p3, [16, 16, 16]), [1, 1, 4])
    return gl.load(p3, mask=ok3[:, None, None], other=0)


@gluon.jit
def _load_half(cache_ptr, valid, row, byte0):
    """64 bytes of the rows from ``byte0``: words [64, 16] in HALFSEG."""
    rows2: gl.constexpr = gl.SliceLayout(1, HALFSEG)
    r2 = gl.convert_layout(row, rows2)
    ok2 = gl.convert_layout(valid, rows2)
    offs_w = gl.arange(0, 16, layout=gl.SliceLayout(0, HALFSEG))
    w2 = (cache_ptr + r2 + byte0).to(gl.pointer_type(gl.int32))
    p2 = gl.max_contiguous(gl.multiple_of(w2[:, None] + offs_w[None, :], [16, 16]), [1, 4])
    return gl.load(p2, mask=ok2[:, None], other=0)


@gluon.jit
def _load_rows(cache_ptr, valid, row, scl):
    """Segments 0-1 [64, 2, 2, 16] words, segments 2 and 3 [64, 2, 16], the RoPE tail
    [64, 16], the 8 scale bytes as one int64 a row (the 8th is padding); one slot unused."""
    rows4: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, SEG)))
    r4 = gl.convert_layout(row, rows4)
    ok4 = gl.convert_layout(valid, rows4)
    offs_s = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, SEG))))
    offs_h = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, SEG))))
    offs_w = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, SEG))))
    words = (cache_ptr + r4).to(gl.pointer_type(gl.int32))
    p = (words[:, None, None, None] + (offs_s * 32)[None, :, None, None]
         + (offs_h * 16)[None, None, :, None] + offs_w[None, None, None, :])  # fmt: skip
    p = gl.max_contiguous(gl.multiple_of(p, [16, 16, 16, 16]), [1, 1, 1, 4])
    x01 = gl.load(p, mask=ok4[:, None, None, None], other=0)
    x2 = _load_seg(cache_ptr, valid, row, 256)
    x6 = _load_half(cache_ptr, valid, row, 384)  # NoPE chunk 6
    r0 = _load_half(cache_ptr, valid, row, 448)  # RoPE words 0-15
    offs_t = gl.arange(0, 16, layout=gl.SliceLayout(0, TAIL))
    wt = (cache_ptr + row + 512).to(gl.pointer_type(gl.int32))
    pt = gl.max_contiguous(gl.multiple_of(wt[:, None] + offs_t[None, :], [16, 8]), [1, 2])
    tail = gl.load(pt, mask=valid[:, None], other=0)
    sp = gl.multiple_of((cache_ptr + scl).to(gl.pointer_type(gl.int64)), [8])
    scales = gl.load(sp, mask=valid, other=0)
    zero = gl.zeros([K.BLOCK_K], gl.int32, layout=SEG_ROWS)
    return x01, x2, x6, r0, tail, scales, zero


@gluon.jit
def _scale_of(scales, chunk):
    """bf16x2 words of the scale of NoPE chunk ``chunk`` (broadcast shapes) from the rows'
    8 scale bytes (int64)."""
    e = ((scales >> (chunk * 8).to(gl.int64)) & 0xFF).to(gl.int32)
    return K._scale_bf16x2(e)


@gluon.jit
def _store_seg(words, x, scales, chunk0: gl.constexpr):
    """Dequantize one segment (NoPE chunks chunk0, chunk0 + 1) into its 64 words."""
    rows3: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, SEG3))
    s3 = gl.convert_layout(scales, rows3)
    offs_h = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, SEG3)))
    sc = _scale_of(s3[:, None], chunk0 + offs_h[None, :])  # [64, 2]
    lo, hi = K._dequant_words(x, sc[:, :, None])
    words.slice(chunk0 * 32, 64, dim=1).store(gl.join(lo, hi).reshape([K.BLOCK_K, 64]))


@gluon.jit
def _store_tile(tile, x01, x2, x6, r0, tail, scales, unused):
    """Dequantize NoPE into the tile's words 0-223, RoPE into 224-255."""
    words = tile._reinterpret(gl.int32, [K.BLOCK_K, 256], K.WORDS)
    rows4: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, SEG)))
    s4 = gl.convert_layout(scales, rows4)
    offs_s = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, SEG))))
    offs_h = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, SEG))))
    chunk = (2 * offs_s)[None, :, None] + offs_h[None, None, :]  # [1, 2, 2]
    sc = _scale_of(s4[:, None, None], chunk)  # [64, 2, 2]
    lo, hi = K._dequant_words(x01, sc[:, :, :, None])
    words.slice(0, 128, dim=1).store(gl.join(lo, hi).reshape([K.BLOCK_K, 128]))
    _store_seg(words, x2, scales, 4)
    s6 = gl.convert_layout(scales, gl.SliceLayout(1, HALFSEG))
    sc6 = K._scale_bf16x2(((s6 >> 48) & 0xFF).to(gl.int32))  # chunk 6: byte 6
    lo6, hi6 = K._dequant_words(x6, sc6[:, None])
    words.slice(192, 32, dim=1).store(gl.join(lo6, hi6).reshape([K.BLOCK_K, 32]))
    words.slice(224, 16, dim=1).store(r0)
    words.slice(240, 16, dim=1).store(tail)


def install() -> None:
    """Swap the variant's functions into hopper_fp8 (before its kernel first compiles)."""
    K._rows = _rows
    K._load_rows = _load_rows
    K._store_tile = _store_tile


def _child(variant: str) -> None:
    if variant == "seg128":
        install()
    import torch
    import triton

    from sparse_mla import fp8 as F
    from sparse_mla import sparse_mla_prefill
    from sparse_mla import workloads as W
    from sparse_mla.gluon.launch_fp8 import FP8SmallConfig
    from sparse_mla.reference import check_against_reference

    for T, H in [(16384, 16), (16384, 8), (1024, 16), (64, 16)]:  # one head group
        w = W.dsv4_csa(T, H, topk=512, device="cuda", seed=1)
        cache = F.quantize(w.kv.reshape(w.kv.shape[0], -1), 64)
        deq = F.dequantize(cache)

        # 152 registers: the variant's producer spills at the package's default 128 (4 rows a
        # lane); the package's loads are timed at both.
        for regs in (128, 152) if variant == "package" else (152,):
            cfg = FP8SmallConfig(PRODUCER_REGS=regs)

            def run(w=w, cache=cache, cfg=cfg):
                return sparse_mla_prefill(w.q, cache, w.kv_indices, w.kv_indptr, w.softmax_scale,
                                          attn_sink=w.attn_sink, config=cfg)  # fmt: skip

            rep = check_against_reference(run(), w.q, deq, w.kv_indices, w.kv_indptr,
                                          w.softmax_scale, attn_sink=w.attn_sink)  # fmt: skip
            ms = triton.testing.do_bench(run, warmup=25, rep=200)
            print(f"{variant} r{regs} T={T} H={H} {ms:.4f} ms ok={rep.ok}", flush=True)
            torch.cuda.synchronize()


if __name__ == "__main__":
    if len(sys.argv) == 2:
        _child(sys.argv[1])
    else:
        env = dict(os.environ, PYTHONPATH=os.getcwd())
        for v in ("package", "seg128", "package", "seg128"):
            subprocess.run([sys.executable, __file__, v], env=env, check=False)
