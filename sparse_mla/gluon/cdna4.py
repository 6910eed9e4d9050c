"""CDNA4 (gfx950) pieces of the Gluon MLA kernel: MFMA layouts, buffer loads into LDS, wave64.

The shared algorithm (``algorithm.py``) calls these through ``ARCH == "cdna4"``; everything that
knows about AMD hardware lives here.
- MMA: ``v_mfma_f32_16x16x32_bf16`` through ``AMDMFMALayout(version=4)``; operands in registers
  with ``k_width=8`` (eight 16-bit values per lane, the instruction's K slice).
- Gather: ``buffer_load ... lds`` (direct-to-LDS) with 32-bit offsets when the pool spans less
  than 2 GiB; otherwise ``global_load_lds`` with 64-bit pointers (``USE_BUFFER=False``).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.amd.cdna4 import async_copy as acp

WARP_SIZE = 64
K_WIDTH = 8
# Buffer-load offsets are 32-bit: the pool's byte span must stay below 2^31.
BUFFER_MAX_BYTES = 2**31 - 1


def mma_layout(warps: list[int]) -> gl.AMDMFMALayout:
    """[M, N] accumulator layout of one 16x16x32 MFMA per tile, ``warps`` = [warps_m, warps_n]."""
    return gl.amd.AMDMFMALayout(
        version=4, instr_shape=[16, 16, 32], transposed=True, warps_per_cta=list(warps)
    )


def shared_layout() -> gl.SwizzledSharedLayout:
    # Each wave writes whole 512-wide rows; the XOR swizzle stays inside a row (a wave).
    return gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])


@gluon.jit
def gather_rows(smem, base_ptr, row_off, valid, offs_c, USE_BUFFER: gl.constexpr):
    """Async copy rows ``row_off`` (int64 element offsets, [R]) x columns ``offs_c`` into smem."""
    if USE_BUFFER:
        # Invalid rows keep offset 0 under a false mask: never read, zero-filled.
        off32 = gl.where(valid, row_off, 0).to(gl.int32)
        offs = off32[:, None] + offs_c[None, :]  # [R, C] int32
        # Rows start 16-byte aligned (checked on the host): 16-byte loads per lane.
        offs = gl.max_contiguous(gl.multiple_of(offs, [8, 8]), [1, 8])
        acp.buffer_load_to_shared(smem, base_ptr, offs, mask=valid[:, None])
    else:
        ptrs = base_ptr + row_off[:, None] + offs_c[None, :]  # [R, C] int64 addressing
        ptrs = gl.max_contiguous(gl.multiple_of(ptrs, [16, 16]), [1, 8])
        acp.global_load_to_shared(smem, ptrs, mask=valid[:, None], other=0.0)


@gluon.jit
def commit():
    acp.commit_group()


@gluon.jit
def wait(num_outstanding: gl.constexpr):
    acp.wait_group(num_outstanding)


@gluon.jit
def mma(a, b, acc):
    return gl.amd.cdna4.mfma(a, b, acc)
