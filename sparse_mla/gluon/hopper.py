"""Hopper (sm90) pieces of the Gluon MLA kernel: mma.sync (MMA v2) layouts, cp.async gathers.

The shared algorithm (``algorithm.py``) calls these through ``ARCH == "hopper"``: the
``gluon_mma`` kernel, which serves decode and sm80-sm89. For the sm90 prefill ``config=None``
runs ``gluon_ws_small`` (``hopper_ws_small.py``) or ``gluon_ws`` (``hopper_ws.py``), with
``gluon_wgmma`` (``hopper_prefill.py``) and ``gluon_mma`` as fallbacks only
(``sparse_mla.dispatch.RULE``); each is its own registry entry (``launch.KERNELS``).
- MMA: ``mma.sync.m16n8k16`` bf16/fp16 with fp32 accumulation (``NVMMADistributedLayout``
  version [2, 0]); operands come from shared memory through ``ldmatrix`` (``k_width=2``).
- Gather: ``cp.async`` 16-byte copies per lane into shared memory, 64-bit addressing; a masked
  lane copies 0 bytes and zero-fills.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

WARP_SIZE = 32
K_WIDTH = 2
BUFFER_MAX_BYTES = 0  # no buffer loads on NVIDIA


def mma_layout(warps: list[int]) -> gl.NVMMADistributedLayout:
    """[M, N] accumulator layout of mma.sync m16n8, ``warps`` = [warps_m, warps_n]."""
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=list(warps), instr_shape=[16, 8])


def shared_layout() -> gl.SwizzledSharedLayout:
    # 16-byte vectors XOR-swizzled over 8 phases: conflict-free ldmatrix on 1 KiB rows.
    return gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])


@gluon.jit
def gather_rows(smem, base_ptr, row_off, valid, offs_c, USE_BUFFER: gl.constexpr):
    """Async copy rows ``row_off`` (int64 element offsets, [R]) x columns ``offs_c`` into smem."""
    ptrs = base_ptr + row_off[:, None] + offs_c[None, :]  # [R, C]
    # Rows start 16-byte aligned (checked on the host): 16-byte cp.async per lane.
    ptrs = gl.max_contiguous(gl.multiple_of(ptrs, [16, 16]), [1, 8])
    cp.async_copy_global_to_shared(smem, ptrs, mask=valid[:, None])


@gluon.jit
def commit():
    cp.commit_group()


@gluon.jit
def wait(num_outstanding: gl.constexpr):
    cp.wait_group(num_outstanding)


@gluon.jit
def mma(a, b, acc):
    return mma_v2(a, b, acc)
